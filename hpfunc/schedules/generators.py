"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZBV and DualPipeV.

Each generator returns a compute-only :class:`~hpfunc.schedules.ir.Schedule` (``F``, ``B``,
``W``, ``BW``); :func:`hpfunc.schedules.insert_comms` adds the sends and receives. ``p`` is the
number of pipeline ranks, ``m`` the number of microbatches.

Every generator is written out from the schedule's definition (phase by phase), so its output is
fixed data: the same for every call, and for interleaved 1F1B, ZBV and DualPipeV identical step by
step to ``torch.distributed.pipelining`` (tested). The zero-bubble family (Qi et al., ICLR 2024)
splits the backward into ``B`` (dx) and ``W`` (dw) and places the ``W`` passes where the
pipeline would otherwise idle, keeping every ``W`` close enough to its ``B`` that the activations
held between ``F`` and ``W`` stay bounded (``p`` per rank for ZB-H1, ``2p - 1`` for ZB-H2, ``2p``
stage-chunks for ZBV).

Example:
    >>> from hpfunc.schedules import gpipe, zb_h1
    >>> [str(a) for a in gpipe(2, 2)[0]]
    ['0F0', '0F1', '0BW0', '0BW1']
    >>> [str(a) for a in zb_h1(2, 2)[1]]
    ['1F0', '1B0', '1F1', '1B1', '1W0', '1W1']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .ir import Action, ActionKind, Schedule, _require_int, loop_placement, v_placement

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev", "GENERATORS"]

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def _check_pm(name: str, p: int, m: int, *, min_p: int = 1) -> None:
    try:
        _require_int("p (pipeline ranks)", p, minimum=min_p)
        _require_int("m (microbatches)", m, minimum=1)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{name}: {err}") from None


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all full backwards.

    Bubble ratio ``(p - 1) / m``; peak in-flight activations ``m`` microbatches.

    Example:
        >>> s = gpipe(4, 8)
        >>> s.num_stages, len(s[0])
        (4, 16)
    """
    _check_pm("gpipe", p, m)
    actions = {r: [Action(F, r, i) for i in range(m)] + [Action(BW, r, i) for i in range(m)] for r in range(p)}
    return Schedule(actions, loop_placement(p), m, name="gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): ``p - 1 - r`` warm-up forwards on rank ``r``, then one forward and
    one full backward alternately, then the remaining backwards.

    Bubble ratio ``(p - 1) / m``; peak in-flight ``min(p, m)`` microbatches on rank 0.

    Example:
        >>> [str(a) for a in one_f_one_b(2, 3)[0]]
        ['0F0', '0F1', '0BW0', '0F2', '0BW1', '0BW2']
    """
    _check_pm("one_f_one_b", p, m)
    actions = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [Action(F, r, warmup + i), Action(BW, r, i)]
        row += [Action(BW, r, i) for i in range(m - warmup, m)]
        actions[r] = row
    return Schedule(actions, loop_placement(p), m, name="1f1b")


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): ``v`` model chunks per rank, stage ``c * p + r``
    on rank ``r``. Microbatches go through the chunks in groups of ``p``.

    Rank ``r`` runs ``2 (p - 1 - r) + (v - 1) p`` warm-up chunk-forwards (at most ``m v``; ``v = 1``
    is plain 1F1B with ``p - 1 - r``), then
    alternates forward and full backward. Bubble ratio ``(p - 1) / (v m)``; rank 0 holds at most
    ``2 (p - 1) + (v - 1) p + 1`` chunk activations, i.e. ``p (1 + (p - 1) / (p v))`` microbatches
    of a full stage (``v`` chunks make one stage's worth), when ``m v`` exceeds the warm-up.

    Raises:
        ValueError: ``v < 1``, ``m < 1``, or ``m`` not a multiple of ``p``.

    Example:
        >>> s = interleaved_1f1b(2, 4, 2)
        >>> s.stage_to_rank
        (0, 1, 0, 1)
    """
    _check_pm("interleaved_1f1b", p, m)
    try:
        _require_int("v (chunks per rank)", v, minimum=1)
    except (TypeError, ValueError) as err:
        raise type(err)(f"interleaved_1f1b: {err}") from None
    if m % p != 0:
        raise ValueError(
            f"interleaved_1f1b: m (microbatches) must be a multiple of p={p} so microbatches move through "
            f"the chunks in whole groups of p; got m={m} (try m={-(-m // p) * p})"
        )
    total = m * v

    def which(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        microbatch = (k // (p * v)) * p + k % p
        return chunk, microbatch

    actions = {}
    for r in range(p):
        # With one chunk this is plain 1F1B; with more, the deeper warm-up keeps every chunk busy.
        warmup = min(p - 1 - r if v == 1 else 2 * (p - 1 - r) + (v - 1) * p, total)
        row = []
        for k in range(warmup):
            c, i = which(k, False)
            row.append(Action(F, c * p + r, i))
        for k in range(total - warmup):
            c, i = which(warmup + k, False)
            row.append(Action(F, c * p + r, i))
            c, i = which(k, True)
            row.append(Action(BW, c * p + r, i))
        for k in range(total - warmup, total):
            c, i = which(k, True)
            row.append(Action(BW, c * p + r, i))
        actions[r] = row
    return Schedule(actions, loop_placement(p, v), m, name=f"interleaved_1f1b(v={v})")


# -- the zero-bubble family ---------------------------------------------------------------------------


def _split_1f1b(p: int, m: int, warmup: Callable[[int], int], w_delay: Callable[[int], int], name: str) -> Schedule:
    """1F1B order with the backward split: rank ``r`` runs ``warmup(r)`` forwards, then alternates
    ``B`` and ``F``, then the remaining ``B``; the ``W`` of the ``k``-th backward follows the
    ``(k + w_delay(r))``-th backward, and the last ones close the list. The delayed ``W`` passes
    are what fill the drain; rank ``r`` holds at most ``warmup(r) + w_delay(r)`` activations.
    """
    actions = {}
    for r in range(p):
        warm = min(warmup(r), m)
        delay = w_delay(r)
        order = [Action(F, r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action(B, r, i), Action(F, r, warm + i)]
        order += [Action(B, r, i) for i in range(m - warm, m)]
        row: list[Action] = []
        backwards = weights = 0
        for a in order:
            row.append(a)
            if a.kind is B:
                backwards += 1
                if backwards - 1 - delay >= 0:
                    row.append(Action(W, r, weights))
                    weights += 1
        row += [Action(W, r, i) for i in range(weights, m)]
        actions[r] = row
    return Schedule(actions, loop_placement(p), m, name=name)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split into ``B`` (dx) and ``W`` (dw), the
    ``W`` of rank ``r`` delayed by ``r`` backwards so the ``W`` passes fill the drain.

    Activation memory as 1F1B: rank ``r`` holds at most ``p`` microbatches (``p - r`` between
    ``F`` and ``B`` plus ``r`` between ``B`` and ``W``). Idle time per rank ``(p - 1)(F + B - W)``,
    i.e. ``p - 1`` at unit costs, a third of 1F1B's.

    Example:
        >>> [str(a) for a in zb_h1(2, 3)[1]]
        ['1F0', '1B0', '1F1', '1B1', '1W0', '1F2', '1B2', '1W1', '1W2']
    """
    _check_pm("zb_h1", p, m)
    return _split_1f1b(p, m, lambda r: p - r, lambda r: r, "zb_h1")


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024): ZB-H1 with a deeper warm-up, ``2(p - r) - 1`` forwards on rank
    ``r``, and ``W`` delayed by ``2r`` backwards. With steps overlapped (post-validation) no rank
    idles between its first and last action once ``m >= 2p``: bubble ``(p - 1)(F + B - 2W)``, zero
    at unit costs. Every rank holds at most ``2p - 1`` microbatches. Below ``m = 2p - 1`` the deep
    warm-up cannot fill and :func:`zb_h1` is the better choice.

    Example:
        >>> zb_h2(2, 4)[0][:4]
        (Action('0F0'), Action('0F1'), Action('0F2'), Action('0B0'))
    """
    _check_pm("zb_h2", p, m)
    return _split_1f1b(p, m, lambda r: 2 * (p - r) - 1, lambda r: 2 * r, "zb_h2")


def zbv(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6): two stages per rank in a V (rank ``r`` holds chunk 0 =
    stage ``r`` and chunk 1 = stage ``2p - 1 - r``), backward split into ``B`` and ``W``.

    Rank ``r`` runs ``2(p - r) - 1`` chunk-0 forwards; ``r`` pairs (chunk-1 ``F``, chunk-0 ``F``);
    ``p - r`` triples (chunk-1 ``F``, ``B``, ``W``); then the steady state (chunk-0 ``F``, ``B``,
    ``W``, chunk-1 ``F``, ``B``, ``W``) until every forward is issued; then ``r`` pairs of
    backwards (chunk 0, chunk 1) whose ``W`` wait, ``p - r`` pairs (chunk-0 ``B``, a waiting
    chunk-0 ``W``), and the waiting ``W`` of chunk 1, then chunk 0. With fewer than ``2p - 1``
    microbatches the schedule is built for ``2p - 1`` and the missing microbatches dropped.

    At most ``2p`` stage-chunk activations per rank (``p`` microbatches of a full rank, as 1F1B),
    counted until ``W``; no bubble between a rank's first and last action once ``m >= 2p``.

    Example:
        >>> zbv(2, 4).stage_to_rank
        (0, 1, 1, 0)
    """
    _check_pm("zbv", p, m)
    n = max(m, 2 * p - 1)
    actions = {}
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        issued = {F: [0, 0], B: [0, 0], W: [0, 0]}
        row: list[Action] = []

        def do(kind: ActionKind, chunk: int) -> None:
            i = issued[kind][chunk]
            issued[kind][chunk] += 1
            if i < m:
                row.append(Action(kind, stage[chunk], i))

        for _ in range(2 * (p - r) - 1):
            do(F, 0)
        for _ in range(r):
            do(F, 1)
            do(F, 0)
        for _ in range(p - r):
            do(F, 1)
            do(B, 1)
            do(W, 1)
        while issued[F][0] < n or issued[F][1] < issued[F][0]:
            if issued[F][0] < n:
                do(F, 0)
            for chunk in (0, 1):
                if chunk == 1:
                    do(F, 1)
                do(B, chunk)
                do(W, chunk)
        for _ in range(r):
            do(B, 0)
            do(B, 1)
        for _ in range(p - r):
            do(B, 0)
            do(W, 0)
        for chunk in (1, 0):
            while issued[W][chunk] < n:
                do(W, chunk)
        actions[r] = row
    return Schedule(actions, v_placement(p), m, name="zbv")


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek, the "cut-in-half" DualPipe): V placement as :func:`zbv`, microbatches
    fed from one end, forward of one chunk paired with the backward of the other in the steady
    state, and zero-bubble ``B``/``W`` splits at the edges of the steady state.

    Rank ``r`` (chunk 0 = stage ``r``, chunk 1 = stage ``2p - 1 - r``) runs, in eight phases:
    ``2(p - 1 - r)`` chunk-0 forwards; ``r + 1`` pairs (chunk-0 forward, chunk-1 forward);
    ``p - 1 - r`` of (chunk-1 ``B``, its ``W``, chunk-1 forward); ``m - 2p + r + 1`` steady pairs
    ((chunk-0 forward, chunk-1 backward), (chunk-1 forward, chunk-0 backward)); ``p - 1 - r`` of
    (chunk-1 backward, chunk-1 forward, chunk-0 backward); ``r + 1`` of (chunk-1 backward, chunk-0
    backward), the second half of them split into ``B`` and deferred ``W``; ``p - 1 - r`` of
    (a deferred ``W``, chunk-0 ``B``); then the remaining ``W``.

    Raises:
        ValueError: ``p < 2`` or ``m < 2p`` (the steady state needs ``2p`` microbatches).

    Example:
        >>> s = dualpipev(2, 4)
        >>> s.num_stages
        4
    """
    _check_pm("dualpipev", p, m, min_p=2)
    if m < 2 * p:
        raise ValueError(f"dualpipev: needs m >= 2p microbatches to reach its steady state; got p={p}, m={m}")
    actions = {}
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        next_f = [0, 0]
        next_b = [0, 0]
        deferred: deque[Action] = deque()
        row: list[Action] = []

        def fwd(c: int) -> None:
            row.append(Action(F, stage[c], next_f[c]))
            next_f[c] += 1

        def bwd(c: int, split: bool = False) -> None:
            i = next_b[c]
            next_b[c] += 1
            if split:
                row.append(Action(B, stage[c], i))
                deferred.append(Action(W, stage[c], i))
            else:
                row.append(Action(BW, stage[c], i))

        for _ in range(2 * (p - 1 - r)):
            fwd(0)
        for _ in range(r + 1):
            fwd(0)
            fwd(1)
        for _ in range(p - 1 - r):
            bwd(1, split=True)
            row.append(deferred.popleft())
            fwd(1)
        for _ in range(m - 2 * p + r + 1):
            fwd(0)
            bwd(1)
            fwd(1)
            bwd(0)
        for _ in range(p - 1 - r):
            bwd(1)
            fwd(1)
            bwd(0)
        # Halfway through, backwards start leaving their W for later (odd ranks one action
        # earlier than even ranks), so the W passes fill the drain.
        n = r + 1
        split = False
        for j in range(n):
            if j == n // 2 and r % 2 == 1:
                split = True
            bwd(1, split=split)
            if j == n // 2 and r % 2 == 0:
                split = True
            bwd(0, split=split)
        for _ in range(p - 1 - r):
            row.append(deferred.popleft())
            bwd(0, split=True)
        row.extend(deferred)
        actions[r] = row
    return Schedule(actions, v_placement(p), m, name="dualpipev")


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipev,
}
