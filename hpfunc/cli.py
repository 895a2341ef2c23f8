"""The ``hpfunc`` command: ``hpfunc launch ...``, ``hpfunc train CONFIG.yaml``, ``hpfunc convert SRC DST`` and ``hpfunc plan CONFIG.yaml``."""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = """usage: hpfunc <command> [args]

commands:
  launch --nproc N script.py [args]   run a script on N ranks (torch.distributed.run underneath)
  train CONFIG.yaml [--set key=value] train a model from a YAML config (on N processes, which it
                                      starts, when its parallel.mesh has N > 1 positions)
  convert SRC DST [--to dcp|hf|torch] convert a model's checkpoint between an hpfunc (DCP) folder, a
                                      Hugging Face safetensors folder and a .pt file, streamed
                                      (hpfunc convert --help)
  plan CONFIG.yaml --devices N [--memory 80GiB] [--hardware h100]
                                      search the parallel layouts that fit N devices, ranked by
                                      estimated step time (hpfunc plan --help)
"""


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "launch":
        from hpfunc.launch import main as launch_main

        launch_main(rest)
    elif cmd == "train":
        from hpfunc.train.cli import main as train_main

        train_main(rest)
    elif cmd == "convert":
        from hpfunc.models.qwen3.convert import main as convert_main

        convert_main(rest)
    elif cmd == "plan":
        from hpfunc.autoparallel.plan_cli import main as plan_main

        plan_main(rest)
    else:
        print(f"hpfunc: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
