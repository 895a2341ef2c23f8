"""Between the trainer's YAML config and the planner: the workload and layout a config asks for, and
the config a chosen layout becomes.

    >>> from hpfunc.train.config import load_config_dict
    >>> cfg = load_config_dict({"model": {"preset": "qwen3-moe-tiny"}, "train": {"batch_size": 8},
    ...                         "parallel": {"mesh": {"fsdp": 2, "tp": 2}, "plan": ["fsdp", "tp"]}})
    >>> layout_of(cfg).name
    'fsdp2xtp2 remat=none'
    >>> with_layout({"train": {"batch_size": 8}}, Layout(fsdp=2, microbatches=2))["parallel"]
    {'mesh': {'fsdp': 2}, 'plan': ['fsdp']}
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from hpfunc.autoparallel.configuration import Layout, Workload
from hpfunc.models.description import ModelDescription

__all__ = ["workload_of", "precision_of", "compute_dtype", "layout_of", "with_layout", "describe_model", "check_runnable"]

_REMAT_OF_POLICY = {None: "none", "none": "none", "nothing_saveable": "full",
                    "dots_with_no_batch_dims_saveable": "selective", "everything_saveable": "none"}


def describe_model(cfg: Any) -> tuple[Any, ModelDescription]:
    """The model config of the trainer config ``cfg`` (its own builder) and its cost-model description."""
    from hpfunc.models.qwen3.describe import describe
    from hpfunc.train.build import build_model_config

    model_cfg = build_model_config(cfg.model)
    return model_cfg, describe(model_cfg, act_bytes=4 if compute_dtype(cfg) in ("float32", "float64") else 2)


def compute_dtype(cfg: Any) -> str:
    """The dtype the step computes in, as ``hpfunc train`` runs ``cfg``: ``precision.compute_dtype``, else
    ``model.dtype`` (the parameters' own)."""
    return cfg.precision.compute_dtype or cfg.model.dtype


def precision_of(cfg: Any) -> str:
    """The model-state precision of the cost model (:data:`~hpfunc.autoparallel.configuration.STATE_BYTES`)
    that ``hpfunc train`` runs for ``cfg``: ``mixed`` for 16-bit compute over 32-bit parameters
    (``model.dtype: float32`` with ``precision.compute_dtype: bfloat16``: fp32 master weights, gradients
    and moments), ``bf16`` for 16-bit parameters (``model.dtype: bfloat16``: everything in bf16), else
    ``fp32``.

    >>> from hpfunc.train.config import load_config_dict
    >>> [precision_of(load_config_dict(d)) for d in ({"model": {"dtype": "bfloat16"}},
    ...     {"model": {"dtype": "float32"}, "precision": {"compute_dtype": "bfloat16"}}, {})]
    ['bf16', 'mixed', 'fp32']
    """
    store = cfg.model.dtype
    if store in ("bfloat16", "float16"):
        return "bf16"
    return "mixed" if compute_dtype(cfg) in ("bfloat16", "float16") else "fp32"


def workload_of(cfg: Any, *, precision: str | None = None, reserve_bytes: int | None = None) -> Workload:
    """The step of ``cfg``: ``train.batch_size`` sequences of ``train.seq_len`` tokens computed in
    :func:`compute_dtype`, model states in :func:`precision_of` (as ``hpfunc train`` runs the config's
    ``model.dtype`` and ``precision:``) unless ``precision`` says."""
    dtype = compute_dtype(cfg)
    prec = precision or precision_of(cfg)
    extra: dict[str, Any] = {} if reserve_bytes is None else {"reserve_bytes": int(reserve_bytes)}
    from hpfunc.train.build import build_model_config

    model_cfg = build_model_config(cfg.model)
    if getattr(model_cfg, "moe_dispatcher", None) == "padded":  # fixed capacity buffers (see Workload)
        extra["moe_buffer_factor"] = float(model_cfg.moe_buffer_factor)
    return Workload(global_batch=cfg.train.batch_size, seq_len=cfg.train.seq_len, dtype=dtype, precision=prec,
                    **extra)


def layout_of(cfg: Any) -> Layout:
    """The layout of ``cfg.parallel`` (and ``train.microbatches``) in the planner's terms."""
    pc = cfg.parallel
    f: dict[str, Any] = {"microbatches": cfg.train.microbatches}
    for e in pc.plan:
        size = [pc.mesh[a] for a in e.axes]
        o = e.options
        if e.kind == "ddp":
            f["dp"] = size[0]
        elif e.kind in ("fsdp", "zero3", "zero2", "zero1"):
            f["fsdp"], f["zero"] = size[0], {"zero1": 1, "zero2": 2}.get(e.kind, 3)
        elif e.kind == "hsdp":
            f["dp"], f["fsdp"] = size
        elif e.kind == "ep":
            f["ep"] = size[0]
        elif e.kind == "tp":
            f["tp"], f["sp"] = size[0], bool(o.get("sequence_parallel")) and size[0] > 1
        elif e.kind == "pp":
            sched = "interleaved_1f1b" if o["schedule"] == "interleaved" else o["schedule"]
            f.update(pp=size[0], schedule=sched, microbatches=o["microbatches"],
                     virtual_stages=o["virtual_stages"] or (2 if sched == "interleaved_1f1b" else 1))
            if o["layers_per_stage"]:
                f["layers_per_stage"] = tuple(o["layers_per_stage"])
            r = o["remat"]
            if isinstance(r, (list, tuple)):
                f["stage_remat"] = tuple(_REMAT_OF_POLICY.get(x, "none") for x in r)
            else:
                f["remat"] = _REMAT_OF_POLICY.get(r, "none")
    return Layout(**f)


def with_layout(data: Mapping[str, Any], layout: Layout) -> dict[str, Any]:
    """A copy of the raw config mapping ``data`` running ``layout``: its ``parallel:`` section replaced
    and ``train.microbatches`` set (the gradient accumulation; 1 under a pipeline, which cuts the
    batch itself)."""
    out = copy.deepcopy(dict(data))
    section = layout.parallel_section()
    old = dict(out.get("parallel") or {})
    for key in ("mesh", "plan"):
        old.pop(key, None)
    out["parallel"] = {**section, **old} if section else (old or None)
    train = dict(out.get("train") or {})
    train["microbatches"] = 1 if layout.pp > 1 else layout.microbatches
    out["train"] = train
    return out


def check_runnable(data: Mapping[str, Any]) -> Any:
    """Check ``data`` with the trainer's own loader and plan check (no rank started); returns the config."""
    from hpfunc.train.build import check_buildable
    from hpfunc.train.config import load_config_dict

    cfg = load_config_dict(data)
    check_buildable(cfg)
    return cfg
