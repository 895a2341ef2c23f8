"""The memory recorder: which storages made during a forward pass are still alive after it.

A :class:`Recorder` is a :class:`hpfunc.saved_tensors.Layer` (pushed outermost by
:func:`hpfunc.memory.saved_activations`) plus a weak log of every storage the forward creates
(:class:`~hpfunc.memory._storage.ProducerMode`). The bytes it reports are *storage liveness*: after
the forward, a logged storage that is still alive is counted, whoever keeps it (a saved tensor, a
selective-checkpoint cache entry, a remat region's inputs, an autograd Function's ``ctx``, a leak).
What the transforms tell it (:meth:`Recorder.note`, :meth:`Recorder.host_copy`) only *labels* an alive
storage -- its kind, name and op -- and says which alive storages are host copies; it never makes a
dead storage count, nor a live one vanish.

Kinds: ``saved`` (seen by this layer's pack: autograd saved it and the layers inside handed it on),
``remat_input`` (an input a remat region keeps for its recompute), ``cached`` (a selective-checkpoint
cache entry; these bypass saved-tensor hooks), ``offloaded`` (a host buffer of ``offload`` or of an
``OFFLOAD`` decision) and ``other`` (alive, but no mechanism reported it).

What the log does not see, checked on torch 2.13 by listing every Python-reachable tensor alive
after a forward against the log: only storages created outside the dispatcher. The one kept for
backward is ``torch.utils.checkpoint``'s RNG snapshot (``torch.get_rng_state()``: 5056 bytes per remat
region with ``preserve_rng_state``, a real CPU tensor even under ``FakeTensorMode``; with CUDA also each
device's generator state, as CPU tensors), which is bookkeeping of the recompute, not an activation,
and is not counted. The checkpoint's other internals are empty tensors (``_NoopSaveInputs``' dummy:
0 bytes, left out). Constants made by ``torch.tensor(...)`` are seen (``lift_fresh``), and SDPA's
logsumexp is an op output saved by its backward, counted as ``saved``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hpfunc import saved_tensors
from hpfunc.memory._names import NameScope, current_scope
from hpfunc.memory._storage import ProducerMode, StorageLog, local, storage_key

__all__ = ["Entry", "HostPart", "Recorder", "current_recorder"]


@dataclasses.dataclass
class Entry:
    """One storage (or, for a host buffer shared by several, one part of it) alive for backward."""

    nbytes: int
    kind: str  # "saved", "remat_input", "cached", "offloaded" or "other" (see the module docstring)
    where: str  # "device" or "host"
    name: str | None = None
    op: str | None = None
    shape: tuple[int, ...] = ()
    dtype: str = ""


@dataclasses.dataclass(frozen=True)
class HostPart:
    """The slot of one device storage inside a host buffer: its bytes there (alignment included)."""

    nbytes: int
    name: str | None
    op: str | None
    shape: tuple[int, ...]
    dtype: str


class Recorder(saved_tensors.Layer):
    """Logs the storages of one forward pass weakly, labels them, and measures which are alive."""

    name = "hpfunc.memory"

    def __init__(self) -> None:
        self.log = StorageLog()
        self._notes: dict[int, tuple[StorageWeakRef, str, str | None, str | None]] = {}
        self._host: dict[int, tuple[StorageWeakRef, tuple[HostPart, ...]]] = {}

    # -- what the forward creates ------------------------------------------------------------

    def producing(self) -> ProducerMode:
        """The dispatch mode that logs every storage the ops inside it create."""
        return ProducerMode(self.log)

    def track(self, t: torch.Tensor) -> None:
        """Measure ``t``'s storage too, though no op inside the forward created it (a prepared argument)."""
        self.log.add(t)

    # -- labels from the transforms ----------------------------------------------------------

    def pack(self, t: torch.Tensor, outer: saved_tensors.Outer) -> Any:
        scope = current_scope()
        self.note(t, kind="saved", name=scope.name_of(t) if scope is not None else None)
        return outer.pack(t)

    def note(self, t: torch.Tensor, *, kind: str, name: str | None = None, op: str | None = None) -> None:
        """Label ``t``'s storage; the first kind given stays (a remat input is then also saved by autograd)."""
        key = storage_key(t)
        old = self._notes.get(key)
        if old is not None and not old[0].expired():
            self._notes[key] = (old[0], old[1], old[2] or name, old[3] or op)
            return
        self._notes[key] = (StorageWeakRef(local(t).untyped_storage()), kind, name, op)

    def host_copy(self, host: torch.Tensor, parts: list[HostPart]) -> None:
        """``host`` is a host buffer holding copies of device storages, one :class:`HostPart` each, in order."""
        self.log.add(host)
        self._host[storage_key(host)] = (StorageWeakRef(local(host).untyped_storage()), tuple(parts))

    # -- measurement -------------------------------------------------------------------------

    def measure(self, names: NameScope | None = None) -> list[tuple[int, Entry]]:
        """``(storage key, Entry)`` for every logged storage alive now (host buffers: one per part)."""
        out: list[tuple[int, Entry]] = []
        for key, nbytes, op, shape, dtype, _ in self.log.alive():
            host = self._host.get(key)
            if host is not None and not host[0].expired():
                parts = host[1]
                for p in parts:
                    out.append((key, Entry(p.nbytes, "offloaded", "host", p.name, p.op, p.shape, p.dtype)))
                rest = nbytes - sum(p.nbytes for p in parts)
                if rest:  # not expected: a host buffer holds its parts exactly; shown rather than hidden
                    out.append((key, Entry(rest, "offloaded", "host", None, None, (rest,), "uint8")))
                continue
            note = self._notes.get(key)
            if note is not None and note[0].expired():
                note = None
            kind, name, noted_op = note[1:] if note is not None else ("other", None, None)
            if name is None and names is not None:
                name = names.name_of_key(key)
            out.append((key, Entry(nbytes, kind, "device", name, noted_op or op, shape, dtype)))
        return out


def current_recorder() -> Recorder | None:
    """The recorder measuring the forward running now (the outermost on the saved-tensor stack), or ``None``."""
    for lay in saved_tensors.layers():
        if isinstance(lay, Recorder):
            return lay
    return None
