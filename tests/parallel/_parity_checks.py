"""Shared rank-side checks of the MoE parallel tests: a parallelized AdamW step against one device, and
the experts' reference problem (tokens, routing weights, expert weights, the one-device outputs and
gradients) that the dispatcher tests compare with."""

from __future__ import annotations

import torch


def check_step_against_one_device(what: str, step_out: tuple, at: dict, at_state, b: dict, ref_loss, opt,
                                  ref: tuple, i: int, lr: float) -> tuple:
    """``step_out = (params, state, metrics, grads)`` of a parallelized step from ``at`` / ``at_state``
    (full tensors) on batch ``b``: loss, expert load, every gradient and the update equal the one-device
    step; the independent one-device trajectory ``ref = (ref_params, ref_state)`` advances one step and
    stays close. Returns ``(ref_params, ref_state, aux)`` (``aux`` of the one-device loss at ``at``)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.testing import assert_trees_close, to_full

    params, _, metrics, grads = step_out
    (value, aux), ref_grads = hpfunc.value_and_grad(ref_loss, has_aux=True)(at, b)
    assert_trees_close(metrics["loss"], value, rtol=1e-5, atol=1e-6, what=f"{what} loss")
    assert torch.equal(to_full(metrics["expert_load"]), aux["expert_load"]), f"{what} expert load"
    for (path, gr), r in zip(hpfunc.tree.leaves_with_paths(to_full(grads)), hpfunc.tree.leaves(ref_grads)):
        scale = float(r.abs().max()) or 1.0
        assert_trees_close(gr, r, rtol=1e-5, atol=1e-5 * scale, what=f"{what} grad {path}")
    u, _ = opt.update(to_full(grads), at_state, at)
    assert_trees_close(params, optim.apply_updates(at, u), rtol=1e-5, atol=1e-7, what=f"{what} update")
    ref_params, ref_state = ref
    _, tgrads = hpfunc.value_and_grad(ref_loss, has_aux=True)(ref_params, b)
    updates, ref_state = opt.update(tgrads, ref_state, ref_params)
    ref_params = optim.apply_updates(ref_params, updates)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=0.05 * lr * (i + 1), what=f"{what} params")
    return ref_params, ref_state, aux


def experts_problem(g: torch.Generator, T: int, k: int, E: int, routing, H: int = 6, I: int = 4) -> dict:
    """Tokens ``x [T, H]``, their expert ids ``idx = routing()`` (drawn right after ``x``), combine weights
    ``w [T, k]``, expert stacks, and the one-device ``grouped_experts`` output with the gradients of all
    five against a random cotangent (fp64)."""
    from hpfunc.models.moe import grouped_experts

    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = routing()
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    wg, wu, wd = (torch.randn(E, I, H, generator=g, dtype=torch.float64),
                  torch.randn(E, I, H, generator=g, dtype=torch.float64),
                  torch.randn(E, H, I, generator=g, dtype=torch.float64))
    ref_in = [t.clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    ref = grouped_experts(ref_in[0], idx, ref_in[1], *ref_in[2:], impl="bmm")
    cot = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    return {"x": x, "idx": idx, "w": w, "wg": wg, "wu": wu, "wd": wd, "ref": ref.detach(), "cot": cot,
            "ref_grads": torch.autograd.grad((ref * cot).sum(), ref_in)}
