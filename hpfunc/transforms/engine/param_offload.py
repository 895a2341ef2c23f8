"""Parameters at rest in host memory, brought to the device layer by layer (``with_state_offload("params")``).

A parameter the plan offloads reaches the step as a host block (pinned on CUDA). The differentiation
does not take that block as its autograd input: it takes an *anchor*, a device tensor of the block's
shape and dtype over one element (zero strides: no memory), so that the gradient comes back on the
device like any other parameter's (a host leaf would receive it in host memory). Wherever the engine
needs the block's values -- a group's all-gather (synchronous, prefetched, or for the backward's
re-gather) or the use of a parameter that is not gathered -- :meth:`HostParams.fill` puts a device
copy in the anchor's place; through :class:`_BringIn` the copy passes its gradient on to the anchor.
A gather needs the copy only to start: after it, nothing holds the copy and it is freed; a parameter
used as stored is claimed by the step's saved-tensor layer like a gathered group, so under reshard
after forward autograd keeps a marker and the backward copies the block in again.

The copies run on a copy stream (:func:`hpfunc.copy_stream.start_to_device`, ``non_blocking`` from
pinned memory) and, once the first run of a differentiation recorded the order of its gathers
(:mod:`~hpfunc.transforms.engine.prefetch`), one group ahead of the gather prefetch: when group ``k``
is gathered, group ``k + 1``'s blocks (copied in meanwhile) feed its prefetched all-gather and the copy of
group ``k + 2`` starts, so it runs while layer ``k`` computes. About two groups' blocks are on the device
at once. On the CPU the copies are real copies into distinct buffers (a value not copied in is as wrong
there as on a GPU).

    >>> import torch
    >>> host = HostParams({1: torch.ones(2, 3)}, torch.device("cpu"))
    >>> a = host.anchor(1); a.shape, a.untyped_storage().nbytes()
    (torch.Size([2, 3]), 4)
    >>> w = a.detach().requires_grad_(True)
    >>> [x] = host.fill([1], [w]); x.sum().backward(); float(x.detach().sum()), w.grad.shape
    (6.0, torch.Size([2, 3]))
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from hpfunc.copy_stream import Incoming, copy_stream_for, start_to_device

__all__ = ["HostParams"]


class HostParams:
    """The offloaded parameter blocks of one differentiation: ``hosts`` (index -> host block), their device
    anchors, and the copies to the device in flight (by group)."""

    __slots__ = ("hosts", "device", "stream", "flying", "_anchors")

    def __init__(self, hosts: Mapping[int, torch.Tensor], device: torch.device):
        self.hosts = dict(hosts)
        self.device = torch.device(device)
        self.stream = copy_stream_for(self.device)
        self.flying: dict[tuple[int, ...], Incoming] = {}  # members -> their copies in flight
        self._anchors: dict[int, torch.Tensor] = {}

    def anchor(self, i: int) -> torch.Tensor:
        """A device tensor shaped like host block ``i`` over one element: the autograd input in its place."""
        a = self._anchors.get(i)
        if a is None:
            h = self.hosts[i]
            a = self._anchors[i] = torch.zeros((), dtype=h.dtype, device=self.device).expand(h.shape)
        return a

    def any(self, members: Sequence[int]) -> bool:
        return any(j in self.hosts for j in members)

    def start(self, members: Sequence[int]) -> None:
        """Start copying the offloaded blocks of ``members`` to the device (if not under way already)."""
        key = tuple(j for j in members if j in self.hosts)
        if key and key not in self.flying:
            self.flying[key] = start_to_device([self.hosts[j] for j in key], self.device, stream=self.stream)

    def fill(self, members: Sequence[int], blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``blocks`` (of ``members``) with each offloaded one replaced by a device copy of its host block (the
        copy started by :meth:`start`, else one made now); where the block requires grad (an anchor) the copy
        passes its gradient on to it."""
        key = tuple(j for j in members if j in self.hosts)
        if not key:
            return list(blocks)
        incoming = self.flying.pop(key, None)
        if incoming is None:
            incoming = start_to_device([self.hosts[j] for j in key], self.device, stream=self.stream)
        copies = dict(zip(key, incoming.wait()))
        out = []
        for j, b in zip(members, blocks):
            c = copies.pop(j, None)
            if c is None:
                out.append(b)
            elif b.requires_grad and torch.is_grad_enabled():
                out.append(_BringIn.apply(b, [c]))
            else:
                out.append(c)
        return out

    def finish(self) -> None:
        """Drop the copies started and not used (a read order that changed)."""
        for incoming in self.flying.values():
            incoming.wait()
        self.flying.clear()


class _BringIn(torch.autograd.Function):
    """The device copy of an offloaded block as a function of its anchor: the values are the copy's, the
    gradient goes to the anchor unchanged (on the device)."""

    @staticmethod
    def forward(anchor: torch.Tensor, box: list) -> torch.Tensor:
        return box.pop()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g, None
