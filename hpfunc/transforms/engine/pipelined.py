"""A loss run as a pipeline inside a parallelized step: the runner a ``pp`` plan layer binds.

When the function a step differentiates calls a pipelined model's loss (Qwen3's
:func:`~hpfunc.models.qwen3.parallel_plan.loss` hands itself to :func:`hpfunc.layout.runner`),
:class:`StagePipeline` runs the whole schedule right there: every forward, input-gradient and
weight-gradient pass of every microbatch of this rank's stages
(:class:`~hpfunc.transforms.pipeline.PipelineStep`, with its weight-only ``W`` and executed swaps),
activations and their gradients sent to the neighbouring pipeline ranks by counted point-to-point
transfers. The loss it returns is the mean over microbatches (the same on every pipeline rank),
attached to this rank's parameters *as used* (gathered over FSDP axes, cast under mixed precision) by
an autograd function whose backward hands out the gradients the schedule computed. So the step's own
``value_and_grad`` goes on as without a pipeline: the gradients flow through the gather's transpose
(reduce-scatter) to the storage blocks and are reduced over the data axes by the engine.

Gradient seeds follow :mod:`hpfunc.lax`'s per-rank semantics: the last stage's loss is seeded with the
engine's seed times the pipeline size (the loss is computed on one pipeline rank, not split among
them), and a parameter shared by several stages (a tied embedding, held by every pipeline rank) is a
replica over the pipeline axis: the engine sums its per-stage gradients there as for any replica.
"""

from __future__ import annotations

from typing import Any

import torch

from hpfunc import lax
from hpfunc import tree as _tree
from hpfunc.layout import PlanError
from hpfunc.layout import blocks_sq_sum
from hpfunc.transforms.engine.view import materialize

__all__ = ["StagePipeline", "known_gradients"]


class _Attach(torch.autograd.Function):
    """``loss`` as a function of ``params`` whose gradient is the precomputed one (scaled by the
    incoming gradient over the seed it was computed with)."""

    @staticmethod
    def forward(ctx, loss, grads, seed, *params):
        ctx.grads, ctx.seed, ctx.params = grads, seed, params
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        # the step's own seed comes back unchanged when the objective is the pipelined loss itself (plus
        # terms that do not scale it): the precomputed gradients are the answer, without a pass over them
        # (read on the CPU only: on an accelerator the comparison would wait for the device)
        if g.device.type == "cpu" and g.numel() == 1 and float(g) == ctx.seed:
            return (None, None, None, *ctx.grads)
        scale = g / ctx.seed
        return (None, None, None, *[None if gr is None else gr * scale.to(gr.dtype) for gr in ctx.grads])


def known_gradients(loss: torch.Tensor, leaves: list[torch.Tensor], seed: float) -> list | None:
    """The gradients of ``loss`` seeded with ``seed`` with respect to ``leaves`` without a backward pass,
    when ``loss`` is the pipeline's loss itself (the output of :class:`_Attach`, not a function of it)
    attached to exactly these leaves (the parameters as stored: no gather or cast between them and the
    stages) with the same seed: then they are the gradients the schedule computed (``None`` for a leaf
    the pipeline did not use, as ``torch.autograd.grad(..., allow_unused=True)``). ``None`` otherwise:
    differentiate as usual."""
    node = loss.grad_fn
    if type(node) is not _Attach._backward_cls or node.seed != seed:
        return None
    if len(node.params) == len(leaves) and all(x is w for x, w in zip(node.params, leaves)):
        return list(node.grads)  # attached to these leaves in this order (the common case)
    by_id: dict[int, Any] = {}
    for x, g in zip(node.params, node.grads):
        if id(x) in by_id:  # one tensor at two leaves of the tree: leave the sum to autograd
            return None
        by_id[id(x)] = g
    wanted = {id(w) for w in leaves}
    if any(i not in wanted for i in by_id):  # attached to tensors made from the leaves (gathered, cast)
        return None
    return [by_id.get(id(w)) for w in leaves]


