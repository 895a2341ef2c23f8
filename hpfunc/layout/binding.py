"""The one binding of the layout seam: everything it answers, as one immutable value.

A parallelized step binds a :class:`Binding` for its body (the step's :class:`~hpfunc.layout.StepLayout`,
the model's parameter paths) and another for the function it differentiates (the data, tensor-,
expert-parallel axes, the pipeline runner), each built once when the step is lowered; every query of
:mod:`hpfunc.layout` reads the one bound value. The context managers ``bind``, ``data_parallel``,
``tensor_parallel``, ``expert_parallel``, ``context_parallel``, ``pipeline`` and ``model_parameter_paths`` each bind a copy
of the current binding with their fields changed (for a test, or a layer run by hand).

The binding also holds the :class:`Scopes`: what the caller, or the library for a region of a step,
binds around some code for everything under it to see (a recorder, a test hook, the trainer's step
count; :func:`scoped` binds them, :func:`scopes` reads them). A step's layout bindings are built when it
is lowered and say nothing about the scopes (``scopes=None``): :func:`binding` keeps the scopes in force,
so a recorder bound around a step call is seen in its body and in the function it differentiates.

    >>> bound().tp_axis, bound().step is None
    (None, True)
    >>> with binding(Binding(tp_axis="tp", data_axes=("dp",))):
    ...     bound().tp_axis, bound().data_axes
    ('tp', ('dp',))
    >>> with rebind(ep_axis="ep"):
    ...     bound().ep_axis, bound().tp_axis
    ('ep', None)
    >>> with scoped(steps_done=3), binding(Binding(tp_axis="tp")):  # a layout bound inside keeps the scopes
    ...     scopes().steps_done, bound().tp_axis
    (3, 'tp')
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Iterator

import attrs

if TYPE_CHECKING:
    from hpfunc.memory._names import NameScope

__all__ = ["Binding", "Scopes", "StateStreaming", "BitFlip", "bound", "binding", "rebind", "regions", "scopes",
           "scoped"]


@attrs.frozen
class StateStreaming:
    """How the optimizer streams its state held in host memory (:func:`hpfunc.optim.streaming_state`):
    ``group_bytes`` of state a group (0: one leaf a group); ``moments``, ``params``: whether the moments,
    the parameters are held in host memory."""

    group_bytes: int
    moments: bool = True
    params: bool = False


@attrs.frozen
class BitFlip:
    """A bit flip injected into a reduced gradient (:func:`hpfunc.transforms.engine.sdc.inject_bit_flip`):
    bit ``bit`` of element 0 of ``path``'s block on global rank ``rank``, at check number ``step`` (every
    check when ``None``)."""

    rank: int
    path: str
    bit: int
    step: int | None = None


@attrs.frozen
class Scopes:
    """What is bound around some code for everything under it, steps included, to see; each member is
    bound by its own context manager (through :func:`scoped`) and is ``None`` outside it.

    ``state_streaming``: the optimizer state streamed through the device (:class:`StateStreaming`,
    :func:`hpfunc.optim.streaming_state`: a step under ``with_state_offload``); ``sdc_flip``: the
    :class:`BitFlip` of :func:`hpfunc.transforms.engine.sdc.inject_bit_flip` (fault-injection tests);
    ``pipeline_timeline``: the list the pipeline executor records its events into
    (:func:`hpfunc.transforms.pipeline.record_timeline`); ``dispatch_trace``, ``ring_trace``: the lists
    the MoE chunked exchange and ring attention record their events into
    (:func:`hpfunc.models.dispatch.trace_exchange`, :func:`hpfunc.models.context_attention.trace_ring`);
    ``checkpoint_tag``: the name :func:`hpfunc.checkpoint_name` is tagging (bound for its one alias op, read
    by the remat policy); ``name_scope``: the innermost ``hpfunc.memory`` name scope, where
    ``checkpoint_name`` records the storages it tags (one per ``remat`` / ``offload`` call and memory
    report); ``local_losses``: the list a train step's objective records each call's loss into, on the
    steps the precision monitor measures (:meth:`hpfunc.train.precision_probe.PrecisionProbe.recording`);
    ``steps_done``: the optimizer steps taken before the train step that runs, as the trainer's loop
    counts them (:func:`hpfunc.train.precision_probe.steps_done`). A recorder is a list appended to: the
    bound value, not the binding, changes.
    """

    state_streaming: StateStreaming | None = None
    sdc_flip: BitFlip | None = None
    pipeline_timeline: list | None = None
    dispatch_trace: list | None = None
    ring_trace: list | None = None
    checkpoint_tag: str | None = None
    name_scope: "NameScope | None" = None
    local_losses: list | None = None
    steps_done: int | None = None


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
    (:func:`~hpfunc.layout.regions`; ``Lowered.compile``), ``None`` for eager; ``scopes``: the
    :class:`Scopes`, ``None`` in a binding made for a layout (when a step is lowered, ...): bound, it
    takes the scopes in force (:func:`binding`).
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
    scopes: Scopes | None = None


_BOUND: contextvars.ContextVar[Binding] = contextvars.ContextVar("hpfunc_layout", default=Binding(scopes=Scopes()))


def bound() -> Binding:
    """The binding in force (the empty :class:`Binding` outside a step: one device)."""
    return _BOUND.get()


@contextlib.contextmanager
def binding(value: Binding) -> Iterator[Binding]:
    """Make ``value`` the binding for the ``with`` block; with ``value.scopes`` ``None`` (a binding made for a
    layout, as a step makes them) the :class:`Scopes` in force when the block is entered stay bound."""
    if value.scopes is None:
        value = attrs.evolve(value, scopes=_BOUND.get().scopes)
    token = _BOUND.set(value)
    try:
        yield value
    finally:
        _BOUND.reset(token)


@contextlib.contextmanager
def rebind(**changes: Any) -> Iterator[Binding]:
    """Bind the binding in force when the block is entered with ``changes`` (field names of :class:`Binding`)."""
    with binding(attrs.evolve(_BOUND.get(), **changes)) as value:  # (scopes None: those in force stay)
        yield value


def scopes() -> Scopes:
    """The :class:`Scopes` in force (every member ``None`` outside their context managers).

    >>> scopes().pipeline_timeline is None
    True
    """
    return _BOUND.get().scopes


@contextlib.contextmanager
def scoped(**changes: Any) -> Iterator[Binding]:
    """Bind the binding in force when the block is entered with ``changes`` to its :class:`Scopes` (member
    names).

    >>> events = []
    >>> with scoped(pipeline_timeline=events):
    ...     scopes().pipeline_timeline is events
    True
    """
    now = _BOUND.get()
    with binding(attrs.evolve(now, scopes=attrs.evolve(now.scopes, **changes))) as value:
        yield value


def regions() -> Any:
    """The compiled regions (:class:`hpfunc.regions.Regions`) a compiled step binds for the function it
    differentiates (``train_step.compile(...)``, ``Lowered.compile``), or ``None``: a model that declares
    regions runs them eagerly. A model reads this instead of taking a ``regions`` argument from the step.

    >>> regions() is None
    True
    """
    return _BOUND.get().regions
