"""Outputs: metrics JSONL, progress display modes, the loss plot."""

from __future__ import annotations

import io
import math

from hpfunc.train.output import MetricsWriter, Progress, format_summary, plot_losses, read_metrics


def test_metrics_jsonl_round_trip(tmp_path):
    import torch

    path = tmp_path / "m" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write({"step": 1, "loss": torch.tensor(2.5), "expert_load": torch.tensor([[1, 2]]), "lr": math.nan})
        w.write({"step": 2, "val_loss": 2.0})
    assert read_metrics(path) == [
        {"step": 1, "loss": 2.5, "expert_load": [[1, 2]], "lr": None},
        {"step": 2, "val_loss": 2.0},
    ]


def test_progress_modes():
    lines = io.StringIO()
    p = Progress(20, "lines", lines)
    p.update(1, {"loss": 5.5, "lr": 1e-3})
    p.update(2)  # no record: nothing printed
    p.close()
    assert lines.getvalue() == "step  1/20  loss 5.5000  lr 1.00e-03\n"
    quiet = io.StringIO()
    p = Progress(3, "none", quiet)
    p.update(1, {"loss": 1.0})
    p.message("hello")
    assert quiet.getvalue() == ""
    bar = io.StringIO()
    p = Progress(3, "bar", bar)
    p.update(2, {"loss": 1.25})
    p.close()
    assert "loss 1.2500" in bar.getvalue() and "2/3" in bar.getvalue()
    assert Progress(3, "auto", io.StringIO()).mode == "lines"  # not a terminal


def test_plot_and_summary(tmp_path):
    records = [{"step": 1, "loss": 5.5}, {"step": 10, "loss": 3.0}, {"step": 10, "val_loss": 3.2}]
    png = plot_losses(records, tmp_path / "loss.png", title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = format_summary({"steps": 10, "train_time_s": 2.0, "tokens_per_s": 512.0, "tokens": 1024,
                           "first_loss": 5.5, "last_loss": 3.0, "last_window": 10, "val_loss": 3.2, "out_dir": "o"})
    assert "first 5.5000 -> last 3.0000" in text and "validation loss: 3.2000" in text
