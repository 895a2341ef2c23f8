"""muon equals a from-the-paper reference (fp32 iteration); non-matrix leaves are rejected by path.

The comparison with ``torch.optim.Muon`` (which iterates in bf16) is in test_optim_muon_torch.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hpfunc import optim

from _optim_helpers import max_abs_diff, randn, run_updates, one_intra_op_thread  # noqa: F401 (autouse fixture)

# Worst error seen against the reference, printed by test_muon_report_max_error (run with -s).
MAX_ERR = {"fp32": 0.0}


# ---- reference, written from the published algorithm (Jordan et al. 2024) -------------------
def ref_newton_schulz5(G: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.transpose(-2, -1)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.transpose(-2, -1)
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.transpose(-2, -1)
    return X


def ref_muon_run(params: dict, grads: list[dict], *, lr, beta, nesterov, ns_steps, wd, consistent_rms, dtype):
    """In-place loop as in the published optimizer: buf.lerp_(g, 1 - beta); Nesterov
    g.lerp_(buf, beta); orthogonalise; scale; p *= 1 - lr * wd; p -= lr * update."""
    params = {k: v.clone() for k, v in params.items()}
    bufs = {k: torch.zeros_like(v) for k, v in params.items()}
    for g_tree in grads:
        for k, p in params.items():
            g = g_tree[k].clone()
            bufs[k].lerp_(g, 1 - beta)
            update = g.lerp_(bufs[k], beta) if nesterov else bufs[k].clone()
            update = ref_newton_schulz5(update, ns_steps, dtype).float()
            rows, cols = p.size(-2), p.size(-1)
            if consistent_rms is None:
                update = update * max(1, rows / cols) ** 0.5
            else:
                update = update * consistent_rms * max(rows, cols) ** 0.5
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)
    return params


SHAPES = {"square": (6, 6), "wide": (4, 10), "tall": (12, 5), "experts": (3, 8, 4), "experts_wide": (2, 3, 7)}


@settings(max_examples=25, deadline=None)
@given(
    lr=st.floats(1e-3, 0.05),
    beta=st.sampled_from([0.0, 0.9, 0.95]),
    nesterov=st.booleans(),
    ns_steps=st.sampled_from([1, 3, 5]),
    wd=st.sampled_from([0.0, 0.1]),
    consistent_rms=st.sampled_from([None, 0.2, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_muon_matches_reference(lr, beta, nesterov, ns_steps, wd, consistent_rms, seed):
    params = {k: randn(s, seed + i) * 0.5 for i, (k, s) in enumerate(SHAPES.items())}
    grads = [{k: randn(s, seed * 31 + 100 * t + i) for i, (k, s) in enumerate(SHAPES.items())} for t in range(6)]
    expected = ref_muon_run(
        params, grads, lr=lr, beta=beta, nesterov=nesterov, ns_steps=ns_steps, wd=wd, consistent_rms=consistent_rms,
        dtype=torch.float32,
    )
    tx = optim.muon(lr, beta=beta, nesterov=nesterov, ns_steps=ns_steps, weight_decay=wd, consistent_rms=consistent_rms)
    got = run_updates(params, grads, tx)
    err = max(max_abs_diff(got[k], expected[k]) for k in SHAPES)
    MAX_ERR["fp32"] = max(MAX_ERR["fp32"], err)
    # The reference decays the param and then adds the step (two roundings), apply_updates adds
    # one combined update; the reference's iteration is b*A + c*A@A where ours fuses it into addmm:
    # a few fp32 ulps apart on params of magnitude ~2.
    for k in SHAPES:
        torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=2e-6, msg=lambda m: f"{k}: {m}")


def test_muon_report_max_error():
    print("\nmuon vs published-algorithm reference: " + ", ".join(f"{k} {v:.3e}" for k, v in MAX_ERR.items()))


def test_newton_schulz_orthogonalises_each_expert_separately():
    g = randn((4, 16, 8), 3)
    g[1] *= 100.0  # a batch element's scale must not leak into the others
    out = optim.newton_schulz(g)
    for e in range(4):
        s = torch.linalg.svdvals(out[e])
        assert ((s > 0.6) & (s < 1.3)).all(), (e, s)
        torch.testing.assert_close(out[e], optim.newton_schulz(g[e]))


def test_muon_state_fp32_for_bf16_params():
    params = {"w": randn((4, 4), 0, torch.bfloat16)}
    tx = optim.muon(0.02)
    state = tx.init(params)
    assert state[0].momentum["w"].dtype == torch.float32
    updates, state = tx.update({"w": randn((4, 4), 1, torch.bfloat16)}, state, params)
    assert updates["w"].dtype == torch.float32 and state[0].momentum["w"].dtype == torch.float32
    assert optim.apply_updates(params, updates)["w"].dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(), (5,), (2, 2, 2, 2)])
def test_muon_rejects_non_matrix_leaf_naming_path(shape):
    params = {"layers": [{"attn": {"wq": torch.zeros(4, 4)}, "norm": torch.zeros(shape)}]}
    with pytest.raises(optim.UnsupportedLeafError, match=r"'layers\.0\.norm'.*ndim") as info:
        optim.muon(0.02).init(params)
    assert "muon_adamw" in str(info.value)  # suggests the fix


def test_muon_rejects_non_matrix_update_naming_path():
    tx = optim.muon(0.02)
    state = tx.init({"w": torch.zeros(4, 4)})
    with pytest.raises(optim.OptimError, match=r"'w'"):
        tx.update({"w": torch.zeros(16)}, state)


@pytest.mark.parametrize("bad", ["match_adamw_rms", 0.0, -0.2, True])
def test_muon_rejects_bad_consistent_rms(bad):
    with pytest.raises(ValueError, match="consistent_rms must be None .* or a positive float"):
        optim.muon(0.02, consistent_rms=bad)


def test_muon_rejects_per_step_coefficient_tables():
    with pytest.raises(ValueError, match=r"ns_coeffs must be one \(a, b, c\) triple"):
        optim.scale_by_muon(((3.4, -4.7, 2.0), (3.4, -4.7, 2.0)))


def test_muon_stack_is_independent_matrices():
    """A 3-D leaf [n, rows, cols] gets, slice by slice, the update of n separate 2-D leaves (fp32;
    the batched kernels round differently from the 2-D ones, hence a few ulps)."""
    for shape in [(3, 8, 4), (2, 3, 7), (4, 6, 6), (1, 5, 2)]:
        p = randn(shape, 1)
        grads = [randn(shape, 10 + t) for t in range(5)]
        tx = optim.muon(0.05, weight_decay=0.1, consistent_rms=0.2)
        stack = run_updates({"e": p}, [{"e": g} for g in grads], tx)["e"]
        for i in range(shape[0]):
            alone = run_updates({"e": p[i]}, [{"e": g[i]} for g in grads], tx)["e"]
            torch.testing.assert_close(stack[i], alone, atol=1e-6, rtol=2e-6, msg=lambda m: f"{shape}[{i}]: {m}")
