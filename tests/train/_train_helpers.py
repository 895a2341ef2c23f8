"""Shared by the trainer tests: a tiny MoE config and a small generated corpus for it."""

from __future__ import annotations

import pathlib

TINY = {
    "seed": 0,
    "model": {"preset": "qwen3-moe-tiny", "hidden_size": 32, "moe_intermediate_size": 32, "num_experts": 4},
    "optimizer": {"lr": 1e-2},
    "schedule": {"name": "constant", "warmup_steps": 3},
    "data": {"source": "text", "paths": ["corpus/*.py"], "val_fraction": 0.1},
    "train": {"steps": 30, "batch_size": 4, "seq_len": 32, "log_every": 5, "eval_every": 15, "eval_batches": 2,
              "num_threads": 1},
    "output": {"dir": "out", "progress": "lines", "sample_tokens": 16, "sample_prompt": "def "},
}


def write_corpus(folder: pathlib.Path) -> None:
    """A small, repetitive Python-like corpus (generated here; no third-party text)."""
    folder.mkdir()
    for i in range(4):
        lines = [f"def function_{i}_{j}(x, y):\n    return x * {j} + y - {i}\n\n" for j in range(40)]
        (folder / f"m{i}.py").write_text("".join(lines))
