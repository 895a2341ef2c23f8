"""``hpfunc train`` under torchrun's multi-node rendezvous: two launcher agents on this machine
(``--nnodes 2`` over the loopback, 2 ranks each) train the tiny MoE on a 2x2 mesh."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import yaml
from _train_helpers import TINY, write_corpus

from hpfunc.train.config import load_config
from hpfunc.train.trainer import run
from hpfunc.train.output import read_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_like_one_device(tmp_path):
    write_corpus(tmp_path / "corpus")
    steps = 3
    cfg = {**TINY, "output": {**TINY["output"], "dir": str(tmp_path / "out"), "plot": False, "sample_tokens": 0},
           "parallel": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]},
           "train": {**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0, "eval_batches": 0}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONWARNINGS"] = "ignore"
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "hpfunc.cli", "launch", "--nnodes", "2", "--node-rank", str(n),
                                "--nproc", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                                "--rdzv-id", "hpfunc-test", "-m", "hpfunc.cli", "train", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
              for n in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outs)
    printed = "".join(outs)
    assert printed.count("parallel: 4 processes (gloo), mesh {fsdp: 2, tp: 2}") == 1, printed  # global rank 0 alone
    got = [r["loss"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    # the one-node 2x2 run equals one device (tests/train/test_parallel_run.py); so must two nodes
    single = run(load_config(path, ["parallel=null", f"output.dir={tmp_path / 'single'}"]), echo=False)
    want = [r["loss"] for r in single.records if "loss" in r]
    assert len(got) == len(want) == steps
    assert got == pytest.approx(want, rel=1e-5), (got, want)
