"""One stack of saved-tensor hooks, so that the transforms that decide where autograd's saved tensors
live compose at any nesting.

``torch.autograd.graph.saved_tensors_hooks`` nest, but only the innermost pair sees the tensors saved
inside it. hpfunc has several transforms that each want some of those tensors: a parallelized step
owns the parameters it gathered (FSDP drops them after the forward and gathers them again in the
backward), :func:`hpfunc.offload` moves activations to host memory, and
:func:`hpfunc.memory.saved_activations` records what stays. Each of them contributes a
:class:`Layer` to one stack held in a context variable; the torch hooks that a layer installs run the
whole stack, in this order:

1. **ownership**, outermost first: the first layer whose :meth:`Layer.owns` claims the tensor packs it.
   A gathered parameter belongs to the step that gathered it, whatever is nested inside (an
   ``offload`` of a layer leaves it to the step's re-gather instead of copying it to the host);
2. otherwise the **innermost** layer packs it; a layer may hand the tensor on to the next layer
   outward (``outer.pack(t)``), and the outermost hands it to autograd's default (the tensor is kept).

Unpacking runs the same layers back: each layer's :meth:`Layer.unpack` receives exactly what its
:meth:`Layer.pack` returned. A packed value remembers its layers, so unpacking works in the backward,
outside every ``with`` block.

A layer that only claims tensors (it never changes one it is handed) sets ``needs_hooks = False``:
it joins the stack without installing torch hooks, so it costs nothing unless a layer inside or
outside it needs them (then the hooks installed run the whole stack, its claims included).

Inside a recomputed region (:func:`recompute_region`, entered by ``remat``) torch's checkpoint owns
every tensor saved: nothing is kept to move, so layers pushed there install no hooks.

Example (a layer that counts what it sees and hands everything on):
    >>> import torch
    >>> from hpfunc import saved_tensors
    >>> class Count(saved_tensors.Layer):
    ...     name = "count"
    ...     def __init__(self):
    ...         self.n = 0
    ...     def pack(self, t, outer):
    ...         self.n += 1
    ...         return outer.pack(t)
    >>> c, x = Count(), torch.ones(3, requires_grad=True)
    >>> with saved_tensors.layer(c):
    ...     y = (x * x).sum()         # mul saves both of its inputs
    >>> y.backward(); c.n, x.grad.tolist()
    (2, [2.0, 2.0, 2.0])
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import torch

from hpfunc import forward_context

__all__ = ["Layer", "Outer", "layer", "layers", "recompute_region", "in_recompute_region"]


class Layer:
    """One transform's say over saved tensors (subclass and override what you need).

    ``name`` is used in error messages (``"hpfunc.offload"``). ``needs_hooks``: whether the layer
    changes tensors it packs (then torch hooks are installed while it is on the stack).
    """

    name: str = "layer"
    needs_hooks: bool = True

    def owns(self, t: torch.Tensor) -> bool:
        """Whether this tensor is this layer's to pack whatever layers are nested inside (default: no)."""
        return False

    def pack(self, t: torch.Tensor, outer: "Outer") -> Any:
        """What autograd keeps instead of ``t``; the default hands ``t`` to the layers outward."""
        return outer.pack(t)

    def unpack(self, packed: Any, outer: "Outer") -> torch.Tensor:
        """The tensor back from what :meth:`pack` returned; the default undoes ``outer.pack``."""
        return outer.unpack(packed)


class Outer:
    """The layers outward of one layer: ``pack`` hands them a tensor, ``unpack`` takes it back."""

    __slots__ = ("layer", "next")

    def __init__(self, layer: Layer, next: "Outer | None"):
        # ``layer`` is the one these are outward of; ``next`` the same for the layer outward (None past the
        # outermost: autograd's default). One Outer per layer of a chain, made once: packing allocates nothing.
        self.layer, self.next = layer, next

    def pack(self, t: torch.Tensor) -> Any:
        nxt = self.next
        if nxt is None:
            # autograd's default: keep the tensor. Detached: a saved output returned as itself would hold
            # its own grad_fn (a reference cycle that keeps the graph alive until the garbage collector)
            return t.detach()
        return _Packed(nxt, nxt.layer.pack(t, nxt))

    def unpack(self, packed: Any) -> torch.Tensor:
        return _unpack(packed)


