"""The local stages' parameters and gradients over one step: gathered for use, accumulated, reduced.

Each local stage's parameter leaves enter the step as fresh differentiable leaves (the caller's tensors
are never touched). Without an FSDP axis they are made once, as stored. With one, the gathers and
reductions are the engine's, grouped as the lowered step groups them (every parameter under one list
element, ``layers.3``, with one dtype, in one packed collective: :func:`~hpfunc.transforms.engine.gather.group_key`):

* ``UNSHARD`` *issues* each group's packed all-gather without waiting
  (:func:`~hpfunc.transforms.engine.prefetch.start`, the forward prefetch's
  :class:`~hpfunc.transforms.engine.prefetch.Flight`); the stage's first forward after it lands them. A
  schedule whose ``UNSHARD`` comes ahead of that forward (``insert_fsdp(..., prefetch=k)``) overlaps the
  gather with the compute between.
* ``RESHARD`` drops the gathered leaves (a graph still pending keeps what it saved).
* ``REDUCE_GRAD`` *issues* each group's packed reduce-scatter of the stage's accumulated gradients
  (:func:`~hpfunc.transforms.engine.reduce_async.start_psum_scatter`) and goes on; the step waits for
  them at its end, so they run while the rank computes its other stages.

With a data axis instead (parameters replicated), a stage's gradients are all-reduced in the lowered
step's buckets (:func:`~hpfunc.transforms.engine.overlap.buckets_of`: one per layer) as soon as its last
weight-gradient action on this rank has run (:func:`~hpfunc.transforms.engine.reduce_async.start_psum`),
waited for at the end of the step. Every reduction is a sum; the mean (over the FSDP or data axis) is
taken after the wait.

Weight gradients accumulate over microbatches: a split backward's ``W`` hands its gradients to
:meth:`StageParams.accumulate`, a full ``BW`` leaves them in the leaves' ``.grad`` inside autograd
(:meth:`StageParams.collect` adds the two).

    >>> StageLayout.groups_of(["layers.0.w", "layers.0.b", "embed"], [torch.float32] * 3, "fsdp")
    [[0, 1], [2]]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpfunc import tree as _tree
from hpfunc.layout import LeafLayout, LeafSpec
from hpfunc.mesh import Mesh
from hpfunc.transforms.engine import prefetch
from hpfunc.transforms.engine.gather import group_key
from hpfunc.transforms.engine.outside_checkpoint import outside
from hpfunc.transforms.engine.overlap import buckets_of
from hpfunc.transforms.engine.packing import _unpack_gathered
from hpfunc.transforms.engine.reduce_async import InFlight, start_psum, start_psum_scatter
from hpfunc.transforms.engine.view import lazy
from hpfunc.transforms.pipeline.errors import PipelineError

__all__ = ["shard_stage_params", "unshard_stage_grads", "StageLayout", "StageParams", "is_diff"]


def is_diff(t: torch.Tensor) -> bool:
    """Whether ``t`` can carry a gradient (floating or complex)."""
    return t.is_floating_point() or t.is_complex()


def _chunk_dim0(x: torch.Tensor, n: int, i: int, path: str) -> torch.Tensor:
    if x.dim() == 0 or x.shape[0] % n:
        raise PipelineError(f"FSDP: parameter {path!r} of shape {tuple(x.shape)} cannot be split into {n} equal "
                            f"shards along dim 0; make dim 0 a multiple of the FSDP axis size {n}")
    return x.chunk(n, dim=0)[i].clone()


def shard_stage_params(params: Any, mesh: Mesh, axis: str) -> Any:
    """This rank's dim-0 shard of every leaf (the storage layout ``UNSHARD`` expects).

    Example:
        >>> shards = shard_stage_params({0: {"w": w0}}, mesh, "fsdp")   # doctest: +SKIP
    """
    n, i = mesh.axis_size(axis), mesh.axis_index(axis)
    return _tree.map_with_path(lambda p, x: _chunk_dim0(x, n, i, p), params)


def unshard_stage_grads(grads: Any, mesh: Mesh, axis: str) -> Any:
    """All-gather dim-0 shards (the inverse of :func:`shard_stage_params`), e.g. to compare with a reference."""
    group, n = mesh.group(axis), mesh.axis_size(axis)

    def gather(x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    return _tree.tree_map(gather, grads)


class StageLayout:
    """What a stage's parameter structure decides for its collectives, once per structure: its gather
    groups (FSDP) and reduction buckets (data parallel), as leaf positions; non-tensor leaves are in none,
    and only differentiable ones are reduced."""

    __slots__ = ("groups", "reduce_groups", "buckets")

    def __init__(self, paths: list[str], leaves: list, fsdp_axis: str | None, data_axis: str | None):
        pos = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        dtypes = [leaves[k].dtype for k in pos]
        self.groups = [[pos[j] for j in g] for g in self.groups_of([paths[k] for k in pos], dtypes, fsdp_axis)] \
            if fsdp_axis is not None else []
        self.reduce_groups = [g for g in self.groups if is_diff(leaves[g[0]])]
        diff = [k for k in pos if is_diff(leaves[k])]
        self.buckets: list[list[int]] = []
        if data_axis is not None and fsdp_axis is None and diff:
            lays = [LeafLayout(paths[k], tuple(leaves[k].shape), LeafSpec.of(()), replicated=(data_axis,)) for k in diff]
            self.buckets = [[diff[j] for j in members] for _, members in buckets_of(lays, [leaves[k].dtype for k in diff])]

    @staticmethod
    def groups_of(paths: list[str], dtypes: list[torch.dtype], axis: str) -> list[list[int]]:
        """The engine's gather groups of leaves sharded on dim 0 over ``axis`` (indices, in first-member order)."""
        found: dict[tuple, list[int]] = {}
        for k, (path, dt) in enumerate(zip(paths, dtypes)):
            found.setdefault(group_key(path, ((0, (axis,)),), dt), []).append(k)
        return list(found.values())


