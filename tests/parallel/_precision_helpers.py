"""Rank-side helpers: mixed precision and the gradient scaling factor."""

from __future__ import annotations

import functools
import math

import torch

import _parallel_helpers as H

BF16 = torch.bfloat16


def _step(name: str, model: str, plan_fn, **cfg_overrides):
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    cfg = H.config(model, **cfg_overrides)
    mesh, plan = H.make(name, cfg)
    plan = plan_fn(plan)
    step = parallel_train_step(lambda p, b: qwen3.parallel_plan.loss(p, b, cfg)[0], optim.adamw(H.LR), mesh, plan,
                               return_grads=True)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                          shapes=qwen3.param_shapes(cfg))
    return mesh, plan, cfg, step, params


def run_mixed_parity(name: str, model: str, seed: int, reduce_dtype=torch.float32) -> float:
    """One step with bf16 compute: loss (rtol 1e-2) and reduced fp32 gradients (relative L2 error per leaf
    <= 1e-2) equal single-device autograd through a bf16 cast of the fp32 parameters; parameters,
    gradients and optimizer state stay fp32. Returns the worst gradient error."""
    import hpfunc
    from hpfunc.models import qwen3
    from hpfunc.testing import assert_trees_close, to_full

    mesh, plan, cfg, step, params = _step(name, model, lambda p: p.with_mixed_precision(BF16, reduce_dtype))
    n_data = mesh.axis_size(tuple(a for a in mesh.axis_names if a in plan.data_axes)) if plan.data_axes else 1
    b = H.batches(cfg, 1, 4, 8, seed)[0]
    full = to_full(params)

    def ref_loss(p):
        # one bf16 cast per data shard, as each rank makes: the shards' gradients then meet in fp32 (one
        # shared cast would sum them in bf16 inside autograd, a rounding the sharded step does not make)
        cast = lambda: hpfunc.tree.tree_map(lambda x: x.to(BF16), p)  # noqa: E731
        shards = b["tokens"].chunk(n_data)
        if not cfg.moe_layers:
            return torch.stack([qwen3.loss(cast(), {"tokens": t}, cfg)[0] for t in shards]).mean()
        # MoE: the load-balancing term of the whole batch (the step sums counts, rows and router
        # probabilities over the data shards), its probabilities from each shard's own cast
        ce, counts, probs, rows = [], 0, 0, 0
        for t in shards:
            logits, aux = qwen3.apply(cast(), t, cfg, return_aux=True)
            ce.append(torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                        qwen3.shift_labels(t).reshape(-1), ignore_index=-100))
            counts = counts + aux["expert_load"].sum(0).float()
            probs = probs + sum(torch.softmax(lg, dim=-1, dtype=torch.float32).sum(0) for lg in aux["router_logits"])
            rows = rows + sum(lg.shape[0] for lg in aux["router_logits"])
        lb = cfg.num_experts * torch.sum((counts / rows) * (probs / rows))
        return torch.stack(ce).mean() + cfg.router_aux_loss_coef * lb

    value, ref_grads = hpfunc.value_and_grad(ref_loss)(full)
    new_params, state, metrics, grads = step(params, step.init_opt_state(params), b)
    worst = 0.0
    tol = 2e-2 if plan.tp_axis is not None else 1e-2
    assert_trees_close(metrics["loss"], value, rtol=1e-2, atol=1e-2, what="bf16 loss")
    for (path, g), r in zip(hpfunc.tree.leaves_with_paths(to_full(grads)), hpfunc.tree.leaves(ref_grads)):
        assert g.dtype == torch.float32, path
        # bf16 rounds every activation to 8 bits of mantissa, and the shards' matmuls accumulate in another
        # order than the full batch's: compare each leaf by its relative L2 error (bf16 tolerance 1e-2)
        # Under TP the row-parallel partial sums are rounded to bf16 on each rank before their all-reduce
        # (as in Megatron), where one device rounds the finished matmul once: 2e-2 there.
        err = float((g.double() - r.double()).norm() / max(float(r.double().norm()), 1e-12))
        assert err <= tol, f"bf16 grad {path}: relative L2 error {err:.2e} > {tol}"
        worst = max(worst, err)
    assert all(x.dtype == torch.float32 for x in hpfunc.tree.leaves(new_params))
    return worst


def run_mixed_comm(name: str, reduce_dtype) -> dict:
    """Bytes each rank sends in one step, by (op, phase), payloads over 8 bytes; the step's scalars (the
    collective tagged ``"scalars"``, and those riding a gradient bucket: ``CommRecord.rider_bytes``) left out."""
    import hpfunc
    from hpfunc.models import qwen3

    mesh, plan, cfg, step, params = _step(name, "qwen3-dense-tiny",
                                          lambda p: p.with_mixed_precision(BF16, reduce_dtype),
                                          tie_word_embeddings=False)
    b = H.batches(cfg, 1, 4, 6, 0)[0]
    state = step.init_opt_state(params)
    with hpfunc.comm_stats() as stats:
        step(params, state, b)
    shapes = hpfunc.tree.leaves(qwen3.param_shapes(cfg), is_leaf=lambda x: isinstance(x, torch.Size))
    out = {"psi": sum(math.prod(s) for s in shapes), "embed": cfg.vocab_size * cfg.hidden_size, "n": mesh.size}
    from hpfunc.comm import ring_sent_bytes

    for r in stats.records:
        if r.payload_bytes > 8 and r.tag != "scalars":
            k = f"{r.op}/{r.phase}"
            sent = ring_sent_bytes(r.op, r.payload_bytes - r.rider_bytes, r.n) if r.rider_bytes else r.sent_bytes
            out[k] = out.get(k, 0) + sent
    return out


def run_scaling_factor(name: str, factor: float) -> None:
    """``with_gradient_scaling_factor(f)``: gradients are f * (data ranks) times the default mean."""
    from hpfunc.testing import assert_trees_close, to_full

    mesh, plan, cfg, step, params = _step(name, "qwen3-dense-tiny", lambda p: p)
    _, _, _, _, params2 = _step(name, "qwen3-dense-tiny", lambda p: p)
    scaled = _step(name, "qwen3-dense-tiny", lambda p: p.with_gradient_scaling_factor(factor))[3]
    n_data = mesh.axis_size(tuple(a for a in mesh.axis_names if a in plan.data_axes))
    b = H.batches(cfg, 1, 4, 8, 0)[0]
    *_, m1, g1 = step(params, step.init_opt_state(params), b)
    *_, m2, g2 = scaled(params2, scaled.init_opt_state(params2), b)
    assert_trees_close(m2["loss"], m1["loss"], rtol=0, atol=0, what="the loss is not scaled")
    k = factor * n_data
    assert_trees_close(to_full(g2), _scale(to_full(g1), k), rtol=1e-6, atol=1e-9,
                       what="scaled grads")


def _scale(tree, k):
    import hpfunc

    return hpfunc.tree.tree_map(lambda x: x * k, tree)