def build_executor(cfg: Any) -> Any:
    """The :class:`~hpfunc.transforms.pipeline.PipelineStep` of a plan's pipeline on ``cfg.mesh`` (built
    once per step layout: it validates the schedule)."""
    from hpfunc.transforms.pipeline import PipelineStep

    layer, mesh = cfg.plan.pipeline, cfg.mesh
    stages = layer.stages
    p = mesh.axis_size(layer.axis)

    def stage_fn(s: int):
        def fn(params: Any, x: Any, mb: Any) -> Any:
            carry = None if s == 0 else (x if isinstance(x, tuple) else (x,))
            return stages.forward(s, params, carry, mb)

        policy = layer.remat_policy(s)
        if policy is False:
            return fn
        from hpfunc.transforms.remat import remat

        return remat(fn, policy=policy)

    def loss_fn(params: Any, y: Any, mb: Any) -> tuple:
        return stages.loss(params, y if isinstance(y, tuple) else (y,), mb)

    # The loss ends the last stage (for Qwen3 the final norm, the head and the cross-entropy, whose
    # logits are the largest activation of the model): the stage's policy covers it too, as its own
    # region (it keeps the stage output it starts from).
    last_policy = layer.remat_policy(stages.num_stages - 1)
    if last_policy is not False:
        from hpfunc.transforms.remat import remat

        loss_fn = remat(loss_fn, policy=last_policy)

    return PipelineStep([stage_fn(s) for s in range(stages.num_stages)], layer.schedule(p), mesh, axis=layer.axis,
                        loss_fn=loss_fn, data_axis=None, fsdp_axis=None, first_input=None, check=True,
                        with_microbatch=True, loss_scale=cfg.seed_scale * p)


