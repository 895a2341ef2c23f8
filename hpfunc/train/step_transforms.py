"""What the ``precision:`` and ``activations:`` sections do to the train step, for every plan.

* ``precision:`` is the plan's mixed precision (:meth:`hpfunc.transforms.plans.Plan.with_mixed_precision`:
  parameters cast to ``compute_dtype`` for use, before the FSDP all-gather; gradients reduced in
  ``reduce_dtype``; the parameters, their gradients and the optimizer state stay in ``model.dtype``).
  Without a mesh there is no plan: the loss reads the parameters cast to ``compute_dtype``, the same
  cast (the gradient comes back in the parameters' dtype through the cast's backward).
* ``activations:`` wraps each layer of the model, as the model runs it through
  :func:`hpfunc.layout.run_layer`, in :func:`~hpfunc.transforms.remat.remat` and / or
  :func:`~hpfunc.transforms.offload.offload` by its policy (``offload(remat(layer))`` when both: the
  recomputed region's inputs go to host memory). The loss binds the transform
  (:func:`hpfunc.layout.layer_transforms`) inside the differentiated function, so it is the same under
  every plan: fsdp, tp, ep, hsdp, ddp, pp (each stage runs its layers through the same seam).

Example:
    >>> from hpfunc.train.config import load_config_dict
    >>> cfg = load_config_dict({"activations": {"remat": {1: "nothing_saveable"}, "offload": "dots"}})
    >>> t = layer_transform(cfg.activations)
    >>> def layer(x):
    ...     return x
    >>> t(0, layer).__name__, t(1, layer).__name__  # every layer offloaded, layer 1 recomputed too
    ('layer', 'layer')
    >>> layer_transform(load_config_dict({}).activations) is None
    True
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from hpfunc import layout
from hpfunc import tree as _tree
from hpfunc.train.config import ActivationsConfig, Config, ConfigError, PrecisionConfig
from hpfunc.train.config.grammars import check_layer_policies, layer_policy

__all__ = ["layer_transform", "train_loss", "with_precision", "check_step_transforms", "policy_names", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _remat_policy(name: str) -> Any:
    from hpfunc.transforms import policies

    return getattr(policies, name)


def _offload_policy(name: str) -> Any:
    from hpfunc.transforms import policies

    return policies.offload_everything if name == "everything" else policies.offload_dots()


def layer_transform(ac: ActivationsConfig) -> layout.LayerTransform | None:
    """``(index, layer_fn) -> layer_fn`` for :func:`hpfunc.layout.layer_transforms`: the layer wrapped as
    ``activations.remat`` / ``activations.offload`` say for its index; ``None`` when neither is set."""
    if ac.remat is None and ac.offload is None:
        return None
    from hpfunc.transforms.offload import offload
    from hpfunc.transforms.remat import remat

    wrapped: dict[tuple[int, Callable], Callable] = {}  # one wrapper per layer and function, built once

    def transform(index: int, fn: Callable) -> Callable:
        key = (index, fn)
        out = wrapped.get(key)
        if out is None:
            out = fn
            r, o = layer_policy(ac.remat, index), layer_policy(ac.offload, index)
            if r is not None:
                out = remat(out, policy=_remat_policy(r))
            if o is not None:
                out = offload(out, policy=_offload_policy(o))
            wrapped[key] = out
        return out

    return transform


def _with_layers(loss_fn: Callable, transform: layout.LayerTransform, model: str) -> Callable:
    """``loss_fn`` with ``transform`` bound for its layers; a model that runs none of its layers through
    :func:`hpfunc.layout.run_layer` is a config error (the policies would silently do nothing)."""
    seen: list[int] = []

    def counting(index: int, fn: Callable) -> Callable:
        seen.append(index)
        return transform(index, fn)

    @functools.wraps(loss_fn)
    def loss(params: Any, batch: Any, cfg: Any) -> Any:
        seen.clear()
        with layout.layer_transforms(counting):
            out = loss_fn(params, batch, cfg)
        if not seen:
            raise ConfigError(f"activations: the model {model!r} runs no layer through hpfunc.layout.run_layer, so "
                              f"per-layer remat / offload policies cannot reach it; remove the activations: section, "
                              f"or call layout.run_layer(i, layer_fn, ...) in the model's layer loop")
        return out

    return loss


def _cast_params(loss_fn: Callable, dtype: torch.dtype) -> Callable:
    """``loss_fn`` reading its floating parameters cast to ``dtype`` (mixed precision on one device)."""

    @functools.wraps(loss_fn)
    def loss(params: Any, batch: Any, cfg: Any) -> Any:
        cast = _tree.tree_map(lambda p: p.to(dtype) if isinstance(p, torch.Tensor) and p.is_floating_point() else p,
                              params)
        return loss_fn(cast, batch, cfg)

    return loss


def train_loss(cfg: Config, spec: Any, *, on_mesh: bool) -> Callable:
    """The loss the train step differentiates: the model's (``spec.step_loss()`` on a mesh, ``spec.loss``
    on one device with its compiled regions under ``train.compile``; on a mesh the step is compiled,
    ``hpfunc.parallelize(..., compile=...)``, and binds the regions) with the ``activations:`` policies
    bound for its layers and, on one device, the ``precision.compute_dtype`` cast (on a mesh the plan
    casts: :func:`with_precision`)."""
    loss_fn = spec.step_loss() if on_mesh else spec.loss
    if not on_mesh:
        loss_fn = spec.compiled_loss(loss_fn, cfg.train.compile)  # train.compile: the model's regions compiled
    transform = layer_transform(cfg.activations)
    if transform is not None:
        loss_fn = _with_layers(loss_fn, transform, spec.name)
    if not on_mesh and cfg.precision.compute_dtype is not None:
        loss_fn = _cast_params(loss_fn, DTYPES[cfg.precision.compute_dtype])
    return loss_fn


def with_precision(plan: Any, pc: PrecisionConfig) -> Any:
    """``plan`` with ``precision:`` applied (unchanged when both dtypes are null)."""
    if pc.compute_dtype is None and pc.reduce_dtype is None:
        return plan
    return plan.with_mixed_precision(None if pc.compute_dtype is None else DTYPES[pc.compute_dtype],
                                     None if pc.reduce_dtype is None else DTYPES[pc.reduce_dtype])


def check_step_transforms(cfg: Config, model_cfg: Any, spec: Any) -> None:
    """Raise :class:`ConfigError` naming the key when ``precision:`` or ``activations:`` does not fit the run:
    a layer index outside the model, a per-layer list of the wrong length, ``precision.reduce_dtype``
    without a mesh (nothing is reduced). (``activations.remat`` with a ``pp`` entry is checked with the
    pipeline, by :func:`hpfunc.train.distributed.check_parallel`.)"""
    ac, pc = cfg.activations, cfg.precision
    if pc.reduce_dtype is not None and cfg.parallel.size == 1:
        raise ConfigError(f"precision.reduce_dtype: {pc.reduce_dtype} on a single device, where no gradient is "
                          f"reduced; remove it, or give a parallel: mesh and plan")
    n = spec.num_layers(model_cfg)
    if n is not None:
        where = f"model.{spec.layers_field}"
        check_layer_policies(ac.remat, "activations.remat", n, where)
        check_layer_policies(ac.offload, "activations.offload", n, where)


def policy_names(value: Any) -> set[str]:
    """The policy names a per-layer key uses."""
    if isinstance(value, tuple):
        return {v for v in value if v is not None}
    if isinstance(value, dict):
        return {v for v in value.values() if v is not None}
    return set() if value is None else {value}
