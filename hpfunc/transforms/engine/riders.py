"""Small values that ride a collective the step makes anyway: the step's scalars in one all-reduce.

A training step reduces a few small values besides its gradients: the loss (a mean over the data
shards), the floating batch statistics of ``aux`` (means), its integer ones (sums: token counts, expert
loads) and, when the step asks for it, the gradients' global sum of squares. On gloo every collective
is a round trip costing ~0.6 ms of CPU and ~1 ms of wall time on two ranks whatever its size (64 KiB or
3 floats: ``bench/collectives.py``), so each separate one costs more than its bytes. Here they are packed
into one vector of the carrier's floating dtype and reduced by one ``SUM`` all-reduce: appended to the
last gradient bucket of a DDP step (:mod:`~hpfunc.transforms.engine.overlap`), or alone (fp64) after
the backward otherwise. Each value keeps its own reduction exactly:

- floating values: summed in the carrier dtype (no narrower than their own), then scaled (a mean:
  ``1/n``, as :func:`hpfunc.lax.pmean` scales its sum); cast back to their dtype;
- integers: exactly, as ``b``-bit limbs (12 in fp32, 32 in fp64) whose sums over ``n`` ranks stay below
  the carrier's exact-integer range (``n * 2**b <= 2**24`` or ``2**53``), recombined with carries
  (two's complement, modulo ``2**64``, as an int64 ``psum`` wraps);
- a value reduced over fewer axes than the carrier's collective (the loss over the data axes, inside a
  sum over the data and tensor axes) is added by the ranks at coordinate 0 of the extra axes only
  (weight 1; the others add 0), so that the sum is over its own axes.

>>> import torch
>>> riders = Riders([torch.tensor(2.0), torch.tensor([3, -4])], ["mean", "sum"], torch.float32, n=2)
>>> packed = riders.pack()
>>> packed.shape  # one float, and two integers as six 12-bit limbs each
torch.Size([13])
>>> riders.unpack(packed * 2)  # as if two ranks had sent the same values
[tensor(2.), tensor([ 6, -8])]
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["Riders", "limb_bits"]

# integer limbs: width in bits for a carrier dtype (its exact-integer range: 2**24, 2**53)
_LIMB_BITS = {torch.float32: 12, torch.float64: 32}
_EXACT_BITS = {torch.float32: 24, torch.float64: 53}


def limb_bits(carrier: torch.dtype, n: int) -> int | None:
    """The limb width carrying int64 values exactly in a ``carrier`` sum over ``n`` ranks, or ``None``
    when none does (another dtype, or too many ranks).

    >>> limb_bits(torch.float32, 8), limb_bits(torch.float64, 8), limb_bits(torch.float32, 2**13)
    (12, 32, None)
    """
    b = _LIMB_BITS.get(carrier)
    if b is None or n * (2**b - 1) >= 2 ** _EXACT_BITS[carrier]:
        return None
    return b


class Riders:
    """Values that ride one ``SUM`` all-reduce in a ``carrier`` vector (see the module docstring).

    ``values``: tensors; ``kinds``: per value ``"mean"`` (floating, over ``n`` ranks) or ``"sum"``
    (floating or integer); ``n``: the number of ranks the values are reduced over; ``ranks``: the number
    of ranks of the collective they ride (default ``n``; it bounds the integer sums); ``weight``: this
    rank's weight (``1.0`` or ``0.0``: whether it adds its values, for a collective over more axes than
    the values' own). :meth:`fits` says whether every value can ride (a dtype or rank count it cannot
    carry exactly: reduce it apart)."""

    def __init__(self, values: Sequence[torch.Tensor], kinds: Sequence[str], carrier: torch.dtype, *, n: int,
                 ranks: int | None = None, weight: float = 1.0):
        self.values, self.kinds, self.carrier, self.n, self.weight = list(values), list(kinds), carrier, n, weight
        self.bits = limb_bits(carrier, n if ranks is None else ranks)
        self.limbs = math.ceil(64 / self.bits) if self.bits else 0
        self.sizes = [x.numel() * (self.limbs if not x.is_floating_point() else 1) for x in self.values]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def fits(self) -> bool:
        """Every value can ride: floating ones no wider than the carrier, integer ones in int64 (or
        narrower) with a limb width for this carrier and rank count."""
        width = torch.finfo(self.carrier).bits if self.carrier.is_floating_point else 0
        for x in self.values:
            if x.is_complex() or x.dtype == torch.bool:
                return False
            if x.is_floating_point():
                if torch.finfo(x.dtype).bits > width:
                    return False
            elif self.bits is None or x.dtype == torch.uint64:
                return False
        return True

    def pack(self) -> torch.Tensor:
        """This rank's values as one ``carrier`` vector (weighted)."""
        parts = []
        for x in self.values:
            x = x.detach().reshape(-1)
            if x.is_floating_point():
                parts.append(x.to(self.carrier) if self.weight == 1.0 else x.to(self.carrier) * self.weight)
                continue
            x = x.to(torch.int64)
            if self.weight != 1.0:
                x = x * int(self.weight)
            parts.append(((x.unsqueeze(1) >> self._shifts(x.device)) & ((1 << self.bits) - 1)).reshape(-1)
                         .to(self.carrier))
        if not parts:
            return torch.empty(0, dtype=self.carrier)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def unpack(self, summed: torch.Tensor) -> list[torch.Tensor]:
        """The reduced values (their dtypes and shapes) from the summed vector."""
        out = []
        for x, kind, part in zip(self.values, self.kinds, summed.split(self.sizes)):
            if x.is_floating_point():
                y = part * (1.0 / self.n) if kind == "mean" else part
                out.append(y.to(x.dtype).view(x.shape))
                continue
            # sum_k s_k 2**(b k) modulo 2**64: int64 shifts and sums wrap, as an int64 psum does
            s = part.view(-1, self.limbs).to(torch.int64)
            out.append((s << self._shifts(s.device)).sum(1).to(x.dtype).view(x.shape))
        return out

    def _shifts(self, device: torch.device) -> torch.Tensor:
        """The bit offsets of the integer limbs: ``0, b, 2b, ...``."""
        return torch.arange(0, self.bits * self.limbs, self.bits, device=device)
