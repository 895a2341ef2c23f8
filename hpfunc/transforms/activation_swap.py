"""Swap one stage-microbatch's saved activations to host memory and back (``SWAP_OUT`` / ``SWAP_IN``).

:func:`~hpfunc.transforms.pipeline.pipeline_map` runs the forward of a stage-microbatch that its
schedule swaps under an :class:`ActivationSwap` layer on hpfunc's saved-tensor stack
(:mod:`hpfunc.saved_tensors`). The layer keeps, for every tensor autograd saves, a slot holding the
tensor and what the layers outward of it made of it (so a memory recorder outside sees it kept on
the device); it hands parameters, batch data and the stage's inputs outward untouched (the step holds
them anyway: moving them would free nothing).

* :meth:`ActivationSwap.swap_out` copies each storage the slots refer to once (views share it) into
  host buffers (:class:`~hpfunc.transforms.host_copy.HostBuffer`: pinned, on a side stream with CUDA;
  a synchronous copy into a distinct buffer on CPU) and drops every reference the slots hold, so the
  device storage is freed unless someone else holds it (``keep``: storages the step holds, such as
  the stage's outputs, are left in place).
* :meth:`ActivationSwap.swap_in` brings them back into fresh device storages (CUDA: a host-to-device
  copy issued on the side stream, waited for when backward first unpacks a slot, so the copy
  overlaps whatever runs between ``SWAP_IN`` and the backward; CPU: a synchronous copy) and hands
  the new tensors outward again; the host buffers go.
* Unpacking a slot that is still on host brings the whole stage-microbatch back first (a schedule
  without its ``SWAP_IN`` still computes the right gradients).

Values are copied byte for byte: gradients with and without swaps are identical.

Example:
    >>> import torch
    >>> from hpfunc import saved_tensors
    >>> w = torch.randn(3, 3, requires_grad=True)
    >>> lay = ActivationSwap(held=[w])
    >>> with saved_tensors.layer(lay):
    ...     y = (torch.tanh(torch.ones(2, 3)) @ w).sum()
    >>> lay.swap_out(); lay.on_host_bytes        # tanh's output (2 x 3 fp32), saved by the matmul
    24
    >>> lay.swap_in(); lay.on_host_bytes
    0
    >>> y.backward(); w.grad.shape
    torch.Size([3, 3])
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hpfunc import saved_tensors
from hpfunc.memory._storage import storage_key
from hpfunc.transforms.host_copy import HostBuffer, is_fake, pin_for

__all__ = ["ActivationSwap"]


class _Slot:
    """One saved tensor: on the device (``tensor`` and its outward packing) or in a host buffer
    (``meta``: buffer index, slot in the buffer, dtype, size, stride, storage offset)."""

    __slots__ = ("tensor", "packed", "outer", "meta", "where", "event", "__weakref__")

    def __init__(self, t: torch.Tensor, outer: saved_tensors.Outer) -> None:
        self.tensor: torch.Tensor | None = t.detach()
        self.outer = outer
        self.packed: Any = outer.pack(t)
        self.meta: tuple | None = None
        self.where: str = "device"
        self.event: Any = None           # CUDA: the host-to-device copy this slot's tensor waits for


class ActivationSwap(saved_tensors.Layer):
    """The saved tensors of one forward region, movable to host memory and back (module docstring).

    Args:
        held: tensors whose storages are held elsewhere (parameters, the batch, the region's inputs):
            handed outward and never copied.
        memory_kind: ``"pinned_host"`` (default with CUDA) or ``"unpinned_host"``.
    """

    name = "hpfunc.pipeline.swap"

    def __init__(self, held: Iterable[torch.Tensor] = (), *, memory_kind: str | None = None) -> None:
        self.held = {storage_key(t) for t in held if isinstance(t, torch.Tensor)}
        self.pin = pin_for(memory_kind, "pipeline swap")
        # Weak: the graph owns the slots (a slot refers to this layer through its Outer; a strong list
        # here would make a cycle that keeps every saved tensor alive until the garbage collector runs).
        self._slots: list[weakref.ref] = []
        self.buffers: list[HostBuffer] = []
        self.stream: Any = None
        self.swapped = False

    # -- the saved-tensor stack -----------------------------------------------------------------------
    def pack(self, t: torch.Tensor, outer: saved_tensors.Outer) -> Any:
        if type(t) is not torch.Tensor or is_fake(t) or storage_key(t) in self.held:
            return outer.pack(t)
        slot = _Slot(t, outer)
        self._slots.append(weakref.ref(slot))
        return slot

    def unpack(self, packed: Any, outer: saved_tensors.Outer) -> torch.Tensor:
        if not isinstance(packed, _Slot):
            return outer.unpack(packed)
        if packed.where == "host":
            self.swap_in()
        if packed.event is not None:
            torch.cuda.current_stream(packed.tensor.device).wait_event(packed.event)
            packed.tensor.record_stream(torch.cuda.current_stream(packed.tensor.device))
            packed.event = None
        return packed.outer.unpack(packed.packed)

    # -- the swaps ------------------------------------------------------------------------------------
    def slots(self) -> Iterator[_Slot]:
        """The slots still held by the graph."""
        for ref in self._slots:
            slot = ref()
            if slot is not None:
                yield slot

    @property
    def on_host_bytes(self) -> int:
        """Bytes of the host buffers holding this region's activations now (0 when on the device)."""
        return sum(b.nbytes for b in self.buffers)

    def swap_out(self, keep: Iterable[torch.Tensor] = ()) -> None:
        """Copy the slots' storages to host and drop the device references (``keep``: storages left in place).

        Raises:
            ValueError: the region is swapped out already.
        """
        if self.swapped:
            raise ValueError("ActivationSwap.swap_out: expected activations on the device, found them on host "
                             "already (a second SWAP_OUT without a SWAP_IN between)")
        kept = {storage_key(t) for t in keep if isinstance(t, torch.Tensor)}
        index: dict[int, int] = {}
        sources: list[torch.Tensor] = []
        moving = []
        for slot in self.slots():
            t = slot.tensor
            key = storage_key(t)
            if key in kept:
                continue
            if key not in index:
                index[key] = len(sources)
                sources.append(t)
            moving.append((slot, index[key]))
        if sources:
            device = sources[0].device
            if device.type == "cuda" and self.stream is None:
                self.stream = torch.cuda.Stream(device)
            # One host buffer for the region: one copy (CUDA: on the side stream; record_stream keeps the
            # device blocks until it ends, so dropping them below is safe).
            buf = HostBuffer(sources, pin=self.pin, stream=self.stream)
            self.buffers.append(buf)
            for slot, j in moving:
                t = slot.tensor
                slot.meta = (len(self.buffers) - 1, j, t.dtype, tuple(t.shape), tuple(t.stride()),
                             t.storage_offset())
                slot.tensor, slot.packed, slot.where = None, None, "host"
        self.swapped = True

    def swap_in(self) -> None:
        """Bring the slots on host back into fresh device storages and hand them outward again.

        Raises:
            ValueError: the region is not swapped out.
        """
        if not self.swapped:
            raise ValueError("ActivationSwap.swap_in: expected activations on host, found them on the device "
                             "(a SWAP_IN without a SWAP_OUT before it)")
        back: dict[int, tuple[torch.Tensor, Any]] = {}
        for k, buf in enumerate(self.buffers):
            back[k] = _to_device(buf, self.stream)
        for slot in self.slots():
            if slot.where != "host":
                continue
            b, j, dtype, size, stride, offset = slot.meta
            data, event = back[b]
            itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
            start = self.buffers[b].offsets[j] // itemsize
            t = torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), start + offset, size, stride)
            slot.tensor, slot.packed, slot.where, slot.event, slot.meta = t.detach(), slot.outer.pack(t), "device", event, None
        self.buffers.clear()
        self.swapped = False


def _to_device(buf: HostBuffer, stream: Any) -> tuple[torch.Tensor, Any]:
    """A fresh device copy of ``buf``'s bytes, and the CUDA event to wait for (``None`` on CPU)."""
    if buf.device.type == "cuda":
        with torch.cuda.stream(stream):
            if buf.event is not None:
                stream.wait_event(buf.event)  # the device-to-host copy must have ended
            data = buf.host.to(buf.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return data, event
    # CPU: "device" and host memory are one; a distinct copy, as on an accelerator, so that the
    # measured bytes move as they would there.
    return buf.host.clone(), None
