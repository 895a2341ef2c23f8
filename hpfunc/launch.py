"""Launching SPMD programs: ``hpfunc launch`` (a thin layer over ``torch.distributed.run``) and
``spmd(fn, nprocs)`` for notebooks and tests.

Command line (same as torchrun; ``--nproc`` is short for ``--nproc-per-node`` and a single node
runs ``--standalone`` unless you pass rendezvous options)::

    hpfunc launch --nproc 4 examples/shard_map_demo.py
    python -m hpfunc.launch --nproc 4 --timeout 60 examples/shard_map_demo.py

torch's launcher runs in this process and starts each rank through :mod:`hpfunc.rank`, which guards
it (:mod:`hpfunc.faults`): a rank is killed when the launcher dies (even by ``kill -9``); a rank
whose heartbeat stops for longer than the collective timeout (``--timeout``, default 300 s) is named
and killed; a collective that waits longer than the timeout fails with an error naming the rank,
the collective, its mesh axes and the source line (in the process group that
:func:`hpfunc.mesh.init_distributed` or a :class:`hpfunc.Mesh` starts). When a rank fails the
others are stopped and the command exits with that rank's status after one line saying which rank
it was; SIGTERM (or Ctrl-C) stops the ranks and exits with 128 + the signal number. A wrong
``--nproc`` or ``--timeout`` is a usage error (exit status 2).

From Python (a notebook)::

    from hpfunc.launch import spmd
    def f():
        import hpfunc, torch
        mesh = hpfunc.Mesh({"dp": 2})
        return hpfunc.typeof(hpfunc.shard(torch.zeros(4, 2), mesh, hpfunc.P("dp")))
    spmd(f, 2)                      # rank 0's result: 'f32[4@dp,2]'
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from hpfunc.faults import Watchdog, check_timeout, nccl_environment, timeout_from_env
from hpfunc.host_memory import rank_environment

__all__ = ["spmd", "main", "torchrun_args", "parse_args", "run_ranks", "LaunchArgs", "UsageError", "USAGE"]


def spmd(fn: Callable, nprocs: int, *args: Any, return_all: bool = False, pool=None, timeout: float = 300.0,
         **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` gloo ranks and return rank 0's result (or all results).

    Pass a :class:`hpfunc.testing.RankPool` as ``pool`` to reuse running ranks; otherwise ranks are
    started for this call and stopped after it.
    """
    from hpfunc.testing.pool import RankPool

    if pool is not None:
        if pool.nprocs != nprocs:
            raise ValueError(f"spmd(nprocs={nprocs}) was given a pool of {pool.nprocs} ranks")
        out = pool.run(fn, *args, timeout=timeout, **kwargs)
    else:
        with RankPool(nprocs, timeout=timeout) as p:
            out = p.run(fn, *args, **kwargs)
    return out if return_all else out[0]


_RDZV_FLAGS = ("--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend", "--master-addr",
               "--master_addr", "--master-port", "--master_port", "--nnodes", "--standalone")
# torchrun's options that take no value; every other option takes one (``--nnodes 2`` or ``--nnodes=2``)
_TORCHRUN_SWITCHES = ("--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
                      "--virtual-local-rank", "--virtual_local_rank")
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's own --nproc-per-node values besides a number

USAGE = """usage: hpfunc launch --nproc N [--timeout S] script.py [script args]
       hpfunc launch --nproc N [--timeout S] -m module [module args]

Run a script on N ranks through torch's own launcher (torch.distributed.run), one machine
(--standalone unless you pass rendezvous options).

  --nproc N, -n N   number of processes (ranks) per machine, a number >= 1, or gpu (one per GPU,
                    each rank on cuda:LOCAL_RANK with NCCL), cpu, auto (torchrun's words)
  --timeout S       seconds a collective may wait for its peers before the job fails with an error
                    naming the rank and the collective (default 300); a rank whose heartbeat stops
                    for longer is named and killed
  any torchrun option is passed through; see `python -m torch.distributed.run --help`
"""


