"""Silent data corruption (SDC) check: the replicas of every reduced gradient block must be bitwise equal.

After the gradient reduction every rank along a leaf's replica axes (the axes its stored block is
replicated on and that were all-reduced: ddp's axis, hsdp's replicate axis, tensor-parallel axes for
parameters replicated over them such as norms; not fsdp or ZeRO axes, whose blocks differ) holds the
same reduced block: an all-reduce returns the same bits on every rank (gloo and NCCL's ring and tree
all-reduces broadcast each reduced chunk from one rank). A bit flipped in one rank's copy -- a faulty
core, a memory error after the collective -- would make the replicas' optimizer updates drift apart
without any error. :func:`check` computes, per leaf, a checksum of this rank's reduced block (the sum
of its bit patterns as integers, int64: a single flipped bit changes it by ``± 2**k``, never by 0), then
one ``all_gather`` of the checksum vector over the whole mesh (8 bytes a leaf a rank), and compares
within each replica group on every rank: a mismatch is the same :class:`SDCError` on every rank,
naming the step, the parameter path and the rank(s) that disagree with the others (with two replicas:
both), or a warning with ``policy="warn"``.

Enabled by ``plan.with_sdc_check("raise" | "warn")`` (:meth:`hpfunc.transforms.plans.Plan.with_sdc_check`).
With no replica anywhere (fsdp over every rank) there is nothing to compare: a warning says so once.

:func:`inject_bit_flip` is the documented test hook: a context manager (a :class:`hpfunc.layout.BitFlip`
in the layout binding's scopes, so it is scoped to the code under it, a step's body included) that flips
bit ``bit`` of element 0 of the reduced gradient of ``path`` on rank ``rank`` just before the checksum
(the corrupted gradient goes on to the optimizer, as a real fault would).

>>> checksum([torch.tensor([1.0, 2.0])]).tolist() == [1065353216 + 1073741824]
True
>>> checksum([torch.tensor([1.0, 2.0]).index_put((torch.tensor(0),), torch.tensor(1.0000001))]).item() - 2139095040
1
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from hpfunc import layout
from hpfunc.layout import LeafLayout

__all__ = ["SDCError", "checksum", "check", "inject_bit_flip", "replica_axes", "POLICIES"]

POLICIES = ("raise", "warn")


class SDCError(RuntimeError):
    """Replicas of a reduced gradient differ: silent data corruption on (at least) one rank."""


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def inject_bit_flip(*, rank: int, path: str, bit: int, step: int | None = None) -> Iterator[None]:
    """Test hook: flip ``bit`` (0 = least significant) of element 0 of ``path``'s reduced gradient on
    global rank ``rank`` (at check number ``step``, every check when ``None``). Only under an SDC check.

    >>> with inject_bit_flip(rank=1, path="w", bit=3):
    ...     layout.scopes().sdc_flip.bit
    3
    """
    with layout.scoped(sdc_flip=layout.BitFlip(int(rank), str(path), int(bit), step)):
        yield


def replica_axes(lay: LeafLayout) -> tuple[str, ...]:
    """The axes over which ``lay``'s reduced gradient block is replicated (all-reduced, not ZeRO-scattered)."""
    done = {a for _, axes in lay.opt_extra for a in axes}
    return tuple(a for a in lay.replicated if a not in done)


def checksum(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``int64[len(blocks)]``: per block, the sum of its elements' bit patterns read as integers."""
    out = []
    for b in blocks:
        b = b.detach().contiguous()
        ints = b.view(_INT_OF[b.element_size()]) if b.is_floating_point() else b
        out.append(ints.to(torch.int64).sum() if ints.numel() else torch.zeros((), dtype=torch.int64))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def _flip(grad: torch.Tensor, bit: int) -> None:
    flat = grad.view(-1)
    if not flat.numel():
        return
    ints = flat.view(_INT_OF[flat.element_size()])
    with torch.no_grad():
        ints[0] ^= (1 << bit) if bit < 8 * flat.element_size() - 1 else -(1 << bit)


def check(leaves: Sequence[LeafLayout], grads: list[torch.Tensor], mesh, *, step: int, policy: str) -> None:
    """Compare the checksums of the reduced ``grads`` (this rank's blocks of ``leaves``) across their replicas.

    Collective (one all_gather over the mesh); every rank raises (or warns) the same. ``step`` is named
    in the message.
    """
    from hpfunc import lax

    rank = dist.get_rank() if dist.is_initialized() else 0
    fault = layout.scopes().sdc_flip
    if fault is not None and fault.rank == rank and (fault.step is None or fault.step == step):
        for lay, g in zip(leaves, grads):
            if lay.path == fault.path:
                _flip(g, fault.bit)
    checked = [i for i, lay in enumerate(leaves) if replica_axes(lay)]
    if not checked:
        if step == 0:
            warnings.warn("SDC check: no parameter has a replicated gradient block on this mesh and plan (e.g. "
                          "fsdp over every rank); there are no replicas to compare, nothing is checked",
                          stacklevel=2)
        return
    mine = checksum([grads[i] for i in checked])
    names = tuple(mesh.axis_names)
    everyone = lax.all_gather(mine, names, axis=0, tiled=False) if mesh.size > 1 else mine[None]
    table = everyone.reshape(mesh.size, len(checked)).tolist()  # one host read a check
    shape = [mesh.axis_size(a) for a in names]
    ranks = mesh.device_mesh.mesh.reshape(-1).tolist()  # global rank of each mesh position, row-major
    coords = [_unravel(k, shape) for k in range(mesh.size)]
    problems = []
    for col, i in enumerate(checked):
        axes = set(replica_axes(leaves[i]))
        groups: dict[tuple, list[int]] = {}
        for k, c in enumerate(coords):
            key = tuple(x for a, x in zip(names, c) if a not in axes)
            groups.setdefault(key, []).append(k)
        for members in groups.values():
            values = [table[k][col] for k in members]
            if len(set(values)) > 1:
                majority = max(set(values), key=values.count)
                odd = [ranks[k] for k, v in zip(members, values) if v != majority]
                if len(odd) * 2 >= len(members):  # no majority (two replicas): name them all
                    odd = [ranks[k] for k in members]
                problems.append(f"parameter {leaves[i].path!r}: the reduced gradient differs on rank(s) {odd} from "
                                f"its replicas on ranks {[ranks[k] for k in members]} (replicated over "
                                f"{sorted(axes)}; checksums {values})")
    if problems:
        msg = (f"SDC check, step {step}: {len(problems)} replicated gradient block(s) are not bitwise equal -- "
               f"silent data corruption: " + "; ".join(problems[:4]) +
               (f"; ... ({len(problems) - 4} more)" if len(problems) > 4 else "") +
               ". Replicas are equal by construction; take the rank(s) named out of service and restart from the "
               "last checkpoint")
        if policy == "raise":
            raise SDCError(msg)
        warnings.warn(msg, stacklevel=2)


def _unravel(k: int, shape: list[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(k % s)
        k //= s
    return tuple(reversed(out))


def overhead_bytes(n_leaves: int, world: int) -> int:
    """Bytes one check's all_gather moves in all: ``8 * leaves * world``.

    >>> overhead_bytes(10, 4)
    320
    """
    return 8 * n_leaves * world if world > 1 else 0


