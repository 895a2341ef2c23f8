"""``parallelize(..., donate_state=True)``: the optimizer writes the new state into the old one's memory,
with the values of ``donate_state=False`` bit for bit; ``optim.update_and_apply(..., donate=True)`` alone."""

from __future__ import annotations

import pytest
import torch

from hpfunc import optim

import _state_helpers as S


@pytest.mark.multirank
@pytest.mark.parametrize("name, params_in_place", [("fsdp", True), ("zero1", False)])
def test_donated_state_is_reused_and_bitwise_equal(pools, name, params_in_place):
    """fsdp: moments and parameter blocks in place; zero1: the moments in place, the parameters
    all-gathered from the updated optimizer blocks into new storage (their old blocks are donated)."""
    out = pools(2).run(S.run_donated, name)
    for o in out:
        assert o["reused"] == [{"mu": True, "params": params_in_place}] * 3, o


def _tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "s": torch.randn((), generator=g)}


def test_update_and_apply_in_place_equals_new_tensors():
    tx = optim.chain(optim.clip_by_global_norm(1.0),
                     optim.adamw(optim.linear(1e-2, 1e-3, 5), weight_decay=0.1, mask=lambda p, x: x.ndim >= 2))
    p_new, p_don = _tree(0), _tree(0)
    s_new, s_don = tx.init(p_new), tx.init(p_don)
    for i in range(5):
        g = _tree(10 + i)
        ptr = [x.data_ptr() for x in (p_don["w"], s_don[1][0].mu["w"], s_don[1][0].nu["b"])]
        p_new, s_new = optim.update_and_apply(tx, g, s_new, p_new)
        p_don, s_don = optim.update_and_apply(tx, g, s_don, p_don, donate=True)
        assert ptr == [x.data_ptr() for x in (p_don["w"], s_don[1][0].mu["w"], s_don[1][0].nu["b"])]
        for a, b in zip(optim._tree.flatten((p_new, s_new))[0], optim._tree.flatten((p_don, s_don))[0]):
            assert torch.equal(a, b)


def test_donation_is_a_permission_not_a_promise():
    """A leaf that requires grad, or one tensor at two leaves, gets new tensors (the same values)."""
    tx = optim.adamw(0.1)
    w = torch.ones(3)
    shared = {"a": w, "b": w}
    got, _ = optim.update_and_apply(tx, {"a": torch.ones(3), "b": -torch.ones(3)}, tx.init(shared), shared,
                                    donate=True)
    ref, _ = optim.update_and_apply(tx, {"a": torch.ones(3), "b": -torch.ones(3)}, tx.init(shared), shared)
    assert torch.equal(w, torch.ones(3)) and all(torch.equal(got[k], ref[k]) for k in ref)
    leaf = {"w": torch.ones(3, requires_grad=True)}
    got, _ = optim.update_and_apply(tx, {"w": torch.ones(3)}, tx.init(leaf), leaf, donate=True)
    assert got["w"].data_ptr() != leaf["w"].data_ptr() and torch.equal(leaf["w"].detach(), torch.ones(3))