class StageParams:
    """The parameters and gradients of this rank's stages during one step (see the module docstring).

    ``step``: the :class:`~hpfunc.transforms.pipeline.step.PipelineStep` (its mesh, axes, local stages,
    and its memo of :class:`StageLayout` per structure); ``params``: stage -> parameter tree (this rank's
    shards under FSDP)."""

    def __init__(self, step: Any, params: Any, deferred: Any = None):
        # stage -> its leaves read on first use (see :meth:`_make_deferred`); none: every leaf as given
        self.deferred = {} if deferred is None else deferred
        self.mesh, self.fsdp, self.fsdp_axis, self.data_axis = step.mesh, step.fsdp, step.fsdp_axis, step.data_axis
        self.pp_index, self.local_stages = step.pp_index, step.local_stages
        self.specs: dict[int, Any] = {}
        self.stored: dict[int, list] = {}
        self.layouts: dict[int, StageLayout] = {}
        for s in self.local_stages:
            leaves, spec = _tree.flatten(params[s])
            self.specs[s], self.stored[s] = spec, leaves
            if self.fsdp or self.data_axis is not None:
                key = (s, spec, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in leaves))
                lay = step.stage_layouts.get(key)
                if lay is None:
                    paths = [p for p, _ in _tree.leaves_with_paths(params[s])]
                    lay = step.stage_layouts[key] = StageLayout(paths, leaves, self.fsdp_axis if self.fsdp else None,
                                                                self.data_axis)
                self.layouts[s] = lay
        self.live: dict[int, list] = {}  # the differentiable leaves the stage's forwards use now
        self.live_trees: dict[int, Any] = {}  # the parameter tree of live[s], made once per UNSHARD
        self.diff_pos: dict[int, list[int]] = {}  # per stage: the positions of its differentiable leaves
        # Every set of differentiable leaves a stage's forwards used (one per UNSHARD under FSDP, else one):
        # a full backward (BW) accumulates into their ``.grad`` inside autograd, as torch's own stages do.
        self.generations: dict[int, list[list]] = {s: [] for s in self.local_stages}
        # The weight gradients of split backwards (W) over microbatches: the first is kept as autograd
        # returned it (it may alias another tensor, e.g. an incoming gradient), the second sum is a fresh
        # tensor, and later ones are added into it in place (the values of out-of-place sums, fewer
        # allocations). A BW's go to the leaves' ``.grad`` instead (autograd's AccumulateGrad, which steals
        # or copies by the same rule); ``collect`` adds the two.
        self.grads: dict[int, list[torch.Tensor | None]] = {s: [None] * len(self.stored[s]) for s in self.local_stages}
        self.owned: dict[int, list[bool]] = {s: [False] * len(self.stored[s]) for s in self.local_stages}
        self.gathering: dict[int, list[tuple[list[int], prefetch.Flight]]] = {}  # UNSHARD issued, not landed
        # reductions issued and not yet waited for, in the order issued: (stage, positions, in flight)
        self.reducing: list[tuple[int, list[int], InFlight]] = []
        self.reduced: set[int] = set()  # the stages whose REDUCE_GRAD ran
        self.final: set[int] = set()  # the stages whose gradients were taken for their reductions
        if not self.fsdp:
            for s in self.local_stages:
                if s in self.deferred:
                    self._make_deferred(s)
                else:
                    self._make_live(s, self.stored[s])

    def _make_live(self, s: int, leaves: list) -> None:
        live = [x.detach().requires_grad_(is_diff(x)) if isinstance(x, torch.Tensor) else x for x in leaves]
        self.live[s] = live
        self.diff_pos[s] = [k for k, t in enumerate(live) if isinstance(t, torch.Tensor) and t.requires_grad]
        self.generations[s].append(live)
        self.live_trees[s] = _tree.unflatten(self.specs[s], live)

    def _make_deferred(self, s: int) -> None:
        """Stage ``s``'s leaves made on first read: ``deferred[s]`` says which given leaf a tensor is
        (``position(x)``: its index among the stage's leaves, or ``None``) and gives its value as used
        (``value(k)``, e.g. landing an all-gather issued ahead); the stage's forwards read a lazy view of the
        given tree whose leaves are fresh differentiable leaves of those values, each made once. So a
        stage's first forward reads its layers one by one, each as it needs it, and the front door's gathers
        run while the layers before compute (:class:`~hpfunc.transforms.engine.pipelined.StagePipeline`).
        After each forward of the stage every leaf is made (:meth:`settle`): a backward finds them all."""
        stored = self.stored[s]
        self.live[s] = [None if isinstance(x, torch.Tensor) else x for x in stored]
        self.diff_pos[s] = [k for k, x in enumerate(stored) if isinstance(x, torch.Tensor) and is_diff(x)]
        self.generations[s].append(self.live[s])
        self.live_trees[s] = lazy(_tree.unflatten(self.specs[s], stored), lambda x, s=s: self._read(s, x))

    def _read(self, s: int, x: torch.Tensor) -> torch.Tensor:
        k = self.deferred[s].position(x)
        if k is None:
            return x
        return self._leaf(s, k)

    def _leaf(self, s: int, k: int) -> torch.Tensor:
        live = self.live[s]
        leaf = live[k]
        if leaf is None:
            # outside a selective remat's numbered ops: its recompute reads the leaf made here
            with outside():
                v = self.deferred[s].value(k)
            leaf = live[k] = v.detach().requires_grad_(is_diff(v))
        return leaf

    def settle(self, s: int) -> None:
        """Make every leaf of a deferred stage ``s`` not read yet (those its forward did not use)."""
        if s in self.deferred:
            for k, x in enumerate(self.live[s]):
                if x is None:
                    self._leaf(s, k)

    # -- the FSDP actions ------------------------------------------------------------------------------
    def unshard(self, s: int) -> None:
        """``UNSHARD``: issue the packed all-gathers of stage ``s``'s parameter groups over the FSDP axis."""
        if s in self.live or s in self.gathering:
            return  # gathered already (a second UNSHARD without a RESHARD between)
        stored = self.stored[s]
        self.gathering[s] = [(g, prefetch.start(self.mesh, [stored[k] for k in g], (self.fsdp_axis,)))
                             for g in self.layouts[s].groups]

    def ready(self, s: int) -> bool:
        """Whether stage ``s``'s parameters can be used now, landing its gathers in flight first."""
        flights = self.gathering.pop(s, None)
        if flights is not None:
            leaves = list(self.stored[s])
            for members, flight in flights:
                blocks = [leaves[k] for k in members]
                full = flight.wait()
                for k, x in zip(members, _unpack_gathered(full, blocks, [0] * len(blocks), full.shape[0])):
                    leaves[k] = x
            self._make_live(s, leaves)
        return s in self.live

    def reshard(self, s: int) -> None:
        """``RESHARD``: drop stage ``s``'s gathered parameters (waiting for gathers never used)."""
        for _, flight in self.gathering.pop(s, ()):
            flight.wait()
        self.live.pop(s, None)
        self.live_trees.pop(s, None)

    def reduce_grad(self, s: int) -> None:
        """``REDUCE_GRAD``: issue the packed reduce-scatters of stage ``s``'s accumulated gradients over the
        FSDP axis (the sums; this rank's shard of their mean comes at :meth:`result`)."""
        self._start(s, self.layouts[s].reduce_groups, scatter=True)
        self.reduced.add(s)

    def gradients_final(self, s: int) -> None:
        """Stage ``s``'s last weight-gradient action on this rank has run: with a data axis, issue the
        all-reduces of its gradients (the lowered step's buckets)."""
        if self.data_axis is not None and not self.fsdp and s not in self.final:
            self._start(s, self.layouts[s].buckets, scatter=False)

    def _start(self, s: int, groups: list[list[int]], *, scatter: bool) -> None:
        n = self.mesh.axis_size(self.fsdp_axis) if scatter else 1
        gs = self.collect(s)
        for k, (x, g) in enumerate(zip(self.stored[s], gs)):
            if g is None and isinstance(x, torch.Tensor) and is_diff(x):  # unused: a zero (full size) in its bucket
                gs[k] = x.new_zeros((x.shape[0] * n,) + tuple(x.shape[1:])) if scatter else torch.zeros_like(x)
        self.grads[s] = gs
        self.final.add(s)
        axis = self.fsdp_axis if scatter else self.data_axis
        for g in groups:
            members = [gs[k] for k in g]
            flight = (start_psum_scatter(self.mesh, members, [0] * len(members), (axis,)) if scatter
                      else start_psum(self.mesh, members, (axis,)))
            self.reducing.append((s, g, flight))

    # -- gradients -------------------------------------------------------------------------------------
    def accumulate(self, s: int, positions: list[int], dw: Any) -> None:
        """Add a split backward's weight gradients ``dw`` (of the leaves at ``positions``) to stage ``s``'s."""
        acc, own = self.grads[s], self.owned[s]
        for k, g in zip(positions, dw):
            if g is None:
                continue
            if acc[k] is None:
                acc[k] = g
            elif own[k]:
                acc[k].add_(g)
            else:
                acc[k], own[k] = acc[k] + g, True

    def collect(self, s: int) -> list[torch.Tensor | None]:
        """Stage ``s``'s gradients so far: the split backwards' sums plus what full backwards left in ``.grad``."""
        out = list(self.grads[s])
        for gen in self.generations[s]:
            for k, t in enumerate(gen):
                g = t.grad if isinstance(t, torch.Tensor) else None
                if g is not None:
                    out[k] = g if out[k] is None else out[k] + g
                    t.grad = None
        return out

    def result(self) -> dict[int, Any]:
        """The gradients of the step, per local stage (after waiting for the reductions in flight): zeros
        where unused; the mean over the FSDP axis (this rank's shard) or the data axis."""
        for flights in self.gathering.values():  # gathered and never used: wait, drop
            for _, flight in flights:
                flight.wait()
        self.gathering.clear()
        for s in self.local_stages:
            if self.fsdp and s not in self.reduced:
                raise PipelineError(f"pp rank {self.pp_index}: stage {s} never got its REDUCE_GRAD")
            if s not in self.final:
                self.gradients_final(s)  # (a stage without a weight-gradient action: reduced now)
        axis = self.fsdp_axis if self.fsdp else self.data_axis
        n = self.mesh.axis_size(axis) if axis is not None else 1
        for s, positions, flight in self.reducing:  # in the order issued
            acc = self.grads[s]
            for k, r in zip(positions, flight.wait()):
                acc[k] = r.div_(n)
        self.reducing.clear()
        out: dict[int, Any] = {}
        for s in self.local_stages:
            self.settle(s)  # (a stage never run: its leaves, for their zero gradients' shapes)
            as_used = self.live[s] if s in self.deferred else self.stored[s]
            gs = [x if not isinstance(x, torch.Tensor) else torch.zeros_like(x) if g is None else g
                  for x, g in zip(as_used, self.grads[s] if s in self.final else self.collect(s))]
            out[s] = _tree.unflatten(self.specs[s], gs)
        return out
