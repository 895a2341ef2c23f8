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
