"""Rank-side helpers for tests/parallel/test_parallel_styles.py: Qwen3's table against the same plan
written out by a user, and a user's own model (a residual MLP) trained with a style plan."""

from __future__ import annotations

import fnmatch

import torch

LR = 1e-3


def qwen3_written_out(sequence_parallel: bool = False, vocab_parallel: bool = False) -> dict:
    """Megatron TP for Qwen3 as a user would write it, one pattern per weight family (attention by whole
    heads of 16, the tiny models' head_dim)."""
    from hpfunc.layout import ColwiseParallel, RowwiseParallel, SequenceParallel, VocabParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    hcol, hrow = ColwiseParallel(unit=16), RowwiseParallel(unit=16)
    styles = {
        "layers.*.attn.wq": hcol, "layers.*.attn.wk": hcol, "layers.*.attn.wv": hcol,
        "layers.*.attn.bq": hcol, "layers.*.attn.bk": hcol, "layers.*.attn.bv": hcol,
        "layers.*.attn.wo": hrow,
        "layers.*.mlp.w_gate": col, "layers.*.mlp.w_up": col, "layers.*.mlp.w_down": row,
        "layers.*.moe.experts.w_gate": col, "layers.*.moe.experts.w_up": col, "layers.*.moe.experts.w_down": row,
        "layers.*.moe.shared.w_gate": col, "layers.*.moe.shared.w_up": col, "layers.*.moe.shared.w_down": row,
    }
    if sequence_parallel:
        styles.update({"layers.*.attn_norm": SequenceParallel(), "layers.*.mlp_norm": SequenceParallel(),
                       "final_norm": SequenceParallel()})
    if vocab_parallel:
        styles.update({"embed": VocabParallel(), "lm_head": VocabParallel()})
    return styles


def every_family_config():
    """A Qwen3 with every parameter family: attention biases, a dense layer, a MoE layer with a shared
    expert, an untied head (all tp-split dimensions divide by 2)."""
    from hpfunc.models import qwen3

    return qwen3.preset("qwen3-moe-tiny", attention_bias=True, decoder_sparse_step=2,
                        shared_expert_intermediate_size=32, tie_word_embeddings=False)


def run_tp_equals_styles() -> list[str]:
    """Qwen3's own table (``parallel_plan.tp_styles``) and the written-out styles resolve identically, alone
    and under FSDP, with and without sequence / vocabulary parallelism; returns the compared variants."""
    import hpfunc
    from hpfunc import P
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3.parallel_plan import tp_styles
    from hpfunc.transforms import plans

    mesh = hpfunc.Mesh({"fsdp": 2, "tp": 2})
    checked = []
    for model in ("every-family", "qwen3-dense-tiny", "qwen3-moe-tiny"):
        cfg = every_family_config() if model == "every-family" else qwen3.preset(model)
        shapes = qwen3.param_shapes(cfg)
        paths = [p for p, _ in hpfunc.tree.leaves_with_paths(shapes, is_leaf=lambda x: isinstance(x, torch.Size))]
        for sp in (False, True):
            for vocab in (False, True):
                styles = qwen3_written_out(sp, vocab)
                # a user writes only the families the model has (tp rejects patterns that match nothing)
                styles = {k: v for k, v in styles.items() if fnmatch.filter(paths, k)}
                for data in (plans.Plan(), plans.fsdp("fsdp")):
                    ready = data + plans.tp("tp", tp_styles(cfg, sequence_parallel=sp, vocab_parallel=vocab))
                    mine = data + plans.tp("tp", styles)
                    a, b = ready.resolve(shapes, mesh), mine.resolve(shapes, mesh)
                    assert a == b, [(p, a[p].spec, b[p].spec) for p in a if a[p] != b[p]]
                    assert (ready.tp_sequence_parallel, ready.tp_vocab_parallel) == (sp, vocab)
                    assert (mine.tp_sequence_parallel, mine.tp_vocab_parallel) == (sp, vocab)
                    checked.append(f"{model} sp={sp} vocab={vocab} fsdp={bool(data.layers)}")
    # and the layouts are the documented ones (on the every-family model, tp alone)
    cfg = every_family_config()
    res = plans.tp("tp", tp_styles(cfg, vocab_parallel=True)).resolve(qwen3.param_shapes(cfg), mesh)
    expect = {"layers.0.attn.wq": P("tp"), "layers.0.attn.bq": P("tp"), "layers.0.attn.wo": P(None, "tp"),
              "layers.0.attn.bo": P(), "layers.0.attn.q_norm": P(), "layers.0.mlp.w_gate": P("tp"),
              "layers.0.mlp.w_down": P(None, "tp"), "layers.1.moe.experts.w_up": P(None, "tp"),
              "layers.1.moe.experts.w_down": P(None, None, "tp"), "layers.1.moe.shared.w_up": P("tp"),
              "layers.1.moe.shared.w_down": P(None, "tp"), "layers.1.moe.shared.gate": P(),
              "layers.1.moe.router": P(), "embed": P("tp"), "lm_head": P("tp"), "final_norm": P()}
    for path, spec in expect.items():
        assert res[path].spec.storage == spec, (path, res[path].spec.storage, spec)
    return checked


