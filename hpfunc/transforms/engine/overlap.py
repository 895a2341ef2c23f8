"""Gradient all-reduces that run while the backward still computes (DDP's buckets).

A parameter whose stored block is replicated on some mesh axes (DDP, HSDP's replicate axis, a
parameter replicated over TP) needs its gradient summed over them. Instead of one packed ``psum``
after the backward, the gradients are packed in *buckets* decided at lowering (:func:`buckets_of`:
one per layer, ``layers.3``, and one for the top-level parameters, per axes and dtype), and each
bucket's all-reduce is started (``async_op``) by a gradient hook as soon as the last of its members'
gradients is final, so the collective runs on the process group's thread while autograd computes
the layers below it; :meth:`Overlap.finish` waits for them after the backward (the optimizer reads
the reduced gradients only then; the comm counter notes each wait, ``stats.waits``). The bytes are
those of the one packed ``psum`` (each gradient is sent once); what changes is when, and the number
of calls (one per bucket). The comm counter records each call with the phase it was issued in
(``backward``).

Buckets hold whole layers up to a cap (:data:`BUCKET_CAP_BYTES`, 25 MiB, DDP's ``bucket_cap_mb``;
``Plan.with_bucket_cap``): consecutive layers in the backward's order share one bucket while their
gradients fit, so that a model of small layers pays a few collectives, not one per layer (on gloo
each is a round trip costing host time on every rank); ``0``: one bucket per layer.

Buckets start in their order only (a bucket finished early waits for the ones before it), and one
whose member received no gradient (a parameter the loss does not use) is completed with zeros after
the backward and reduced then, with every bucket after it: every rank issues the same collectives in
the same order.

    >>> from hpfunc.layout import LeafLayout, LeafSpec
    >>> lays = [LeafLayout(p, (4,), LeafSpec.of(()), replicated=("dp",)) for p in ("embed", "layers.0.w", "layers.1.w")]
    >>> buckets_of(lays, [torch.float32] * 3)
    [(('dp',), [2]), (('dp',), [1]), (('dp',), [0])]
    >>> import hpfunc
    >>> buckets_of(lays, [torch.float32] * 3, cap_bytes=32, mesh=hpfunc.Mesh({"dp": 1}))  # 16 B each: 2 fit
    [(('dp',), [2, 1]), (('dp',), [0])]
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from hpfunc import comm as _comm
from hpfunc import lax
from hpfunc.layout import LeafLayout
from hpfunc.transforms.engine.gather import layer_of
from hpfunc.transforms.engine.reduce import reduction_bucket

__all__ = ["BUCKET_CAP_BYTES", "buckets_of", "Overlap"]

BUCKET_CAP_BYTES = 25 * 2**20  # the default cap of one all-reduce bucket (DDP's bucket_cap_mb=25)


def buckets_of(leaves: list[LeafLayout], dtypes: list[torch.dtype], reduce_dtype: torch.dtype | None = None, *,
               cap_bytes: int = 0, mesh: Any = None) -> list[tuple[tuple[str, ...], list[int]]]:
    """The overlapped all-reduce buckets of a step's parameters: ``(axes, leaf indices)``, one per layer
    (the list element a path runs through, ``layers.3``) and one for the top-level parameters, per
    replicated axes and dtype; leaves whose gradient takes no all-reduce alone (ZeRO's reduce-scatter,
    FSDP) are in none. Listed in the order a backward finishes them: the last layer first, the
    top-level parameters (the embedding is used first) last. ``cap_bytes > 0`` (with the ``mesh``, which
    sizes each gradient block): consecutive buckets of the same axes and dtype are merged while the
    merged gradients' bytes stay within it (a layer over the cap stays a bucket of its own)."""
    found: dict[tuple, list[int]] = {}
    for i, (lay, dt) in enumerate(zip(leaves, dtypes)):
        b = reduction_bucket(lay, reduce_dtype or dt)
        if b is None or b[0] != "ar":
            continue
        found.setdefault((layer_of(lay.path), b[2], b[3]), []).append(i)

    def order(key: tuple) -> tuple:
        layer = key[0]
        if not layer:
            return (1, 0, "")
        parts = layer.split(".")
        return (0, -int(parts[-1]), ".".join(parts[:-1]))

    keys = sorted(found, key=order)
    if cap_bytes <= 0:
        return [(key[1], found[key]) for key in keys]

    def nbytes(key: tuple) -> int:
        size = torch.empty((), dtype=key[2]).element_size()
        return sum(math.prod(leaves[i].shape) // mesh.axis_size(leaves[i].spec.storage.axes) * size
                   for i in found[key])

    merged: list[list] = []  # [axes, dtype, members, bytes]
    for key in keys:
        b = nbytes(key)
        last = merged[-1] if merged else None
        if last is not None and last[0] == key[1] and last[1] == key[2] and last[3] + b <= cap_bytes:
            last[2] = last[2] + found[key]
            last[3] += b
        else:
            merged.append([key[1], key[2], list(found[key]), b])
    return [(axes, members) for axes, _, members, _ in merged]


