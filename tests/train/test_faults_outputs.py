"""Faults on the output side of ``hpfunc train``, injected for real: a diverged run, reruns into a folder,
two runs at once, ``kill -9`` at several moments, a full disk, unwritable and impossible folders.

Each test checks the exit status, that the message names the key / file / step, that no process is
left behind and that no earlier output is lost. The full disk is injected two ways: ``RLIMIT_FSIZE``
in the child (with ``SIGXFSZ`` ignored, a write past the limit fails with ``EFBIG``; works for any
user), and where this machine allows a private mount namespace, a real ``ENOSPC`` from a 12 KiB
tmpfs mounted in it (skipped otherwise). A read-only folder is a read-only bind mount in a private
mount namespace when running as root (root ignores permission bits), a ``chmod 555`` folder otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import yaml
from _train_helpers import TINY, write_corpus

from hpfunc.train.cli import main as train_main
from hpfunc.train.config import load_config
from hpfunc.train.output import LOCK_FILE, MetricsWriter, RunFolder, read_metrics, to_json

RUN_FILES = ["config.yaml", "loss.png", "metrics.jsonl", "sample.txt", "summary.json"]
PNG_HEAD, PNG_TAIL = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"


# ---------------------------------------------------------------------------------------------
# Helpers


def _config(tmp_path: pathlib.Path, name: str = "tiny.yaml", out: str = "out", **sections) -> pathlib.Path:
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "output": {**TINY["output"], "dir": str(tmp_path / out)}, **sections}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _train_cmd(config: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpfunc.cli", "train", str(config), *args]


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity (which Python's json accepts by default)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _fingerprint(folder: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a test's unique temp path)."""
    found = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(d.name))
    return found


def _assert_complete_or_absent(out: pathlib.Path) -> list[dict]:
    """Every file the trainer writes is complete or absent; the only other files are its lock file and
    hidden temp files of atomic writes (``.NAME.partial.PID``), never a visible partial file."""
    names = sorted(p.name for p in out.iterdir())
    for name in names:
        assert name in RUN_FILES or name == LOCK_FILE or (name.startswith(".") and ".partial." in name), names
    records = []
    if (out / "config.yaml").exists():
        assert load_config(out / "config.yaml").train.steps >= 1
    if (out / "metrics.jsonl").exists():
        data = (out / "metrics.jsonl").read_bytes()
        assert not data or data.endswith(b"\n"), data[-200:]  # whole lines only
        for line in data.decode().splitlines():
            _strict_json(line)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no torn line to skip
            records = read_metrics(out / "metrics.jsonl")
    if (out / "summary.json").exists():
        assert _strict_json((out / "summary.json").read_text())["steps"] >= 1
    if (out / "loss.png").exists():
        png = (out / "loss.png").read_bytes()
        assert png.startswith(PNG_HEAD) and png.endswith(PNG_TAIL), len(png)
    if (out / "sample.txt").exists():
        assert (out / "sample.txt").read_text().startswith("def ")
    return records


