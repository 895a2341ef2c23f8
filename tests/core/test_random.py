"""hpfunc.random: keys are values, and samples are the same for every sharding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpfunc import P
from hpfunc import random as hr
from hpfunc.testing import strategies as hst


def test_threefry_known_answer():
    # Random123 known-answer test for Threefry-2x32-20 with a zero key and counter.
    w0, w1 = hr._threefry2x32(0, 0, torch.tensor([0]), torch.tensor([0]))
    assert (int(w0), int(w1)) == (0x6B200159, 0x99BA4EFE)
    m = 0xFFFFFFFF
    w0, w1 = hr._threefry2x32(m, m, torch.tensor([m]), torch.tensor([m]))
    assert (int(w0), int(w1)) == (0x1CB996FC, 0xBB002BE7)


def test_keys_are_values():
    k = hr.key(7)
    a, b = hr.split(k)
    assert not torch.equal(a, b)
    assert torch.equal(hr.split(k), hr.split(k))
    assert torch.equal(hr.fold_in(k, 3), hr.fold_in(k, 3))
    assert not torch.equal(hr.fold_in(k, 3), hr.fold_in(k, 4))
    assert not any(torch.equal(hr.fold_in(k, 0), s) for s in hr.split(k, 4))
    before = torch.random.get_rng_state()
    hr.normal(k, (5,))
    assert torch.equal(before, torch.random.get_rng_state()), "sampling must not touch torch's global RNG"
    with pytest.raises(TypeError, match="expected a key"):
        hr.normal(torch.zeros(3), (2,))


def test_distributions_look_right():
    k = hr.key(0)
    x = hr.normal(k, (200_000,))
    assert abs(x.mean()) < 0.01 and abs(x.std() - 1) < 0.01
    u = hr.uniform(k, (200_000,), minval=-2, maxval=3)
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.02
    r = hr.randint(k, (100_000,), 3, 8)
    assert set(r.unique().tolist()) == {3, 4, 5, 6, 7}
    b = hr.bernoulli(k, 0.25, (100_000,))
    assert abs(b.float().mean() - 0.25) < 0.01
    t = hr.truncated_normal(k, (100_000,), lower=-1, upper=1)
    assert t.min() >= -1 and t.max() <= 1
    p = hr.permutation(k, 50)
    assert sorted(p.tolist()) == list(range(50))


SAMPLERS = ["normal", "uniform", "randint", "bernoulli", "bits"]


def sample(name, k, shape, **kw):
    if name == "normal":
        return hr.normal(k, shape, **kw)
    if name == "uniform":
        return hr.uniform(k, shape, **kw)
    if name == "randint":
        return hr.randint(k, shape, -5, 11, **kw)
    if name == "bernoulli":
        return hr.bernoulli(k, 0.3, shape, **kw)
    return hr.bits(k, shape, **kw)


def run_invariance(mesh_shape, shape, spec, name, seed):
    import hpfunc
    from hpfunc import NamedSharding

    mesh = hpfunc.Mesh(mesh_shape)
    k = hr.key(seed)
    sharded = sample(name, k, shape, sharding=NamedSharding(mesh, spec))
    single = sample(name, k, shape)
    # inside shard_map: the local block for an evenly split spec
    even = all(shape[d] % mesh.axis_size(spec.dim_axes(d)) == 0 for d in range(len(shape)))
    local_ok = True
    if even:
        out = hpfunc.shard_map(lambda: sample(name, k, shape, spec=spec), mesh=mesh, in_specs=(), out_specs=spec)()
        local_ok = torch.equal(out.full_tensor(), single)
    return torch.equal(sharded.full_tensor(), single), hpfunc.typeof(sharded), local_ok


@pytest.mark.multirank
@given(data=st.data())
def test_samplers_are_sharding_invariant(pools, data):
    world = data.draw(st.sampled_from([2, 4, 8]))
    mesh_shape = data.draw(hst.mesh_shapes(world))
    shape = data.draw(hst.shapes(1, 3, 1, 9))
    spec = data.draw(hst.specs(shape, mesh_shape, even=data.draw(st.booleans())))
    name = data.draw(st.sampled_from(SAMPLERS))
    seed = data.draw(hst.seeds())
    for same, t, local_ok in pools(world).run(run_invariance, mesh_shape, shape, spec, name, seed):
        assert same, f"{name}{shape} with {spec} on {mesh_shape} differs from the single-device sample"
        assert local_ok, f"{name}{shape} sampled inside shard_map with spec={spec} differs"


def run_dropout(seed):
    import hpfunc

    mesh = hpfunc.Mesh({"dp": 2, "tp": 2})
    k = hr.key(seed)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))
    ref = hr.dropout(k, x, 0.3)
    tp = hpfunc.shard_map(lambda v: hr.dropout(k, v, 0.3, spec=P("dp", "tp")), mesh=mesh,
                          in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))(x)
    dt = hr.dropout(k, hpfunc.shard(x, mesh, P(("dp", "tp"))), 0.3)
    return torch.equal(tp.full_tensor(), ref), torch.equal(dt.full_tensor(), ref)


@pytest.mark.multirank
def test_dropout_matches_single_device_under_tp(pool4):
    for a, b in pool4.run(run_dropout, 5):
        assert a and b
