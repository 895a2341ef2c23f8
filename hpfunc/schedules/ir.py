"""The schedule IR: :class:`Action`, :class:`Schedule` and stage placements.

A pipeline schedule is data: for every rank, the ordered list of actions it executes. An executor
walks one rank's list from the front; every action carries what it needs to run without looking
elsewhere: its kind, the stage it acts on, the microbatch, and for communication the peer rank.

Kinds (hpfunc names; the torch CSV names differ for two of them, see :mod:`.csv_io`):

============  ===================================================================
``F``         forward of ``stage`` on ``microbatch``
``B``         input-gradient backward (dx); keeps what ``W`` needs
``W``         weight-gradient backward (dw); needs the ``B`` of the same stage/microbatch
``BW``        full backward (``B`` then ``W`` in one action)
``SEND_F``    send the activations ``stage`` produced to the rank of ``stage + 1``
``RECV_F``    receive the input activations of ``stage`` from the rank of ``stage - 1``
``SEND_B``    send the input gradient ``stage`` produced to the rank of ``stage - 1``
``RECV_B``    receive the output gradient of ``stage`` from the rank of ``stage + 1``
``UNSHARD``   FSDP: all-gather the parameters of ``stage`` (no microbatch)
``RESHARD``   FSDP: free the gathered parameters of ``stage`` (no microbatch)
``REDUCE_GRAD`` FSDP: reduce-scatter the gradients of ``stage`` (no microbatch)
``SWAP_OUT``  move the saved activations of ``(stage, microbatch)`` to host memory
``SWAP_IN``   bring them back before the backward needs them
============  ===================================================================

Example:
    >>> from hpfunc.schedules.ir import Action, Schedule
    >>> a = Action("F", stage=0, microbatch=1)
    >>> str(a), a.is_compute
    ('0F1', True)
    >>> s = Schedule({0: [Action("F", 0, 0), Action("BW", 0, 0)]}, stage_to_rank=(0,), num_microbatches=1)
    >>> s.num_stages, s.num_ranks
    (1, 1)
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence

import attrs

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "loop_placement",
    "v_placement",
    "COMPUTE_KINDS",
    "COMM_KINDS",
]


class ActionKind(str, enum.Enum):
    """What an :class:`Action` does. The value is the short name used in action strings."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    SWAP_OUT = "SWAP_OUT"
    SWAP_IN = "SWAP_IN"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
FSDP_KINDS = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})
SWAP_KINDS = frozenset({ActionKind.SWAP_OUT, ActionKind.SWAP_IN})
# Kinds that act on a whole stage, not on one microbatch.
STAGE_KINDS = FSDP_KINDS
BACKWARD_KINDS = frozenset({ActionKind.B, ActionKind.BW})

# Longest names first so that "BW" is not read as "B" followed by garbage.
_KIND_ALTERNATION = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KIND_ALTERNATION})(\d*)(?:@r(\d+))?$")


def _to_kind(kind: ActionKind | str) -> ActionKind:
    if isinstance(kind, ActionKind):
        return kind
    try:
        return ActionKind(kind)
    except ValueError:
        names = ", ".join(k.value for k in ActionKind)
        raise ValueError(f"unknown action kind {kind!r}; expected one of {names}") from None


def _check_index(name: str, value: int | None, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Action.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"Action.{name} must be >= 0, got {value}")