# ---------------------------------------------------------------------------------------------
# A user's own model: a residual MLP block over [batch, seq, dim], single-device code plus the three
# layout hooks of hpfunc.layout (identities without a bound axis)


def mlp_init(key, dim: int, hidden: int) -> dict:
    from hpfunc import random

    def normal(i, shape):
        return random.normal(random.fold_in(key, i), shape, torch.float32, std=0.2)

    return {"norm": 1.0 + normal(0, (dim,)), "w_in": normal(1, (hidden, dim)), "b_in": normal(2, (hidden,)),
            "w_out": normal(3, (dim, hidden)), "b_out": normal(4, (dim,))}


def mlp_loss(p, batch):
    import torch.nn.functional as F

    from hpfunc import layout
    from hpfunc.models.layers import rms_norm

    x = layout.scatter_sequence(batch["x"])  # this rank's sequence block under sequence parallelism
    u = F.gelu(F.linear(layout.gather_sequence(rms_norm(x, p["norm"], 1e-6)), p["w_in"], p["b_in"]))
    x = x + layout.reduce_partial(F.linear(u, p["w_out"])) + p["b_out"]  # bias once, after the sum
    y = layout.gather_sequence(x)  # the loss on the whole sequence, the same on every rank
    return ((y - batch["y"]) ** 2).mean()


def mlp_styles(sequence_parallel: bool) -> dict:
    from hpfunc.layout import ColwiseParallel, Replicate, RowwiseParallel, SequenceParallel

    return {"w_in": ColwiseParallel(), "b_in": ColwiseParallel(), "w_out": RowwiseParallel(),
            "norm": SequenceParallel() if sequence_parallel else Replicate()}


def run_user_mlp(mesh_axes: dict, sequence_parallel: bool, seed: int, dim: int = 8, hidden: int = 16,
                 seq: int = 4, steps: int = 2) -> float:
    """Train the MLP with ``[fsdp +] tp(styles)`` and on one device: loss, reduced gradients and the
    AdamW update agree at every step (rtol 1e-5)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    mesh = hpfunc.Mesh(mesh_axes)
    plan = plans.tp("tp", mlp_styles(sequence_parallel))
    if "fsdp" in mesh_axes:
        plan = plans.fsdp("fsdp") + plan
    assert plan.tp_sequence_parallel == sequence_parallel

    opt = optim.adamw(LR, eps=1e-6)
    # the step binds the tp axis and plan.tp_sequence_parallel for the model's layout hooks
    step = parallel_train_step(mlp_loss, opt, mesh, plan, return_grads=True)
    params = step.shard_params(mlp_init(hpfunc.random.key(seed), dim, hidden))
    state = step.init_opt_state(params)
    g = torch.Generator().manual_seed(seed)
    n_data = mesh.axis_size("fsdp") if "fsdp" in mesh_axes else 1
    for i in range(steps):
        b = {"x": torch.randn(4, seq, dim, generator=g), "y": torch.randn(4, seq, dim, generator=g)}
        at, at_state = to_full(params), to_full(state)
        params, state, metrics, grads = step(params, state, b)

        def ref_loss(p, b=b):  # the step's loss: the mean over data shards of the shard means
            return torch.stack([mlp_loss(p, {"x": x, "y": y})
                                for x, y in zip(b["x"].chunk(n_data), b["y"].chunk(n_data))]).mean()

        value, ref_grads = hpfunc.value_and_grad(ref_loss)(at, b)
        assert_trees_close(metrics["loss"], value, rtol=1e-5, atol=1e-6, what=f"step {i} loss")
        assert_trees_close(to_full(grads), ref_grads, rtol=1e-5, atol=1e-6, what=f"step {i} grads")
        u, _ = opt.update(to_full(grads), at_state, at)
        assert_trees_close(params, optim.apply_updates(at, u), rtol=1e-5, atol=1e-7, what=f"step {i} update")
        # and the layout is the styles': w_in split by rows, w_out by columns, the rest replicated on tp
        spec = {p: r.spec.storage for p, r in step.resolve(params).items()}
        assert "tp" in spec["w_in"].dim_axes(0) and "tp" in spec["w_out"].dim_axes(1)
        assert "tp" not in spec["norm"].axes and "tp" not in spec["b_out"].axes
    return float(metrics["loss"].full_tensor())
