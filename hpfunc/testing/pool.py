"""A persistent pool of real ``torch.distributed`` ranks (gloo on CPU) that runs functions SPMD.

Spawning ranks and forming a process group costs seconds; a pool pays it once and then runs any
number of functions on the same ranks (milliseconds each). Tests use one pool per world size for
the whole pytest session; notebooks hold one as a variable.

    >>> from hpfunc.testing import RankPool
    >>> def hello():
    ...     import torch.distributed as dist
    ...     return dist.get_rank()
    >>> with RankPool(2) as pool:        # doctest: +SKIP
    ...     pool.run(hello)
    [0, 1]

Functions and arguments travel with cloudpickle, so lambdas and functions defined in a notebook
work. Every rank runs the same function (SPMD). DTensors in the results are gathered into full
tensors. When a rank raises, the exception is re-raised here with the rank's traceback attached;
when ranks hang (a collective that some rank never joined), the pool is killed after ``timeout``
seconds, :class:`RankTimeout` is raised, and the next ``run`` starts fresh ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import cloudpickle

__all__ = ["RankPool", "RankError", "RankTimeout"]


class RankError(RuntimeError):
    """A rank raised an exception that could not be re-raised as its own type."""


class RankTimeout(TimeoutError):
    """The ranks did not all answer within the timeout (a hang or a deadlock); the pool was restarted."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather_results(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    from hpfunc import tree as _tree

    def conv(x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.full_tensor().detach()
        if hasattr(x, "detach") and hasattr(x, "requires_grad"):
            return x.detach()
        return x

    return _tree.tree_map(conv, value)


def _worker_main(rank: int, world: int, port: int, conn: Connection, env: dict[str, str], threads: int,
                 path: list[str], backend: str) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    sys.path[:] = path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    import logging

    # DTensor's redistribute warns about gloo fallbacks on every call; keep test and notebook output readable.
    for name in ("torch.distributed", "torch.distributed.tensor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - report any failure to start
        conn.send(("err", _pack_error(e)))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        try:
            parent_path, payload = msg
            for p in parent_path:
                if p not in sys.path:
                    sys.path.append(p)
            fn, args, kwargs, gather = cloudpickle.loads(payload)
            out = fn(*args, **kwargs)
            if gather:
                out = _gather_results(out)
            conn.send(("ok", cloudpickle.dumps(out)))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            conn.send(("err", _pack_error(e)))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _pack_error(e: BaseException) -> tuple[bytes | None, str, str]:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        blob = cloudpickle.dumps(e)
        cloudpickle.loads(blob)
    except Exception:  # noqa: BLE001 - unpicklable exception: send text only
        blob = None
    return blob, f"{type(e).__name__}: {e}", tb


class RankPool:
    """``nprocs`` persistent ranks forming one process group.

    Args:
        nprocs: world size.
        timeout: seconds a ``run`` may take before the ranks are presumed hung and restarted.
        env: extra environment variables for the ranks (e.g. ``{"HPFUNC_CHECK_REP": "1"}``).
        threads: intra-op threads per rank (1 keeps 8 ranks usable on a 2-core machine).
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
    """

    def __init__(self, nprocs: int, *, timeout: float = 120.0, env: dict[str, str] | None = None,
                 threads: int = 1, backend: str = "gloo", start_timeout: float = 300.0):
        if nprocs < 1:
            raise ValueError(f"RankPool needs nprocs >= 1, found {nprocs}")
        self.nprocs = nprocs
        self.timeout = timeout
        self.env = dict(env or {})
        self.threads = threads
        self.backend = backend
        self.start_timeout = start_timeout
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self.restarts = 0

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> "RankPool":
        """Spawn the ranks and wait until the process group is up (idempotent)."""
        if self.alive:
            return self
        self.close()
        ctx = mp.get_context("spawn")
        port = _free_port()
        for r in range(self.nprocs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(r, self.nprocs, port, child, self.env, self.threads, list(sys.path), self.backend))
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        deadline = time.monotonic() + self.start_timeout
        for r, c in enumerate(self._conns):
            left = deadline - time.monotonic()
            if left <= 0 or not c.poll(left):
                self.close()
                raise RankTimeout(f"rank {r} of {self.nprocs} did not start within {self.start_timeout:.0f} s")
            kind, payload = c.recv()
            if kind != "ready":
                self.close()
                raise RankError(f"rank {r} failed to start:\n{payload[2]}")
        return self

    def close(self) -> None:
        """Stop the ranks (kills them if they do not exit promptly)."""
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def restart(self) -> None:
        self.close()
        self.restarts += 1
        self.start()

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- running ---------------------------------------------------------------------------------
    def run(self, fn: Callable, *args: Any, timeout: float | None = None, gather: bool = True,
            grace: float = 10.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the list of per-rank results.

        Raises the first rank's exception (with its remote traceback as a note) if any rank fails.
        """
        self.start()
        payload = cloudpickle.dumps((fn, args, kwargs, gather))
        msg = (list(sys.path), payload)
        for c in self._conns:
            c.send(msg)
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[str, Any]] = {}
        first_error_at: float | None = None
        index = {c: r for r, c in enumerate(self._conns)}
        pending = list(self._conns)
        while pending:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + grace)
            if now >= limit:
                break
            ready = wait(pending, timeout=limit - now)
            for c in ready:
                r = index[c]
                try:
                    results[r] = c.recv()
                except EOFError:
                    results[r] = ("err", (None, "rank process died", f"rank {r} exited (exit code "
                                          f"{self._procs[r].exitcode})"))
                pending.remove(c)
                if results[r][0] == "err" and first_error_at is None:
                    first_error_at = time.monotonic()
        errors = sorted((r, v[1]) for r, v in results.items() if v[0] == "err")
        if pending:
            missing = sorted(index[c] for c in pending)
            self.close()
            if errors:
                self._raise(errors[0][0], errors[0][1], extra=f"ranks {missing} then hung; the pool was restarted")
            raise RankTimeout(
                f"{getattr(fn, '__name__', fn)!r} did not finish on ranks {missing} within {timeout:.0f} s "
                f"(a collective some rank never joined?); the pool was stopped and restarts on the next run"
            )
        if errors:
            self._raise(errors[0][0], errors[0][1])
        return [cloudpickle.loads(results[r][1]) for r in range(self.nprocs)]

    def run0(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`run` but return rank 0's result only."""
        return self.run(fn, *args, **kwargs)[0]

    @staticmethod
    def _raise(rank: int, err: tuple[bytes | None, str, str], extra: str = "") -> None:
        blob, summary, tb = err
        exc: BaseException | None = None
        if blob is not None:
            try:
                exc = cloudpickle.loads(blob)
            except Exception:  # noqa: BLE001
                exc = None
        note = f"raised on rank {rank}:\n{tb}" + (f"\n{extra}" if extra else "")
        if exc is None:
            raise RankError(f"rank {rank}: {summary}\n{note}")
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        raise exc
