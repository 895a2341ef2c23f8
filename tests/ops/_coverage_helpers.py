"""Rank-side helpers for test_operators_doc.py."""

from __future__ import annotations


def probe_page() -> str:
    from hpfunc.ops import coverage

    return coverage.render(coverage.probe())


def run_rows(name: str, mesh_shape: dict, layouts: list, seed: int, k: int) -> tuple[str, str]:
    """One supported layout per mesh axis of ``mesh_shape`` (from the 1-D table) for the row ``name``,
    other values (``seed``) and shapes (``k``): the status against one device."""
    import hpfunc
    from hpfunc.ops import coverage
    from hpfunc.ops.yaml_registry import load_registry, shipped_registry

    load_registry(shipped_registry())
    case = {c.name: c for c in coverage.CASES}[name]
    return coverage.run_layout(case, hpfunc.Mesh(mesh_shape), layouts, seed, k)
