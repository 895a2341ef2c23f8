"""Regional compilation (动转静): ``torch.compile`` of a model's compute regions, with the collectives
and the layout reads of a parallelized step left eager between them.

A parallelized step cannot be compiled whole today (docs/parallel.md, "Compiling the per-rank program"):
dynamo does not trace the :mod:`hpfunc.layout` binding (a ``ContextVar``), ``hpfunc.lax`` collectives are
``torch.distributed`` calls inside autograd Functions, the engine differentiates with an eager
``torch.autograd.grad`` and the fused AdamW kernel does not functionalize. What compiles is the compute
*between* those: a model declares its regions in its own code (a transformer layer with no collective in
it, or the pieces of one between its tensor-parallel seams) and calls them through a :class:`Regions`;
every layout value a region depends on is read before the call, outside the region, and handed in as
an argument (a tensor, or a Python constant dynamo specialises on). A region is compiled with
``fullgraph=True``: a region that holds anything dynamo cannot trace is an error at its first call, not
a silent graph break. AOTAutograd compiles each region's backward too; the engine's autograd stitches
the regions, the FSDP gathers and the collectives together as in eager mode.

The parameters a region reads are handed in as plain tensors (:func:`plain`): reading a parallelized
step's lazy parameter view is what gathers a layer over its FSDP axes (and casts it under mixed
precision), so that happens eagerly, just before the region, one layer at a time as before.

``Regions`` counts the graphs its backend compiled, per region, with a wrapper around the backend (a
real count of compilations: dynamo calls the backend once per graph it captures, again on every
recompilation): after the first step of a run with fixed shapes the counts stay put.

    >>> import torch
    >>> regions = Regions("eager")
    >>> def scale(x, w, *, k):
    ...     return torch.tanh(x * w) * k
    >>> y = regions("scale", scale, torch.ones(3), torch.full((3,), 0.5), k=2.0)
    >>> y = regions("scale", scale, torch.zeros(3), torch.full((3,), 0.5), k=2.0)   # same shapes: no recompile
    >>> regions.compilations
    {'scale': 1}
    >>> y = regions("scale", scale, torch.zeros(4), torch.full((4,), 0.5), k=2.0)   # a new shape recompiles
    >>> regions.compilations, regions
    ({'scale': 2}, Regions(backend='eager', compilations={'scale': 2}))
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch

__all__ = ["Regions", "plain", "BACKENDS", "backend_of"]

# The torch.compile backends a trainer config may name (``train.compile``): inductor generates fused
# kernels (C++ on CPU, Triton on GPU); aot_eager traces forward and backward with AOTAutograd and runs
# the graphs eagerly (compiles in a fraction of the time: the test suite's choice); eager only captures.
BACKENDS = ("inductor", "aot_eager", "eager")


def backend_of(mode: bool | str, where: str = "compile") -> str | None:
    """The backend a compile request names (``train.compile``, ``parallelize(compile=...)``,
    ``Lowered.compile(mode)``): ``None`` for ``False`` (eager), ``inductor`` for ``True``, else one of
    :data:`BACKENDS`.

    >>> backend_of(True), backend_of("aot_eager"), backend_of(False)
    ('inductor', 'aot_eager', None)
    """
    if mode is False or mode is None:
        return None
    if mode is True:
        return "inductor"
    if isinstance(mode, str) and mode in BACKENDS:
        return mode
    raise ValueError(f"{where}: expected true, false or one of {BACKENDS}, found {mode!r}")


def plain(tree: Any) -> Any:
    """``tree`` with every mapping as a ``dict`` and every non-tensor sequence as a ``list``, each leaf
    read once (a parallelized step's lazy parameter view gathers and casts a leaf when it is read).

    >>> plain({"a": (torch.ones(1), [torch.zeros(2)])})
    {'a': [tensor([1.]), [tensor([0., 0.])]]}
    """
    if isinstance(tree, torch.Tensor) or tree is None:
        return tree
    if isinstance(tree, Mapping):
        return {k: plain(tree[k]) for k in tree}
    if isinstance(tree, Sequence) and not isinstance(tree, str):
        return [plain(x) for x in tree]
    return tree


class _Counting:
    """A torch.compile backend that counts the graphs it is handed, then compiles them with ``backend``."""

    def __init__(self, backend: str, counts: dict[str, int], name: str) -> None:
        self.backend, self.counts, self.name = backend, counts, name

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return lookup_backend(self.backend)(gm, example_inputs)


class Regions:
    """Compiled regions by name: ``regions(name, fn, *args, **kwargs)`` runs ``torch.compile(fn)`` (made
    on the first call of that name, ``fullgraph=True``, static shapes) on the arguments.

    ``backend``: one of :data:`BACKENDS`. ``compilations``: per region, how many graphs the backend has
    compiled (the first call compiles one; each recompilation, e.g. for a new shape, one more).
    A name is bound to the function of its first call; calling it with another function is an error.
    """

    def __init__(self, backend: str = "inductor") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"Regions: backend must be one of {BACKENDS}, found {backend!r}")
        self.backend = backend
        self._fns: dict[str, tuple[Callable, Callable]] = {}
        self._counts: dict[str, int] = {}

    def __call__(self, name: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        entry = self._fns.get(name)
        if entry is None:
            backend = _Counting(self.backend, self._counts, name)
            compiled = torch.compile(_own_code(fn, name), backend=backend, fullgraph=True, dynamic=False)
            entry = self._fns[name] = (fn, compiled)
        elif entry[0] is not fn:
            raise ValueError(f"Regions: region {name!r} was compiled from {_qualname(entry[0])}; it is now called "
                             f"with {_qualname(fn)}: give each function its own region name")
        return entry[1](*args, **kwargs)

    @property
    def compilations(self) -> dict[str, int]:
        """Graphs compiled so far, per region name (a copy)."""
        return dict(self._counts)

    def __repr__(self) -> str:
        return f"Regions(backend={self.backend!r}, compilations={self._counts})"


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` as a function with a code object of its own. Dynamo keeps its compiled graphs on the code
    object, at most ``recompile_limit`` (8) per code object whatever the backend: each :class:`Regions`
    (a backend of its own) compiling the same model function would otherwise use up that limit for
    every later one. With its own code object a region's count starts from zero in each ``Regions``."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"Regions: region {name!r} must be a Python function (compiled from its code), found "
                        f"{type(fn).__name__}; pass the function and its arguments, not a partial or a method")
    out = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return out


def _qualname(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))
