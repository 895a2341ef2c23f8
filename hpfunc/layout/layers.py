"""Per-layer transforms: a model runs each of its layers through :func:`run_layer`, so that what a layer
keeps for its backward (recomputed, offloaded to host memory) can be chosen per layer from outside.

A model calls ``run_layer(i, layer_fn, *args)`` for its layer ``i`` (its index in the whole model, also on
a pipeline stage that holds some layers only). With nothing bound it is ``layer_fn(*args)``; inside
:func:`layer_transforms` it runs ``transform(i, layer_fn)(*args)``, where ``transform`` (for example the
trainer's ``activations:`` policies, :mod:`hpfunc.train.activations`) wraps the layer in
:func:`hpfunc.transforms.remat.remat` or :func:`hpfunc.transforms.offload.offload`, or returns it as is.
The model keeps reading the same top to bottom; the transforms stay out of ``models/``.

    >>> import torch
    >>> def layer(h):
    ...     return h * 2
    >>> run_layer(0, layer, torch.ones(2)).tolist()
    [2.0, 2.0]
    >>> seen = []
    >>> def transform(i, fn):
    ...     seen.append(i)
    ...     return fn
    >>> with layer_transforms(transform):
    ...     _ = [run_layer(i, layer, torch.ones(2)) for i in range(3)]
    >>> seen
    [0, 1, 2]
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from hpfunc.layout.binding import bound, rebind

__all__ = ["run_layer", "layer_transforms", "LayerTransform"]

LayerTransform = Callable[[int, Callable[..., Any]], Callable[..., Any]]


def run_layer(index: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, layer ``index`` of a model, through the bound per-layer transform if any."""
    transform = bound().layer_transform
    if transform is None:
        return fn(*args, **kwargs)
    return transform(index, fn)(*args, **kwargs)


@contextlib.contextmanager
def layer_transforms(transform: LayerTransform | None) -> Iterator[None]:
    """Bind ``transform(index, layer_fn) -> layer_fn`` for the layers run in the ``with`` block (``None``:
    none). Bind it inside the function a parallelized step differentiates (the loss): the step binds a
    fresh layout for it."""
    with rebind(layer_transform=transform):
        yield
