"""What the train step measures for the precision monitor, on the steps it logs and no others.

A :class:`PrecisionProbe` handed to :func:`hpfunc.train.step.make_train_step` makes every ``every``-th step
(the step whose number after it, ``state.step + 1``, is a multiple of ``every``) also return:

* ``precision_sq``: ``[3, leaves]`` fp64, per leaf of the trained parameters (in
  :func:`hpfunc.tree.leaves` order with ``None`` as a leaf; a frozen leaf, or another pipeline stage's,
  is 0): the squared global norm of its gradient, of the parameter before the update, and of the update
  (new minus old parameter);
* ``precision_local_loss``: ``[data ranks, calls]`` fp64: the loss each data-parallel rank computed on
  its own shard of the batch, per call of the objective (one per micro-batch of ``train.microbatches``;
  under a ``pp`` plan one per step: the pipeline's mean over its microbatches), not averaged over ranks
  (MindFormers' local loss).

Each rank sums the squares of its own blocks and places its own losses at its data index; one ``psum``
(:func:`hpfunc.layout.sq_norm_table`) makes the table global, so nothing is gathered and no rank's
partial value is reported as a global one. On those steps the step's ``grad_norm`` is the square root of
the table's gradient row summed, from that same reduction. Between them the step does no extra work
(a context-variable read per objective call).

    >>> import torch
    >>> from hpfunc import optim
    >>> from hpfunc.train.step import init_train_state, make_train_step
    >>> loss = lambda p, b, cfg: ((p["w"] * b["x"]).sum(), {})
    >>> tx = optim.adamw(0.5, weight_decay=0.0)
    >>> step = make_train_step(None, tx, loss_fn=loss, monitor=PrecisionProbe(every=2))
    >>> state = init_train_state({"w": torch.ones(2)}, tx)
    >>> state, m = step(state, {"x": torch.tensor([3.0, 4.0])})
    >>> "precision_sq" in m                       # step 1: not a logging step
    False
    >>> state, m = step(state, {"x": torch.tensor([3.0, 4.0])})
    >>> m["precision_sq"][0].tolist(), m["precision_local_loss"].shape  # gradient squares; 1 rank, 1 call
    ([25.0], torch.Size([1, 1]))
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from hpfunc import layout
from hpfunc import tree as _tree

__all__ = ["PrecisionProbe", "record_local_loss", "steps_done", "SQ", "LOCAL_LOSS", "ROWS"]

SQ = "precision_sq"  # the metrics key of the [3, leaves] table
LOCAL_LOSS = "precision_local_loss"  # the metrics key of the [data ranks, calls] local losses
ROWS = ("grad", "param", "update")  # the rows of the table, in order

# the local losses of the step being measured (None between measured steps) and the optimizer steps taken
# before the step that runs now, as the caller counts them on the host (None: not told, the probe reads the
# state's step counter): members of the layout binding's scopes (hpfunc.layout.Scopes), which the step's own
# bindings keep


@contextlib.contextmanager
def steps_done(n: int) -> Iterator[None]:
    """Within: a train step that runs takes its state's step count (``state.step``) to be ``n``, the
    caller's own count on the host, so that :meth:`PrecisionProbe.due` reads no tensor (on a GPU reading
    ``state.step`` makes the host wait for the device). The trainer's loop counts the steps it applied.

    >>> probe = PrecisionProbe(every=2)
    >>> with steps_done(1):
    ...     probe.due(torch.tensor(6))  # the caller's count, not the tensor's
    True
    >>> probe.due(torch.tensor(6))  # not told: read from the tensor
    False
    """
    with layout.scoped(steps_done=int(n)):
        yield


def record_local_loss(loss: torch.Tensor) -> None:
    """Called by the step's objective with each call's loss (this rank's, on its shard); kept only while
    a measured step runs."""
    kept = layout.scopes().local_losses
    if kept is not None:
        kept.append(loss.detach())


class PrecisionProbe:
    """Which steps the train step measures (every ``every``-th) and how (see the module docstring)."""

    def __init__(self, every: int = 1):
        if int(every) < 1:
            raise ValueError(f"every: expected an integer >= 1, found {every}")
        self.every = int(every)

    def due(self, step: torch.Tensor) -> bool:
        """Whether the step after ``step`` optimizer steps (``state.step``) is measured: from the caller's
        count on the host when one is given (:func:`steps_done`: the trainer's loop gives its own), else a
        read of ``step`` (on a device, a host sync)."""
        done = layout.scopes().steps_done
        return ((int(step) if done is None else done) + 1) % self.every == 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[list]:
        """The list the objective's losses are recorded into while the ``with`` block runs."""
        kept: list = []
        with layout.scoped(local_losses=kept):
            yield kept

    @staticmethod
    def snapshot(trained: Any) -> Any:
        """This rank's parameter blocks before the update: a copy when the step was handed its state to
        reuse (:func:`hpfunc.layout.donated`: the update may write the new values into them), else the
        blocks themselves (the update makes new tensors)."""
        if not layout.donated():
            return trained
        return _tree.tree_map(lambda x: None if x is None else x.detach().clone(), trained, none_is_leaf=True)

    @staticmethod
    def measure(grads: Any, before: Any, after: Any, losses: list) -> dict[str, torch.Tensor]:
        """The metrics of a measured step (``SQ`` and ``LOCAL_LOSS``), in one reduction over the mesh."""
        updates = _tree.tree_map(lambda new, old: None if old is None else new.detach() - old, after, before,
                                 none_is_leaf=True)
        mine = torch.stack([x.to(torch.float64).reshape(()) for x in losses]) if losses else None
        table, rows = layout.sq_norm_table([grads, before, updates], per_rank=mine, where="precision monitor")
        out = {SQ: table}
        if rows is not None:
            out[LOCAL_LOSS] = rows
        return out
