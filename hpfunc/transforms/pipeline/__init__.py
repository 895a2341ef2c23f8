"""``pipeline_map``: execute a pipeline schedule (:mod:`hpfunc.schedules`) over torch.distributed.

Every rank runs the same program. It builds a step function from the full list of stage functions,
a :class:`~hpfunc.schedules.Schedule` and a :class:`~hpfunc.Mesh`; the step walks
``schedule.actions[pp_index]`` front to back:

==============  ==========================================================================
``F``           ``y = stage_fns[s](params[s], x)``; on the last stage ``loss_fn(y, microbatch)``
``B``           input gradient (:func:`~hpfunc.transforms.backward_split.backward_input`): ``dx``, keeping
                the gradient flowing into each parameter's use site (the matmul with the weight)
``W``           weight gradient only (:func:`~hpfunc.transforms.backward_split.backward_weight`): re-runs
                the use sites towards the parameters from what ``B`` kept; accumulated
``BW``          both in one ``torch.autograd.backward`` call: the weight gradients accumulate over
                microbatches in the stage's parameter leaves' ``.grad`` inside autograd, as torch's
                ``PipelineStage`` does (no Python-side sum per parameter and microbatch)
``SEND_*``      posted asynchronously (``dist.batch_isend_irecv``); a finished one is let go at the next
                send (its buffer with it), the rest are waited for at the end
``RECV_*``      received (and waited for) right where the schedule puts it
``UNSHARD``     all-gather the stage's parameter shards over the FSDP axis
``RESHARD``     drop the gathered parameters (graphs still pending keep what they saved)
``REDUCE_GRAD`` reduce the stage's accumulated gradients over the FSDP axis, keep this rank's shard
``SWAP_OUT``    move the stage-microbatch's saved activations to host memory
                (:class:`~hpfunc.transforms.activation_swap.ActivationSwap` on the saved-tensor stack)
``SWAP_IN``     bring them back into device memory (before the backward that needs them)
==============  ==========================================================================

A microbatch's graph (every tensor it saved) stays until its ``W`` or ``BW``: the weight side of a
split backward needs the saved layer inputs. :attr:`SimResult.peak_resident_until_w
<hpfunc.schedules.SimResult>` counts exactly that (minus what is swapped out); the activation bytes
resident per rank, measured by storage liveness, equal it times the bytes of one stage-microbatch
(``tests/pipeline/test_pipeline_swaps.py``).

Stages placed on the same rank (the turn of a V, or interleaved stages) hand activations and
gradients to each other in memory. The loss returned is the mean over microbatches (equal to the
full-batch loss for a loss that is a mean over equally sized microbatches); gradients are those of
that mean.

Example (2 ranks, run under ``hpfunc launch --nproc 2``)::

    import torch, hpfunc
    from hpfunc.schedules import one_f_one_b
    from hpfunc.transforms.pipeline import pipeline_map

    mesh = hpfunc.Mesh({"pp": 2})
    stage_fns = [lambda p, x: torch.tanh(x @ p["w"]), lambda p, x: x @ p["w"]]
    loss_fn = lambda y, mb: ((y - mb["y"]) ** 2).mean()
    step = pipeline_map(stage_fns, one_f_one_b(2, 4), mesh, loss_fn=loss_fn,
                        first_input=lambda mb: mb["x"])
    params = {s: {"w": torch.randn(4, 4)} for s in step.local_stages}
    loss, grads = step(params, {"x": torch.randn(8, 4), "y": torch.randn(8, 4)})
"""

from hpfunc.transforms.pipeline.errors import PipelineError
from hpfunc.transforms.pipeline.microbatches import split_microbatches
from hpfunc.transforms.pipeline.stage_params import shard_stage_params, unshard_stage_grads
from hpfunc.transforms.pipeline.step import PipelineStep, pipeline_map
from hpfunc.transforms.pipeline.timeline import record_timeline

__all__ = ["PipelineError", "PipelineStep", "pipeline_map", "record_timeline", "shard_stage_params",
           "split_microbatches", "unshard_stage_grads"]
