"""The ``layer_norms`` callback on a mesh: each rank sums the squares of the blocks it holds (a replica
counted once) and one all-reduce gives every layer's norm; under expert parallelism (fsdp x ep) and
pipeline parallelism (pp, each rank holding its stages only) they equal the single-device per-layer
norms (rtol 1e-5), and their squares sum to the squared global norm. (fsdp x tp: in
``test_model_spec.py``, through ``hpfunc train``.)"""

from __future__ import annotations

import math

import pytest
from _train_helpers import TINY, write_corpus

pytestmark = pytest.mark.multirank


def _raw(tmp_path, parallel):
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    return {**TINY, "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
            "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"name": "constant", "warmup_steps": 0},
            "train": {**TINY["train"], "steps": 2, "batch_size": 4, "seq_len": 16, "log_every": 1, "eval_every": 0,
                      "eval_batches": 0},
            "output": {**TINY["output"], "dir": str(tmp_path / "out"), "progress": "none", "plot": False,
                       "sample_tokens": 0},
            "parallel": parallel, "callbacks": [{"layer_norms": {"every": 2}}]}


def norms_in_rank(raw: dict) -> dict:
    """Train in this rank of the pool; the layer_norms callback's last line (the same on every rank)."""
    from hpfunc.train import Trainer

    trainer = Trainer(raw, echo=False)
    trainer.run()
    (norms,) = [cb for _, cb in trainer.callbacks if type(cb).__name__ == "LayerNorms"]
    return norms.last


@pytest.mark.parametrize("parallel", [
    {"mesh": {"fsdp": 2, "ep": 2}, "plan": ["fsdp", "ep"]},
    {"mesh": {"pp": 2}, "plan": [{"pp": {"microbatches": 1}}]},
], ids=["fsdp2-ep2", "pp2"])
def test_layer_norms_on_a_mesh_equal_one_device(pools, tmp_path, parallel):
    raw = _raw(tmp_path, parallel)
    size = math.prod(parallel["mesh"].values())
    got = pools(size).run(norms_in_rank, raw)
    want = norms_in_rank({**raw, "parallel": None, "output": {**raw["output"], "dir": str(tmp_path / "single")}})
    assert len(got) == size and all(g == got[0] for g in got)  # every rank holds the reduced values
    assert got[0]["step"] == want["step"] == 2
    assert set(got[0]["param_norm"]) == set(want["param_norm"]) == {"embed", "layers.0", "layers.1", "final_norm",
                                                                     "lm_head"}
    assert got[0]["param_norm"] == pytest.approx(want["param_norm"], rel=1e-5)
    total_sq = sum(v ** 2 for v in got[0]["param_norm"].values())
    assert got[0]["total"] ** 2 == pytest.approx(total_sq, rel=1e-12)