def _limited(limit: int):
    def pre():  # in the child: a write past `limit` bytes fails with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def _private_mount(script: str, timeout: int = 120) -> subprocess.CompletedProcess | None:
    """Run ``sh -c script`` in a private mount namespace (mounts vanish with it); None if not allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    return subprocess.run([unshare, "--mount", "sh", "-c", script], capture_output=True, text=True,
                          env=_env(), timeout=timeout)


# ---------------------------------------------------------------------------------------------
# 3. A diverged run is not a success; every JSON is strict JSON


def test_nan_on_the_last_step_fails_naming_the_step(tmp_path, capsys):
    # one step at lr 1e30: the step's loss and gradient are finite, the parameters after it are not
    # usable (the validation loss is NaN); before the fix: exit 0, "done", summary.json with NaN
    path = _config(tmp_path)
    args = [str(path), "--steps", "1", "--set", "optimizer.lr=1e30", "--set", "optimizer.clip_norm=null",
            "--set", "schedule.warmup_steps=0"]
    with pytest.raises(SystemExit) as info:
        train_main(args)
    assert info.value.code == 1
    captured = capsys.readouterr()
    assert "training diverged at step 1: the validation loss is nan" in captured.err
    assert "done:" not in captured.out
    out = tmp_path / "out"
    assert not (out / "summary.json").exists()  # no summary: the run did not finish
    assert [r["step"] for r in _assert_complete_or_absent(out)] == [1]  # the step's line is kept
    # lr 1e39 overflows float32: the parameters themselves are infinite after the last update
    with pytest.raises(SystemExit) as info:
        train_main([*args, "--set", "optimizer.lr=1e39", "--set", "train.eval_batches=0", "--overwrite"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "training diverged at step 1 (the last): its update left non-finite parameters" in err
    assert "'embed'" in err


def test_a_nonfinite_gradient_norm_stops_the_run_at_its_step(tmp_path, capsys):
    # lr 1e10: step 1 is fine, then a step's loss is still finite but its gradient norm is NaN
    path = _config(tmp_path)
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--steps", "6", "--set", "train.log_every=1", "--set", "optimizer.lr=1e10",
                    "--set", "optimizer.clip_norm=null", "--set", "schedule.warmup_steps=0"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    import re

    m = re.search(r"training diverged at step (\d+): the gradient norm is nan while the loss is [0-9.]+ ", err)
    assert m, err
    # the failure path recomputes that step's gradient once to name the parameter where it went wrong
    assert re.search(r"the first parameter whose gradient is not finite: '[a-z_.0-9]+' \(\d+ of \d+ values\)", err), err
    assert "the step was not applied (the state is that of step" in err
    k = int(m.group(1))
    records = _assert_complete_or_absent(tmp_path / "out")
    assert [r["step"] for r in records] == list(range(1, k))  # every step before it, logged and finite
    assert all(isinstance(r["grad_norm"], float) for r in records)


def test_every_json_the_run_writes_is_strict_json(tmp_path, capsys):
    path = _config(tmp_path)
    train_main([str(path), "--steps", "10"])
    capsys.readouterr()
    out = tmp_path / "out"
    _assert_complete_or_absent(out)
    assert sorted(p.name for p in out.iterdir()) == RUN_FILES  # the lock file went with the run
    # a non-finite value is written as null, with a warning naming it; the text is never NaN
    with pytest.warns(RuntimeWarning, match=r"summary: val_loss = nan written as null"):
        text = to_json({"steps": 1, "val_loss": float("nan")}, where="summary")
    assert _strict_json(text) == {"steps": 1, "val_loss": None}
    with pytest.warns(RuntimeWarning, match=r"step 4\): loss = inf"):
        with MetricsWriter(tmp_path / "m.jsonl") as w:
            w.write({"step": 4, "loss": float("inf")})
    assert _strict_json((tmp_path / "m.jsonl").read_text()) == {"step": 4, "loss": None}


# ---------------------------------------------------------------------------------------------
# 4. A run owns its folder


def test_a_rerun_into_a_folder_with_a_run_is_refused_and_overwrite_replaces_it_whole(tmp_path, capsys):
    path = _config(tmp_path)
    out = tmp_path / "out"
    train_main([str(path), "--steps", "10"])
    before = _fingerprint(out)
    assert sorted(before) == RUN_FILES
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--steps", "5"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"config error: output.dir: the folder {out} already holds a run" in err
    assert "it finished" in err and "--overwrite" in err
    assert _fingerprint(out) == before  # nothing touched
    # on a mesh: refused in the launching process, before any rank starts
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--set", "parallel.mesh={fsdp: 2, tp: 2}", "--set", "parallel.plan=[fsdp, tp]"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert f"hpfunc train: config error: output.dir: the folder {out} already holds a run" in captured.err
    assert "starting" not in captured.out
    assert _fingerprint(out) == before
    # a rerun with --overwrite that fails on its data leaves the old run whole (no emptied metrics.jsonl)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--overwrite", "--set", f"data.paths=[{tmp_path / 'empty.txt'}]"])
    assert info.value.code == 2
    assert "the training split has 0 tokens" in capsys.readouterr().err
    assert _fingerprint(out) == before
    # --overwrite replaces the whole run: no old loss.png or sample.txt beside the new files
    train_main([str(path), "--steps", "5", "--overwrite", "--set", "output.plot=false",
                "--set", "output.sample_tokens=0"])
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl", "summary.json"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 5]
    assert load_config(out / "config.yaml").train.steps == 5


def test_a_run_never_writes_over_its_config_or_its_data(tmp_path, capsys):
    write_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = {**TINY, "data": {**TINY["data"], "paths": ["../corpus/*.py"]}, "output": {**TINY["output"], "dir": str(run_dir)}}
    config = run_dir / "config.yaml"  # the user's config, in the folder the run would write
    text = "# my notes on this experiment\n" + yaml.safe_dump(cfg)
    config.write_text(text)
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as info:
            train_main([str(config), *extra])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert (f"output.dir: the run writes config.yaml in {run_dir}, and that file is its input config "
                f"{config}") in err
        assert config.read_text() == text  # comments and all
    # a data file named like an output in the output folder: refused too, even with --overwrite
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    sample = data_dir / "sample.txt"
    sample.write_text("def f(x):\n    return x\n" * 200)
    path = _config(tmp_path, out="data", data={**TINY["data"], "paths": [str(sample)]})
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--overwrite"])
    assert info.value.code == 2
    assert f"that file is its input data file (data.paths) {sample}" in capsys.readouterr().err
    assert sample.read_text() == "def f(x):\n    return x\n" * 200


def test_two_runs_at_once_into_one_folder_the_second_is_refused(tmp_path, capsys):
    path = _config(tmp_path)
    out = tmp_path / "out"
    first = subprocess.Popen(_train_cmd(path, "--steps", "300", "--set", "train.log_every=50",
                                        "--set", "train.eval_every=0"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_bytes().count(b"\n") >= 1):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(SystemExit) as info:  # the second run, in this process (quick to start)
            train_main([str(path), "--steps", "5", "--overwrite"])  # even --overwrite does not take it
        assert first.poll() is None, "the first run ended before the second was refused; give it more steps"
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"config error: output.dir: the folder {out} is in use by another run (pid {first.pid})" in err
        stdout, stderr = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr
    assert "done: 300 steps" in stdout
    records = _assert_complete_or_absent(out)
    assert [r["step"] for r in records if "loss" in r] == [1, 50, 100, 150, 200, 250, 300]
    assert sorted(p.name for p in out.iterdir()) == RUN_FILES
    assert _processes_mentioning(str(tmp_path)) == []


def test_kill_9_at_any_moment_leaves_only_whole_files(tmp_path, capsys):
    """Kill a single-process run with SIGKILL after some metrics lines, when the sample is written (the
    plot is being drawn) and when the plot is written (the summary is next); each time every file in
    the folder is whole or absent, a rerun is refused cleanly, and --overwrite runs over the remains."""
    path = _config(tmp_path, train={**TINY["train"], "log_every": 1})
    out = tmp_path / "out"

    def lines_at_least(n):
        return lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_bytes().count(b"\n") >= n

    points = [("after 3 metrics lines", lines_at_least(3)),
              ("while the plot is drawn", lambda: (out / "sample.txt").exists()),
              ("when the plot is written", lambda: (out / "loss.png").exists())]
    for what, ready in points:
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(_train_cmd(path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(),
                                cwd=tmp_path)
        try:
            deadline = time.monotonic() + 120
            while not ready():
                assert proc.poll() is None, (what, proc.communicate())
                assert time.monotonic() < deadline, what
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, what
        records = _assert_complete_or_absent(out)
        assert records and records[0]["step"] == 1, what
        with pytest.raises(SystemExit) as info:
            train_main([str(path)])  # a stale lock file does not block; the remains of the run do
        assert info.value.code == 2, what
        err = capsys.readouterr().err
        assert f"output.dir: the folder {out} already holds a run" in err, (what, err)
    train_main([str(path), "--overwrite"])
    capsys.readouterr()
    _assert_complete_or_absent(out)
    assert sorted(p.name for p in out.iterdir()) == RUN_FILES  # no lock, no temp files left
    assert _processes_mentioning(str(tmp_path)) == []


# ---------------------------------------------------------------------------------------------
# 5. Full disk, unwritable and impossible folders


@pytest.mark.parametrize("limit, file, step_text", [
    (2000, "metrics.jsonl", "the line of step"),  # the metrics file reaches the limit mid-line
    (20000, "loss.png", "it was not created"),  # the metrics fit; the plot does not
])
def test_a_full_disk_names_the_file_and_keeps_every_whole_line(tmp_path, limit, file, step_text):
    path = _config(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(_train_cmd(path), capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=240,
                          preexec_fn=_limited(limit))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"hpfunc train: output error: cannot write {out / file}: File too large (EFBIG)" in proc.stderr
    assert step_text in proc.stderr and "Traceback" not in proc.stderr
    records = _assert_complete_or_absent(out)
    assert load_config(out / "config.yaml") == load_config(path)  # written before, intact
    assert not (out / "summary.json").exists()  # the run did not finish
    assert not any(".partial." in p.name for p in out.iterdir())  # the failed temp file is removed
    assert not (out / LOCK_FILE).exists()
    assert _processes_mentioning(str(tmp_path)) == []
    if file == "metrics.jsonl":
        import re

        m = re.search(r"the line of step (\d+) was not written, the (\d+) line\(s\) before it are intact", proc.stderr)
        assert m and int(m.group(2)) == len(records) >= 1, proc.stderr
        assert records[-1]["step"] < int(m.group(1))
        assert (out / "metrics.jsonl").stat().st_size <= limit
    else:  # every line of the run was logged; only the plot is missing
        assert not (out / "loss.png").exists() and (out / "sample.txt").exists()
        assert [r["step"] for r in records] == [1, 5, 10, 15, 15, 20, 25, 30, 30]


def test_a_really_full_disk_enospc(tmp_path):
    path = _config(tmp_path, train={**TINY["train"], "log_every": 1})
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    cmd = " ".join(_train_cmd(path, "--out", str(out)))
    proc = _private_mount(f"mount -t tmpfs -o size=12k tmpfs {disk} && {cmd}; status=$?; "
                          f"cp -a {out} {tmp_path}/copy; exit $status")
    if proc is None or "mount:" in proc.stderr:
        pytest.skip("no private mount namespace here (unshare --mount and mount -t tmpfs need privileges)")
    assert proc.returncode == 1, proc.stderr
    assert f"cannot write {out / 'metrics.jsonl'}: No space left on device (ENOSPC)" in proc.stderr
    records = _assert_complete_or_absent(tmp_path / "copy")
    assert len(records) >= 3
    assert f"the {len(records)} line(s) before it are intact" in proc.stderr


def test_read_metrics_skips_a_torn_last_line_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.1}\n{"step": 3, "lo')
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl:3: skipping an incomplete last line"):
        assert read_metrics(path) == [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.1}]
    # an appending writer cuts the torn tail off first, so it never merges into the next line
    with pytest.warns(RuntimeWarning, match="cutting off an incomplete last line"):
        with MetricsWriter(path) as w:
            w.write({"step": 3, "loss": 4.9})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    # damage in the middle is an error naming the file and line, not a silent skip
    path.write_bytes(b'{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        read_metrics(path)


def test_an_impossible_output_dir_is_a_config_error_before_any_work(tmp_path, capsys):
    path = _config(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    mesh = ["--set", "parallel.mesh={fsdp: 2, tp: 2}", "--set", "parallel.plan=[fsdp, tp]"]
    for extra in ([], mesh):  # on a mesh: checked in the launching process, before any rank starts
        with pytest.raises(SystemExit) as info:
            train_main([str(path), "--out", str(blocker / "run"), *extra])
        assert info.value.code == 2
        captured = capsys.readouterr()
        assert (f"hpfunc train: config error: output.dir: cannot create the folder {blocker / 'run'}: a part of the "
                f"path is not a folder ({blocker} is a file)") in captured.err
        assert "starting" not in captured.out and "[rank" not in captured.err
        with pytest.raises(SystemExit) as info:
            train_main([str(path), "--out", str(blocker), *extra])
        assert info.value.code == 2
        assert f"output.dir: {blocker} exists and is not a folder" in capsys.readouterr().err
    assert blocker.read_text() == "not a folder"


def test_a_read_only_output_dir_is_a_config_error_checked_before_launch(tmp_path):
    path = _config(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    single = " ".join(_train_cmd(path, "--out", str(ro / "run")))
    mesh = " ".join(_train_cmd(path, "--out", str(ro), "--set", "'parallel.mesh={fsdp: 2, tp: 2}'",
                               "--set", "'parallel.plan=[fsdp, tp]'"))
    script = f"{single}; echo status=$?; {mesh}; echo status=$?"
    if os.geteuid() == 0:  # root ignores permission bits: a read-only bind mount in a private namespace
        proc = _private_mount(f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} {ro} && {{ {script}; }}")
        if proc is None or "mount:" in proc.stderr:
            pytest.skip("running as root without a private mount namespace: cannot make a folder read-only")
        why = "Read-only file system (EROFS)"
    else:
        ro.chmod(0o555)
        try:
            proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=_env(), timeout=240)
        finally:
            ro.chmod(0o755)
        why = "Permission denied (EACCES)"
    assert proc.stdout.count("status=2") == 2, proc.stdout + proc.stderr
    assert f"config error: output.dir: cannot create the folder {ro / 'run'}: {why}" in proc.stderr
    assert f"config error: output.dir: cannot write into the folder {ro} (creating its lock file" in proc.stderr
    assert "starting 4 processes" not in proc.stdout and "[rank" not in proc.stderr  # refused before launch
    assert list(ro.iterdir()) == []


def test_the_launcher_holds_the_lock_for_its_ranks(tmp_path):
    # what `hpfunc train` does on a mesh: the parent claims the folder, rank 0 works under its token
    out = tmp_path / "out"
    with RunFolder(out) as parent:
        assert (out / LOCK_FILE).exists()
        with pytest.raises(Exception, match="is in use by another run"):
            RunFolder(out).claim()  # anyone else is refused
        rank0 = RunFolder(out, inherited=parent.token).claim()
        rank0.start()
        rank0.write_json("summary.json", {"steps": 1})
        rank0.release()  # the parent's lock is not rank 0's to release
        assert (out / LOCK_FILE).exists()
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
