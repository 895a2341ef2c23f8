"""Optimizer-state dtypes: at least fp32, whatever the params are."""

from __future__ import annotations

import torch


def state_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 leaves, fp64 for fp64 leaves.

    Moments kept in bf16 lose the small increments of late training; hpfunc keeps optimizer state
    in fp32 and leaves fp32 master weights (if any) to the caller.
    """
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got dtype {x.dtype}")
    return torch.promote_types(x.dtype, torch.float32)
