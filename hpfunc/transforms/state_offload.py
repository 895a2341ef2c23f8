"""Selective state offload: chosen state of a parallelized step rests in host memory between steps.

``plan.with_state_offload("optimizer")`` (:meth:`hpfunc.transforms.plans.Plan.with_state_offload`)
keeps every optimizer-state leaf laid out like a parameter (AdamW's two moments, Muon's momentum:
everything but the scalar counters, 2 x the fp32 parameters for AdamW) in host memory while the
forward and backward run:

1. at rest, such a leaf is a DTensor laid out as the plan says whose local block is a host tensor
   (pinned where the mesh's device is CUDA): :func:`to_rest` puts it there after ``init_state`` and
   after every step;
2. the step receives it as a host block; :func:`hpfunc.optim.update_and_apply` streams it to the
   device on a copy stream when the update needs it (:func:`hpfunc.optim.base.stream_state_in`),
   after the backward, so the forward and backward never hold it;
3. the step runs inside :func:`hpfunc.optim.streaming_state` (groups of at most the plan's
   ``offload_group_bytes``, default :data:`GROUP_BYTES`): AdamW's fused path streams the moments group by
   group (the next copied in while one is updated in place in its streamed copy, each copied back to
   fresh host buffers and released), so about two groups are on the device at once; those new leaves
   leave the step in host memory and :func:`to_rest` wraps them with the received state's layout. An
   update that cannot stream brings the whole state in (:func:`hpfunc.optim.base.stream_state_in`) and
   writes the new state on the device; :func:`to_rest` copies it back to fresh host buffers on a copy
   stream (the allocator keeps each device block until its copy ends) and the device copy goes with the
   step.

``plan.with_state_offload("params", layers=PATTERN)`` keeps the parameters whose dotted path ``PATTERN``
matches at its start (a regex, or a predicate on the path; ``None``: every parameter; a selection that
matches none is a :class:`PlanError`) in host memory the same way (:func:`offloaded_params`):

1. at rest they are DTensors of their planned storage layout with host blocks:
   :func:`hpfunc.transforms.parallelize.init_sharded` and ``shard_params`` hand them out there
   (:func:`params_to_rest`), and every step leaves the new ones there;
2. in the step the engine brings each layer's blocks to the device right before its all-gather (or
   its use, for a parameter that is not gathered) on a copy stream, one group ahead of the gather
   prefetch in the order the first run recorded, and drops the device copy after the gather; under
   reshard after forward the backward's re-gather copies it in again (its own prefetch order), so about
   two layers' blocks are on the device at once (:mod:`hpfunc.transforms.engine.param_offload`);
3. the gradients come back on the device (the autograd input is a zero-strided device *anchor* of the
   block's shape, not the host block); the update (:func:`hpfunc.optim.streaming_state` with
   ``params=True``) streams the parameter blocks through the device with the moments, group by group,
   and returns the new ones in host memory; an update that cannot stream brings the held parameters in
   whole (:func:`hpfunc.optim.base.stream_params_in`) and :func:`to_rest` copies the new ones back.

Not under a ``pp`` plan layer or for a parameter whose optimizer block is narrower than its storage
(ZeRO): a :class:`PlanError` at lowering.

The values are those of the same plan without offload, bit for bit (the same arithmetic on the same
numbers; only where they rest changes). On the CPU host and device are one memory: the copies are
real copies into distinct buffers (so a missing copy-back is as wrong there as on a GPU), and the
memory saved is measured on fake CUDA devices (``tests/gpu/test_state_offload.py``,
``tests/gpu/test_param_offload.py``), by storage liveness.

Caveats: a step must update the offloaded state through :func:`hpfunc.optim.update_and_apply` (on a
CUDA mesh a ``tx.update`` of host moments with device gradients fails on the device mismatch); an
at-rest leaf read on the host right after a step on CUDA (a checkpoint's staging) must first wait for
the copy stream (``torch.cuda.synchronize()``; :func:`hpfunc.checkpoint.async_save.stage_async` does);
``full_tensor()`` of an at-rest leaf of a CUDA mesh gathers a host block, which NCCL does not take:
move it to the device first (``x.to("cuda")``). fp32 master weights under mixed precision are not
offloaded as their own kind yet (``"params"`` keeps the fp32 storage in host memory and casts each
layer's copy per use; a bf16 device copy kept between steps is not built: docs/gpu.md).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor

from hpfunc import tree as _tree
from hpfunc.copy_stream import join, to_host
from hpfunc.layout import LeafLayout, PlanError
from hpfunc.sharding import _copy_spec
from hpfunc.transforms.engine.state import param_suffix

__all__ = ["KINDS", "GROUP_BYTES", "check_kinds", "check_group_bytes", "check_layers", "offloaded_params", "rest_paths",
           "to_rest", "params_to_rest", "on_host"]

# what with_state_offload (and the YAML's parallel.offload_state, hpfunc.train.config) can keep in host memory
KINDS = ("optimizer", "params")
# the optimizer state (bytes of moments) a streamed update brings to the device per group of leaves
GROUP_BYTES = 64 << 20


def check_kinds(what: Iterable[Any], where: str) -> tuple[str, ...]:
    """The kinds of state to offload, checked (a :class:`PlanError` names the unknown one)."""
    out = []
    for w in what:
        if w not in KINDS:
            raise PlanError(f"{where}: cannot offload {w!r}; the state that can rest in host memory is "
                            f"{', '.join(map(repr, KINDS))} (the optimizer-state leaves laid out like the "
                            f"parameters; the parameters of chosen layers)")
        out.append(w)
    if not out:
        raise PlanError(f"{where}: name what to offload, e.g. with_state_offload('optimizer')")
    return tuple(dict.fromkeys(out))


def check_group_bytes(group_bytes: Any, where: str) -> int | None:
    """``group_bytes`` checked: ``None`` (the default, :data:`GROUP_BYTES`) or an int >= 0."""
    if group_bytes is None:
        return None
    if isinstance(group_bytes, bool) or not isinstance(group_bytes, int) or group_bytes < 0:
        raise PlanError(f"{where}: group_bytes must be an int >= 0 (the bytes of optimizer state an update streams "
                        f"through the device at once; 0: leaf by leaf), found {group_bytes!r}")
    return group_bytes


def check_layers(layers: Any, kinds: tuple[str, ...], where: str) -> Any:
    """``layers`` checked: ``None`` (every parameter), a regular expression (compiled here, so a bad one
    fails now) or a predicate on the dotted parameter path; only with ``"params"``."""
    if layers is None:
        return None
    if "params" not in kinds:
        raise PlanError(f"{where}: layers= selects the parameters to offload; add 'params' to what is offloaded "
                        f"(with_state_offload('params', layers={layers!r}))")
    if isinstance(layers, str):
        try:
            re.compile(layers)
        except re.error as e:
            raise PlanError(f"{where}: layers={layers!r} is not a regular expression ({e}); write the start of the "
                            f"parameter paths to offload, e.g. r'layers\\.[0-3]\\.'") from None
        return layers
    if callable(layers):
        return layers
    raise PlanError(f"{where}: layers must be a regular expression (matched at the start of the dotted parameter "
                    f"path) or a predicate on that path, found {type(layers).__name__} {layers!r}")


def offloaded_params(kinds: tuple[str, ...], layers: Any, paths: list[str]) -> frozenset[str]:
    r"""The parameter paths (of ``paths``) that rest in host memory: with ``"params"``, those ``layers``
    selects (a regex matched at the start of the path, a predicate, or ``None``: all); a selection that
    matches none is a :class:`PlanError` naming it.

    >>> sorted(offloaded_params(("params",), r"layers\.1\.", ["embed", "layers.0.w", "layers.1.w"]))
    ['layers.1.w']
    """
    if "params" not in kinds:
        return frozenset()
    if layers is None:
        match: Callable[[str], Any] = lambda p: True  # noqa: E731
    elif isinstance(layers, str):
        match = re.compile(layers).match
    else:
        match = layers
    out = frozenset(p for p in paths if match(p))
    if not out:
        shown = ", ".join(repr(p) for p in paths[:4]) + (", ..." if len(paths) > 4 else "")
        raise PlanError(f"with_state_offload('params', layers={layers!r}) (YAML: parallel.offload_state's params): "
                        f"it selects none of the {len(paths)} parameters ({shown}); the pattern is matched at the "
                        f"start of the dotted parameter path, e.g. r'layers\\.[0-3]\\.'")
    return out


def rest_paths(kinds: tuple[str, ...], state_pairs: list[tuple[str, Any]], is_param: Mapping[int, int],
               res: Mapping[str, LeafLayout], params: frozenset[str] = frozenset(),
               param_paths: list[str] | None = None) -> frozenset[str]:
    """The dotted paths of the state leaves that rest in host memory under ``kinds``: with
    ``"optimizer"`` every tensor leaf that is not a parameter and is laid out like one (its path ends
    with a parameter's path; not a scalar); with ``"params"`` the parameter leaves whose parameter path
    (``param_paths[is_param[k]]``) is in ``params``."""
    out = set()
    if "optimizer" in kinds:
        out.update(path for k, (path, x) in enumerate(state_pairs)
                   if k not in is_param and isinstance(x, torch.Tensor) and x.ndim > 0
                   and param_suffix(path, res) is not None)
    if params and param_paths is not None:
        out.update(path for k, (path, _) in enumerate(state_pairs)
                   if k in is_param and param_paths[is_param[k]] in params)
    return frozenset(out)


def to_rest(state: Any, paths: frozenset[str], held: Mapping[str, torch.Tensor] | None = None,
            like: Mapping[str, DTensor] | None = None) -> Any:
    """``state`` with the DTensor leaves at ``paths`` moved to host memory (same layout, a host block).

    One batch of copies on a copy stream where the device is CUDA (pinned buffers); the device
    blocks are released as soon as ``state``'s old leaves are (after their copies end), and the current
    stream waits for the copies (work queued after them, the next step's copies in included, starts after
    they end; the host does not wait). ``held``: the leaves the step already returned in host memory (a
    streamed update, :func:`hpfunc.optim.streaming_state`; ``None`` in ``state``), by path, wrapped as they
    are with the layout of the DTensor at the same path of ``like`` (the state the step received)."""
    if not paths:
        return state
    held = held or {}
    found: list[tuple[str, DTensor]] = []

    def pick(path: str, x: Any) -> Any:
        if path in paths and isinstance(x, DTensor):
            found.append((path, x))
        return x

    _tree.map_with_path(pick, state)
    new: dict[str, DTensor] = {}
    if found:  # on the CPU too: a real copy into a distinct buffer
        hosts, done = to_host([x._local_tensor.detach() for _, x in found])
        join(done, found[0][1]._local_tensor.device)
        new.update((p, DTensor.__new__(DTensor, h, _copy_spec(x._spec), requires_grad=False))
                   for (p, x), h in zip(found, hosts))
    if held:
        if like is None or any(p not in like for p in held):
            raise PlanError(f"to_rest: the held leaves {sorted(held)} need the DTensors they replace (like=)")
        new.update((p, DTensor.__new__(DTensor, h, _copy_spec(like[p]._spec), requires_grad=False))
                   for p, h in held.items())
    if not new:
        return state
    return _tree.map_with_path(lambda path, x: new.get(path, x) if x is None or isinstance(x, DTensor) else x,
                               state, none_is_leaf=True)


def params_to_rest(params: Any, plan: Any) -> Any:
    """``params`` (DTensors laid out as ``plan`` stores them) with those ``plan`` offloads
    (``with_state_offload("params", layers=...)``) moved to host memory: what
    :func:`hpfunc.transforms.parallelize.init_sharded` and ``shard_params`` hand out, so that the first
    step already finds them at rest."""
    if "params" not in plan.state_offload:
        return params
    paths = [p for p, x in _tree.leaves_with_paths(params) if isinstance(x, DTensor)]
    return to_rest(params, offloaded_params(plan.state_offload, plan.offload_layers, paths))


def on_host(state: Any, paths: frozenset[str]) -> list[str]:
    """The paths of ``paths`` whose leaf in ``state`` is held in host memory (a check for tests and reports).

    >>> on_host({"m": torch.zeros(2)}, frozenset({"m"}))
    ['m']
    """
    out = []

    def see(path: str, x: Any) -> Any:
        if path in paths and isinstance(x, torch.Tensor):
            local = x._local_tensor if isinstance(x, DTensor) else x
            if local.device.type == "cpu":
                out.append(path)
        return x

    _tree.map_with_path(see, state)
    return out
