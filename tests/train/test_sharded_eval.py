"""The trainer's validation loss on a mesh, through the parallelized eval step (``hpfunc.value`` under the
run's plan): equal to one process's loss on the gathered parameters (rtol 1e-5), and by storage liveness
no rank ever holds the whole model: one gathered parameter group at a time beyond its shards and the
activations (the gathered-copy evaluation it replaces holds every parameter at once)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multirank


def _peak_new_bytes(fn):
    """``(result, peak bytes of storages created by fn and alive at once)``, on storage liveness."""
    from hpfunc.memory._storage import ProducerMode, StorageLog, live_total

    class Peak(ProducerMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            Peak.peak = max(Peak.peak, sum(n for _, n, *_ in self.log.alive()))
            return out

    log = StorageLog()
    with Peak(log):
        out = fn()
    del log
    return out, Peak.peak


def eval_in_rank(mesh_shape: dict, plan: list) -> dict:
    import torch

    import hpfunc
    from hpfunc import random
    from hpfunc.train.build import build_model_config, build_optimizer, build_schedule
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.distributed import build_eval_step, build_parallel_step
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step import make_eval_step

    cfg = load_config_dict({"model": {"preset": "qwen3-moe-tiny", "num_hidden_layers": 4},
                            "train": {"batch_size": 4, "seq_len": 8},
                            "parallel": {"mesh": mesh_shape, "plan": plan}})
    model_cfg = build_model_config(cfg.model)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps))
    mesh = hpfunc.Mesh(mesh_shape)
    state, train_step = build_parallel_step(cfg, model_cfg, optimizer, lr, random.key(0), mesh, torch.float32)
    sharded = build_eval_step(cfg, model_cfg, mesh)
    tokens = torch.randint(0, model_cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
    sharded(state, batch)  # the first call lowers the step (its one-off bookkeeping is not the evaluation's)
    (_, out), sharded_peak = _peak_new_bytes(lambda: sharded(state, batch))
    full, full_peak = _peak_new_bytes(lambda: train_step.full_params(state.params))
    single = make_eval_step(model_cfg, loss_fn=model_spec(cfg.model).loss)
    ref, act_peak = _peak_new_bytes(lambda: single(full, batch))
    leaves = hpfunc.tree.leaves_with_paths(full)
    groups: dict[str, int] = {}
    for path, x in leaves:  # FSDP's gather groups: a layer (layers.N), or a top-level parameter alone
        key = ".".join(path.split(".")[:2]) if path.startswith("layers.") else path
        groups[key] = groups.get(key, 0) + x.numel() * x.element_size()
    return {"loss": float(out["ce_loss"]), "ref": float(ref), "sharded_peak": sharded_peak, "full_peak": full_peak,
            "act_peak": act_peak, "model_bytes": sum(groups.values()), "largest_group": max(groups.values())}


@pytest.mark.parametrize("mesh_shape,plan", [({"fsdp": 4}, ["fsdp"]), ({"fsdp": 2, "tp": 2}, ["fsdp", "tp"])])
def test_sharded_eval_equals_one_process_and_holds_one_layer(pool4, mesh_shape, plan):
    for r in pool4.run(eval_in_rank, mesh_shape, plan):
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5), r
        # the gathered copy holds the whole model; the sharded evaluation one group at a time beyond the
        # activations of the forward (measured on one process) and the shards it already had: the packed
        # all-gather buffer and its unpacked copy are alive together while a group is unpacked (2x)
        assert r["full_peak"] >= r["model_bytes"], r
        assert r["sharded_peak"] <= 2 * r["largest_group"] + 1.25 * r["act_peak"], r
        assert r["sharded_peak"] < 0.6 * r["model_bytes"], r
