"""The README's quick start on a fresh clone: the two commands it names are the ones CI and this test
run, and the main job, run from a clone of the committed tree (nothing untracked, no run folder, no
build output), trains on its 2x2 mesh and writes its outputs.

The clone runs the default config with fewer steps (every other key as written), so the test checks
what a new user's first command needs: the committed config, data source, launcher and mesh.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [line.split("#", 1)[0].strip() for line in blocks[-1].splitlines()]
    return [c for c in commands if c]


def test_the_readme_names_the_main_job_and_the_ci_test_command():
    main_job, tests = _quick_start_commands()
    assert main_job == "hpfunc train examples/configs/qwen3_moe_tiny.yaml", main_job
    assert (ROOT / main_job.split()[-1]).is_file()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == tests == "python -m pytest", (ci[-1], tests)


@pytest.mark.multirank
def test_the_main_job_runs_from_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: there is no committed tree to clone")
    clone = tmp_path / "hpfunc"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=120)
    main_job = _quick_start_commands()[0].split()
    assert main_job[:2] == ["hpfunc", "train"]
    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONWARNINGS": "ignore"}
    # the clone's hpfunc, not this checkout's: `hpfunc` is `python -m hpfunc.cli` with the clone first
    cmd = [sys.executable, "-m", "hpfunc.cli", *main_job[1:], "--set", "train.steps=4", "--set", "schedule.warmup_steps=1",
           "--set", "train.log_every=2", "--set", "train.eval_batches=1", "--set", "output.sample_tokens=8"]
    done = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the main job failed in a fresh clone:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = clone / "runs" / "qwen3_moe_tiny"
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and all(math.isfinite(v) for v in losses), rows
    assert summary, "summary.json is empty"
    assert str(clone) in subprocess.run([sys.executable, "-c", "import hpfunc; print(hpfunc.__file__)"],
                                        cwd=clone, env=env, capture_output=True, text=True).stdout
