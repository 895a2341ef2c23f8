"""The entry point of every rank an hpfunc launcher starts: ``python -m hpfunc.rank [-m] TARGET [args]``.

``hpfunc launch`` and ``hpfunc train`` have ``torch.distributed.run`` start this module instead of
the target itself. It first guards the rank (:func:`hpfunc.faults.guard_rank`: the rank is killed
when its launcher dies, and a heartbeat thread tells the launcher it is alive), then runs the target
as ``python TARGET args`` or ``python -m TARGET args`` would (``sys.argv``, ``sys.path[0]``,
``__name__ == "__main__"``). A lost-peer failure of a collective that the target did not catch
(a timeout, a closed connection; see :mod:`hpfunc.faults`) issued outside :mod:`hpfunc.lax` is
re-raised as a :class:`hpfunc.faults.CollectiveError` naming the rank, the collective and where it
was issued (those of :mod:`hpfunc.lax` are one already); the rank exits with status 1.

Example (what ``hpfunc launch --nproc 2 script.py --lr 3`` starts, in effect)::

    torchrun --standalone --nproc-per-node 2 -m hpfunc.rank script.py --lr 3
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

__all__ = ["main"]

USAGE = "usage: python -m hpfunc.rank [-m] TARGET [args]   (started by hpfunc launch / hpfunc train)"


def main(argv: Sequence[str] | None = None) -> None:
    """Guard this rank, then run ``argv`` (``[script, args...]`` or ``["-m", module, args...]``)."""
    from hpfunc import faults

    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        print(f"hpfunc.rank: missing the target to run\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    target, args = argv[0], argv[1:]
    beat = faults.guard_rank()
    try:
        sys.argv = [target, *args]
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
    except RuntimeError as e:
        err = faults.translate(e)
        if err is None or err is e:
            raise
        raise err from e  # the backend's error, then the one naming the collective and the rank
    finally:
        if beat is not None:
            beat.stop()


if __name__ == "__main__":
    main()
