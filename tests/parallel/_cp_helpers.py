"""Rank-side helpers for the context-parallel plan tests (tests/parallel/test_parallel_cp.py)."""

from __future__ import annotations

import functools

import torch

LR = 1e-3
ADAM_EPS = 1e-5


def _tp(cfg, axis, **modes):
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans

    return plans.tp(axis, parallel_plan.tp_styles(cfg, **modes))


# name -> (world, mesh axes, plan factory(plans, cfg, impl)); impl: the cp strategy
CP_PLANS = {
    "cp2": (2, {"cp": 2}, lambda pl, cfg, impl, **kw: pl.cp("cp", impl=impl, **kw)),
    "cp4": (4, {"cp": 4}, lambda pl, cfg, impl, **kw: pl.cp("cp", impl=impl, **kw)),
    "cp2x2_hybrid": (4, {"cp": 2, "cpu": 2},
                     lambda pl, cfg, impl, **kw: pl.cp("cp", impl="hybrid", ulysses_axis="cpu", **kw)),
    "fsdp_cp": (4, {"fsdp": 2, "cp": 2}, lambda pl, cfg, impl, **kw: pl.fsdp("fsdp") + pl.cp("cp", impl=impl, **kw)),
    "cp_tp": (4, {"cp": 2, "tp": 2}, lambda pl, cfg, impl, **kw: pl.cp("cp", impl=impl, **kw) + _tp(cfg, "tp")),
    "cp_tp_sp": (4, {"cp": 2, "tp": 2}, lambda pl, cfg, impl, **kw: pl.cp("cp", impl=impl, **kw)
                 + _tp(cfg, "tp", sequence_parallel=True, vocab_parallel=True)),
    "cp_tp_vocab": (4, {"cp": 2, "tp": 2}, lambda pl, cfg, impl, **kw: pl.cp("cp", impl=impl, **kw)
                    + _tp(cfg, "tp", vocab_parallel=True)),
    "ep_cp": (4, {"ep": 2, "cp": 2}, lambda pl, cfg, impl, **kw: pl.ep("ep", ep_experts(cfg))
              + pl.cp("cp", impl=impl, **kw)),
}


def ep_experts(cfg):
    from hpfunc.models.qwen3 import parallel_plan

    return parallel_plan.ep_experts(cfg)


def make(name, cfg, impl, **kw):
    import hpfunc
    from hpfunc.transforms import plans

    world, axes, factory = CP_PLANS[name]
    return hpfunc.Mesh(axes), factory(plans, cfg, impl, **kw)


