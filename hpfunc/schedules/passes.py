"""Passes: schedule -> schedule rewrites that lower a compute-only schedule towards execution.

* :func:`insert_comms` adds ``SEND``/``RECV`` pairs between ranks.
* :func:`split_backward` turns each ``BW`` into ``B`` + ``W``; :func:`merge_backward` does the
  reverse.
* :func:`insert_fsdp` adds ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` for PP x FSDP.
* :func:`insert_swaps` adds ``SWAP_OUT``/``SWAP_IN`` so that at most ``max_resident`` activations
  stay in device memory.

Each pass returns a new schedule and leaves its input untouched; a valid input gives a valid
output (the tests prove it with :func:`hpfunc.schedules.validate` on every generator).

Example:
    >>> from hpfunc.schedules import one_f_one_b, insert_comms, validate
    >>> s = validate(insert_comms(one_f_one_b(2, 2)))
    >>> [str(a) for a in s[1]]
    ['1RECV_F0', '1F0', '1BW0', '1SEND_B0', '1RECV_F1', '1F1', '1BW1', '1SEND_B1']
"""

from __future__ import annotations

from collections import defaultdict

from .ir import Action, ActionKind, Schedule, _require_int

__all__ = ["insert_comms", "split_backward", "merge_backward", "insert_fsdp", "insert_swaps"]

K = ActionKind


def insert_comms(schedule: Schedule) -> Schedule:
    """Add the point-to-point transfers a compute-only schedule needs.

    Each activation crossing ranks gets a ``SEND_F`` right after the forward that produced it and a
    ``RECV_F`` right before the forward that consumes it; gradients likewise with ``SEND_B`` after
    ``B``/``BW`` and ``RECV_B`` before. Stages on the same rank (the turn of a V) exchange nothing.

    Deadlock freedom: sends are asynchronous, so the only waits are receives, and each receive sits
    right before the compute that would otherwise have waited on the producer directly. The wait
    graph is the compute schedule's dependency graph with each cross-rank edge subdivided, so a
    schedule that validates before validates after.

    Raises:
        ValueError: the schedule already has send/recv actions.
    """
    if schedule.has_comms:
        raise ValueError(f"insert_comms: schedule {schedule.name!r} already has send/recv actions")
    last = schedule.num_stages - 1
    rank_of = schedule.stage_to_rank
    out = {}
    for rank, row in schedule.actions.items():
        new: list[Action] = []
        for a in row:
            s, i = a.stage, a.microbatch
            if a.kind is K.F and s > 0 and rank_of[s - 1] != rank:
                new.append(Action(K.RECV_F, s, i, peer=rank_of[s - 1]))
            if a.kind in (K.B, K.BW) and s < last and rank_of[s + 1] != rank:
                new.append(Action(K.RECV_B, s, i, peer=rank_of[s + 1]))
            new.append(a)
            if a.kind is K.F and s < last and rank_of[s + 1] != rank:
                new.append(Action(K.SEND_F, s, i, peer=rank_of[s + 1]))
            if a.kind in (K.B, K.BW) and s > 0 and rank_of[s - 1] != rank:
                new.append(Action(K.SEND_B, s, i, peer=rank_of[s - 1]))
        out[rank] = new
    return schedule.replace(actions=out)


def split_backward(schedule: Schedule) -> Schedule:
    """Replace each ``BW(s, i)`` with ``B(s, i)`` and a ``W(s, i)`` placed after it (after the
    ``SEND_B`` of its gradient, if one follows directly, so the send is not delayed).

    Example:
        >>> from hpfunc.schedules import gpipe
        >>> [str(a) for a in split_backward(gpipe(1, 1))[0]]
        ['0F0', '0B0', '0W0']
    """
    out = {}
    for rank, row in schedule.actions.items():
        new: list[Action] = []
        waiting: Action | None = None
        for a in row:
            if waiting is not None and not (a.kind is K.SEND_B and a.stage == waiting.stage
                                            and a.microbatch == waiting.microbatch):
                new.append(waiting)
                waiting = None
            if a.kind is K.BW:
                new.append(Action(K.B, a.stage, a.microbatch))
                waiting = Action(K.W, a.stage, a.microbatch)
            else:
                new.append(a)
        if waiting is not None:
            new.append(waiting)
        out[rank] = new
    return schedule.replace(actions=out)


