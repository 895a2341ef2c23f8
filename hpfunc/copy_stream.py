"""Copies between host and device memory beside the compute: a copy stream, events, pinned buffers.

:func:`to_host` and :func:`to_device` move lists of tensors between a device and host memory the way
state offload needs them (:meth:`hpfunc.transforms.plans.Plan.with_state_offload`, the optimizer's
:func:`hpfunc.optim.update_and_apply`):

* on a CUDA device, host buffers are pinned and the copies run on a side stream (a ``torch.cuda.Stream``
  of the device) after the work already queued on the current stream; ``to_host`` keeps each device
  block from being reused until its copy ends (``record_stream``) and returns an event that marks the
  copies' end; ``to_device`` makes the current stream wait for its copies (an event, no host wait), so
  nothing here makes the host wait for the device;
* on fake devices (``FakeTensorMode``, the dry run and the tests' fake CUDA) the same tensors are made,
  shapes only, with ``non_blocking`` copies (no host sync is recorded);
* on the CPU the copies are synchronous, into distinct buffers: a host copy is a copy, as on an
  accelerator (code that forgets to copy back is then as wrong on the CPU as on a GPU).

    >>> import torch
    >>> x = torch.arange(4.0)
    >>> [h], done = to_host([x])
    >>> h.data_ptr() != x.data_ptr(), torch.equal(h, x), done is None
    (True, True, True)
    >>> [d] = to_device([h], torch.device("cpu"))
    >>> torch.equal(d, x)
    True
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["is_shape_only", "on_real_cuda", "copy_stream_for", "to_host", "to_device", "start_to_device", "Incoming",
           "join"]


def is_shape_only(t: torch.Tensor) -> bool:
    """A fake (``FakeTensorMode``) or meta tensor: a shape without memory to copy."""
    return isinstance(t, FakeTensor) or t.is_meta


def on_real_cuda(t: torch.Tensor) -> bool:
    """``t`` is in the memory of a CUDA device this process drives (not a fake one)."""
    return t.device.type == "cuda" and not is_shape_only(t) and torch.cuda.is_available()


def copy_stream_for(device: torch.device) -> Any:
    """A side stream of ``device`` for copies (``None`` where there is no real CUDA device: the copies of
    this module are then made at once)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.Stream(device)


def to_host(tensors: Sequence[torch.Tensor], *, pin: bool | None = None,
            stream: Any = None) -> tuple[list[torch.Tensor], Any]:
    """Host copies of ``tensors`` (all of one device) and the event their copies end at (``None`` when
    they are done on return: CPU, fake devices).

    ``pin``: pinned host buffers (default: when the tensors are on a CUDA device). ``stream``: the side
    stream to copy on (default: a new one).
    """
    if not tensors:
        return [], None
    first = tensors[0]
    if not on_real_cuda(first):
        out = []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            h.copy_(t, non_blocking=not (t.device.type == "cpu" and not is_shape_only(t)))
            out.append(h)
        return out, None
    pin = True if pin is None else pin
    device = first.device
    stream = torch.cuda.Stream(device) if stream is None else stream
    stream.wait_stream(torch.cuda.current_stream(device))  # the values as the compute left them
    out = []
    with torch.cuda.stream(stream):
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            h.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator keeps the device block until the copy ends
            out.append(h)
        done = torch.cuda.Event()
        done.record(stream)
    return out, done


def to_device(tensors: Sequence[torch.Tensor], device: torch.device, *, after: Any = None) -> list[torch.Tensor]:
    """Device copies of the host ``tensors``; ``after``: an event (of :func:`to_host`) the copies wait for.

    On CUDA the copies run on a side stream and the current stream waits for them (the host does not).
    """
    return start_to_device(tensors, device, after=after).wait()


class Incoming:
    """Device copies under way (:func:`start_to_device`): :meth:`wait` hands them out once the current
    stream waits for them (on CUDA an event; the host never waits)."""

    __slots__ = ("tensors", "event", "device")

    def __init__(self, tensors: list[torch.Tensor], event: Any, device: torch.device):
        self.tensors, self.event, self.device = tensors, event, device

    def wait(self) -> list[torch.Tensor]:
        out, self.tensors = self.tensors, []
        if self.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.event)
            for d in out:
                d.record_stream(current)  # made on the copy stream, used and freed on the current one
        return out


def start_to_device(tensors: Sequence[torch.Tensor], device: torch.device, *, after: Any = None,
                    stream: Any = None) -> Incoming:
    """Start device copies of the host ``tensors`` without making the current stream wait for them yet:
    on CUDA they run on ``stream`` (a side stream, default a new one) after the work queued so far and
    after the event ``after``, so that the current stream computes meanwhile (the double buffer of a
    streamed update: the next group comes in while this one is updated); :meth:`Incoming.wait` before use.

    >>> import torch
    >>> h = torch.ones(3)
    >>> [d] = start_to_device([h], torch.device("cpu")).wait()
    >>> torch.equal(d, h), d.data_ptr() != h.data_ptr()
    (True, True)
    """
    device = torch.device(device)
    if not tensors:
        return Incoming([], None, device)
    if device.type != "cuda" or not torch.cuda.is_available() or any(is_shape_only(t) for t in tensors):
        if device.type == "cpu":
            return Incoming([t.detach().clone() for t in tensors], None, device)  # a distinct "device" copy
        return Incoming([t.detach().to(device, non_blocking=True) for t in tensors], None, device)
    stream = torch.cuda.Stream(device) if stream is None else stream
    stream.wait_stream(torch.cuda.current_stream(device))
    if after is not None:
        stream.wait_event(after)
    out = []
    with torch.cuda.stream(stream):
        for t in tensors:
            d = torch.empty(t.shape, dtype=t.dtype, device=device)
            d.copy_(t, non_blocking=True)
            out.append(d)
        done = torch.cuda.Event()
        done.record(stream)
    return Incoming(out, done, device)


def join(event: Any, device: torch.device) -> None:
    """Make the current stream of ``device`` wait for ``event`` (of :func:`to_host`; ``None``: nothing to
    wait for): work queued after, the next step's copies in included, starts after those copies end,
    and the host does not wait."""
    if event is not None:
        torch.cuda.current_stream(torch.device(device)).wait_event(event)
