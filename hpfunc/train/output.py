"""What a run leaves behind: ``config.yaml``, ``metrics.jsonl``, ``loss.png``, ``summary.json``, and progress.

Metrics are written one JSON object per line as the run goes (a crash keeps what was logged).
Training lines carry ``step`` (steps done), ``loss`` (mean objective over the steps since the last
line), ``ce_loss``, ``aux_loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``elapsed_s`` and, for MoE,
``expert_imbalance`` (max over mean expert load, averaged over layers) and ``expert_load``
(per-layer token counts of the last step). Evaluation lines carry ``step`` and ``val_loss``.

Example:
    >>> import tempfile, json, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with MetricsWriter(d / "metrics.jsonl") as w:
    ...     w.write({"step": 1, "loss": 5.5})
    >>> read_metrics(d / "metrics.jsonl")
    [{'step': 1, 'loss': 5.5}]
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
from typing import Any, Iterable, TextIO

__all__ = ["MetricsWriter", "read_metrics", "Progress", "plot_losses", "format_summary"]


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)  # JSON has no NaN/inf
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


class MetricsWriter:
    """Append-only JSONL writer; each line is flushed so the file is readable while training runs."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = open(self.path, "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in order."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


class Progress:
    """A tqdm bar on a terminal, plain lines otherwise (logs, CI), or nothing.

    ``mode``: ``"auto"`` (bar when stdout is a TTY), ``"bar"``, ``"lines"`` or ``"none"``.
    """

    def __init__(self, total: int, mode: str = "auto", stream: TextIO | None = None):
        self.stream = sys.stdout if stream is None else stream
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode = mode
        self.total = total
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            try:
                width = os.get_terminal_size(self.stream.fileno()).columns
            except (OSError, AttributeError, ValueError):
                width = 0
            # A pseudo-terminal may report 0 columns; tqdm would then draw nothing.
            self._bar = tqdm(total=total, file=self.stream, unit="step", leave=True,
                             **({"dynamic_ncols": True} if width > 0 else {"ncols": 100, "nrows": 40}))

    def update(self, step: int, record: dict[str, Any] | None = None) -> None:
        """Advance to ``step`` steps done; ``record`` (a logged metrics line) is shown when given."""
        if self._bar is not None:
            if record:  # keep the history above the bar, the latest values on it
                self._bar.write(self._line(step, record), file=self.stream)
                self._bar.set_postfix_str(_short(record), refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.mode == "lines" and record:
            print(self._line(step, record), file=self.stream, flush=True)

    def _line(self, step: int, record: dict[str, Any]) -> str:
        return f"step {step:>{len(str(self.total))}}/{self.total}  {_short(record)}"

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.mode != "none":
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _short(record: dict[str, Any]) -> str:
    parts = []
    for key, fmt in (("loss", ".4f"), ("val_loss", ".4f"), ("grad_norm", ".3f"), ("lr", ".2e"),
                     ("expert_imbalance", ".2f"), ("tokens_per_s", ",.0f")):
        v = record.get(key)
        if isinstance(v, (int, float)):
            name = {"tokens_per_s": "tok/s", "expert_imbalance": "imbalance"}.get(key, key)
            parts.append(f"{name} {v:{fmt}}")
    return "  ".join(parts)


def plot_losses(records: Iterable[dict[str, Any]], path: str | pathlib.Path, *, title: str = "") -> pathlib.Path:
    """Training (and validation) loss against steps, saved as a PNG (matplotlib's Agg canvas, no pyplot)."""
    # A bare Figure renders with the Agg canvas and leaves pyplot's global backend and state alone.
    from matplotlib.figure import Figure

    records = list(records)
    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    val = [(r["step"], r["val_loss"]) for r in records if isinstance(r.get("val_loss"), (int, float))]
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path)
    return path


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run lines printed to the console."""
    lines = [
        f"done: {summary['steps']} steps in {summary['train_time_s']:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tokens/s, {summary['tokens']:,} tokens)",
        f"loss: first {summary['first_loss']:.4f} -> last {summary['last_loss']:.4f} "
        f"(mean of the last {summary['last_window']} steps)",
    ]
    if summary.get("val_loss") is not None:
        lines.append(f"validation loss: {summary['val_loss']:.4f}")
    lines.append(f"outputs: {summary['out_dir']}")
    return "\n".join(lines)
