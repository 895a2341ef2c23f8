"""``hpfunc simulate CONFIG.yaml [--world N] [--steps K] [--compare METRICS.jsonl] [--json PATH] [--set k=v]``.

Runs every rank of the config's parallel training run in this one process, a thread per rank over
real gloo process groups (:mod:`hpfunc.autoparallel.simulate`), prints each step once all ranks have
finished it, then the per-step losses and gradient norms and, per rank, its mesh coordinate, the norm
of its parameter blocks and the bytes it sent. ``--compare`` checks the losses against a real run's
metrics.jsonl (``hpfunc train`` of the same config and steps). Exit status 0; 1 when a rank failed or
the comparison found a difference beyond ``--rtol``; 2 for a usage or config error (the message names
the flag or the config key, e.g. a world the mesh does not fill).

Example:
    >>> main([])  # doctest: +ELLIPSIS
    usage: hpfunc simulate CONFIG.yaml ...
    >>> main(["nowhere.yaml"])
    Traceback (most recent call last):
    ...
    SystemExit: 2
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

USAGE = """usage: hpfunc simulate CONFIG.yaml [--world N] [--steps K] [--out DIR] [--overwrite] [--json PATH]
                       [--compare METRICS.jsonl] [--rtol R] [--echo] [--set key.path=value ...]

Run all N ranks of the config's parallel training run in this one process (a thread per rank, real
gloo process groups over an in-process store, real values), on the CPU, and report the per-step
losses on every rank, each rank's mesh coordinate, parameter blocks and communication. The losses
equal those of `hpfunc train` of the same config on N processes. Use small sizes (--set).

  --world N        ranks (default: the size of parallel.mesh, which must equal it)
  --steps K        train.steps of the simulated run (default: the config's)
  --out DIR        rank 0's output folder (default: a temporary one, removed)
  --overwrite      replace a previous run in --out
  --json PATH      write the result as JSON (per rank: coordinate, steps, comm, param_norms)
  --compare FILE   a real run's metrics.jsonl: compare its losses step by step (exit 1 beyond --rtol)
  --rtol R         relative tolerance of --compare (default 1e-5)
  --echo           rank 0 also prints what hpfunc train prints
  --set key=value  override a config key (repeatable)
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpfunc simulate", usage=USAGE, add_help=False)
    p.add_argument("config")
    p.add_argument("--world")
    p.add_argument("--steps")
    p.add_argument("--out")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--compare")
    p.add_argument("--rtol", default="1e-5")
    p.add_argument("--echo", action="store_true")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = read_args(_parser, USAGE, argv)
    if args is None:
        return
    from hpfunc.autoparallel.simulate import (SimulationError, SimulationInputError, check_request, compare_records,
                                              format_simulation, simulate)
    from hpfunc.train.output import read_metrics

    try:
        world = _int(args.world, "--world", 1)
        steps = _int(args.steps, "--steps", 1)
        try:
            rtol = float(args.rtol)
        except ValueError:
            raise ValueError(f"--rtol: expected a number, found {args.rtol!r}") from None
        if not pathlib.Path(args.config).is_file():
            raise ValueError(f"CONFIG: no file {args.config!r}")
        real = None
        if args.compare is not None:
            if not pathlib.Path(args.compare).is_file():
                raise ValueError(f"--compare: no file {args.compare!r} (a real run's metrics.jsonl)")
            real = read_metrics(args.compare)
        check_request(args.config, world=world, steps=steps, overrides=args.overrides)
    except (ValueError, SimulationInputError) as err:
        print(f"hpfunc simulate: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        sim = simulate(args.config, world=world, steps=steps, overrides=args.overrides, out_dir=args.out,
                       overwrite=args.overwrite, progress=True, echo=args.echo)
    except SimulationError as err:
        print(f"hpfunc simulate: {err}", file=sys.stderr)
        if err.failures:
            print(f"the traceback of rank {err.failures[0][0]}:\n{err.failures[0][2]}", file=sys.stderr)
        raise SystemExit(1) from None
    print(format_simulation(sim))
    if args.json_path:
        pathlib.Path(args.json_path).write_text(json.dumps(sim.to_dict(), indent=1, default=str))
        print(f"wrote {args.json_path}")
    if real is not None:
        rows, worst, problems = compare_records(sim.records, real, rtol=rtol)
        print(f"compared with {args.compare}: {len(rows)} logged step(s), largest relative difference {worst:.2e} "
              f"(rtol {rtol:g})")
        for step, a, b in rows:
            print(f"  step {step:>4}  simulated {a!r:>22}  real {b!r:>22}")
        if problems:
            print("hpfunc simulate: the simulation differs from the real run: " + "; ".join(problems), file=sys.stderr)
            raise SystemExit(1)
        print("the simulation's losses equal the real run's")
    if sim.disagreements():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
