"""Asynchronous saves: the state is staged into host copies while the caller waits, then written through
DCP by a background thread while training goes on.

At most one save is in flight: a new save first waits for the previous one (that wait counts as time
the caller was blocked). :attr:`PendingSave.blocked_s` is what the training loop paid for the save
(waiting for the previous one plus staging); :meth:`PendingSave.wait` returns the finished
:class:`~hpfunc.checkpoint.dcp_io.SaveResult` and re-raises an error of the write.

The background write talks to the other ranks over a process group of its own (created by
:class:`AsyncSaver`, a collective call every rank makes), never the one training uses, so its
collectives cannot interleave with the step's. Its timeout (``timeout_s``, 600 s by default instead
of gloo's 30 minutes) bounds how long a background write waits for a peer that died or hangs: the
write then fails and :meth:`PendingSave.wait` raises it, naming the step.

>>> import tempfile, pathlib, torch
>>> saver = AsyncSaver()
>>> pending = saver.save(pathlib.Path(tempfile.mkdtemp()) / "step_1", {"w": torch.ones(2)}, step=1)
>>> pending.blocked_s >= 0 and pending.wait().step
1
>>> saver.close()
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpfunc.checkpoint import _ranks
from hpfunc.checkpoint.dcp_io import SaveResult, check_metadata, flatten_state, write_flat
from hpfunc.checkpoint.errors import CheckpointError
from hpfunc.checkpoint.save_faults import check_step
from hpfunc.faults import is_comm_failure

__all__ = ["AsyncSaver", "PendingSave", "stage", "stage_async", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 600.0  # of the background write's collectives (gloo's own default is 30 minutes)


def _copy(x: Any, device_copies: dict) -> Any:
    """A host copy of ``x`` (a DTensor keeps its layout); a block of a CUDA device is only noted in
    ``device_copies`` (id -> block) and copied by :func:`stage_async` in one batch."""
    if isinstance(x, DTensor):
        local = x.to_local()
        if x.device_mesh.device_type != "cpu":
            # from_local would move the host copy back to the mesh's device (a second device copy of the
            # state while the write runs): the same layout, kept in host memory
            from hpfunc.sharding import _copy_spec

            host = _host(local, device_copies)
            return DTensor.__new__(DTensor, host, _copy_spec(x._spec), requires_grad=False)
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu").copy_(local)
        return DTensor.from_local(host, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())
    if isinstance(x, torch.Tensor):
        return _host(x, device_copies)
    return x


def _host(t: torch.Tensor, device_copies: dict) -> torch.Tensor:
    if t.device.type == "cpu":
        return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)
    device_copies[id(t)] = t
    return t  # replaced by its host copy in stage_async


def stage_async(flat: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """:func:`stage` without waiting for the device: ``(staged, done)``, ``done`` the event the device's
    copies end at (``None`` when none are pending). The blocks of a CUDA device are copied into pinned
    host buffers on a copy stream (:func:`hpfunc.copy_stream.to_host`), so the caller's thread does not
    wait for the device; whoever reads the staged values (the background write) waits for ``done``."""
    from hpfunc.copy_stream import to_host

    if torch.cuda.is_available() and any(isinstance(v, DTensor) and v._local_tensor.device.type == "cpu"
                                         and v.device_mesh.device_type == "cuda" for v in flat.values()):
        # a block of a cuda mesh resting in host memory (state offload) may still be arriving on a copy
        # stream (hpfunc.copy_stream.to_host): read it on the host only once the device's copies ended
        torch.cuda.synchronize()
    device_copies: dict = {}
    staged = {k: _copy(v, device_copies) for k, v in flat.items()}
    if not device_copies:
        return staged, None
    blocks = list(device_copies.values())
    hosts, done = to_host(blocks)
    host_of = {id(b): h for b, h in zip(blocks, hosts)}

    def swap(x: Any) -> Any:
        if isinstance(x, DTensor) and id(x._local_tensor) in host_of:
            return DTensor.__new__(DTensor, host_of[id(x._local_tensor)], x._spec, requires_grad=False)
        return host_of.get(id(x), x) if isinstance(x, torch.Tensor) else x

    return {k: swap(v) for k, v in staged.items()}, done


def stage(flat: dict[str, Any]) -> dict[str, Any]:
    """Host copies of this rank's blocks (DTensors keep their layout): the values the write will see,
    whatever the caller does to its state afterwards.

    >>> import torch
    >>> w = torch.ones(2); staged = stage({"w": w}); _ = w.add_(1)
    >>> staged["w"].tolist()
    [1.0, 1.0]
    """
    staged, done = stage_async(flat)
    if done is not None:
        done.synchronize()
    return staged


class PendingSave:
    """A save in flight: :meth:`wait` for it; :attr:`blocked_s` is how long the caller was held."""

    def __init__(self, path: os.PathLike, step: int) -> None:
        self.path, self.step = path, step
        self.blocked_s = 0.0
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reported = False  # the error was raised to the caller once

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        """Whether the write finished with an error (not waiting: False while it runs)."""
        return self._done.is_set() and self._error is not None

    def wait(self) -> SaveResult:
        """Block until the write finished; its result, or its error raised here."""
        self._done.wait()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._result is not None
        return self._result

    def _run(self, write: Callable[[], SaveResult]) -> None:
        try:
            self._result = write()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self._error = e
        finally:
            self._done.set()


class AsyncSaver:
    """Saves in the background, one at a time (see the module docstring).

    Args:
        after_save: called in the background thread with each finished :class:`SaveResult` (a
            :class:`~hpfunc.checkpoint.manager.CheckpointManager` prunes old checkpoints there).
        timeout_s: how long a collective of the background write waits for the other ranks before
            it fails (the write of the slowest rank included: size it to the checkpoint).
    """

    def __init__(self, *, after_save: Callable[[SaveResult], None] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ValueError(f"AsyncSaver: timeout_s must be a number of seconds > 0, found {timeout_s!r}")
        # a group of its own for the background thread's collectives (every rank creates it, in order)
        self._group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
                       if _ranks.active() and _ranks.world(None) > 1 else None)
        self.timeout_s = float(timeout_s)
        self._after_save = after_save
        self._pending: PendingSave | None = None

    def save(self, path: str | os.PathLike, state: Any, *, step: int, metadata: Any = None,
             expect_bytes: int | None = None) -> PendingSave:
        """Stage ``state`` and start writing it to ``path`` (after the previous save finished); every rank calls it.

        The write first has the ranks compare path and step and rank 0 check the free space against
        ``expect_bytes`` (:func:`hpfunc.checkpoint.save_faults.agree`, on the saver's group): a
        mismatch, too little space or a failed write is a :class:`CheckpointError` on every rank,
        raised by :meth:`PendingSave.wait` (the trainer asks after every step)."""
        start = time.perf_counter()
        check_metadata(metadata)
        step = check_step(step, "save")
        flat = flatten_state(state)
        self.wait()  # at most one in flight; an error of the previous save is raised here
        staged, copied = stage_async(flat)  # device blocks: pinned copies on a copy stream, waited for below
        pending = PendingSave(path, step)
        group, after = self._group, self._after_save

        timeout_s = self.timeout_s

        def write() -> SaveResult:
            if copied is not None:
                copied.synchronize()  # the staged device blocks have reached host memory
            try:
                result = write_flat(path, staged, step=step, metadata=metadata, group=group,
                                    expect_bytes=expect_bytes)
            except Exception as e:
                if not is_comm_failure(e):  # not a collective that lost its peers: the write's own error
                    raise
                raise CheckpointError(
                    f"asynchronous save of step {step} to {path}: a collective among the ranks failed ({e}); "
                    f"a peer died or did not join the save within the saver's timeout ({timeout_s:g} s: "
                    f"checkpoint.timeout_s in hpfunc train); the checkpoint is incomplete and is never taken "
                    f"for a valid one") from e
            if after is not None:
                after(result)
            return result

        pending._thread = threading.Thread(target=pending._run, args=(write,), name=f"hpfunc-ckpt-save-{step}")
        self._pending = pending
        pending._thread.start()
        pending.blocked_s = time.perf_counter() - start
        return pending

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight, if any; its result (its error raised here, unless the caller already
        had it from :meth:`PendingSave.wait`)."""
        pending, self._pending = self._pending, None
        if pending is None or (pending.done() and pending._reported):
            return None
        return pending.wait()

    def close(self) -> None:
        """Finish the save in flight and let the process group go."""
        try:
            self.wait()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
