"""Host values onto a device without making the host wait: pinned buffers and ``non_blocking`` copies.

A copy from ordinary (pageable) host memory to a CUDA device with ``non_blocking=False`` (``x.to("cuda")``,
``torch.tensor(values, device="cuda")``) makes torch synchronize the stream after it: the host waits
for every kernel queued before. From pinned (page-locked) memory with ``non_blocking=True`` the copy is
queued on the stream like a kernel and the host goes on. :func:`put` does that for a pytree of host
tensors (a training batch), :func:`literal` for a few host numbers (a pipeline's shape header):

* on a CUDA device torch drives: pinned host copies (torch's caching host allocator keeps each buffer
  until its copy on the stream has run), ``non_blocking`` copies on the current stream, or on
  ``stream`` when given (a copy stream: the caller makes the compute stream wait for it);
* on fake devices (``FakeTensorMode``: the dry run, the fake-CUDA tests) the same copies, ``non_blocking``,
  without pinning (there is no memory to pin); no host sync is recorded;
* on the CPU nothing moves: the tensors are returned as they are (no copy, nothing pinned).

:func:`put_blocks` does it for a batch split over a mesh (the global batch, the same on every rank): only
this rank's block of each leaf travels, and the result is a DTensor laid out as the spec says (what
``shard_map`` and ``hpfunc.parallelize`` take as they are, without slicing on the device).

    >>> import torch
    >>> b = {"tokens": torch.arange(6).view(2, 3)}
    >>> put(b, torch.device("cpu"))["tokens"] is b["tokens"]
    True
    >>> literal([3, 1, 4], torch.int64, torch.device("cpu")).tolist()
    [3, 1, 4]
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hpfunc import tree as _tree
from hpfunc.copy_stream import is_shape_only

__all__ = ["put", "put_blocks", "literal", "pins"]


def pins(device: torch.device | str) -> bool:
    """Whether host tensors bound for ``device`` are pinned first: a CUDA device of a process that has
    CUDA (a fake CUDA device has no memory to pin; the CPU needs no copy).

    >>> pins("cpu"), pins(torch.device("cuda")) == torch.cuda.is_available()
    (False, True)
    """
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _put_one(x: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if x.device == device or (x.device.type == device.type and device.index is None):
        return x
    if pin and x.device.type == "cpu" and not is_shape_only(x) and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def put(batch: Any, device: torch.device | str, *, stream: Any = None) -> Any:
    """``batch`` (a pytree whose tensor leaves are on the host) on ``device``: pinned and copied
    ``non_blocking`` on CUDA (on ``stream`` when given, else the current stream), copied ``non_blocking``
    on a fake device, returned unchanged on the CPU. Leaves that are not tensors, or already on
    ``device``, are kept."""
    device = torch.device(device)
    if device.type == "cpu":
        return batch
    pin = pins(device)

    def move(x: Any) -> Any:
        return _put_one(x, device, pin) if isinstance(x, torch.Tensor) else x

    if stream is None:
        return _tree.tree_map(move, batch)
    with torch.cuda.stream(stream):
        return _tree.tree_map(move, batch)


def literal(values: Sequence[int | float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A 1-d tensor of ``values`` on ``device``, made on the host and copied without a host wait
    (pinned, ``non_blocking``) where ``torch.tensor(values, device=device)`` would synchronize."""
    return put(torch.tensor(list(values), dtype=dtype), device)


def put_blocks(batch: Any, mesh: Any, spec: Any, *, stream: Any = None) -> Any:
    """``batch`` (a pytree of host tensors holding the global values, the same on every rank) as DTensors
    on ``mesh`` laid out by ``spec`` (an :class:`hpfunc.sharding.P` for every leaf; a parallelized step's
    ``plan.batch_spec(mesh)``), of which only this rank's block is copied to the mesh's device (pinned,
    ``non_blocking``, on ``stream`` when given, as :func:`put`). On a CPU mesh the blocks are views of
    the host tensors (nothing is copied). Leaves that are not tensors are kept.

    Raises:
      ValueError: a leaf whose dimension does not divide over the spec's mesh axes, naming its path.

    A sketch (on a mesh ``{dp: 2}`` of CUDA ranks; a doctest cannot start ranks)::

        batch = put_blocks({"tokens": host_tokens}, mesh, P("dp"))   # rank r copies rows [r B/2, (r+1) B/2)
        state, metrics = train_step(state, batch)                    # the step slices nothing
    """
    from hpfunc.sharding import _wrap_local, as_spec, spec_to_placements

    spec = as_spec(spec)
    device = torch.device(mesh.device_type)
    pin = pins(device)

    def block(path: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        placements = spec_to_placements(spec, mesh, x.ndim, where=path)
        local = x
        for d in range(x.ndim):
            axes = spec.dim_axes(d)
            n = mesh.axis_size(axes)
            if n == 1:
                continue
            if x.shape[d] % n:
                raise ValueError(f"put_blocks: leaf {path!r} of shape {tuple(x.shape)}: dimension {d} does not "
                                 f"divide over the mesh axes {axes} ({n} ranks); make it a multiple of {n}")
            k = x.shape[d] // n
            local = local.narrow(d, mesh.axis_index(axes) * k, k)
        local = local.contiguous()  # (a block of dimension 0 of a contiguous tensor is one already)
        if device.type != "cpu":
            local = _put_one(local, device, pin)  # this rank's block alone travels
        return _wrap_local(local, mesh, placements, tuple(x.shape))

    def run() -> Any:
        return _tree.map_with_path(block, batch)

    if stream is None:
        return run()
    with torch.cuda.stream(stream):
        return run()
