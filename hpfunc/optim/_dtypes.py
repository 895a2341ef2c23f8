"""Optimizer-state dtypes: at least fp32, whatever the params are."""

from __future__ import annotations

from typing import Any

import torch

from hpfunc.optim import _tree
from hpfunc.optim.errors import UnsupportedLeafError


def state_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 leaves, fp64 for fp64 leaves.

    Moments kept in bf16 lose the small increments of late training; hpfunc keeps optimizer state
    in fp32 and leaves fp32 master weights (if any) to the caller.
    """
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got dtype {x.dtype}")
    return torch.promote_types(x.dtype, torch.float32)


def zeros_state(params: Any, where: str) -> Any:
    """A tree of zeros shaped like ``params`` in :func:`state_dtype` (placements kept for DTensors)."""
    leaves, spec = _tree.flatten(params)
    for i, p in enumerate(leaves):
        if not (isinstance(p, torch.Tensor) and p.is_floating_point()):
            found = f"dtype {p.dtype}" if isinstance(p, torch.Tensor) else f"a {type(p).__name__}"
            raise UnsupportedLeafError(
                f"{where}: the leaf at '{_tree.paths(params)[i]}' is {found}; optimizer state needs "
                "floating-point tensors. Keep non-trainable values out of the params tree or mask them "
                "out with masked(...)/partition(...)."
            )
    return _tree.unflatten(spec, [torch.zeros_like(p, dtype=state_dtype(p)) for p in leaves])
