"""Prove a schedule runs: every dependency satisfied, every piece of work done once, no deadlock.

The rules (``S`` stages, ``m`` microbatches, ``r(s)`` the rank of stage ``s``):

* Placement: an action on stage ``s`` sits in the list of rank ``r(s)``; ``0 <= microbatch < m``.
* Work: for every stage and microbatch exactly one ``F`` and either one ``BW`` or one ``B`` and one
  ``W``. Nothing twice.
* Data: ``F(s, i)`` needs ``F(s-1, i)``; ``B``/``BW(s, i)`` needs ``F(s, i)`` and the backward of
  ``(s+1, i)``; ``W(s, i)`` comes after ``B(s, i)``. Same-rank dependencies must come earlier in
  the list. Across ranks, a compute-only schedule waits on the producing compute action directly;
  once communication is present (:func:`insert_comms`), the consumer must be preceded by the
  matching ``RECV`` on its own rank, which waits for the producer's ``SEND``.
* Communication: every ``SEND`` has exactly one matching ``RECV`` on the peer and vice versa;
  sends come after the compute that produced the data; peers agree with the placement.
* FSDP: a stage that is ever unsharded is unsharded whenever it computes; ``UNSHARD``/``RESHARD``
  alternate; ``REDUCE_GRAD`` comes once, after every weight gradient of the stage, and (once any
  stage has one) on every FSDP stage.
* Swap: ``SWAP_OUT(s, i)`` between ``F(s, i)`` and its backward, ``SWAP_IN`` after it and before the
  backward.
* No deadlock: the ranks are played forward, each running its list in order, a send completing
  at once (asynchronous, like ``isend``; or, with ``blocking_sends=True``, only when its receive is
  reached too) and a receive or a cross-rank compute dependency blocking until its producer has
  run. If no rank can move, the cycle of waits is reported.

Every failure is a :class:`ScheduleError` naming the rank, the step index and the action.

Example:
    >>> from hpfunc.schedules import one_f_one_b, validate, ScheduleError
    >>> s = one_f_one_b(2, 2)
    >>> validate(s) is s
    True
    >>> broken = s.replace(actions={0: s[0][:-1], 1: s[1]})  # drop rank 0's last backward
    >>> try:
    ...     validate(broken)
    ... except ScheduleError as e:
    ...     print(e.rank, e.action)
    0 0BW1
"""

from __future__ import annotations

from collections.abc import Iterator

from .ir import Action, ActionKind, Schedule

__all__ = ["ScheduleError", "validate", "dependencies", "execution_order", "expected_peer"]

K = ActionKind
Pos = tuple[int, int]  # (rank, step)


