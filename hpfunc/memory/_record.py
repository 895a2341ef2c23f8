"""Context-scoped bookkeeping shared by ``remat``, ``offload`` and :func:`hpfunc.memory.saved_activations`.

Two things live here, both in ``contextvars`` (no module-level mutable state):

* a *recorder*: while :func:`saved_activations` runs a forward pass, every mechanism that keeps a
  tensor alive for backward (a saved-tensor hook, a remat region keeping its inputs, a selective
  checkpoint cache entry, an offload to host) reports the tensor here, by storage, so that a
  storage kept by two mechanisms is counted once;
* a *name scope*: ``checkpoint_name`` records which storages carry which name, so that policies
  that only see a saved tensor (offload's saved-tensor hooks) can still find its name.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["storage_key", "storage_nbytes", "Entry", "Recorder", "NameScope", "current_recorder",
           "current_scope", "recording", "name_scope"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory: a DTensor's local shard, else ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage, equal for all views of it (also for fake and meta tensors)."""
    return StorageWeakRef(local(t).untyped_storage()).cdata


def storage_nbytes(t: torch.Tensor) -> int:
    return int(local(t).untyped_storage().nbytes())


@dataclasses.dataclass
class Entry:
    """One storage kept alive for backward."""

    nbytes: int
    kind: str  # "saved" (saved-tensor hook), "cached" (selective checkpoint), "remat_input", "offloaded"
    where: str  # "device" or "host"
    name: str | None = None
    op: str | None = None
    shape: tuple[int, ...] = ()
    dtype: str = ""


class Recorder:
    """Collects :class:`Entry` per storage during one forward pass."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self._refs: dict[int, StorageWeakRef] = {}
        self.producers: dict[int, str] = {}
        self.host_entries: list[Entry] = []

    def record(self, t: torch.Tensor, *, kind: str, where: str = "device", name: str | None = None,
               op: str | None = None) -> None:
        key = storage_key(t)
        if where == "host":
            # The device storage is released after the copy (its address may be reused), so host
            # copies are kept apart; the device entry of the same storage, if any, moved.
            old = self.entries.pop(key, None)
            self._refs.pop(key, None)
            self.host_entries.append(Entry(storage_nbytes(t), kind, where, name or (old.name if old else None),
                                           op or self.producers.get(key), tuple(t.shape),
                                           str(t.dtype).replace("torch.", "")))
            return
        old = self.entries.get(key)
        if old is not None and not self._refs[key].expired():
            # A storage kept by several mechanisms counts once.
            old.name = old.name or name
            old.op = old.op or op
            return
        self._refs[key] = StorageWeakRef(local(t).untyped_storage())
        self.entries[key] = Entry(storage_nbytes(t), kind, where, name, op or self.producers.get(key),
                                  tuple(local(t).shape), str(t.dtype).replace("torch.", ""))

    def alive(self) -> list[tuple[int | None, Entry]]:
        """Entries whose storage is still alive (device) plus all host copies."""
        out: list[tuple[int | None, Entry]] = [(k, e) for k, e in self.entries.items() if not self._refs[k].expired()]
        return out + [(None, e) for e in self.host_entries]


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("hpfunc_memory_recorder", default=None)


def current_recorder() -> Recorder | None:
    return _RECORDER.get()


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    token = _RECORDER.set(rec)
    try:
        yield rec
    finally:
        _RECORDER.reset(token)


class NameScope:
    """Names tagged by ``checkpoint_name`` inside one transform call (forwarded to enclosing scopes)."""

    def __init__(self, parent: "NameScope | None" = None) -> None:
        self.parent = parent
        self.names: set[str] = set()
        self._by_storage: dict[int, tuple[StorageWeakRef, str]] = {}

    def record(self, name: str, t: torch.Tensor) -> None:
        scope: NameScope | None = self
        key = storage_key(t)
        while scope is not None:
            scope.names.add(name)
            scope._by_storage[key] = (StorageWeakRef(local(t).untyped_storage()), name)
            scope = scope.parent

    def name_of(self, t: torch.Tensor) -> str | None:
        key = storage_key(t)
        scope: NameScope | None = self
        while scope is not None:  # tags made outside this scope (by the caller) count too
            hit = scope._by_storage.get(key)
            if hit is not None and not hit[0].expired():
                return hit[1]
            scope = scope.parent
        return None


_SCOPE: contextvars.ContextVar[NameScope | None] = contextvars.ContextVar("hpfunc_name_scope", default=None)


def current_scope() -> NameScope | None:
    return _SCOPE.get()


@contextlib.contextmanager
def name_scope() -> Iterator[NameScope]:
    scope = NameScope(_SCOPE.get())
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensor leaves of an arbitrary (torch pytree) value."""
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]
