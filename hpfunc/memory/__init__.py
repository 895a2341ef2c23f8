"""Measure what a forward pass keeps alive for backward: bytes per policy, per name, per mechanism.

:func:`saved_activations` runs ``fn`` once (forward only) on copies of its arguments and measures
**storage liveness**: every storage created during the forward (and the copied arguments) is logged
weakly; after the forward, with the outputs dropped and only their autograd graph kept, the storages
still alive are what the graph keeps for backward. Each is counted once, whatever number of views
refer to it, and labelled with the mechanism that keeps it where one reported it:

* ``saved``: saved by autograd, kept on device (seen by the recorder's saved-tensor layer);
* ``remat_input``: an input of a ``remat`` region, kept for its recompute;
* ``cached``: an op output cached by selective checkpointing (these bypass saved-tensor hooks;
  remat's cache labels them as it stores them);
* ``offloaded``: a host buffer of ``offload`` or of an ``OFFLOAD`` policy decision (per device
  storage it holds);
* ``other``: alive, but reported by no mechanism (an autograd Function's ``ctx`` attribute, a leak).

The labels never change the count: a storage a transform claims to have moved but that is still
alive counts on device (and its host copy on host).

It works on real tensors and on fake ones (``FakeTensorMode``, at real shapes, no memory used).
Values of arguments listed in ``state_argnums`` (parameters) are model state, not activations, and
are reported apart (``state_bytes``: the state storages the graph keeps).

Example:
    >>> import torch
    >>> from hpfunc.memory import saved_activations
    >>> def layer(w, x):
    ...     return torch.tanh(x @ w).sum()
    >>> r = saved_activations(layer, torch.ones(4, 4), torch.ones(2, 4), state_argnums=(0,))
    >>> r.device_bytes   # x (kept for dw) and tanh's output (kept for its own backward): 2 x (2*4 fp32)
    64
    >>> r.by_kind(), r.state_bytes   # w is kept for dx: state
    ({'saved': 64}, 64)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import torch

from hpfunc import saved_tensors
from hpfunc import tree as _tree
from hpfunc.memory._names import name_scope
from hpfunc.memory._recorder import Entry, Recorder
from hpfunc.memory._storage import local, storage_key, tensors_in

__all__ = ["saved_activations", "SavedReport", "Entry"]


@dataclasses.dataclass
class SavedReport:
    """Storages kept for backward after one forward pass (see :func:`saved_activations`)."""

    entries: list[Entry]
    state_entries: list[Entry]
    policy: str

    @property
    def device_bytes(self) -> int:
        """Activation bytes alive in device memory after the forward (every kind but ``offloaded``)."""
        return sum(e.nbytes for e in self.entries if e.where == "device")

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers of offload alive after the forward."""
        return sum(e.nbytes for e in self.entries if e.where == "host")

    @property
    def state_bytes(self) -> int:
        return sum(e.nbytes for e in self.state_entries)

    def by_name(self, where: str = "device") -> dict[str, int]:
        """Bytes per ``checkpoint_name`` (``"(untagged)"`` for the rest) in ``where`` memory."""
        out: dict[str, int] = {}
        for e in self.entries:
            if e.where == where:
                k = e.name or "(untagged)"
                out[k] = out.get(k, 0) + e.nbytes
        return out

    def by_kind(self) -> dict[str, int]:
        """Bytes per mechanism (``saved``, ``remat_input``, ``cached``, ``offloaded``, ``other``)."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.kind] = out.get(e.kind, 0) + e.nbytes
        return out

    def table(self) -> str:
        """A readable listing, largest first."""
        rows = [f"policy {self.policy}: device {self.device_bytes / 2**20:.2f} MiB, host "
                f"{self.host_bytes / 2**20:.2f} MiB, state (excluded) {self.state_bytes / 2**20:.2f} MiB"]
        for e in sorted(self.entries, key=lambda e: -e.nbytes):
            rows.append(f"  {e.nbytes / 2**20:10.3f} MiB  {e.where:6} {e.kind:11} {e.name or '-':12} "
                        f"{e.dtype}{list(e.shape)}  {e.op or ''}")
        return "\n".join(rows)



def saved_activations(fn: Callable, *args: Any, state_argnums: Sequence[int] = (), label: str = "no remat",
                      **kwargs: Any) -> SavedReport:
    """Run ``fn(*args, **kwargs)`` forward and report the bytes its autograd graph keeps alive.

    Args:
        fn: the function to measure (it may contain ``remat``, ``offload`` and ``checkpoint_name``; to
            measure a whole function under a remat policy pass ``remat(fn, policy=...)``, or call
            :func:`hpfunc.transforms.remat.saved_activations`, which takes ``policy=``).
        state_argnums: positions of arguments that are model state (parameters): their bytes are
            reported as ``state_bytes`` and left out of the activation totals.
        label: what the report calls the measured function.

    Every tensor in ``args`` and ``kwargs`` is copied into a storage of its own (so that what keeps it
    alive afterwards is the graph, not the caller); floating-point copies require grad (as in
    training, where the layer input carries a gradient), so autograd saves what it would save in a
    training step. The copies are leaves: like the caller's data and parameters, ``offload`` keeps
    them where they are. The same tensor passed twice is copied once (different views of one
    storage are copied apart).
    """
    if "policy" in kwargs:  # (this package sits below the transforms: it applies no remat policy itself)
        raise TypeError("hpfunc.memory.saved_activations takes no policy=; measure remat(fn, policy=...) or call "
                        "hpfunc.transforms.remat.saved_activations(fn, *args, policy=...)")
    measured = fn
    rec = Recorder()
    copies: dict[int, torch.Tensor] = {}

    def prep(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        y = copies.get(id(x))
        if y is None:
            y = x.detach().clone()
            if y.is_floating_point() or y.is_complex():
                y.requires_grad_(True)
            copies[id(x)] = y
            rec.track(y)
        return y

    args = tuple(_tree.tree_map(prep, a) for a in args)
    kwargs = {k: _tree.tree_map(prep, v) for k, v in kwargs.items()}
    state_keys = {storage_key(x) for i in state_argnums for x in tensors_in(args[i])}

    with torch.enable_grad(), name_scope() as names, saved_tensors.layer(rec), rec.producing():
        out = measured(*args, **kwargs)
    # Keep the graph, not the outputs: an output's storage counts only if the graph keeps it too (a
    # saved result, tanh's), not because this function holds the output.
    graph = [t.grad_fn for t in tensors_in(out) if t.grad_fn is not None]
    del out, args, kwargs
    _release(copies)
    alive = _settled(rec, names)
    del graph
    entries = [e for k, e in alive if k not in state_keys]
    state = [e for k, e in alive if k in state_keys]
    return SavedReport(entries, state, label)


def _settled(rec: Recorder, names: Any, budget_s: float = 0.1) -> list:
    """``rec.measure(names)``, once the storages no mechanism reported (``other``) have had a moment to go.

    A collective that has completed can still hold its buffers in the process group's worker thread for
    a moment after the waiting caller was woken (gloo drops its work object, and with it the send and
    receive buffers, after marking it done): that is not the graph keeping them, so with a process group
    running, unreported storages are measured again after short pauses (at most ``budget_s`` in all)
    until none is left; what is still alive then is reported."""
    alive = rec.measure(names)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return alive
    waited, pause = 0.0, 0.002
    while waited < budget_s and any(e.kind == "other" for _, e in alive):
        time.sleep(pause)
        waited += pause
        pause = min(2 * pause, budget_s - waited)
        alive = rec.measure(names)
    return alive


def _release(copies: dict[int, torch.Tensor]) -> None:
    """Drop this function's hold on the argument copies (a function: no loop variable outlives it)."""
    # The copies that require grad are leaves, and autograd's AccumulateGrad node of a leaf holds that
    # very tensor: it would keep every such copy alive, used or not (in training the layer input is the
    # previous layer's output, which nothing holds once the graph saved what it needs). Point them at
    # empty storages: an argument's storage then stays alive only through what the graph saved
    # (detached tensors, views, cache entries: other tensors on the same storage). A DTensor's memory
    # is its local block's: that is the tensor repointed.
    for y in copies.values():
        if y.requires_grad:
            owner = local(y)
            owner.data = owner.new_empty(0)
    copies.clear()