class StagePipeline:
    """The pipeline runner of one differentiation (see the module docstring)."""

    def __init__(self, program: Any, params_layer: Any, step: Any = None):
        cfg = program.engine
        self.params_layer = params_layer  # the step's saved-tensor layer (gather.ParamLayer)
        # told the global sum of squares of the gradients handed out, reduced with the loss (one collective
        # for both), when those gradients are the step's own (see EngineConfig.pipeline_grads_final)
        self.step = step if cfg.pipeline_grads_final else None
        self.layer = cfg.plan.pipeline
        self.axis, self.stages = self.layer.axis, self.layer.stages
        self.seed = cfg.seed_scale
        self.memo = program.stage_uses
        self.executor = program.pipeline_executor()
        self.local_stages = self.executor.local_stages
        self.needs_view = cfg.needs_view
        self.aux_templates = program.aux_templates
        self.used = False

    def run(self, params: Any, batch: Any, *, owner: Any = None) -> tuple[torch.Tensor, dict]:
        stages = self.stages
        if owner is not None and stages.owner is not None and owner is not stages.owner and owner != stages.owner:
            raise PlanError("pp: the loss of one model config ran under a pipeline plan built for another; build "
                            "the plan's stages from the same config (qwen3.parallel_plan.pipeline_stages(cfg, n))")
        if self.used:
            raise PlanError("pp: the pipelined loss ran twice in one differentiation; a step differentiates the "
                            "model's loss once (use plans.pp(..., microbatches=m) instead of hpfunc.microbatch)")
        self.used = True
        # the parameters as used (gathered, cast) are read through a lazy view only when the plan gathers or
        # casts them; otherwise the step's blocks are in the tree as they are
        full = materialize(params) if self.needs_view else params
        leaves, treedef = _tree.flatten(full)
        # per local stage: the positions of the leaves it uses (once per parameter structure)
        uses = self.memo.get(treedef)
        if uses is None:
            paths = [path for path, _ in _tree.leaves_with_paths(full)]
            uses = self.memo[treedef] = {s: [k for k, path in enumerate(paths) if s in stages.stage_of(path)]
                                         for s in self.local_stages}
        # per local stage: the leaves it uses (the others None), so each stage differentiates its own
        trees = {}
        for s in self.local_stages:
            mine: list = [None] * len(leaves)
            for k in uses[s]:
                mine[k] = leaves[k]
            trees[s] = _tree.unflatten(treedef, mine)
        with self.params_layer.keeping_gathered():
            losses, auxes, grads = self.executor.execute(trees, batch)
        wants = []
        for k, x in enumerate(leaves):
            if x.requires_grad:
                wants.append(k)
                # The executor's stages are closed (their backward names no targets): a stage function that
                # reached the step's parameters other than through its arguments put gradients in their .grad
                if x.is_leaf and x.grad is not None:
                    paths = [path for path, _ in _tree.leaves_with_paths(full)]
                    raise PlanError(f"pp: a pipeline stage's backward reached the step's parameter {paths[k]!r} "
                                    f"other than through the parameters the stage was given (their gradient landed "
                                    f"in its .grad); a stage function must read the parameters from its params "
                                    f"argument, not from a tree it closed over")
        # the gradient of every leaf this rank holds, summed over its local stages (a leaf shared by
        # stages on several pipeline ranks is a replica over the pipeline axis: the engine sums it there)
        by_leaf: dict[int, torch.Tensor] = {}
        for s in self.local_stages:
            for k, g in zip(uses[s], _tree.leaves(grads[s])):
                by_leaf[k] = g if k not in by_leaf else by_leaf[k] + g
        grads = [by_leaf.get(k) for k in wants]
        with torch.no_grad():
            # only the last stage's rank has the losses
            value = (torch.stack(losses).mean().float() if losses
                     else torch.zeros((), dtype=torch.float32, device=self.executor.device))
            # this rank's part of the gradients' global norm (each of its blocks held here alone), as
            # layout.blocks_sq_norm sums it, reduced in the loss's collective
            sq = None
            if self.step is not None and grads and all(g is not None for g in grads):
                sq = blocks_sq_sum(grads)
            value, aux, sq = self._to_every_rank(value, auxes, batch, sq)
        if sq is not None:
            self.step.remember_sq_norm(grads, sq)
        if not wants:
            return value, aux
        return _Attach.apply(value, grads, self.seed, *[leaves[k] for k in wants]), aux

    def _to_every_rank(self, value: torch.Tensor, auxes: list[dict], batch: Any,
                       sq: torch.Tensor | None = None) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """The loss and the aux of the microbatches (floats averaged, integers summed) on every pipeline
        rank: one ``psum`` over the pipeline axis of them all packed in fp64. Only the last stage's rank
        holds values (the others add zeros), so the sum is exact: fp32 values and integer counts below
        2**53 pass through fp64 unchanged. ``sq`` (an fp64 scalar, every rank's own) rides along: its
        sum over the pipeline ranks comes back third."""
        # the template (zeros shaped like the aux) follows from the batch's shapes: made once per shapes
        leaves, treedef = _tree.flatten(batch)
        key = (treedef, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in leaves))
        template = self.aux_templates.get(key)
        if template is None:
            template = self.aux_templates[key] = self.stages.aux_template(batch)
        parts = [value]
        for k, z in template.items():
            if auxes:
                vals = [a[k] for a in auxes]
                v = torch.stack(vals if all(type(t) is torch.Tensor for t in vals)
                                else [torch.as_tensor(t) for t in vals]).detach()
                v = v.float().mean(0) if z.is_floating_point() else v.sum(0)
            else:
                v = z
            parts.append(v.to(z.dtype))
        if sq is not None:
            parts.append(sq)
        packed = lax.psum(torch.cat([t.reshape(-1).to(torch.float64) for t in parts]), self.axis)
        out = [x.reshape(t.shape).to(t.dtype) for x, t in zip(packed.split([t.numel() for t in parts]), parts)]
        if sq is not None:
            return out[0], dict(zip(template, out[1:-1])), out[-1]
        return out[0], dict(zip(template, out[1:])), None
