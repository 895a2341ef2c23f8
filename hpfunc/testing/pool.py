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

Functions and arguments travel with cloudpickle, so lambdas and functions defined in a notebook, a
script or a program read from standard input (``python - <<EOF``) work: the ranks are fresh
interpreters that import only this module (never the caller's main module). Every rank runs the same
function (SPMD). DTensors in the results are gathered into full tensors.

Faults, and what the next ``run`` finds:

* a rank raises: the exception is re-raised here with the rank's traceback attached; the ranks stay up.
* ranks hang (a collective some rank never joined, a rank stopped with SIGSTOP): after ``timeout``
  seconds the ranks are killed and :class:`RankTimeout` names the ranks that did not answer.
* a rank process dies while running the function (killed, ``os._exit``, a crash): the other ranks
  are killed at once (their process group is broken) and :class:`RankError` names the rank, its pid
  and its exit signal or status.
* a rank process dies between runs: the next ``run`` notices before sending anything and starts
  fresh ranks (``pool.restarts`` counts the restarts, ``pool.last_restart_reason`` says why).

After any of these the next ``run`` starts ``nprocs`` fresh ranks. No rank outlives the pool: ``close``
(also on ``with`` exit, a ``KeyboardInterrupt`` during a run, and garbage collection) kills and reaps
every rank process, and a rank whose parent process died exits by itself within a second.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import cloudpickle

from hpfunc.host_memory import rank_environment

__all__ = ["RankPool", "RankError", "RankTimeout"]


class RankError(RuntimeError):
    """A rank failed: its process died (killed, exited, crashed), it failed to start, or it raised an
    exception that could not be re-raised as its own type."""


class RankTimeout(TimeoutError):
    """The ranks did not all answer within the timeout (a hang or a deadlock); the ranks were stopped
    and the next run starts fresh ones."""


# The rank's first statements, run by ``python -c``: set sys.path as the caller's before importing
# anything of hpfunc (a notebook may have put it on the path), then enter _worker_main.
_BOOT = ("import sys\n"
         "from multiprocessing.connection import Connection\n"
         "conn = Connection({fd})\n"
         "path, cfg = conn.recv()\n"
         "sys.path[:] = path\n"
         "from hpfunc.testing.pool import _worker_main\n"
         "_worker_main(conn, **cfg)\n")

_PARENT_POLL_S = 0.5  # how often a rank checks that the process that started it is still alive


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


def _exit_when_orphaned(parent: int) -> None:
    """Exit this rank once the process that started it is gone (it cannot close us any more)."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _worker_main(conn: Connection, *, rank: int, world: int, port: int, threads: int, backend: str,
                 parent: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the caller handles it (and closes the pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True, name="hpfunc-orphan-watch").start()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
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
        except (EOFError, OSError):
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
            reply = ("ok", cloudpickle.dumps(out))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("err", _pack_error(e))
        try:
            conn.send(reply)
        except OSError:  # the caller is gone
            break
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


def _describe_exit(code: int | None) -> str:
    """``'was killed by signal SIGKILL'`` / ``'exited with status 3'`` for a ``Popen.returncode``."""
    if code is None:
        return "closed its connection but is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name}"
    return f"exited with status {code}"


def _proc_state(pid: int) -> str:
    """A few words on a live process's scheduler state (Linux ``/proc``), for timeout messages."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return {"T": " (stopped: SIGSTOP or SIGTSTP)", "t": " (stopped by a debugger)", "D": " (in uninterruptible I/O)",
            "Z": " (exited, not yet reaped)"}.get(state, "")


def _fn_name(fn: Callable) -> str:
    return repr(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or fn)


