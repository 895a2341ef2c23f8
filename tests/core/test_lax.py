"""Every hpfunc.lax collective and its gradient against the single-device formula.

Each rank holds its own input ``x_r`` and cotangent ``c_r``; the global function is
``L = sum_r <c_r, op(x)_r>``. The ranks compute ``op`` and ``dL/dx_r`` with hpfunc.lax (through
``torch.autograd.grad`` and through ``torch.func.grad``); this process computes the same with the
collective written as plain tensor algebra on all ranks' tensors and compares.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpfunc.testing import strategies as hst

pytestmark = pytest.mark.multirank

OPS = ["psum", "pmean", "pmax", "pmin", "all_gather", "all_gather_tiled", "psum_scatter", "psum_scatter_tiled",
       "all_to_all", "ppermute"]


def groups(mesh_shape: dict[str, int], axes: tuple[str, ...]) -> dict[int, tuple[list[int], int]]:
    """rank -> (ranks of its group in logical order, its logical index)."""
    names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in names]
    out = {}
    for coord in itertools.product(*[range(s) for s in sizes]):
        rank = 0
        for c, s in zip(coord, sizes):
            rank = rank * s + c
        members = []
        for sub in itertools.product(*[range(mesh_shape[a]) for a in axes]):
            c2 = list(coord)
            for a, v in zip(axes, sub):
                c2[names.index(a)] = v
            r2 = 0
            for c, s in zip(c2, sizes):
                r2 = r2 * s + c
            members.append(r2)
        me = 0
        for a in axes:
            me = me * mesh_shape[a] + coord[names.index(a)]
        out[rank] = (members, me)
    return out


def make_input(seed: int, rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).float()


def reference(op: str, xs: list[torch.Tensor], me: int, p: dict) -> torch.Tensor:
    n = len(xs)
    if op == "psum":
        return torch.stack(xs).sum(0)
    if op == "pmean":
        return torch.stack(xs).mean(0)
    if op == "pmax":
        return torch.stack(xs).amax(0)
    if op == "pmin":
        return torch.stack(xs).amin(0)
    if op == "all_gather":
        return torch.stack(xs, dim=p["dim"])
    if op == "all_gather_tiled":
        return torch.cat(xs, dim=p["dim"])
    if op == "psum_scatter":
        return torch.stack(xs).sum(0).select(p["dim"], me)
    if op == "psum_scatter_tiled":
        return torch.stack(xs).sum(0).chunk(n, dim=p["dim"])[me]
    if op == "all_to_all":
        return torch.cat([x.chunk(n, dim=p["split"])[me] for x in xs], dim=p["concat"])
    if op == "ppermute":
        src = [s for s, d in p["perm"] if d == me]
        return xs[src[0]] if src else torch.zeros_like(xs[me])
    raise AssertionError(op)


def apply_op(op: str, x: torch.Tensor, axes, p: dict) -> torch.Tensor:
    from hpfunc import lax

    if op in ("psum", "pmean", "pmax", "pmin"):
        return getattr(lax, op)(x, axes)
    if op == "all_gather":
        return lax.all_gather(x, axes, axis=p["dim"])
    if op == "all_gather_tiled":
        return lax.all_gather(x, axes, axis=p["dim"], tiled=True)
    if op == "psum_scatter":
        return lax.psum_scatter(x, axes, scatter_dimension=p["dim"])
    if op == "psum_scatter_tiled":
        return lax.psum_scatter(x, axes, scatter_dimension=p["dim"], tiled=True)
    if op == "all_to_all":
        return lax.all_to_all(x, axes, p["split"], p["concat"])
    if op == "ppermute":
        return lax.ppermute(x, axes, p["perm"])
    raise AssertionError(op)


def run_on_rank(mesh_shape, axes, op, shape, out_shape, p, seed):
    import torch.distributed as dist

    import hpfunc

    mesh = hpfunc.Mesh(mesh_shape)
    r = dist.get_rank()
    x = make_input(seed, r, shape).requires_grad_(True)
    c = make_input(seed + 7, r, out_shape)
    with mesh:
        out = apply_op(op, x, axes, p)
        (g,) = torch.autograd.grad((out * c).sum(), x)
        g_func = torch.func.grad(lambda t: (apply_op(op, t, axes, p) * c).sum())(x.detach())
    return out.detach(), g, g_func


def _case(data, world):
    mesh_shape = data.draw(hst.mesh_shapes(world))
    axes = data.draw(hst.axis_subsets(mesh_shape))
    n = math.prod(mesh_shape[a] for a in axes)
    op = data.draw(st.sampled_from(OPS))
    shape = list(data.draw(hst.shapes(1, 3, 1, 5)))
    p: dict = {}
    if op in ("all_gather", "all_gather_tiled"):
        p["dim"] = data.draw(st.integers(0, len(shape) if op == "all_gather" else len(shape) - 1))
    elif op == "psum_scatter":
        p["dim"] = data.draw(st.integers(0, len(shape) - 1))
        shape[p["dim"]] = n
    elif op == "psum_scatter_tiled":
        p["dim"] = data.draw(st.integers(0, len(shape) - 1))
        shape[p["dim"]] = n * data.draw(st.integers(1, 3))
    elif op == "all_to_all":
        p["split"] = data.draw(st.integers(0, len(shape) - 1))
        p["concat"] = data.draw(st.integers(0, len(shape) - 1))
        shape[p["split"]] = n * data.draw(st.integers(1, 3))
    elif op == "ppermute":
        kind = data.draw(st.sampled_from(["shift", "random"]))
        if kind == "shift":
            k = data.draw(st.integers(1, max(1, n - 1)))
            p["perm"] = [(i, (i + k) % n) for i in range(n)]
        else:
            dst = data.draw(st.permutations(list(range(n))))
            keep = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
            p["perm"] = [(i, d) for i, (d, k) in enumerate(zip(dst, keep)) if k]
    seed = data.draw(hst.seeds())
    return mesh_shape, tuple(axes), op, tuple(shape), p, seed


def _check(pools, world, case):
    mesh_shape, axes, op, shape, p, seed = case
    grp = groups(mesh_shape, axes)
    xs_all = {r: make_input(seed, r, shape).double().requires_grad_(True) for r in range(world)}
    outs = {}
    for r in range(world):
        members, me = grp[r]
        outs[r] = reference(op, [xs_all[m] for m in members], me, p)
    cs = {r: make_input(seed + 7, r, outs[r].shape).double() for r in range(world)}
    loss = sum((outs[r] * cs[r]).sum() for r in range(world))
    if not loss.requires_grad:  # e.g. an empty permutation: every output is zeros
        loss = loss + 0 * sum(x.sum() for x in xs_all.values())
    grads = torch.autograd.grad(loss, [xs_all[r] for r in range(world)], allow_unused=True)
    grads = [torch.zeros_like(xs_all[r]) if g is None else g for r, g in enumerate(grads)]
    res = pools(world).run(run_on_rank, mesh_shape, axes, op, shape, tuple(outs[0].shape), p, seed)
    for r, (out, g, g_func) in enumerate(res):
        where = f"{op} over {axes} on mesh {mesh_shape}, rank {r}"
        torch.testing.assert_close(out.double(), outs[r].detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} value: {m}")
        torch.testing.assert_close(g.double(), grads[r], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} grad: {m}")
        torch.testing.assert_close(g_func, g, rtol=0, atol=0, msg=lambda m: f"{where} torch.func.grad: {m}")


@given(data=st.data())
def test_collectives_match_formula_2_and_4_ranks(pools, data):
    world = data.draw(st.sampled_from([2, 4]))
    _check(pools, world, _case(data, world))


@settings(max_examples=12)
@given(data=st.data())
def test_collectives_match_formula_8_ranks(pools, data):
    _check(pools, 8, _case(data, 8))


def run_unequal_a2a(mesh_shape, axis, sizes, width, seed):
    import torch.distributed as dist

    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh(mesh_shape)
    r = dist.get_rank()
    me = mesh.axis_index(axis)
    x = make_input(seed, r, (sum(sizes[me]), width)).requires_grad_(True)
    c = make_input(seed + 7, r, (sum(row[me] for row in sizes), width))
    with mesh:
        out = lax.all_to_all(x, axis, 0, 0, split_sizes=sizes[me])
        (g,) = torch.autograd.grad((out * c).sum(), x)
    return out.detach(), g


@given(data=st.data())
def test_all_to_all_unequal_splits(pools, data):
    world = data.draw(st.sampled_from([2, 4]))
    mesh_shape = {"x": world}
    sizes = [[data.draw(st.integers(0, 3)) for _ in range(world)] for _ in range(world)]
    width = data.draw(st.integers(1, 3))
    seed = data.draw(hst.seeds())
    xs = [make_input(seed, r, (sum(sizes[r]), width)).double().requires_grad_(True) for r in range(world)]
    outs = [torch.cat([xs[j].split(sizes[j])[me] for j in range(world)]) for me in range(world)]
    cs = [make_input(seed + 7, r, outs[r].shape).double() for r in range(world)]
    grads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(outs, cs)), xs)
    res = pools(world).run(run_unequal_a2a, mesh_shape, "x", sizes, width, seed)
    for r, (out, g) in enumerate(res):
        torch.testing.assert_close(out.double(), outs[r].detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g.double(), grads[r], rtol=1e-6, atol=1e-6)


def run_axis_queries(mesh_shape):
    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh(mesh_shape)
    names = list(mesh_shape)
    with mesh:
        return {
            "index": {a: lax.axis_index(a) for a in names},
            "size": {a: lax.axis_size(a) for a in names},
            "index_all_rev": lax.axis_index(tuple(reversed(names))),
            "size_all": lax.axis_size(tuple(names)),
        }


def test_axis_index_and_size(pool4):
    res = pool4.run(run_axis_queries, {"x": 2, "y": 2})
    for r, out in enumerate(res):
        assert out["index"] == {"x": r // 2, "y": r % 2}
        assert out["size"] == {"x": 2, "y": 2} and out["size_all"] == 4
        assert out["index_all_rev"] == (r % 2) * 2 + r // 2


def run_bad_axes(kind):
    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh({"dp": 2})
    x = torch.ones(2)
    if kind == "unknown":
        with mesh:
            lax.psum(x, "tp")
    elif kind == "twice":
        with mesh:
            lax.psum(x, ("dp", "dp"))
    elif kind == "no_mesh":
        lax.psum(x, "dp")
    elif kind == "scatter_size":
        with mesh:
            lax.psum_scatter(torch.ones(3), "dp", tiled=True)
    elif kind == "perm":
        with mesh:
            lax.ppermute(x, "dp", [(0, 2)])


@pytest.mark.parametrize(
    "kind,match",
    [("unknown", "unknown mesh axis 'tp'"), ("twice", "twice"), ("no_mesh", "current mesh"),
     ("scatter_size", "divisible by 2"), ("perm", "out of range")],
)
def test_bad_axis_arguments(pool2, kind, match):
    with pytest.raises(ValueError, match=match):
        pool2.run(run_bad_axes, kind)


def run_async_a2a(mesh_shape, axis, sizes, width, seed):
    """``all_to_all_start(...).wait()`` and its backward against ``all_to_all`` on the same rows; a second
    start issued while the first is in flight; the counter sees both, forward and backward."""
    import torch.distributed as dist

    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh(mesh_shape)
    r = dist.get_rank()
    me = mesh.axis_index(axis)
    x = make_input(seed, r, (sum(sizes[me]), width)).requires_grad_(True)
    c = make_input(seed + 7, r, (sum(row[me] for row in sizes), width))
    with mesh, hpfunc.comm_stats() as stats:
        first = lax.all_to_all_start(x * 2.0, axis, split_sizes=sizes[me])
        second = lax.all_to_all_start(x, axis, split_sizes=sizes[me], recv_sizes=[row[me] for row in sizes])
        out = first.wait() + second.wait() * 3.0  # waited for in either order
        (g,) = torch.autograd.grad((out * c).sum(), x)
        want = lax.all_to_all(x, axis, 0, 0, split_sizes=sizes[me]) * 5.0
        (g_want,) = torch.autograd.grad((want * c).sum(), x)
        with pytest.raises(RuntimeError, match="already waited for"):
            first.wait()
    starts = [(rec.phase, rec.payload_bytes) for rec in stats.records if rec.name == "all_to_all_start"]
    return out.detach(), want.detach(), g, g_want, starts


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_all_to_all_start_equals_all_to_all_and_transposes(pools, data):
    mesh_shape, axis = data.draw(st.sampled_from([({"x": 2}, "x"), ({"x": 4}, "x"), ({"a": 2, "b": 2}, ("b", "a"))]))
    world = 4 if len(mesh_shape) == 2 or mesh_shape.get("x") == 4 else 2
    n = 4 if world == 4 else 2
    sizes = [[data.draw(st.integers(0, 3)) for _ in range(n)] for _ in range(n)]
    width = data.draw(st.integers(1, 3))
    res = pools(world).run(run_async_a2a, mesh_shape, axis, sizes, width, data.draw(hst.seeds()))
    for out, want, g, g_want, starts in res:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g, g_want, rtol=1e-6, atol=1e-6)
        assert [p for p, _ in starts] == ["forward", "forward", "backward", "backward"], starts


def run_inputs_unchanged(mesh_shape, axis):
    """Each collective on a contiguous input and on a non-contiguous one: the inputs keep their values
    (``psum_scatter`` hands its input to the reduce-scatter without a copy: the backend only reads it)."""
    import torch.distributed as dist

    import hpfunc

    mesh = hpfunc.Mesh(mesh_shape)
    r = dist.get_rank()
    n = mesh.axis_size(axis)
    changed = []
    for op in OPS:
        p = {"dim": 0, "split": 0, "concat": 0, "perm": [(i, (i + 1) % n) for i in range(n)]}
        for transpose in (False, True):
            x = make_input(3, r, (n, 2 * n) if not transpose else (2 * n, n))
            x = x.t() if transpose else x  # (n, 2n) either way; the second not contiguous
            before = x.clone()
            with mesh:
                apply_op(op, x, axis, p)
            if not torch.equal(x, before):
                changed.append((op, transpose))
    return changed


def test_collectives_leave_their_input_unchanged(pool2):
    assert pool2.run(run_inputs_unchanged, {"x": 2}, "x") == [[], []]