def run_cp_parity(name: str, impl: str, model: str, seed: int, seq: int, batch: int = 2, steps: int = 2,
                  bug: str | None = None, docs: bool = False, remat: str | None = None, **kw) -> dict:
    """``steps`` AdamW steps under plan ``name`` with the cp strategy ``impl`` against single-device autograd
    on the same global batches (sequence length ``seq``; with ``docs`` packed documents of random lengths,
    ``batch["doc_ids"]``; with ``remat`` a policy name of :mod:`hpfunc.transforms.policies`, the whole
    loss recomputed in the backward but what it saves): loss, every reduced gradient, grad norm and the
    update at the same parameters (rtol 1e-5), and the independent single-device trajectory.

    ``bug`` plants a deliberate error to show that the comparison can fail: ``"skip_rotation"`` (the ring's
    last K, V transfer is not attended), ``"causal_offset"`` (the causal mask one position late),
    ``"rope_offset"`` (every rank takes the positions of the next rank's tokens for RoPE)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    torch.manual_seed(0)
    cfg = qwen3.preset(model)
    mesh, plan = make(name, cfg, impl, **kw)
    key = hpfunc.random.key(seed)
    loss_fn = (lambda p, b: parallel_plan.loss(p, b, cfg)[0])
    if remat is not None:
        from hpfunc.transforms import policies
        from hpfunc.transforms.remat import remat as _remat

        loss_fn = _remat(loss_fn, policy=getattr(policies, remat))
    with _planted(bug):
        opt = optim.adamw(LR, eps=ADAM_EPS)
        step = parallel_train_step(loss_fn, opt, mesh, plan, return_grads=True)
        params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, key, shapes=qwen3.param_shapes(cfg))
        ref_params = qwen3.init(key, cfg)
        state, ref_state = step.init_opt_state(params), opt.init(ref_params)
        g = torch.Generator().manual_seed(seed)
        for i in range(steps):
            b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)}
            if docs:  # a new document starts at a token with probability 0.3
                b["doc_ids"] = torch.cumsum((torch.rand(batch, seq, generator=g) < 0.3).long(), dim=1)
            at, at_state = to_full(params), to_full(state)
            params, state, metrics, grads = step(params, state, b)
            value, ref_grads = hpfunc.value_and_grad(lambda p: qwen3.loss(p, b, cfg)[0])(at)
            assert_trees_close(metrics["loss"], value, rtol=1e-5, atol=1e-6, what=f"step {i} loss")
            assert_trees_close(metrics["grad_norm"], optim.global_norm(ref_grads), rtol=1e-5, atol=1e-7,
                               what=f"step {i} grad_norm")
            for (path, gr), r in zip(hpfunc.tree.leaves_with_paths(to_full(grads)), hpfunc.tree.leaves(ref_grads)):
                scale = float(r.abs().max()) or 1.0
                assert_trees_close(gr, r, rtol=1e-5, atol=1e-5 * scale, what=f"step {i} grad {path}")
            u, _ = opt.update(to_full(grads), at_state, at)
            assert_trees_close(params, optim.apply_updates(at, u), rtol=1e-5, atol=1e-7, what=f"step {i} update")
            _, tgrads = hpfunc.value_and_grad(lambda p: qwen3.loss(p, b, cfg)[0])(ref_params)
            updates, ref_state = opt.update(tgrads, ref_state, ref_params)
            ref_params = optim.apply_updates(ref_params, updates)
            assert_trees_close(params, ref_params, rtol=1e-5, atol=0.05 * LR * (i + 1), what=f"step {i} params")
    return {"loss": float(metrics["loss"].full_tensor())}


class _planted:
    """A deliberate bug for the duration of a run (the tests show it makes the parity fail)."""

    def __init__(self, bug: str | None):
        self.bug, self.undo = bug, []

    def __enter__(self):
        from hpfunc.models import context_attention as ca
        from hpfunc.models.sequence_split import SequenceSplit

        if self.bug == "skip_rotation":
            orig = ca._attend

            def attend(q, q_chunks, k, v, k_chunks, m):  # the keys of the last ring step are not attended
                out = orig(q, q_chunks, k, v, k_chunks, m)
                me = ca._axis_index(_AXIS)
                if list(k_chunks) == list(m.split.chunks_of((me + 1) % m.split.ranks)):
                    return [None] * len(out)
                return out

            ca._attend = attend
            self.undo.append(lambda: setattr(ca, "_attend", orig))
        elif self.bug == "causal_offset":  # the causal mask one token late: each query sees the next key
            orig = ca.block_attention

            def block(q, k, v, q_pos, k_pos, **kw):
                return orig(q, k, v, q_pos + 1, k_pos, **{**kw, "masked": True})

            ca.block_attention = block
            self.undo.append(lambda: setattr(ca, "block_attention", orig))
        elif self.bug == "rope_offset":
            orig = SequenceSplit.positions
            SequenceSplit.positions = lambda self, rank: orig(self, (rank + 1) % self.ranks)
            self.undo.append(lambda: setattr(SequenceSplit, "positions", orig))
        elif self.bug is not None:
            raise ValueError(self.bug)
        return self

    def __exit__(self, *exc):
        for f in self.undo:
            f()


_AXIS = "cp"


def run_bad_input(case: str) -> str:
    """The message of the error a bad cp plan or batch raises (before any communication)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    cfg = qwen3.preset("qwen3-dense-tiny")
    seq = 8
    if case == "no_pad":
        mesh, plan, seq = hpfunc.Mesh({"cp": 2}), plans.cp("cp", pad=False), 6
    elif case == "ulysses_heads":
        mesh, plan = hpfunc.Mesh({"cp": 4}), plans.cp("cp", impl="ulysses")
    elif case == "ulysses_heads_tp":
        mesh, plan = hpfunc.Mesh({"cp": 2, "tp": 2}), plans.cp("cp", impl="ulysses") + _tp(cfg, "tp")
    elif case == "axis_twice":
        mesh, plan = hpfunc.Mesh({"cp": 2}), plans.fsdp("cp") + plans.cp("cp")
    elif case == "no_axis":
        mesh, plan = hpfunc.Mesh({"dp": 2}), plans.ddp("dp") + plans.cp("cp")
    else:
        raise ValueError(case)
    stats = None
    try:
        step = parallel_train_step(lambda p, b: parallel_plan.loss(p, b, cfg)[0], optim.adamw(LR), mesh, plan)
        params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                              shapes=qwen3.param_shapes(cfg))
        state = step.init_opt_state(params)
        b = {"tokens": torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))}
        with hpfunc.comm_stats() as stats:  # the step's collectives before the error: none
            step(params, state, b)
    except ValueError as e:
        return f"{e}\nCOLLECTIVES {0 if stats is None else stats.count()}"
    raise AssertionError(f"{case}: no error")


