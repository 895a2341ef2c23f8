"""``moe_monitor``: the expert load of every MoE layer, from the step's ``expert_load`` (``[layers, E]``
token counts of the whole batch, summed over the data and expert ranks), as Megatron-Core's
``MoEMetricsTracker`` reports it once per step.

Per layer, each ``every``-th step, a line of ``moe.jsonl``:

* ``max_violation``: ``(max - mean) / mean`` of the load (0: perfectly balanced);
* ``top10_share``: the share of the layer's tokens taken by its busiest 10% of experts (at least one);
* ``dead_experts``: the experts that received no token in the last ``dead_after`` steps (every step
  counts, logged or not);
* ``load``: the per-expert counts, or, with more than ``max_experts`` experts, ``top_load``: the
  ``max_experts`` busiest as ``{expert: count}`` (capped keys, as NeMo AutoModel logs 128 experts);

and the step's ``aux_loss``. At the end, ``moe_load.png``: one heat map per layer of each expert's share
of the layer's tokens over the logged steps. A model without MoE layers (no ``expert_load``) writes
nothing.

    callbacks: [{moe_monitor: {every: 10, dead_after: 50}}]

    >>> import torch
    >>> layer_stats(torch.tensor([6, 2, 0, 0]), dead=[2], max_experts=8)
    {'max_violation': 2.0, 'top10_share': 0.75, 'dead_experts': [2], 'load': [6, 2, 0, 0]}
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hpfunc.train.callbacks.base import WriterCallback, open_lines

__all__ = ["MoeMonitor", "layer_stats"]


def layer_stats(load: torch.Tensor, *, dead: list[int], max_experts: int) -> dict[str, Any]:
    """The statistics of one layer's per-expert token counts ``load`` (``[E]``)."""
    counts = load.to(torch.float64)
    E = counts.numel()
    total = float(counts.sum())
    mean = total / E
    top = max(1, math.ceil(0.1 * E))
    out: dict[str, Any] = {
        "max_violation": (float(counts.max()) - mean) / mean if mean > 0 else 0.0,
        "top10_share": float(counts.topk(top).values.sum()) / total if total > 0 else 0.0,
        "dead_experts": list(dead),
    }
    ints = load.to(torch.int64)
    if E <= max_experts:
        out["load"] = ints.tolist()
    else:
        values, ids = ints.topk(max_experts)
        out["top_load"] = {str(int(i)): int(v) for i, v in zip(ids, values)}
    return out


class MoeMonitor(WriterCallback):
    """Per-layer expert-load statistics to ``file`` every ``every`` steps, and a heat map at the end."""

    def __init__(self, *, every: int = 1, dead_after: int = 10, max_experts: int = 16, file: str = "moe.jsonl",
                 heatmap: str | None = "moe_load.png"):
        if every < 1 or dead_after < 1 or max_experts < 1:
            raise ValueError(f"every, dead_after and max_experts must be integers >= 1, found {every}, {dead_after}, "
                             f"{max_experts}")
        self.every, self.dead_after, self.max_experts = every, dead_after, max_experts
        self.file, self.heatmap = file, heatmap
        self._writer: Any = None
        self._idle: torch.Tensor | None = None  # [layers, E]: steps since each expert last got a token
        self.shares: list[tuple[int, torch.Tensor]] = []  # (step, [layers, E] share of each layer's tokens)

    def on_train_start(self, trainer: Any) -> None:
        self._writer = open_lines(trainer, self.file)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        load = metrics.get("expert_load")
        if load is None or load.numel() == 0:
            return
        load = load.detach().to(torch.int64)
        idle = torch.zeros_like(load) if self._idle is None else self._idle
        self._idle = torch.where(load > 0, torch.zeros_like(idle), idle + 1)
        if step % self.every:
            return
        layers = []
        for i in range(load.shape[0]):
            dead = torch.nonzero(self._idle[i] >= self.dead_after).flatten().tolist()
            layers.append({"layer": i, **layer_stats(load[i], dead=dead, max_experts=self.max_experts)})
        aux = metrics.get("aux_loss")
        self._writer.write({"step": step, "aux_loss": None if aux is None else float(aux), "layers": layers})
        self.shares.append((step, load.to(torch.float64) / load.sum(dim=1, keepdim=True).clamp_min(1)))

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        super().on_train_end(trainer, summary)
        if self.heatmap and self.shares:
            plot_heatmap(self.shares, trainer.output_file(self.heatmap))


def plot_heatmap(shares: list[tuple[int, torch.Tensor]], path: Any) -> Any:
    """One panel per layer: expert (rows) by logged step (columns), coloured by the share of the layer's
    tokens; written atomically."""
    import io

    # a bare Figure renders with the Agg canvas and leaves pyplot's backend (a notebook's inline one) alone
    from matplotlib.figure import Figure

    from hpfunc.train.output import write_atomic

    steps = [s for s, _ in shares]
    grid = torch.stack([x for _, x in shares])  # [steps, layers, E]
    n_layers = grid.shape[1]
    fig = Figure(figsize=(8, 1.2 + 1.6 * n_layers), dpi=80)
    axes = fig.subplots(n_layers, 1, squeeze=False)
    for i in range(n_layers):
        ax = axes[i][0]
        im = ax.imshow(grid[:, i, :].T.numpy(), aspect="auto", origin="lower", cmap="viridis",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, grid.shape[2] - 0.5))
        ax.set_ylabel(f"layer {i}\nexpert")
        fig.colorbar(im, ax=ax, label="share of tokens")
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return write_atomic(path, buf.getvalue())
