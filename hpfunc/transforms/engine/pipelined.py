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


AHEAD = 2  # stage parameter groups whose all-gathers are in flight ahead of their first read, at most


class _Ahead:
    """The step's parameters read by the stages where they use them, gathers issued one group ahead.

    Under FSDP the step's view gathers a group of parameters (a layer's) when one of them is first read.
    Read all at once before the schedule runs, every gather would wait in turn with nothing to compute
    meanwhile. Here the pipeline hands the executor, per local stage, its leaves to read on first use
    (:meth:`StageParams._make_deferred <hpfunc.transforms.pipeline.stage_params.StageParams._make_deferred>`):
    a stage's first forward reads layer ``k`` as it reaches it, which lands that group's all-gather and
    issues the next group's without waiting (the reader's :meth:`issue`, the forward prefetch's packed
    :func:`~hpfunc.transforms.engine.prefetch.start`), so layer ``k + 1``'s gather runs while layer ``k``
    computes; the first group's is issued before the schedule starts. Reading a group issues the next
    one not read yet, while fewer than :data:`AHEAD` (2) are in flight: one ahead in the order, and one
    more while a group issued ahead waits for a read out of that order (on the first step, whose order is
    the tree's: Qwen3's last stage reads its layers before the final norm that sorts first); a group read
    out of order is gathered in its turn, never twice. The order is that of the parameter tree on the first step, then the order the stages read the
    groups in that step (kept in the program's memo). The values read are the view's own (the same
    gathers, landed: their transposes are the same reduce-scatters), so bytes and results are unchanged.

    Used when the view is one plain tree read by a reader that can issue gathers (the step's); otherwise the
    pipeline reads the whole tree before the schedule as before."""

    def __init__(self, base: Any, read: Any):
        self.base, self.read = base, read

    @classmethod
    def of(cls, params: Any) -> "_Ahead | None":
        from hpfunc.transforms.engine.view import _LazyDict, _LazyList, _is_view

        if isinstance(params, _LazyDict):
            base, read = params._d, params._read
        elif isinstance(params, _LazyList):
            base, read = params._l, params._read
        else:
            return None
        if not (hasattr(read, "issue") and hasattr(read, "ws") and hasattr(read, "cfg")):
            return None
        if any(_is_view(x) for x in _tree.flatten(base, is_leaf=_is_view)[0]):
            return None  # a tree built of several views: read whole (materialize)
        return cls(base, read)

    def start(self, leaves: list, uses: dict[int, list[int]], memo: dict, treedef: Any) -> dict[int, Any]:
        """Issue the first group's gather; per stage, the executor's reader of its leaves (``uses[s]``)."""
        read = self.read
        self.leaves, self.values = leaves, [None] * len(leaves)
        self.index = {}  # block index in the step -> position in leaves
        for k, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                i = read.ws.index_of(x)
                if i is not None:
                    self.index.setdefault(i, k)
        group_of = read.cfg.group_of
        key = ("read order", treedef)
        order = memo.get(key)
        if order is None:  # the first step: the tree's order (each group by its first member)
            order = []
            for i in sorted(self.index, key=self.index.get):
                g = group_of.get(i)
                if g is not None and g[0] not in order:
                    order.append(g[0])
        self.order, self.at = list(order), {g: n for n, g in enumerate(order)}
        self.seen: list[int] | None = [] if key not in memo else None
        self.done: set[int] = set()  # the groups read (gathered) in this step
        self.memo, self.key = memo, key
        self.flying: set[int] = set()  # the groups issued ahead and not read yet (at most AHEAD)
        if self.order and read.issue(self.order[0]):
            self.flying.add(self.order[0])
        return {s: _StageReader(self, ks) for s, ks in uses.items()}

    def value(self, k: int) -> Any:
        """Leaf ``k`` as used (read once; reading a gathered group issues the next one's gather)."""
        v = self.values[k]
        if v is None:
            x = self.leaves[k]
            if not isinstance(x, torch.Tensor):
                return x
            v = self.values[k] = self.read(x)
            i = self.read.ws.index_of(x)
            g = self.read.cfg.group_of.get(i)
            if g is not None and g[0] not in self.done:
                first = g[0]
                self.done.add(first)
                if self.seen is not None:
                    self.seen.append(first)
                # the next group in the order not gathered yet (one read out of order is not gathered twice)
                n = self.at.get(first, -1) + 1
                while n < len(self.order) and self.order[n] in self.done:
                    n += 1
                self.flying -= self.done
                if n < len(self.order) and len(self.flying) < AHEAD and self.read.issue(self.order[n]):
                    self.flying.add(self.order[n])
        return v

    def finish(self) -> list:
        """Every leaf as used (those no stage read, read now); the read order kept for the next steps."""
        out = [self.value(k) if isinstance(x, torch.Tensor) else x for k, x in enumerate(self.leaves)]
        if self.seen is not None:
            self.memo.setdefault(self.key, tuple(self.seen) + tuple(g for g in self.order if g not in self.seen))
        return out


class _StageReader:
    """One stage's leaves for the executor: ``position(x)`` (the stage's index of the step's block ``x``, or
    of an exact alias of it) and ``value(k)`` (that leaf as used)."""

    __slots__ = ("ahead", "keys", "local")

    def __init__(self, ahead: _Ahead, keys: list[int]):
        self.ahead, self.keys = ahead, keys
        self.local = {k: n for n, k in enumerate(keys)}

    def position(self, x: Any) -> int | None:
        i = self.ahead.read.ws.param_of(x)
        k = None if i is None else self.ahead.index.get(i)
        return None if k is None else self.local.get(k)

    def value(self, n: int) -> Any:
        return self.ahead.value(self.keys[n])


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
        # casts them; otherwise the step's blocks are in the tree as they are. Read through the view, each
        # stage's leaves are read where its first forward uses them, their gathers issued ahead (_Ahead)
        ahead = _Ahead.of(params) if self.needs_view else None
        full = params if ahead is None else ahead.base
        if ahead is None and self.needs_view:
            full = materialize(params)
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
        deferred = None
        if ahead is not None:
            deferred = ahead.start(leaves, {s: uses[s] for s in self.local_stages}, self.memo, treedef)
        with self.params_layer.keeping_gathered():
            losses, auxes, grads = self.executor.execute(trees, batch, deferred)
        if ahead is not None:
            leaves = ahead.finish()  # the leaves as used (every one read by now)
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
