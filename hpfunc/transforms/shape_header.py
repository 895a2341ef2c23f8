"""A point-to-point message's shape header, made on the host and sent as a device tensor without a host wait.

A pipeline stage cannot know the shapes of the tensors another stage sends it; the first message of a
shape carries a header: ``[count, (dtype index, ndim, dim_0 .. dim_5) per tensor]`` (int64, the layout
of :mod:`hpfunc.transforms.pipeline`'s headers). NCCL sends device tensors only, and
``torch.tensor(fields, device="cuda")`` copies from pageable host memory with a stream synchronize
after it (the host waits for every queued kernel). :func:`header_send_op` builds the header with
:func:`hpfunc.host_to_device.literal` (pinned, ``non_blocking``) and returns its ``P2POp`` for
``dist.batch_isend_irecv``; :func:`header_recv_op` posts the receive into a device buffer; the
receiver's :func:`decode` of ``header.tolist()`` is the one read the first step of a new shape makes
(docs/gpu.md).

    >>> import torch
    >>> fields = encode([torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)])
    >>> len(fields) == HEADER_LEN, decode(fields)
    (True, [((2, 3), torch.float32), ((4,), torch.int64)])
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from hpfunc.host_to_device import literal

__all__ = ["MAX_TENSORS", "MAX_NDIM", "HEADER_LEN", "DTYPES", "encode", "decode", "header_send_op", "header_recv_op"]

MAX_TENSORS = 8
MAX_NDIM = 6
HEADER_LEN = 1 + MAX_TENSORS * (2 + MAX_NDIM)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool)


def encode(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The header's fields for ``tensors`` (host integers); a ``ValueError`` names what cannot be sent."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a header describes at most {MAX_TENSORS} tensors, found {len(tensors)}")
    fields = [0] * HEADER_LEN
    fields[0] = len(tensors)
    for j, t in enumerate(tensors):
        if t.dim() > MAX_NDIM or t.dtype not in DTYPES:
            raise ValueError(f"tensor {j}: cannot describe a {t.dtype} tensor of shape {tuple(t.shape)} (at most "
                             f"{MAX_NDIM} dims, dtypes {DTYPES})")
        base = 1 + j * (2 + MAX_NDIM)
        fields[base], fields[base + 1] = DTYPES.index(t.dtype), t.dim()
        fields[base + 2: base + 2 + t.dim()] = t.shape
    return fields


def decode(fields: Sequence[int]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``[(shape, dtype), ...]`` of a received header's fields (``header.tolist()``)."""
    out = []
    for j in range(int(fields[0])):
        base = 1 + j * (2 + MAX_NDIM)
        nd = int(fields[base + 1])
        out.append((tuple(int(d) for d in fields[base + 2: base + 2 + nd]), DTYPES[int(fields[base])]))
    return out


def header_send_op(tensors: Sequence[torch.Tensor], peer: int, group: Any, tag: int,
                   device: torch.device | str) -> dist.P2POp:
    """The ``isend`` of ``tensors``' header to global rank ``peer``, the header on ``device`` (pinned and
    copied ``non_blocking`` on CUDA: no host wait), for ``dist.batch_isend_irecv``."""
    return dist.P2POp(dist.isend, literal(encode(tensors), torch.int64, device), peer, group, tag)


def header_recv_op(peer: int, group: Any, tag: int, device: torch.device | str) -> tuple[torch.Tensor, dist.P2POp]:
    """``(buffer, op)``: the ``irecv`` of a header from global rank ``peer`` into a device buffer."""
    buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    return buf, dist.P2POp(dist.irecv, buf, peer, group, tag)
