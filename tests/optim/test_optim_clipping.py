"""global_norm and clip_by_global_norm match torch.nn.utils.clip_grad_norm_; scale scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hpfunc import optim

from _optim_helpers import randn, one_intra_op_thread  # noqa: F401 (autouse fixture)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=4),
    max_norm=st.floats(0.01, 20.0),
    scale=st.sampled_from([1e-3, 1.0, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_clip_matches_torch(shapes, max_norm, scale, seed):
    grads = [randn(s, seed + i) * scale for i, s in enumerate(shapes)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    torch.testing.assert_close(optim.global_norm(grads), total)
    tx = optim.clip_by_global_norm(max_norm)
    clipped, _ = tx.update(grads, tx.init(None))
    for c, p in zip(clipped, params):
        torch.testing.assert_close(c, p.grad, atol=0, rtol=1e-6)


def test_global_norm_nested_and_empty():
    tree = {"a": torch.tensor([3.0]), "b": [torch.tensor([[4.0]]), None], "c": ()}
    assert optim.global_norm(tree).item() == 5.0
    assert optim.global_norm({}).item() == 0.0


def test_global_norm_bf16_accumulates_in_fp32():
    x = torch.full((4096,), 0.01, dtype=torch.bfloat16)
    n = optim.global_norm([x])
    assert n.dtype == torch.float32
    torch.testing.assert_close(n, torch.linalg.vector_norm(x.float()))


def test_clip_keeps_dtype_and_leaves_small_updates_alone():
    tx = optim.clip_by_global_norm(10.0)
    g = {"w": torch.tensor([0.5, 0.25], dtype=torch.bfloat16)}
    u, _ = tx.update(g, tx.init(None))
    assert u["w"].dtype == torch.bfloat16 and torch.equal(u["w"], g["w"])


def test_clip_rejects_bad_max_norm():
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(0.0)


def test_scale_and_learning_rate_sign():
    g = {"w": torch.tensor([1.0, -2.0])}
    u, _ = optim.scale(0.5).update(g, optim.scale(0.5).init(None))
    assert torch.equal(u["w"], torch.tensor([0.5, -1.0]))
    tx = optim.scale_by_learning_rate(0.1, flip_sign=False)
    assert torch.allclose(tx.update(g, tx.init(None))[0]["w"], torch.tensor([0.1, -0.2]))


def test_scale_by_learning_rate_follows_schedule():
    tx = optim.scale_by_learning_rate(optim.linear(1.0, 0.0, 4))
    state = tx.init(None)
    seen = []
    for _ in range(6):
        u, state = tx.update({"w": torch.ones(1)}, state)
        seen.append(u["w"].item())
    assert seen == [-1.0, -0.75, -0.5, -0.25, 0.0, 0.0]
    assert state.count.dtype == torch.int64 and int(state.count) == 6


def test_grad_accumulation_scale_then_clip_chain():
    tx = optim.chain(optim.scale(0.25), optim.clip_by_global_norm(1.0))
    u, _ = tx.update({"w": torch.tensor([12.0, 16.0])}, tx.init(None))  # norm 20 -> 5 -> clipped to 1
    torch.testing.assert_close(u["w"], torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)
