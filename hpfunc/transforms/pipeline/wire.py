"""The point-to-point wire protocol between pipeline ranks: tags, shape headers, posted receives.

A forward message (a stage's outputs to the next stage's rank) carries, the first time its key passes,
a *header*: one int64 tensor naming the count, dtypes and shapes of the tensors that follow (the
receiver cannot know another stage's output shapes). Both ends key a message by (sending stage,
microbatch, the microbatch's shapes): every rank splits the same batch, so both know from the second
step on that no header comes (as torch's ``PipelineStage`` infers shapes once). A backward message
mirrors the receiver's own outputs and never has a header. Each tensor travels under a tag of its own
(kind, sending stage, microbatch, part), so the transfers between one pair of ranks (both directions
of a V, several interleaved stages) may arrive in any order. Sends are posted with
``dist.batch_isend_irecv`` and not waited for (a finished one is let go at the next send, its buffer
with it); receives are posted ahead and waited for where the schedule puts them.

    >>> Wire.header_fields([torch.zeros(2, 3)])[:5]
    [1, 0, 2, 2, 3]
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from hpfunc import comm
from hpfunc import tree as _tree
from hpfunc.mesh import Mesh
from hpfunc.schedules import ActionKind
from hpfunc.transforms import shape_header
from hpfunc.transforms.shape_header import HEADER_LEN as _HEADER
from hpfunc.transforms.shape_header import MAX_TENSORS
from hpfunc.transforms.pipeline.errors import PipelineError
from hpfunc.transforms.pipeline.timeline import event

__all__ = ["MAX_TENSORS", "Wire", "PendingRecv"]

K = ActionKind

_KIND_TAG = {K.SEND_F: 0, K.RECV_F: 0, K.SEND_B: 1, K.RECV_B: 1}


def _drop_finished(works: list) -> None:
    """Remove the finished works from ``works`` (in place), raising the error of a failed one."""
    keep = []
    for w in works:
        if w.is_completed():
            w.wait()  # returns at once; raises if the send failed
        else:
            keep.append(w)
    works[:] = keep


class Wire:
    """The transfers of one pipeline rank over the mesh axis ``axis`` (see the module docstring).

    ``num_stages``, ``num_microbatches``: the schedule's (they number the tags); ``early_headers``: the
    front door's mode, where a forward receive is posted early with the first microbatch's shapes while
    the sender's header still comes (it is then checked against them)."""

    def __init__(self, mesh: Mesh, axis: str, num_stages: int, num_microbatches: int, *, early_headers: bool):
        self.mesh, self.axis = mesh, axis
        self.group = mesh.group(axis)
        self.device = torch.device(mesh.device_type)  # headers and received buffers live there (NCCL)
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self.early_headers = early_headers
        # (sending stage, microbatch, the microbatch's shapes) -> the shapes and dtypes the stage sent: a
        # forward message carries a header naming them the first time only (see the module docstring); a
        # stage whose outputs then change shape is an error.
        self.boundary: dict[tuple, list[tuple[tuple[int, ...], torch.dtype]]] = {}

    def global_rank(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def tag(self, kind: ActionKind, stage: int, mb: int, part: int) -> int:
        # Named by the sending stage: a RECV_F names the receiving stage (sender s - 1), a RECV_B
        # too (sender s + 1).
        if kind is K.RECV_F:
            stage -= 1
        elif kind is K.RECV_B:
            stage += 1
        m, n = self.num_microbatches, self.num_stages
        return ((_KIND_TAG[kind] * n + stage) * m + mb) * (MAX_TENSORS + 1) + part

    @staticmethod
    def boundary_key(sender: int, i: int, mb: Any) -> tuple:
        return (sender, i, tuple((tuple(x.shape), x.dtype) for x in _tree.leaves(mb) if isinstance(x, torch.Tensor)))

    def note_arrived(self, sender: int, i: int, mb: Any, got: Sequence[torch.Tensor]) -> list:
        """What a forward receive brought: remembered as the shapes of its key; returned as ``(shape, dtype)`` pairs."""
        like = [(tuple(t.shape), t.dtype) for t in got]
        self.boundary.setdefault(self.boundary_key(sender, i, mb), like)
        return like

    def forward_header(self, tensors: Sequence[torch.Tensor], action: Any, mb: Any) -> bool:
        """Whether this forward message carries a header: the first time its key is sent (see ``boundary``)."""
        key = self.boundary_key(action.stage, action.microbatch, mb)
        shapes = [(tuple(t.shape), t.dtype) for t in tensors]
        known = self.boundary.get(key)
        if known is None:
            self.boundary[key] = shapes
            return True
        if known != shapes:
            raise PipelineError(f"{action}: stage {action.stage} now outputs {shapes} for microbatch "
                                f"{action.microbatch}, but output {known} for a microbatch of the same shapes in an "
                                f"earlier step; the receiving rank posts its buffers from those, so a stage's output "
                                f"shapes must follow from its microbatch's shapes")
        return False

    @staticmethod
    def header_fields(tensors: Sequence[torch.Tensor], where: Any = "send") -> list[int]:
        """The header of ``tensors`` (:mod:`hpfunc.transforms.shape_header`'s layout): their count, then per
        tensor its dtype's index, its rank and its shape."""
        try:
            return shape_header.encode(tensors)
        except ValueError as e:
            raise PipelineError(f"{where}: {e}") from None

    def send(self, tensors: Sequence[torch.Tensor], action: Any, pending: list, *, header: bool) -> None:
        """Post ``action``'s send of ``tensors`` (with a header first if ``header``); its works join ``pending``."""
        peer = self.global_rank(action.peer)
        ops = []
        if header:
            self.header_fields(tensors, f"stage {action.stage}")  # the stage's wording for what cannot be sent
            # on the device (NCCL sends no host tensor), copied from pinned memory without a host wait
            ops.append(shape_header.header_send_op(tensors, peer, self.group,
                                                   self.tag(action.kind, action.stage, action.microbatch, 0), self.device))
        for j, t in enumerate(tensors):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, self.group,
                                  self.tag(action.kind, action.stage, action.microbatch, j + 1)))
        event("send", action)
        collectors = comm.active()
        if collectors:  # the counter sees pipeline traffic: each message's bytes (the header apart)
            phase = "forward" if action.kind is K.SEND_F else "backward"
            n = self.mesh.axis_size(self.axis)
            if header:
                comm.record(collectors, op="send", name="pipeline_header", axes=(self.axis,), n=n,
                            payload_bytes=_HEADER * 8, phase=phase, tag="header", sent_bytes=Fraction(_HEADER * 8))
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            comm.record(collectors, op="send", name="pipeline_" + ("activations" if phase == "forward" else "grads"),
                        axes=(self.axis,), n=n, payload_bytes=nbytes, phase=phase, sent_bytes=Fraction(nbytes))
        if ops:
            _drop_finished(pending)  # a finished send's work holds its buffer: let it go now, not at the end
            pending.extend(dist.batch_isend_irecv(ops))

    def post_recv(self, action: Any, like: Sequence[Any] | None, *, header: bool = True) -> "PendingRecv":
        """Post the receive of ``action`` now (non-blocking): the payload into buffers shaped like
        ``like`` (tensors, or ``(shape, dtype)`` pairs), or, with ``like=None``, its header first (then
        the payload is posted once the header has arrived, at :meth:`PendingRecv.wait`). ``header=False``:
        a forward message whose sender sends no header (its shapes are known from an earlier step)."""
        peer = self.global_rank(action.peer)
        kind, s, i = action.kind, action.stage, action.microbatch
        pending = PendingRecv(self, action, peer)
        if like is None:
            pending.header, op = shape_header.header_recv_op(peer, self.group, self.tag(kind, s, i, 0), self.device)
            pending.works = dist.batch_isend_irecv([op])
        else:
            if header and self.early_headers and kind is K.RECV_F:  # the sender's header still comes: take it too
                pending.header, op = shape_header.header_recv_op(peer, self.group, self.tag(kind, s, i, 0), self.device)
                pending.header_ops = [op]
            pending.post_payload([torch.empty_like(t) if isinstance(t, torch.Tensor)
                                  else torch.empty(t[0], dtype=t[1], device=self.device) for t in like])
        event("post", action)
        return pending

    def post_forward_recv(self, action: Any, like: Sequence[Any] | None, mb: Any) -> "PendingRecv":
        """Post a forward receive: into buffers of the shapes the sender told in an earlier step (no
        header comes, see ``boundary``), else shaped ``like`` with the header checked against them, or
        (``like=None``) header first."""
        known = self.boundary.get(self.boundary_key(action.stage - 1, action.microbatch, mb))
        return self.post_recv(action, like) if known is None else self.post_recv(action, known, header=False)

    @staticmethod
    def finish_sends(pending: list) -> None:
        """Wait for the sends still in flight (the end of a step)."""
        for w in pending:
            w.wait()
        pending.clear()


