"""Saves checkpoints in a loop until killed (the kill -9 test's victim): resumes after the newest complete
checkpoint under argv[1], prints ``saved N`` after each save."""

import sys

import torch

from hpfunc import checkpoint

root = sys.argv[1]
manager = checkpoint.CheckpointManager(root, keep_last=2)
found = checkpoint.latest(root)
step = checkpoint.info(found)["step"] + 1 if found is not None else 0
while True:
    manager.save({"w": torch.full((64, 1024), float(step)), "step": step}, step)
    print(f"saved {step}", flush=True)
    step += 1
