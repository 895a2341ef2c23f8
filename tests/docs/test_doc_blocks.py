"""Every fenced python block of README.md and docs/ runs (or is marked a fragment of an example on the
same page that runs): one-process blocks in this process, a page's blocks in one namespace; ``# ranks: N``
blocks on a pool of N gloo ranks (tests/docs/_doc_blocks.py says how a block is marked)."""

from __future__ import annotations

import os
import tempfile

import pytest

import _doc_blocks as D

PAGES = [p for p in D.pages() if D.blocks(p)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(D.ROOT)) for p in PAGES])
def test_every_python_block_of_the_page_runs(page, pools):
    ns: dict = {"__name__": "__main__"}
    old = os.getcwd()
    for block in D.blocks(page):
        if block.fragment:
            continue
        if block.ranks > 1:
            assert pools(block.ranks).run(D.run_block, block.code, block.id) == ["ok"] * block.ranks, block.id
            continue
        with tempfile.TemporaryDirectory() as d:
            os.chdir(d)
            try:
                exec(compile(block.code, block.id, "exec"), ns)
            finally:
                os.chdir(old)


def test_fragments_name_the_full_example_and_the_page_has_one():
    for page in D.pages():
        bs = D.blocks(page)
        for b in bs:
            if b.fragment:
                assert any(not o.fragment for o in bs), f"{b.id}: a fragment on a page without a full example"
