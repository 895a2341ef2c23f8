"""The layout seam: how code that is not elementwise learns where a value lives inside a parallelized step.

This is hpfunc's extension point. ``hpfunc.parallelize(step, mesh, plan)`` runs ``step`` on every rank
on this rank's blocks and binds, for the step, one immutable :class:`Binding` (a ``contextvars`` value)
holding its :class:`StepLayout`, and another for the function it differentiates (data, tensor-,
expert-, context-parallel axes, the pipeline runner).
Library code written for one device asks it the few questions that blocks change, and gives the
single-device answer; outside a step every question answers for one device, so the same code runs
unchanged on one device, in a notebook and on a mesh. The core (``autodiff``, ``microbatch``), the
models and the optimizers import only this package, never ``hpfunc.transforms``.

What you can ask:

===================================  =================================================================
:func:`bound`                        the one :class:`Binding` in force (everything below reads it)
:func:`current`                      the bound :class:`StepLayout` (``None`` outside a step)
:func:`leaf` (path)                  the :class:`LeafLayout` of a parameter: global shape, storage /
                                     compute / optimizer specs, what is gathered before use
:func:`varying_axes` (path)          the mesh axes along which that parameter's block differs
:func:`data_axes`                    the mesh axes the batch is split over (batch statistics vary
                                     over them)
:func:`local_block` (path, full)     the block of a global value that this rank's block covers
:func:`gather_block` (path, block)   the global value from this rank's block (a collective)
:func:`global_sq_norm` (tree)        the squared norm of global tensors from their blocks
:func:`sq_norm_table` (trees)        every leaf's global squared norm (and per-data-rank values) in
                                     one reduction (the precision monitor's)
:func:`donated`                      whether the step may write its new state into the old one's buffers
:func:`ep_axis`                      the expert-parallel axis (:mod:`hpfunc.layout.expert_parallel`)
:func:`cp_binding`                   the context-parallel binding: the axes each sequence is split
                                     over and the attention strategy (:mod:`hpfunc.layout.context_parallel`)
:func:`runner`, :class:`Stages`      the pipeline binding: a model split into stages runs through the
                                     bound runner (:mod:`hpfunc.layout.pipeline`)
:func:`model_paths` (tree)           every parameter path of the model (a pipeline rank holds some)
:func:`run_layer` (i, fn, ...)       a model's layer ``i``, through the bound per-layer transform (remat,
                                     offload per layer: :mod:`hpfunc.layout.layers`)
:func:`regions`                      the compiled regions a compiled step runs the model's compute in
                                     (``Lowered.compile``), ``None`` for eager
:func:`scopes`, :func:`scoped`       the :class:`Scopes` bound around some code for all under it to see,
                                     steps included (recorders, test hooks, the trainer's step count)
:func:`tp_axis`, ...                 the tensor-parallel binding (:mod:`hpfunc.layout.tensor_parallel`)
                                     and its building blocks :func:`scatter_sequence`,
                                     :func:`gather_sequence`, :func:`reduce_partial`
styles                               :class:`ColwiseParallel`, :class:`RowwiseParallel`, ... : how a
                                     model declares its tensor-parallel table
===================================  =================================================================

Who uses it: :func:`hpfunc.value_and_grad` hands the differentiation to the bound layout (gather on
use, reduced gradients); :func:`hpfunc.optim.global_norm` sums over shards; Muon gathers a sharded
matrix with :func:`gather_block` and cuts its update back with :func:`local_block`; the MoE
expert-bias update cuts the global load to this rank's experts; Qwen3's layers, embedding, head and
loss (``hpfunc.models.qwen3``) read the tensor-parallel binding; MoE blocks read the
expert-parallel one and dispatch tokens to the ranks holding their experts; Qwen3's attention reads
the context-parallel one and takes its tokens of each sequence.

A new parallelism is a plan layer plus hooks that read this context; nothing else changes. A layer of
your own does the same (the one-device run is the reference; ``docs/parallel.md`` runs it on a mesh):

    >>> import torch, torch.nn.functional as F
    >>> from hpfunc import layout
    >>> def mlp(p, x):                       # w_in column-parallel, w_out row-parallel over the bound axis
    ...     h = F.gelu(F.linear(layout.gather_sequence(x), p["w_in"]))
    ...     return layout.reduce_partial(F.linear(h, p["w_out"]))
    >>> p = {"w_in": torch.ones(8, 4), "w_out": torch.ones(4, 8)}
    >>> mlp(p, torch.ones(2, 3, 4)).shape    # no step bound: exactly the single-device layer
    torch.Size([2, 3, 4])
    >>> layout.current() is None, layout.tp_axis()
    (True, None)
"""

from hpfunc.layout.binding import (BitFlip, Binding, Scopes, StateStreaming, binding, bound, rebind, regions, scoped,
                                   scopes)
from hpfunc.layout.step import (Accumulation, LeafLayout, LeafSpec, PlanError, StepLayout, bind, blocks_sq_norm,
                                blocks_sq_sum, sq_norm_part,
                                current, data_axes, data_parallel, donated, gather_block, global_sq_norm, leaf,
                                local_block, sq_norm_table, varying_axes)
from hpfunc.layout.expert_parallel import ep_axis, expert_parallel
from hpfunc.layout.context_parallel import ContextParallel, context_parallel, cp_binding
from hpfunc.layout.layers import LayerTransform, layer_transforms, run_layer
from hpfunc.layout.pipeline import PipelineRunner, Stages, model_parameter_paths, model_paths, pipeline, runner
from hpfunc.layout.styles import ColwiseParallel, Replicate, RowwiseParallel, SequenceParallel, Style, VocabParallel
from hpfunc.layout.tensor_parallel import (check_sequence, gather_sequence, reduce_partial, scatter_sequence,
                                           sequence_parallel, tensor_parallel, tp_axis, vocab_parallel)

__all__ = [
    "StepLayout", "LeafLayout", "LeafSpec", "Accumulation", "PlanError", "current", "bind", "leaf", "data_axes",
    "data_parallel", "donated",
    "varying_axes", "local_block", "gather_block", "global_sq_norm", "blocks_sq_norm", "blocks_sq_sum", "sq_norm_part",
    "sq_norm_table",
    "tensor_parallel", "tp_axis", "sequence_parallel", "vocab_parallel", "scatter_sequence", "gather_sequence",
    "reduce_partial", "check_sequence", "expert_parallel", "ep_axis",
    "ContextParallel", "context_parallel", "cp_binding",
    "Stages", "PipelineRunner", "pipeline", "runner", "model_paths", "model_parameter_paths",
    "Style", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "VocabParallel", "Replicate",
    "Binding", "binding", "bound", "rebind", "regions", "run_layer", "layer_transforms", "LayerTransform",
    "Scopes", "scopes", "scoped", "StateStreaming", "BitFlip",
]
