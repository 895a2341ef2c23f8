"""A parallel configuration (:class:`Layout`) and the job it runs (:class:`Workload`), as the planner sees them.

A layout is the degrees of each parallelism plus the pipeline schedule and the remat kind; it maps
one to one onto a trainer ``parallel:`` section (:meth:`Layout.parallel_section`), with the mesh axes
in the order ``pp, dp, fsdp, ep, tp`` (the last axis varies fastest over ranks, so tensor and expert
parallelism stay inside a node first).

    >>> lay = Layout(ep=8)
    >>> lay.world, lay.data_shards, lay.name
    (8, 8, 'ep8 remat=none')
    >>> lay.parallel_section()
    {'mesh': {'ep': 8}, 'plan': ['ep']}
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from hpfunc.models.description import REMAT_KINDS

__all__ = ["Layout", "Workload", "LayoutError", "STATE_BYTES", "REDUCE_BYTES", "AXIS_ORDER", "PP_SCHEDULES"]

AXIS_ORDER = ("pp", "dp", "fsdp", "ep", "tp")
# schedules the planner considers (names of hpfunc.schedules.GENERATORS), and stages per rank
PP_SCHEDULES = {"1f1b": 1, "interleaved_1f1b": None, "zb_h1": 1, "zbv": 2}

# Model-state bytes per parameter: (parameter, gradient, fp32 master copy, optimizer state).
STATE_BYTES = {
    "mixed": (2, 2, 4, 8),  # bf16 parameters and gradients, fp32 master and Adam m, v: 16 bytes
    "fp32": (4, 4, 0, 8),   # fp32 everything: 16 bytes
    "bf16": (2, 2, 0, 4),   # bf16 everything, no master copy: 8 bytes
}


# Bytes per gradient element a data-parallel reduction moves: hpfunc reduces gradients in the dtype the
# parameters are stored in (fp32 under mixed precision: bf16 compute over fp32 storage), measured by
# `hpfunc dryrun` (its reduce-scatters carry fp32); bf16 storage reduces in bf16.
REDUCE_BYTES = {"mixed": 4, "fp32": 4, "bf16": 2}


class LayoutError(ValueError):
    """A layout that cannot run: degrees that do not fill the world, split the batch or the model."""


@attrs.frozen(kw_only=True)
class Workload:
    """The step: ``global_batch`` sequences of ``seq_len`` tokens, activations in ``dtype``, model
    states in ``precision`` (see :data:`STATE_BYTES`), causal attention (counted at half) through a
    flash kernel (no ``s^2`` term) unless said otherwise; ``reserve_bytes``: memory set aside for what
    is not modelled (allocator, communication buffers, runtime context)."""

    global_batch: int
    seq_len: int
    dtype: str = "bfloat16"
    precision: Literal["mixed", "fp32", "bf16"] = "mixed"
    causal: bool = True
    flash_attention: bool = True
    reserve_bytes: int = 4 * 2**30
    routing_imbalance: float = 1.0  # expert tokens on the busiest rank / the balanced count
    # The padded MoE dispatcher's fixed buffers: rows per (source, destination) = factor x the balanced
    # count, whatever the routing (overflow dropped); None: the dropless dispatcher, whose rows follow
    # the routing (routing_imbalance)
    moe_buffer_factor: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.precision not in STATE_BYTES:
            raise LayoutError(f"precision: expected one of {', '.join(STATE_BYTES)}, found {self.precision!r}")
        for key in ("global_batch", "seq_len"):
            if getattr(self, key) < 1:
                raise LayoutError(f"train.{'batch_size' if key == 'global_batch' else key}: expected >= 1, "
                                  f"found {getattr(self, key)}")

    @property
    def expert_rows_factor(self) -> float:
        """Rows the experts compute (and the all-to-alls move) per balanced row on the busiest rank: the
        padded dispatcher's buffer factor, else the routing imbalance."""
        return float(self.routing_imbalance if self.moe_buffer_factor is None else self.moe_buffer_factor)

    @property
    def act_bytes(self) -> int:
        return 4 if self.dtype in ("float32", "fp32") else 2

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@attrs.frozen(kw_only=True)
class Layout:
    """Degrees of parallelism and how the step runs.

    ``dp``: replicas (ddp, or hsdp's replicate axis when ``fsdp > 1``); ``fsdp``: the sharding axis,
    at ZeRO stage ``zero`` (3: fsdp; 1, 2: optimizer state, and gradients); ``ep``: expert parallel
    (a data axis that also shards the non-expert parameters as fsdp); ``tp``: tensor parallel
    (``sp``: with sequence parallelism); ``pp``: pipeline ranks running ``schedule`` with
    ``virtual_stages`` stages per rank; ``microbatches``: per step and data shard (the pipeline's
    microbatches, or gradient accumulation without a pipeline); ``remat``: ``none``, ``selective``
    or ``full`` for every layer (``stage_remat`` overrides it per pipeline stage); ``cp``: context
    parallel, a term for later (must be 1).
    """

    dp: int = 1
    fsdp: int = 1
    zero: int = 3
    ep: int = 1
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    remat: str = "none"
    cp: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    stage_remat: tuple[str, ...] | None = None

    def __attrs_post_init__(self) -> None:
        for key in ("dp", "fsdp", "ep", "tp", "pp", "virtual_stages", "microbatches", "cp"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"layout.{key}: expected an integer >= 1, found {v!r}")
        if self.cp != 1:
            raise LayoutError(f"layout.cp: context parallelism is not implemented in hpfunc yet; found cp={self.cp}")
        if self.zero not in (1, 2, 3):
            raise LayoutError(f"layout.zero: expected 1, 2 or 3, found {self.zero!r}")
        if self.remat not in REMAT_KINDS:
            raise LayoutError(f"layout.remat: expected one of {', '.join(REMAT_KINDS)}, found {self.remat!r}")
        if self.pp > 1 and self.schedule not in PP_SCHEDULES:
            raise LayoutError(f"layout.schedule: expected one of {', '.join(PP_SCHEDULES)}, found {self.schedule!r}")
        if self.sp and self.tp == 1:
            raise LayoutError("layout.sp: sequence parallelism needs tp > 1")

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.ep * self.tp * self.pp * self.cp

    @property
    def data_shards(self) -> int:
        """How many ways the batch is split (dp x fsdp x ep)."""
        return self.dp * self.fsdp * self.ep

    @property
    def stages_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        fixed = PP_SCHEDULES[self.schedule]
        return self.virtual_stages if fixed is None else fixed

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def mesh(self) -> dict[str, int]:
        """The mesh axes of size > 1, outermost first."""
        sizes = {"pp": self.pp, "dp": self.dp, "fsdp": self.fsdp, "ep": self.ep, "tp": self.tp}
        return {a: sizes[a] for a in AXIS_ORDER if sizes[a] > 1}

    @property
    def family(self) -> str:
        """The mesh and plan kinds without schedule details, microbatches or remat (for reports)."""
        parts = [f"{a}{s}" for a, s in self.mesh.items()]
        if self.fsdp > 1 and self.zero != 3:
            parts[list(self.mesh).index("fsdp")] = f"zero{self.zero}x{self.fsdp}"
        if self.sp:
            parts.append("sp")
        return "x".join(parts) or "single"

    @property
    def name(self) -> str:
        extra = []
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.schedule == "interleaved_1f1b" else ""
            extra.append(f"{self.schedule}{v} m{self.microbatches}")
        elif self.microbatches > 1:
            extra.append(f"accum{self.microbatches}")
        remat = f"remat={self.remat}" if self.stage_remat is None else "remat=" + "/".join(self.stage_remat)
        return " ".join([self.family, *extra, remat])

    def check(self, world: int, *, global_batch: int, layers: int, num_experts: int = 0,
              tp_divides: tuple[int, ...] = ()) -> None:
        """Raise :class:`LayoutError` naming the key when this layout cannot run ``global_batch``
        sequences of a model with ``layers`` layers and ``num_experts`` experts on ``world`` devices."""
        if self.world != world:
            raise LayoutError(f"--devices: the layout {self.name} fills {self.world} devices (pp {self.pp} x dp "
                              f"{self.dp} x fsdp {self.fsdp} x ep {self.ep} x tp {self.tp}), but {world} are given")
        if global_batch % (self.data_shards * self.microbatches):
            raise LayoutError(f"train.batch_size: {global_batch} sequences do not split into {self.data_shards} data "
                              f"shards x {self.microbatches} microbatches")
        if self.ep > 1 and (num_experts == 0 or num_experts % self.ep):
            raise LayoutError(f"parallel.mesh.ep: {self.ep} does not divide the model's {num_experts} experts")
        bad = [d for d in tp_divides if d % self.tp]
        if bad:
            raise LayoutError(f"parallel.mesh.tp: {self.tp} does not divide the model's heads/widths {bad}")
        if self.num_stages > layers:
            raise LayoutError(f"parallel.mesh.pp: {self.num_stages} stages for {layers} layers")
        if self.pp > 1 and self.schedule == "interleaved_1f1b" and self.microbatches % self.pp:
            raise LayoutError(f"parallel.plan.pp.microbatches: interleaved 1F1B needs a multiple of pp={self.pp}, "
                              f"found {self.microbatches}")

    def parallel_section(self) -> dict[str, Any]:
        """The trainer's ``parallel:`` section (``mesh`` and ``plan``) for this layout."""
        mesh = self.mesh
        plan: list[Any] = []
        for axis in mesh:
            if axis == "pp":
                opts: dict[str, Any] = {"schedule": self.schedule, "microbatches": self.microbatches}
                if self.schedule == "interleaved_1f1b":
                    opts["virtual_stages"] = self.virtual_stages
                if self.layers_per_stage is not None:
                    opts["layers_per_stage"] = list(self.layers_per_stage)
                if self.stage_remat is not None:
                    opts["remat"] = [_POLICY[r] for r in self.stage_remat]
                elif self.remat != "none":
                    opts["remat"] = _POLICY[self.remat]
                plan.append({"pp": opts})
            elif axis == "dp":
                if self.fsdp > 1:
                    continue  # hsdp below takes both axes
                plan.append("ddp")
            elif axis == "fsdp":
                kind = {3: "fsdp", 2: "zero2", 1: "zero1"}[self.zero]
                plan.append({"hsdp": {"axes": ["dp", "fsdp"]}} if self.dp > 1 else kind)
            elif axis == "ep":
                plan.append("ep")
            elif axis == "tp":
                plan.append({"tp": {"sequence_parallel": True}} if self.sp else "tp")
        return {"mesh": mesh, "plan": plan} if mesh else {}


# remat kinds -> hpfunc's policy names (what plans.pp's remat= and the trainer's YAML accept)
_POLICY = {"none": None, "selective": "dots_with_no_batch_dims_saveable", "full": "nothing_saveable"}
