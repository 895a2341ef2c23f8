"""One step of a pipeline rank's schedule: the actions front to back, one method per action kind.

:class:`Run` holds what a step carries between actions -- the microbatches, the stage inputs received or
handed over in memory, the messages waiting for their ``SEND``, what each forward saved for its backward,
the losses -- and :meth:`Run.run` dispatches every action of the rank's row to its method
(:data:`Run.HANDLERS`). The parameters and gradients are :class:`~hpfunc.transforms.pipeline.stage_params.StageParams`'s,
the transfers :class:`~hpfunc.transforms.pipeline.wire.Wire`'s.

    >>> sorted(k.name for k in Run.HANDLERS)[:4]
    ['B', 'BW', 'F', 'RECV_B']
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from hpfunc import saved_tensors
from hpfunc import tree as _tree
from hpfunc.schedules import ActionKind
from hpfunc.transforms.activation_swap import ActivationSwap
from hpfunc.transforms.backward_split import BackwardState, backward_input, backward_weight
from hpfunc.transforms.pipeline.errors import PipelineError, Where
from hpfunc.transforms.pipeline.stage_params import StageParams, is_diff
from hpfunc.transforms.pipeline.timeline import event
from hpfunc.transforms.pipeline.wire import MAX_TENSORS, PendingRecv

__all__ = ["Run"]

K = ActionKind
_COMPUTES = (K.F, K.B, K.W, K.BW)


def _as_tuple(y: Any, where: Any) -> tuple[torch.Tensor, ...]:
    ys = (y,) if isinstance(y, torch.Tensor) else tuple(y) if isinstance(y, (tuple, list)) else None
    if ys is None or not all(isinstance(t, torch.Tensor) for t in ys):
        raise PipelineError(f"{where}: a stage that is not the last must return a tensor or a tuple of tensors; "
                            f"found {type(y).__name__}")
    if len(ys) > MAX_TENSORS:
        raise PipelineError(f"{where}: at most {MAX_TENSORS} tensors can pass between stages, found {len(ys)}")
    return ys


class Saved:
    """What a stage's forward on one microbatch leaves for its backward."""

    __slots__ = ("inputs", "outputs", "params", "param_pos", "out_grads", "done_b", "weight_state", "swap")

    def __init__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], params: list[torch.Tensor],
                 param_pos: list[int], swap: ActivationSwap | None = None):
        self.inputs = inputs        # differentiable inputs (requires_grad leaves), [] for stage 0
        self.outputs = outputs      # differentiable outputs, or [scaled loss] on the last stage
        self.params = params        # the parameter leaves this forward used
        self.param_pos = param_pos  # the positions of the differentiable ones among them
        self.out_grads: list[torch.Tensor] | None = None
        self.done_b = False
        self.weight_state: BackwardState | None = None  # what B kept for W (the gradients at the use sites)
        self.swap = swap            # the saved tensors, when the schedule swaps this stage-microbatch