class RankPool:
    """``nprocs`` persistent ranks forming one process group (see the module docstring for faults).

    Args:
        nprocs: world size.
        timeout: seconds a ``run`` may take before the ranks are presumed hung and restarted.
        env: extra environment variables for the ranks (e.g. ``{"HPFUNC_CHECK_REP": "exact"}``).
        threads: intra-op threads per rank (1 keeps 8 ranks usable on a 2-core machine).
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        start_timeout: seconds the ranks may take to start and form the process group.

    Attributes:
        restarts: how many times fresh ranks were started after the first start.
        last_restart_reason: why the ranks were last restarted (``None`` before any restart).
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
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._started_once = False
        self._stop_reason: str | None = None  # why the ranks were stopped, for the next start
        self.restarts = 0
        self.last_restart_reason: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether every rank process is running (a rank that died since the last run makes it False)."""
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, by rank (empty while stopped)."""
        return [p.pid for p in self._procs]

    def _dead(self) -> list[tuple[int, int, int]]:
        """``(rank, pid, returncode)`` of every rank process that has exited (reaping it)."""
        return [(r, p.pid, p.returncode) for r, p in enumerate(self._procs) if p.poll() is not None]

    def start(self) -> "RankPool":
        """Start the ranks and wait until the process group is up (idempotent: a running pool is kept;
        a pool with a dead rank is stopped and started afresh)."""
        if self.alive:
            return self
        dead = self._dead()
        if dead:
            self._stop_reason = "; ".join(f"rank {r} of {self.nprocs} (pid {pid}) {_describe_exit(rc)} between runs"
                                          for r, pid, rc in dead)
        self.close()
        if self._started_once:
            self.restarts += 1
            self.last_restart_reason = self._stop_reason or "restart requested"
        self._stop_reason = None
        self._started_once = True
        try:
            self._spawn()
            self._await_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self) -> None:
        port = _free_port()
        env = {**os.environ, **rank_environment(), **self.env}  # the host allocator's thresholds (hpfunc.host_memory)
        for r in range(self.nprocs):
            mine, theirs = socket.socketpair()
            try:
                fd = theirs.fileno()
                p = subprocess.Popen([sys.executable, "-c", _BOOT.format(fd=fd)], pass_fds=(fd,), env=env,
                                     stdin=subprocess.DEVNULL)
            finally:
                theirs.close()
            self._procs.append(p)
            self._conns.append(Connection(mine.detach()))
            cfg = dict(rank=r, world=self.nprocs, port=port, threads=self.threads, backend=self.backend,
                       parent=os.getpid())
            self._conns[-1].send((list(sys.path), cfg))

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        index = {c: r for r, c in enumerate(self._conns)}
        pending = list(self._conns)
        while pending:
            left = deadline - time.monotonic()
            ready = wait(pending, timeout=max(left, 0)) if left > 0 else []
            if not ready:
                missing = sorted(index[c] for c in pending)
                raise RankTimeout(f"ranks {missing} of {self.nprocs} did not start and form the {self.backend} "
                                  f"process group within {self.start_timeout:.0f} s (RankPool(start_timeout=...))")
            for c in ready:
                r = index[c]
                pending.remove(c)
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    p = self._procs[r]
                    rc = self._reap(p)
                    raise RankError(
                        f"rank {r} of {self.nprocs} (pid {p.pid}) {_describe_exit(rc)} while starting, before the "
                        f"process group formed; its own error output (stderr) says why. The rank runs "
                        f"`{sys.executable} -c ...` and imports hpfunc.testing.pool from the caller's sys.path"
                    ) from None
                if kind != "ready":
                    raise RankError(f"rank {r} of {self.nprocs} failed to start:\n{payload[2]}")

    @staticmethod
    def _reap(p: subprocess.Popen, timeout: float = 5.0) -> int | None:
        """The exit status of a rank whose connection closed (it is exiting: wait a little for it)."""
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self, *, kill: bool = False) -> None:
        """Stop the ranks: ask them to exit, kill those that do not within 2 s (``kill``: at once), reap them all."""
        procs, conns = self._procs, self._conns
        self._procs, self._conns = [], []
        for p, c in zip(procs, conns):
            if kill or p.poll() is not None:
                continue
            try:  # a rank that does not read (stopped, hung) must not block close(): only if writable now
                if select.select([], [c.fileno()], [], 0)[1]:
                    c.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (0.0 if kill else 2.0)
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end (D state)
                pass
        for c in conns:
            c.close()

    def restart(self) -> None:
        """Stop the ranks and start fresh ones."""
        self.close()
        self._stop_reason = "restart requested"
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

        Raises the first rank's exception (with its remote traceback as a note) if a rank raised,
        :class:`RankError` if a rank process died during the run, :class:`RankTimeout` if ranks did not
        answer within ``timeout`` seconds (or ``grace`` seconds after another rank raised).
        """
        payload = cloudpickle.dumps((fn, args, kwargs, gather))
        msg = (list(sys.path), payload)
        timeout = self.timeout if timeout is None else timeout
        self.start()
        try:
            results = self._send_and_collect(fn, msg, timeout, grace, retry=True)
        except BaseException:
            # interrupted (Ctrl-C) or failed half-way: the ranks may still be running fn, and their late
            # answers would be read as the next run's; stop them, the next run starts fresh ranks
            if self._procs:
                self._stop_reason = "a run was interrupted"
                self.close(kill=True)
            raise
        errors = sorted((r, v[1]) for r, v in results.items() if v[0] == "err")
        if errors:
            self._raise(errors[0][0], errors[0][1])
        return [cloudpickle.loads(results[r][1]) for r in range(self.nprocs)]

    def _send_and_collect(self, fn: Callable, msg: Any, timeout: float, grace: float,
                          retry: bool) -> dict[int, tuple[str, Any]]:
        """Send ``msg`` to every rank and collect the answers; raises (the caller closes the pool) on a
        dead rank or a hang, returns normally when every rank answered."""
        for r, c in enumerate(self._conns):
            try:
                c.send(msg)
            except OSError:
                # this rank's end is closed: it died after start()'s liveness check, before it received
                # the function. Ranks before it have it; stop them all and run on fresh ranks once.
                p = self._procs[r]
                rc = self._reap(p)
                why = f"rank {r} of {self.nprocs} (pid {p.pid}) {_describe_exit(rc)} between runs"
                self.close(kill=True)
                self._stop_reason = why
                if not retry:
                    raise RankError(f"{why}, on fresh ranks; not retrying {_fn_name(fn)} again") from None
                self.start()
                return self._send_and_collect(fn, msg, timeout, grace, retry=False)
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
            for c in wait(pending, timeout=limit - now):
                r = index[c]
                pending.remove(c)
                try:
                    results[r] = c.recv()
                except (EOFError, OSError):
                    self._raise_dead(fn, r, results)
                if results[r][0] == "err" and first_error_at is None:
                    first_error_at = time.monotonic()
        if not pending:
            return results
        missing = sorted(index[c] for c in pending)
        states = ", ".join(f"rank {r} (pid {self._procs[r].pid}){_proc_state(self._procs[r].pid)}" for r in missing)
        errors = sorted((r, v[1]) for r, v in results.items() if v[0] == "err")
        self._stop_reason = f"ranks {missing} hung"
        self.close(kill=True)  # they are stuck: nothing to wait for
        if errors:
            self._raise(errors[0][0], errors[0][1],
                        extra=f"{states} then did not answer within {grace:.0f} s; the ranks were stopped and "
                              f"the next run starts fresh ones")
        raise RankTimeout(
            f"{_fn_name(fn)} did not finish on ranks {missing} within {timeout:.0f} s ({states}; a collective "
            f"some rank never joined?); the ranks were stopped and the next run starts fresh ones"
        )

    def _raise_dead(self, fn: Callable, rank: int, results: dict[int, tuple[str, Any]]) -> None:
        """A rank's connection closed during a run: name it (and any other dead rank), stop the pool."""
        p = self._procs[rank]
        rc = self._reap(p)
        dead = [(rank, p.pid, rc)] + [d for d in self._dead() if d[0] != rank]
        what = "; ".join(f"rank {r} of {self.nprocs} (pid {pid}) {_describe_exit(code)}" for r, pid, code in dead)
        others = "".join(f"\n  rank {r} had raised {v[1][1]}" for r, v in sorted(results.items()) if v[0] == "err")
        self._stop_reason = f"{what} while running {_fn_name(fn)}"
        self.close(kill=True)  # the process group is broken: the others cannot finish cleanly
        raise RankError(
            f"{what} while running {_fn_name(fn)}; the other ranks were stopped (their process "
            f"group is broken) and the next run starts {self.nprocs} fresh ranks{others}"
        )

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
