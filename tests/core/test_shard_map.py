"""shard_map of random compositions equals the unsharded function, in values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpfunc import P
from hpfunc.testing import strategies as hst

pytestmark = pytest.mark.multirank

KINDS = ["elementwise", "matmul_psum", "gather_scatter", "all_to_all_roundtrip", "replicated_weight", "pmax_norm"]


def build(kind: str, mesh_shape: dict, axes: tuple, dims: dict):
    """(local function, in_specs, out_specs, reference function, input shapes)."""
    from hpfunc import lax

    n = math.prod(mesh_shape[a] for a in axes)
    a = axes if len(axes) > 1 else axes[0]
    sorted_axes = tuple(sorted(axes, key=list(mesh_shape).index))
    a_sorted = sorted_axes if len(sorted_axes) > 1 else sorted_axes[0]
    m, k, j = dims["m"], dims["k"] * n, dims["j"]
    if kind == "elementwise":
        def f(x, y):
            return torch.sin(x) * y + x * x
        return f, (P(a_sorted), P(a_sorted)), P(a_sorted), f, [(k, m), (k, m)]
    if kind == "matmul_psum":
        # contraction dimension split: partial products summed over the axes
        def f(x, w):
            return lax.psum(x @ w, a)
        return f, (P(None, a_sorted), P(a_sorted, None)), P(), lambda x, w: x @ w, [(m, k), (k, j)]
    if kind == "gather_scatter":
        def f(x):
            full = lax.all_gather(x, a_sorted, axis=0, tiled=True)
            return lax.psum_scatter(full * full, a_sorted, scatter_dimension=0, tiled=True)
        return f, (P(a_sorted),), P(a_sorted), lambda x: n * x * x, [(k, m)]
    if kind == "all_to_all_roundtrip":
        def f(x):
            y = lax.all_to_all(x, a_sorted, 1, 0)  # (k/n, m*n?) -> rows gathered, columns split
            y = torch.tanh(y)
            return lax.all_to_all(y, a_sorted, 0, 1)
        return f, (P(a_sorted),), P(a_sorted), torch.tanh, [(k, m * n)]
    if kind == "replicated_weight":
        # a weight replicated on every axis, used with sharded data: its gradient sums over replicas
        def f(x, w):
            return lax.psum((torch.tanh(x @ w) ** 2).sum(), a)
        return f, (P(a_sorted), P()), P(), lambda x, w: (torch.tanh(x @ w) ** 2).sum(), [(k, m), (m, j)]
    if kind == "pmax_norm":
        def f(x):
            mx = lax.pmax(x.abs().amax(), a)
            return x / mx
        return f, (P(a_sorted),), P(a_sorted), lambda x: x / x.abs().amax(), [(k, m)]
    raise AssertionError(kind)


def run_case(kind, mesh_shape, axes, dims, seed):
    import hpfunc
    from hpfunc.testing import assert_parity

    mesh = hpfunc.Mesh(mesh_shape)
    f, in_specs, out_specs, ref, shapes = build(kind, mesh_shape, axes, dims)
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(s, generator=g, dtype=torch.float64).float() for s in shapes]
    sharded = hpfunc.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def loss(*xs):
        out = sharded(*xs).full_tensor()
        c = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        return (out * c).sum()

    def loss_ref(*xs):
        out = ref(*xs)
        c = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        return (out * c).sum()

    assert_parity(loss, loss_ref, *args, argnums=tuple(range(len(args))), rtol=1e-5, atol=1e-5)
    # and the same with DTensor inputs already sharded by in_specs
    dargs = [hpfunc.shard(x, mesh, s) for x, s in zip(args, in_specs)]
    assert_parity(loss, loss_ref, *dargs, argnums=tuple(range(len(args))), rtol=1e-5, atol=1e-5)
    return True


@given(data=st.data())
def test_random_compositions_match_unsharded(pools, data):
    world = data.draw(st.sampled_from([2, 4, 8]))
    mesh_shape = data.draw(hst.mesh_shapes(world))
    axes = data.draw(hst.axis_subsets(mesh_shape))
    kind = data.draw(st.sampled_from(KINDS))
    dims = {"m": data.draw(st.integers(1, 4)), "k": data.draw(st.integers(1, 3)), "j": data.draw(st.integers(1, 3))}
    seed = data.draw(hst.seeds())
    assert all(pools(world).run(run_case, kind, mesh_shape, tuple(axes), dims, seed))


def run_decorator_and_grad():
    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh({"dp": 2})

    @hpfunc.shard_map(mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    def loss(x, w):
        return lax.psum(((x @ w) ** 2).sum(), "dp")

    x = torch.arange(8.0).reshape(4, 2)
    w = torch.ones(2, 3)
    value, (gx, gw) = hpfunc.value_and_grad(lambda x, w: loss(x, w).full_tensor(), argnums=(0, 1))(x, w)
    ref_v, (rx, rw) = hpfunc.value_and_grad(lambda x, w: ((x @ w) ** 2).sum(), argnums=(0, 1))(x, w)
    return float(value), float(ref_v), torch.equal(gx, rx), torch.allclose(gw, rw), loss.__name__


def test_decorator_and_value_and_grad(pool2):
    for v, rv, gx_ok, gw_ok, name in pool2.run(run_decorator_and_grad):
        assert v == rv and gx_ok and gw_ok and name == "loss"


def run_bad(kind):
    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh({"dp": 2, "tp": 1})
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    if kind == "varying_out":
        # local blocks differ across dp but the out_spec claims replication along dp
        hpfunc.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("dp"), out_specs=P(), check_rep=True)(x)
    if kind == "unknown_axis":
        hpfunc.shard_map(lambda x: x, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x)
    if kind == "indivisible":
        hpfunc.shard_map(lambda x: x, mesh=mesh, in_specs=P(None, "dp"), out_specs=P(None, "dp"))(torch.ones(4, 3))
    if kind == "too_long":
        hpfunc.shard_map(lambda x: x, mesh=mesh, in_specs=P("dp", None, None), out_specs=P())(x)
    if kind == "in_specs_count":
        hpfunc.shard_map(lambda x, y: x, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))(x, x)
    if kind == "tree_path":
        hpfunc.shard_map(lambda t: t["a"], mesh=mesh, in_specs=({"a": P("dp"), "b": P("dp", "dp")},),
                         out_specs=P("dp"))({"a": x, "b": x})
    if kind == "ok_psum":
        out = hpfunc.shard_map(lambda x: lax.psum(x, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P(),
                               check_rep=True)(x)
        return hpfunc.typeof(out)


@pytest.mark.parametrize(
    "kind,match",
    [
        ("varying_out", r"promises replication along mesh axis 'dp'"),
        ("unknown_axis", r"unknown mesh axis 'ep'"),
        ("indivisible", r"args\[0\] has dimension 1 of size 3, not divisible by 2"),
        ("too_long", r"has 3 entries but the tensor has rank 2"),
        ("in_specs_count", r"one entry per positional argument \(2\)"),
        ("tree_path", r"'args\[0\].b' uses mesh axis 'dp' twice"),
    ],
)
def test_bad_input_errors(pool2, kind, match):
    with pytest.raises(ValueError, match=match):
        pool2.run(run_bad, kind)


def test_replicated_psum_passes_check(pool2):
    assert pool2.run(run_bad, "ok_psum")[0] == "f32[2,2]"


# ---------------------------------------------------------------------------------------------
# The replication check: the default (checksums, one all-reduce per call), exact, off, per output


def _with_check_env(value, fn):
    """``fn()`` with HPFUNC_CHECK_REP set to ``value`` in this rank (unset for None), then restored."""
    import os

    old = os.environ.pop("HPFUNC_CHECK_REP", None)
    try:
        if value is not None:
            os.environ["HPFUNC_CHECK_REP"] = value
        return fn()
    finally:
        os.environ.pop("HPFUNC_CHECK_REP", None)
        if old is not None:
            os.environ["HPFUNC_CHECK_REP"] = old


def _outcome(fn):
    from hpfunc.transforms.shard_map import ReplicationError

    try:
        return "ok", fn()
    except ReplicationError as e:
        return "ReplicationError", str(e)
    except ValueError as e:
        return "ValueError", str(e)


def run_rep_check(env, check_rep, kind="broken"):
    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh({"dp": 2})
    x = torch.arange(8.0).reshape(4, 2)

    def f(x):  # loss is reduced; stats.local is this rank's own sum, promised replicated all the same
        out = {"loss": lax.psum(x.sum(), "dp"), "stats": {"local": x.sum(), "n": torch.tensor(x.shape[0])}}
        if kind == "correct":
            out["stats"]["local"] = lax.pmax(out["stats"]["local"], "dp")
        return out

    g = hpfunc.shard_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P(), check_rep=check_rep)

    def call():
        with hpfunc.comm_stats() as stats:
            out = g(x)
        return float(out["loss"].full_tensor()), sum(r.name == "check_rep" for r in stats.records)

    return _with_check_env(env, lambda: _outcome(call))


def test_default_check_catches_a_broken_replication_promise(pool2):
    # HPFUNC_CHECK_REP unset: the default, checksums
    for kind, msg in pool2.run(run_rep_check, None, None):
        assert kind == "ReplicationError", (kind, msg)
        assert msg.startswith("shard_map output 'stats.local': out_spec promises replication along mesh axis 'dp', "
                              "but rank 1 along 'dp' holds a different value than rank 0"), msg
        assert "sums 22.0 vs 6.0 of 1 vs 1 elements" in msg and "check_rep='checksum'" in msg, msg
        assert "hpfunc.lax.psum/pmean over 'dp'" in msg, msg
    # three replicated outputs, one all-reduce (recorded by comm_stats as 'check_rep')
    assert pool2.run(run_rep_check, None, None, "correct") == [("ok", (28.0, 1))] * 2
    # the suite's HPFUNC_CHECK_REP=1 is the exact check (no checksum all-reduce)
    for kind, msg in pool2.run(run_rep_check, "1", None):
        assert kind == "ReplicationError" and "'stats.local'" in msg and "largest abs difference 16.0" in msg, msg
    assert pool2.run(run_rep_check, "1", None, "correct") == [("ok", (28.0, 0))] * 2


@pytest.mark.parametrize("env", [None, "1", "checksum"])
def test_check_rep_false_skips_the_check(pool2, env):
    assert pool2.run(run_rep_check, env, False) == [("ok", (28.0, 0))] * 2
    # per output: the broken one unchecked, the loss checked as the environment says (by checksum unless exact)
    assert pool2.run(run_rep_check, env, {"loss": None, "stats": False}) == [("ok", (28.0, int(env != "1")))] * 2


def test_check_rep_modes_env_and_errors(pool2):
    # explicit modes win over the environment; "trusted" is checked (exactly) only when exact checks are asked for
    assert pool2.run(run_rep_check, "1", "checksum")[0][1].endswith(
        "or name 'dp' in the out_spec"), "checksum named explicitly must run under HPFUNC_CHECK_REP=1 too"
    assert "check_rep='checksum'" in pool2.run(run_rep_check, "1", "checksum")[0][1]
    assert "largest abs difference" in pool2.run(run_rep_check, None, "exact")[0][1]
    assert pool2.run(run_rep_check, None, "trusted") == [("ok", (28.0, 0))] * 2
    assert "largest abs difference" in pool2.run(run_rep_check, "exact", "trusted")[0][1]
    assert pool2.run(run_rep_check, "0", None) == [("ok", (28.0, 0))] * 2
    kind, msg = pool2.run(run_rep_check, "maybe", None)[0]
    assert kind == "ValueError" and "HPFUNC_CHECK_REP='maybe'" in msg and "'checksum'" in msg, msg
    with pytest.raises(ValueError, match=r"check_rep='always'\): expected None"):
        __import__("hpfunc").shard_map(lambda x: x, in_specs=P(), out_specs=P(), check_rep="always")
    with pytest.raises(ValueError, match=r"check_rep='sometimes'"):
        __import__("hpfunc").shard_map(lambda x: x, in_specs=P(), out_specs=P(), check_rep={"a": "sometimes"})


def run_rep_check_2d(check_rep):
    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh({"dp": 2, "tp": 2})
    x = torch.arange(16.0).reshape(4, 4)

    def f(x):
        dp, tp = mesh.axis_index("dp"), mesh.axis_index("tp")
        ok_tp = lax.psum(x, "tp")                         # replicated along tp, sharded along dp
        col = lax.psum(x, "dp") + (1.0 if (dp, tp) == (1, 1) else 0.0)  # differs along dp at tp=1 only
        return {"ok_all": lax.psum(x.sum(), ("dp", "tp")), "ok_tp": ok_tp, "col": col}

    out_specs = {"ok_all": P(), "ok_tp": P("dp"), "col": P(None, "tp")}
    return _outcome(lambda: hpfunc.typeof(
        hpfunc.shard_map(f, mesh=mesh, in_specs=P("dp", "tp"), out_specs=out_specs, check_rep=check_rep)(x)["ok_tp"]))


@pytest.mark.parametrize("check_rep", ["checksum", "exact"])
def test_check_names_the_axis_and_ranks_on_a_2d_mesh(pool4, check_rep):
    outs = pool4.run(run_rep_check_2d, check_rep)
    # one decision for the whole union of the replicated axes: every rank raises the same error, those at
    # tp=0 (where 'col' agrees) too; a rank left out would wait in the next collective for the others
    assert [kind for kind, _ in outs] == ["ReplicationError"] * 4 and len({msg for _, msg in outs}) == 1, outs
    msg = outs[0][1]
    assert msg.startswith("shard_map output 'col': out_spec promises replication along mesh axis 'dp', but rank 1 "
                          "along 'dp' holds a different value than rank 0 (global ranks 3 vs 1, at tp=1"), msg


def run_rep_check_submesh(check_rep):
    import hpfunc

    sub = hpfunc.Mesh({"dp": 2, "tp": 2}).submesh("tp")  # global ranks (0, 1) or (2, 3)
    f = hpfunc.shard_map(lambda x: x * 2, mesh=sub, in_specs=P("tp"), out_specs=P(), check_rep=check_rep)
    return _outcome(lambda: f(torch.arange(4.0)))


@pytest.mark.parametrize("check_rep", ["checksum", "exact"])
def test_check_on_a_submesh_names_global_ranks(pool4, check_rep):
    outs = pool4.run(run_rep_check_submesh, check_rep)
    for r, (kind, msg) in enumerate(outs):
        first = r - r % 2
        assert kind == "ReplicationError" and msg.startswith(
            "shard_map output '<root>': out_spec promises replication along mesh axis 'tp', but rank 1 along 'tp' "
            f"holds a different value than rank 0 (global ranks {first + 1} vs {first}:"), (r, msg)


def run_rep_check_values(case, rtol=0.0):
    import hpfunc

    mesh = hpfunc.Mesh({"dp": 2})
    r = mesh.axis_index("dp")
    nan = float("nan")
    values = {
        "same_kinds": lambda: {"i": torch.tensor([3, -1]), "b": torch.tensor([True, False]),
                               "h": torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
                               "c": torch.tensor([1 + 2j]), "nan": torch.tensor([1.0, nan]), "e": torch.ones(0)},
        "nan_on_one_rank": lambda: {"v": torch.tensor([1.0, nan if r else 2.0])},
        "other_length": lambda: {"v": torch.ones(3 + r)},
        "int_differs": lambda: {"v": torch.tensor([2**40 + r])},
        "tiny_difference": lambda: {"v": torch.tensor([1.0, 2.0]) * (1 + 1e-6 * r)},
    }
    return _outcome(lambda: sorted(hpfunc.shard_map(values[case], mesh=mesh, in_specs=(), out_specs=P(),
                                                    check_rep="checksum", check_rtol=rtol)()))


def test_checksum_check_on_dtypes_nans_lengths_and_tolerance(pool2):
    assert pool2.run(run_rep_check_values, "same_kinds") == [("ok", ["b", "c", "e", "h", "i", "nan"])] * 2
    kind, msg = pool2.run(run_rep_check_values, "nan_on_one_rank")[0]
    assert kind == "ReplicationError" and "'v'" in msg and "nan" not in msg.split("(")[0], msg
    kind, msg = pool2.run(run_rep_check_values, "other_length")[0]
    assert kind == "ReplicationError" and "of 4 vs 3 elements" in msg, msg
    assert pool2.run(run_rep_check_values, "int_differs")[0][0] == "ReplicationError"
    assert pool2.run(run_rep_check_values, "tiny_difference")[0][0] == "ReplicationError"
    assert pool2.run(run_rep_check_values, "tiny_difference", 1e-5) == [("ok", ["v"])] * 2


def run_parallelize_metric(env, per_rank_metric):
    import hpfunc
    from hpfunc import optim
    from hpfunc.transforms import plans

    tx = optim.adamw(0.1)

    def step(state, batch):
        loss, g = hpfunc.value_and_grad(lambda p: ((batch @ p["w"]) ** 2).mean())(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        metrics = {"loss": loss}
        if per_rank_metric:
            metrics["batch_max"] = batch.max()  # this rank's data shard only: not replicated
        return {"params": optim.apply_updates(state["params"], u), "opt": opt}, metrics

    train_step = hpfunc.parallelize(step, hpfunc.Mesh({"dp": 2}), plans.ddp("dp"))
    params = train_step.shard_params({"w": torch.ones(3, 2)})
    state = train_step.init_state(lambda p: {"params": p, "opt": tx.init(p)}, params)
    batch = torch.arange(12.0).reshape(4, 3) / 12

    def call():
        with hpfunc.comm_stats() as stats:
            _, metrics = train_step(state, batch)
        checks = [r.payload_bytes for r in stats.records if r.name == "check_rep"]
        return sorted(metrics), checks

    return _with_check_env(env, lambda: _outcome(call))


def test_parallelize_trusts_its_outputs_unless_asked(pool2):
    # default: nothing is checked on the hot path (the state and the metrics are replicated by construction),
    # so a per-rank metric passes unnoticed -- as the docs say; HPFUNC_CHECK_REP=checksum checks everything
    # with one all-reduce (the state's leaves and the loss: sum and count, max and min, as float64) and
    # catches it; the suite's exact mode checks everything exactly (no checksum all-reduce)
    assert pool2.run(run_parallelize_metric, None, False) == [("ok", (["loss"], []))] * 2
    assert pool2.run(run_parallelize_metric, None, True) == [("ok", (["batch_max", "loss"], []))] * 2
    outcome = pool2.run(run_parallelize_metric, "checksum", False)
    assert all(kind == "ok" and len(checks) == 1 for kind, (_, checks) in outcome), outcome
    for kind, msg in pool2.run(run_parallelize_metric, "checksum", True):
        assert kind == "ReplicationError" and msg.startswith(
            "shard_map output '1.batch_max': out_spec promises replication along mesh axis 'dp'"), msg
    for kind, msg in pool2.run(run_parallelize_metric, "1", True):
        assert kind == "ReplicationError" and "'1.batch_max'" in msg, msg
    assert pool2.run(run_parallelize_metric, "1", False) == [("ok", (["loss"], []))] * 2
