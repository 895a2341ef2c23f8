"""``offload``: keep saved activations in host memory between forward and backward; state offload.

``offload(f, policy=...)`` runs ``f`` under ``torch.autograd.graph.saved_tensors_hooks``: every
tensor autograd saves for backward is shown to the policy as ``(op, name, tensor)``; those it
marks ``Decision.OFFLOAD`` (or ``True`` for a plain predicate) are copied to host memory and the
device copy is released; backward brings them back. The default policy offloads everything
(whole-layer swap). Selective swap combined with recompute is
``remat(f, policy=save_and_offload_only_these_names(...))``, which offloads the values the
selective checkpoint caches.

Copies work on storages: views sharing one storage (q, k, v split from one projection, a
transposed tensor) travel once. With ``bucket_bytes`` small storages are packed into one host
buffer per copy (fewer, larger transfers).

On CUDA, host buffers are pinned, device-to-host copies run on a separate stream, and when
backward first touches a region's values the previous region's values (the next ones backward
needs) are prefetched on that stream. On a CPU-only machine the copy is synchronous into a
distinct host buffer: the bytes that stay "on device" (saved, not offloaded) are what
:func:`hpfunc.memory.saved_activations` reports, and they drop by what the policy names.

Example:
    >>> import torch, hpfunc
    >>> from hpfunc.transforms.offload import offload
    >>> layer = offload(lambda w, x: torch.tanh(x @ w).sum())
    >>> hpfunc.grad(layer)(torch.ones(3, 3), torch.ones(2, 3)).shape
    torch.Size([3, 3])

State offload (:func:`offload_state`, :func:`stream_to`, :func:`prefetch`) keeps parameters,
gradients or optimizer state at rest in host memory and streams them to the device per layer.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from hpfunc import tree as _tree
from hpfunc.memory import _record
from hpfunc.transforms.remat import INNERMOST, Decision, Policy, _warn_unknown, as_policy

__all__ = [
    "offload", "offload_everything", "offload_only_these_names", "offload_dots", "OffloadStats",
    "offload_state", "stream_to", "prefetch", "CacheOffloader", "MemoryKindWarning",
]


class MemoryKindWarning(UserWarning):
    """The requested memory kind does not exist on this machine; a fallback is used."""


offload_everything = Policy(lambda op, name, t: Decision.OFFLOAD, label="offload_everything", needs_op=False)
"""Whole-layer swap: every saved tensor goes to host memory."""


def offload_only_these_names(*names: str) -> Policy:
    """Offload the saved tensors tagged with one of ``names``; keep the rest on device."""
    keep = frozenset(names)
    return Policy(lambda op, name, t: Decision.OFFLOAD if name in keep else Decision.SAVE,
                  label=f"offload_only_these_names{tuple(sorted(keep))}", names=keep, needs_op=False)


def offload_dots() -> Policy:
    """Offload saved outputs of matmuls and fused attention; keep the rest on device."""
    from hpfunc.transforms.remat import _DOTS

    return Policy(lambda op, name, t: Decision.OFFLOAD if op in _DOTS else Decision.SAVE, label="offload_dots")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.is_meta


def _resolve_memory_kind(memory_kind: str | None, where: str) -> bool:
    """Return whether to pin host buffers; warn when pinned memory is asked for but unavailable."""
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
    if _is_fake(buf):
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    return torch.empty(0, dtype=dtype, device=buf.device).set_(buf.untyped_storage(), offset, size, stride)


def _meta(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device)


class OffloadStats:
    """Counters of one offload region (per call): what moved, in how many copies."""

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


class _HostBuffer:
    """Host copy of one or more device storages (several when fused), brought back on demand."""

    def __init__(self, sources: list[torch.Tensor], *, pin: bool, stream: Any) -> None:
        self.device = sources[0].device
        self.offsets: list[int] = []
        total = 0
        for s in sources:
            self.offsets.append(total)
            total += -(-_record.storage_nbytes(s) // 64) * 64  # aligned: any dtype can view at an offset
        self.nbytes = total
        self.stream = stream
        self.event = None
        self._on_device: torch.Tensor | None = None
        self._h2d_event = None
        self.users = 0  # handles reading this buffer; the device copy is dropped after the last read
        self._reads = 0
        if any(_is_fake(s) for s in sources):
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
        if self.device.type != "cuda" or self._on_device is not None or _is_fake(self.host):
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
        if self.device.type != "cuda" or _is_fake(self.host):
            return self.host
        self.prefetch()
        torch.cuda.current_stream(self.device).wait_event(self._h2d_event)
        buf = self._on_device
        buf.record_stream(torch.cuda.current_stream(self.device))
        return buf


class _Handle:
    """What autograd holds instead of an offloaded tensor."""

    __slots__ = ("slot", "meta", "group")

    def __init__(self, slot: list, meta: tuple, group: "_Group") -> None:
        self.slot, self.meta, self.group = slot, meta, group  # slot = [buffer, index, handles] (buffer on flush)

    def get(self) -> torch.Tensor:
        self.group.touched()
        buf, idx, _ = self.slot
        data = buf.bytes_on_device()
        buf.release_one()
        dtype, size, stride, offset, device = self.meta
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return _view_on(data, (dtype, size, stride, offset + buf.offsets[idx] // itemsize, device))


_LAST_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("hpfunc_offload_last_group", default=None)


class _Group:
    """The offloaded storages of one call of an offloaded function (one layer, typically)."""

    def __init__(self, pin: bool, bucket_bytes: int, stats: OffloadStats, recorder: Any) -> None:
        self.pin, self.bucket_bytes, self.stats, self.recorder = pin, bucket_bytes, stats, recorder
        self.slots: dict[int, tuple[list, StorageWeakRef]] = {}
        self.pending: list[tuple[torch.Tensor, list]] = []
        self.pending_bytes = 0
        self.buffers: list[_HostBuffer] = []
        self.stream = None
        self.prev: Any = None  # weakref to the group created before this one (backward needs it next)
        self._touched = False
        self.offloaded_bytes = 0
        self.call = 0

    def _stream_for(self, t: torch.Tensor) -> Any:
        if t.device.type == "cuda" and not _is_fake(t):
            if self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            return self.stream
        return None

    def put(self, t: torch.Tensor, name: str | None, op: str | None) -> _Handle:
        key = _record.storage_key(t)
        hit = self.slots.get(key)
        if hit is None or hit[1].expired():  # an expired hit is a freed storage whose address was reused
            slot: list = [None, 0, 0]
            nbytes = _record.storage_nbytes(t)
            self.slots[key] = (slot, StorageWeakRef(t.untyped_storage()))
            self.stats.tensors_offloaded += 1
            self.stats.offloaded_bytes += nbytes
            self.offloaded_bytes += nbytes
            if self.recorder is not None:
                self.recorder.record(t, kind="offloaded", where="host", name=name, op=op)
            if self.bucket_bytes and nbytes < self.bucket_bytes:
                self.pending.append((t, slot))
                self.pending_bytes += nbytes
                if self.pending_bytes >= self.bucket_bytes:
                    self.flush()
            else:
                self._copy([(t, slot)])
        else:
            slot = hit[0]
        slot[2] += 1
        if slot[0] is not None:
            slot[0].users += 1
        return _Handle(slot, _meta(t), self)

    def _copy(self, items: list[tuple[torch.Tensor, list]]) -> None:
        buf = _HostBuffer([t for t, _ in items], pin=self.pin, stream=self._stream_for(items[0][0]))
        for i, (_, slot) in enumerate(items):
            slot[0], slot[1] = buf, i
            buf.users += slot[2]
        self.buffers.append(buf)
        self.stats.copies += 1

    def flush(self) -> None:
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


class _ProducerMode(TorchDispatchMode):
    """Records which op produced each storage (for policies that look at ``op``)."""

    def __init__(self, producers: dict[int, str], ops: dict[int, Any]) -> None:
        super().__init__()
        self.producers, self.ops = producers, ops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_record.storage_key(t) for t in _record.tensors_in((args, kwargs))}
        for t in _record.tensors_in(out):
            key = _record.storage_key(t)
            if key not in inputs:  # views (also _unsafe_view) and in-place ops keep their producer
                self.producers[key] = str(func)
                self.ops[key] = func
        return out


def offload(f: Callable | None = None, *, policy: Any = None, memory_kind: str | None = None,
            bucket_bytes: int = 0, stats: OffloadStats | None = None) -> Callable:
    """Return ``f`` with the tensors it saves for backward kept in host memory, chosen by ``policy``.

    Args:
        f: any function over pytrees of tensors; usable as a decorator (``@offload`` or
            ``@offload(policy=...)``).
        policy: ``None`` / :data:`offload_everything` (whole-layer swap),
            :func:`offload_only_these_names`, :func:`offload_dots`, any remat policy (its
            ``OFFLOAD`` decisions are offloaded, everything else stays on device), or a predicate
            ``(op, name, tensor) -> bool`` (True = offload).
        memory_kind: ``"pinned_host"`` (default with CUDA) or ``"unpinned_host"``; asking for
            pinned memory without CUDA warns (:class:`MemoryKindWarning`) and copies unpinned.
        bucket_bytes: storages smaller than this are packed together into host buffers of about
            this size, one copy per buffer (0: one copy per storage).
        stats: an :class:`OffloadStats` to accumulate counters into (offloaded bytes, copies).

    Inside a recomputed ``remat`` region nothing is offloaded (the region's saved tensors are
    dropped and recomputed anyway); around one (``offload(remat(layer))``) the region's inputs,
    which the recompute needs, are offloaded.
    """
    if f is None:
        return functools.partial(offload, policy=policy, memory_kind=memory_kind, bucket_bytes=bucket_bytes,
                                 stats=stats)
    if policy is None:
        pol = offload_everything
    elif isinstance(policy, Policy):
        pol = policy
    elif callable(policy):
        user = policy
        pol = Policy(lambda op, name, t: Decision.OFFLOAD if user(op, name, t) else Decision.SAVE,
                     label=getattr(user, "__name__", repr(user)))
    else:
        pol = as_policy(policy)
    pin = _resolve_memory_kind(memory_kind, "offload")
    counters = stats if stats is not None else OffloadStats()

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if INNERMOST.get() == "remat" or not torch.is_grad_enabled():
            return f(*args, **kwargs)
        rec = _record.current_recorder()
        group = _Group(pin, bucket_bytes, counters, rec)
        group.call = counters._calls
        counters._calls += 1
        group.prev = _LAST_GROUP.get()
        producers: dict[int, str] = {}
        ops: dict[int, Any] = {}
        # Arguments without a grad_fn (parameters, data) are held by the caller anyway: moving them
        # would free nothing, so they stay where they are.
        held = {_record.storage_key(x) for x in _record.tensors_in((args, kwargs)) if x.grad_fn is None}

        with _record.name_scope() as scope:
            def pack(t: torch.Tensor) -> Any:
                name = scope.name_of(t)
                key = _record.storage_key(t)
                op = ops.get(key)
                d = pol.decide(op, name, t)
                # Tensor subclasses (DTensor in the global view) stay: they own no storage to copy;
                # inside shard_map saved tensors are plain local blocks and do move.
                plain = type(t) is torch.Tensor or _is_fake(t)
                if d is Decision.OFFLOAD and key not in held and plain:
                    return group.put(t, name, producers.get(key))
                counters.kept_bytes += t.numel() * t.element_size()
                if rec is not None:
                    rec.record(t, kind="saved", where="device", name=name, op=producers.get(key))
                # detached: a saved output returned as itself would hold its own grad_fn (a reference
                # cycle that keeps a graph nobody runs backward on alive until the garbage collector)
                return t.detach()

            def unpack(h: Any) -> torch.Tensor:
                return h.get() if isinstance(h, _Handle) else h

            token = INNERMOST.set("offload")
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    if pol.needs_op:
                        with _ProducerMode(producers, ops):
                            out = f(*args, **kwargs)
                    else:
                        out = f(*args, **kwargs)
            finally:
                INNERMOST.reset(token)
            group.flush()
        counters.per_call.append(group.offloaded_bytes)
        _warn_unknown(pol, scope, f)
        _LAST_GROUP.set(weakref.ref(group))
        return out

    wrapped.stats = counters  # type: ignore[attr-defined]
    return wrapped


class _CachedOnHost:
    """A selective-checkpoint cache entry that lives in host memory (``get_val`` brings it back)."""

    def __init__(self, handle: _Handle) -> None:
        self.handle = handle

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        return self.handle.get()


class CacheOffloader:
    """Moves selected selective-checkpoint cache entries to host memory (used by ``remat``)."""

    def __init__(self, *, recorder: Any = None, memory_kind: str | None = None) -> None:
        self.recorder = recorder
        self.memory_kind = memory_kind
        self.group: _Group | None = None

    def cache_entry(self, wrapper: Any, *, name: str | None, op: str | None) -> _CachedOnHost:
        if self.group is None:
            pin = _resolve_memory_kind(self.memory_kind, "remat offload")
            self.group = _Group(pin, 0, OffloadStats(), self.recorder)
        t = wrapper.val
        return _CachedOnHost(self.group.put(t, name, op))


# ---------------------------------------------------------------------------------------------
# State offload: parameters / gradients / optimizer state at rest in host memory


def _check_device(device: Any, where: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where}: device {str(dev)!r} requested but this machine has no CUDA device "
                         f"(torch.cuda.is_available() is False); use 'cpu', or 'meta' for a shape-only dry run")
    return dev


def _select(predicate: Callable[[str, Any], bool] | None) -> Callable[[str, Any], bool]:
    return (lambda p, x: True) if predicate is None else predicate


def offload_state(tree: Any, predicate: Callable[[str, Any], bool] | None = None, *,
                  memory_kind: str | None = None) -> Any:
    """Copy the leaves selected by ``predicate(path, leaf)`` (all by default) into host memory.

    Returns a tree of the same structure: selected tensor leaves are fresh host tensors (pinned
    with CUDA), the rest are unchanged. Use on parameters, gradients or optimizer state; bring them
    back with :func:`stream_to` or :func:`prefetch`. Meta tensors become uninitialised host tensors
    of the same shape (dry runs).

    >>> import torch
    >>> host = offload_state({"w": torch.ones(2), "step": torch.tensor(3)}, lambda p, x: p == "w")
    >>> host["w"].device.type
    'cpu'
    """
    pin = _resolve_memory_kind(memory_kind, "offload_state")
    sel = _select(predicate)

    def move(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not sel(path, x):
            return x
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=pin)
        if not x.is_meta:
            out.copy_(x.detach(), non_blocking=pin)
        return out

    return _tree.map_with_path(move, tree)


def stream_to(tree: Any, device: Any, predicate: Callable[[str, Any], bool] | None = None, *,
              non_blocking: bool = True, stream: Any = None) -> Any:
    """Copy the selected host leaves of ``tree`` to ``device`` (a new tree; the host copy stays).

    ``device='meta'`` gives shape-only copies (useful to exercise the path on a CPU-only machine).
    On CUDA the copies are issued on ``stream`` when given (the caller waits on it).
    """
    dev = _check_device(device, "stream_to")
    sel = _select(predicate)

    def move(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not sel(path, x):
            return x
        if dev.type == "cpu" and x.device.type == "cpu":
            return x.detach().clone()  # a distinct "device" copy, as on an accelerator
        return x.detach().to(dev, non_blocking=non_blocking)

    if stream is not None and dev.type == "cuda":
        with torch.cuda.stream(stream):
            return _tree.map_with_path(move, tree)
    return _tree.map_with_path(move, tree)


def prefetch(trees: Iterable[Any], device: Any, predicate: Callable[[str, Any], bool] | None = None, *,
             depth: int = 1) -> Iterator[Any]:
    """Yield each tree of ``trees`` (e.g. per-layer parameters at rest on the host) on ``device``,
    with the next ``depth`` trees already being copied.

    On CUDA the copies run on a side stream and each yielded tree is ready on the current stream;
    elsewhere the copies are synchronous but issued in the same order (one layer ahead).

    >>> import torch
    >>> layers = [{"w": torch.full((2,), float(i))} for i in range(3)]
    >>> [float(l["w"][0]) for l in prefetch(layers, "cpu")]
    [0.0, 1.0, 2.0]
    """
    if depth < 0:
        raise ValueError(f"prefetch: depth must be >= 0, found {depth}")
    dev = _check_device(device, "prefetch")
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    queue: list[tuple[Any, Any]] = []
    it = iter(trees)

    def issue() -> bool:
        try:
            nxt = next(it)
        except StopIteration:
            return False
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))
            out = stream_to(nxt, dev, predicate, stream=stream)
            ev = torch.cuda.Event()
            ev.record(stream)
        else:
            out, ev = stream_to(nxt, dev, predicate), None
        queue.append((out, ev))
        return True

    for _ in range(depth + 1):
        if not issue():
            break
    while queue:
        out, ev = queue.pop(0)
        if ev is not None:
            torch.cuda.current_stream(dev).wait_event(ev)
        yield out  # while the caller computes with this tree, the next `depth` are in flight
        issue()
