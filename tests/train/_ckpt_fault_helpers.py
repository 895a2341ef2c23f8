"""Rank side of the checkpoint fault tests: saves and loads given different folders or steps per rank."""

from __future__ import annotations

import os

import torch


def mismatched_saves_and_loads(root: str) -> dict[str, str]:
    """On a 2x2 mesh: a save whose folder differs per rank, one whose step differs, a negative step,
    then a load whose folder differs; every rank's error message (or 'saved'/'loaded')."""
    import torch.distributed as dist

    import hpfunc
    from hpfunc import P, checkpoint

    mesh = hpfunc.Mesh({"fsdp": 2, "tp": 2})
    r = dist.get_rank()
    state = {"w": hpfunc.shard(torch.arange(16.0).reshape(4, 4), mesh, P("fsdp", "tp")), "step": 1}
    out: dict[str, str] = {}
    cases = {"path": (f"{root}/rank{r}/step_00000001", 1), "step": (f"{root}/step_00000001", r + 1),
             "negative": (f"{root}/step_neg", -1)}
    for what, (path, step) in cases.items():
        try:
            checkpoint.save(path, state, step=step)
            out[what] = "saved"
        except checkpoint.CheckpointError as e:
            out[what] = str(e)
    checkpoint.save(f"{root}/good", state, step=1)
    try:
        checkpoint.load(f"{root}/good" if r == 0 else f"{root}/good_{r}", checkpoint.abstract(state))
        out["load"] = "loaded"
    except checkpoint.CheckpointError as e:
        out["load"] = str(e)
    out["files"] = " ".join(sorted(os.listdir(root)))
    return out
