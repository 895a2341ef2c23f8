"""Checkpoints of pipelined train states: each pipeline rank saves and loads only its stages' keys.

Saved on fsdp 4 and loaded on pp 2 x fsdp 2 (each rank reads its stages' blocks), saved on pp 2 x fsdp 2
and loaded on fsdp 4, on fsdp 2 x pp 2 (the other axis order) and on one process: parameters and AdamW
moments bit for bit what was saved.
"""

from __future__ import annotations

import pytest
import torch

import _pp_ckpt_helpers as H

pytestmark = pytest.mark.multirank


def test_round_trips_through_a_pipeline(pools, tmp_path):
    a, b = str(tmp_path / "fsdp4"), str(tmp_path / "pp2xfsdp2")
    pool = pools(4)
    pool.run(H.save_after_a_step, a, {"fsdp": 4}, ["fsdp"])
    loaded = pool.run(H.load_and_compare, a, {"pp": 2, "fsdp": 2}, ["pp", "fsdp"])
    first, last = set(loaded[0]["keys"]), set(loaded[2]["keys"])  # pipeline ranks 0 and 1
    assert "layers.0.attn.wq" in first and "final_norm" not in first
    assert "final_norm" in last and "layers.0.attn.wq" not in last
    assert "embed" in first & last  # the tiny dense model ties its embedding: every pipeline rank holds it
    pool.run(H.save_after_a_step, b, {"pp": 2, "fsdp": 2}, ["pp", "fsdp"])
    assert {o["n"] for o in pool.run(H.load_and_compare, b, {"fsdp": 4}, ["fsdp"])} == {46}  # every key
    pool.run(H.load_and_compare, b, {"fsdp": 2, "pp": 2}, ["fsdp", "pp"])

    # and on this one process: every key of the pipelined save, whole
    from hpfunc import checkpoint, optim, testing
    from hpfunc.models import qwen3

    cfg = qwen3.preset("qwen3-dense-tiny", num_hidden_layers=4)
    meta = qwen3.init(torch.zeros(2, dtype=torch.int64), cfg, device="meta")
    got = checkpoint.load(b, {"params": meta, "opt": optim.adamw(1e-2).init(meta), "step": 0})
    whole = torch.load(b + ".whole.pt")
    testing.assert_trees_close(got["params"], whole["params"], rtol=0, atol=0, what="params on one process")
    testing.assert_trees_close(got["opt"][0].nu, whole["nu"], rtol=0, atol=0, what="nu on one process")