class Run:
    """One execution of this rank's actions (see the module docstring). ``step``: the
    :class:`~hpfunc.transforms.pipeline.step.PipelineStep`; ``mbs``: the microbatches; ``closed``:
    whether a full backward may leave its targets unnamed (the stages' graphs end at their own leaves)."""

    def __init__(self, step: Any, params: StageParams, mbs: list[Any], closed: bool):
        sched = step.schedule
        self.step, self.params, self.mbs, self.closed = step, params, mbs, closed
        self.wire = step.wire
        self.m, self.last = sched.num_microbatches, sched.num_stages - 1
        self.stage_to_rank, self.pp_index = sched.stage_to_rank, step.pp_index
        self.inputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # stage inputs, received or handed over
        self.outbox: dict[tuple[ActionKind, int, int], list[torch.Tensor]] = {}  # messages waiting for their SEND
        self.saved: dict[tuple[int, int], Saved] = {}
        self.losses: list[torch.Tensor] = []
        self.auxes: list[Any] = []
        self.pending: list = []  # sends in flight
        # Receives are posted as early as their buffers are known, so that the transfer runs while this
        # rank computes other microbatches: a gradient's as soon as the forward made the outputs it
        # mirrors; in the front door's mode (microbatches of one shape) every later forward input of a
        # stage once the first one told the shapes. Each is waited for where the schedule puts it.
        self.recv_b = step.recv_b
        self.recv_f = step.recv_f
        self.posted: dict[tuple, PendingRecv] = {}

    def run(self) -> tuple[list[torch.Tensor], list[Any], dict[int, Any]]:
        handlers, final_at = self.HANDLERS, self.step.grads_final_at
        for k, a in enumerate(self.step.actions):
            where = Where(self.pp_index, k, a)
            compute = a.kind in _COMPUTES
            if compute:
                event("start", a)
            handlers[a.kind](self, a.stage, a.microbatch, a, where)
            if compute:
                event("end", a)
            if k in final_at:  # the stage's last weight gradient: its data-parallel reduction starts
                self.params.gradients_final(a.stage)
        if self.posted:  # pragma: no cover - every posted receive has its RECV action
            raise PipelineError(f"pp rank {self.pp_index}: receives posted but never waited for: {sorted(self.posted)}")
        self.wire.finish_sends(self.pending)
        if self.saved:
            left = ", ".join(f"{s}:{i}" for s, i in sorted(self.saved))
            raise PipelineError(f"pp rank {self.pp_index}: schedule ended with backward work left for (stage:mb) {left}")
        return self.losses, self.auxes, self.params.result()

    # -- compute ------------------------------------------------------------------------------------
    def forward(self, s: int, i: int, a: Any, where: Any) -> None:
        """``F``: the stage's forward on microbatch ``i`` (the loss on the last stage); its outputs go to
        the next stage (in memory, or the outbox for ``SEND_F``); a gradient receive is posted now."""
        self._forward(s, i, where)
        rb = self.recv_b.get((s, i))
        if rb is not None and (s, i) in self.saved:
            self.posted[(K.RECV_B, s, i)] = self.wire.post_recv(rb, self.saved[(s, i)].outputs)

    def _forward(self, s: int, i: int, where: Any) -> None:
        # A method of its own, so that no local (the outputs, the inputs) outlives the action: a
        # loop variable would keep this microbatch's graph alive until the next forward.
        step, params, mbs = self.step, self.params, self.mbs
        if not params.ready(s):  # (lands the stage's gathers in flight)
            raise PipelineError(f"{where}: stage {s} is used while its parameters are not gathered (UNSHARD)")
        if s == 0:
            x = mbs[i] if step.first_input is None else step.first_input(mbs[i])
            diff_inputs: list[torch.Tensor] = []
        else:
            raw = self.inputs.pop((s, i))
            xs = tuple(t.detach().requires_grad_(is_diff(t)) for t in raw)
            diff_inputs = [t for t in xs if is_diff(t)]
            x = xs[0] if len(xs) == 1 else xs
        p_tree = params.live_trees[s]
        swap = None
        if (s, i) in step.swapped:
            params.settle(s)  # (the swap is told the parameters: every one made now)
            # Parameters, the batch and the stage inputs are held by the step: never copied.
            swap = ActivationSwap(list(params.live[s]) + _tree.leaves(mbs[i]) + (list(xs) if s > 0 else []))
        with torch.enable_grad(), (saved_tensors.layer(swap) if swap is not None else contextlib.nullcontext()):
            if step.with_microbatch:
                y = step.stage_fns[s](p_tree, None if s == 0 else x, mbs[i])
            else:
                y = step.stage_fns[s](p_tree, x)
            if s == self.last:
                if step.with_microbatch:
                    value, aux = step.loss_fn(p_tree, y, mbs[i])
                    self.auxes.append(aux)
                else:
                    value = step.loss_fn(y, mbs[i])
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise PipelineError(f"{where}: loss_fn must return a scalar tensor, found {type(value).__name__}")
                value = value.reshape(())
                self.losses.append(value.detach())
                outs = [value * (step.loss_scale / self.m)]
        if s != self.last:
            ys = _as_tuple(y, where)
            outs = [t for t in ys if is_diff(t)]
            if self.stage_to_rank[s + 1] == self.pp_index:
                self.inputs[(s + 1, i)] = tuple(t.detach() for t in ys)
            else:
                self.outbox[(K.SEND_F, s, i)] = [t.detach() for t in ys]
        params.settle(s)  # a deferred stage's leaves its forward did not read: made before any backward
        self.saved[(s, i)] = Saved(diff_inputs, outs, params.live[s], params.diff_pos[s], swap)

    def backward_input(self, s: int, i: int, a: Any, where: Any) -> None:
        """``B``: the input gradient, keeping the gradients at the parameters' use sites for ``W``."""
        if self.saved[(s, i)].done_b:
            raise PipelineError(f"{where}: second B for stage {s} microbatch {i}")
        self._backward(s, i, want_dx=True, want_dw=False)

    def backward_weight(self, s: int, i: int, a: Any, where: Any) -> None:
        """``W``: the weight gradients from what ``B`` kept, accumulated."""
        # (no local names the record: it would keep the graph alive after W deletes it)
        if (s, i) not in self.saved or not self.saved[(s, i)].done_b:
            raise PipelineError(f"{where}: W before the B of stage {s} microbatch {i}")
        self._backward(s, i, want_dx=False, want_dw=True)

    def backward_full(self, s: int, i: int, a: Any, where: Any) -> None:
        """``BW``: both in one autograd call; the weight gradients accumulate in the leaves' ``.grad``."""
        self._backward(s, i, want_dx=True, want_dw=True)

    def _backward(self, s: int, i: int, *, want_dx: bool, want_dw: bool) -> None:
        sv = self.saved[(s, i)]
        outs, gouts = [], []
        for k, y in enumerate(sv.outputs):
            if y.requires_grad:
                outs.append(y)
                gouts.append(None if sv.out_grads is None else sv.out_grads[k])
        dx_inputs = sv.inputs if want_dx else []
        ks = sv.param_pos
        p_inputs = [sv.params[k] for k in ks]
        dx: list[torch.Tensor | None] = []
        dw: Sequence[torch.Tensor | None] = []
        if want_dx and want_dw:  # BW: one pass; the weight gradients accumulate in the leaves' .grad
            targets = dx_inputs + p_inputs
            if outs and targets:
                # A closed stage's graph ends at its own fresh leaves (parameters and inputs, every one a
                # target), so naming them changes nothing but costs the engine a marking pass over the
                # graph and a lookup per node (1-2% of a Qwen3 stage's backward); see PipelineStep.execute.
                torch.autograd.backward(outs, grad_tensors=gouts, inputs=None if self.closed else targets)
                dx = [x.grad for x in dx_inputs]
        elif want_dx:  # B: dx, keeping the gradients at the parameters' use sites for W
            dx, sv.weight_state = backward_input(outs, gouts, dx_inputs, p_inputs)
        elif sv.weight_state is not None:  # W: weight gradients only, from what B kept
            dw = backward_weight(sv.weight_state)
            sv.weight_state = None
        if want_dx and s > 0:
            dx = [torch.zeros_like(x) if g is None else g for x, g in zip(sv.inputs, dx)]
            if self.stage_to_rank[s - 1] == self.pp_index:
                self.saved[(s - 1, i)].out_grads = dx
            else:
                self.outbox[(K.SEND_B, s, i)] = dx
        if want_dw:
            if p_inputs:
                self.params.accumulate(s, ks, dw)
            del self.saved[(s, i)]
        else:
            sv.done_b = True

    # -- transfers ----------------------------------------------------------------------------------
    def send_forward(self, s: int, i: int, a: Any, where: Any) -> None:
        """``SEND_F``: post the stage's outputs to the next stage's rank (a header the first time)."""
        tensors = self.outbox.pop((K.SEND_F, s, i))
        self.wire.send(tensors, a, self.pending, header=self.wire.forward_header(tensors, a, self.mbs[i]))

    def recv_forward(self, s: int, i: int, a: Any, where: Any) -> None:
        """``RECV_F``: wait for the stage's input (posting it now if it was not posted ahead); in the front
        door's mode the first one tells the shapes, and the stage's later inputs are posted then."""
        mbs, wire = self.mbs, self.wire
        got = self.posted.pop((K.RECV_F, s, i), None) or wire.post_forward_recv(a, None, mbs[i])
        got = tuple(got.wait())
        self.inputs[(s, i)] = got
        like = wire.note_arrived(s - 1, i, mbs[i], got)
        later_ones = self.recv_f.get(s)
        if self.step.with_microbatch and later_ones and later_ones[0] is a:
            for later in later_ones[1:]:
                j = later.microbatch
                self.posted[(K.RECV_F, s, j)] = wire.post_forward_recv(later, like, mbs[j])

    def send_backward(self, s: int, i: int, a: Any, where: Any) -> None:
        """``SEND_B``: post the input gradient to the previous stage's rank."""
        self.wire.send(self.outbox.pop((K.SEND_B, s, i)), a, self.pending, header=False)

    def recv_backward(self, s: int, i: int, a: Any, where: Any) -> None:
        """``RECV_B``: wait for the gradient of the stage's outputs (posted at its forward)."""
        got = self.posted.pop((K.RECV_B, s, i), None)
        self.saved[(s, i)].out_grads = (got or self.wire.post_recv(a, self.saved[(s, i)].outputs)).wait()

    # -- FSDP -----------------------------------------------------------------------------------------
    def unshard(self, s: int, i: int, a: Any, where: Any) -> None:
        """``UNSHARD``: gather the stage's parameters (a no-op without an FSDP axis)."""
        if self.params.fsdp:
            self.params.unshard(s)

    def reshard(self, s: int, i: int, a: Any, where: Any) -> None:
        """``RESHARD``: drop the stage's gathered parameters (a no-op without an FSDP axis)."""
        if self.params.fsdp:
            self.params.reshard(s)

    def reduce_grad(self, s: int, i: int, a: Any, where: Any) -> None:
        """``REDUCE_GRAD``: reduce the stage's gradients over the FSDP axis (a no-op without one)."""
        if self.params.fsdp:
            self.params.reduce_grad(s)

    # -- swaps ----------------------------------------------------------------------------------------
    def _swap_record(self, s: int, i: int, where: Any) -> Saved:
        rec = self.saved.get((s, i))
        if rec is None or rec.swap is None:
            raise PipelineError(f"{where}: nothing to swap: stage {s} microbatch {i} has no forward pending "
                                f"on this rank (SWAP_OUT/SWAP_IN go between F and its backward)")
        return rec

    def swap_out(self, s: int, i: int, a: Any, where: Any) -> None:
        """``SWAP_OUT``: move the stage-microbatch's saved activations to host memory."""
        rec = self._swap_record(s, i, where)
        # The outputs stay: the step holds them (backward roots, send buffers) anyway.
        rec.swap.swap_out(keep=rec.outputs)

    def swap_in(self, s: int, i: int, a: Any, where: Any) -> None:
        """``SWAP_IN``: bring them back into device memory (before the backward that needs them)."""
        self._swap_record(s, i, where).swap.swap_in()

    HANDLERS = {K.F: forward, K.B: backward_input, K.W: backward_weight, K.BW: backward_full,
                K.SEND_F: send_forward, K.RECV_F: recv_forward, K.SEND_B: send_backward, K.RECV_B: recv_backward,
                K.UNSHARD: unshard, K.RESHARD: reshard, K.REDUCE_GRAD: reduce_grad,
                K.SWAP_OUT: swap_out, K.SWAP_IN: swap_in}