class ScheduleError(ValueError):
    """A schedule breaks a rule. ``rank``, ``step`` and ``action`` say where (any may be None)."""

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None, action: Action | None = None):
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if step is not None:
            where.append(f"step {step}")
        if action is not None:
            where.append(f"action {action}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.rank = rank
        self.step = step
        self.action = action


def _expected_peer(schedule: Schedule, a: Action) -> int | None:
    """The peer rank a send/recv must name, or None when the transfer makes no sense."""
    s, last = a.stage, schedule.num_stages - 1
    other = {K.SEND_F: s + 1, K.RECV_F: s - 1, K.SEND_B: s - 1, K.RECV_B: s + 1}[a.kind]
    if not 0 <= other <= last:
        return None
    return schedule.stage_to_rank[other]


def expected_peer(schedule: Schedule, action: Action) -> int:
    """The rank at the other end of send/recv ``action`` under the schedule's placement.

    Example:
        >>> from hpfunc.schedules import one_f_one_b, Action
        >>> expected_peer(one_f_one_b(2, 1), Action("SEND_F", 0, 0))
        1
    """
    peer = _expected_peer(schedule, action)
    if peer is None:
        raise ValueError(f"{action} has no peer: stage {action.stage} has no neighbour in that direction")
    return peer


def _iter(schedule: Schedule) -> Iterator[tuple[int, int, Action]]:
    for rank in schedule.ranks:
        for step, a in enumerate(schedule.actions[rank]):
            yield rank, step, a


def dependencies(schedule: Schedule) -> dict[Pos, list[Pos]]:
    """Check every static rule and return, for each ``(rank, step)``, the positions it waits on.

    The returned graph includes the edge from the previous step of the same rank. It is what
    :func:`execution_order` and :func:`hpfunc.schedules.simulate` walk.

    Raises:
        ScheduleError: the first broken rule, naming rank, step and action.
    """
    S, m = schedule.num_stages, schedule.num_microbatches
    comms = schedule.has_comms
    where: dict[tuple[ActionKind, int, int | None], Pos] = {}
    backward_at: dict[tuple[int, int], Pos] = {}  # (stage, mb) -> position of its B or BW
    weight_at: dict[tuple[int, int], Pos] = {}  # (stage, mb) -> position of its W or BW
    fsdp_stages = {a.stage for _, _, a in _iter(schedule) if a.kind in (K.UNSHARD, K.RESHARD)}

    # Pass 1: placement, ranges, duplicates, peers; index every action by what it is.
    for rank, step, a in _iter(schedule):
        def err(msg: str) -> ScheduleError:
            return ScheduleError(msg, rank=rank, step=step, action=a)

        if a.stage >= S:
            raise err(f"stage {a.stage} out of range; the schedule has {S} stages")
        owner = schedule.stage_to_rank[a.stage]
        if owner != rank:
            raise err(f"stage {a.stage} is placed on rank {owner}, not rank {rank}")
        if a.microbatch is not None and a.microbatch >= m:
            raise err(f"microbatch {a.microbatch} out of range; the schedule has {m} microbatches")
        if a.is_comm:
            peer = _expected_peer(schedule, a)
            if peer is None:
                raise err(f"stage {a.stage} has no neighbour to {'send to' if a.is_send else 'receive from'}")
            if peer == rank:
                raise err(f"the neighbouring stage is on the same rank {rank}; no send/recv is needed")
            if a.peer is not None and a.peer != peer:
                raise err(f"peer is rank {a.peer} but the placement puts the other end on rank {peer}")
        key = (a.kind, a.stage, a.microbatch)
        if a.kind in (K.UNSHARD, K.RESHARD):
            continue  # repeated on purpose; checked in pass 2
        if key in where:
            r0, s0 = where[key]
            raise err(f"duplicate: the same action already appears at rank {r0} step {s0}")
        where[key] = (rank, step)
        if a.kind in (K.B, K.BW):
            sm = (a.stage, a.microbatch)
            if sm in backward_at:
                r0, s0 = backward_at[sm]
                raise err(f"stage {a.stage} microbatch {a.microbatch} already has a backward at rank {r0} step {s0}")
            backward_at[sm] = (rank, step)
        if a.kind in (K.W, K.BW):
            sm = (a.stage, a.microbatch)
            if sm in weight_at:
                r0, s0 = weight_at[sm]
                raise err(
                    f"stage {a.stage} microbatch {a.microbatch} already has a weight gradient at rank {r0} step {s0}"
                )
            weight_at[sm] = (rank, step)

    def pos_of(kind: ActionKind, stage: int, mb: int | None) -> Pos | None:
        return where.get((kind, stage, mb))

    deps: dict[Pos, list[Pos]] = {}

    # Pass 2: per rank, in order: same-rank order, cross-rank edges, FSDP and swap state.
    for rank in schedule.ranks:
        row = schedule.actions[rank]
        unsharded: set[int] = set()
        reduced: set[int] = set()
        swapped: set[tuple[int, int]] = set()
        weights_done: dict[int, int] = {}
        for step, a in enumerate(row):
            def err(msg: str) -> ScheduleError:
                return ScheduleError(msg, rank=rank, step=step, action=a)

            def need_here(kind: ActionKind, stage: int, mb: int | None, what: str) -> Pos:
                p = pos_of(kind, stage, mb)
                if p is None or p[0] != rank:
                    raise err(f"needs {what} ({stage}{kind.value}{'' if mb is None else mb}) earlier on rank {rank}, "
                              "but it is missing")
                if p[1] > step:
                    raise err(f"needs {what} ({stage}{kind.value}{'' if mb is None else mb}), which comes later, "
                              f"at step {p[1]}")
                return p

            def need_backward_here(stage: int, mb: int, what: str) -> Pos:
                p = backward_at.get((stage, mb))
                if p is None or p[0] != rank:
                    raise err(f"needs {what} (B or BW of stage {stage} microbatch {mb}) earlier on rank {rank}, "
                              "but it is missing")
                if p[1] > step:
                    raise err(f"needs {what} (B or BW of stage {stage} microbatch {mb}), which comes later, "
                              f"at step {p[1]}")
                return p

            d: list[Pos] = [(rank, step - 1)] if step else []
            s, i = a.stage, a.microbatch
            if a.is_compute and s in fsdp_stages and s not in unsharded:
                raise err(f"stage {s} is sharded here (FSDP); an UNSHARD of stage {s} must come first")
            if a.kind is K.F:
                if s > 0:
                    prev_rank = schedule.stage_to_rank[s - 1]
                    if prev_rank == rank:
                        need_here(K.F, s - 1, i, "the forward of the previous stage")
                    elif comms:
                        need_here(K.RECV_F, s, i, "the received activations")
                    else:
                        p = pos_of(K.F, s - 1, i)
                        if p is None:
                            raise err(f"needs the forward {s - 1}F{i} on rank {prev_rank}, which is missing")
                        d.append(p)
            elif a.kind in (K.B, K.BW):
                need_here(K.F, s, i, "its forward")
                if (s, i) in swapped:
                    raise err(f"the activations of stage {s} microbatch {i} are swapped out; SWAP_IN first")
                if s < S - 1:
                    next_rank = schedule.stage_to_rank[s + 1]
                    if next_rank == rank:
                        need_backward_here(s + 1, i, "the backward of the next stage")
                    elif comms:
                        need_here(K.RECV_B, s, i, "the received gradient")
                    else:
                        p = backward_at.get((s + 1, i))
                        if p is None:
                            raise err(f"needs the backward of stage {s + 1} microbatch {i} on rank {next_rank}, "
                                      "which is missing")
                        d.append(p)
            elif a.kind is K.W:
                need_here(K.B, s, i, "its input-gradient backward")
            elif a.kind is K.SEND_F:
                need_here(K.F, s, i, "the forward that produces the activations")
                if pos_of(K.RECV_F, s + 1, i) is None:
                    raise err(f"no matching {s + 1}RECV_F{i} on rank {schedule.stage_to_rank[s + 1]}")
            elif a.kind is K.SEND_B:
                need_backward_here(s, i, "the backward that produces the gradient")
                if pos_of(K.RECV_B, s - 1, i) is None:
                    raise err(f"no matching {s - 1}RECV_B{i} on rank {schedule.stage_to_rank[s - 1]}")
            elif a.kind is K.RECV_F:
                p = pos_of(K.SEND_F, s - 1, i)
                if p is None:
                    raise err(f"waits for {s - 1}SEND_F{i} from rank {schedule.stage_to_rank[s - 1]}, "
                              "which never sends it (recv without send)")
                d.append(p)
            elif a.kind is K.RECV_B:
                p = pos_of(K.SEND_B, s + 1, i)
                if p is None:
                    raise err(f"waits for {s + 1}SEND_B{i} from rank {schedule.stage_to_rank[s + 1]}, "
                              "which never sends it (recv without send)")
                d.append(p)
            elif a.kind is K.UNSHARD:
                if s in unsharded:
                    raise err(f"stage {s} is already unsharded")
                unsharded.add(s)
            elif a.kind is K.RESHARD:
                if s not in unsharded:
                    raise err(f"stage {s} is not unsharded; RESHARD needs an UNSHARD before it")
                unsharded.discard(s)
            elif a.kind is K.REDUCE_GRAD:
                if weights_done.get(s, 0) != m:
                    raise err(f"only {weights_done.get(s, 0)} of {m} weight gradients of stage {s} are done; "
                              "REDUCE_GRAD must follow all of them")
                reduced.add(s)
            elif a.kind is K.SWAP_OUT:
                need_here(K.F, s, i, "its forward")
                bp = backward_at.get((s, i))
                if bp is not None and bp[0] == rank and bp[1] < step:
                    raise err(f"the backward of stage {s} microbatch {i} already ran (step {bp[1]}); nothing to swap out")
                swapped.add((s, i))
            elif a.kind is K.SWAP_IN:
                if (s, i) not in swapped:
                    raise err(f"stage {s} microbatch {i} is not swapped out; SWAP_IN needs a SWAP_OUT before it")
                swapped.discard((s, i))
            if a.kind in (K.W, K.BW):
                if s in reduced:
                    raise err(f"stage {s} already reduced its gradients (REDUCE_GRAD); weight gradients after it are lost")
                weights_done[s] = weights_done.get(s, 0) + 1
            deps[(rank, step)] = d
        if swapped:
            s, i = sorted(swapped)[0]
            raise ScheduleError(f"stage {s} microbatch {i} is swapped out and never swapped back in",
                                rank=rank, step=len(row))

    # Pass 3: completeness (exactly-once is pass 1, presence is here).
    for stage in range(S):
        rank = schedule.stage_to_rank[stage]
        end = len(schedule.actions[rank])
        for i in range(m):
            if pos_of(K.F, stage, i) is None:
                raise ScheduleError(f"stage {stage} microbatch {i} never runs its forward",
                                    rank=rank, step=end, action=Action(K.F, stage, i))
            bp = backward_at.get((stage, i))
            if bp is None:
                raise ScheduleError(f"stage {stage} microbatch {i} never runs its backward (B or BW)",
                                    rank=rank, step=end, action=Action(K.BW, stage, i))
            if (stage, i) not in weight_at:
                raise ScheduleError(
                    f"stage {stage} microbatch {i} never runs its weight gradient W (its B is at step {bp[1]})",
                    rank=rank, step=bp[1], action=Action(K.W, stage, i))
    # Once a schedule reduces gradients explicitly (FSDP lowering), every FSDP stage must.
    if any(kind is K.REDUCE_GRAD for kind, _, _ in where):
        for stage in sorted(fsdp_stages):
            if pos_of(K.REDUCE_GRAD, stage, None) is None:
                rank = schedule.stage_to_rank[stage]
                raise ScheduleError(
                    f"stage {stage} is FSDP-sharded but never reduces its gradients (REDUCE_GRAD), "
                    "while other stages do", rank=rank, step=len(schedule.actions[rank]),
                    action=Action(K.REDUCE_GRAD, stage))
    return deps


def _matching_recv(schedule: Schedule) -> dict[Pos, Pos]:
    """Position of the RECV that matches each SEND (for rendezvous semantics)."""
    recv_at = {(a.kind, a.stage, a.microbatch): (r, i) for r, i, a in _iter(schedule) if a.is_recv}
    out = {}
    for r, i, a in _iter(schedule):
        if a.kind is K.SEND_F:
            out[(r, i)] = recv_at[(K.RECV_F, a.stage + 1, a.microbatch)]
        elif a.kind is K.SEND_B:
            out[(r, i)] = recv_at[(K.RECV_B, a.stage - 1, a.microbatch)]
    return out


def execution_order(
    schedule: Schedule,
    deps: dict[Pos, list[Pos]] | None = None,
    *,
    blocking_sends: bool = False,
) -> list[Pos]:
    """Play the ranks forward and return the positions in an order they can all complete in.

    Sends complete at once (``isend`` semantics) unless ``blocking_sends``, where a send and its
    receive must meet: each waits until the other is at the head of its rank (``send``/``recv``
    semantics, as a blocking transport would have).

    Raises:
        ScheduleError: a deadlock; the message lists the cycle of waits (rank, step, action each).
    """
    if deps is None:
        deps = dependencies(schedule)
    partner = _matching_recv(schedule) if blocking_sends else {}
    head = dict.fromkeys(schedule.ranks, 0)
    length = {r: len(schedule.actions[r]) for r in schedule.ranks}
    done: set[Pos] = set()
    order: list[Pos] = []
    total = sum(length.values())

    def ready(pos: Pos, ignoring: Pos | None = None) -> bool:
        return all(p in done or p == ignoring for p in deps[pos])

    while len(order) < total:
        moved = False
        for r in schedule.ranks:
            while head[r] < length[r]:
                pos = (r, head[r])
                if pos in partner:
                    other = partner[pos]
                    if not (ready(pos) and head[other[0]] == other[1] and ready(other, ignoring=pos)):
                        break
                    done.update((pos, other))
                    order += [pos, other]
                    head[r] += 1
                    head[other[0]] += 1
                    moved = True
                    continue
                if not ready(pos):
                    break
                done.add(pos)
                order.append(pos)
                head[r] += 1
                moved = True
        if not moved:
            raise _deadlock(schedule, deps, head, length, done, partner)
    return order


def _deadlock(schedule: Schedule, deps: dict[Pos, list[Pos]], head: dict[int, int],
              length: dict[int, int], done: set[Pos], partner: dict[Pos, Pos]) -> ScheduleError:
    def waits_on(r: int) -> Pos:
        pos = (r, head[r])
        pending = [p for p in deps[pos] if p not in done]
        if pending:
            return pending[0]
        return partner[pos]  # a blocking send whose receive is not at the head of its rank

    start = next(r for r in schedule.ranks if head[r] < length[r])
    seen: list[int] = []
    r = start
    while r not in seen:
        seen.append(r)
        r = waits_on(r)[0]
    cycle = seen[seen.index(r):]
    parts = []
    for rr in cycle:
        wr, ws = waits_on(rr)
        parts.append(f"rank {rr} step {head[rr]} ({schedule.actions[rr][head[rr]]}) waits for "
                     f"{schedule.actions[wr][ws]} at rank {wr} step {ws}")
    first = cycle[0]
    return ScheduleError("deadlock (cyclic wait): " + "; ".join(parts),
                         rank=first, step=head[first], action=schedule.actions[first][head[first]])


def validate(schedule: Schedule, *, blocking_sends: bool = False) -> Schedule:
    """Check every rule in the module docstring; return the schedule unchanged if it passes.

    ``blocking_sends=True`` checks deadlock freedom for a transport whose sends block until the
    receive is posted (plain ``send``/``recv``); the default models asynchronous sends (``isend``),
    which is what :func:`insert_comms` orders for.

    Raises:
        ScheduleError: the first broken rule, naming rank, step and action.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a Schedule, got {type(schedule).__name__}")
    execution_order(schedule, dependencies(schedule), blocking_sends=blocking_sends)
    return schedule