class UsageError(SystemExit):
    """A wrong ``hpfunc launch`` command line: ``str(e)`` says what is wrong; exit status 2."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


class LaunchArgs(NamedTuple):
    """``hpfunc launch``'s command line, read: torchrun's arguments and hpfunc's own options."""

    torchrun: list[str]  # the arguments of torch.distributed.run (hpfunc's own options taken out)
    nproc: int | None  # --nproc (None: torchrun's auto / cpu / gpu / xpu)
    timeout_s: float | None  # --timeout (None: not given)


def _nproc(value: str, flag: str) -> int | None:
    if value == "gpu":  # one rank per GPU of this machine (torchrun's word), checked here
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"{flag} gpu: this machine has no CUDA device (torch.cuda.is_available() is False); "
                             f"give a number of processes (e.g. {flag} 2)")
        return torch.cuda.device_count()
    if value in _NPROC_WORDS:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1 or str(n) != value.strip():
        raise UsageError(f"{flag}: expected a number of processes >= 1 (e.g. --nproc 2), found {value!r}")
    return n


def parse_args(argv: Sequence[str]) -> LaunchArgs:
    """Read ``hpfunc launch`` arguments: check ``--nproc`` and ``--timeout``, keep the rest for torchrun.

    Raises :class:`UsageError` (exit status 2) naming the option for a wrong or missing value.
    """
    out: list[str] = []
    argv = list(argv)
    nproc: int | None = None
    timeout_s: float | None = None
    i = 0
    script_seen = False

    def value(flag: str) -> str:
        nonlocal i
        a = argv[i]
        if "=" in a:
            return a.split("=", 1)[1]
        if i + 1 >= len(argv):
            raise UsageError(f"{flag} needs a value")
        i += 1
        return argv[i]

    while i < len(argv):
        a = argv[i]
        flag = a.split("=", 1)[0]
        if script_seen:
            out.append(a)
        elif flag in ("--nproc", "-n", "--nproc-per-node", "--nproc_per_node"):
            v = value(flag)
            nproc = _nproc(v, "--nproc-per-node" if flag.startswith("--nproc_") else flag)
            out += ["--nproc-per-node", str(nproc) if v == "gpu" else v]
        elif flag == "--timeout":
            v = value(flag)
            try:
                timeout_s = check_timeout(v, "--timeout")
            except ValueError as e:
                raise UsageError(str(e)) from None
        elif a.startswith("-"):
            out.append(a)
            if "=" not in a and flag not in _TORCHRUN_SWITCHES and i + 1 < len(argv):
                i += 1  # a torchrun option's value (--nnodes 2, --rdzv-endpoint host:port), not the script
                out.append(argv[i])
        else:
            script_seen = True
            if not any(x.split("=")[0] in _RDZV_FLAGS for x in out):
                out.insert(0, "--standalone")
            out.append(a)
        i += 1
    if not script_seen:
        raise UsageError("missing the script to run (hpfunc launch --nproc N script.py [args])")
    return LaunchArgs(out, nproc, timeout_s)


