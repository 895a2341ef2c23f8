"""Storages as the unit of memory: their identity, their size, and which op created each one.

Views share a storage (q, k and v split from one projection, a transposed weight), so memory is
counted per storage, never per tensor. :class:`StorageLog` holds *weak* references only: logging a
storage never keeps it alive, which is what lets :mod:`hpfunc.memory` measure liveness.

    >>> import torch
    >>> x = torch.ones(4, 4)
    >>> storage_key(x) == storage_key(x.t()), storage_nbytes(x[0])
    (True, 64)
    >>> log = StorageLog()
    >>> with ProducerMode(log):
    ...     y = x @ x
    ...     z = y.t()                     # a view: same storage, still made by mm
    >>> log.op_of(z), len(log.alive())
    ('aten.mm.default', 1)
    >>> del y, z
    >>> len(log.alive())
    0
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from hpfunc import tree as _tree

__all__ = ["local", "storage_key", "storage_nbytes", "tensors_in", "live_nbytes", "live_total", "StorageLog",
           "ProducerMode"]

aten = torch.ops.aten


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory: a DTensor's local shard, else ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage, equal for all views of it (also for fake and meta tensors).

    The id is the storage's address: once the storage is freed a new one may get the same id, so
    whoever keeps ids keeps a :class:`StorageWeakRef` beside them and checks ``expired()``.
    """
    return StorageWeakRef(local(t).untyped_storage()).cdata


def storage_nbytes(t: torch.Tensor) -> int:
    return int(local(t).untyped_storage().nbytes())


def live_nbytes(ref: StorageWeakRef) -> int | None:
    """The size now of the storage ``ref`` points to, or ``None`` if it has been freed.

    Read from the storage itself (not remembered from when it was logged): a storage resized in
    place (``resize_(0)`` to free a gathered parameter) counts what it holds now.
    """
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return None if storage is None else int(storage.nbytes())


def live_total(refs: dict[int, StorageWeakRef]) -> int:
    """The bytes now held by the storages of ``refs`` (key -> weak reference); the freed ones are
    removed from ``refs`` (a later storage may reuse a freed one's address, hence its key).

    >>> x = torch.ones(4)
    >>> refs = {storage_key(x): StorageWeakRef(x.untyped_storage())}
    >>> live_total(refs)
    16
    >>> del x
    >>> live_total(refs), refs
    (0, {})
    """
    total = 0
    for key, ref in list(refs.items()):
        n = live_nbytes(ref)
        if n is None:
            del refs[key]
        else:
            total += n
    return total


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensor leaves of an arbitrary value (aten arguments, outputs, pytrees)."""
    return [x for x in _tree.leaves(value) if isinstance(x, torch.Tensor)]


class StorageLog:
    """Weakly-held storages by key, with the op that created each one (the first op seen making it)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[StorageWeakRef, str | None, Any, tuple, str, str]] = {}

    def add(self, t: torch.Tensor, func: Any = None) -> bool:
        """Log ``t``'s storage (made by ``func``, if known); ``False`` if it is already logged and alive."""
        owner = local(t)
        key = storage_key(owner)
        hit = self._entries.get(key)
        if hit is not None and not hit[0].expired():
            return False  # a view of, or an in-place op on, a storage seen already
        self._entries[key] = (StorageWeakRef(owner.untyped_storage()), None if func is None else str(func), func,
                              tuple(owner.shape), str(owner.dtype).replace("torch.", ""), owner.device.type)
        return True

    def _hit(self, key: int) -> tuple | None:
        hit = self._entries.get(key)
        return None if hit is None or hit[0].expired() else hit

    def __contains__(self, t: torch.Tensor) -> bool:
        return self._hit(storage_key(t)) is not None

    def op_of(self, t: torch.Tensor) -> str | None:
        """The name of the op that created ``t``'s storage (``"aten.mm.default"``), if logged."""
        hit = self._hit(storage_key(t))
        return None if hit is None else hit[1]

    def func_of(self, t: torch.Tensor) -> Any:
        """The op (``OpOverload``) that created ``t``'s storage, if logged."""
        hit = self._hit(storage_key(t))
        return None if hit is None else hit[2]

    def alive(self) -> list[tuple[int, int, str | None, tuple, str, str]]:
        """``(key, nbytes, op, shape, dtype, device type)`` of every logged storage still alive (0 bytes left out)."""
        out = []
        for key, (ref, op, _, shape, dtype, device) in self._entries.items():
            n = live_nbytes(ref)
            if n:
                out.append((key, n, op, shape, dtype, device))
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries)


# Ops whose output is a tensor that exists before the op (its storage among the inputs) but was
# created outside the dispatcher: ``torch.tensor(data)`` makes the tensor in C++ and only its
# ``lift_fresh`` is dispatched. The output is new to the program, so it is logged there.
_FRESH = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})


class ProducerMode(TorchDispatchMode):
    """Logs every storage an op creates, with the op, into a :class:`StorageLog` (weakly).

    An output whose storage is among the op's inputs (a view, ``_unsafe_view``, an in-place op) is
    not a new storage: it keeps the producer it had. Works under ``FakeTensorMode`` (fake storages
    have identities and sizes like real ones).
    """

    def __init__(self, log: StorageLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = tensors_in(out)
        if outs:
            inputs = set() if func in _FRESH else {storage_key(t) for t in tensors_in((args, kwargs))}
            for t in outs:
                if storage_key(t) not in inputs:
                    self.log.add(t, func)
        return out
