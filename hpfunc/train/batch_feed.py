"""The trainer's batches on the mesh's device: pinned host memory, ``non_blocking`` copies, the next one
prefetched on a copy stream.

The trainer samples each step's batch on the host (a pure function of the seed and the step,
:func:`hpfunc.train.data.sample_batch`). :class:`BatchFeed` hands it to the step on the run's device:

* on the CPU (one process) the host batch itself: nothing is pinned or copied;
* on a mesh, each rank's block of it (``place``: :func:`hpfunc.host_to_device.put_blocks` over the step's
  batch spec), as a DTensor laid out as the step takes it: on a CPU mesh a view of the host batch, on a
  CUDA mesh only that block pinned and copied ``non_blocking`` (not the whole batch, sliced on the device);
* on one CUDA device (no mesh) the batch pinned and copied ``non_blocking`` (:func:`hpfunc.host_to_device.put`).

On a CUDA device the host does not wait for the copy: after the loop has queued a step,
:meth:`BatchFeed.prefetch` samples the next step's batch and queues its copy on a side stream
(``torch.cuda.Stream``), so that it overlaps the step; :meth:`BatchFeed.take` makes the compute stream
wait for that copy (an event: the host does not wait) and tells the allocator the blocks are used there
(``record_stream``). On fake CUDA devices (the fake-CUDA tests, the dry run) the same ``non_blocking``
copies, unpinned and without a side stream (a fake device has no streams to overlap).

    >>> import torch
    >>> feed = BatchFeed(lambda n: {"tokens": torch.full((2, 3), n)}, "cpu")
    >>> feed.take(4)["tokens"][0].tolist(), feed.prefetch(5), feed.take(5)["tokens"][0, 0].item()
    ([4, 4, 4], False, 5)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from hpfunc import tree as _tree
from hpfunc.host_to_device import pins, put

__all__ = ["BatchFeed"]


class BatchFeed:
    """Step ``n``'s batch on ``device`` (``make(n)``: the host batch of step ``n``, sampled on demand).

    Args:
      make: ``n -> batch``, a pytree of host tensors (a pure function of ``n``: a prefetched batch is
        the one :meth:`take` would have made).
      device: the device the step runs on (``mesh.device_type``, or ``"cpu"``).
      place: ``place(host_batch, stream=None) -> batch on the device`` (a mesh's: this rank's blocks,
        :func:`hpfunc.host_to_device.put_blocks`); default the whole batch (:func:`hpfunc.host_to_device.put`).
    """

    def __init__(self, make: Callable[[int], Any], device: torch.device | str,
                 place: Callable[..., Any] | None = None):
        self.make = make
        self.device = torch.device(device)
        self.place = functools.partial(put, device=self.device) if place is None else place
        self._stream: Any = None
        self._ahead: tuple[int, Any, Any] | None = None  # (step, device batch, copy event)

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` copies ahead: on a CUDA device this process drives."""
        return pins(self.device)

    def take(self, n: int) -> Any:
        """Step ``n``'s batch on the device (the prefetched one when it is step ``n``'s)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == n:
            _, batch, done = ahead
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the device waits for the copy; the host does not
            for x in _tree.leaves(batch):
                if isinstance(x, torch.Tensor):  # made on the copy stream, used and freed on the compute one
                    getattr(x, "_local_tensor", x).record_stream(current)  # (a DTensor's block: its local tensor)
            return batch
        return self.place(self.make(n))

    def prefetch(self, n: int) -> bool:
        """Sample step ``n``'s batch now and queue its copy on the copy stream (call it after queueing
        the step before: the copy overlaps it). Whether it did (only on a CUDA device)."""
        if not self.prefetches:
            return False
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        batch = self.place(self.make(n), stream=self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        self._ahead = (n, batch, done)
        return True
