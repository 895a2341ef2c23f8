"""The engine's parameter gathers run outside torch's selective-checkpoint modes.

A ``remat`` region with a policy other than "save nothing" runs under torch's selective checkpointing,
two dispatch modes that number every aten op of the region: the forward stores, per op and invocation
index, a cached output or a mark "recompute"; the recompute in the backward must run the same ops, and
an op invoked more often there than in the forward is an error ("aten.cat.default encountered during
backward but not found in storage"), one invoked less often shifts the indices of the later calls onto
another call's cached output. The parameter gathers a region's reads trigger are not the same ops in
its forward and its recompute: the forward may land a gather prefetched by the layer before (no
``cat``), the recompute gathers again or lands a backward prefetch, and either may issue the next
layer's prefetch. So the engine runs them outside those modes (:func:`outside`), in the forward and in
the recompute alike; only the model's own ops are numbered, the same ones both times. Autograd is
unaffected (the modes sit below it) and so are torch's saved-tensor hooks (checkpoint still owns what
the gather saves).

Only selective-checkpoint modes on top of the dispatch stack are popped (a mode above them, e.g. a
user's ``TorchDispatchMode`` inside the region, stays, and then so do they): :func:`outside` says
whether any remains, and the engine then gathers as before, synchronously, and prefetches nothing.

    >>> with outside() as clear:
    ...     clear
    True
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils import _python_dispatch as _dispatch
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

__all__ = ["outside"]

_SAC_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


@contextlib.contextmanager
def outside() -> Iterator[bool]:
    """Inside: the selective-checkpoint modes on top of the dispatch stack are off. Yields whether no
    such mode remains on the stack (then the engine may prefetch)."""
    n = torch._C._len_torch_dispatch_stack()
    if n == 0:  # the common case, outside every mode: nothing to look at
        yield True
        return
    stack = [torch._C._get_dispatch_stack_at(i) for i in range(n)]
    top = 0
    while top < n and isinstance(stack[n - 1 - top], _SAC_MODES):
        top += 1
    popped = [_dispatch._pop_mode() for _ in range(top)]
    try:
        yield not any(isinstance(m, _SAC_MODES) for m in stack[: n - top])
    finally:
        for m in reversed(popped):
            _dispatch._push_mode(m)
