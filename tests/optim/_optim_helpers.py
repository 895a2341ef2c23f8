"""Shared helpers for the optimizer tests (kept private to this folder)."""

from __future__ import annotations

import pytest
import torch


def randn(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def grad_sequence(shapes: dict, steps: int, seed: int) -> list[dict]:
    """Per-step gradient trees shaped like ``shapes``, deterministic in ``seed``."""
    return [
        {k: randn(s, seed=seed * 7919 + 31 * i + j) for j, (k, s) in enumerate(sorted(shapes.items()))}
        for i in range(steps)
    ]


def torch_steps(opt, params: dict, grads: list[dict], sched=None) -> dict:
    """Run ``opt`` (a ``torch.optim`` optimizer over ``params``' values) on the gradients of each step,
    stepping ``sched`` after each; returns the final params, detached."""
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: p.detach() for k, p in params.items()}


def scaled_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(1, |b|): an absolute error for |b| <= 1, relative above (fp32 has
    about 7 significant digits, so a 1e-6 bound on params of magnitude 4 is a few ulps)."""
    if not a.numel():
        return 0.0
    a, b = a.double(), b.double()
    return ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Run each test with one intra-op thread, restoring the setting afterwards.

    These tests use tiny tensors: a second OpenMP thread buys nothing, and on a shared 2-core
    machine under load the threads' spin-waits made the docs example 60x slower (0.3 s -> 18 s).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_updates(params: dict, grads: list[dict], tx) -> dict:
    """``params`` after one ``tx`` update per gradient tree in ``grads``."""
    from hpfunc import optim

    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params
