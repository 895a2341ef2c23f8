"""The ``hpfunc`` command: ``hpfunc launch ...``, ``hpfunc train CONFIG.yaml``, ``hpfunc convert SRC DST``,
``hpfunc plan CONFIG.yaml``, ``hpfunc dryrun CONFIG.yaml``, ``hpfunc simulate CONFIG.yaml`` and
``hpfunc --version``.

An argparse parser with one subparser per command; each command parses its own arguments (its module's
``main``), so ``hpfunc COMMAND --help`` is that command's help. Exit status 2 for a usage error: an
unknown command, no command, or a command given no arguments.

Example:
    >>> main(["--version"])  # doctest: +ELLIPSIS
    hpfunc 0.1.0 (torch 2...)
    >>> main(["launch"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    SystemExit: 2
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

__all__ = ["main", "parser", "COMMANDS"]


def _launch(argv: list[str]) -> None:
    from hpfunc.launch import main as launch_main

    launch_main(argv)


def _train(argv: list[str]) -> None:
    from hpfunc.train.cli import main as train_main

    train_main(argv)


def _convert(argv: list[str]) -> None:
    from hpfunc.models.qwen3.convert import main as convert_main

    convert_main(argv)


def _plan(argv: list[str]) -> None:
    from hpfunc.autoparallel.plan_cli import main as plan_main

    plan_main(argv)


def _dryrun(argv: list[str]) -> None:
    from hpfunc.autoparallel.dryrun_cli import main as dryrun_main

    dryrun_main(argv)


def _simulate(argv: list[str]) -> None:
    from hpfunc.autoparallel.simulate_cli import main as simulate_main

    simulate_main(argv)


def _usage_of(command: str) -> str:
    if command == "launch":
        from hpfunc.launch import USAGE
    elif command == "train":
        from hpfunc.train.cli import USAGE
    elif command == "plan":
        return "usage: hpfunc plan CONFIG.yaml --devices N [--memory 80GiB] [--hardware h100] ... (hpfunc plan --help)\n"
    elif command == "simulate":
        return "usage: hpfunc simulate CONFIG.yaml [--world N] [--steps K] ... (hpfunc simulate --help)\n"
    elif command == "dryrun":
        return "usage: hpfunc dryrun CONFIG.yaml [--world N] [--device cuda|cpu] [--rank R] ... (hpfunc dryrun --help)\n"
    else:
        return "usage: hpfunc convert SRC DST [--to dcp|hf|torch] [--config C] ... (hpfunc convert --help)\n"
    return USAGE


# command: (its function, one line of help)
COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "launch": (_launch, "run a script on N ranks (torch.distributed.run underneath): launch --nproc N script.py"),
    "train": (_train, "train a model from a YAML config (on the N processes its parallel.mesh needs)"),
    "convert": (_convert, "convert a model's checkpoint between an hpfunc (DCP) folder, a Hugging Face "
                          "safetensors folder and a .pt file, streamed"),
    "plan": (_plan, "search the parallel layouts that fit N devices, ranked by estimated step time: "
                    "plan CONFIG.yaml --devices N"),
    "dryrun": (_dryrun, "run one training step of a config as one rank of N on fake tensors and the fake process "
                        "group; report its memory, communication, FLOPs and the estimated step time"),
    "simulate": (_simulate, "run all N ranks of a config's parallel training run in one process (a thread per "
                            "rank, real gloo groups, real values): per-step losses equal hpfunc train's"),
}


def _version() -> str:
    import torch

    from hpfunc import __version__

    return f"hpfunc {__version__} (torch {torch.__version__})"


def parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--version`` and one subparser per command (its arguments passed on whole)."""
    p = argparse.ArgumentParser(prog="hpfunc", description="hpfunc: functional distributed training on PyTorch.")
    p.add_argument("--version", action="store_true", help="print hpfunc's and torch's versions and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_line) in COMMANDS.items():
        # add_help=False: COMMAND --help is the command's own help
        s = sub.add_parser(name, help=help_line, add_help=False, prefix_chars="\0")
        s.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``hpfunc``; raises ``SystemExit`` with the command's status (2: a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)  # exits 2 itself for an unknown command
    if args.version:
        print(_version())
        return
    if args.command is None:
        p.print_usage(sys.stderr)
        print("hpfunc: error: a command is required (hpfunc --help lists them)", file=sys.stderr)
        raise SystemExit(2)
    if not args.args:
        print(f"hpfunc {args.command}: error: arguments are required\n\n{_usage_of(args.command)}", file=sys.stderr,
              end="")
        raise SystemExit(2)
    COMMANDS[args.command][0](args.args)


if __name__ == "__main__":
    main()
