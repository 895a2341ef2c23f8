"""Faults at checkpoint time, injected for real: a full disk, a file system turned read-only mid-run, too
little space, a read-only checkpoint folder, ranks given different folders or steps, damaged newest
checkpoints, a malformed ``model.pretrained`` config.json.

The disks are small tmpfs mounts in a private mount namespace (``unshare --mount``; the tests that need
one are skipped, saying so, where it cannot be made: it takes root or user namespaces). Each failing
run is checked for its exit status, a single ``checkpoint error:`` line naming ``checkpoint.dir``, the
folder, the step and the cause, no ``Traceback`` anywhere in the output, nothing trained after the
failed save, the previous checkpoint intact and the run resumed from it bit for bit.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from _train_helpers import TINY, write_corpus

from hpfunc import checkpoint
from hpfunc.train.cli import main as train_main
from hpfunc.train.output import read_metrics

MESH = ["--set", "parallel.mesh={fsdp: 2, tp: 2}", "--set", "parallel.plan=[fsdp, tp]"]
# the launched runs of the save faults: two ranks are enough for a collective save, one error line for all
# ranks and a resume on the mesh, at half the start-up of four on 2 cores (three launches in the test). On
# two ranks each rank's file is larger than the 400 KiB disk, and about every other run the write that
# fills it is torch's serializer's, which loses the OSError ("unexpected pos 704 vs 598"): the save asks
# the file system then, and must still say ENOSPC (hpfunc.checkpoint.save_faults.short_write_cause).
MESH_2 = ["--set", "parallel.mesh={fsdp: 2}", "--set", "parallel.plan=[fsdp]"]


def _config(tmp_path: pathlib.Path, steps: int, every: int, **sections) -> pathlib.Path:
    write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "data": {**TINY["data"], "paths": [str(tmp_path / "corpus" / "*.py")]},
           "train": {**TINY["train"], "steps": steps, "log_every": 1, "eval_every": 0},
           "output": {**TINY["output"], "dir": str(tmp_path / "out"), "sample_tokens": 0, "plot": False,
                      "progress": "none"},
           "checkpoint": {"every": every, "keep_last": None}, **sections}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _can_mount() -> str | None:
    """Why a private tmpfs cannot be mounted here (None: it can)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare command"
    probe = subprocess.run([unshare, "--mount", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no private tmpfs mount here ({probe.stderr.strip()[:120]}): it needs root or user namespaces"
    return None


def _in_namespace(script: str, timeout: int) -> None:
    why = _can_mount()
    if why is not None:
        pytest.skip(why)
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, env=_env(),
                          timeout=timeout)
    assert proc.returncode == 0 and "mount:" not in proc.stderr, proc.stdout + proc.stderr


def _train(tmp_path: pathlib.Path, name: str, config: pathlib.Path, *args: str) -> str:
    """A shell line running ``hpfunc train`` with its stdout, stderr and status in ``tmp_path/name.*``."""
    cmd = " ".join(f"'{a}'" for a in [sys.executable, "-m", "hpfunc.cli", "train", str(config), *args])
    return f"{cmd} > {tmp_path / name}.out 2> {tmp_path / name}.err; echo $? > {tmp_path / name}.status"


def _result(tmp_path: pathlib.Path, name: str) -> tuple[int, str, str]:
    read = lambda ext: (tmp_path / f"{name}.{ext}").read_text()  # noqa: E731
    return int(read("status")), read("out"), read("err")


def _steps(records: list[dict]) -> list[tuple]:
    """``(step, loss, ce_loss, grad_norm, lr)`` of the training lines: what must resume bit for bit."""
    return [(r["step"], r["loss"], r["ce_loss"], r["grad_norm"], r["lr"]) for r in records if "loss" in r]


def _failed_save(tmp_path, name, disk, *, step_re: str, cause: str) -> int:
    """Check a run that stopped on a failed save; return the step it names."""
    status, out, err = _result(tmp_path, name)
    assert status == 1, (name, out, err)
    assert "Traceback" not in out + err, (name, err)
    lines = [line for line in err.splitlines() if "checkpoint error:" in line]
    assert len(lines) == 1, (name, err)  # one line, not one per rank
    m = re.fullmatch(rf"hpfunc train: checkpoint error: checkpoint\.dir: cannot save the checkpoint of step "
                     rf"({step_re}) to {re.escape(str(disk))}/step_(\d+): {cause}.*", lines[0])
    assert m and int(m.group(1)) == int(m.group(2)), (name, lines[0])
    assert f"the run stopped after step" in lines[0]
    assert not any(p.name.startswith(".") for p in disk.iterdir()), list(disk.iterdir())  # no .partial left
    assert "summary.json" not in (tmp_path / f"{name}.ls").read_text().split()  # the run did not finish
    return int(m.group(1))


def _save_faults_then_resume(tmp_path, *, mesh: list[str], steps: int, every: int, second: str,
                             timeout: int) -> None:
    """Three runs in one private mount namespace, ``checkpoint.dir`` a small tmpfs:

    1. synchronous saves, a 400 KiB disk: the first save (a checkpoint is ~0.8 MiB) fails with ENOSPC;
    2. ``--overwrite``, asynchronous saves: then ``second``: ``readonly`` (a 4 MiB disk, remounted
       read-only once the first checkpoint is there: a later save fails with EROFS) or ``space`` (a
       1.2 MiB disk: the first save fits, the next is refused, less free space than the last checkpoint);
    3. the disk remounted writable and larger: ``--resume auto`` continues from the newest checkpoint
       and must log every step of run 2 bit for bit.
    """
    config = _config(tmp_path, steps, every)
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "out"
    ck = ["--set", f"checkpoint.dir={disk}"]
    first = f"{disk}/step_{every:08d}"
    watcher = (f"( while [ ! -d {first} ]; do sleep 0.02; done; until mount -o remount,ro {disk}; do sleep 0.05; "
               f"done ) & " if second == "readonly" else "")
    script = " && ".join([
        f"mount -t tmpfs -o size=400k tmpfs {disk}",
        _train(tmp_path, "r1", config, *ck, "--set", "checkpoint.async_save=false", *mesh),
        f"cp {out}/metrics.jsonl {tmp_path}/m1.jsonl", f"ls -a {disk} > {tmp_path}/ls1", f"ls {out} > {tmp_path}/r1.ls",
        f"mount -o remount,size={'4m' if second == 'readonly' else '1200k'} {disk}",
        watcher + _train(tmp_path, "r2", config, *ck, "--overwrite", "--set", "checkpoint.async_save=true", *mesh),
        "wait", f"cp {out}/metrics.jsonl {tmp_path}/m2.jsonl", f"ls {out} > {tmp_path}/r2.ls",
        f"mount -o remount,rw,size=16m {disk}",
        f"ls -a {disk} > {tmp_path}/ls2",
        _train(tmp_path, "r3", config, *ck, "--resume", "auto", *mesh),
    ])
    _in_namespace(script, timeout)

    # 1: ENOSPC at the first save; nothing trained after it, nothing left on the disk
    _failed_save(tmp_path, "r1", disk, step_re=str(every), cause=re.escape(
        "No space left on device (ENOSPC): the file system is full"))
    assert "no complete checkpoint was written before" in _result(tmp_path, "r1")[2]
    m1 = read_metrics(tmp_path / "m1.jsonl")
    assert [s for s, *_ in _steps(m1)] == list(range(1, every + 1))
    assert (tmp_path / "ls1").read_text().split() == [".", ".."]

    # 2: the asynchronous save's failure stops the run at the next step on every rank, not the next save
    cause = (re.escape("Read-only file system (EROFS): the file system is mounted read-only") if second == "readonly"
             else r"not enough space: 0\.\d\d MiB free on the file system of .*, and the previous checkpoint took "
                  r"[01]\.\d\d MiB")
    failed = _failed_save(tmp_path, "r2", disk, step_re=r"\d+" if second == "readonly" else str(2 * every),
                          cause=cause)
    err2 = _result(tmp_path, "r2")[2]
    m2 = _steps(read_metrics(tmp_path / "m2.jsonl"))
    last = m2[-1][0]
    assert failed <= last <= failed + 1 and failed % every == 0, (failed, last, err2)
    assert f"the run stopped after step {last}" in err2
    assert m2[:every] == _steps(m1)  # runs 1 and 2 trained the same steps before their saves
    kept = sorted(int(n[5:]) for n in (tmp_path / "ls2").read_text().split() if n.startswith("step_"))
    assert kept and kept[-1] == failed - every, kept
    assert f"the newest complete checkpoint is still {disk}/step_{kept[-1]:08d}" in err2

    # 3: the resumed run logs every step of run 2 bit for bit, then finishes
    status, out3, err3 = _result(tmp_path, "r3")
    assert status == 0 and "Traceback" not in out3 + err3, err3
    final = _steps(read_metrics(out / "metrics.jsonl"))
    assert [s for s, *_ in final] == list(range(1, steps + 1))
    assert final[:last] == m2
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == kept[-1]


def test_failed_checkpoint_saves_on_one_process(tmp_path):
    """Sync ENOSPC; async EROFS of a disk remounted read-only mid-run; resumed bit for bit."""
    _save_faults_then_resume(tmp_path, mesh=[], steps=9, every=3, second="readonly", timeout=400)


@pytest.mark.multirank
def test_failed_checkpoint_saves_on_a_mesh(tmp_path):
    """Sync ENOSPC on 2 ranks; async refusal for too little space; resumed bit for bit on the mesh."""
    _save_faults_then_resume(tmp_path, mesh=MESH_2, steps=6, every=2, second="space", timeout=600)


def test_a_short_write_on_an_almost_full_disk_is_said_as_enospc(tmp_path, monkeypatch):
    """torch's serializer raises a bare RuntimeError for a write the file system cut short (no OSError):
    the save asks the file system, and a disk with (almost) no space left is said as ENOSPC."""
    from hpfunc.checkpoint import save_faults

    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = RuntimeError("rank 0 failed")
    wrapped.__cause__ = torch_error
    assert save_faults.short_write(wrapped) and not save_faults.short_write(RuntimeError("another failure"))
    monkeypatch.setattr(save_faults, "free_bytes", lambda folder: 4096)
    said = save_faults.short_write_cause(torch_error, tmp_path)
    assert said.startswith("No space left on device (ENOSPC): the file system is full (0.00 MiB free after a write "
                           "stopped short: RuntimeError: [enforce fail at inline_container.cc:672]"), said
    monkeypatch.setattr(save_faults, "free_bytes", lambda folder: 2**30)  # space left: torch's own line, no guess
    assert save_faults.short_write_cause(torch_error, tmp_path) == (
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    # through a save: DCP's write raises torch's line; the save says ENOSPC and removes the partial folder
    from hpfunc.checkpoint import dcp_io

    def short(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp_io.dcp, "save", short)
    monkeypatch.setattr(save_faults, "free_bytes", lambda folder: 0)
    with pytest.raises(checkpoint.CheckpointError) as failed:
        checkpoint.save(tmp_path / "step_00000001", {"w": torch.zeros(4)}, step=1)
    assert str(failed.value).startswith(f"cannot save the checkpoint of step 1 to {tmp_path / 'step_00000001'}: No "
                                        f"space left on device (ENOSPC): the file system is full (0.00 MiB free after"
                                        f" a write stopped short: RuntimeError: [enforce fail"), str(failed.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Ranks given different folders or steps: one small collective before anything is written


@pytest.mark.multirank
def test_save_and_load_agree_on_folder_and_step_across_ranks(tmp_path, pool4):
    from _ckpt_fault_helpers import mismatched_saves_and_loads

    outs = pool4.run(mismatched_saves_and_loads, str(tmp_path), timeout=120)  # before the fix: a hang
    for what in ("path", "step", "negative", "load", "files"):
        assert len({o[what] for o in outs}) == 1, (what, [o[what] for o in outs])  # the same on every rank
    out = outs[0]
    assert out["path"].startswith("save: the ranks were given different checkpoints (rank 0: "
                                  f"'{tmp_path}/rank0/step_00000001' step 1; rank 1: '{tmp_path}/rank1/"), out["path"]
    assert out["path"].endswith("nothing was written")
    assert "rank 0: " in out["step"] and "step 1; rank 1: " in out["step"] and "step 2;" in out["step"], out["step"]
    assert out["negative"] == "save: the step must be an int >= 0 (the number of steps done), found -1"
    assert out["load"].startswith(f"load: the ranks were given different checkpoints (rank 0: '{tmp_path}/good'; "
                                  f"rank 1: '{tmp_path}/good_1'"), out["load"]
    assert out["files"] == "good"  # no folder, no .partial left by the refused saves


def test_a_step_that_is_not_a_count_is_refused_on_one_process(tmp_path):
    for step in (-3, 1.5, True):
        with pytest.raises(checkpoint.CheckpointError, match=r"save: the step must be an int >= 0 .* found "):
            checkpoint.save(tmp_path / "c", {"w": torch.ones(2)}, step=step)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Damaged newest checkpoints: skipped by name, set aside, resumed from the newest verified one


def _damage(folder: pathlib.Path, how: str) -> None:
    data = folder / "__0_0.distcp"
    if how == "bitflip":  # same size: only the checksum can tell
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    elif how == "truncated":
        data.write_bytes(data.read_bytes()[:-100])
    else:  # "markerless"
        (folder / checkpoint.MARKER).unlink()


def test_newest_verified_skips_every_kind_of_damage(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path)
    for step in (1, 2, 3, 4):
        manager.save({"w": torch.full((64,), float(step))}, step)
    for step, how in ((4, "bitflip"), (3, "truncated"), (2, "markerless")):
        _damage(checkpoint.step_dir(tmp_path, step), how)
    found, skipped = checkpoint.newest_verified(tmp_path)
    assert found == checkpoint.step_dir(tmp_path, 1)
    assert [p.name for p, _ in skipped] == ["step_00000004", "step_00000003", "step_00000002"]
    assert "__0_0.distcp: checksum mismatch" in skipped[0][1]
    assert "bytes found" in skipped[1][1] and "truncated" in skipped[1][1]
    assert "has no completion marker" in skipped[2][1]
    kept = checkpoint.set_aside(skipped[0][0])
    assert kept.name == "step_00000004.damaged" and kept.is_dir()
    assert checkpoint.complete_steps(tmp_path) == [1]  # sizes alone already tell 2 and 3


def test_resume_auto_passes_over_damaged_newest_checkpoints_by_name(tmp_path, capsys):
    config = _config(tmp_path, 6, 2)
    out = tmp_path / "out"
    train_main([str(config)])
    ref = _steps(read_metrics(out / "metrics.jsonl"))
    root = out / "checkpoints"
    _damage(root / "step_00000006", "bitflip")  # before the fix: a hard error, no fallback
    _damage(root / "step_00000004", "truncated")  # before the fix: skipped without a word, then replaced
    capsys.readouterr()
    train_main([str(config), "--resume", "auto"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for name, why in (("step_00000006", "checksum mismatch"), ("step_00000004", "bytes found")):
        line = next(line for line in err.splitlines() if f"skipped the damaged checkpoint {name}" in line)
        assert why in line and f"it is kept as {root / name}.damaged" in line and "resuming from step_00000002" in line
    assert _steps(read_metrics(out / "metrics.jsonl")) == ref  # steps 3-6 again, bit for bit
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004", "step_00000004.damaged",
                                                      "step_00000006", "step_00000006.damaged"]


def test_a_damaged_format_key_is_named_as_damage_not_a_version(tmp_path):
    checkpoint.save(tmp_path / "c", {"w": torch.ones(2)}, step=1)
    marker = tmp_path / "c" / checkpoint.MARKER
    text = marker.read_text()
    marker.write_text(text.replace('"hpfunc-dcp-checkpoint/1"', '"hpfunc-dcp-checkpoinx/1"'))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"the completion marker is damaged: its 'format' key "
                                                                r"reads 'hpfunc-dcp-checkpoinx/1'"):
        checkpoint.info(tmp_path / "c")
    marker.write_text(text.replace('"hpfunc-dcp-checkpoint/1"', '"hpfunc-dcp-checkpoint/2"'))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"is of format 'hpfunc-dcp-checkpoint/2', this hpfunc "
                                                                r"reads 'hpfunc-dcp-checkpoint/1'; load it with the "
                                                                r"hpfunc version that wrote it"):
        checkpoint.info(tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# Inputs and outputs checked before launch


def test_a_malformed_pretrained_config_json_names_the_file_and_key_before_launch(tmp_path, capsys):
    from hpfunc import random
    from hpfunc.models import preset, qwen3

    cfg = preset("qwen3-moe-tiny", num_hidden_layers=1)
    hf = tmp_path / "hf"
    qwen3.save_pretrained(qwen3.init(random.key(0), cfg), cfg, hf)
    good = json.loads((hf / "config.json").read_text())
    config = _config(tmp_path, 4, 0, model={"pretrained": str(hf)})
    file = hf / "config.json"
    cases = [('{"model_type": "qwen3_moe",', rf"{re.escape(str(file))} is not valid JSON \(line 1 column 28: "),
             (json.dumps({k: v for k, v in good.items() if k != "hidden_size"}),
              rf"{re.escape(str(file))}: key 'hidden_size' is missing; expected an int >= 1")]  # the HF reader's own check
    for text, want in cases:
        file.write_text(text)
        for extra in ([], MESH):  # on a mesh: in the launching process, before any rank starts
            with pytest.raises(SystemExit) as info:
                train_main([str(config), *extra])
            assert info.value.code == 2
            captured = capsys.readouterr()
            assert re.search(rf"^hpfunc train: config error: model\.pretrained: {want}", captured.err, re.M), \
                captured.err
            assert "Traceback" not in captured.err and "starting" not in captured.out
    assert not (tmp_path / "out").exists()


def test_a_read_only_checkpoint_dir_is_refused_before_launch(tmp_path):
    config = _config(tmp_path, 4, 2)
    ro = tmp_path / "ro"
    ro.mkdir()
    script = " && ".join([f"mount --bind {ro} {ro}", f"mount -o remount,bind,ro {ro} {ro}",
                          _train(tmp_path, "one", config, "--set", f"checkpoint.dir={ro}/ckpt"),
                          _train(tmp_path, "mesh", config, "--set", f"checkpoint.dir={ro}", *MESH)])
    _in_namespace(script, 300)
    for name, folder in (("one", ro / "ckpt"), ("mesh", ro)):
        status, out, err = _result(tmp_path, name)
        assert status == 2, (name, err)
        assert (f"hpfunc train: config error: checkpoint.dir: cannot write into the folder {folder}: Read-only file "
                f"system (EROFS)") in err, (name, err)
        assert "Traceback" not in err and "starting" not in out and "[rank" not in err
    assert list(ro.iterdir()) == []
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_missing_data_on_a_mesh_is_found_once_before_launch(tmp_path, capsys):
    config = _config(tmp_path, 4, 0)
    with pytest.raises(SystemExit) as info:
        train_main([str(config), "--set", f"data.paths=[{tmp_path}/nowhere/*.py]", *MESH])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("data.paths.0: the pattern") == 1 and "matches no file" in captured.err, captured.err
    assert "starting" not in captured.out and "[rank" not in captured.err


# ---------------------------------------------------------------------------------------------
# The smaller items of the probe


def test_small_inputs_named_seed_out_sigterm_and_an_empty_file(tmp_path, capsys, monkeypatch):
    from hpfunc.train.fault_hooks import ENV as FAULTS

    config = _config(tmp_path, 6, 0)
    with pytest.raises(SystemExit) as info:  # before: 2**64 silently became the seed 0
        train_main([str(config), "--set", f"seed={2**64}"])
    assert info.value.code == 2
    assert "config error: seed: expected an integer in [0, 2**64)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # before: wrote into the current folder
        train_main([str(config), "--out", ""])
    assert info.value.code == 2
    assert "hpfunc train: --out: expected a folder path, found ''" in capsys.readouterr().err
    # an empty file under data.max_bytes: the data is to blame, not the byte cap
    (tmp_path / "empty.py").write_text("")
    with pytest.raises(SystemExit) as info:
        train_main([str(config), "--set", f"data.paths=[{tmp_path}/empty.py]", "--set", "data.max_bytes=100000"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error: data.paths: the training split has 0 tokens" in err and "raise data.max_bytes" not in err
    # SIGTERM of one process without checkpoints: a message and 143 after the step, not a bare -15
    monkeypatch.setenv(FAULTS, "term@2")
    with pytest.raises(SystemExit) as info:
        train_main([str(config)])
    assert info.value.code == 143
    err = capsys.readouterr().err
    assert ("hpfunc train: stopped by SIGTERM after step 2; checkpoints are off (checkpoint.every: 0), so the run "
            "cannot be continued; the metrics up to step 2 are kept") in err, err
    assert [s for s, *_ in _steps(read_metrics(tmp_path / "out" / "metrics.jsonl"))] == [1, 2]


def test_launch_says_when_restarts_are_used_up_and_refuses_a_missing_script(tmp_path, capsys):
    from hpfunc.launch import main as launch_main

    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    launch = [sys.executable, "-m", "hpfunc.launch", "--nproc", "1"]
    # in this process (`hpfunc launch`'s main, as the usage tests call it): refused before torch's launcher
    # runs, so before any rank could start
    with pytest.raises(SystemExit) as refused:
        launch_main(["--nproc", "1", str(tmp_path / "nothere.py")])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"hpfunc launch: the script '{tmp_path / 'nothere.py'}' does not exist" in err, err
    proc = subprocess.run([*launch, "--max-restarts", "1", str(script)], capture_output=True, text=True, env=_env(),
                          timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert ("hpfunc: rank 0 of 1 failed (exit status 3); its error is printed above. The other ranks were stopped. "
            "The group was restarted 1 time(s), all that --max-restarts (parallel.max_restarts) allows, and failed "
            "again: giving up.") in proc.stderr, proc.stderr


def test_a_sample_that_cannot_be_written_is_said(tmp_path, capsys):
    import numpy as np

    config = _config(tmp_path, 4, 0)
    np.save(tmp_path / "ids.npy", np.arange(2000) % 300)
    train_main([str(config), "--set", "data.source=ids", "--set", f"data.paths=[{tmp_path / 'ids.npy'}]",
                "--set", "model.vocab_size=300", "--set", "output.sample_tokens=8", "--set", "output.progress=lines"])
    out = capsys.readouterr().out
    assert ("sample: none written: output.sample_tokens generates bytes, and this run's data is token ids "
            "(data.source: ids)") in out, out
    assert not (tmp_path / "out" / "sample.txt").exists()