def run_cp_comm(name: str, impl: str, seq: int, batch: int = 2, **kw) -> dict:
    """One step under ``comm_stats``: every record on the cp axes as ``(op, phase, payload bytes, sent bytes)``,
    with the figures the formulas of docs/reference.md need (tokens per sequence padded, layers, heads)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    cfg = qwen3.preset("qwen3-dense-tiny")
    mesh, plan = make(name, cfg, impl, **kw)
    step = parallel_train_step(lambda p, b: parallel_plan.loss(p, b, cfg)[0], optim.adamw(LR), mesh, plan)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                          shapes=qwen3.param_shapes(cfg))
    state = step.init_opt_state(params)
    b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))}
    with hpfunc.comm_stats() as stats:
        step(params, state, b)
    axes = plan.cp_binding.axes
    n_data = mesh.axis_size(plan.data_axes) if plan.data_axes else 1
    return {"records": [(r.op, r.axes, r.phase, r.payload_bytes, r.sent_bytes) for r in stats.records
                        if set(r.axes) <= set(axes)],
            "layers": cfg.num_hidden_layers, "P": mesh.axis_size(axes), "B": batch // n_data,
            "h": cfg.num_attention_heads * cfg.head_dim, "h_kv": cfg.num_key_value_heads * cfg.head_dim}


def run_ring_transfers(policy: str | None) -> dict:
    """The ring's transfers of one cp 2 step by phase, with the loss under ``hpfunc.remat(policy)`` or not."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans, policies
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step
    from hpfunc.transforms.remat import remat

    cfg = qwen3.preset("qwen3-dense-tiny")
    mesh, plan = hpfunc.Mesh({"cp": 2}), plans.cp("cp", impl="ring")
    loss_fn = lambda p, b: parallel_plan.loss(p, b, cfg)[0]  # noqa: E731
    if policy is not None:
        loss_fn = remat(loss_fn, policy=getattr(policies, policy))
    step = parallel_train_step(loss_fn, optim.adamw(LR), mesh, plan)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                          shapes=qwen3.param_shapes(cfg))
    state = step.init_opt_state(params)
    b = {"tokens": torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))}
    with hpfunc.comm_stats() as stats:
        step(params, state, b)
    out = {"layers": cfg.num_hidden_layers}
    for r in stats.records:
        if r.op == "ppermute":
            out[r.phase] = out.get(r.phase, 0) + 1
    return out