def merge_backward(schedule: Schedule) -> Schedule:
    """Fuse each ``B(s, i)`` with its ``W(s, i)`` into one ``BW(s, i)`` at the position of the ``B``.

    Moving a ``W`` earlier never breaks a dependency (nothing but ``REDUCE_GRAD``, which stays
    after, waits on it), so a valid schedule stays valid; the zero-bubble schedules lose their
    bubble filling, of course.

    Example:
        >>> from hpfunc.schedules import zb_h1
        >>> [str(a) for a in merge_backward(zb_h1(2, 2))[1]]
        ['1F0', '1BW0', '1F1', '1BW1']
    """
    out = {}
    for rank, row in schedule.actions.items():
        has_w = {(a.stage, a.microbatch) for a in row if a.kind is K.W}
        has_b = {(a.stage, a.microbatch) for a in row if a.kind is K.B}
        pairs = has_w & has_b
        new = []
        for a in row:
            if a.kind is K.B and (a.stage, a.microbatch) in pairs:
                new.append(Action(K.BW, a.stage, a.microbatch))
            elif a.kind is K.W and (a.stage, a.microbatch) in pairs:
                continue
            else:
                new.append(a)
        out[rank] = new
    return schedule.replace(actions=out)


def insert_fsdp(schedule: Schedule, *, max_unsharded: int | None = None, prefetch: int = 0) -> Schedule:
    """Add FSDP actions for PP x FSDP: each stage's parameters are gathered (``UNSHARD``) before
    its first compute, its gradients reduce-scattered (``REDUCE_GRAD``) right after its last weight
    gradient, and its parameters freed (``RESHARD``) after its last use.

    With ``max_unsharded=k``, a rank holding several stages keeps at most ``k`` of them gathered:
    when another is needed, the gathered stage whose next use is farthest away is resharded first
    (and gathered again when next needed).

    With ``prefetch=k`` each ``UNSHARD`` moves up to ``k`` compute actions earlier (never past an
    action of its own stage or another FSDP action), so the all-gather can overlap that compute;
    up to ``k`` more stages may then be gathered at once.

    Example:
        >>> from hpfunc.schedules import gpipe
        >>> [str(a) for a in insert_fsdp(gpipe(1, 1))[0]]
        ['0UNSHARD', '0F0', '0BW0', '0REDUCE_GRAD', '0RESHARD']
    """
    if max_unsharded is not None:
        _require_int("max_unsharded", max_unsharded, minimum=1)
    _require_int("prefetch", prefetch, minimum=0)
    if any(a.kind in (K.UNSHARD, K.RESHARD, K.REDUCE_GRAD) for row in schedule.actions.values() for a in row):
        raise ValueError(f"insert_fsdp: schedule {schedule.name!r} already has FSDP actions")
    m = schedule.num_microbatches
    out = {}
    for rank, row in schedule.actions.items():
        uses: dict[int, list[int]] = defaultdict(list)
        for step, a in enumerate(row):
            if a.is_compute:
                uses[a.stage].append(step)
        last_use = {s: steps[-1] for s, steps in uses.items()}
        weights: dict[int, int] = defaultdict(int)
        gathered: list[int] = []
        new: list[Action] = []
        for step, a in enumerate(row):
            s = a.stage
            if a.is_compute and s not in gathered:
                if max_unsharded is not None and len(gathered) >= max_unsharded:
                    def next_use(stage: int) -> int:
                        return next((u for u in uses[stage] if u > step), len(row))

                    victim = max(gathered, key=next_use)
                    gathered.remove(victim)
                    new.append(Action(K.RESHARD, victim))
                new.append(Action(K.UNSHARD, s))
                gathered.append(s)
            new.append(a)
            if a.kind in (K.W, K.BW):
                weights[s] += 1
                if weights[s] == m:
                    new.append(Action(K.REDUCE_GRAD, s))
            if a.is_compute and last_use[s] == step:
                gathered.remove(s)
                new.append(Action(K.RESHARD, s))
        out[rank] = _hoist_unshards(new, prefetch) if prefetch else new
    return schedule.replace(actions=out)


