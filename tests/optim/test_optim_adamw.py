"""adamw equals torch.optim.AdamW (bias correction, decoupled decay, schedules) over 20 steps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hpfunc import optim

from _optim_helpers import grad_sequence, max_abs_diff, randn, scaled_err, torch_steps, one_intra_op_thread  # noqa: F401 (autouse fixture)

STEPS = 20
TOL = 1e-6

SHAPES = st.sampled_from(
    [
        {"w": (3, 5)},
        {"w": (8, 4), "b": (4,)},
        {"scalar": (), "v": (7,), "m": (2, 3, 4)},
        {"emb": (16, 8), "head": (8, 16), "norm": (8,)},
    ]
)


def run_torch(params0: dict, grads: list[dict], *, lr, b1, b2, eps, wd, schedule=None) -> dict:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in params0.items()}
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    sched = None
    if schedule is not None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule(step) / lr)
    return torch_steps(opt, params, grads, sched)


def run_ours(params0: dict, grads: list[dict], tx: optim.GradientTransformation) -> dict:
    params = {k: v.clone() for k, v in params0.items()}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params


# Worst errors seen by the property test, printed by test_adamw_report_max_error (run with -s).
MAX_ERR: dict[str, float] = {"fp64 abs": 0.0, "fp32 abs": 0.0, "fp32 scaled": 0.0, "torch fp32 vs fp64 abs": 0.0}


@settings(max_examples=30, deadline=None)
@given(
    shapes=SHAPES,
    lr=st.floats(1e-4, 0.1),
    b1=st.sampled_from([0.0, 0.8, 0.9, 0.95]),
    b2=st.sampled_from([0.9, 0.99, 0.999]),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    wd=st.sampled_from([0.0, 1e-2, 0.1]),
    use_schedule=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adamw_matches_torch(shapes, lr, b1, b2, eps, wd, use_schedule, seed):
    """Same maths: fp64 runs agree to 1e-6 absolute (in practice ~1e-15). In fp32 both sides
    round differently (torch rounds the decayed param before adding the step, optax-style chains
    add one update), so fp32 runs agree to a few ulps: |diff| <= 1e-6 * max(1, |p|) + 1e-6 * |p|
    (the project's fp32 tolerance is rtol 1e-5)."""
    params0 = {k: randn(s, seed=seed + i) for i, (k, s) in enumerate(sorted(shapes.items()))}
    grads = grad_sequence(shapes, STEPS, seed)
    schedule = (
        optim.linear_warmup_cosine_decay(0.0, lr, warmup_steps=5, decay_steps=15, end_value=lr / 10)
        if use_schedule
        else None
    )
    hyper = dict(lr=lr, b1=b1, b2=b2, eps=eps, wd=wd, schedule=schedule)
    tx = optim.adamw(schedule or lr, b1, b2, eps, weight_decay=wd)

    p64 = {k: v.double() for k, v in params0.items()}
    g64 = [{k: v.double() for k, v in g.items()} for g in grads]
    expected64 = run_torch(p64, g64, **hyper)
    got64 = run_ours(p64, g64, tx)
    err64 = max(max_abs_diff(got64[k], expected64[k]) for k in expected64)
    assert err64 <= TOL, f"fp64: max |ours - torch| = {err64:.3e} > {TOL}"

    expected = run_torch(params0, grads, **hyper)
    got = run_ours(params0, grads, tx)
    for k in expected:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], expected[k], atol=TOL, rtol=2 * TOL, msg=lambda m: f"fp32 {k}: {m}")
    MAX_ERR["fp64 abs"] = max(MAX_ERR["fp64 abs"], err64)
    MAX_ERR["fp32 abs"] = max(MAX_ERR["fp32 abs"], max(max_abs_diff(got[k], expected[k]) for k in expected))
    MAX_ERR["fp32 scaled"] = max(MAX_ERR["fp32 scaled"], max(scaled_err(got[k], expected[k]) for k in expected))
    MAX_ERR["torch fp32 vs fp64 abs"] = max(
        MAX_ERR["torch fp32 vs fp64 abs"], max(max_abs_diff(expected[k], expected64[k]) for k in expected)
    )


def test_adamw_report_max_error():
    """Runs after the property test (file order); prints the measured worst cases for the report."""
    print(f"\nadamw vs torch.optim.AdamW over {STEPS} steps: " + ", ".join(f"{k} {v:.3e}" for k, v in MAX_ERR.items()))


def test_adamw_state_is_fp32_for_bf16_params_and_params_keep_dtype():
    params = {"w": randn((4, 4), 0, torch.bfloat16), "b": randn((4,), 1, torch.bfloat16)}
    tx = optim.adamw(1e-2)
    state = tx.init(params)
    mu = state[0].mu
    assert mu["w"].dtype == torch.float32 and state[0].nu["b"].dtype == torch.float32
    assert state[0].count.dtype == torch.int64
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    updates, state = tx.update(grads, state, params)
    assert updates["w"].dtype == torch.float32
    new = optim.apply_updates(params, updates)
    assert new["w"].dtype == torch.bfloat16 and new["b"].dtype == torch.bfloat16
    assert state[0].mu["w"].dtype == torch.float32


def test_adamw_is_pure():
    params = {"w": randn((3, 3), 0)}
    grads = {"w": randn((3, 3), 1)}
    tx = optim.adamw(0.1, weight_decay=0.1)
    state = tx.init(params)
    snapshot = [t.clone() for t in (params["w"], grads["w"], state[0].mu["w"], state[0].nu["w"], state[0].count)]
    u1, s1 = tx.update(grads, state, params)
    u2, s2 = tx.update(grads, state, params)  # same inputs, same outputs: nothing was mutated
    after = [params["w"], grads["w"], state[0].mu["w"], state[0].nu["w"], state[0].count]
    for a, b in zip(snapshot, after):
        assert torch.equal(a, b)
    assert torch.equal(u1["w"], u2["w"]) and int(s1[0].count) == 1 == int(s2[0].count)