@attrs.frozen(repr=False, order=False)
class Action:
    """One step of one rank: ``kind`` applied to ``stage`` and ``microbatch``.

    ``microbatch`` is ``None`` exactly for the whole-stage FSDP kinds (``UNSHARD``, ``RESHARD``,
    ``REDUCE_GRAD``). ``peer`` is the other rank of a send/recv (``None`` for everything else; a
    schedule fills it in from its placement, see :func:`hpfunc.schedules.insert_comms`).

    Example:
        >>> Action("BW", 2, 3)
        Action('2BW3')
        >>> Action.parse("1SEND_F0@r2").peer
        2
    """

    kind: ActionKind = attrs.field(converter=_to_kind)
    stage: int = attrs.field()
    microbatch: int | None = attrs.field(default=None)
    peer: int | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        _check_index("stage", self.stage, optional=False)
        if self.kind in STAGE_KINDS:
            if self.microbatch is not None:
                raise ValueError(
                    f"{self.kind} acts on a whole stage and takes no microbatch; got microbatch={self.microbatch}"
                )
        else:
            if self.microbatch is None:
                raise ValueError(f"{self.kind} needs a microbatch index (stage {self.stage}); got None")
            _check_index("microbatch", self.microbatch, optional=False)
        if self.peer is not None:
            if self.kind not in COMM_KINDS:
                raise ValueError(f"only send/recv actions have a peer; {self.kind} got peer={self.peer}")
            _check_index("peer", self.peer, optional=False)

    # -- classification -------------------------------------------------------------------------
    @property
    def is_compute(self) -> bool:
        """``F``, ``B``, ``W`` or ``BW``."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """A point-to-point send or receive."""
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self.kind in (ActionKind.RECV_F, ActionKind.RECV_B)

    def replace(self, **changes: object) -> Action:
        """A copy with some fields changed, e.g. ``a.replace(peer=1)``."""
        return attrs.evolve(self, **changes)

    # -- text -----------------------------------------------------------------------------------
    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f"@r{self.peer}"
        return f"Action('{self}{peer}')"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``'<stage><KIND><microbatch>'`` with an optional ``'@r<peer>'`` suffix.

        This is the hpfunc spelling (``B`` = input grad, ``BW`` = full backward); for torch's
        spelling use :func:`hpfunc.schedules.csv_io.action_from_torch_str`.

        Example:
            >>> Action.parse("3W12")
            Action('3W12')
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected '<stage><KIND><microbatch>' such as '0F1', "
                f"'2BW0', '1SEND_F3' or '0UNSHARD'"
            )
        stage, kind, mb, peer = match.groups()
        return cls(
            kind,
            int(stage),
            int(mb) if mb else None,
            peer=int(peer) if peer is not None else None,
        )


def loop_placement(num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % num_ranks`` (GPipe, 1F1B, interleaved 1F1B).

    Example:
        >>> loop_placement(2, 2)
        (0, 1, 0, 1)
    """
    _require_int("num_ranks", num_ranks, minimum=1)
    _require_int("stages_per_rank", stages_per_rank, minimum=1)
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2p - 1 - r`` (ZBV, DualPipeV).

    Example:
        >>> v_placement(3)
        (0, 1, 2, 2, 1, 0)
    """
    _require_int("num_ranks", num_ranks, minimum=1)
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _freeze_actions(actions: Mapping[int, Iterable[Action]]) -> dict[int, tuple[Action, ...]]:
    if not isinstance(actions, Mapping):
        raise TypeError(f"Schedule.actions must be a mapping rank -> list of Action, got {type(actions).__name__}")
    frozen: dict[int, tuple[Action, ...]] = {}
    for rank in sorted(actions):
        _require_int("rank", rank, minimum=0)
        row = tuple(actions[rank])
        for step, action in enumerate(row):
            if not isinstance(action, Action):
                raise TypeError(
                    f"rank {rank} step {step}: expected an Action, got {type(action).__name__} {action!r}"
                )
        frozen[rank] = row
    return frozen


def _freeze_layers(value: Sequence[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    layers = tuple(value)
    for stage, n in enumerate(layers):
        _require_int(f"stage_layers[{stage}]", n, minimum=1)
    return layers


@attrs.frozen(repr=False, eq=True)
class Schedule:
    """A whole pipeline schedule: ``{rank: (Action, ...)}`` plus its placement.

    Attributes:
        actions: rank -> the actions that rank executes, in order. Every rank of the placement
            has an entry (possibly empty).
        stage_to_rank: ``stage_to_rank[s]`` is the rank holding stage ``s``; its length is the
            number of stages.
        num_microbatches: microbatches per step.
        stage_layers: optional number of model layers (embedding and head counted as layers) in
            each stage, e.g. from :func:`hpfunc.schedules.balance_layers`; stages may differ.
        name: free-form label (the generator's name).

    Example:
        >>> from hpfunc.schedules import one_f_one_b
        >>> s = one_f_one_b(2, 2)
        >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
        1f1b  p=2 m=2 stages=2
        step  rank 0  rank 1
           0  0F0     1F0
           1  0F1     1BW0
           2  0BW0    1F1
           3  0BW1    1BW1
    """

    actions: Mapping[int, tuple[Action, ...]] = attrs.field(converter=_freeze_actions)
    stage_to_rank: tuple[int, ...] = attrs.field(converter=tuple)
    num_microbatches: int = attrs.field()
    stage_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_freeze_layers, kw_only=True)
    name: str = attrs.field(default="", kw_only=True, eq=False)

    def __attrs_post_init__(self) -> None:
        _require_int("num_microbatches", self.num_microbatches, minimum=1)
        if not self.stage_to_rank:
            raise ValueError("stage_to_rank is empty; a schedule needs at least one stage")
        for stage, rank in enumerate(self.stage_to_rank):
            _require_int(f"stage_to_rank[{stage}]", rank, minimum=0)
        ranks = set(self.stage_to_rank)
        unknown = sorted(set(self.actions) - ranks)
        if unknown:
            raise ValueError(
                f"actions given for rank(s) {unknown} that hold no stage; stage_to_rank={self.stage_to_rank}"
            )
        missing = sorted(ranks - set(self.actions))
        if missing:
            # Every rank that holds a stage gets a (possibly empty) list, so executors can index.
            full = dict(self.actions)
            for rank in missing:
                full[rank] = ()
            object.__setattr__(self, "actions", _freeze_actions(full))
        if self.stage_layers is not None and len(self.stage_layers) != len(self.stage_to_rank):
            raise ValueError(
                f"stage_layers has {len(self.stage_layers)} entries but there are "
                f"{len(self.stage_to_rank)} stages"
            )

    @classmethod
    def from_strings(
        cls,
        rows: Mapping[int, Iterable[str]],
        stage_to_rank: Sequence[int],
        num_microbatches: int,
        **kwargs: object,
    ) -> Schedule:
        """Build a schedule from hpfunc action strings (see :meth:`Action.parse`).

        Example:
            >>> s = Schedule.from_strings({0: ["0F0", "0BW0"]}, (0,), 1)
            >>> s[0]
            (Action('0F0'), Action('0BW0'))
        """
        actions = {}
        for rank, row in rows.items():
            parsed = []
            for step, text in enumerate(row):
                try:
                    parsed.append(Action.parse(text))
                except ValueError as err:
                    raise ValueError(f"rank {rank} step {step}: {err}") from None
            actions[rank] = parsed
        return cls(actions, stage_to_rank, num_microbatches, **kwargs)  # type: ignore[arg-type]

    # -- shape ----------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.actions))

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages placed on ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range; the schedule has {self.num_stages} stages")
        return self.stage_to_rank[stage]

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    @property
    def has_comms(self) -> bool:
        """True when send/recv actions are present (after :func:`insert_comms`)."""
        return any(a.is_comm for row in self.actions.values() for a in row)

    def replace(self, **changes: object) -> Schedule:
        """A copy with some fields changed, e.g. ``s.replace(actions=new_actions)``."""
        return attrs.evolve(self, **changes)

    # -- text -----------------------------------------------------------------------------------
    def format(self, *, max_steps: int | None = None) -> str:
        """The per-rank grid (one column per rank, one row per step) as text."""
        ranks = self.ranks
        rows = [[str(a) for a in self.actions[r]] for r in ranks]
        steps = max((len(r) for r in rows), default=0)
        if max_steps is not None:
            steps = min(steps, max_steps)
        widths = [max([len(f"rank {r}")] + [len(x) for x in row]) for r, row in zip(ranks, rows)]
        step_w = max(4, len(str(max(steps - 1, 0))))
        header = f"{self.name or 'schedule'}  p={self.num_ranks} m={self.num_microbatches} stages={self.num_stages}"
        lines = [header, "step".rjust(step_w) + "  " + "  ".join(f"rank {r}".ljust(w) for r, w in zip(ranks, widths))]
        for i in range(steps):
            cells = [(row[i] if i < len(row) else "").ljust(w) for row, w in zip(rows, widths)]
            lines.append(str(i).rjust(step_w) + "  " + "  ".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        n = sum(len(r) for r in self.actions.values())
        return (
            f"Schedule(name={self.name!r}, ranks={self.num_ranks}, stages={self.num_stages}, "
            f"microbatches={self.num_microbatches}, actions={n})"
        )
