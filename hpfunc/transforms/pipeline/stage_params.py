"""The local stages' parameters and gradients over one step: gathered for use, accumulated, reduced.

Each local stage's parameter leaves enter the step as fresh differentiable leaves (the caller's tensors
are never touched). Without an FSDP axis they are made once, as stored; with one, ``UNSHARD`` gathers
them over the FSDP axis (dim-0 shards) and ``RESHARD`` drops the gathered leaves (a graph still pending
keeps what it saved). Weight gradients accumulate over microbatches: a split backward's ``W`` hands its
gradients to :meth:`StageParams.accumulate`, a full ``BW`` leaves them in the leaves' ``.grad`` inside
autograd (:meth:`StageParams.collect` adds the two). ``REDUCE_GRAD`` reduces a stage's accumulated
gradients over the FSDP axis and keeps this rank's shard; with a data axis instead, every gradient is
averaged over it at the end of the step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpfunc import tree as _tree
from hpfunc.mesh import Mesh
from hpfunc.transforms.pipeline.errors import PipelineError

__all__ = ["shard_stage_params", "unshard_stage_grads", "StageParams", "is_diff"]


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


class StageParams:
    """The parameters and gradients of this rank's stages during one step (see the module docstring).

    ``step``: the :class:`~hpfunc.transforms.pipeline.step.PipelineStep` (its mesh, axes, local stages);
    ``params``: stage -> parameter tree (this rank's shards under FSDP)."""

    def __init__(self, step: Any, params: Any):
        self.mesh, self.fsdp, self.fsdp_axis, self.data_axis = step.mesh, step.fsdp, step.fsdp_axis, step.data_axis
        self.pp_index, self.local_stages = step.pp_index, step.local_stages
        self.specs: dict[int, Any] = {}
        self.stored: dict[int, list] = {}
        for s in self.local_stages:
            leaves, spec = _tree.flatten(params[s])
            self.specs[s], self.stored[s] = spec, leaves
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
        self.reduced: set[int] = set()  # the stages whose REDUCE_GRAD ran
        if not self.fsdp:
            for s in self.local_stages:
                self._make_live(s, self.stored[s])

    def _make_live(self, s: int, leaves: list) -> None:
        live = [x.detach().requires_grad_(is_diff(x)) if isinstance(x, torch.Tensor) else x for x in leaves]
        self.live[s] = live
        self.diff_pos[s] = [k for k, t in enumerate(live) if isinstance(t, torch.Tensor) and t.requires_grad]
        self.generations[s].append(live)
        self.live_trees[s] = _tree.unflatten(self.specs[s], live)

    # -- the FSDP actions ------------------------------------------------------------------------------
    def unshard(self, s: int) -> None:
        """``UNSHARD``: gather stage ``s``'s parameters over the FSDP axis."""
        group, n = self.mesh.group(self.fsdp_axis), self.mesh.axis_size(self.fsdp_axis)

        def gather(x: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x.detach().contiguous(), group=group)
            return torch.cat(parts, dim=0)

        self._make_live(s, _tree.leaves(_tree.tree_map(gather, _tree.unflatten(self.specs[s], self.stored[s]))))

    def reshard(self, s: int) -> None:
        """``RESHARD``: drop stage ``s``'s gathered parameters."""
        self.live.pop(s, None)
        self.live_trees.pop(s, None)

    def reduce_grad(self, s: int) -> None:
        """``REDUCE_GRAD``: stage ``s``'s accumulated gradients, reduced over the FSDP axis, this rank's shard."""
        self.grads[s] = [None if g is None else self._reduce_grad_shard(g) for g in self.collect(s)]
        self.reduced.add(s)

    def _reduce_grad_shard(self, g: torch.Tensor) -> torch.Tensor:
        # all_reduce + slice rather than reduce_scatter: gloo lacks a reduce_scatter on CPU.
        n, i = self.mesh.axis_size(self.fsdp_axis), self.mesh.axis_index(self.fsdp_axis)
        g = g.contiguous().clone()
        dist.all_reduce(g, group=self.mesh.group(self.fsdp_axis))
        return g.chunk(n, dim=0)[i].div_(n)

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
        """The gradients of the step, per local stage: zeros where unused; the data-parallel mean for
        stages not reduced by ``REDUCE_GRAD``."""
        out: dict[int, Any] = {}
        for s in self.local_stages:
            ref = self.stored[s]
            if self.fsdp and s not in self.reduced:
                raise PipelineError(f"pp rank {self.pp_index}: stage {s} never got its REDUCE_GRAD")
            gs = []
            for x, g in zip(ref, self.grads[s] if s in self.reduced else self.collect(s)):
                if not isinstance(x, torch.Tensor):
                    gs.append(x)
                    continue
                if g is None:
                    g = torch.zeros_like(x)
                if self.data_axis is not None and s not in self.reduced:
                    g = g.contiguous().clone()
                    dist.all_reduce(g, group=self.mesh.group(self.data_axis))
                    g.div_(self.mesh.axis_size(self.data_axis))
                gs.append(g)
            out[s] = _tree.unflatten(self.specs[s], gs)
        return out