def test_adamw_state_is_a_tree_of_tensors():
    import optree

    params = {"layers": [{"wq": torch.zeros(2, 2)}, {"wq": torch.zeros(2, 2)}], "norm": torch.zeros(2)}
    state = optim.adamw(optim.constant(1e-3)).init(params)
    leaves = optree.tree_leaves(state)
    assert leaves and all(isinstance(x, torch.Tensor) for x in leaves)
    # three copies of the params' leaves would be mu + nu; plus two step counts (adam, schedule)
    assert len(leaves) == 2 * 3 + 2


def test_scale_by_adam_eps_root_inside_sqrt():
    g = torch.tensor([0.0, 2.0])
    tx = optim.scale_by_adam(b1=0.0, b2=0.0, eps=0.0, eps_root=1.0)
    u, _ = tx.update({"g": g}, tx.init({"g": g}))
    assert torch.allclose(u["g"], g / torch.sqrt(g * g + 1.0))


def test_add_decayed_weights_needs_params():
    tx = optim.add_decayed_weights(0.1)
    with pytest.raises(optim.OptimError, match="needs the params"):
        tx.update({"w": torch.ones(1)}, tx.init(None))


def test_adamw_decay_mask():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    tx = optim.adamw(0.1, weight_decay=0.5, mask=lambda path, x: x.ndim >= 2)
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    updates, _ = tx.update(zeros, tx.init(params), params)
    assert torch.equal(updates["b"], torch.zeros(2))
    assert torch.allclose(updates["w"], torch.full((2, 2), -0.05))
    assert math.isclose(updates["w"][0, 0].item(), -0.1 * 0.5, rel_tol=1e-6)


@pytest.mark.parametrize(
    "schedule",
    [
        optim.warmup_stable_decay(0.0, 0.05, warmup_steps=4, stable_steps=6, decay_steps=8, end_value=1e-3,
                                  decay_shape="cosine"),
        optim.linear(0.05, 0.0, 15, transition_begin=3),
    ],
    ids=["wsd", "linear"],
)
def test_adamw_schedule_matches_lambdalr(schedule):
    shapes = {"w": (5, 3), "b": (3,)}
    params0 = {k: randn(s, 10 + i, torch.float64) for i, (k, s) in enumerate(sorted(shapes.items()))}
    grads = [{k: v.double() for k, v in g.items()} for g in grad_sequence(shapes, STEPS, 3)]
    expected = run_torch(params0, grads, lr=0.05, b1=0.9, b2=0.99, eps=1e-8, wd=0.1, schedule=schedule)
    got = run_ours(params0, grads, optim.adamw(schedule, 0.9, 0.99, 1e-8, weight_decay=0.1))
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=1e-12, rtol=1e-12)


def test_state_round_trips_through_a_flat_dict_of_paths():
    """The state flattens to {dotted path: tensor} (what a checkpoint stores) and back."""
    import optree

    from hpfunc.tree import path_str

    params = {"layers": [{"wq": randn((4, 4), 0), "norm": randn((4,), 1)}], "embed": randn((6, 4), 2)}
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.muon_adamw(0.02, adam_learning_rate=optim.constant(1e-3)))
    state = tx.init(params)
    grads = [{"layers": [{"wq": randn((4, 4), 3 + i), "norm": randn((4,), 4 + i)}], "embed": randn((6, 4), 5 + i)} for i in range(3)]
    for g in grads[:2]:
        _, state = tx.update(g, state, params)
    paths, leaves, spec = optree.tree_flatten_with_path(state)
    flat = {path_str(p): x.clone() for p, x in zip(paths, leaves)}
    assert len(flat) == len(leaves)  # unique keys
    assert all(isinstance(x, torch.Tensor) for x in flat.values())
    restored = optree.tree_unflatten(spec, [flat[path_str(p)] for p in paths])
    u1, s1 = tx.update(grads[2], state, params)
    u2, s2 = tx.update(grads[2], restored, params)
    for a, b in zip(optree.tree_leaves((u1, s1)), optree.tree_leaves((u2, s2))):
        assert torch.equal(a, b)


def test_non_float_leaf_is_rejected_by_path():
    with pytest.raises(optim.UnsupportedLeafError, match=r"'layers\.0\.step' is dtype torch.int64"):
        optim.adamw(1e-3).init({"layers": [{"step": torch.zeros(2, dtype=torch.int64)}]})


def test_foreach_and_per_leaf_paths_agree(monkeypatch):
    """Plain tensors take fused torch._foreach_* ops; DTensors and mixed dtypes a per-leaf loop.
    Both compute the same thing."""
    from hpfunc.optim import _ops

    shapes = {"a": (4, 3), "b": (7,), "c": ()}
    params0 = {k: randn(s, i) for i, (k, s) in enumerate(sorted(shapes.items()))}
    grads = grad_sequence(shapes, 5, 1)
    tx = optim.chain(optim.clip_by_global_norm(0.5), optim.scale(2.0), optim.adamw(0.05, weight_decay=0.1))
    fused = run_ours(params0, grads, tx)
    monkeypatch.setattr(_ops, "foreachable", lambda *lists: False)
    looped = run_ours(params0, grads, tx)
    for k in fused:
        torch.testing.assert_close(fused[k], looped[k], atol=1e-7, rtol=1e-7)
