"""Checkpoint keys are names: a state saved from Python (``init_train_state``'s ``TrainState``, optimizer
NamedTuples inside) has DCP keys ``params.<path>``, ``opt_state.<field>...``, ``step``, read with every
tensor equal by a process that imports only torch; a checkpoint of the older positional keys
(``0.<path>``) still loads. (The trainer's checkpoint: tests/models/test_hf_export.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import torch

import hpfunc
from hpfunc import checkpoint, optim
from hpfunc.checkpoint import dcp_io
from hpfunc.checkpoint.keys import key_paths
from hpfunc.models import preset, qwen3
from hpfunc.train import init_train_state

# a reader that has never heard of hpfunc: DCP's metadata lists the keys, DCP reads every tensor
TORCH_ONLY = textwrap.dedent("""
    import sys, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(sys.argv[1])
    meta = reader.read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    assert not [m for m in sys.modules if m.split(".")[0] == "hpfunc"]
    torch.save(sd, sys.argv[2])
""")


def read_with_torch_only(path, tmp_path) -> dict:
    out = tmp_path / "read.pt"
    res = subprocess.run([sys.executable, "-c", TORCH_ONLY, str(path), str(out)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


def _state():
    cfg = preset("qwen3-moe-tiny", num_hidden_layers=1)
    params = qwen3.init(hpfunc.random.key(0), cfg)
    state = init_train_state(params, optim.adamw(1e-3))
    # moments that are not zeros, so that a swapped key would be seen
    return hpfunc.tree.tree_map(lambda t: t + torch.rand(t.shape).to(t.dtype) if t.is_floating_point() else t,
                                state)


def test_a_state_saved_from_python_has_named_keys_read_by_torch_alone(tmp_path):
    state = _state()
    checkpoint.save(tmp_path / "ckpt", state, step=1)
    got = read_with_torch_only(tmp_path / "ckpt", tmp_path)
    want = dict(zip(key_paths(state), hpfunc.tree.leaves(state)))
    assert set(got) == {k for k, v in want.items() if isinstance(v, torch.Tensor)}
    for key in got:
        assert re.fullmatch(r"(params|opt_state|step)(\.[A-Za-z_][\w]*|\.\d+)*", key), key
        assert torch.equal(got[key], want[key]), key
    assert not set(got) & (set(key_paths(state, named=False)) - set(want))  # no NamedTuple field by position
    assert "params.layers.0.attn.wq" in got and any(k.startswith("opt_state.") and ".mu." in k for k in got)
    back = checkpoint.load(tmp_path / "ckpt", checkpoint.abstract(state))
    assert type(back) is type(state)
    assert all(torch.equal(a, b) for a, b in zip(hpfunc.tree.leaves(back), hpfunc.tree.leaves(state)))


def test_a_checkpoint_with_positional_keys_still_loads(tmp_path):
    state = _state()
    positional = key_paths(state, named=False)
    assert positional[0].startswith("0.") and positional != key_paths(state)
    # the writer of an older hpfunc: the same files, keys numbered by position
    dcp_io.write_flat(tmp_path / "old", dict(zip(positional, [x.detach() if isinstance(x, torch.Tensor) else x
                                                               for x in hpfunc.tree.leaves(state)])), step=1)
    assert set(checkpoint.info(tmp_path / "old")["keys"]) == set(positional)
    back = checkpoint.load(tmp_path / "old", checkpoint.abstract(state))
    assert all(torch.equal(a, b) for a, b in zip(hpfunc.tree.leaves(back), hpfunc.tree.leaves(state)))
