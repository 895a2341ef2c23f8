"""Starting the ranks of a multi-process run: ``hpfunc train`` re-executes itself under torch's launcher.

When the config's mesh needs more than one process and the current process is not one of a launch's
ranks (no ``RANK`` / ``WORLD_SIZE`` in the environment), the command starts
``torch.distributed.run`` in-process (the launcher ``hpfunc launch`` wraps) with a standalone
rendezvous on this machine and one process per mesh position, each running the same command::

    hpfunc train cfg.yaml --set x=y      # 4-process mesh: becomes, in effect,
    torchrun --standalone --nproc-per-node 4 -m hpfunc.rank -m hpfunc.cli train cfg.yaml --set x=y

Inside the ranks :func:`in_launched_rank` is true, so they train instead of launching again. A rank
that fails makes the launcher stop the others (nobody waits on a collective that never comes) and
:func:`launch` returns that rank's exit status; the rank printed its own error on stderr.

The ranks start through :mod:`hpfunc.rank` (:func:`hpfunc.launch.run_ranks`), so no rank outlives
the launcher (even a ``kill -9`` of it), and with the collective timeout ``timeout_s`` (the config's
``parallel.timeout_s``): a collective that waits longer fails naming the rank, the collective and
its mesh axis, and a rank whose heartbeat stops for longer (stopped, hung) is named and killed.
SIGTERM or Ctrl-C of the launcher stops the ranks; :func:`launch` then returns 128 + the signal.

Example (a script instead of the trainer, as the tests do)::

    status = launch(["script.py", "arg"], nproc=2)      # 0 when every rank exits 0
"""

from __future__ import annotations

import math
import os
from typing import Sequence

__all__ = ["in_launched_rank", "launch", "rank_of_this_process"]

_UNSHARE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def in_launched_rank() -> bool:
    """Whether this process is a rank of a torchrun-style launch (``RANK`` and ``WORLD_SIZE`` are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_of_this_process() -> int:
    """``RANK`` of a launched rank, else 0."""
    return int(os.environ.get("RANK", "0"))


def launch(target: Sequence[str], nproc: int, *, module: bool = False, threads: int | None = None,
           timeout_s: float | None = None, max_restarts: int = 0, shutdown_timeout_s: float | None = None,
           backend: str | None = None) -> int:
    """Run ``target`` (a script and its arguments, or with ``module`` a module name and its arguments)
    on ``nproc`` local ranks through ``torch.distributed.run``; return the exit status.

    Args:
      target: ``[script.py, args...]`` or ``[module, args...]``.
      nproc: number of processes (the mesh size).
      module: run ``python -m target[0]``.
      threads: ``OMP_NUM_THREADS`` for the ranks when the environment does not set it (torch's
        launcher would otherwise set 1 and print a banner saying so).
      timeout_s: the collective timeout (``parallel.timeout_s``); None: the default of
        :func:`hpfunc.launch.run_ranks` (300 s).
      max_restarts: elastic restarts (``parallel.max_restarts``, torchrun's ``--max-restarts``): after a
        rank fails the launcher stops the others and starts the whole group again, up to this many
        times; the trainer's ranks of a restarted group resume from the newest checkpoint.
      shutdown_timeout_s: how long the launcher lets the ranks finish after SIGTERM (their last words)
        before it kills them (torchrun's ``--shutdown-timeout``; None: torch's 30 s).
      backend: the ranks' backend (``nccl`` gives them NCCL's error handling for the same timeout,
        :func:`hpfunc.faults.nccl_environment`); None: NCCL when this machine has CUDA.

    Returns:
      0 when every rank exited 0; otherwise the exit status of the first rank that failed (1 when it
      was killed by a signal); 128 + the signal number when the launcher got SIGTERM, SIGINT (130),
      SIGHUP or SIGQUIT, after stopping the ranks. What went wrong is printed on stderr.
    """
    from hpfunc.launch import run_ranks, torchrun_args

    os.environ.setdefault("OMP_NUM_THREADS", str(threads or 1))
    # torch 2.13's launcher shares its rendezvous store with the ranks and gives a restarted group no
    # key prefix of its own: the new ranks read the gloo addresses of the dead ones ("Gloo connectFullMesh
    # failed ... Connection refused", seen on the first restart). With the store not shared, rank 0 of
    # each attempt hosts a fresh one.
    unshare = bool(max_restarts) and _UNSHARE not in os.environ
    if unshare:
        os.environ[_UNSHARE] = "1"
    extra = [*([f"--max-restarts={max_restarts}"] if max_restarts else []),
             *([f"--shutdown-timeout={int(math.ceil(shutdown_timeout_s))}"] if shutdown_timeout_s else [])]
    argv = ["--nproc", str(nproc), *extra, *(["--module"] if module else []), *target]
    try:
        return run_ranks(torchrun_args(argv), nproc=nproc, timeout_s=timeout_s, who="hpfunc train",
                         backend=backend)
    finally:
        if unshare:
            os.environ.pop(_UNSHARE, None)
