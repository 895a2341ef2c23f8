"""``precision_monitor``: gradient, parameter and update norms per layer and per parameter group, the local
loss of every data-parallel rank and micro-batch, and loss or gradient-norm spikes naming the layer and
the rank that moved most.

Every ``every``-th step the train step itself measures (:class:`~hpfunc.train.precision_probe.PrecisionProbe`):
each rank sums the squares of the gradient, parameter and update blocks it holds, per leaf, and places
its own per-call losses at its data index; one ``psum`` over the mesh makes that table global (a block
held by ``k`` ranks counted once), so no parameter or gradient is gathered and no rank's partial value
is written as a global one. The steps between do no extra work. The callback (rank 0) groups the table
by the parameters' pytree paths, as ``layer_norms`` does: per layer (``layers.<i>``, else the path's
first component: ``embed``, ``final_norm``, ...) and per parameter group (the path with the layer
index starred: ``layers.*.attn.wq``). A line of ``precision.jsonl`` per measured step::

    {"step": 10, "loss": 2.31, "grad_norm": 0.84,
     "layers": {"embed": {"grad_norm": ..., "param_norm": ..., "update_ratio": ...}, "layers.0": {...}, ...},
     "groups": {"layers.*.attn.wq": {...}, ...},
     "local_loss": [[2.29, 2.35], [2.30, 2.31]],          # [data rank][micro-batch]
     "spike": {...}}                                      # only on a step that spiked

``update_ratio`` is ``||new - old|| / ||old||`` of the group's parameters (``null`` for a zero
parameter). ``local_loss[r][m]`` is the loss data-parallel rank ``r`` computed on its own shard in its
``m``-th call of the objective (micro-batch ``m`` of ``train.microbatches``; under ``pp`` one per step:
the pipeline's mean over its microbatches), as MindFormers defines the local loss: per rank, not
averaged.

**Spikes.** The loss or the gradient norm above ``spike_k`` times its running median over the last
``window`` measured steps (once ``warmup`` are known) is a spike: the ``spike`` entry names the value
and its ratio to the median, the layer whose gradient norm rose most over its own running median, and
the data rank (and micro-batch) whose local loss did (ratios for positive values, such as losses and
norms). Each spike is also said on stderr. The running medians start afresh on a resume.

With a ``tensorboard`` callback in the run, the per-layer values, the local losses and a ``spike``
marker go to its event file as scalars under ``precision/``.

    callbacks: [{precision_monitor: {every: 10, spike_k: 3.0, window: 20}}]

    >>> import torch
    >>> mon = PrecisionMonitor(every=1, warmup=2)
    >>> paths = ["embed", "layers.0.w", "layers.1.w"]
    >>> def metrics(scale, rank1=1.0):
    ...     g = torch.tensor([1.0, 4.0, 9.0 * scale ** 2], dtype=torch.float64)  # gradient squares
    ...     p = torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64)
    ...     table = torch.stack([g, p, p * 1e-6])
    ...     loss = torch.tensor([[2.0], [2.0 * rank1]], dtype=torch.float64)
    ...     return {"loss": loss.mean(), "grad_norm": g.sum().sqrt(), "precision_sq": table,
    ...             "precision_local_loss": loss}
    >>> for step in (1, 2):
    ...     rec = mon.observe(step, metrics(1.0), paths)
    >>> rec["layers"]["layers.1"]
    {'grad_norm': 3.0, 'param_norm': 2.0, 'update_ratio': 0.001}
    >>> rec = mon.observe(3, metrics(20.0, rank1=8.0), paths)
    >>> {k: rec["spike"][k] for k in ("on", "layer", "rank", "microbatch")}
    {'on': ['loss', 'grad_norm'], 'layer': 'layers.1', 'rank': 1, 'microbatch': 0}
"""

from __future__ import annotations

import collections
import math
import re
import statistics
import sys
from typing import Any

import torch

from hpfunc.train.callbacks.base import WriterCallback, open_lines
from hpfunc.train.callbacks.layer_norms import group_of, group_order
from hpfunc.train.precision_probe import LOCAL_LOSS, ROWS, SQ, PrecisionProbe

