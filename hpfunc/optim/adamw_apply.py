"""AdamW's update and apply in one pass: the :class:`~hpfunc.optim.base.FusedUpdate` of ``adamw``.

``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)`` followed by ``apply_updates``
makes 7 new tensors per leaf and 11 passes over memory; on a small model the optimizer then costs
about twice ``torch.optim.AdamW``'s in-place step. This computes the same new state and params the
way torch's foreach AdamW does::

    m <- lerp(m, g, 1 - b1)        v <- b2 v + (1 - b2) g^2
    p <- p (1 - lr wd) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)

For contiguous fp32 or fp64 leaves of one device (and no ``eps_root``, which torch lacks) it runs
torch's fused AdamW kernel, ``torch._fused_adamw_`` (what ``torch.optim.AdamW(fused=True)`` runs): one
pass over each leaf's parameter, gradient and two moments, bit for bit ``AdamW(fused=True)``'s result
(within an ulp of the foreach form's) and on CPU about 3.5x faster than the foreach form (0.62 against
2.2 ms a step on 722,048 parameters). Otherwise it computes the formula the way torch's foreach AdamW
does, in 4 new tensors (m, v, the denominator, p) and 8 passes, bit for bit torch's foreach result on
plain tensors of one dtype. The state is the chain's own (``ScaleByAdamState``, the decay's, the
rate's), so the two paths are interchangeable step by step and checkpoints do not change. With
``donate=True`` both write into the old moments and params (in place, as torch does; the kernel then
makes no new tensor, the foreach form only the denominator); without, the kernel updates copies. The
foreach form takes the leaves in groups of about a million elements (:data:`_CHUNK_ELEMENTS`), so that
its temporaries stay small enough for the allocator to reuse (values unchanged: every op is
elementwise).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from hpfunc.copy_stream import is_shape_only
from hpfunc.optim import _ops, _tree
from hpfunc.optim.adam import ScaleByAdamState
from hpfunc.optim.base import (
    EmptyState, OptState, Params, UpdateFn, Updates, apply_updates, stream_group_bytes, stream_params_in,
    stream_state_in, streamed_kinds,
)
from hpfunc.optim.combine import MaskedState, mask_flags
from hpfunc.optim.scale import ScalarOrSchedule, ScaleByScheduleState
from hpfunc.optim.schedules import Tabled

__all__ = ["adamw_apply"]


def adamw_apply(chain_update: UpdateFn, *, b1: float, b2: float, eps: float, eps_root: float,
                weight_decay: float, mask: Any, learning_rate: ScalarOrSchedule) -> Callable:
    """``apply(grads, state, params) -> (new_params, new_state)`` of ``adamw(...)`` whose chain's
    update is ``chain_update``; a state or leaves it cannot fuse go through ``chain_update`` and
    ``apply_updates`` (which also raise the chain's errors for a malformed state)."""
    masks: dict = {}  # (structure, shapes) -> which leaves decay: the mask reads paths and shapes only

    def decays(grads: Any, leaves: list[torch.Tensor], spec: Any) -> list[bool]:
        if mask is None:
            return [True] * len(leaves)
        key = (spec, tuple(tuple(x.shape) for x in leaves))
        hit = masks.get(key)
        if hit is None:
            hit = masks[key] = mask_flags(mask, grads)
        return hit

    def fallback(grads: Updates, state: OptState, params: Params) -> tuple[Params, OptState]:
        params = stream_params_in(params, grads)  # parameters held in host memory: to the gradients' device
        updates, new_state = chain_update(grads, state, params)
        return apply_updates(params, updates), new_state

    @torch.no_grad()
    def apply(grads: Updates, state: OptState, params: Params, *, donate: bool = False) -> tuple[Params, OptState]:
        if not _fusable_state(state, mask is not None, callable(learning_rate)) or params is None:
            return fallback(grads, stream_state_in(state, params, grads), params)
        adam, decay_state, rate_state = state
        (g, m, v, p), spec = _tree.flatten_aligned([grads, adam.mu, adam.nu, params],
                                                   ["updates", "state.mu", "state.nu", "params"], "adamw")
        if not g:
            return fallback(grads, stream_state_in(state, params, grads), params)
        # inside streaming_state: the moments and / or parameters held in host memory come by groups
        group_bytes = stream_group_bytes()
        held_m, held_p = streamed_kinds()
        held_m = held_m and _held_like(m, v, g)
        p_held = [held_p and x.device.type == "cpu" for x in p]
        streamed = (group_bytes is not None and eps_root == 0.0 and (held_m or any(p_held))
                    and _held_like(p, p, g, p_held)  # what is on the device, as the kernel takes it:
                    and _kernel_leaves([y if h else x for x, y, h in zip(p, g, p_held)], g,
                                       g if held_m else m, g if held_m else v, shape_only=True))
        if group_bytes is not None and not streamed:  # the whole state to the device, then as without offload
            state = stream_state_in(state, params, grads)
            params = stream_params_in(params, grads)
            adam = state[0]
            (g, m, v, p), spec = _tree.flatten_aligned([grads, adam.mu, adam.nu, params],
                                                       ["updates", "state.mu", "state.nu", "params"], "adamw")
        kernel = streamed or eps_root == 0.0 and _kernel_leaves(p, g, m, v)
        if not kernel:
            if not _ops.foreachable(g, m, v, p):
                return fallback(grads, state, params)
            _tree.check_shapes(g, m, grads, "updates", "state.mu", "adamw")
            _tree.check_shapes(p, m, grads, "params", "state.mu", "adamw")
        count = adam.count + 1
        on_device = count.device.type != "cpu"  # a parallel state on a GPU mesh: never read the count
        if on_device and not kernel:
            return fallback(grads, state, params)  # the foreach path takes its step sizes as Python numbers
        lr_tensor = None  # the scheduled rate read on the device (a table of the schedule, no host sync)
        if callable(learning_rate):
            if on_device and kernel and isinstance(learning_rate, Tabled) and learning_rate.tabled:
                lr_tensor = learning_rate.at(rate_state.count).to(torch.float32)
                lr = learning_rate.bound  # the checks below take the largest rate of the schedule
            else:
                lr = float(learning_rate(int(rate_state.count)))
            new_rate_state: Any = ScaleByScheduleState(count=rate_state.count + 1)
        else:
            lr, new_rate_state = float(learning_rate), rate_state
        # on a device count the bound 1 - b1 <= bc1 (t = 1) stands in for the value
        bc1, bc2 = (1.0 - b1, None) if on_device else _ops.bias_corrections(count, b1, b2)
        top = torch.finfo(p[0].dtype).max
        decay_factor = abs(1.0 - lr * weight_decay) if lr_tensor is None else 1.0 + lr * abs(weight_decay)
        if abs(lr / bc1) > top or decay_factor > top:
            # a factor the params' dtype cannot hold (lr 1e39 in fp32): torch's foreach ops refuse such a
            # scalar; the chain multiplies in steps and gives the infinities such a rate deserves
            return fallback(grads, state, params)
        in_place = donate and _writable(p, m, v)
        flags = decays(grads, g, spec) if weight_decay != 0.0 else [False] * len(p)
        if kernel:
            # torch's fused step: an fp32 tensor on the parameters' device, counted
            step = (count.to(torch.float32) if on_device
                    else torch.tensor(float(int(count)), dtype=torch.float32, device=g[0].device))
            hyper = dict(step=step, lr=lr if lr_tensor is None else lr_tensor, b1=b1, b2=b2, eps=eps,
                         weight_decay=weight_decay)
            if streamed:
                new_p, new_m, new_v = _streamed_kernel(p, m, v, g, flags, group_bytes=group_bytes, in_place=in_place,
                                                       held_m=held_m, p_held=p_held, **hyper)
            else:
                new_p, new_m, new_v = _fused_kernel(p, m, v, g, flags, in_place=in_place, **hyper)
            new_adam = ScaleByAdamState(count=count, mu=_tree.unflatten(spec, new_m), nu=_tree.unflatten(spec, new_v))
            return _tree.unflatten(spec, new_p), (new_adam, decay_state, new_rate_state)
        new_p: list[torch.Tensor] = []
        new_m: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        for a, b in _chunks(p):
            cp, cm, cv, cg, cf = p[a:b], m[a:b], v[a:b], g[a:b], flags[a:b]
            if in_place:  # the same foreach ops into the donated buffers: the same values, no new tensors
                torch._foreach_lerp_(cm, cg, 1.0 - b1)
                torch._foreach_mul_(cv, b2)
                torch._foreach_addcmul_(cv, cg, cg, value=1.0 - b2)
                nm, nv = cm, cv
            else:
                nm, nv = _ops.adam_moments(cm, cv, cg, b1, b2)
            denom = _ops.adam_denominator(nv, bias_correction2=bc2, eps=eps, eps_root=eps_root)
            decayed = [x for x, f in zip(cp, cf) if f]
            if in_place:
                np_ = cp
                if decayed:
                    torch._foreach_mul_(decayed, 1.0 - lr * weight_decay)
            else:
                scaled = iter(torch._foreach_mul(decayed, 1.0 - lr * weight_decay) if decayed else ())
                np_ = [next(scaled) if f else x.clone() for x, f in zip(cp, cf)]
            torch._foreach_addcdiv_(np_, nm, denom, value=-lr / bc1)
            del denom
            new_p += np_
            new_m += nm
            new_v += nv
        if in_place:  # new tensor objects over the same memory: the outputs are not the inputs
            new_p, new_m, new_v = ([x.detach() for x in xs] for xs in (new_p, new_m, new_v))
        new_adam = ScaleByAdamState(count=count, mu=_tree.unflatten(spec, new_m), nu=_tree.unflatten(spec, new_v))
        return _tree.unflatten(spec, new_p), (new_adam, decay_state, new_rate_state)

    apply.streams_state = True  # type: ignore[attr-defined]  # it streams a state held in host memory itself
    return apply


def _kernel_leaves(p: list[torch.Tensor], g: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
                   shape_only: bool = False) -> bool:
    """Whether torch's fused AdamW kernel (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)``
    runs) can take these leaves (with no ``eps_root``, which torch lacks): plain tensors, all fp32 or all
    fp64 on one device, contiguous (the kernel walks each tensor's memory in order), each parameter's
    gradient and moments of its shape. One pass; a leaf that does not fit sends the step the foreach way,
    whose checks name what is wrong. ``shape_only``: fake tensors count as plain (the streamed update's
    shape-only run, which skips the kernel itself: :func:`_fused_kernel`)."""
    if _FUSED is None:
        return False
    first = p[0]
    dtype = first.dtype
    if dtype is not torch.float32 and dtype is not torch.float64:
        return False
    device = first.device
    cpu = device.type == "cpu"
    plain = _computes_plain if shape_only else _ops.plain_type
    for a, b, c, d in zip(p, g, m, v):
        for x in (a, b, c, d):
            if (not plain(type(x)) or x.dtype is not dtype or not x.is_contiguous()
                    or (not x.is_cpu if cpu else x.device != device)):
                return False
        shape = a.shape
        if b.shape != shape or c.shape != shape or d.shape != shape:
            return False
    return True


_FUSED = getattr(torch, "_fused_adamw_", None)


def _computes_plain(cls: type) -> bool:
    """``cls`` computes as a plain tensor for the kernel: a plain tensor, or a fake one (``FakeTensorMode``:
    the shape-only run of the same kernel a device runs; the dry run and the fake-device tests)."""
    return _ops.plain_type(cls) or issubclass(cls, FakeTensor)


def _fused_kernel(p: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], g: list[torch.Tensor],
                  flags: list[bool], *, step: torch.Tensor, lr: float | torch.Tensor, b1: float, b2: float, eps: float, weight_decay: float,
                  in_place: bool, state_in_place: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The update by torch's fused AdamW kernel: one pass over each leaf's parameter, gradient and
    moments, no temporaries (about 4x faster on CPU than the 8 foreach passes). It writes in place: into
    the donated buffers, else into copies (``state_in_place``: the moments in place whatever ``in_place``
    says: they are the streamed copies of a state at rest in host memory). The decayed and the other
    leaves go in two calls, as two ``torch.optim.AdamW`` parameter groups would (``weight_decay`` 0 for
    the second)."""
    if not in_place:
        p = [x.clone() for x in p]
        if not state_in_place:
            m, v = ([x.clone() for x in xs] for xs in (m, v))
    for decay in (True, False):
        idx = [k for k, f in enumerate(flags) if f is decay]
        if not idx:
            continue
        if is_shape_only(p[0]):  # fake tensors (a streamed update's dry or fake-device run): the kernel writes
            continue             # in place and makes nothing, so its shape-only run is no op at all
        pick = (lambda xs: xs) if len(idx) == len(p) else (lambda xs: [xs[k] for k in idx])
        _FUSED(pick(p), pick(g), pick(m), pick(v), [], [step] * len(idx), amsgrad=False, lr=lr, beta1=b1, beta2=b2,
               weight_decay=weight_decay if decay else 0.0, eps=eps, maximize=False, grad_scale=None,
               found_inf=None)
    if in_place:  # new tensor objects over the same memory: the outputs are not the inputs
        return ([x.detach() for x in xs] for xs in (p, m, v))  # type: ignore[return-value]
    return p, m, v


def _streamed_kernel(p: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], g: list[torch.Tensor],
                     flags: list[bool], *, group_bytes: int, in_place: bool, held_m: bool = True,
                     p_held: list[bool] | None = None,
                     **hyper: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """:func:`_fused_kernel` over moments ``m``, ``v`` held in host memory (``held_m``) and / or parameters
    held there (``p_held[k]``), streamed through the gradients' device by groups of leaves of at most
    ``group_bytes`` bytes of streamed tensors (:func:`_byte_groups`): group ``k + 1`` is copied in on a copy
    stream while group ``k`` is updated in place in its streamed copy, which is then copied back to fresh
    host buffers on another copy stream and released. About two groups are on the device at once (the copy
    in flight and the one updated), never the whole state. The values are the unstreamed kernel's bit for
    bit (it is elementwise per leaf). Returns the new params and moments: those held in host memory there,
    the others on the device; the current stream waits for the last copy back (no host wait)."""
    from hpfunc.copy_stream import copy_stream_for, join, start_to_device, to_host

    device = g[0].device
    p_held = [False] * len(p) if p_held is None else p_held

    def streamed(a: int, b: int) -> list[torch.Tensor]:  # what group [a, b) copies in: its moments, then params
        return (m[a:b] + v[a:b] if held_m else []) + [p[k] for k in range(a, b) if p_held[k]]

    sizes = [(x.numel() * x.element_size() + y.numel() * y.element_size() if held_m else 0)
             + (w.numel() * w.element_size() if h else 0) for x, y, w, h in zip(m, v, p, p_held)]
    groups = _byte_groups(sizes, group_bytes)
    streams = copy_stream_for(device), copy_stream_for(device)  # in, back: each direction on its own
    new_p: list[torch.Tensor] = []
    new_m: list[torch.Tensor] = []
    new_v: list[torch.Tensor] = []
    a, b = groups[0]
    incoming = start_to_device(streamed(a, b), device, stream=streams[0])
    done = None
    for k, (a, b) in enumerate(groups):
        here = incoming.wait()
        if k + 1 < len(groups):  # the next group comes in while this one is updated
            c, d = groups[k + 1]
            incoming = start_to_device(streamed(c, d), device, stream=streams[0])
        n = b - a
        if held_m:  # the streamed copies, updated in place
            gm, gv, rest = here[:n], here[n:2 * n], iter(here[2 * n:])
        else:  # on the device: in place only where donated
            gm, gv, rest = m[a:b], v[a:b], iter(here)
            if not in_place:
                gm, gv = [x.clone() for x in gm], [x.clone() for x in gv]
        gp = [next(rest) if p_held[j] else p[j] if in_place else p[j].clone() for j in range(a, b)]
        np_, nm, nv = _fused_kernel(gp, gm, gv, g[a:b], flags[a:b], in_place=True, **hyper)
        del here, gp, gm, gv
        back = (nm + nv if held_m else []) + [x for j, x in zip(range(a, b), np_) if p_held[j]]
        hosts, done = to_host(back, stream=streams[1]) if back else ([], done)
        del back
        got = iter(hosts[2 * n:] if held_m else hosts)
        new_p += [next(got) if p_held[j] else x for j, x in zip(range(a, b), np_)]
        new_m += hosts[:n] if held_m else nm
        new_v += hosts[n:2 * n] if held_m else nv
        del np_, nm, nv  # the device copies go (on CUDA once their copy back ends)
    join(done, device)
    return new_p, new_m, new_v


def _byte_groups(sizes: list[int], group_bytes: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: consecutive leaves (of ``sizes`` bytes streamed each) taking at most
    ``group_bytes`` bytes (one leaf at least; ``0``: one leaf per group).

    >>> _byte_groups([32, 32, 128], 64), _byte_groups([32, 32, 128], 0), _byte_groups([32, 32, 128], 1 << 20)
    ([(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)], [(0, 3)])
    """
    out, start, size = [], 0, 0
    for k, n in enumerate(sizes):
        if k > start and size + n > group_bytes:
            out.append((start, k))
            start, size = k, 0
        size += n
    if sizes:
        out.append((start, len(sizes)))
    return out


def _held_like(m: list[torch.Tensor], v: list[torch.Tensor], p: list[torch.Tensor],
               which: list[bool] | None = None) -> bool:
    """The tensors of ``m`` and ``v`` (those ``which`` flags, default all) are held in host memory, each a
    plain contiguous tensor of the shape and dtype of its leaf in ``p`` (what the streamed kernel takes;
    fake tensors too: the shape-only run of a streamed update)."""
    plain = _computes_plain
    for k, (x, y, w) in enumerate(zip(m, v, p)):
        if which is not None and not which[k]:
            continue
        for t in (x, y):
            if (not plain(type(t)) or t.device.type != "cpu" or t.dtype is not w.dtype or t.shape != w.shape
                    or not t.is_contiguous()):
                return False
    return True


# Leaves are updated in groups of at most this many elements (one leaf at least): the denominators (and
# without donation the new tensors) of one group are made and freed before the next, so the temporaries
# stay a few MiB that the allocator reuses. A whole model's denominators at once (40 MiB at 10 M fp32
# parameters) are handed back to the OS when freed and page-faulted in again every step: at 10 M
# parameters about 7,000 faults a step, ~20% of the optimizer's time on CPU.
_CHUNK_ELEMENTS = 1 << 20


def _chunks(xs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` cutting ``xs`` into consecutive groups of at most ``_CHUNK_ELEMENTS``
    elements (a larger leaf alone).

    >>> _chunks([torch.zeros(1 << 19), torch.zeros(1 << 19), torch.zeros(1 << 21), torch.zeros(3)])
    [(0, 2), (2, 3), (3, 4)]
    """
    out, start, size = [], 0, 0
    for k, x in enumerate(xs):
        n = x.numel()
        if k > start and size + n > _CHUNK_ELEMENTS:
            out.append((start, k))
            start, size = k, 0
        size += n
    if xs:
        out.append((start, len(xs)))
    return out


def _writable(*lists: list[torch.Tensor]) -> bool:
    """The donated leaves can take the update in place: none requires grad, no two start at the same
    memory (a leaf twice in the tree, a parameter aliasing a moment)."""
    seen: set[int] = set()
    for xs in lists:
        for x in xs:
            if x.requires_grad:
                return False
            if x.numel():
                ptr = x.data_ptr()
                if ptr in seen:
                    return False
                seen.add(ptr)
    return True


def _fusable_state(state: Any, masked: bool, scheduled: bool) -> bool:
    """``state`` is what ``adamw``'s chain's ``init`` built: ``(ScaleByAdamState, the decay's, the
    rate's)``; anything else goes through the chain (whose errors name what is wrong)."""
    if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], ScaleByAdamState)):
        return False
    decay, rate = state[1], state[2]
    if masked != isinstance(decay, MaskedState) or not masked and not isinstance(decay, EmptyState):
        return False
    return isinstance(rate, ScaleByScheduleState) if scheduled else isinstance(rate, EmptyState)