def torchrun_args(argv: Sequence[str]) -> list[str]:
    """Translate ``hpfunc launch`` arguments into ``torch.distributed.run`` arguments (see :func:`parse_args`)."""
    return parse_args(argv).torchrun


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (the ranks inherit it), as it was afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """torch's launcher installs handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT: put ours back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
    before = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, h in before.items():
            if h is not None:
                signal.signal(s, h)


def run_ranks(torchrun_argv: Sequence[str], *, nproc: int | None, timeout_s: float | None = None,
              who: str = "hpfunc launch", backend: str | None = None) -> int:
    """Run torch's launcher on ``torchrun_argv`` (see :func:`torchrun_args`) in this process, each rank
    through :mod:`hpfunc.rank`, and return the exit status; what went wrong is printed on stderr.

    The ranks die with this process (parent-death signal), beat a heartbeat that a watchdog thread
    here reads (a rank silent for longer than the timeout is named and killed), and start their
    process group (:func:`hpfunc.mesh.init_distributed`) with the collective timeout ``timeout_s``
    (default: :data:`hpfunc.faults.DEFAULT_TIMEOUT_S`). With torchrun's ``--no-python`` or
    ``--run-path`` the target runs as given, without the guard.

    Returns:
      0 when every rank exited 0; the status of the first rank that failed (1 when it was killed by
      a signal); 128 + the signal number when this process got SIGTERM, SIGINT, SIGHUP or SIGQUIT
      (the ranks are stopped first).

    ``backend``: the ranks' process-group backend (default: NCCL when this machine has CUDA, as
    :func:`hpfunc.mesh.init_distributed` chooses); on NCCL the ranks also get NCCL's error handling and
    watchdog monitor for the same timeout (:func:`hpfunc.faults.nccl_environment`).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(list(torchrun_argv))
    if not args.module and not args.no_python and not os.path.isfile(args.training_script):
        # found here, before any rank starts (torch's launcher would start them all to fail one by one)
        raise UsageError(f"the script {args.training_script!r} does not exist (or is not a file); give the path of "
                         f"a Python script, or -m MODULE")
    if not args.no_python and not args.run_path:
        args.training_script_args = [*(["-m"] if args.module else []), args.training_script,
                                     *args.training_script_args]
        args.training_script, args.module = "hpfunc.rank", True
    timeout = timeout_from_env() if timeout_s is None else check_timeout(timeout_s, "timeout")
    of = f" of {nproc}" if nproc else ""
    with Watchdog(nproc, timeout, who=who) as dog, _environ(rank_env(dog, timeout, backend)), \
            _signal_handlers_kept():
        try:
            torchrun.run(args)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            code = failure.exitcode
            how = f"exit status {code}" if code >= 0 else f"signal {_signal_name(-code)}"
            why = (" after it stopped responding (see above)" if rank in dog.killed else
                   "; its error is printed above")
            also = [r for r in sorted(dog.killed) if r != rank]
            more = f" Rank {', '.join(map(str, also))} stopped responding and was killed (see above)." if also else ""
            restarts = int(getattr(args, "max_restarts", 0) or 0)
            gave_up = (f" The group was restarted {restarts} time(s), all that --max-restarts (parallel.max_restarts) "
                       f"allows, and failed again: giving up." if restarts else "")
            print(f"hpfunc: rank {rank}{of} failed ({how}){why}. The other ranks were stopped.{more}{gave_up}",
                  file=sys.stderr, flush=True)
            return code if code > 0 else 1
        except SignalException as e:  # the launcher stopped the ranks (SIGTERM, then SIGKILL) before this
            print(f"{who}: stopped by {_signal_name(int(e.sigval))}; the ranks were stopped", file=sys.stderr,
                  flush=True)
            return 128 + int(e.sigval)
    return 0


def rank_env(dog: Watchdog, timeout_s: float, backend: str | None = None) -> dict[str, str]:
    """What a launcher adds to its ranks' environment: the host allocator's thresholds, the watchdog's
    variables (:meth:`hpfunc.faults.Watchdog.env`) and, when the ranks start NCCL (``backend``; None: NCCL
    when this machine has CUDA), NCCL's error handling (:func:`hpfunc.faults.nccl_environment`)."""
    if backend is None:
        import torch

        backend = os.environ.get("HPFUNC_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    return {**rank_environment(), **dog.env(), **(nccl_environment(timeout_s) if backend == "nccl" else {})}


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def main(argv: Sequence[str] | None = None) -> None:
    """``hpfunc launch``: run a script on N ranks through torch's own launcher; exit with its status
    (2 for a wrong command line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    try:
        parsed = parse_args(argv)
    except UsageError as e:
        print(f"hpfunc launch: {e}\n\n{USAGE}", file=sys.stderr, end="")
        raise
    try:
        status = run_ranks(parsed.torchrun, nproc=parsed.nproc, timeout_s=parsed.timeout_s)
    except UsageError as e:
        print(f"hpfunc launch: {e}", file=sys.stderr)
        raise
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
