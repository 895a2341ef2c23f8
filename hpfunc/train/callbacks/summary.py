"""``summary``: ``summary.json`` and the end-of-run lines (always on, rank 0, the last callback). It
waits for every write handed to the background writer first, so summary.json is written only once every
other output is whole: its presence means the run finished, and a failed write or a failing callback
leaves none."""

from __future__ import annotations

from typing import Any

from hpfunc.train.callbacks.base import Callback

__all__ = ["Summary"]


class Summary(Callback):
    """Write ``summary.json`` last and print the summary."""

    run_part = True

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        from hpfunc.train.output import format_summary

        trainer.writer.flush()  # every other output first: a failure among them leaves no summary.json
        trainer.writer.submit(lambda: trainer.folder.write_json("summary.json", summary))
        trainer.writer.flush()
        trainer.say(format_summary(summary))
