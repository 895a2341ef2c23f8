"""Context-parallel attention on local blocks: all-gather KV, ring, Ulysses and their 2-D hybrid.

Each rank of a context-parallel mesh axis holds its tokens of the sequence as split by a
:class:`~hpfunc.models.sequence_split.SequenceSplit` (two chunks, causally balanced), and calls one of
these inside :func:`hpfunc.shard_map` (or under ``with mesh:``) with its local ``q [B, Hq, S/P, D]``,
``k, v [B, Hkv, S/P, D]`` (after RoPE at :meth:`SequenceSplit.positions`; ``axis=None``: the whole sequence on this rank, the same
blocks without communication); the result is its tokens'
attention output ``[B, Hq, S/P, D]``, equal to single-device attention over the whole sequence. The
collectives are :mod:`hpfunc.lax`'s, so the backward is their exact transposes (autograd through them:
the ring's dK, dV go back around the ring by the inverse permutation).

=============  =====================================================  ===================================
strategy       what travels (per rank, per call, forward)             backward
=============  =====================================================  ===================================
``allgather``  one all-gather of K, V (KV heads only): ``2 N h_kv``   one reduce-scatter of dK, dV
``ring``       ``P - 1`` transfers of K, V of ``2 N h_kv / P``        ``P - 1`` transfers of dK, dV
``ulysses``    all-to-alls of q, k, v, out (``N h / P`` each)         four all-to-alls
``hybrid``     Ulysses within ``ulysses_axis``, ring across ``axis``  the transposes of both
=============  =====================================================  ===================================

(``N`` tokens per sequence times the batch, ``h = Hq D``, ``h_kv = Hkv D``; docs/reference.md has the
formulas the tests assert.) Causal work is skipped per chunk pair: a query chunk never computes a key
chunk after it, so the balanced split gives every rank the same attention FLOPs.

Document masks (packed sequences): ``doc_ids [B, S]`` (or ``[S]``) of the *whole* sequence, held by
every rank (metadata of ``S`` integers the data path has before the split; no id travels); a token
attends only within its document. Documents need not divide into chunks.

>>> import hpfunc, torch
>>> split = SequenceSplit(seq_len=8, ranks=1)
>>> q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
>>> with hpfunc.Mesh({"cp": 1}):
...     out = context_attention(q, k, v, split, axis="cp", impl="ring")
>>> bool(torch.allclose(out, dense_attention(q, k, v), atol=1e-5))
True
>>> bool(torch.allclose(context_attention(q, k, v, split, axis=None, impl="allgather"), out, atol=1e-5))
True
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator, Sequence

import torch

from hpfunc import lax, layout
from hpfunc.layout.context_parallel import IMPLS
from hpfunc.models.attention_blocks import block_attention, dense_attention, merge_blocks
from hpfunc.models.sequence_split import ContextParallelError, SequenceSplit

__all__ = ["IMPLS", "context_attention", "allgather_attention", "ring_attention", "ulysses_attention",
           "hybrid_attention", "local_positions", "trace_ring", "SequenceSplit", "ContextParallelError",
           "dense_attention"]


@contextlib.contextmanager
def trace_ring() -> Iterator[list[tuple[float, str, int]]]:
    """Record the ring's events ``(time.perf_counter(), event, step)`` into the list it yields: ``"send
    posted"``, ``"compute start"``, ``"compute end"``, ``"wait start"``, ``"arrived"`` (forward only; a
    member of the layout binding's scopes: other threads record nothing, a step's body does). With
    overlap, step ``t``'s transfer is posted before its compute starts and waited for after it ends.

    >>> with trace_ring() as events:
    ...     pass
    >>> events
    []
    """
    events: list[tuple[float, str, int]] = []
    with layout.scoped(ring_trace=events):
        yield events


def _event(name: str, step: int) -> None:
    events = layout.scopes().ring_trace
    if events is not None:
        events.append((time.perf_counter(), name, step))


def local_positions(split: SequenceSplit, axis: str | tuple[str, ...] | None) -> torch.Tensor:
    """Global positions of this rank's tokens along ``axis`` (for RoPE tables), ``[S/P]`` int64."""
    return split.positions(_axis_index(axis))


