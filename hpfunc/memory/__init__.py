"""Measure what a forward pass keeps alive for backward: bytes per policy, per name, per mechanism.

:func:`saved_activations` runs ``fn`` once (forward only) and reports every storage kept for
backward, deduplicated by storage, with the mechanism that keeps it:

* ``saved``: saved by autograd (seen by a ``saved_tensors_hooks`` pack hook), kept on device;
* ``remat_input``: an input of a ``remat`` region, kept for its recompute;
* ``cached``: an op output cached by selective checkpointing (these bypass saved-tensor hooks;
  remat's cache reports them as it stores them);
* ``offloaded``: moved to host memory by ``offload`` or an ``OFFLOAD`` policy decision.

It works on real tensors and on fake ones (``FakeTensorMode``, at real shapes, no memory used).
Values of arguments listed in ``state_argnums`` (parameters) are model state, not activations, and
are reported apart (``state_bytes``).

Example:
    >>> import torch
    >>> from hpfunc.memory import saved_activations
    >>> def layer(w, x):
    ...     return torch.tanh(x @ w).sum()
    >>> r = saved_activations(layer, torch.ones(4, 4), torch.ones(2, 4), state_argnums=(0,))
    >>> r.device_bytes   # x (kept for dw) and tanh's output (kept for its own backward): 2 * 2*4*4 bytes
    64
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from hpfunc.memory._record import Entry, Recorder, name_scope, recording, storage_key

__all__ = ["saved_activations", "SavedReport", "Entry"]


@dataclasses.dataclass
class SavedReport:
    """Storages kept for backward after one forward pass (see :func:`saved_activations`)."""

    entries: list[Entry]
    state_entries: list[Entry]
    policy: str

    @property
    def device_bytes(self) -> int:
        """Activation bytes resident in device memory (saved, cached or kept as remat inputs)."""
        return sum(e.nbytes for e in self.entries if e.where == "device")

    @property
    def host_bytes(self) -> int:
        """Activation bytes moved to host memory by offload."""
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


def _producer_mode(rec: Recorder) -> Any:
    from hpfunc.transforms.offload import _ProducerMode

    return _ProducerMode(rec.producers, {})


def saved_activations(fn: Callable, *args: Any, policy: Any = None, state_argnums: Sequence[int] = (),
                      **kwargs: Any) -> SavedReport:
    """Run ``fn(*args, **kwargs)`` forward and report the bytes kept for its backward.

    Args:
        fn: the function to measure (it may contain ``remat``, ``offload`` and ``checkpoint_name``).
        policy: if given, measure ``remat(fn, policy=policy)`` instead of ``fn``.
        state_argnums: positions of arguments that are model state (parameters): their bytes are
            reported as ``state_bytes`` and left out of the activation totals.

    Floating-point tensor arguments are made to require grad (as in training, where the layer
    input carries a gradient), so autograd saves what it would save in a training step.
    """
    from hpfunc import tree as _tree
    from hpfunc.transforms.remat import as_policy, remat

    measured = remat(fn, policy=policy) if policy is not None else fn
    label = str(as_policy(policy)) if policy is not None else "no remat"

    def prep(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x

    args = tuple(_tree.tree_map(prep, a) for a in args)
    state_keys = {storage_key(x) for i in state_argnums for x in _tree.leaves(args[i]) if isinstance(x, torch.Tensor)}
    rec = Recorder()

    def pack(t: torch.Tensor) -> torch.Tensor:
        from hpfunc.memory._record import current_scope

        scope = current_scope()
        rec.record(t, kind="saved", where="device", name=scope.name_of(t) if scope else None)
        return t.detach()  # not t itself: a saved output would then keep its own graph alive (a cycle)

    with torch.enable_grad(), recording(rec), name_scope():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _producer_mode(rec):
            out = measured(*args, **kwargs)
        alive = rec.alive()
    del out
    entries = [e for k, e in alive if k not in state_keys]
    state = [e for k, e in alive if k in state_keys]
    return SavedReport(entries, state, label)