class Overlap:
    """The overlapped reduction of one backward (see the module docstring).

    ``ws``: the leaves differentiated (their gradient hooks start the buckets); ``wanted``: the indices
    whose gradients this backward computes; ``buckets``: :func:`buckets_of` of the step."""

    def __init__(self, mesh: Any, ws: Any, wanted: list[int], buckets: list[tuple[tuple[str, ...], list[int]]],
                 reduce_dtype: torch.dtype | None = None, scalars: Any = None):
        self.mesh, self.reduce_dtype = mesh, reduce_dtype
        wanted_set = set(wanted)
        # only buckets every member of which this backward differentiates (a subtree's value_and_grad
        # reduces the others after it, as before)
        self.buckets = [(axes, members) for axes, members in buckets
                        if all(i in wanted_set and ws[i].requires_grad for i in members)]
        self.covered = {i for _, members in self.buckets for i in members}
        self.got: dict[int, torch.Tensor] = {}
        self.left = [len(members) for _, members in self.buckets]
        self.started: list[tuple[int, torch.Tensor, Any, Any] | None] = [None] * len(self.buckets)
        self.next = 0  # the next bucket to start
        self.last = len(self.buckets) - 1  # started as the backward returns; the step's scalars ride it
        self.collectors = _comm.active()
        # the step's scalars (StepScalars) ride the last bucket's all-reduce when they can (riders.py)
        self.scalars, self.riders = scalars, None
        if scalars is not None and self.buckets:
            axes, members = self.buckets[-1]
            carrier = reduce_dtype if reduce_dtype is not None and ws[members[0]].is_floating_point() \
                else ws[members[0]].dtype
            self.riders = scalars.riders_for(carrier, lax._axes_of(mesh, axes).names)
        # the last bucket completes when the backward ends (it holds what the backward reaches last: the
        # top-level parameters, the embedding's gradient computed last): it is started after the backward
        # returns, from the gradients it returned, with no gradient hooks (a model of one bucket has none)
        self.handles = []
        for b, (_, members) in enumerate(self.buckets[:-1]):
            for i in members:
                self.handles.append(ws[i].register_hook(self._hook(i, b)))

    def _hook(self, i: int, b: int):
        def hook(g: torch.Tensor) -> None:
            if i in self.got:  # (a leaf's hook fires once per backward; a second backward is not ours)
                return
            self.got[i] = g.detach()
            self.left[b] -= 1
            # buckets start in their order only, so that every rank issues the same sequence of collectives
            # even where its backward finished one bucket before another rank did
            while self.next < self.last and self.left[self.next] == 0:
                self._start(self.next)
                self.next += 1
        return hook

    def _start(self, b: int, phase: str | None = None) -> None:
        axes, members = self.buckets[b]
        flat = torch.cat([self.got[i].reshape(-1) for i in members])
        if self.reduce_dtype is not None and flat.is_floating_point():
            flat = flat.to(self.reduce_dtype)
        riding = 0
        if b == self.last and self.riders is not None:
            if flat.dtype == self.riders.carrier:
                flat = torch.cat([flat, self.riders.pack()])
                riding = self.riders.numel * flat.element_size()
            else:  # (a bucket of another dtype than planned: the scalars are reduced apart)
                self.riders = None
        ax = lax._axes_of(self.mesh, axes)
        rec = _comm.record(self.collectors, op="all_reduce", name="psum", axes=ax.names, n=ax.n,
                           payload_bytes=flat.numel() * flat.element_size(),
                           phase=phase or ("backward" if torch._C._current_graph_task_id() != -1 else "forward"),
                           rider_bytes=riding)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ax.group, async_op=True)
        self.started[b] = (b, flat, work, rec)

    def finish(self, grads: dict[int, torch.Tensor | None], like: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The reduced gradients of the covered leaves (waiting for their collectives); ``grads`` holds
        what the backward returned (``None`` for a leaf it did not reach: zeros), ``like[i]`` a tensor
        of leaf ``i``'s shape and dtype."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for b in range(self.next, len(self.buckets)):  # (after one whose member the loss does not use: zeros)
            for i in self.buckets[b][1]:
                if i not in self.got:
                    g = grads.get(i)
                    self.got[i] = torch.zeros_like(like[i]) if g is None else g.detach()
            # (the gradients' reduction of the backward just ended: its phase, as a hook's would be)
            self._start(b, phase="backward" if b == self.last else None)
        self.next = len(self.buckets)
        out: dict[int, torch.Tensor] = {}
        for b, flat, work, rec in self.started:
            try:
                work.wait()
            except RuntimeError as e:
                from hpfunc import faults as _faults

                axes = self.buckets[b][0]
                _faults.raise_collective_error(e, "psum", axes, lax._axes_of(self.mesh, axes).n)
                raise
            _comm.waited(self.collectors, rec)
            members = self.buckets[b][1]
            sizes = [self.got[i].numel() for i in members]
            if b == self.last and self.riders is not None:
                self.scalars.rode(self.riders, flat[sum(sizes):])
            for i, part in zip(members, flat[:sum(sizes)].split(sizes)):
                out[i] = part.view(self.got[i].shape).to(like[i].dtype)
        return out