# ---------------------------------------------------------------------------------------------
# Checks (all before any communication)


def _axis_size(axis: str | tuple[str, ...] | None) -> int:
    return 1 if axis is None else lax.axis_size(axis)


def _axis_index(axis: str | tuple[str, ...] | None) -> int:
    return 0 if axis is None else lax.axis_index(axis)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, *, impl: str,
           axis: str | tuple[str, ...], ulysses_axis: str | tuple[str, ...] | None, replicate_kv: bool,
           doc_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Validate the call; the padded document ids (or None)."""
    if impl not in IMPLS:
        raise ContextParallelError(f"context attention: impl must be one of {IMPLS}, found {impl!r}")
    if not isinstance(split, SequenceSplit):
        raise ContextParallelError(f"context attention: expected a SequenceSplit, found {type(split).__name__}")
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ContextParallelError(
            f"context attention: expected q [B, Hq, S/P, D] and k, v [B, Hkv, S/P, D] of equal shapes, found "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, hq, s, d = q.shape
    if k.shape[0] != B or k.shape[2] != s or k.shape[3] != d or hq % k.shape[1]:
        raise ContextParallelError(
            f"context attention: k, v {tuple(k.shape)} must match q {tuple(q.shape)} in batch, tokens and head dim, "
            f"and the query heads must be a multiple of the key/value heads")
    p_ring = _axis_size(axis)
    p_uly = _axis_size(ulysses_axis) if impl == "hybrid" else 1
    if impl == "hybrid" and ulysses_axis is None:
        raise ContextParallelError("context attention impl='hybrid' needs ulysses_axis= (Ulysses inside it, the ring "
                                   f"across axis {axis!r})")
    where = f"axis {axis!r}" + (f" x ulysses_axis {ulysses_axis!r}" if impl == "hybrid" else "")
    if p_ring * p_uly != split.ranks:
        raise ContextParallelError(
            f"context attention over {where}: the split is for {split.ranks} ranks but the mesh has "
            f"{p_ring * p_uly}; build SequenceSplit(seq_len, ranks={p_ring * p_uly})")
    if s != split.local_len:
        raise ContextParallelError(
            f"context attention over {where}: each of {split.ranks} ranks must hold {split.local_len} tokens of the "
            f"padded sequence ({split.padded_len} for {split.seq_len}), found {s} in q {tuple(q.shape)}; shard the "
            f"batch with SequenceSplit.shard / local (which pad it to a multiple of 2 x {split.ranks})")
    heads_axis_size = p_ring if impl == "ulysses" else p_uly
    if impl in ("ulysses", "hybrid"):
        uax = axis if impl == "ulysses" else ulysses_axis
        if hq % heads_axis_size:
            raise ContextParallelError(
                f"Ulysses over {uax!r}: {hq} query heads do not split over {heads_axis_size} ranks; the Ulysses "
                f"degree must divide the query heads (use impl='hybrid' for a ring across the rest)")
        if k.shape[1] % heads_axis_size and not replicate_kv:
            raise ContextParallelError(
                f"Ulysses over {uax!r}: degree {heads_axis_size} is above the {k.shape[1]} key/value heads (or does "
                f"not divide them); pass replicate_kv=True to repeat the KV heads (more bytes travel), or use "
                f"impl='hybrid' with a Ulysses degree that divides {k.shape[1]}")
    if doc_ids is None:
        return None
    docs = split.padded_doc_ids(doc_ids)
    if docs.shape[0] not in (1, B):
        raise ContextParallelError(f"document ids: batch {docs.shape[0]} does not match q's batch {B}")
    return docs.to(q.device)


# ---------------------------------------------------------------------------------------------
# Attention of query chunks to key chunks (causal work skipped per chunk pair)


class _Mask:
    """What every block of one call shares: the split, causality, padded document ids, scale."""

    __slots__ = ("split", "causal", "docs", "scale")

    def __init__(self, split: SequenceSplit, causal: bool, docs: torch.Tensor | None, scale: float | None):
        self.split, self.causal, self.docs, self.scale = split, causal, docs, scale

    def doc_slice(self, chunks: Sequence[int]) -> torch.Tensor | None:
        if self.docs is None:
            return None
        c = self.split.chunk_len
        return torch.cat([self.docs[:, b * c:(b + 1) * c] for b in chunks], dim=1)


def _needed(a: int, k_chunks: Sequence[int], causal: bool) -> list[int]:
    """Indices into ``k_chunks`` of the key chunks query chunk ``a`` attends (causal: none after it)."""
    return [j for j, b in enumerate(k_chunks) if not causal or b <= a]


def _attend(q: torch.Tensor, q_chunks: Sequence[int], k: torch.Tensor, v: torch.Tensor, k_chunks: Sequence[int],
            m: _Mask) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """For each query chunk (``q``'s tokens are ``q_chunks`` laid end to end, as ``k, v``'s are ``k_chunks``):
    its ``(out, lse)`` over the key chunks it attends, or None when it attends none of them."""
    split, c = m.split, m.split.chunk_len
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, a in enumerate(q_chunks):
        js = _needed(a, k_chunks, m.causal)
        if not js:
            results.append(None)
            continue
        if js == list(range(js[0], js[-1] + 1)):  # consecutive: a view
            kb, vb = k[:, :, js[0] * c:(js[-1] + 1) * c], v[:, :, js[0] * c:(js[-1] + 1) * c]
        else:
            kb = torch.cat([k[:, :, j * c:(j + 1) * c] for j in js], dim=2)
            vb = torch.cat([v[:, :, j * c:(j + 1) * c] for j in js], dim=2)
        bs = [k_chunks[j] for j in js]
        has_pad = any((b + 1) * c > split.seq_len for b in bs)
        masked = m.docs is not None or has_pad or (m.causal and a in bs)
        q_pos = split.chunk_positions(a).to(q.device)
        k_pos = torch.cat([split.chunk_positions(b) for b in bs]).to(q.device)
        results.append(block_attention(q[:, :, i * c:(i + 1) * c], kb, vb, q_pos, k_pos, causal=m.causal,
                                       seq_len=split.seq_len, q_doc=m.doc_slice([a]), k_doc=m.doc_slice(bs),
                                       scale=m.scale, masked=masked))
    return results


def _to_sequence_order(kv: torch.Tensor, chunks: Sequence[int], c: int, dim: int) -> tuple[torch.Tensor, list[int]]:
    """``kv`` (chunks ``chunks`` end to end along ``dim``) reordered by chunk id, and the sorted ids (so a
    causal query chunk's keys are one prefix, a view)."""
    order = sorted(range(len(chunks)), key=lambda j: chunks[j])
    index = torch.cat([torch.arange(j * c, (j + 1) * c) for j in order]).to(kv.device)
    return kv.index_select(dim, index), [chunks[j] for j in order]


def _outputs(blocks: list) -> torch.Tensor:
    return torch.cat([b[0] for b in blocks], dim=2)


def _group_chunks(split: SequenceSplit, group: int, size: int) -> list[int]:
    """The chunks of ranks ``group * size ... group * size + size - 1`` end to end (flattened rank order)."""
    return [c for u in range(size) for c in split.chunks_of(group * size + u)]


# ---------------------------------------------------------------------------------------------
# Strategies


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, *,
                        axis: str | tuple[str, ...], causal: bool = True, doc_ids: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """All-gather K and V (their KV heads only, stacked: one all-gather) over ``axis``; attend the local
    queries to the whole sequence's keys. Transpose: one reduce-scatter of dK, dV."""
    docs = _check(q, k, v, split, impl="allgather", axis=axis, ulysses_axis=None, replicate_kv=False, doc_ids=doc_ids)
    me, P = _axis_index(axis), split.ranks
    kv = torch.stack([k, v])
    if axis is not None:
        kv = lax.all_gather(kv, axis, axis=3, tiled=True)  # [2, B, Hkv, S_pad, D]
    kv, k_chunks = _to_sequence_order(kv, _group_chunks(split, 0, P), split.chunk_len, 3)
    return _outputs(_attend(q, split.chunks_of(me), kv[0], kv[1], k_chunks, _Mask(split, causal, docs, scale)))


def _ring_perm(n: int) -> list[tuple[int, int]]:
    """Each rank sends to the next: at step ``t`` rank ``r`` holds the keys of rank ``r - t``."""
    return [(i, (i + 1) % n) for i in range(n)]


def _ring(q: torch.Tensor, q_chunks: Sequence[int], kv: torch.Tensor, chunks_of: Callable[[int], Sequence[int]],
          axis: str | tuple[str, ...], m: _Mask, overlap: bool) -> torch.Tensor:
    n, me = _axis_size(axis), _axis_index(axis)
    perm = _ring_perm(n)
    state: list = [None] * len(q_chunks)
    unused = []  # received keys no query chunk attends (contiguous split, causal): tied in below
    for t in range(n):
        pending = None
        if t < n - 1 and overlap:  # post the next transfer before this block's compute
            _event("send posted", t)
            pending = lax.ppermute_start(kv, axis, perm)
        _event("compute start", t)
        blocks = _attend(q, q_chunks, kv[0], kv[1], chunks_of((me - t) % n), m)
        for i, block in enumerate(blocks):
            if block is not None:
                state[i] = block if state[i] is None else merge_blocks(*state[i], *block)
        if all(b is None for b in blocks):
            unused.append(kv)
        _event("compute end", t)
        if t < n - 1:
            if pending is not None:
                _event("wait start", t)
                kv = pending.wait()
                _event("arrived", t)
            else:
                kv = lax.ppermute(kv, axis, perm)
    out = _outputs(state)  # step 0 is the rank's own keys: every query chunk has its diagonal block
    # Every rank must run every transfer's transpose in the backward (its peer waits for it): keys this
    # rank did not attend join the output with weight 0, so their (zero) cotangent still travels.
    for kv in unused:
        out = out + 0.0 * kv.sum()
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, *,
                   axis: str | tuple[str, ...], causal: bool = True, doc_ids: torch.Tensor | None = None,
                   scale: float | None = None, overlap: bool = True) -> torch.Tensor:
    """Ring attention over ``axis``: each rank keeps its queries and passes K, V (KV heads only, stacked:
    one transfer per step) around the ring, ``P - 1`` steps, merging blocks by log-sum-exp. ``overlap``
    posts the next transfer (:func:`hpfunc.lax.ppermute_start`) before the current block's compute.
    The backward is autograd through the transfers' exact transposes: dK, dV travel back the ring."""
    docs = _check(q, k, v, split, impl="ring", axis=axis, ulysses_axis=None, replicate_kv=False, doc_ids=doc_ids)
    me = _axis_index(axis)
    return _ring(q, split.chunks_of(me), torch.stack([k, v]), split.chunks_of, axis,
                 _Mask(split, causal, docs, scale), overlap)


