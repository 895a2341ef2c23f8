"""The run's own outputs as callbacks, always on: the config's ``callbacks:`` (and ``callbacks=`` objects)
extend this list, between its head and its tail.

==================  =========================================================  ==========
name                what                                                       ranks
==================  =========================================================  ==========
``progress``        the progress bar or lines (``output.progress``)            0
``metrics_file``    metrics.jsonl, one line per logged record                  0
``checkpoints``     a save every ``checkpoint.every`` steps and after the last  every rank
(the config's)
``loss_plot``       loss.png (``output.plot``)                                 0
``summary``         summary.json, last, and the end-of-run lines               0
==================  =========================================================  ==========

    >>> [label for label, _ in run_callbacks([("callbacks[0] (mine)", object())])]
    ['progress (built-in)', 'metrics_file (built-in)', 'checkpoints (built-in)', 'callbacks[0] (mine)', 'loss_plot (built-in)', 'summary (built-in)']
"""

from __future__ import annotations

from typing import Any, Sequence

from hpfunc.train.callbacks.checkpoints import Checkpoints
from hpfunc.train.callbacks.loss_plot import LossPlot
from hpfunc.train.callbacks.metrics_file import MetricsFile
from hpfunc.train.callbacks.progress import ProgressBar
from hpfunc.train.callbacks.summary import Summary

__all__ = ["run_callbacks"]


def run_callbacks(extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The run's callbacks in the order they are called: the built-in head, ``extra``, the built-in tail."""
    head = [("progress (built-in)", ProgressBar()), ("metrics_file (built-in)", MetricsFile()),
            ("checkpoints (built-in)", Checkpoints())]
    tail = [("loss_plot (built-in)", LossPlot()), ("summary (built-in)", Summary())]
    return [*head, *extra, *tail]
