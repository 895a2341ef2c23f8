"""Faults on the input side of ``hpfunc train``: bad data files (written broken by the test), data that
cannot feed the run, a sequence longer than the model's positions, a mesh axis that shards nothing.

Each is a config error (exit status 2) whose message names the file or the key and the fix, raised
before anything is written (an existing run in the output folder stays whole) and, on a mesh,
before any process starts.
"""

from __future__ import annotations

import hashlib
import pathlib
import pickle

import numpy as np
import pytest
import torch
import yaml
from _train_helpers import TINY, write_corpus

from hpfunc.train.build import check_buildable
from hpfunc.train.cli import main as train_main
from hpfunc.train.config import ConfigError, load_config_dict
from hpfunc.train.data import DataError, load_data, read_ids, read_jsonl

_FIX_NPY = "write it again with np.save(path, np.asarray(ids, dtype=np.int32))"
_FIX_PT = "write it again with torch.save(torch.as_tensor(ids, dtype=torch.int32), path)"


class _NotATensor:
    """A class a weights-only load refuses (pickled by reference to this test module)."""


def _good_npy(path: pathlib.Path) -> bytes:
    np.save(path, np.arange(400, dtype=np.int32) % 256)
    return path.read_bytes()


def _good_pt(path: pathlib.Path) -> bytes:
    torch.save(torch.arange(400, dtype=torch.int32) % 256, path)
    return path.read_bytes()


def _write_bad(kind: str, folder: pathlib.Path) -> pathlib.Path:
    """A broken ids file of the given kind, written for real."""
    if kind.endswith("npy"):
        path = folder / f"{kind}.npy"
        good = _good_npy(path)
        if kind == "truncated-npy":
            path.write_bytes(good[: len(good) - 100])
        elif kind == "truncated-header-npy":
            path.write_bytes(good[:20])
        elif kind == "corrupt-npy":
            path.write_bytes(b"\x00garbage, not an array" * 10)
        elif kind == "object-npy":
            np.save(path, np.array([1, "two", None], dtype=object), allow_pickle=True)
        elif kind == "pickled-npy":
            path.write_bytes(pickle.dumps([1, 2, 3]))
        elif kind == "empty-npy":
            path.write_bytes(b"")
        elif kind == "float-npy":
            np.save(path, np.linspace(0, 1, 50))
        return path
    path = folder / f"{kind}.pt"
    good = _good_pt(path)
    if kind == "truncated-pt":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "corrupt-pt":
        path.write_bytes(b"x" * 300)
    elif kind == "pickled-pt":
        torch.save({"ids": _NotATensor()}, path)
    elif kind == "empty-pt":
        path.write_bytes(b"")
    elif kind == "list-pt":
        torch.save([1, 2, 3], path)
    return path


