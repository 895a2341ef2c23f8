"""Launching SPMD programs: ``hpfunc launch`` (a thin layer over ``torch.distributed.run``) and
``spmd(fn, nprocs)`` for notebooks and tests.

Command line (same as torchrun; ``--nproc`` is short for ``--nproc-per-node`` and a single node
runs ``--standalone`` unless you pass rendezvous options)::

    hpfunc launch --nproc 4 examples/shard_map_demo.py
    python -m hpfunc.launch --nproc 4 examples/shard_map_demo.py

From Python (a notebook)::

    from hpfunc.launch import spmd
    def f():
        import hpfunc, torch
        mesh = hpfunc.Mesh({"dp": 2})
        return hpfunc.typeof(hpfunc.shard(torch.zeros(4, 2), mesh, hpfunc.P("dp")))
    spmd(f, 2)                      # rank 0's result: 'f32[4@dp,2]'
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

__all__ = ["spmd", "main", "torchrun_args"]


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


def torchrun_args(argv: Sequence[str]) -> list[str]:
    """Translate ``hpfunc launch`` arguments into ``torch.distributed.run`` arguments."""
    out: list[str] = []
    argv = list(argv)
    i = 0
    script_seen = False
    while i < len(argv):
        a = argv[i]
        if script_seen:
            out.append(a)
        elif a in ("--nproc", "-n"):
            if i + 1 >= len(argv):
                raise SystemExit("hpfunc launch: --nproc needs a number")
            out += ["--nproc-per-node", argv[i + 1]]
            i += 1
        elif a.startswith("--nproc="):
            out += ["--nproc-per-node", a.split("=", 1)[1]]
        elif a.startswith("-"):
            out.append(a)
        else:
            script_seen = True
            if not any(x.split("=")[0] in _RDZV_FLAGS for x in out):
                out.insert(0, "--standalone")
            out.append(a)
        i += 1
    if not script_seen:
        raise SystemExit("hpfunc launch: missing the script to run (hpfunc launch --nproc N script.py [args])")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``hpfunc launch``: run a script on N ranks through torch's own launcher."""
    from torch.distributed.run import main as torchrun_main

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hpfunc launch --nproc N script.py [script args]\n"
              "       (any torchrun option is passed through; see `python -m torch.distributed.run --help`)")
        return
    torchrun_main(torchrun_args(argv))


if __name__ == "__main__":
    main()
