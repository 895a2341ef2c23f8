"""The one binding of the layout seam: everything it answers, as one immutable value.

A parallelized step binds a :class:`Binding` for its body (the step's :class:`~hpfunc.layout.StepLayout`,
the model's parameter paths) and another for the function it differentiates (the data, tensor-,
expert-parallel axes, the pipeline runner), each built once when the step is lowered; every query of
:mod:`hpfunc.layout` reads the one bound value. The context managers ``bind``, ``data_parallel``,
``tensor_parallel``, ``expert_parallel``, ``context_parallel``, ``pipeline`` and ``model_parameter_paths`` each bind a copy
of the current binding with their fields changed (for a test, or a layer run by hand).

    >>> bound().tp_axis, bound().step is None
    (None, True)
    >>> with binding(Binding(tp_axis="tp", data_axes=("dp",))):
    ...     bound().tp_axis, bound().data_axes
    ('tp', ('dp',))
    >>> with rebind(ep_axis="ep"):
    ...     bound().ep_axis, bound().tp_axis
    ('ep', None)
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import attrs

__all__ = ["Binding", "bound", "binding", "rebind", "regions"]


@attrs.frozen
class Binding:
    """What the layout seam answers while a step runs (see the module docstring).

    ``step``: the step's :class:`~hpfunc.layout.StepLayout` (``None`` outside a step and inside the
    function it differentiates); ``data_axes``: the mesh axes the batch is split over, for the
    differentiated function; ``tp_axis``, ``vocab_parallel``, ``sequence_parallel``: the tensor-parallel
    binding; ``ep_axis``: the expert-parallel axis; ``context_parallel``: the
    :class:`~hpfunc.layout.ContextParallel` of a ``cp`` plan layer; ``pipeline``: the
    :class:`~hpfunc.layout.PipelineRunner` of a pipelined differentiation; ``model_paths``: every
    parameter path of the model (a pipeline rank holds only some); ``layer_transform``: what
    :func:`~hpfunc.layout.run_layer` wraps each layer of a model in (:mod:`hpfunc.layout.layers`);
    ``regions``: the :class:`hpfunc.regions.Regions` a compiled step runs the model's compute in
    (:func:`~hpfunc.layout.regions`; ``Lowered.compile``), ``None`` for eager.
    """

    step: Any = None
    data_axes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    tp_axis: str | None = None
    vocab_parallel: bool = False
    sequence_parallel: bool = False
    ep_axis: str | None = None
    context_parallel: Any = None
    pipeline: Any = None
    model_paths: tuple[str, ...] | None = None
    layer_transform: Any = None
    regions: Any = None


_BOUND: contextvars.ContextVar[Binding] = contextvars.ContextVar("hpfunc_layout", default=Binding())


def bound() -> Binding:
    """The binding in force (the empty :class:`Binding` outside a step: one device)."""
    return _BOUND.get()


@contextlib.contextmanager
def binding(value: Binding) -> Iterator[Binding]:
    """Make ``value`` the binding for the ``with`` block."""
    token = _BOUND.set(value)
    try:
        yield value
    finally:
        _BOUND.reset(token)


def rebind(**changes: Any) -> contextlib.AbstractContextManager[Binding]:
    """Bind the current binding with ``changes`` (field names of :class:`Binding`) for the ``with`` block."""
    return binding(attrs.evolve(_BOUND.get(), **changes))


def regions() -> Any:
    """The compiled regions (:class:`hpfunc.regions.Regions`) a compiled step binds for the function it
    differentiates (``train_step.compile(...)``, ``Lowered.compile``), or ``None``: a model that declares
    regions runs them eagerly. A model reads this instead of taking a ``regions`` argument from the step.

    >>> regions() is None
    True
    """
    return _BOUND.get().regions