BAD_FILES = {
    "truncated-npy": "the .npy file is damaged or truncated (Failed to read all data",
    "truncated-header-npy": "the .npy file is damaged or truncated",
    "corrupt-npy": "not a .npy array: the file holds data that does not start with the .npy signature",
    "object-npy": "the array has dtype object (Python objects, stored as a pickle, which is not loaded",
    "pickled-npy": "not a .npy array: the file holds pickled Python data (not loaded: a pickle can run code)",
    "empty-npy": "the file is empty (0 bytes), not a .npy array",
    "float-npy": "expected integer token ids, found dtype float64",
    "truncated-pt": "the .pt file is damaged or truncated (RuntimeError: PytorchStreamReader failed reading zip",
    "corrupt-pt": "not a file written by torch.save (first bytes b'xxxx')",
    "pickled-pt": "the file holds Python objects other than tensors (Unsupported global: GLOBAL "
                  "test_faults_inputs._NotATensor), which are not loaded",
    "empty-pt": "the file is empty (0 bytes), not a saved tensor",
    "list-pt": "expected a saved integer tensor, found list",
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_bad_ids_file_is_a_data_error_naming_the_file(tmp_path, kind):
    path = _write_bad(kind, tmp_path)
    with pytest.raises(DataError) as info:
        read_ids([path])
    msg = str(info.value)
    assert msg.startswith(f"{path}: {BAD_FILES[kind]}"), msg
    if kind not in ("list-pt", "float-npy"):
        assert (_FIX_NPY if kind.endswith("npy") else _FIX_PT) in msg


def test_a_bad_ids_file_through_the_command_leaves_the_previous_run_whole(tmp_path, capsys):
    write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "output": {**TINY["output"], "dir": str(tmp_path / "out")}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    train_main([str(tmp_path / "tiny.yaml"), "--steps", "5"])
    out = tmp_path / "out"
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    capsys.readouterr()
    for kind in ("truncated-npy", "pickled-pt"):
        bad = _write_bad(kind, tmp_path)
        for extra in ([], ["--check"]):
            with pytest.raises(SystemExit) as info:
                train_main([str(tmp_path / "tiny.yaml"), "--overwrite", "--set", "data.source=ids",
                            "--set", f"data.paths=[{bad}]", "--set", "data.tokenizer=null", *extra])
            assert info.value.code == 2
            err = capsys.readouterr().err
            assert err.startswith(f"hpfunc train: config error: {bad}: {BAD_FILES[kind][:30]}"), err
            assert "Traceback" not in err
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before


def test_undecodable_jsonl_names_the_file_and_line(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"docs.jsonl:2: not UTF-8 text"):
        read_jsonl([f])


# ---------------------------------------------------------------------------------------------
# Data that cannot feed the run: checked by a run and by --check


def _ids_config(tmp_path: pathlib.Path, ids: np.ndarray, **train) -> pathlib.Path:
    np.save(tmp_path / "ids.npy", ids)
    cfg = {"data": {"source": "ids", "paths": ["ids.npy"], "val_fraction": 0.1},
           "model": {"preset": "qwen3-moe-tiny", "hidden_size": 32, "moe_intermediate_size": 32, "num_experts": 4},
           "train": {"steps": 2, "batch_size": 2, "seq_len": 16, "num_threads": 1, **train},
           "output": {"dir": str(tmp_path / "out"), "progress": "none"}}
    path = tmp_path / "ids.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_check_reads_the_data_and_checks_it_against_the_model(tmp_path, capsys):
    path = _ids_config(tmp_path, np.arange(2000) % 300)  # ids up to 299, vocabulary 256
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--check"])
    assert info.value.code == 2
    assert ("config error: model.vocab_size: the data has token ids up to 299 but the model's vocabulary is 256; "
            "set model.vocab_size: 300 (or more)") in capsys.readouterr().err
    train_main([str(path), "--check", "--set", "model.vocab_size=300"])
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["model"]["vocab_size"] == 300  # still the config, the data in a comment
    assert "# data: 1 id file(s): 2,000 tokens (1,800 train / 200 val), token ids < 300 (model.vocab_size 300)" in printed
    assert not (tmp_path / "out").exists()  # --check writes nothing
    # too few tokens for a window in each split, found by --check too
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--check", "--set", "model.vocab_size=300", "--set", "train.seq_len=1900"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "data.val_fraction: the training split has 1,800 tokens, too few for one window" in err
    assert ("add data (each split needs 1901 tokens, 3802 in all) or lower train.seq_len (to at most 999), or train "
            "without validation (data.val_fraction: 0)") in err
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--check", "--set", "model.vocab_size=300", "--set", "train.seq_len=900"])
    assert "data.val_fraction: the validation split has 200 tokens" in capsys.readouterr().err


def test_an_empty_file_names_the_file_and_the_split(tmp_path, capsys):
    path = _ids_config(tmp_path, np.zeros(0, dtype=np.int32))
    with pytest.raises(SystemExit) as info:
        train_main([str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (f"config error: data.paths: the training split has 0 tokens, too few for one window of train.seq_len + "
            f"1 = 17 tokens (the data: {tmp_path / 'ids.npy'} is empty; none kept for validation); add data "
            f"(data.paths)") in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_too_few_training_tokens_suggest_a_smaller_val_fraction(tmp_path, capsys):
    # 100 tokens: enough for a window of 17, but val_fraction 0.9 leaves the training split 10
    path = _ids_config(tmp_path, np.arange(100, dtype=np.int32))
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--set", "data.val_fraction=0.9"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error: data.val_fraction: the training split has 10 tokens, too few for one window" in err
    assert f"from {tmp_path / 'ids.npy'}; data.val_fraction 0.9 keeps the last 90 for validation" in err
    assert "set data.val_fraction between 0.17 and 0.83 (now 0.9)" in err  # lower it, not raise it
    with pytest.raises(SystemExit):  # without validation, only the training split needs a window
        train_main([str(path), "--set", "data.val_fraction=0.9", "--set", "train.eval_batches=0"])
    assert "lower data.val_fraction (now 0.9; at most 0.83 leaves 17 tokens for training)" in capsys.readouterr().err
    # the suggestion works
    train_main([str(path), "--set", "data.val_fraction=0.5"])
    assert (tmp_path / "out" / "summary.json").exists()


def test_a_validation_split_too_short_for_a_window_is_an_error_when_the_run_evaluates(tmp_path, capsys):
    path = _ids_config(tmp_path, np.arange(100, dtype=np.int32))  # val 10 tokens < 17
    with pytest.raises(SystemExit) as info:
        train_main([str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "data.val_fraction: the validation split has 10 tokens (data.val_fraction 0.1 of the data" in err
    assert "set data.val_fraction between 0.17 and 0.83 (now 0.1)" in err and "set train.eval_batches: 0" in err
    train_main([str(path), "--set", "train.eval_batches=0"])  # no validation asked: fine


# ---------------------------------------------------------------------------------------------
# What the model or the mesh cannot do


@pytest.mark.parametrize("seq_len, max_pos, preset", [(32, 8, "qwen3-moe-tiny"), (3000, None, "qwen3-dense-tiny")])
def test_a_sequence_longer_than_the_model_positions_is_a_config_error(tmp_path, capsys, seq_len, max_pos, preset):
    model = {"preset": preset, **({"max_position_embeddings": max_pos} if max_pos else {})}
    with pytest.raises(ConfigError) as info:
        check_buildable(load_config_dict({"model": model, "train": {"seq_len": seq_len}}))
    limit = max_pos or 2048
    assert str(info.value) == (
        f"train.seq_len: {seq_len} is longer than the model's model.max_position_embeddings ({limit}, preset "
        f"{preset!r}); use train.seq_len <= {limit} or set model.max_position_embeddings: {seq_len} (or more)")
    # through the command, before anything is read or written
    write_corpus(tmp_path / "corpus")
    cfg = {**TINY, "output": {**TINY["output"], "dir": str(tmp_path / "out")}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as exit_info:
        train_main([str(tmp_path / "tiny.yaml"), "--set", "model.max_position_embeddings=8"])
    assert exit_info.value.code == 2
    assert "train.seq_len: 32 is longer than the model's model.max_position_embeddings (8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mesh, plan, axis, kind", [
    ({"fsdp": 3}, ["fsdp"], "fsdp", "fsdp"),
    ({"dp": 3}, ["zero1"], "dp", "zero1"),
    ({"dp": 2, "fsdp": 3}, ["hsdp"], "fsdp", "hsdp"),
])
def test_a_mesh_axis_that_shards_no_parameter_is_refused_before_launch(tmp_path, capsys, mesh, plan, axis, kind):
    write_corpus(tmp_path / "corpus")
    n = 1
    for size in mesh.values():
        n *= size
    cfg = {**TINY, "train": {**TINY["train"], "batch_size": n}, "parallel": {"mesh": mesh, "plan": plan},
           "output": {**TINY["output"], "dir": str(tmp_path / "out")}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as info:
        train_main([str(tmp_path / "tiny.yaml")])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert (f"config error: parallel.mesh.{axis}: {kind} (parallel.plan[0]) over 3 ranks would shard nothing: no "
            f"dimension of any parameter of the model divides by 3") in captured.err
    assert "or use ddp for this axis" in captured.err
    assert "starting" not in captured.out and not (tmp_path / "out").exists()
    # ddp over the same axis is what the user gets anyway, and is accepted
    check_buildable(load_config_dict({"train": {"batch_size": 3}, "parallel": {"mesh": {"dp": 3}, "plan": ["ddp"]}}))