__all__ = ["PrecisionMonitor", "kind_of", "probe_of"]

_LAYER_INDEX = re.compile(r"^layers\.\d+\.")


def kind_of(path: str) -> str:
    """The parameter group of a leaf: its path with the layer index starred (``layers.3.attn.wq`` ->
    ``layers.*.attn.wq``); a path outside ``layers`` is its own group."""
    return _LAYER_INDEX.sub("layers.*.", path)


def probe_of(callbacks: Any) -> PrecisionProbe | None:
    """The probe the train step must carry for the run's callbacks (``(label, callback)`` pairs): the first
    callback's ``step_probe``, or ``None`` when no callback asks for one."""
    return next((cb.step_probe for _, cb in callbacks if getattr(cb, "step_probe", None) is not None), None)


def _ratio(value: float, history: Any) -> float:
    """``value`` over the median of ``history`` (inf over a zero median of a positive value)."""
    med = statistics.median(history)
    if med > 0:
        return value / med
    return math.inf if value > 0 else 1.0


class PrecisionMonitor(WriterCallback):
    """Per-layer and per-group norms, local losses and spikes every ``every`` steps to ``file``."""

    def __init__(self, *, every: int = 10, file: str = "precision.jsonl", spike_k: float = 3.0, window: int = 20,
                 warmup: int = 5):
        if not spike_k > 1.0:
            raise ValueError(f"spike_k: expected a factor > 1, found {spike_k}")
        if window < 1:
            raise ValueError(f"window: expected an integer >= 1, found {window}")
        if not 1 <= warmup <= window:
            raise ValueError(f"warmup: expected an integer in [1, window={window}], found {warmup}")
        self.step_probe = PrecisionProbe(every)  # checks every
        self.every, self.file, self.spike_k, self.window, self.warmup = every, file, float(spike_k), window, warmup
        self._writer: Any = None
        self._paths: dict[Any, list[str]] = {}
        self._history: dict[str, collections.deque] = {}
        self.last: dict[str, Any] | None = None
        self.spikes: list[dict[str, Any]] = []

    def on_train_start(self, trainer: Any) -> None:
        self._writer = open_lines(trainer, self.file)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if SQ not in metrics:  # not a measured step
            return
        record = self.observe(step, metrics, self._leaf_paths(trainer.state.params))
        self._writer.write(record)
        spike = record.get("spike")
        if spike is not None:
            print(f"hpfunc train: precision monitor: step {step}: {self._say(spike)}", file=sys.stderr, flush=True)
        board = next((cb for _, cb in trainer.callbacks if hasattr(cb, "add_scalars")), None)
        if board is not None:
            board.add_scalars(self._scalars(record), step)

    # -- the values of one measured step --------------------------------------------------------
    def observe(self, step: int, metrics: dict[str, Any], paths: list[str]) -> dict[str, Any]:
        """The record of a measured step from its metrics (``SQ``, ``LOCAL_LOSS``, ``loss``, ``grad_norm``)
        and the leaf paths of its table's columns; updates the running medians."""
        table = metrics[SQ].detach().to(torch.float64).cpu()
        if table.shape != (len(ROWS), len(paths)):
            raise ValueError(f"precision monitor: the step's table has shape {tuple(table.shape)}, expected "
                             f"({len(ROWS)}, {len(paths)}) for the {len(paths)} parameter leaves")
        cols = table.tolist()
        layers = self._grouped(paths, cols, group_of, keep_zero=True)
        kinds = self._grouped(paths, cols, kind_of, keep_zero=False)
        record: dict[str, Any] = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                                  "layers": layers, "groups": kinds}
        local = metrics.get(LOCAL_LOSS)
        if local is not None:
            record["local_loss"] = local.detach().to(torch.float64).cpu().tolist()
        spike = self._spike(record)
        if spike is not None:
            record["spike"] = spike
            self.spikes.append({"step": step, **spike})
        self.last = record
        return record

    @staticmethod
    def _grouped(paths: list[str], cols: list[list[float]], key: Any, *, keep_zero: bool) -> dict[str, dict]:
        sums: dict[str, list[float]] = {}
        for k, path in enumerate(paths):
            acc = sums.setdefault(key(path), [0.0] * len(ROWS))
            for r in range(len(ROWS)):
                acc[r] += cols[r][k]
        out = {}
        for name in sorted(sums, key=group_order):
            grad, param, update = sums[name]
            if not keep_zero and grad == param == update == 0.0:  # frozen (not trained): nothing to say
                continue
            out[name] = {"grad_norm": math.sqrt(grad), "param_norm": math.sqrt(param),
                         "update_ratio": math.sqrt(update) / math.sqrt(param) if param > 0 else None}
        return out

    def _spike(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Compare this step with the running medians (then add it to them): which values spiked, and the
        layer and rank that moved most."""
        watched = {"loss": record["loss"], "grad_norm": record["grad_norm"]}
        layers = {name: v["grad_norm"] for name, v in record["layers"].items()}
        ranks = [sum(row) / len(row) for row in record.get("local_loss", []) if row]
        hist = self._history
        on = [name for name, v in watched.items()
              if len(hist.get(name, ())) >= self.warmup and v > self.spike_k * statistics.median(hist[name])]
        spike = None
        if on:
            spike = {"on": on, **{f"{n}_ratio": _ratio(watched[n], hist[n]) for n in on}}
            moved = {n: _ratio(v, hist[f"layer:{n}"]) for n, v in layers.items() if hist.get(f"layer:{n}")}
            if moved:
                spike["layer"] = max(moved, key=moved.__getitem__)
                spike["layer_ratio"] = moved[spike["layer"]]
            by_rank = {r: _ratio(v, hist[f"rank:{r}"]) for r, v in enumerate(ranks) if hist.get(f"rank:{r}")}
            if by_rank:
                r = max(by_rank, key=by_rank.__getitem__)
                row = record["local_loss"][r]
                spike.update(rank=r, rank_ratio=by_rank[r], microbatch=max(range(len(row)), key=row.__getitem__))
        for name, v in [*watched.items(), *((f"layer:{n}", v) for n, v in layers.items()),
                        *((f"rank:{r}", v) for r, v in enumerate(ranks))]:
            hist.setdefault(name, collections.deque(maxlen=self.window)).append(v)
        return spike

    @staticmethod
    def _say(spike: dict[str, Any]) -> str:
        parts = [f"{n} {spike[f'{n}_ratio']:.3g}x its running median" for n in spike["on"]]
        if "layer" in spike:
            parts.append(f"the layer that moved most: {spike['layer']} (gradient norm {spike['layer_ratio']:.3g}x)")
        if "rank" in spike:
            parts.append(f"the data rank that moved most: {spike['rank']} (local loss {spike['rank_ratio']:.3g}x, "
                         f"highest in micro-batch {spike['microbatch']})")
        return "; ".join(parts)

    @staticmethod
    def _scalars(record: dict[str, Any]) -> dict[str, float]:
        out = {}
        for name, v in record["layers"].items():
            for key, value in v.items():
                if value is not None:
                    out[f"precision/{key}/{name}"] = value
        for r, row in enumerate(record.get("local_loss", [])):
            for m, value in enumerate(row):
                out[f"precision/local_loss/rank{r}" + (f"/mb{m}" if len(row) > 1 else "")] = value
        out["precision/spike"] = 1.0 if "spike" in record else 0.0
        return out

    def _leaf_paths(self, params: Any) -> list[str]:
        """The path of every leaf of the parameters (``None`` as a leaf), once per tree structure."""
        from hpfunc import tree

        leaves, treedef = tree.flatten(params, none_is_leaf=True)
        hit = self._paths.get(treedef)
        if hit is None:
            hit = self._paths[treedef] = tree.leaves(tree.map_with_path(lambda p, x: p, params, none_is_leaf=True),
                                                 none_is_leaf=True)
        return hit
