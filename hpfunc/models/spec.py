"""``ModelSpec``: everything the trainer needs to know about a model, in one value that lives beside it.

The trainer (:mod:`hpfunc.train`) names no model: it reaches the model's config class and presets, its
``init`` / ``loss`` / ``apply``, its parallel plan pieces (tensor-parallel table, expert stacks,
pipeline stages, optimizer routing) and its Hugging Face import through a spec found by
:func:`hpfunc.models.registry.resolve` (``model.name`` in the YAML: a registered name such as
``qwen3_moe``, or the import path ``package.module:SPEC`` of a spec of your own). Anchor: torchtitan's
``TrainSpec``.

Only ``name``, ``config_class``, ``presets``, ``preset``, ``init``, ``param_shapes``, ``loss`` and
``apply`` are required; a model without tensor, expert or pipeline parallelism leaves those pieces
``None`` and the trainer refuses such a plan entry with a config error naming it.

Example (a one-matrix "language model"):
    >>> import attrs, torch
    >>> @attrs.frozen
    ... class Cfg:
    ...     vocab_size: int = 16
    >>> def init(key, cfg, dtype=torch.float32):
    ...     return {"w": torch.zeros(cfg.vocab_size, cfg.vocab_size, dtype=dtype)}
    >>> def apply(params, tokens, cfg):
    ...     return params["w"][tokens]
    >>> def loss(params, batch, cfg):
    ...     logits = apply(params, batch["tokens"][:, :-1], cfg)
    ...     ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten())
    ...     return ce, {"ce_loss": ce}
    >>> spec = ModelSpec(name="bigram", config_class=Cfg, presets=("bigram-16",),
    ...                  preset=lambda name, **kw: Cfg(**kw), init=init, apply=apply, loss=loss,
    ...                  param_shapes=lambda cfg: {"w": torch.Size([cfg.vocab_size] * 2)})
    >>> cfg = spec.preset("bigram-16")
    >>> round(float(spec.loss(spec.init(None, cfg), {"tokens": torch.tensor([[1, 2, 3]])}, cfg)[0]), 4)
    2.7726
    >>> spec.count_params(cfg), spec.describe(cfg)
    (256, '256 params')
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import attrs
import torch

__all__ = ["ModelSpec", "HFSupport"]


def _shape_count(shapes: Any) -> int:
    from hpfunc import tree

    return sum(math.prod(s) for s in tree.leaves(shapes, is_leaf=lambda x: isinstance(x, torch.Size)))


@attrs.frozen
class HFSupport:
    """A model's Hugging Face folder support (``model.pretrained``).

    ``load_config(folder) -> cfg``; ``load_params(folder, cfg, *, dtype) -> params`` (one process);
    ``import_sharded(folder, target, cfg) -> params`` (every rank reads its blocks of ``target``'s
    layout); ``config_error``: the exception ``load_config`` raises for a config it refuses.
    """

    load_config: Callable[[str], Any]
    load_params: Callable[..., Any]
    import_sharded: Callable[[str, Any, Any], Any]
    config_error: type = ValueError


@attrs.frozen
class ModelSpec:
    """A model as the trainer sees it. See the module docstring; every callable takes the model config.

    Attributes:
      name: the registered name (``model.name``).
      config_class: an attrs class; ``model.<field>`` keys of the YAML override its fields.
      presets: the preset names ``preset`` accepts; ``preset(name, **overrides) -> cfg``.
      init: ``init(key, cfg, dtype=torch.float32) -> params``.
      param_shapes: ``cfg -> tree of torch.Size`` (the parameters as ``init`` makes them).
      loss: ``(params, batch, cfg) -> (loss, aux)`` on one device; ``aux`` may hold ``ce_loss``,
        ``aux_loss``, ``expert_load`` (``[moe_layers, E]``) and ``dropped_pairs``.
      apply: ``(params, tokens, cfg) -> logits`` (sampling).
      parallel_loss: the loss a parallelized step runs (the model reads its layout from :mod:`hpfunc.layout`);
        ``None``: ``loss`` is already parallel-aware (or the model has no tensor parallelism).
      tp_styles: ``(cfg, *, vocab_parallel, sequence_parallel) -> {pattern: Style}`` or ``None``.
      tp_divides: ``(cfg, *, vocab_parallel) -> [(field, what)]``: the config fields a tensor-parallel
        degree must divide (``("num_attention_heads", "attention heads")``).
      ep_experts: ``cfg -> (pattern, ...)``: the expert stacks an ``ep`` entry splits, or ``None``.
      pipeline_stages: ``(cfg, n, *, layers=None) -> Stages`` or ``None``.
      decay_mask / adamw_when: the optimizer routing (``None``: every leaf decays; Muon's default).
      with_aux_loss_coef: ``(cfg, coef) -> cfg`` for ``train.aux_loss_coef``, or ``None``.
      count_params / active_params: ``cfg -> int`` (default: counted from ``param_shapes``).
      describe: ``cfg -> str``: the size line the trainer prints (default: the parameter count).
      to_dict: ``cfg -> dict`` saved in checkpoints (default :func:`attrs.asdict`).
      hf: the Hugging Face folder support, or ``None``.
      config_error: the exception ``preset`` raises for a config it refuses.
      not_overridable: config fields the YAML cannot set.
      vocab_field, positions_field, layers_field, experts_field: the config fields holding the
        vocabulary size, the longest sequence (``None``: no limit), the number of layers and the number
        of experts (``None``: a dense model).
      ignore_index: the label value the loss ignores.
      compile_loss: ``(loss, regions) -> loss``: ``loss`` (``loss`` or ``parallel_loss``) running its
        compute as the compiled regions the model declares (:class:`hpfunc.regions.Regions`), or ``None``:
        the model declares none (``train.compile`` is then refused). See :meth:`compiled_loss`.
    """

    name: str
    config_class: type
    presets: tuple[str, ...]
    preset: Callable[..., Any]
    init: Callable[..., Any]
    param_shapes: Callable[[Any], Any]
    loss: Callable[..., Any]
    apply: Callable[..., Any]
    parallel_loss: Callable[..., Any] | None = None
    tp_styles: Callable[..., Mapping[str, Any]] | None = None
    tp_divides: Callable[..., list[tuple[str, str]]] | None = None
    ep_experts: Callable[[Any], tuple[str, ...]] | None = None
    pipeline_stages: Callable[..., Any] | None = None
    decay_mask: Callable[[str, torch.Tensor], bool] | None = None
    adamw_when: Callable[[str, torch.Tensor], bool] | None = None
    with_aux_loss_coef: Callable[[Any, float], Any] | None = None
    count_params_fn: Callable[[Any], int] | None = None
    active_params_fn: Callable[[Any], int] | None = None
    describe_fn: Callable[[Any], str] | None = None
    to_dict_fn: Callable[[Any], dict] | None = None
    hf: HFSupport | None = None
    config_error: type = ValueError
    not_overridable: frozenset = frozenset()
    vocab_field: str = "vocab_size"
    positions_field: str | None = None
    layers_field: str | None = None
    experts_field: str | None = None
    ignore_index: int = -100
    compile_loss: Callable[[Callable[..., Any], Any], Callable[..., Any]] | None = None

    def step_loss(self) -> Callable[..., Any]:
        """The loss a parallelized step runs (``parallel_loss``, else ``loss``)."""
        return self.loss if self.parallel_loss is None else self.parallel_loss

    def compiled_loss(self, loss: Callable[..., Any], compile: bool | str) -> Callable[..., Any]:
        """``loss`` as ``train.compile`` asks: itself for ``False``; else with the model's regions compiled
        by a new :class:`hpfunc.regions.Regions` (``True``: the ``inductor`` backend; or the backend named).

        >>> ModelSpec(name="m", config_class=object, presets=(), preset=None, init=None, param_shapes=None,
        ...           loss=None, apply=None).compiled_loss(len, "aot_eager")
        Traceback (most recent call last):
        ...
        ValueError: train.compile: the model 'm' declares no compiled regions (its ModelSpec.compile_loss is None); set train.compile: false
        """
        if not self.check_compile(compile):
            return loss
        from hpfunc.regions import Regions, backend_of

        return self.compile_loss(loss, Regions(backend_of(compile, "train.compile")))

    def check_compile(self, compile: bool | str) -> bool:
        """Whether ``train.compile`` asks for compiled regions; a ``ValueError`` when it does and the model
        declares none (its ``compile_loss`` is ``None``): a parallelized step compiled with
        ``hpfunc.parallelize(..., compile=...)`` would otherwise run such a model eagerly, silently."""
        if compile is False:
            return False
        if self.compile_loss is None:
            raise ValueError(f"train.compile: the model {self.name!r} declares no compiled regions (its "
                             f"ModelSpec.compile_loss is None); set train.compile: false")
        return True

    def count_params(self, cfg: Any) -> int:
        return self.count_params_fn(cfg) if self.count_params_fn else _shape_count(self.param_shapes(cfg))

    def active_params(self, cfg: Any) -> int:
        return self.active_params_fn(cfg) if self.active_params_fn else self.count_params(cfg)

    def describe(self, cfg: Any) -> str:
        if self.describe_fn is not None:
            return self.describe_fn(cfg)
        return f"{self.count_params(cfg):,} params"

    def to_dict(self, cfg: Any) -> dict:
        return self.to_dict_fn(cfg) if self.to_dict_fn else attrs.asdict(cfg)

    def vocab_size(self, cfg: Any) -> int:
        return int(getattr(cfg, self.vocab_field))

    def num_experts(self, cfg: Any) -> int:
        return int(getattr(cfg, self.experts_field)) if self.experts_field else 0

    def num_layers(self, cfg: Any) -> int | None:
        return int(getattr(cfg, self.layers_field)) if self.layers_field else None