def _hoist_unshards(row: list[Action], prefetch: int) -> list[Action]:
    """Move each UNSHARD up to ``prefetch`` compute actions earlier (see :func:`insert_fsdp`)."""
    row = list(row)
    for j in range(len(row)):
        a = row[j]
        if a.kind is not K.UNSHARD:
            continue
        target, computes = j, 0
        while target > 0 and computes < prefetch:
            prev = row[target - 1]
            if prev.stage == a.stage and (prev.is_compute or prev.kind in (K.RESHARD, K.REDUCE_GRAD)):
                break
            if prev.kind in (K.UNSHARD, K.RESHARD, K.REDUCE_GRAD):
                break
            target -= 1
            computes += prev.is_compute
        row.insert(target, row.pop(j))
    return row


def insert_swaps(schedule: Schedule, *, max_resident: int, prefetch: int = 1) -> Schedule:
    """Swap activations to host memory so that at most ``max_resident`` stage-microbatch
    activations stay on the device between forward and backward on each rank.

    After a forward, if more than ``max_resident`` activations are resident, the one whose backward
    comes last is swapped out (``SWAP_OUT``, right after the forward and its send). Its ``SWAP_IN``
    is placed ``prefetch`` compute actions before its backward (never before the ``SWAP_OUT``), so
    the copy can overlap the compute in between. At any moment at most ``max_resident + 1 +
    prefetch`` activations are resident (the kept ones, the one just computed until its
    ``SWAP_OUT``, and those prefetched); ``simulate(...).peak_resident`` measures it.
    :func:`~hpfunc.transforms.pipeline.pipeline_map` executes the swaps; it keeps a microbatch until
    its ``W`` (not its ``B``), which ``simulate(...).peak_resident_until_w`` counts (equal to
    ``peak_resident`` for fused ``BW`` schedules).

    Example:
        >>> from hpfunc.schedules import gpipe
        >>> [str(a) for a in insert_swaps(gpipe(1, 2), max_resident=1, prefetch=0)[0]]
        ['0F0', '0F1', '0SWAP_OUT1', '0BW0', '0SWAP_IN1', '0BW1']
    """
    _require_int("max_resident", max_resident, minimum=1)
    _require_int("prefetch", prefetch, minimum=0)
    if any(a.kind in (K.SWAP_OUT, K.SWAP_IN) for row in schedule.actions.values() for a in row):
        raise ValueError(f"insert_swaps: schedule {schedule.name!r} already has swap actions")
    out = {}
    for rank, row in schedule.actions.items():
        backward_step = {(a.stage, a.microbatch): j for j, a in enumerate(row) if a.kind in (K.B, K.BW)}
        compute_steps = [j for j, a in enumerate(row) if a.is_compute]
        resident: set[tuple[int, int]] = set()
        swap_out_after: dict[int, list[tuple[int, int]]] = defaultdict(list)  # step -> keys
        swap_in_before: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for j, a in enumerate(row):
            key = (a.stage, a.microbatch)
            if a.kind is K.F:
                resident.add(key)
                if len(resident) > max_resident:
                    victim = max(resident, key=lambda k: backward_step.get(k, len(row)))
                    resident.discard(victim)
                    # Swap out right after this forward (and its send), whichever activation it is.
                    anchor = j
                    while anchor + 1 < len(row) and row[anchor + 1].kind is K.SEND_F:
                        anchor += 1
                    swap_out_after[anchor].append(victim)
                    b = backward_step.get(victim)
                    if b is not None:
                        earlier = [c for c in compute_steps if anchor < c < b]
                        target = earlier[max(0, len(earlier) - prefetch)] if prefetch and earlier else b
                        # Keep receives that feed the backward next to it: insert before them.
                        while target - 1 > anchor and row[target - 1].is_recv:
                            target -= 1
                        swap_in_before[target].append(victim)
            elif a.kind in (K.B, K.BW):
                resident.discard(key)
        new: list[Action] = []
        for j, a in enumerate(row):
            for s, i in swap_in_before.get(j, ()):
                new.append(Action(K.SWAP_IN, s, i))
            new.append(a)
            for s, i in swap_out_after.get(j, ()):
                new.append(Action(K.SWAP_OUT, s, i))
        out[rank] = new
    return schedule.replace(actions=out)
