"""The argument reading the ``hpfunc plan``, ``hpfunc dryrun`` and ``hpfunc simulate`` commands share:
no argument or ``-h``/``--help`` prints the usage; a parse error exits 2 (argparse's own message first).

>>> import argparse
>>> def parser():
...     p = argparse.ArgumentParser(prog="hpfunc x", add_help=False)
...     p.add_argument("config")
...     return p
>>> read_args(parser, "usage: hpfunc x CONFIG", ["a.yaml"]).config
'a.yaml'
>>> read_args(parser, "usage: hpfunc x CONFIG", [])
usage: hpfunc x CONFIG
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


def read_args(parser: Callable[[], argparse.ArgumentParser], usage: str,
              argv: Sequence[str] | None) -> argparse.Namespace | None:
    """The parsed ``argv`` (``sys.argv[1:]`` when ``None``), or ``None`` after printing ``usage`` for no
    argument or a help flag. A parse error exits with status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return None
    try:
        return parser().parse_args(argv)
    except SystemExit:
        raise SystemExit(2) from None
