"""``offload``: keep saved activations in host memory between forward and backward; state offload.

``offload(f, policy=...)`` runs ``f`` with a layer on hpfunc's saved-tensor stack
(:mod:`hpfunc.saved_tensors`): every tensor autograd saves for backward is shown to the policy as
``(op, name, tensor)``; those it marks ``Decision.OFFLOAD`` (or ``True`` for a plain predicate) are
copied to host memory (:mod:`hpfunc.transforms.host_copy`) and the device copy is released; backward
brings them back. The rest are handed to the layers outward, unchanged. The default policy offloads
everything (whole-layer swap). Selective swap combined with recompute is
``remat(f, policy=save_and_offload_only_these_names(...))``, which offloads the values the
selective checkpoint caches.

Copies work on storages: views sharing one storage (q, k, v split from one projection, a
transposed tensor) travel once. With ``bucket_bytes`` small storages are packed into one host
buffer per copy (fewer, larger transfers).

On CUDA, host buffers are pinned, device-to-host copies run on a separate stream, and when
backward first touches a region's values the previous region's values (the next ones backward
needs) are prefetched on that stream. On a CPU-only machine the copy is synchronous into a
distinct host buffer: :func:`hpfunc.memory.saved_activations` measures which device storages stay
alive and which host buffers hold copies, and the device bytes drop by what the policy names.

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
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from hpfunc import saved_tensors
from hpfunc import tree as _tree
from hpfunc.memory._names import NameScope, name_scope
from hpfunc.memory._recorder import current_recorder
from hpfunc.memory._storage import ProducerMode, StorageLog, storage_key, tensors_in
from hpfunc.transforms.host_copy import Handle, HostGroup, MemoryKindWarning, OffloadStats, is_fake, pin_for
from hpfunc.transforms.policies import (
    Decision, Policy, as_offload_policy, offload_dots, offload_everything, offload_only_these_names,
    warn_unknown_names,
)

__all__ = [
    "offload", "offload_everything", "offload_only_these_names", "offload_dots", "OffloadStats",
    "offload_state", "stream_to", "prefetch", "MemoryKindWarning",
]


class _Kept:
    """A saved tensor offload keeps, while its region runs; at the end of the region it is handed to
    the layers outward, or read from the host copy if a later view offloaded its storage."""

    __slots__ = ("tensor", "outer", "packed")

    def __init__(self, t: torch.Tensor, outer: saved_tensors.Outer) -> None:
        self.tensor: torch.Tensor | None = t
        self.outer = outer
        self.packed: Any = None


class _OffloadLayer(saved_tensors.Layer):
    """Offload's say over saved tensors: those its policy marks ``OFFLOAD`` go to host memory; the rest
    are handed to the layers outward (an enclosing offload may move them, a recorder sees them stay).

    Decisions are per storage: once one saved view of a storage is offloaded, every view of it saved
    in the region reads the host copy. Keeping one view on device would keep the whole storage there
    beside its host copy: ``checkpoint_name`` often tags a value after an op saved it (attention saves
    its output, which the model reshapes and tags ``attn_out`` afterwards), so what is kept is only
    handed outward when the region ends, when every tag is known.
    """

    name = "hpfunc.offload"

    def __init__(self, policy: Policy, group: HostGroup, scope: NameScope, held: set[int],
                 log: StorageLog | None, counters: OffloadStats) -> None:
        self.policy, self.group, self.scope, self.held, self.log, self.counters = \
            policy, group, scope, held, log, counters
        self.recorder = current_recorder()
        self.kept: list[_Kept] = []

    def _op(self, t: torch.Tensor) -> str | None:
        log = self.log if self.log is not None else (self.recorder.log if self.recorder is not None else None)
        return None if log is None else log.op_of(t)

    def _movable(self, t: torch.Tensor) -> bool:
        # Tensor subclasses (DTensor in the global view) stay: they own no storage to copy; inside
        # shard_map saved tensors are plain local blocks and do move. Arguments without a grad_fn
        # (parameters, data) are held by the caller anyway: moving them would free nothing.
        return (type(t) is torch.Tensor or is_fake(t)) and storage_key(t) not in self.held

    def pack(self, t: torch.Tensor, outer: saved_tensors.Outer) -> Any:
        if self._movable(t):
            name = self.scope.name_of(t)
            if self.group.holds(t) or self.policy.decide(
                    self.log.func_of(t) if self.log is not None else None, name, t) is Decision.OFFLOAD:
                return self.group.put(t, name, self._op(t))
        kept = _Kept(t, outer)
        self.kept.append(kept)
        return kept

    def close(self) -> None:
        """The region ended: hand what is kept outward (or to the host copy of its storage)."""
        for kept in self.kept:
            t = kept.tensor
            if self._movable(t) and self.group.holds(t):
                kept.packed = self.group.put(t, self.scope.name_of(t), self._op(t))
            else:
                self.counters.kept_bytes += t.numel() * t.element_size()
                kept.packed = kept.outer.pack(t)
            kept.tensor = None  # (the saved tensor itself: an output would hold its own grad_fn)
        self.kept.clear()

    def unpack(self, packed: Any, outer: saved_tensors.Outer) -> torch.Tensor:
        if isinstance(packed, _Kept):
            if packed.tensor is not None:  # a backward inside the region (a gradient taken in the forward)
                return packed.tensor.detach()
            packed = packed.packed
            if not isinstance(packed, Handle):
                return outer.unpack(packed)
        if isinstance(packed, Handle):
            return packed.get()
        return outer.unpack(packed)


_LAST_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("hpfunc_offload_last_group", default=None)


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

    Nesting (:mod:`hpfunc.saved_tensors`): a tensor that an enclosing layer owns (the parameters a
    parallelized step gathered) is never copied; what this policy keeps is handed outward, so an
    enclosing ``offload`` applies its own policy to it and nothing is copied twice. Inside a
    recomputed ``remat`` region nothing is offloaded (torch's checkpoint owns the region's saved
    tensors: they are dropped and recomputed anyway); around one (``offload(remat(layer))``) the
    region's inputs, which the recompute needs, are offloaded.
    """
    if f is None:
        return functools.partial(offload, policy=policy, memory_kind=memory_kind, bucket_bytes=bucket_bytes,
                                 stats=stats)
    pol = as_offload_policy(policy)
    pin = pin_for(memory_kind, "offload")
    counters = stats if stats is not None else OffloadStats()

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return f(*args, **kwargs)
        group = HostGroup(pin, bucket_bytes, counters)
        group.call = counters._calls
        counters._calls += 1
        group.prev = _LAST_GROUP.get()
        # Which op made each storage, for policies that look at it (nothing is packed in a recompute
        # region: no need to watch the ops there).
        log = StorageLog() if pol.needs_op and not saved_tensors.in_recompute_region() else None
        held = {storage_key(x) for x in tensors_in((args, kwargs)) if x.grad_fn is None}
        with name_scope() as scope:
            lay = _OffloadLayer(pol, group, scope, held, log, counters)
            try:
                with saved_tensors.layer(lay):
                    if log is not None:
                        with ProducerMode(log):
                            out = f(*args, **kwargs)
                    else:
                        out = f(*args, **kwargs)
            finally:
                lay.close()
                group.flush()
        counters.per_call.append(group.offloaded_bytes)
        warn_unknown_names(pol, scope.names, f)
        _LAST_GROUP.set(weakref.ref(group))
        return out

    wrapped.stats = counters  # type: ignore[attr-defined]
    return wrapped


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
    pin = pin_for(memory_kind, "offload_state")
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