def _expand_kv(k: torch.Tensor, v: torch.Tensor, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV heads repeated (each in place, ``repeat_interleave``) to a multiple of ``degree`` that divides
    the query heads (Ulysses above the KV heads, ``replicate_kv=True``)."""
    hkv = k.shape[1]
    if hkv % degree == 0:
        return k, v
    r = degree // math.gcd(hkv, degree)
    return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str | tuple[str, ...],
             attend_heads: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sequence-sharded -> head-sharded (four all-to-alls over ``axis`` with the output's), attention on
    the group's whole token set for a slice of the heads, and back."""
    if axis is None:
        return attend_heads(q, k, v)
    k, v = _expand_kv(k, v, lax.axis_size(axis))
    qh = lax.all_to_all(q, axis, 1, 2)
    kh = lax.all_to_all(k, axis, 1, 2)
    vh = lax.all_to_all(v, axis, 1, 2)
    return lax.all_to_all(attend_heads(qh, kh, vh), axis, 2, 1)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, *,
                      axis: str | tuple[str, ...], causal: bool = True, doc_ids: torch.Tensor | None = None,
                      scale: float | None = None, replicate_kv: bool = False) -> torch.Tensor:
    """DeepSpeed-Ulysses over ``axis``: all-to-alls turn q, k, v from sequence-sharded into head-sharded,
    each rank attends the whole sequence for ``1/P`` of the heads, and one all-to-all turns the output
    back. The degree must divide the KV heads unless ``replicate_kv`` (then the KV heads are repeated
    before the exchange, which sends more)."""
    docs = _check(q, k, v, split, impl="ulysses", axis=axis, ulysses_axis=None, replicate_kv=replicate_kv,
                  doc_ids=doc_ids)
    m, chunks = _Mask(split, causal, docs, scale), _group_chunks(split, 0, split.ranks)

    def attend_heads(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        kv, k_chunks = _to_sequence_order(torch.stack([kh, vh]), chunks, split.chunk_len, 3)
        return _outputs(_attend(qh, chunks, kv[0], kv[1], k_chunks, m))

    return _ulysses(q, k, v, axis, attend_heads)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, *,
                     axis: str | tuple[str, ...], ulysses_axis: str | tuple[str, ...], causal: bool = True,
                     doc_ids: torch.Tensor | None = None, scale: float | None = None, replicate_kv: bool = False,
                     overlap: bool = True) -> torch.Tensor:
    """2-D context parallelism: Ulysses inside ``ulysses_axis`` (heads split), a ring across ``axis``
    (the group's K, V for its heads travel). The split is over the flattened ``(axis, ulysses_axis)``
    ranks (row-major: ``ring index * Pu + ulysses index``), so the degree is not capped by the heads."""
    docs = _check(q, k, v, split, impl="hybrid", axis=axis, ulysses_axis=ulysses_axis, replicate_kv=replicate_kv,
                  doc_ids=doc_ids)
    pu = _axis_size(ulysses_axis)
    m, group = _Mask(split, causal, docs, scale), _axis_index(axis)

    def attend_heads(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
        return _ring(qh, _group_chunks(split, group, pu), torch.stack([kh, vh]),
                     lambda g: _group_chunks(split, g, pu), axis, m, overlap)

    return _ulysses(q, k, v, ulysses_axis, attend_heads)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, *,
                      axis: str | tuple[str, ...], impl: str = "ring", causal: bool = True,
                      doc_ids: torch.Tensor | None = None, scale: float | None = None, replicate_kv: bool = False,
                      overlap: bool = True, ulysses_axis: str | tuple[str, ...] | None = None) -> torch.Tensor:
    """Context-parallel attention by ``impl`` (one of :data:`IMPLS`; see the module docstring)."""
    if impl == "allgather":
        return allgather_attention(q, k, v, split, axis=axis, causal=causal, doc_ids=doc_ids, scale=scale)
    if impl == "ring":
        return ring_attention(q, k, v, split, axis=axis, causal=causal, doc_ids=doc_ids, scale=scale, overlap=overlap)
    if impl == "ulysses":
        return ulysses_attention(q, k, v, split, axis=axis, causal=causal, doc_ids=doc_ids, scale=scale,
                                 replicate_kv=replicate_kv)
    if impl == "hybrid":
        return hybrid_attention(q, k, v, split, axis=axis, ulysses_axis=ulysses_axis, causal=causal, doc_ids=doc_ids,
                                scale=scale, replicate_kv=replicate_kv, overlap=overlap)
    raise ContextParallelError(f"context attention: impl must be one of {IMPLS}, found {impl!r}")
