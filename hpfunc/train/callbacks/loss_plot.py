"""``loss_plot``: ``loss.png`` at the end of the run (always on, rank 0; ``output.plot: false`` turns it
off): the training and validation losses of metrics.jsonl against the step
(:func:`hpfunc.train.output.plot_losses`), rendered and written on the run's background writer."""

from __future__ import annotations

from typing import Any

from hpfunc.train.callbacks.base import Callback

__all__ = ["LossPlot"]


class LossPlot(Callback):
    """Plot the run's losses to ``loss.png`` when it finishes."""

    run_part = True

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        from hpfunc.train.output import plot_losses

        cfg, tc = trainer.cfg, trainer.cfg.train
        if not cfg.output.plot:
            return
        title = f"{cfg.model.preset} on {cfg.data.source} ({tc.steps} steps, batch {tc.batch_size}x{tc.seq_len})"
        if trainer.mesh is not None:
            title += "\nmesh " + " x ".join(f"{a} {n}" for a, n in cfg.parallel.mesh.items())
        records, path = list(trainer.records), trainer.output_file("loss.png")
        trainer.writer.submit(lambda: plot_losses(records, path, title=title))
