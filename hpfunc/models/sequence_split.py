"""How a long sequence is split over context-parallel ranks: causal load balancing as a token permutation.

The (padded) sequence is cut into ``2 P`` equal chunks for ``P`` ranks. With ``balanced=True`` (the
default) rank ``r`` holds chunk ``r`` and chunk ``2P - 1 - r``: under a causal mask a query chunk ``a``
attends to ``a`` earlier chunks and its own, so every rank does ``2P - 1`` full chunk blocks and two
diagonal ones, the same work (with ``balanced=False`` rank ``r`` holds chunks ``2r, 2r + 1`` and the
last rank does about ``2P - 1`` times the first's work).

The split is a permutation of token indices, applied once to the batch by the data path:
:meth:`SequenceSplit.order` is the global index held at each slot of the ranks' concatenated local
sequences, :meth:`SequenceSplit.positions` the global positions of one rank's tokens (for RoPE and the
causal mask), :meth:`SequenceSplit.shard` / :meth:`SequenceSplit.unshard` apply the permutation and its
inverse. A sequence whose length does not divide by ``2P`` is padded at the end (``pad=True``): padded
tokens sit after every real one, so no real query attends to them; labels are padded with the ignore
index so the loss counts only real targets.

>>> split = SequenceSplit(seq_len=6, ranks=2)      # padded to 8, chunks of 2
>>> split.chunks_of(0), split.chunks_of(1)
((0, 3), (1, 2))
>>> split.positions(0).tolist(), split.positions(1).tolist()
([0, 1, 6, 7], [2, 3, 4, 5])
>>> x = torch.arange(6).view(1, 6)
>>> [p.tolist() for p in split.shard(x, dim=1, fill=-1)]
[[[0, 1, -1, -1]], [[2, 3, 4, 5]]]
>>> split.unshard(split.shard(x, dim=1), dim=1).tolist()
[[0, 1, 2, 3, 4, 5]]
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from hpfunc.layout import PlanError

__all__ = ["ContextParallelError", "SequenceSplit"]


class ContextParallelError(PlanError):
    """A context-parallel split or attention call does not fit its inputs or its mesh axis."""


def _positive(_self: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ContextParallelError(f"SequenceSplit.{attribute.name}: expected a positive int, found {value!r}")


@attrs.frozen
class SequenceSplit:
    """A sequence of ``seq_len`` tokens split over ``ranks`` context-parallel ranks in ``2 * ranks`` chunks.

    ``balanced``: rank ``r`` holds chunks ``r`` and ``2 ranks - 1 - r`` (else ``2r`` and ``2r + 1``).
    ``pad``: round the length up to a multiple of ``2 * ranks`` (else such a length is an error).
    """

    seq_len: int = attrs.field(validator=_positive)
    ranks: int = attrs.field(validator=_positive)
    balanced: bool = True
    pad: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.pad and self.seq_len % (2 * self.ranks):
            raise ContextParallelError(
                f"SequenceSplit: sequence length {self.seq_len} does not divide into {2 * self.ranks} chunks "
                f"(2 x {self.ranks} context-parallel ranks) and pad=False; pass pad=True to pad it to "
                f"{self.padded_len} or choose a length that is a multiple of {2 * self.ranks}")

    @property
    def chunks(self) -> int:
        """Number of chunks, ``2 * ranks``."""
        return 2 * self.ranks

    @property
    def padded_len(self) -> int:
        """The sequence length rounded up to a multiple of ``2 * ranks``."""
        return -(-self.seq_len // self.chunks) * self.chunks

    @property
    def chunk_len(self) -> int:
        """Tokens per chunk."""
        return self.padded_len // self.chunks

    @property
    def local_len(self) -> int:
        """Tokens per rank (two chunks)."""
        return 2 * self.chunk_len

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The global chunk indices rank ``rank`` holds, in its local order."""
        if not 0 <= rank < self.ranks:
            raise ContextParallelError(f"SequenceSplit.chunks_of: rank {rank} is out of range for {self.ranks} ranks")
        if self.balanced:
            return rank, self.chunks - 1 - rank
        return 2 * rank, 2 * rank + 1

    def chunk_positions(self, chunk: int) -> torch.Tensor:
        """Global positions of chunk ``chunk`` (int64)."""
        return torch.arange(chunk * self.chunk_len, (chunk + 1) * self.chunk_len)

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions of rank ``rank``'s local tokens, ``[local_len]`` int64 (RoPE and the causal mask)."""
        return torch.cat([self.chunk_positions(c) for c in self.chunks_of(rank)])

    def order(self) -> torch.Tensor:
        """``[padded_len]``: the global index at each slot of the ranks' local sequences concatenated in
        rank order (the permutation applied to the padded sequence)."""
        return torch.cat([self.positions(r) for r in range(self.ranks)])

    def pad_to_split(self, x: torch.Tensor, dim: int = 1, fill: float | int = 0) -> torch.Tensor:
        """``x`` padded along ``dim`` from ``seq_len`` to ``padded_len`` with ``fill``."""
        self._check_len(x, dim, self.seq_len, "pad_to_split")
        extra = self.padded_len - self.seq_len
        if not extra:
            return x
        shape = list(x.shape)
        shape[dim] = extra
        return torch.cat([x, x.new_full(shape, fill)], dim=dim)

    def local(self, x: torch.Tensor, rank: int, dim: int = 1, fill: float | int = 0) -> torch.Tensor:
        """Rank ``rank``'s tokens of the full sequence ``x`` (length ``seq_len`` along ``dim``)."""
        return self.pad_to_split(x, dim, fill).index_select(dim, self.positions(rank).to(x.device))

    def permute(self, x: torch.Tensor, dim: int = 1, fill: float | int = 0) -> torch.Tensor:
        """``x`` padded and permuted along ``dim``: the ranks' local sequences end to end (split it evenly
        over the ranks, e.g. by ``shard_map`` with the cp axis on ``dim``). Differentiable."""
        return self.pad_to_split(x, dim, fill).index_select(dim, self.order().to(x.device))

    def unpermute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The inverse of :meth:`permute`: sequence order, padding dropped."""
        self._check_len(x, dim, self.padded_len, "unpermute")
        inverse = torch.empty_like(self.order())
        inverse[self.order()] = torch.arange(self.padded_len)
        return x.index_select(dim, inverse.to(x.device)).narrow(dim, 0, self.seq_len)

    def shard(self, x: torch.Tensor, dim: int = 1, fill: float | int = 0) -> list[torch.Tensor]:
        """Every rank's tokens of ``x``: pad, permute, split (differentiable)."""
        return list(self.permute(x, dim, fill).chunk(self.ranks, dim=dim))

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The inverse of :meth:`shard`: the ranks' local tensors back in sequence order, padding dropped."""
        if len(parts) != self.ranks:
            raise ContextParallelError(f"SequenceSplit.unshard: expected {self.ranks} parts, found {len(parts)}")
        for r, p in enumerate(parts):
            self._check_len(p, dim, self.local_len, f"unshard (part {r})")
        return self.unpermute(torch.cat(list(parts), dim=dim), dim)

    def padded_doc_ids(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """Document ids ``[B, seq_len]`` (or ``[seq_len]``) of the whole sequence, padded to ``padded_len``
        with a distinct negative id per padded token (a padded token is a document of its own)."""
        if doc_ids.dim() == 1:
            doc_ids = doc_ids[None]
        if doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise ContextParallelError(
                f"document ids: expected an integer tensor [batch, {self.seq_len}] (or [{self.seq_len}]) for the "
                f"whole sequence, found {doc_ids.dtype} {tuple(doc_ids.shape)}")
        self._check_len(doc_ids, 1, self.seq_len, "document ids")
        doc_ids = doc_ids.long()
        extra = self.padded_len - self.seq_len
        if extra:
            if bool((doc_ids < 0).any()):
                raise ContextParallelError("document ids must be >= 0 (negative ids mark padding)")
            pads = -1 - torch.arange(extra, device=doc_ids.device).expand(doc_ids.shape[0], extra)
            doc_ids = torch.cat([doc_ids, pads], dim=1)
        return doc_ids

    def _check_len(self, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
        if not -x.dim() <= dim < x.dim() or x.shape[dim] != expected:
            found = x.shape[dim] if -x.dim() <= dim < x.dim() else f"no dimension {dim}"
            raise ContextParallelError(
                f"SequenceSplit.{what}: expected {expected} tokens along dimension {dim} (sequence {self.seq_len}, "
                f"padded {self.padded_len}, {self.ranks} ranks), found {found} in a tensor of shape {tuple(x.shape)}")
