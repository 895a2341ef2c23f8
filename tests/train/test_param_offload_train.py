"""``hpfunc train`` with ``parallel.offload_state: [optimizer, {params: PATTERN}]`` (the chosen layers'
parameters and the optimizer state at rest in host memory between steps), run in the session's rank pool:
per-step losses and the evaluation equal the same run without offload, exactly; every layer recomputed in
the backward (``activations.remat``), so that the recompute's gathers bring the offloaded blocks in too."""

from __future__ import annotations

import pytest
from _train_helpers import TINY, write_corpus

pytestmark = pytest.mark.multirank


def train_in_rank(raw: dict) -> list[dict]:
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.trainer import run

    return run(load_config_dict(raw), echo=False).records


def test_offloaded_layers_train_as_without(pools, tmp_path):
    write_corpus(tmp_path / "corpus")

    def raw(offload, out):
        parallel = {"mesh": {"fsdp": 2}, "plan": ["fsdp"], **({"offload_state": offload} if offload else {})}
        return {**TINY, "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"name": "constant", "warmup_steps": 0},
                "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
                "train": {**TINY["train"], "steps": 2, "log_every": 1, "eval_every": 2, "eval_batches": 1},
                "output": {**TINY["output"], "dir": str(tmp_path / out), "progress": "none", "plot": False,
                           "sample_tokens": 0},
                "activations": {"remat": "nothing_saveable"}, "parallel": parallel}

    want = pools(2).run(train_in_rank, raw(None, "plain"))[0]
    got = pools(2).run(train_in_rank, raw(["optimizer", {"params": r"layers\.1\."}], "offload"))[0]
    assert [r["loss"] for r in got if "loss" in r] == [r["loss"] for r in want if "loss" in r] != []
    evals = [[r[k] for k in r if "val" in k] for r in want]
    assert [[r[k] for k in r if "val" in k] for r in got] == evals and any(evals), want
