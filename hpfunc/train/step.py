"""A pure training step: ``train_step(state, batch) -> (new_state, metrics)``.

``make_train_step`` builds it from a model loss and an optimizer. Parameters that are not trained
by gradient (the MoE expert bias, selected by a path predicate) are kept out of the gradient and
the optimizer and updated by their own rule after the step (for the expert bias the sign rule
``bias += rate * sign(mean(load) - load)``). Nothing is mutated: the step returns a new state, and
the same inputs always give the same outputs.

Example (a toy "model" whose loss is a quadratic; ``aux`` holds what the metrics report):
    >>> import torch
    >>> from hpfunc import optim
    >>> def loss(params, batch, cfg):
    ...     l = ((params["w"] - batch["tokens"].float().mean()) ** 2).sum()
    ...     return l, {"ce_loss": l, "aux_loss": torch.zeros(())}
    >>> tx = optim.adamw(0.1, weight_decay=0.0)
    >>> step = make_train_step(None, tx, loss_fn=loss)
    >>> state = init_train_state({"w": torch.zeros(2)}, tx)
    >>> state, metrics = step(state, {"tokens": torch.ones(1, 4, dtype=torch.int64)})
    >>> int(state.step), round(float(metrics["loss"]), 3)
    (1, 2.0)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import attrs
import torch

from hpfunc import tree as _tree
from hpfunc.autodiff import value_and_grad
from hpfunc.train.precision_probe import SQ, record_local_loss

__all__ = [
    "TrainState",
    "split_params",
    "merge_params",
    "init_train_state",
    "make_train_step",
    "make_grad_check_step",
    "make_eval_step",
]

LossFn = Callable[[Any, Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, Mapping[str, Any]]]


class TrainState(NamedTuple):
    """Everything a step reads and writes: all params (trained and not), optimizer state, step count.

    ``opt_state`` covers only the trained params (the tree with ``None`` at the non-trained leaves).
    """

    params: Any
    opt_state: Any
    step: torch.Tensor


def _never(path: str) -> bool:
    del path
    return False


def split_params(params: Any, is_frozen: Callable[[str], bool]) -> tuple[Any, Any]:
    """``(trained, frozen)``: two trees shaped like ``params`` with ``None`` at the other's leaves.

    >>> t, f = split_params({"w": 1, "moe": {"expert_bias": 2}}, lambda p: p.endswith("expert_bias"))
    >>> t, f
    ({'w': 1, 'moe': {'expert_bias': None}}, {'w': None, 'moe': {'expert_bias': 2}})
    """
    trained = _tree.map_with_path(lambda p, x: None if is_frozen(p) else x, params)
    frozen = _tree.map_with_path(lambda p, x: x if is_frozen(p) else None, params)
    return trained, frozen


def merge_params(trained: Any, frozen: Any) -> Any:
    """Inverse of :func:`split_params`: take each leaf from whichever tree holds it (``trained`` itself
    when ``frozen`` holds none, the common case of a model without frozen leaves)."""
    if not _tree.leaves(frozen):
        return trained
    return _tree.tree_map(lambda a, b: a if b is None else b, trained, frozen, none_is_leaf=True)


def init_train_state(
    params: Any, optimizer: Any, *, is_frozen: Callable[[str], bool] | None = None, step: int = 0
) -> TrainState:
    """The state before the first step: ``optimizer.init`` over the trained params only.

    ``is_frozen`` defaults to the expert-bias predicate of ``hpfunc.models`` (when importable).

    >>> from hpfunc import optim
    >>> params = {"w": torch.ones(2), "moe": {"expert_bias": torch.zeros(4)}}
    >>> state = init_train_state(params, optim.adamw(1e-3))
    >>> from hpfunc import tree
    >>> int(state.step), any(x.shape == (4,) for x in tree.leaves(state.opt_state))  # no moments for the bias
    (0, False)
    """
    is_frozen = _default_is_frozen() if is_frozen is None else is_frozen
    trained, _ = split_params(params, is_frozen)
    return TrainState(params=params, opt_state=optimizer.init(trained), step=torch.tensor(step, dtype=torch.int64))


def _default_is_frozen() -> Callable[[str], bool]:
    try:
        from hpfunc.models.moe import is_expert_bias
    except ImportError:  # a model without MoE building blocks: everything trains
        return _never
    return is_expert_bias


def _default_update_frozen() -> Callable[[Any, torch.Tensor, float], Any] | None:
    try:
        from hpfunc.models.moe import update_expert_bias
    except ImportError:
        return None
    return update_expert_bias


def _default_loss() -> LossFn:
    from hpfunc.models import registry

    return registry.resolve(None, preset=registry.DEFAULT_PRESET).loss


def make_train_step(
    model_cfg: Any,
    optimizer: Any,
    *,
    aux_loss_coef: float | None = None,
    expert_bias_rate: float = 0.0,
    lr_schedule: Callable[[int], float] | None = None,
    loss_fn: LossFn | None = None,
    is_frozen: Callable[[str], bool] | None = None,
    update_frozen: Callable[[Any, torch.Tensor, float], Any] | None = None,
    num_microbatches: int = 1,
    monitor: Any = None,
) -> Callable[[TrainState, Mapping[str, torch.Tensor]], tuple[TrainState, dict[str, torch.Tensor]]]:
    """Build ``train_step(state, batch) -> (state, metrics)`` for a model and an optimizer.

    The objective is the model's loss (for an MoE model, e.g. ``ce + router_aux_loss_coef * aux_loss``).
    Gradients flow to every parameter except those
    ``is_frozen(path)`` selects; after the optimizer update those are replaced by
    ``update_frozen(params, aux["expert_load"], expert_bias_rate)`` (skipped when the rate is 0 or
    the loss reports no expert load).

    Args:
      model_cfg: passed as the third argument of ``loss_fn`` (the model config).
      optimizer: a ``GradientTransformation`` (``hpfunc.optim``) over the trained params.
      aux_loss_coef: weight of the router load-balancing loss in the objective: replaces
        ``model_cfg.router_aux_loss_coef`` when given (``None`` keeps the model's).
      expert_bias_rate: step size of the expert-bias sign rule.
      lr_schedule: ``step -> learning rate``, only reported in the metrics.
      loss_fn: ``(params, batch, model_cfg) -> (loss, aux)``; defaults to the loss of the registered model of
        the default preset (:mod:`hpfunc.models.registry`).
      is_frozen: path predicate of the non-gradient leaves; defaults to ``is_expert_bias``.
      update_frozen: their update rule; defaults to ``update_expert_bias``.
      num_microbatches: gradient accumulation: the batch is split along dimension 0 into this many
        equal micro-batches, one forward and backward each, values and gradients averaged
        (:func:`hpfunc.microbatch`; under ``hpfunc.parallelize`` the gradients are reduced once).
      monitor: a :class:`~hpfunc.train.precision_probe.PrecisionProbe`: its steps also return per-leaf
        squared norms of the gradient, the parameter and the update and the per-rank local losses, in
        one reduction (the ``precision_monitor`` callback reads them); ``None``: never.

    Returns:
      A pure function. ``metrics`` holds 0-d tensors ``loss`` (the objective), ``ce_loss``,
      ``aux_loss``, ``grad_norm`` (before clipping), ``lr`` and, for MoE models, ``expert_load``
      (``[n_moe_layers, E]`` token counts of this batch) and, when the model's dispatcher can drop
      pairs, ``dropped_pairs`` (``[n_moe_layers]``).
    """
    from hpfunc import layout
    from hpfunc.optim import global_norm, schedules, update_and_apply

    is_frozen = _default_is_frozen() if is_frozen is None else is_frozen
    update_frozen = _default_update_frozen() if update_frozen is None else update_frozen
    expert_bias_rate = float(expert_bias_rate)
    grad_fn = _grad_fn(model_cfg, aux_loss_coef, loss_fn, num_microbatches)

    frozen_masks: dict = {}  # parameter tree structure -> is_frozen of each leaf (paths are per structure)

    def split(params: Any) -> tuple[Any, Any]:
        """:func:`split_params` with the predicate evaluated once per tree structure, not per leaf and step
        (and ``(params, None)`` when no leaf is frozen: nothing to split or merge)."""
        leaves, treedef = _tree.flatten(params)
        mask = frozen_masks.get(treedef)
        if mask is None:
            mask = frozen_masks[treedef] = [bool(is_frozen(path)) for path, _ in _tree.leaves_with_paths(params)]
        if not any(mask):
            return params, None
        return (_tree.unflatten(treedef, [None if f else x for x, f in zip(leaves, mask)]),
                _tree.unflatten(treedef, [x if f else None for x, f in zip(leaves, mask)]))

    def train_step(state: TrainState, batch: Mapping[str, torch.Tensor]) -> tuple[TrainState, dict[str, torch.Tensor]]:
        trained, frozen = split(state.params)
        measured = None
        if monitor is not None and monitor.due(state.step):  # a logging step of the precision monitor
            with monitor.recording() as losses:
                (loss, aux), grads = grad_fn(trained, frozen, batch)
            before = monitor.snapshot(trained)  # a copy when the update may write into these blocks
            new_trained, opt_state = update_and_apply(optimizer, grads, state.opt_state, trained,
                                                      donate=layout.donated())
            measured = monitor.measure(grads, before, new_trained, losses)
        else:
            (loss, aux), grads = grad_fn(trained, frozen, batch)
            new_trained, opt_state = update_and_apply(optimizer, grads, state.opt_state, trained,
                                                      donate=layout.donated())
        params = merge_params(new_trained, frozen)
        load = aux.get("expert_load")
        if load is not None and expert_bias_rate != 0.0 and update_frozen is not None:
            params = update_frozen(params, load, expert_bias_rate)
        metrics = {
            "loss": loss,
            "ce_loss": torch.as_tensor(aux.get("ce_loss", loss)).detach(),
            "aux_loss": torch.as_tensor(aux.get("aux_loss", 0.0)).detach(),
            # on a measured step from its table's reduction (the same value): one collective, not two
            "grad_norm": (global_norm(grads).detach() if measured is None
                          else measured[SQ][0].sum().sqrt().to(torch.float32)),
            # a step held on a GPU is read there (the schedule's table: no host sync, docs/gpu.md)
            "lr": (torch.tensor(float("nan"), dtype=torch.float64, device=state.step.device) if lr_schedule is None
                   else schedules.value_at(lr_schedule, state.step)),
        }
        if load is not None:
            metrics["expert_load"] = load.detach()
        if aux.get("dropped_pairs") is not None:  # a capacity or a padded buffer: pairs no expert computed
            metrics["dropped_pairs"] = aux["dropped_pairs"].detach()
        if measured is not None:
            metrics.update(measured)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    return train_step


def _grad_fn(model_cfg: Any, aux_loss_coef: float | None, loss_fn: LossFn | None, num_microbatches: int) -> Callable:
    """``grad_fn(trained, frozen, batch) -> ((loss, aux), grads)``: the objective of the train step and
    its gradient with respect to the trained params (accumulated over ``num_microbatches``)."""
    loss_fn = _default_loss() if loss_fn is None else loss_fn
    if aux_loss_coef is not None and model_cfg is not None and attrs.has(type(model_cfg)):
        model_cfg = attrs.evolve(model_cfg, router_aux_loss_coef=float(aux_loss_coef))

    def objective(trained: Any, frozen: Any, batch: Mapping[str, torch.Tensor]):
        loss, aux = loss_fn(merge_params(trained, frozen), batch, model_cfg)
        record_local_loss(loss)  # this rank's loss on its shard, kept on the precision monitor's steps
        return loss, dict(aux)

    grad_fn = value_and_grad(objective, has_aux=True)
    if num_microbatches != 1:
        from hpfunc.microbatch import microbatch

        grad_fn = microbatch(grad_fn, num_microbatches, argnums=2)
    return grad_fn


def make_state_eval_step(
    model_cfg: Any, *, loss_fn: LossFn | None = None
) -> Callable[[TrainState, Mapping[str, torch.Tensor]], tuple[TrainState, dict[str, torch.Tensor]]]:
    """``eval_step(state, batch) -> (state, {"ce_loss": loss})``: :func:`make_eval_step` as a step over the
    train state, for :func:`hpfunc.parallelize`: the loss through :func:`hpfunc.value`, so the
    parameters are gathered on use (a layer at a time under FSDP: no rank holds a full copy), nothing is
    kept for a backward, and the loss is the mean over the data shards. The state comes back unchanged.

    >>> loss_fn = lambda params, batch, cfg: (params["w"].sum(), {"ce_loss": params["w"].sum()})
    >>> _, out = make_state_eval_step(None, loss_fn=loss_fn)(TrainState({"w": torch.ones(3)}, None, torch.tensor(0)), {})
    >>> float(out["ce_loss"])
    3.0
    """
    from hpfunc.autodiff import value

    loss_fn = _default_loss() if loss_fn is None else loss_fn

    def ce(params: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss, aux = loss_fn(params, batch, model_cfg)
        return torch.as_tensor(dict(aux).get("ce_loss", loss))

    def eval_step(state: TrainState, batch: Mapping[str, torch.Tensor]) -> tuple[TrainState, dict[str, torch.Tensor]]:
        return state, {"ce_loss": value(ce)(state.params, batch)}

    return eval_step


def make_grad_check_step(
    model_cfg: Any,
    *,
    aux_loss_coef: float | None = None,
    loss_fn: LossFn | None = None,
    is_frozen: Callable[[str], bool] | None = None,
    num_microbatches: int = 1,
) -> Callable[[TrainState, Mapping[str, torch.Tensor]], tuple[TrainState, dict[str, torch.Tensor]]]:
    """Build ``check_step(state, batch) -> (state, {"nonfinite": counts})``: the train step's gradient
    (same objective and options as :func:`make_train_step`), not applied, reduced to the number of
    non-finite values of each parameter's gradient.

    ``counts`` is an int64 vector with one entry per leaf of ``state.params`` (the ``None`` positions a
    pipeline rank does not hold included, in :func:`hpfunc.tree.leaves` order with ``None`` as a
    leaf; a frozen leaf counts 0). Under :func:`hpfunc.parallelize` every rank counts in its blocks
    and one ``psum`` over the mesh adds them up, so the vector is the same on every rank (a value
    replicated on ``k`` ranks counts ``k`` times: a count above 0 is what it tells). The trainer runs
    it only after a step came out non-finite, to name the parameter.

    >>> def loss(params, batch, cfg):
    ...     return (params["a"] * batch["x"]).sum() + params["b"].sum(), {}
    >>> check = make_grad_check_step(None, loss_fn=loss)
    >>> params = {"a": torch.ones(2), "b": torch.ones(3)}
    >>> _, out = check(TrainState(params, None, torch.tensor(0)), {"x": torch.tensor([1.0, float("nan")])})
    >>> out["nonfinite"].tolist()
    [1, 0]
    """
    from hpfunc import layout, lax

    is_frozen = _default_is_frozen() if is_frozen is None else is_frozen
    grad_fn = _grad_fn(model_cfg, aux_loss_coef, loss_fn, num_microbatches)

    def check_step(state: TrainState, batch: Mapping[str, torch.Tensor]) -> tuple[TrainState, dict[str, torch.Tensor]]:
        trained, frozen = split_params(state.params, is_frozen)
        _, grads = grad_fn(trained, frozen, batch)
        counts = [torch.zeros((), dtype=torch.int64) if g is None else (~torch.isfinite(g.detach())).sum()
                  for g in _tree.leaves(grads, none_is_leaf=True)]
        counts = torch.stack(counts) if counts else torch.zeros(0, dtype=torch.int64)
        ctx = layout.current()
        if ctx is not None:  # each rank counted in its blocks: the sum over the mesh covers every block
            axes = tuple(a for a in ctx.mesh.axis_names if ctx.mesh.axis_size(a) > 1)
            counts = lax.psum(counts, axes) if axes else counts
        return state, {"nonfinite": counts}

    return check_step


def make_eval_step(
    model_cfg: Any, *, loss_fn: LossFn | None = None
) -> Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor]:
    """``eval_step(params, batch) -> ce_loss`` (no gradient).

    >>> loss_fn = lambda params, batch, cfg: (params["w"].sum(), {"ce_loss": params["w"].sum()})
    >>> float(make_eval_step(None, loss_fn=loss_fn)({"w": torch.ones(3)}, {}))
    3.0
    """
    loss_fn = _default_loss() if loss_fn is None else loss_fn

    def eval_step(params: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            loss, aux = loss_fn(params, batch, model_cfg)
        return torch.as_tensor(dict(aux).get("ce_loss", loss)).detach()

    return eval_step
