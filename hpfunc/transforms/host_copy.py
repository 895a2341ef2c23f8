"""Host copies of device storages: copied out in forward, brought back on demand in backward.

The machinery under :func:`hpfunc.transforms.offload.offload` (saved tensors) and under ``remat``'s
``OFFLOAD`` decisions (selective-checkpoint cache entries): a :class:`HostGroup` holds the host copies
of one region (one call of an offloaded layer); :meth:`HostGroup.put` copies a tensor's storage out
once, however many views of it are put, and returns a :class:`Handle` whose :meth:`Handle.get` gives
the tensor back. Small storages can share one host buffer (``bucket_bytes``: one copy per bucket).

On CUDA, host buffers are pinned and copies run on a side stream (``record_stream`` keeps the device
block until its copy ends); :meth:`HostGroup.touched` (the first read in backward) starts bringing
back the group made before it, which backward needs next. Elsewhere the copy is synchronous into a
distinct host buffer and backward reads from it.

Every host buffer is registered with the memory recorder, when one is measuring
(:meth:`hpfunc.memory._recorder.Recorder.host_copy`): it is how a report tells host copies from
device storages. Whether a device storage was freed is the recorder's measurement, not ours.

    >>> import torch
    >>> g = HostGroup(pin=False, bucket_bytes=0, stats=OffloadStats())
    >>> x = torch.arange(6.0).view(2, 3)
    >>> h1, h2 = g.put(x, "h", None), g.put(x.t(), "h", None)   # two views: one storage, one copy
    >>> g.stats.copies, torch.equal(h2.get(), x.t()), g.buffers[0].host.data_ptr() != x.data_ptr()
    (1, True, True)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from hpfunc.memory._recorder import HostPart, current_recorder
from hpfunc.memory._storage import storage_key, storage_nbytes

__all__ = ["MemoryKindWarning", "OffloadStats", "pin_for", "is_fake", "HostBuffer", "Handle", "HostGroup",
           "CacheOffloader"]

_ALIGN = 64  # bytes: a storage placed after another in a shared buffer starts where any dtype can view it


class MemoryKindWarning(UserWarning):
    """The requested memory kind does not exist on this machine; a fallback is used."""


def is_fake(t: torch.Tensor) -> bool:
    """A fake (``FakeTensorMode``) or meta tensor: shapes only, nothing to copy."""
    return isinstance(t, FakeTensor) or t.is_meta


def pin_for(memory_kind: str | None, where: str) -> bool:
    """Whether host buffers are pinned for ``memory_kind``; warn when pinned memory is asked for but
    there is no CUDA device. ``where`` names the caller in messages."""
    if memory_kind is None:
        return torch.cuda.is_available()
    if memory_kind not in ("pinned_host", "unpinned_host"):
        raise ValueError(f"{where}: memory_kind must be 'pinned_host' or 'unpinned_host', found {memory_kind!r}")
    if memory_kind == "pinned_host" and not torch.cuda.is_available():
        warnings.warn(
            f"{where}: memory_kind='pinned_host' needs a CUDA device and this machine has none; offloaded "
            f"tensors are copied synchronously into ordinary (unpinned) host memory instead",
            MemoryKindWarning, stacklevel=3)
        return False
    return memory_kind == "pinned_host"


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of ``t``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view_on(buf: torch.Tensor, like: tuple) -> torch.Tensor:
    dtype, size, stride, offset, device = like
    if is_fake(buf):
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    return torch.empty(0, dtype=dtype, device=buf.device).set_(buf.untyped_storage(), offset, size, stride)


def _meta(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device)


class OffloadStats:
    """Counters of one offload region (per call): what moved, in how many copies.

    These are offload's own counts (what it copied); what a forward keeps alive is measured by
    :func:`hpfunc.memory.saved_activations`.
    """

    def __init__(self) -> None:
        self.offloaded_bytes = 0
        self.kept_bytes = 0
        self.copies = 0
        self.tensors_offloaded = 0
        self.per_call: list[int] = []  # offloaded bytes of each call, in order (one entry per layer)
        # Backward: the calls in the order backward first read them, and (call, call prefetched then).
        # Calls are numbered per stats object, from 0. Prefetch copies on CUDA only; elsewhere it
        # is requested (recorded here) and the values are read from the host buffer.
        self.backward_order: list[int] = []
        self.prefetched: list[tuple[int, int]] = []
        self._calls = 0

    def __repr__(self) -> str:
        return (f"OffloadStats(offloaded_bytes={self.offloaded_bytes}, kept_bytes={self.kept_bytes}, "
                f"copies={self.copies}, tensors_offloaded={self.tensors_offloaded}, calls={len(self.per_call)})")


class HostBuffer:
    """Host copy of one or more device storages (several when fused), brought back on demand."""

    def __init__(self, sources: list[torch.Tensor], *, pin: bool, stream: Any) -> None:
        self.device = sources[0].device
        self.offsets: list[int] = []
        self.slots: list[int] = []  # bytes of each source's slot (its storage, padded to the next offset)
        total = 0
        for i, s in enumerate(sources):
            self.offsets.append(total)
            n = storage_nbytes(s)
            if i + 1 < len(sources):
                n = -(-n // _ALIGN) * _ALIGN
            self.slots.append(n)
            total += n
        self.nbytes = total
        self.stream = stream
        self.event = None
        self._on_device: torch.Tensor | None = None
        self._h2d_event = None
        self.users = 0  # handles reading this buffer; the device copy is dropped after the last read
        self._reads = 0
        if any(is_fake(s) for s in sources):
            self.host = torch.empty(total, dtype=torch.uint8, device=self.device)
            return
        self.host = torch.empty(total, dtype=torch.uint8, pin_memory=pin and self.device.type == "cuda")
        if self.device.type == "cuda" and stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for s, off in zip(sources, self.offsets):
                    src = _byte_view(s)
                    self.host[off:off + src.numel()].copy_(src, non_blocking=True)
                    src.record_stream(stream)  # the allocator keeps the device block until the copy ends
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            for s, off in zip(sources, self.offsets):
                src = _byte_view(s)
                self.host[off:off + src.numel()].copy_(src)

    def prefetch(self) -> None:
        """Start the host-to-device copy (CUDA only; elsewhere values are read from the host copy)."""
        if self.device.type != "cuda" or self._on_device is not None or is_fake(self.host):
            return
        stream = self.stream
        with torch.cuda.stream(stream):
            if self.event is not None:
                stream.wait_event(self.event)
            self._on_device = self.host.to(self.device, non_blocking=True)
            self._h2d_event = torch.cuda.Event()
            self._h2d_event.record(stream)

    def release_one(self) -> None:
        # Each saved tensor is unpacked once per backward: after the last one, the views handed to
        # autograd keep what they need alive and the buffer's own device copy can go.
        self._reads += 1
        if self._reads >= self.users:
            self._reads = 0
            self._on_device = None

    def bytes_on_device(self) -> torch.Tensor:
        if self.device.type != "cuda" or is_fake(self.host):
            return self.host
        self.prefetch()
        torch.cuda.current_stream(self.device).wait_event(self._h2d_event)
        buf = self._on_device
        buf.record_stream(torch.cuda.current_stream(self.device))
        return buf


class Handle:
    """What is kept instead of an offloaded tensor: ``get()`` gives the tensor back (on its device)."""

    __slots__ = ("slot", "meta", "group")

    def __init__(self, slot: list, meta: tuple, group: "HostGroup") -> None:
        self.slot, self.meta, self.group = slot, meta, group  # slot = [buffer, index, handles] (buffer on flush)

    def get(self) -> torch.Tensor:
        self.group.touched()
        buf, idx, _ = self.slot
        data = buf.bytes_on_device()
        buf.release_one()
        dtype, size, stride, offset, device = self.meta
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return _view_on(data, (dtype, size, stride, offset + buf.offsets[idx] // itemsize, device))


class HostGroup:
    """The host copies of one region (one call of an offloaded function, typically one layer).

    ``prev`` (a weak reference to the group made before this one) is prefetched when this group is
    first read in backward; ``call`` numbers the group in ``stats``.
    """

    def __init__(self, pin: bool, bucket_bytes: int, stats: OffloadStats, recorder: Any = None) -> None:
        self.pin, self.bucket_bytes, self.stats = pin, bucket_bytes, stats
        self.recorder = recorder if recorder is not None else current_recorder()
        self.slots: dict[int, tuple[list, StorageWeakRef]] = {}
        self.pending: list[tuple[torch.Tensor, list, str | None, str | None]] = []
        self.pending_bytes = 0
        self.buffers: list[HostBuffer] = []
        self.stream = None
        self.prev: Any = None
        self._touched = False
        self.offloaded_bytes = 0
        self.call = 0

    def _stream_for(self, t: torch.Tensor) -> Any:
        if t.device.type == "cuda" and not is_fake(t):
            if self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            return self.stream
        return None

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage has a host copy here (put earlier, through any view)."""
        hit = self.slots.get(storage_key(t))
        return hit is not None and not hit[1].expired()

    def put(self, t: torch.Tensor, name: str | None, op: str | None) -> Handle:
        """Copy ``t``'s storage to host (once per storage) and return the handle that brings ``t`` back.
        ``name`` and ``op`` label the copy in memory reports."""
        key = storage_key(t)
        hit = self.slots.get(key)
        if hit is None or hit[1].expired():  # an expired hit is a freed storage whose address was reused
            slot: list = [None, 0, 0]
            nbytes = storage_nbytes(t)
            self.slots[key] = (slot, StorageWeakRef(t.untyped_storage()))
            self.stats.tensors_offloaded += 1
            self.stats.offloaded_bytes += nbytes
            self.offloaded_bytes += nbytes
            if self.bucket_bytes and nbytes < self.bucket_bytes:
                self.pending.append((t, slot, name, op))
                self.pending_bytes += nbytes
                if self.pending_bytes >= self.bucket_bytes:
                    self.flush()
            else:
                self._copy([(t, slot, name, op)])
        else:
            slot = hit[0]
        slot[2] += 1
        if slot[0] is not None:
            slot[0].users += 1
        return Handle(slot, _meta(t), self)

    def _copy(self, items: list[tuple[torch.Tensor, list, str | None, str | None]]) -> None:
        buf = HostBuffer([t for t, *_ in items], pin=self.pin, stream=self._stream_for(items[0][0]))
        for i, (_, slot, _, _) in enumerate(items):
            slot[0], slot[1] = buf, i
            buf.users += slot[2]
        self.buffers.append(buf)
        self.stats.copies += 1
        if self.recorder is not None:
            self.recorder.host_copy(buf.host, [
                HostPart(n, name, op, tuple(t.shape), str(t.dtype).replace("torch.", ""))
                for (t, _, name, op), n in zip(items, buf.slots)])

    def flush(self) -> None:
        """Copy the storages still waiting for a bucket to fill (at the end of the region)."""
        if self.pending:
            self._copy(self.pending)
            self.pending, self.pending_bytes = [], 0

    def touched(self) -> None:
        # First use in backward: start bringing back the previous region, which backward needs next.
        if not self._touched:
            self._touched = True
            self.stats.backward_order.append(self.call)
            prev = self.prev() if self.prev is not None else None
            if prev is not None and not prev._touched:  # touched: an earlier backward (previous step)
                self.stats.prefetched.append((self.call, prev.call))
                for b in prev.buffers:
                    b.prefetch()


class _CachedOnHost:
    """A selective-checkpoint cache entry that lives in host memory (``get_val`` brings it back)."""

    __slots__ = ("handle",)

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        return self.handle.get()


class CacheOffloader:
    """Moves selected selective-checkpoint cache entries to host memory (``remat``'s ``OFFLOAD``).

    torch's selective checkpoint keeps its cache outside saved-tensor hooks, as wrappers with a
    ``get_val`` method; :meth:`cache_entry` swaps one such wrapper for one whose value waits on host.
    """

    def __init__(self, *, memory_kind: str | None = None, recorder: Any = None) -> None:
        self.memory_kind = memory_kind
        self.recorder = recorder
        self.group: HostGroup | None = None

    def cache_entry(self, wrapper: Any, *, name: str | None, op: str | None) -> _CachedOnHost:
        if self.group is None:
            self.group = HostGroup(pin_for(self.memory_kind, "remat offload"), 0, OffloadStats(), self.recorder)
        return _CachedOnHost(self.group.put(wrapper.val, name, op))
