"""The ``pp`` plan layer: which pipeline stages a rank holds, and the schedule they run.

``plans.pp(axis, stages, schedule="1f1b", microbatches=m)`` (re-exported by :mod:`hpfunc.transforms.plans`)
splits the model over the mesh axis ``axis``: pipeline rank ``r`` holds the parameters of the stages the
schedule places on it (``schedule.stages_of(r)``), and the rest of the plan (fsdp, tp, ep, ...) lays out
those parameters over the other axes as without a pipeline. A parameter used by several stages (a tied
embedding) is held by every pipeline rank, and its gradient is summed over them.

The parameter tree of a pipelined state keeps the model's structure; a leaf this rank does not hold is
``None`` (:meth:`PipelineLayer.local`), so paths keep their meaning (``layers.5.attn.wq`` on the rank of
stage 1) and every tree function (optimizers, checkpoints, norms through :mod:`hpfunc.layout`) sees only
what the rank holds.

    >>> from hpfunc.models import qwen3
    >>> from hpfunc.models.qwen3 import parallel_plan
    >>> cfg = qwen3.preset("qwen3-dense-tiny")
    >>> layer = PipelineLayer("pp", parallel_plan.pipeline_stages(cfg, 2), "1f1b", 4)
    >>> s = layer.schedule(2)
    >>> s.name, s.num_stages, s.num_microbatches, layer.stages_on(s, 1)
    ('1f1b', 2, 4, (1,))
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from hpfunc import tree as _tree
from hpfunc.layout import PlanError, Stages
from hpfunc.schedules import GENERATORS, Schedule, read_csv

__all__ = ["PipelineLayer", "SCHEDULES", "build_schedule"]

# names accepted for `schedule=`: the generators, plus "interleaved" for interleaved 1F1B
SCHEDULES = tuple(GENERATORS) + ("interleaved",)
_TWO_PER_RANK = ("zbv", "dualpipev")  # V schedules: two stages on every rank
# remat policies by name (hpfunc.transforms.policies), for configs
_POLICY_NAMES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


def is_schedule_file(schedule: Any) -> bool:
    """Whether a ``schedule`` option names a CSV file (ends in ``.csv`` or holds a path separator)
    rather than a generator.

    >>> is_schedule_file("zbv"), is_schedule_file("runs/zbv.csv")
    (False, True)
    """
    return isinstance(schedule, str) and (schedule.endswith(".csv") or os.sep in schedule)


def _read_file(path: str, m: int | None) -> Schedule:
    if not os.path.exists(path):
        raise PlanError(f"pp: schedule file {path!r} does not exist")
    try:
        return read_csv(path, num_microbatches=m, name=os.path.basename(path))
    except ValueError as err:
        raise PlanError(f"pp: schedule file {path!r}: {err}") from None


def stages_per_rank(schedule: str | Schedule, virtual_stages: int | None) -> int:
    """How many stages each pipeline rank holds under a named schedule, a schedule file or a schedule."""
    if is_schedule_file(schedule):
        # a file says it itself (an interleaved or V schedule puts several stages on every rank)
        schedule = _read_file(schedule, None)
    if isinstance(schedule, Schedule):
        return schedule.num_stages // schedule.num_ranks
    if schedule in _TWO_PER_RANK:
        return 2
    if schedule in ("interleaved", "interleaved_1f1b"):
        return 2 if virtual_stages is None else int(virtual_stages)
    return 1


def build_schedule(schedule: str | Schedule, p: int, m: int, virtual_stages: int | None = None) -> Schedule:
    """A :class:`~hpfunc.schedules.Schedule` for ``p`` pipeline ranks and ``m`` microbatches from a name
    (:data:`SCHEDULES`), a CSV file in torch's format, or a schedule (checked against ``p`` and ``m``)."""
    if isinstance(schedule, Schedule) or is_schedule_file(schedule):
        s = schedule if isinstance(schedule, Schedule) else _read_file(schedule, m)
        if virtual_stages not in (None, s.num_stages // s.num_ranks):
            raise PlanError(f"pp: virtual_stages={virtual_stages} does not match the schedule {s.name!r}, which "
                            f"places {s.num_stages // s.num_ranks} stage(s) on each of its {s.num_ranks} ranks; "
                            f"leave virtual_stages out (a given schedule says it itself)")
    elif schedule in ("interleaved", "interleaved_1f1b"):
        s = GENERATORS["interleaved_1f1b"](p, m, 2 if virtual_stages is None else int(virtual_stages))
    elif schedule in GENERATORS:
        if virtual_stages not in (None, stages_per_rank(schedule, None)):
            raise PlanError(f"pp: virtual_stages={virtual_stages} applies to the interleaved schedule only; "
                            f"{schedule!r} places {stages_per_rank(schedule, None)} stage(s) per rank")
        try:
            s = GENERATORS[schedule](p, m)
        except (TypeError, ValueError) as err:
            raise PlanError(f"pp: schedule {schedule!r} with {p} pipeline ranks and {m} microbatches: {err}") from None
    else:
        raise PlanError(f"pp: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}, a CSV file in "
                        f"torch's format, or an hpfunc.schedules.Schedule")
    if s.num_ranks != p or s.ranks != tuple(range(p)):
        raise PlanError(f"pp: schedule {s.name!r} runs on {s.num_ranks} ranks {s.ranks} but the pipeline axis has "
                        f"{p}; generate it for {p} ranks or change the mesh")
    if s.num_microbatches != m:
        raise PlanError(f"pp: schedule {s.name!r} has {s.num_microbatches} microbatches, the plan says "
                        f"microbatches={m}")
    return s


@attrs.frozen(eq=False)
class PipelineLayer:
    """``pp(axis, stages, schedule, microbatches)`` of a plan (see the module docstring)."""

    axis: str
    stages: Stages
    schedule_name: Any = "1f1b"
    microbatches: int = 1
    virtual_stages: int | None = None
    remat: Any = None  # a remat policy for every stage, or {stage: policy} / one per stage (None: keep all)
    max_resident: int | None = None  # swap activations to host beyond this many stage-microbatches per rank

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.stages, Stages):
            raise PlanError(f"pp({self.axis!r}): stages must be a hpfunc.layout.Stages from the model's parallel "
                            f"plan (e.g. qwen3.parallel_plan.pipeline_stages(cfg, n)), found "
                            f"{type(self.stages).__name__}")
        if not (isinstance(self.microbatches, int) and self.microbatches >= 1):
            raise PlanError(f"pp({self.axis!r}): microbatches must be an int >= 1, found {self.microbatches!r}")

    def schedule(self, p: int) -> Schedule:
        """The schedule on a pipeline axis of size ``p``, checked against the stages."""
        s = build_schedule(self.schedule_name, p, self.microbatches, self.virtual_stages)
        if self.max_resident is not None:
            if not (isinstance(self.max_resident, int) and self.max_resident >= 1):
                raise PlanError(f"pp: max_resident must be an int >= 1 (stage-microbatches kept on the device), "
                                f"found {self.max_resident!r}")
            from hpfunc.schedules import insert_swaps

            if not any(a.kind.name.startswith("SWAP") for row in s.actions.values() for a in row):
                s = insert_swaps(s, max_resident=self.max_resident)
        if s.num_stages != self.stages.num_stages:
            raise PlanError(f"pp: schedule {s.name!r} on {p} ranks has {s.num_stages} stages but the model was split "
                            f"into {self.stages.num_stages}; build the stages with num_stages={s.num_stages} "
                            f"(pp size {p} x {s.num_stages // p} stage(s) per rank)")
        self._check_remat(s)
        return s

    def _check_remat(self, schedule: Schedule) -> None:
        """A selective remat policy allows one backward per recomputed region (torch's selective
        checkpoint): a stage whose backward the schedule splits into B and W needs full recompute."""
        from hpfunc.schedules import ActionKind

        split = {a.stage for row in schedule.actions.values() for a in row if a.kind is ActionKind.W}
        for st in range(self.stages.num_stages):
            policy = self.remat_policy(st)
            if policy is False or st not in split:
                continue
            if not (getattr(policy, "saves_nothing", False) or getattr(policy, "saves_everything", False)):
                raise PlanError(f"pp: stage {st} has the selective remat policy {policy!r} but schedule {schedule.name!r} "
                                f"splits its backward into B and W, and a selectively recomputed region allows one "
                                f"backward; use nothing_saveable for that stage, or a schedule without the split "
                                f"(gpipe, 1f1b, interleaved)")

    def remat_policy(self, stage: int) -> Any:
        """The remat policy of ``stage`` (``False``: none, its activations are kept). Policies may be
        given by name (``"nothing_saveable"``, ``"dots_saveable"``, ...: the YAML form)."""
        r = self.remat
        if isinstance(r, dict):
            r = r.get(stage)
        elif isinstance(r, (list, tuple)):
            if len(r) != self.stages.num_stages:
                raise PlanError(f"pp: remat has {len(r)} entries but the model has {self.stages.num_stages} stages; "
                                f"give one policy (or None) per stage, or a dict {{stage: policy}}")
            r = r[stage]
        if r is None or r is False or r == "none":
            return False
        if isinstance(r, str):
            from hpfunc.transforms import policies

            if r not in _POLICY_NAMES:
                raise PlanError(f"pp: unknown remat policy {r!r} for stage {stage}; use one of "
                                f"{', '.join(_POLICY_NAMES)} or none")
            return getattr(policies, r)
        return r

    @staticmethod
    def stages_on(schedule: Schedule, rank: int) -> tuple[int, ...]:
        return schedule.stages_of(rank)

    def holds(self, path: str, local_stages: tuple[int, ...]) -> bool:
        """Whether the pipeline rank holding ``local_stages`` holds the parameter at ``path``."""
        used = self.stages.stage_of(path)
        return len(used) > 1 or used[0] in local_stages

    def is_shared(self, path: str) -> bool:
        """Used by several stages: held by every pipeline rank, its gradient summed over them."""
        return len(self.stages.stage_of(path)) > 1

    def local(self, tree: Any, local_stages: tuple[int, ...]) -> Any:
        """``tree`` (shaped like the parameters) with the leaves this rank does not hold set to ``None``."""
        import torch

        return _tree.map_with_path(lambda path, x: x if self.holds(path, local_stages) else None, tree,
                                   is_leaf=lambda x: isinstance(x, torch.Size))

    def check_paths(self, paths: list[str]) -> None:
        """Every parameter path must be one of the model's (the stages were built for this model)."""
        known = set(self.stages.paths)
        extra = [p for p in paths if p not in known]
        if extra:
            raise PlanError(f"pp: parameter {extra[0]!r} is not a parameter of the model the pipeline stages were "
                            f"built for (its paths look like {list(self.stages.paths)[:3]}); build the stages "
                            f"from the same config as the parameters")