class _Packed:
    """A value packed by ``outer.layer`` (``outer`` leads to the layers outward of it)."""

    __slots__ = ("outer", "payload")

    def __init__(self, outer: Outer, payload: Any):
        self.outer, self.payload = outer, payload


def _outers(chain: tuple[Layer, ...]) -> list[Outer]:
    """``outers[k]``: the Outer of ``chain[k]`` (outermost first)."""
    outers: list[Outer] = []
    nxt = None
    for lay in chain:
        nxt = Outer(lay, nxt)
        outers.append(nxt)
    return outers


def _pack_with(chain: tuple[Layer, ...]):
    outers = _outers(chain)
    owners = outers[:-1]  # the innermost layer packs what no outer layer owns, so only the outer ones are asked
    inner = outers[-1]

    def pack(t: torch.Tensor) -> Any:
        for o in owners:
            if o.layer.owns(t):
                return _Packed(o, o.layer.pack(t, o))
        return _Packed(inner, inner.layer.pack(t, inner))

    return pack


def _unpack(packed: Any) -> torch.Tensor:
    if type(packed) is _Packed:
        o = packed.outer
        return o.layer.unpack(packed.payload, o)
    return packed


class _InContext:
    """A packed value with the context it was packed in (see :func:`_in_forward_context`)."""

    __slots__ = ("captured", "payload")

    def __init__(self, captured: forward_context.Captured, payload: Any):
        self.captured, self.payload = captured, payload


def _in_forward_context(pack: Callable, unpack: Callable) -> tuple[Callable, Callable]:
    """The hooks with each unpack run in the context its pack ran in: on CUDA the autograd engine unpacks
    on its device thread, where the layers' context variables (the mesh of an FSDP re-gather) are unset."""

    def pack_here(t: torch.Tensor) -> _InContext:
        return _InContext(forward_context.capture(), pack(t))

    def unpack_there(p: _InContext) -> torch.Tensor:
        return forward_context.run(p.captured, unpack, p.payload)

    return pack_here, unpack_there


_STACK: contextvars.ContextVar[tuple[Layer, ...]] = contextvars.ContextVar("hpfunc_saved_tensor_layers", default=())
_RECOMPUTE: contextvars.ContextVar[str | None] = contextvars.ContextVar("hpfunc_recompute_region", default=None)


def layers() -> tuple[Layer, ...]:
    """The layers on the stack now, outermost first."""
    return _STACK.get()


@contextlib.contextmanager
def layer(lay: Layer) -> Iterator[Layer]:
    """Push ``lay`` on the stack for the ``with`` block (see the module docstring)."""
    if not isinstance(lay, Layer):
        raise TypeError(f"saved_tensors.layer: expected a saved_tensors.Layer, found {type(lay).__name__}")
    chain = _STACK.get() + (lay,)
    token = _STACK.set(chain)
    try:
        # Hooks run the chain they were installed with: when a layer outward has hooks installed,
        # this one must install the longer chain too, or tensors saved here would never be asked
        # about (a claim-only layer's ``owns`` ignored under an outer recorder or offload).
        if any(x.needs_hooks for x in chain) and _RECOMPUTE.get() is None:
            if len(chain) == 1:  # alone on the stack: its own pack/unpack, with nothing to route
                outer = _outers(chain)[0]
                hooks = (lambda t: lay.pack(t, outer), lambda p: lay.unpack(p, outer))
            else:
                hooks = (_pack_with(chain), _unpack)
            with torch.autograd.graph.saved_tensors_hooks(*_in_forward_context(*hooks)):
                yield lay
        else:
            yield lay
    finally:
        _STACK.reset(token)


@contextlib.contextmanager
def recompute_region(name: str = "hpfunc.remat") -> Iterator[None]:
    """Mark a region whose saved tensors torch's checkpoint owns (they are dropped and recomputed):
    layers pushed inside install no hooks. ``name`` is reported by :func:`in_recompute_region`."""
    token = _RECOMPUTE.set(name)
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


def in_recompute_region() -> str | None:
    """The name of the recomputed region running now (``"hpfunc.remat"``), or ``None``."""
    return _RECOMPUTE.get()