class PendingRecv:
    """A posted receive: its header (forward messages name their shapes) and payload works."""

    __slots__ = ("wire", "action", "peer", "header", "header_ops", "works", "bufs")

    def __init__(self, wire: Wire, action: Any, peer: int):
        self.wire, self.action, self.peer = wire, action, peer
        self.header: torch.Tensor | None = None
        self.header_ops: list = []
        self.works: list = []
        self.bufs: list[torch.Tensor] | None = None

    def post_payload(self, bufs: list[torch.Tensor]) -> None:
        a, wire = self.action, self.wire
        self.bufs = bufs
        ops = self.header_ops + [dist.P2POp(dist.irecv, b, self.peer, wire.group,
                                            wire.tag(a.kind, a.stage, a.microbatch, j + 1)) for j, b in enumerate(bufs)]
        self.header_ops = []
        if ops:
            self.works += dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        if self.bufs is None:  # the header told the shapes: receive the payload now
            bufs = [torch.empty(shape, dtype=dtype, device=self.wire.device)
                    for shape, dtype in shape_header.decode(self.header.tolist())]
            self.post_payload(bufs)
            for w in self.works:
                w.wait()
            self.works = []
        elif self.header is not None:  # posted early with the first microbatch's shapes: the header must agree
            told = shape_header.decode(self.header.tolist())
            for j, b in enumerate(self.bufs):
                shape, dtype = told[j] if j < len(told) else ((), None)
                if len(told) != len(self.bufs) or shape != tuple(b.shape) or dtype != b.dtype:
                    raise PipelineError(f"{self.action}: stage input {j} arrived as {shape} but the first "
                                        f"microbatch's was {tuple(b.shape)}; microbatches of one step must "
                                        f"give every stage inputs of one shape")
        event("arrived", self.action)
        return self.bufs
