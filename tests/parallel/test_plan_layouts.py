"""Plan layouts on abstract meshes (no ranks): compositions resolve in either order."""

from __future__ import annotations

import torch

from hpfunc.train.distributed import AbstractMesh
from hpfunc.transforms import plans


def _specs(plan, shapes, mesh):
    res = plan.resolve({k: torch.empty(s) for k, s in shapes.items()}, mesh)
    return {k: (r.spec.storage, r.spec.compute, r.spec.opt) for k, r in res.items()}


def test_zero_before_fsdp_resolves():
    mesh = AbstractMesh({"dp": 2, "fsdp": 2})
    got = _specs(plans.zero2("dp") + plans.fsdp("fsdp"), {"w": (8, 4), "b": (8,)}, mesh)
    # the matrix: zero takes dim 0 for the optimizer state, fsdp the next free dim for storage
    assert got["w"] == (plans.P(None, "fsdp"), plans.P(), plans.P("dp", "fsdp"))
    # the vector: only the zero dim is left; fsdp leaves it replicated rather than break opt-extends-storage
    assert got["b"] == (plans.P(), plans.P(), plans.P("dp"))
    # storage-first order keeps its layout
    got = _specs(plans.fsdp("fsdp") + plans.zero2("dp"), {"w": (8, 4)}, mesh)
    assert got["w"] == (plans.P("fsdp"), plans.P(), plans.P("fsdp", "dp"))


def test_bucket_cap_is_checked_and_combines_once():
    """``Plan.with_bucket_cap``: bytes >= 0 or None; plans combined with + agree on it; the buckets it
    packs are whole layers, merged in the backward's order while they fit (engine/overlap.py)."""
    import pytest

    from hpfunc.layout import LeafLayout, LeafSpec, PlanError
    from hpfunc.mesh import Mesh
    from hpfunc.transforms.engine.overlap import buckets_of

    for bad in (-1, 1.5, True, "25MB"):
        with pytest.raises(PlanError, match="with_bucket_cap: cap_bytes must be an int >= 0"):
            plans.ddp("dp").with_bucket_cap(bad)
    with pytest.raises(PlanError, match="bucket_cap_bytes 0 on the left, 8 on the right"):
        plans.ddp("dp").with_bucket_cap(0) + plans.fsdp("fsdp").with_bucket_cap(8)
    assert (plans.ddp("dp").with_bucket_cap(8) + plans.fsdp("fsdp")).bucket_cap_bytes == 8
    lays = [LeafLayout(p, s, LeafSpec.of(()), replicated=("dp",))
            for p, s in (("embed", (4,)), ("layers.0.w", (2, 2)), ("layers.0.b", (4,)), ("layers.1.w", (8,)))]
    dts = [torch.float32] * 4
    mesh = Mesh({"dp": 1})
    assert buckets_of(lays, dts) == [(("dp",), [3]), (("dp",), [1, 2]), (("dp",), [0])]
    # layers.1 (32 B) + layers.0 (32 B) fit 64 B; the top (16 B) starts a new bucket
    assert buckets_of(lays, dts, cap_bytes=64, mesh=mesh) == [(("dp",), [3, 1, 2]), (("dp",), [0])]
    # a layer over the cap stays whole, alone
    assert buckets_of(lays, dts, cap_bytes=16, mesh=mesh) == [(("dp",), [3]), (("dp",), [1, 2]), (("dp",), [0])]
    assert buckets_of(lays, dts, cap_bytes=1 << 20, mesh=mesh) == [(("dp",), [3, 1, 2, 0])]
