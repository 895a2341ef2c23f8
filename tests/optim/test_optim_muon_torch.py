"""hpfunc's muon against ``torch.optim.Muon`` (torch 2.13): where they define the same update, and
exactly where they differ.

The same update (checked by the property test) under this correspondence:

=====================================  ===========================================================
``torch.optim.Muon``                   ``hpfunc.optim.muon``
=====================================  ===========================================================
``lr``                                 ``learning_rate``
``momentum``                           ``beta`` (both an EMA: ``buf.lerp_(g, 1 - momentum)``)
``nesterov``                           ``nesterov`` (both ``g.lerp(buf, momentum)``)
``ns_coefficients``, ``ns_steps``      ``ns_coeffs``, ``ns_steps``
``eps``                                ``eps`` (torch: ``max(norm, eps)``, hpfunc: ``norm + eps``)
``adjust_lr_fn=None / "original"``     ``consistent_rms=None``: ``sqrt(max(1, rows / cols))``
``adjust_lr_fn="match_rms_adamw"``     ``consistent_rms=0.2``: ``0.2 * sqrt(max(rows, cols))``
``weight_decay`` (``p *= 1 - lr wd``   ``weight_decay`` (``add_decayed_weights`` before
with the unadjusted ``lr``)            ``scale_by_learning_rate``: also the unadjusted rate)
Newton-Schulz always in bf16           ``ns_dtype=torch.bfloat16`` (default: fp32)
=====================================  ===========================================================

In bf16 hpfunc's iteration runs the same ops in the same order (two ``addmm`` per step), so the
orthogonalised matrices are bit-identical and the parameters differ only by the fp32 rounding of
the final step: torch rounds ``p * (1 - lr wd)`` and then ``p - lr' O``, hpfunc rounds
``scale O``, ``+ wd p``, ``* -lr`` and ``p + u``. Each rounding is at most half an ulp of a value of
the parameters' magnitude, so after ``T`` steps the two are within ``2 T`` ulps of
``max(1, |p|)`` (the gradients are fixed, so no difference feeds back into the momentum).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from hpfunc import optim

from _optim_helpers import randn, run_updates, scaled_err, torch_steps, one_intra_op_thread  # noqa: F401 (autouse fixture)

STEPS = 6
FP32_ULP = torch.finfo(torch.float32).eps
TIGHT = 2 * STEPS * FP32_ULP  # see the module docstring
MAX_ERR = {"bf16 iteration vs torch (scaled)": 0.0, "fp32 iteration vs torch (scaled)": 0.0}
# Below this Frobenius norm of a Newton-Schulz input, ``norm + eps`` (hpfunc) and ``max(norm, eps)``
# (torch) give different bf16 numbers: bf16 absorbs ``+ 1e-7`` only when it is under half an ulp of
# the norm, i.e. for norms above 2**8 * 1e-7 = 2.6e-5 (test_eps_is_added_where_torch_clamps).
EPS_ZONE = 1e-4


def min_ns_input_norm(grads: list[dict], momentum: float, nesterov: bool) -> float:
    """The smallest norm of a matrix that the iteration sees (the momentum recursion, restated)."""
    bufs, smallest = {}, math.inf
    for g_tree in grads:
        for k, g in g_tree.items():
            m = torch.lerp(bufs.get(k, torch.zeros_like(g)), g, 1 - momentum)
            bufs[k] = m
            u = torch.lerp(g, m, momentum) if nesterov else m
            smallest = min(smallest, torch.linalg.matrix_norm(u).item())
    return smallest


def run_torch(params: dict, grads: list[dict], schedule=None, **kw) -> dict:
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.Muon(list(ps.values()), **kw)
    sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s) / kw["lr"])
    return torch_steps(opt, ps, grads, sched)


def ours_for(torch_kw: dict, *, ns_dtype=torch.bfloat16, schedule=None):
    """The hpfunc optimizer that defines the same update as ``torch.optim.Muon(**torch_kw)``."""
    adjust = torch_kw.get("adjust_lr_fn")
    return optim.muon(
        schedule or torch_kw["lr"],
        torch_kw.get("ns_coefficients", optim.NS_COEFFICIENTS),
        torch_kw.get("ns_steps", 5),
        torch_kw["momentum"],
        torch_kw.get("eps", 1e-7),
        torch_kw["weight_decay"],
        nesterov=torch_kw["nesterov"],
        consistent_rms=0.2 if adjust == "match_rms_adamw" else None,
        ns_dtype=ns_dtype,
    )


matrix_shapes = st.lists(st.tuples(st.integers(1, 24), st.integers(1, 24)), min_size=1, max_size=3)


@settings(max_examples=30, deadline=None)
@given(
    shapes=matrix_shapes,
    lr=st.floats(1e-3, 0.1),
    momentum=st.sampled_from([0.0, 0.5, 0.9, 0.95]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    adjust_lr_fn=st.sampled_from([None, "original", "match_rms_adamw"]),
    ns_steps=st.sampled_from([1, 3, 5]),
    grad_scale=st.sampled_from([1e-3, 1.0, 30.0]),
    use_schedule=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_muon_equals_torch_muon(shapes, lr, momentum, nesterov, weight_decay, adjust_lr_fn, ns_steps, grad_scale,
                                use_schedule, seed):
    """fp32 params, gradients and momentum; the iteration in bf16 on both sides (torch has no other).
    Examples whose iteration inputs fall in the eps zone are the documented difference (tested below)."""
    params = {f"m{i}": randn(s, seed + i) for i, s in enumerate(shapes)}
    grads = [{k: randn(v.shape, seed * 31 + 100 * t + i) * grad_scale for i, (k, v) in enumerate(params.items())}
             for t in range(STEPS)]
    assume(min_ns_input_norm(grads, momentum, nesterov) > EPS_ZONE)
    kw = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn,
              ns_steps=ns_steps)
    schedule = optim.linear(lr, lr / 4, STEPS - 2, 1) if use_schedule else None
    expected = run_torch(params, grads, schedule=schedule, **kw)
    got = run_updates(params, grads, ours_for(kw, schedule=schedule))
    err = max(scaled_err(got[k], expected[k]) for k in params)
    MAX_ERR["bf16 iteration vs torch (scaled)"] = max(MAX_ERR["bf16 iteration vs torch (scaled)"], err)
    assert all(got[k].dtype == torch.float32 for k in got)
    assert err <= TIGHT, f"max |ours - torch| / max(1, |torch|) = {err:.3e} > {TIGHT:.3e} (2 * {STEPS} fp32 ulps)"


def test_fp32_iteration_is_where_the_default_differs_from_torch():
    """hpfunc iterates in fp32 by default, torch always in bf16: the trajectories then differ by far
    more than rounding (bf16 keeps 8 significant bits), and agree once ns_dtype=bf16."""
    params = {"w": randn((16, 24), 0), "v": randn((24, 8), 1)}
    grads = [{k: randn(v.shape, 10 + 2 * t + i) for i, (k, v) in enumerate(params.items())} for t in range(STEPS)]
    kw = dict(lr=0.05, momentum=0.95, nesterov=True, weight_decay=0.1)
    expected = run_torch(params, grads, **kw)
    bf16 = run_updates(params, grads, ours_for(kw))
    fp32 = run_updates(params, grads, ours_for(kw, ns_dtype=None))
    err_bf16 = max(scaled_err(bf16[k], expected[k]) for k in params)
    err_fp32 = max(scaled_err(fp32[k], expected[k]) for k in params)
    MAX_ERR["fp32 iteration vs torch (scaled)"] = err_fp32
    assert err_bf16 <= TIGHT
    assert err_fp32 > 1000 * TIGHT, err_fp32
    assert err_fp32 < STEPS * kw["lr"] * 2.0 * 2**-6, err_fp32  # a few bf16 ulps of an update of size ~1 per step


def test_eps_is_added_where_torch_clamps():
    """torch normalises by max(norm, eps), hpfunc by norm + eps (as the published code and optax): the
    same bits for ordinary gradients, different ones when the norm is within a few eps."""
    eps = 1e-7
    for norm, same in [(1.0, True), (1e-3, True), (1e-6, False), (2e-7, False)]:
        g = randn((6, 10), 3)
        g = g * (norm / torch.linalg.matrix_norm(g))
        kw = dict(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, eps=eps)
        expected = run_torch({"w": torch.zeros(6, 10)}, [{"w": g}], **kw)["w"]
        got = run_updates({"w": torch.zeros(6, 10)}, [{"w": g}], ours_for(kw))["w"]
        assert (scaled_err(got, expected) <= TIGHT) == same, (norm, scaled_err(got, expected))
    zero = {"w": torch.zeros(3, 5)}
    kw = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.0)
    assert torch.equal(run_updates(zero, [zero], ours_for(kw))["w"], run_torch(zero, [zero], **kw)["w"])  # 0 -> 0


def test_stacks_are_hpfunc_only():
    """torch.optim.Muon refuses a 3-D parameter; hpfunc treats [n, rows, cols] as n matrices (equal,
    slice by slice, to n 2-D leaves: test_optim_muon.py::test_muon_stack_is_independent_matrices)."""
    with pytest.raises(ValueError, match="only supports 2D parameters"):
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])
    p = {"e": randn((2, 3, 4), 0)}
    assert run_updates(p, [{"e": randn((2, 3, 4), 1)}], optim.muon(0.02))["e"].shape == (2, 3, 4)


def test_only_defaults_and_names_differ():
    """torch's defaults are lr=1e-3, weight_decay=0.1; hpfunc's learning_rate is required and its
    weight_decay defaults to 0 (both: momentum/beta 0.95, Nesterov, 5 steps, eps 1e-7, the same
    coefficients)."""
    import inspect

    tp = inspect.signature(torch.optim.Muon.__init__).parameters
    hp = inspect.signature(optim.muon).parameters
    assert (tp["lr"].default, tp["weight_decay"].default) == (1e-3, 0.1)
    assert hp["learning_rate"].default is inspect.Parameter.empty and hp["weight_decay"].default == 0.0
    pairs = [("momentum", "beta"), ("nesterov", "nesterov"), ("ns_steps", "ns_steps"), ("eps", "eps"),
             ("ns_coefficients", "ns_coeffs")]
    for t_name, h_name in pairs:
        assert tp[t_name].default == hp[h_name].default, (t_name, tp[t_name].default, hp[h_name].default)


def test_adjust_lr_fn_is_consistent_rms():
    for shape in [(8, 2), (2, 8), (5, 5), (3, 12)]:
        for adjust, rms in [(None, None), ("original", None), ("match_rms_adamw", 0.2)]:
            assert math.isclose(
                torch.optim._muon._adjust_lr(1.0, adjust, torch.Size(shape)), optim.muon_scale(shape, rms)
            ), (shape, adjust)


def test_muon_torch_report_max_error():
    print("\nmuon vs torch.optim.Muon: " + ", ".join(f"{k} {v:.3e}" for k, v in MAX_ERR.items()))
