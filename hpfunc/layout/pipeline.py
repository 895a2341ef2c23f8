"""The pipeline binding: how a model split into stages runs under a ``pp`` plan layer.

A model that can be pipelined describes its split as :class:`Stages` (built beside the model, e.g.
:func:`hpfunc.models.qwen3.parallel_plan.pipeline_stages`): which stages use each parameter, one
forward per stage over a *carry* (the tensors passed from one stage to the next) and the loss on the
last stage. ``plans.pp(axis, stages, schedule=..., microbatches=m)`` puts it in a plan; inside a
parallelized step the transform binds a :class:`PipelineRunner` around the function it
differentiates, and the model's loss hands itself to it (:func:`runner`). With nothing bound the same
stages run one after the other on one device (:meth:`Stages.run`), which is what the pipelined run
is proven equal to.

    >>> import torch
    >>> stages = Stages(
    ...     num_stages=2, paths=("a", "b"), stage_of=lambda path: (0,) if path == "a" else (1,),
    ...     forward=lambda s, p, carry, mb: (mb["x"] * p["a"],) if s == 0 else (carry[0] * p["b"],),
    ...     loss=lambda p, carry, mb: (carry[0].sum(), {}), aux_template=lambda mb: {})
    >>> float(stages.run({"a": torch.tensor(2.0), "b": torch.tensor(3.0)}, {"x": torch.ones(2)})[0])
    12.0
    >>> runner() is None
    True
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol

import attrs

from hpfunc.layout.binding import bound, rebind

__all__ = ["Stages", "PipelineRunner", "pipeline", "runner", "model_paths"]


@attrs.frozen(eq=False)
class Stages:
    """A model split into ``num_stages`` pipeline stages.

    ``paths``: every parameter path of the model, in its flattening order (the ranks of a pipeline
    each hold only some of them). ``stage_of(path)``: the stages that use the parameter (more than one
    for a tied embedding: the first and the last stage). ``forward(s, params, carry, microbatch) ->
    carry``: stage ``s`` (``carry`` is ``None`` on stage 0; a carry is a tuple of tensors, the
    floating ones carry gradients back); ``loss(params, carry, microbatch) -> (loss, aux)`` ends the
    last stage (a scalar mean over the microbatch; ``aux`` a dict of tensors, floats averaged and
    integers summed over microbatches). Both are pure functions of their arguments: gradients reach
    the parameters only through ``params`` (the executor runs a stage's full backward without naming
    its targets, as ``torch.distributed.pipelining`` does, and a stage that reads parameters it closed
    over is a :class:`PlanError`). ``aux_template(batch)``: zeros shaped like that ``aux`` (the ranks
    without the last stage receive it into them), a function of the batch's shapes and dtypes only (the
    runner makes it once per shapes). ``owner``: what built it (the model's
    config), checked by the model's hook so that a plan built for one model is not run by another.
    """

    num_stages: int
    paths: tuple[str, ...]
    stage_of: Callable[[str], tuple[int, ...]]
    forward: Callable[[int, Any, Any, Any], Any]
    loss: Callable[[Any, Any, Any], tuple[Any, dict]]
    aux_template: Callable[[Any], dict]
    owner: Any = None
    layers: tuple[int, ...] | None = None  # layers per stage, when the model counts layers

    def run(self, params: Any, microbatch: Any) -> tuple[Any, dict]:
        """The stages one after the other on one device: ``(loss, aux)`` of one (micro)batch."""
        carry = None
        for s in range(self.num_stages):
            carry = self.forward(s, params, carry, microbatch)
        return self.loss(params, carry, microbatch)


class PipelineRunner(Protocol):
    """What a parallelized step with a ``pp`` layer binds (implemented by the transform)."""

    axis: str
    stages: Stages

    def run(self, params: Any, batch: Any, *, owner: Any = None) -> tuple[Any, dict]:
        """``(loss, aux)`` of ``batch`` (this rank's data shard) pipelined over the bound schedule; the
        loss carries the gradients of the parameters in ``params`` (this rank's stages)."""


@contextlib.contextmanager
def pipeline(run: PipelineRunner | None) -> Iterator[None]:
    """Bind the pipeline runner for the function being differentiated (``None``: no pipeline)."""
    with rebind(pipeline=run, model_paths=None if run is None else tuple(run.stages.paths)):
        yield


@contextlib.contextmanager
def model_parameter_paths(paths: tuple[str, ...] | None) -> Iterator[None]:
    """Bind the paths of every parameter of the model (a pipelined step: this rank holds some)."""
    with rebind(model_paths=None if paths is None else tuple(paths)):
        yield


def runner() -> PipelineRunner | None:
    """The bound pipeline runner, or ``None`` (no ``pp`` layer in the step running now)."""
    return bound().pipeline


def model_paths(tree: Any) -> list[str]:
    """The parameter paths of the whole model whose parameters (or this rank's share of them) are
    ``tree``: the paths of ``tree`` itself, unless a pipelined step bound the model's full list (each
    pipeline rank holds only its stages' parameters, the others are ``None``).

    >>> model_paths({"a": 1, "b": {"c": 2}})
    ['a', 'b.c']
    """
    paths = bound().model_paths
    if paths is not None:
        return list(paths)
    from hpfunc import tree as _tree

    return [p for p, _ in _tree.leaves_with_paths(tree)]
