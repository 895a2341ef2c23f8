"""``hpfunc dryrun CONFIG.yaml [--world N] [--device cuda|cpu] [--rank R] [--hardware h100] [--json PATH] [--set k=v]``.

Runs the trainer's real parallelized step of the config for one rank on fake tensors and the fake
process group (:mod:`hpfunc.autoparallel.dryrun`), prints what that rank holds, sends and computes
beside the cost model's estimate, and writes the same as JSON with ``--json`` (keys:
docs/autoparallel.md). Exit status 0, or 2 for a usage or config error (the message names the flag or
the config key: a world the mesh does not fill, an unknown hardware name, ...).

Example:
    >>> main([])  # doctest: +ELLIPSIS
    usage: hpfunc dryrun CONFIG.yaml ...
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Sequence

from hpfunc.autoparallel.plan_cli import _int

__all__ = ["main", "USAGE"]

USAGE = """usage: hpfunc dryrun CONFIG.yaml [--world N] [--device cuda|cpu] [--rank R] [--hardware h100|h200|a100|cpu]
                     [--json PATH] [--set key.path=value ...]

Run one training step of the config's model and parallel plan as rank R of N on fake tensors and the
fake process group (nothing allocated, no accelerator), and report that rank's parameter, gradient and
optimizer-state bytes, the peak of what the step allocates (storage liveness), its communication per
collective and mesh axis, its FLOPs, and the cost model's estimate on the hardware.

  --world N        ranks in the world (default: the size of parallel.mesh, which must equal it)
  --device D       fake device type: cuda (default; a shape-only CUDA runtime on a CPU-only torch) or cpu
  --rank R         the rank to run (default 0)
  --hardware NAME  preset for the time estimate: h100 (default), h200, a100 or cpu
  --json PATH      write the report as JSON (keys: docs/autoparallel.md)
  --set key=value  override a config key (repeatable)
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpfunc dryrun", usage=USAGE, add_help=False)
    p.add_argument("config")
    p.add_argument("--world")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rank", default="0")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    try:
        args = _parser().parse_args(argv)
    except SystemExit:
        raise SystemExit(2) from None
    import yaml

    from hpfunc.autoparallel.dryrun import DryRunError, check_request, dry_run, format_report
    from hpfunc.train.config import ConfigError, apply_overrides

    try:
        world = _int(args.world, "--world", 1)
        rank = _int(args.rank, "--rank", 0)
        path = pathlib.Path(args.config)
        if not path.is_file():
            raise ValueError(f"CONFIG: no file {args.config!r}")
        raw = apply_overrides(yaml.safe_load(path.read_text()) or {}, args.overrides)
        check_request(raw, world=world, rank=rank, device=args.device, hardware=args.hardware)
    except (ValueError, ConfigError, DryRunError) as err:
        print(f"hpfunc dryrun: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    report = dry_run(raw, world=world, rank=rank, device=args.device, hardware=args.hardware, progress=True)
    print(format_report(report))
    if args.json_path:
        pathlib.Path(args.json_path).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
