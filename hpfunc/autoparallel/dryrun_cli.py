"""``hpfunc dryrun CONFIG.yaml [--world N] [--device cuda|cpu] [--rank R | --all-positions] [--hardware h100|PATH.json]
[--reserve GiB] [--moe both|balanced|worst] [--json PATH] [--set k=v]``, and ``hpfunc dryrun --calibrate PATH.json``.

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

from hpfunc.autoparallel.cli_args import read_args
from hpfunc.autoparallel.plan_cli import _int

__all__ = ["main", "USAGE"]

USAGE = """usage: hpfunc dryrun CONFIG.yaml [--world N] [--device cuda|cpu] [--rank R | --all-positions]
                     [--hardware h100|h200|a100|cpu|PATH.json] [--reserve 4GiB] [--moe both|balanced|worst]
                     [--json PATH] [--set key.path=value ...]
       hpfunc dryrun --calibrate PATH.json

Run one training step of the config's model and parallel plan as rank R of N on fake tensors and the
fake process group (nothing allocated, no accelerator), and report that rank's parameter, gradient and
optimizer-state bytes, the peak of what the step allocates (storage liveness), its communication per
collective and mesh axis, its FLOPs, and the cost model's estimate on the hardware.

  --world N        ranks in the world (default: the size of parallel.mesh, which must equal it)
  --device D       fake device type: cuda (default; a shape-only CUDA runtime on a CPU-only torch) or cpu
  --rank R         the rank to run (default 0)
  --all-positions  run one rank of every distinct position in the mesh (each pipeline stage; the first
                   and last coordinate of every other axis, where uneven shards differ) and report each
  --hardware NAME  preset for the time estimate: h100 (default), h200, a100, cpu, or a profile PATH.json
  --reserve SIZE   memory added to the measured peak for what is not modelled (default 4GiB; also the
                   config's top-level `dryrun: {reserve: ...}`, which this command reads and removes)
  --moe CASES      an MoE model's routing assumptions, one step each: worst (default: the dispatcher's
                   capacity worst case), balanced (forced-balanced routing) or both; also `dryrun: {moe: ...}`
  --json PATH      write the report as JSON (keys: docs/autoparallel.md; a list with --all-positions)
  --set key=value  override a config key (repeatable)
  --calibrate PATH measure this machine (matmul FLOP/s by dtype, attention and grouped-GEMM efficiency,
                   memory bandwidth, 2-rank gloo bandwidth and latency) into a hardware profile for --hardware
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpfunc dryrun", usage=USAGE, add_help=False)
    p.add_argument("config", nargs="?")
    p.add_argument("--all-positions", dest="all_positions", action="store_true")
    p.add_argument("--reserve")
    p.add_argument("--moe")
    p.add_argument("--calibrate")
    p.add_argument("--world")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rank", default="0")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = read_args(_parser, USAGE, argv)
    if args is None:
        return
    import yaml

    from hpfunc.autoparallel.dryrun import (DEFAULT_MOE, DEFAULT_RESERVE, MOE_CHOICES, DryRunError, check_request, dry_run,
                                            format_report, positions)
    from hpfunc.autoparallel.hardware import HardwareError, parse_bytes
    from hpfunc.train.config import ConfigError, apply_overrides

    if args.calibrate:
        _calibrate(args.calibrate)
        return
    try:
        if not args.config:
            raise ValueError("CONFIG: expected a config file (or --calibrate PATH)")
        world = _int(args.world, "--world", 1)
        rank = _int(args.rank, "--rank", 0)
        path = pathlib.Path(args.config)
        if not path.is_file():
            raise ValueError(f"CONFIG: no file {args.config!r}")
        raw = apply_overrides(yaml.safe_load(path.read_text()) or {}, args.overrides)
        section = raw.pop("dryrun", None) or {}
        if not isinstance(section, dict) or set(section) - {"reserve", "moe"}:
            raise ValueError(f"dryrun: expected a mapping with the keys 'reserve' and / or 'moe' (e.g. dryrun: "
                             f"{{reserve: 4GiB, moe: worst}}), found {section!r}")
        moe = str(section.get("moe", DEFAULT_MOE)) if args.moe is None else args.moe
        if moe not in MOE_CHOICES:
            key = "--moe" if args.moe is not None else "dryrun.moe"
            raise ValueError(f"{key}: expected one of {', '.join(MOE_CHOICES)}, found {moe!r}")
        reserve = DEFAULT_RESERVE
        if "reserve" in section:
            reserve = parse_bytes(section["reserve"], key="dryrun.reserve", allow_zero=True)
        if args.reserve is not None:
            reserve = parse_bytes(args.reserve, key="--reserve", allow_zero=True)
        cfg, world = check_request(raw, world=world, rank=rank, device=args.device, hardware=args.hardware, moe=moe)
        ranks = positions(dict(cfg.parallel.mesh)) if args.all_positions else [rank]
    except (ValueError, ConfigError, DryRunError, HardwareError) as err:
        print(f"hpfunc dryrun: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    reports = []
    for r in ranks:
        try:
            report = dry_run(raw, world=world, rank=r, device=args.device, hardware=args.hardware, progress=True,
                             reserve_bytes=reserve, moe=moe)
            print(format_report(report))
        except RuntimeError as err:  # a position the fake run cannot take (e.g. a later pipeline stage)
            if not args.all_positions:
                raise
            report = {"rank": r, "world": world, "error": str(err).splitlines()[0]}
            print(f"dry run: rank {r} of {world}: not measured: {report['error']}")
        reports.append(report)
    if args.json_path:
        out = reports if args.all_positions else reports[0]
        pathlib.Path(args.json_path).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json_path}")


def _calibrate(path: str) -> None:
    from hpfunc.autoparallel.calibrate import calibrate
    from hpfunc.autoparallel.hardware import to_json

    print("hpfunc dryrun --calibrate: measuring matmul, attention, grouped GEMM, memory copy and 2-rank gloo ...",
          file=sys.stderr, flush=True)
    hw = calibrate(name=pathlib.Path(path).stem)
    data = to_json(hw)
    pathlib.Path(path).write_text(json.dumps(data, indent=1))
    print(json.dumps(data, indent=1))
    print(f"wrote {path} (use it with --hardware {path})")


if __name__ == "__main__":
    main()
