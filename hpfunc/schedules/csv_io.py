"""Read and write schedules in the CSV format of ``torch.distributed.pipelining``.

One row per rank (row ``r`` is rank ``r``), one cell per action, each cell an action string
``<stage><KIND><microbatch>``: ``0F0``, ``1I2``, ``2W1``, ``3B0``, ``0SEND_F0``, ``1RECV_B3``,
``0UNSHARD``, ``0RESHARD``, ``0REDUCE_GRAD``. Empty cells (torch's idle steps) are skipped.

torch and hpfunc spell the backward kinds differently:

=================  =========  ===========
meaning            hpfunc     torch
=================  =========  ===========
input grad (dx)    ``B``      ``I``
weight grad (dw)   ``W``      ``W``
full backward      ``BW``     ``B``
=================  =========  ===========

torch's fused ``(0F3;3B1)OVERLAP_F_B`` cells are read as their sub-actions in order. hpfunc's
``SWAP_OUT``/``SWAP_IN`` have no torch equivalent; they are written in hpfunc spelling
(``0SWAP_OUT1``), which torch cannot read (``write_csv(..., torch_compatible=True)`` refuses them).

Example:
    >>> import io
    >>> from hpfunc.schedules import one_f_one_b, read_csv, write_csv
    >>> buf = io.StringIO()
    >>> write_csv(one_f_one_b(2, 2), buf)
    >>> buf.getvalue().splitlines()
    ['0F0,0F1,0B0,0B1', '1F0,1B0,1F1,1B1']
    >>> read_csv(io.StringIO(buf.getvalue())) == one_f_one_b(2, 2)
    True
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any, Union

from .ir import Action, ActionKind, Schedule, SWAP_KINDS
from .validate import _expected_peer

__all__ = [
    "action_to_torch_str",
    "action_from_torch_str",
    "write_csv",
    "read_csv",
    "to_torch_pipeline_order",
    "from_torch_pipeline_order",
]

K = ActionKind
PathOrFile = Union[str, os.PathLike, IO[str]]

_TO_TORCH = {K.B: "I", K.BW: "B"}
_FROM_TORCH = {"I": K.B, "B": K.BW}
_TORCH_KINDS = ["REDUCE_GRAD", "UNSHARD", "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
                "SWAP_OUT", "SWAP_IN", "F", "I", "B", "W"]
_TORCH_RE = re.compile(rf"^(\d+)({'|'.join(_TORCH_KINDS)})(\d*)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def action_to_torch_str(action: Action) -> str:
    """The torch spelling of ``action`` (``B`` -> ``I``, ``BW`` -> ``B``).

    Example:
        >>> action_to_torch_str(Action("BW", 1, 2)), action_to_torch_str(Action("B", 1, 2))
        ('1B2', '1I2')
    """
    kind = _TO_TORCH.get(action.kind, action.kind.value)
    mb = "" if action.microbatch is None else str(action.microbatch)
    return f"{action.stage}{kind}{mb}"


def action_from_torch_str(text: str) -> list[Action]:
    """Parse one torch action string into hpfunc actions (empty for an empty cell; several for
    an ``OVERLAP_F_B`` cell). Peers are left unset.

    Example:
        >>> action_from_torch_str("2I0"), action_from_torch_str("(0F3;3B1)OVERLAP_F_B")
        ([Action('2B0')], [Action('0F3'), Action('3BW1')])
    """
    text = text.strip()
    if not text or text == "None":
        return []
    overlap = _OVERLAP_RE.match(text)
    if overlap:
        return [a for part in overlap.group(1).split(";") for a in action_from_torch_str(part)]
    match = _TORCH_RE.match(text)
    if match is None:
        raise ValueError(
            f"cannot parse torch action string {text!r}; expected '<stage><KIND><microbatch>' with KIND one of "
            f"{', '.join(_TORCH_KINDS)} (e.g. '0F0', '1I2', '0SEND_F1', '0UNSHARD')"
        )
    stage, kind, mb = match.groups()
    return [Action(_FROM_TORCH.get(kind, kind), int(stage), int(mb) if mb else None)]


def _rows(schedule: Schedule, torch_compatible: bool) -> list[list[str]]:
    ranks = schedule.ranks
    if ranks != tuple(range(len(ranks))):
        raise ValueError(f"CSV rows are ranks 0..n-1; this schedule has ranks {ranks}")
    rows = []
    for r in ranks:
        row = []
        for step, a in enumerate(schedule.actions[r]):
            if torch_compatible and a.kind in SWAP_KINDS:
                raise ValueError(
                    f"rank {r} step {step}: {a} has no torch spelling; pass torch_compatible=False to write it "
                    "in hpfunc spelling"
                )
            row.append(action_to_torch_str(a))
        rows.append(row)
    return rows


def write_csv(schedule: Schedule, file: PathOrFile, *, torch_compatible: bool = False) -> None:
    """Write ``schedule`` as torch-format CSV to a path or an open text file.

    Placement and microbatch count are not stored (torch infers them); :func:`read_csv` infers them
    the same way or takes them as arguments.
    """
    rows = _rows(schedule, torch_compatible)
    if isinstance(file, (str, os.PathLike)):
        with open(file, "w", newline="") as f:
            csv.writer(f).writerows(rows)
    else:
        csv.writer(file).writerows(rows)


def _infer_placement(actions: Mapping[int, Sequence[Action]]) -> tuple[int, ...]:
    owner: dict[int, tuple[int, int]] = {}
    for rank, row in actions.items():
        for step, a in enumerate(row):
            if a.stage in owner and owner[a.stage][0] != rank:
                r0, s0 = owner[a.stage]
                raise ValueError(
                    f"rank {rank} step {step}: {a} puts stage {a.stage} on rank {rank}, but rank {r0} step {s0} "
                    f"already acts on it; pass stage_to_rank explicitly if this is intended"
                )
            owner.setdefault(a.stage, (rank, step))
    if not owner:
        raise ValueError("the CSV holds no actions; cannot infer the stage placement")
    missing = [s for s in range(max(owner) + 1) if s not in owner]
    if missing:
        raise ValueError(f"no rank acts on stage(s) {missing}; pass stage_to_rank explicitly")
    return tuple(owner[s][0] for s in range(len(owner)))


def _build(actions: dict[int, list[Action]], stage_to_rank: Sequence[int] | None,
           num_microbatches: int | None, name: str, stage_layers: Sequence[int] | None) -> Schedule:
    placement = tuple(stage_to_rank) if stage_to_rank is not None else _infer_placement(actions)
    if num_microbatches is None:
        mbs = [a.microbatch for row in actions.values() for a in row if a.microbatch is not None]
        if not mbs:
            raise ValueError("the CSV holds no microbatch actions; pass num_microbatches explicitly")
        num_microbatches = max(mbs) + 1
    for rank in set(placement):
        actions.setdefault(rank, [])
    bare = Schedule(actions, placement, num_microbatches, name=name, stage_layers=stage_layers)
    filled = {}
    for rank, row in bare.actions.items():
        out = []
        for a in row:
            if a.is_comm and a.peer is None and a.stage < bare.num_stages:
                peer = _expected_peer(bare, a)
                a = a.replace(peer=peer) if peer is not None else a
            out.append(a)
        filled[rank] = out
    return bare.replace(actions=filled)


def read_csv(
    file: PathOrFile,
    *,
    stage_to_rank: Sequence[int] | None = None,
    num_microbatches: int | None = None,
    stage_layers: Sequence[int] | None = None,
    name: str = "",
) -> Schedule:
    """Read a torch-format CSV (one row per rank) into a :class:`Schedule`.

    ``stage_to_rank`` defaults to the rank whose row acts on each stage; ``num_microbatches`` to one
    more than the largest microbatch index. Send/recv peers are filled in from the placement. The
    result is not validated; call :func:`hpfunc.schedules.validate`.
    """
    if isinstance(file, (str, os.PathLike)):
        with open(file, newline="") as f:
            text = f.read()
    else:
        text = file.read()
    actions: dict[int, list[Action]] = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        parsed = []
        for col, cell in enumerate(row):
            try:
                parsed.extend(action_from_torch_str(cell))
            except ValueError as err:
                raise ValueError(f"CSV row {rank} (rank {rank}) column {col}: {err}") from None
        actions[rank] = parsed
    return _build(actions, stage_to_rank, num_microbatches, name, stage_layers)


def to_torch_pipeline_order(schedule: Schedule) -> dict[int, list[Any]]:
    """The schedule as torch's ``pipeline_order``: ``{rank: [torch _Action, ...]}``.

    Uses torch's own ``_Action.from_str`` on each action string (private torch API).
    """
    from torch.distributed.pipelining.schedules import _Action

    return {r: [_Action.from_str(s) for s in row] for r, row in enumerate(_rows(schedule, True))}


def from_torch_pipeline_order(
    order: Mapping[int, Iterable[Any]],
    *,
    stage_to_rank: Sequence[int] | None = None,
    num_microbatches: int | None = None,
    name: str = "",
) -> Schedule:
    """Read torch's ``pipeline_order`` (``{rank: [_Action or None]}``) into a :class:`Schedule`.

    Each torch action is read through its string form, so ``None`` (an idle step) is skipped and
    ``OVERLAP_F_B`` is expanded.
    """
    actions = {}
    for rank, row in order.items():
        parsed = []
        for step, a in enumerate(row):
            try:
                parsed.extend(action_from_torch_str("" if a is None else str(a)))
            except ValueError as err:
                raise ValueError(f"pipeline_order rank {rank} step {step}: {err}") from None
        actions[int(rank)] = parsed
    return _build(actions, stage_to_rank, num_microbatches, name, None)
