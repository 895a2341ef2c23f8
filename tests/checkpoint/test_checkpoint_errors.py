"""Bad input is an error that says what was expected, what was found, where, and the fix; it comes before
anything is read into the target or written over."""

from __future__ import annotations

import pathlib

import pytest
import torch

from hpfunc import checkpoint
from hpfunc.checkpoint import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError

import _ckpt_helpers as H


def _state(hidden: int = 4) -> dict:
    return {"params": {"embed": torch.arange(8.0 * hidden).reshape(8, hidden), "norm": torch.ones(hidden)},
            "opt": {"count": torch.tensor(3)}, "step": 3}


@pytest.fixture
def saved(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "step_00000003"
    checkpoint.save(path, _state(), step=3)
    return path


def _distcp(path: pathlib.Path) -> pathlib.Path:
    return sorted(path.glob("*.distcp"))[0]


def test_another_model_names_missing_and_unexpected_keys(saved):
    other = _state()
    other["params"]["lm_head"] = other["params"].pop("norm")
    with pytest.raises(CheckpointMismatchError) as e:
        checkpoint.load(saved, checkpoint.abstract(other))
    msg = str(e.value)
    assert "'params.lm_head'" in msg and "'params.norm'" in msg and str(saved) in msg
    assert "lacks" in msg and "another model" in msg and "target built like the saved state" in msg


def test_shape_mismatch_names_key_checkpoint_and_both_shapes(saved):
    with pytest.raises(CheckpointMismatchError) as e:
        checkpoint.load(saved, checkpoint.abstract(_state(hidden=6)))
    msg = str(e.value)
    assert "key 'params.embed'" in msg and "saved shape (8, 4)" in msg and "wants (8, 6)" in msg
    assert str(saved) in msg and "config" in msg


def test_dtype_mismatch_names_key_and_both_dtypes(saved):
    target = checkpoint.abstract(_state())
    target["params"]["norm"] = checkpoint.Abstract((4,), torch.bfloat16)
    with pytest.raises(CheckpointMismatchError, match=r"key 'params.norm': saved dtype float32, the target wants "
                                                      r"bfloat16; load with the saved dtype and cast"):
        checkpoint.load(saved, target)


def test_tensor_where_the_target_has_a_value(saved):
    target = checkpoint.abstract(_state())
    target["opt"]["count"] = 0
    with pytest.raises(CheckpointMismatchError, match=r"key 'opt.count': the checkpoint holds a tensor int64\[\]"):
        checkpoint.load(saved, target)


def test_missing_shard_file_is_named(saved):
    victim = _distcp(saved)
    victim.unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"{victim}: shard file missing"):
        checkpoint.load(saved, checkpoint.abstract(_state()))
    assert checkpoint.latest(saved.parent) is None  # and latest() does not offer it


def test_checksum_mismatch_is_named(saved):
    victim = _distcp(saved)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{victim}: checksum mismatch \(crc32 [0-9a-f]{{8}} recorded, "
                                                     rf"[0-9a-f]{{8}} found\)"):
        checkpoint.load(saved, checkpoint.abstract(_state()))
    # sizes are all latest() checks: the damage is found by load, which reads the bytes
    assert checkpoint.latest(saved.parent) == saved


def test_truncated_file_is_named(saved):
    victim = _distcp(saved)
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match=rf"{victim}: \d+ bytes found, \d+ recorded"):
        checkpoint.load(saved, checkpoint.abstract(_state()))


def test_incomplete_checkpoint_is_refused_and_skipped(saved, tmp_path):
    newer = tmp_path / "step_00000004"
    checkpoint.save(newer, _state(), step=4)
    (newer / checkpoint.MARKER).unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"is incomplete: it has no completion marker .*latest\(root\)"):
        checkpoint.load(newer, checkpoint.abstract(_state()))
    assert checkpoint.latest(tmp_path) == saved
    with pytest.raises(IncompleteCheckpointError, match="the folder does not exist"):
        checkpoint.load(tmp_path / "nope", checkpoint.abstract(_state()))


def test_bad_metadata_refused_before_anything_is_written(saved):
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    with pytest.raises(checkpoint.CheckpointError, match="metadata must be strict JSON"):
        checkpoint.save(saved, _state(), step=3, metadata={"loss": float("nan")})
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before
    assert not list(saved.parent.glob(".*partial*"))


def test_saving_an_abstract_state_is_refused(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=r"the state leaf '[a-z.]+' is an abstract (float32|int64)\[[0-9, ]*\], not a value"):
        checkpoint.save(tmp_path / "c", checkpoint.abstract(_state()), step=0)


def test_resave_of_a_step_replaces_it_whole(saved):
    state = _state()
    state["params"]["embed"] += 1
    checkpoint.save(saved, state, step=3)
    out = checkpoint.load(saved, checkpoint.abstract(_state()))
    assert torch.equal(out["params"]["embed"], state["params"]["embed"])
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]


@pytest.mark.multirank
def test_a_corrupt_file_is_the_error_of_every_rank(pools, tmp_path):
    msgs = pools(2).run(H.corrupt_is_named_on_every_rank, str(tmp_path / "c"))
    assert msgs[0] == msgs[1] and "__1_0.distcp: checksum mismatch" in msgs[0], msgs


@pytest.mark.multirank
def test_a_save_rank_0_cannot_start_fails_on_every_rank(pools, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    msgs = pools(2).run(H.save_failure_is_every_ranks, str(blocker / "step_1"))
    assert msgs[0] == msgs[1] and msgs[0].startswith(
        f"cannot save the checkpoint of step 1 to {blocker / 'step_1'}: Not a directory (ENOTDIR)"), msgs
    assert blocker.read_text() == "not a folder"
