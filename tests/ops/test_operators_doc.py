"""docs/operators.md is what ``python -m hpfunc.ops.coverage`` writes now, and every supported layout
it lists holds on 1-D and 2-D meshes with other values and shapes (a property test per row)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _coverage_helpers as H
from hpfunc.ops import coverage

pytestmark = pytest.mark.multirank

DOC = Path(__file__).resolve().parents[2] / "docs" / "operators.md"


def _supported() -> dict[str, list[tuple]]:
    """The supported layouts per row, read back from the page."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| `[^`]*` \| (.*?) \| (.*) \|$", line)
        if m:
            layouts = re.findall(r"\(([^)]*)\)->", m.group(2))
            out[m.group(1)] = [tuple(None if p == "R" else int(p[1:]) for p in lay.split(", ")) for lay in layouts]
    return out


def test_the_page_is_current(pool2):
    page = pool2.run(H.probe_page)[0]
    assert page == DOC.read_text(), "docs/operators.md is stale: run python -m hpfunc.ops.coverage --write docs/operators.md"


def test_every_row_is_on_the_page():
    assert sorted(_supported()) == sorted(c.name for c in coverage.CASES)


@settings(max_examples=10)
@given(data=st.data())
def test_supported_layouts_hold_on_other_meshes(pools, data):
    table = {k: v for k, v in _supported().items() if v}
    name = data.draw(st.sampled_from(sorted(table)))
    world, mesh_shape = data.draw(st.sampled_from([(2, {"a": 2}), (4, {"a": 4}), (4, {"a": 2, "b": 2})]))
    layouts = [data.draw(st.sampled_from(table[name])) for _ in mesh_shape]
    seed, k = data.draw(st.integers(0, 2**16)), data.draw(st.sampled_from([1, 2]))
    for status, detail in pools(world).run(H.run_rows, name, mesh_shape, layouts, seed, k):
        assert status == "ok", (name, mesh_shape, layouts, seed, k, detail)
