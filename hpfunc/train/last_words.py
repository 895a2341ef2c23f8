"""Last words: on SIGTERM, SIGINT or a failed step, the ranks that can still talk save the last completed
step, within a timeout, before the run exits.

- :class:`StopSignals` replaces the SIGTERM and SIGINT handlers for the loop with one that only notes
  the signal; the loop finishes the step in progress (a signal in the middle of a collective would
  leave the peers waiting), then stops. A second SIGINT raises ``KeyboardInterrupt`` at once.
- On a mesh the ranks agree after every step whether any of them was signalled
  (:meth:`LastWords.any_stop`: one all-reduce of one integer), so they all stop after the same step,
  even when only one rank got the signal.
- :meth:`LastWords.save` makes the save: on a mesh it first asks the heartbeats
  (:func:`hpfunc.faults.gone_peers`) whether a rank has exited or gone silent (then the save is
  skipped, saying which rank: a checkpoint needs every rank's blocks), then the ranks agree on the
  step over a process group of their own whose collectives time out after
  ``checkpoint.last_words_timeout_s`` (a rank stuck elsewhere makes the others skip, not hang), then
  they save synchronously on that group.

The state saved is the one before the step that failed or the one after the last step: the step is
a pure function, so an exception inside it leaves its input state whole.

>>> lw = LastWords(None, distributed=False, timeout_s=5)
>>> lw.save(None, 3, {}, why="a test")[1]
'no checkpoint: checkpoints are off (checkpoint.every: 0)'
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

__all__ = ["StopSignals", "Stopped", "LastWords"]


class Stopped(RuntimeError):
    """The run stopped on a signal after saving (or trying to save) its last completed step."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """Within ``with``: SIGTERM and SIGINT set :attr:`signum` instead of ending the process (main thread
    only; elsewhere nothing changes). The previous handlers are restored on exit.

    >>> import os, signal
    >>> with StopSignals() as s:
    ...     os.kill(os.getpid(), signal.SIGTERM)
    ...     s.signum == signal.SIGTERM
    True
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place (inside ``with``, on the main thread)."""
        return bool(self._old)

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # asked twice: stop now
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class LastWords:
    """The save on the way out (see the module docstring). Constructing it on a mesh is a collective
    call (it creates the process group of the last words, with the timeout ``timeout_s``).

    Args:
      checkpoints: the run's :class:`~hpfunc.train.checkpointing.TrainCheckpoints` (None: checkpoints
        are off and nothing is saved).
      distributed: the run is on a mesh of several processes.
      timeout_s: how long the ranks wait for each other to agree and for each collective of the save.
    """

    def __init__(self, checkpoints: Any, *, distributed: bool, timeout_s: float):
        self.checkpoints = checkpoints
        self.distributed = distributed
        self.timeout_s = float(timeout_s)
        self.group = None
        if distributed and checkpoints is not None:
            import datetime

            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))

    def any_stop(self, signum: int | None, save_failed: bool = False, *, group: Any = None) -> tuple[int | None, bool]:
        """On a mesh: ``(the signal any rank got, whether any rank's asynchronous save failed)``, in one
        all-reduce of host integers over ``group`` (a gloo group; default the default group) that every
        rank calls after each step; else ``(signum, save_failed)``."""
        if not self.distributed:
            return signum, save_failed
        import torch
        import torch.distributed as dist

        flag = torch.tensor([signum or 0, int(save_failed)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag[0]) or None, bool(flag[1])

    def _agree(self, data_step: int) -> str | None:
        """Every rank joins an all-reduce of its step on the last words' group: None when they all did,
        at the same step; else why not."""
        import datetime

        import torch
        import torch.distributed as dist

        mine = torch.tensor([data_step, -data_step], dtype=torch.int64)
        try:
            work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - a timeout or a lost peer: reported, not raised
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            return (f"not every rank joined within {self.timeout_s:g} s (checkpoint.last_words_timeout_s): "
                    f"{first}")
        hi, lo = int(mine[0]), -int(mine[1])
        if hi != lo:
            return f"the ranks are at different steps ({lo} to {hi})"
        return None

    def save(self, state: Any, data_step: int, loop: dict[str, Any], *, why: str) -> tuple[Any, str]:
        """Save ``state`` (after ``data_step`` steps) if every rank can: ``(SaveResult or None, message)``."""
        del why
        if self.checkpoints is None:
            return None, "no checkpoint: checkpoints are off (checkpoint.every: 0)"
        if data_step == 0:
            return None, "no checkpoint: no step was completed"
        if self.distributed:
            from hpfunc import faults

            gone = faults.gone_peers()
            if gone:
                return None, (f"no checkpoint: {'; '.join(gone)}, and a checkpoint needs every rank's blocks "
                              f"(the last one saved stays the newest)")
            problem = self._agree(data_step)
            if problem is not None:
                return None, f"no checkpoint: {problem} (the last one saved stays the newest)"
        t = time.perf_counter()
        try:
            result = self.checkpoints.save_now(state, data_step, loop, process_group=self.group)
        except Exception as e:  # noqa: BLE001 - the run is ending anyway: say why it was not saved
            return None, f"no checkpoint: the save failed: {type(e).__name__}: {str(e)[:300]}"
        return result, f"saved the checkpoint of step {data_step} ({result.path}) in {time.perf_counter() - t:.2f} s"

    def close(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - a group whose peers are gone cannot always be torn down
                pass
            self.group = None


def stop_message(signum: int, data_step: int, saved: str) -> str:
    """``stopped by SIGTERM after step 12; saved ...; continue with --resume auto``."""
    return (f"stopped by {_signal_name(signum)} after step {data_step}; {saved}; continue it with "
            f"`hpfunc train CONFIG --resume auto`")
