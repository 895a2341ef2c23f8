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
