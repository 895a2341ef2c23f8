"""``hpfunc plan CONFIG.yaml --devices N --memory 80GiB [--hardware h100] [--top K] [--json PATH] [--write BEST.yaml]``.

Searches the parallel layouts of the config's model and step (``train.batch_size``, ``train.seq_len``,
``model.dtype``) on ``N`` devices of a hardware preset (:mod:`hpfunc.autoparallel.search`), prints
the ``K`` fastest that fit with their memory and time breakdowns, the families that do not fit and
the term that overflows in each, and how the config's own ``parallel:`` layout fares; ``--write``
writes the best as a trainer config (checked with the trainer's own loader and plan check). Exit
status 0, or 2 for a usage or input error (the message names the flag or the config key).

Example:
    >>> main([])  # doctest: +ELLIPSIS
    usage: hpfunc plan CONFIG.yaml --devices N ...
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Sequence

from hpfunc.autoparallel.cli_args import read_args

__all__ = ["main", "USAGE", "report_json"]

USAGE = """usage: hpfunc plan CONFIG.yaml --devices N [--memory 80GiB] [--hardware h100|h200|a100|cpu] [--top K]
                   [--json PATH] [--write BEST.yaml] [--set key.path=value ...] [--precision mixed|fp32|bf16]
                   [--reserve 4GiB]

Estimate memory and step time of every parallel layout (dp, fsdp/zero/hsdp, tp(+sp), ep, pp with
schedule and microbatches, remat) of the config's model on N devices, and rank those that fit.
The figures come from a cost model (docs/autoparallel.md), not from a run.

  --devices N          number of devices (ranks)
  --memory SIZE        device memory limit (80GiB, 80GB, 85e9); default: the hardware's
  --hardware NAME      h100 (default), h200, a100 or cpu
  --top K              print the K fastest layouts (default 5)
  --json PATH          write the whole report as JSON (keys: docs/autoparallel.md)
  --write BEST.yaml    write the config with the best layout
  --set key=value      override a config key before planning (repeatable)
  --precision P        model-state bytes: mixed (16 B/param), fp32 (16), bf16 (8); default from model.dtype
  --reserve SIZE       memory set aside for what the model does not count (default 4GiB)
"""


_REJECTED_SHOWN = 12


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpfunc plan", usage=USAGE, add_help=False)
    p.add_argument("config")
    p.add_argument("--devices", required=True)
    p.add_argument("--memory")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--top", default="5")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--write")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--precision")
    p.add_argument("--reserve")
    return p


def _int(text: str | None, flag: str, minimum: int = 1) -> int | None:
    """The integer flag ``flag`` given as ``text`` (``None``: not given); below ``minimum`` or not an
    integer: a ``ValueError`` naming the flag."""
    if text is None:
        return None
    try:
        v = int(text)
    except ValueError:
        v = minimum - 1
    if v < minimum:
        raise ValueError(f"{flag}: expected an integer >= {minimum}, found {text!r}")
    return v


def _candidate_json(c: Any) -> dict:
    out = {"layout": c.layout.name, "family": c.layout.family, "parallel": c.layout.parallel_section(),
           "microbatches": c.layout.microbatches, "remat": c.layout.remat,
           "memory_bytes": dict(c.memory.terms), "memory_total_bytes": c.memory.total}
    if c.time is not None:
        out.update(step_seconds=c.time.total, time_seconds=dict(c.time.terms),
                   tokens_per_second_per_device=c.time.tokens_per_second_per_device)
    return out


def report_json(result: Any, *, desc: Any, work: Any, own: Any = None, top: int = 5) -> dict:
    """The report as plain data (documented in docs/autoparallel.md#json)."""
    from hpfunc.autoparallel.flops import train_flops_per_token
    from hpfunc.autoparallel.memory_model import UNMODELLED

    return {
        "devices": result.world, "hardware": result.hardware.name, "memory_limit_bytes": result.memory_limit,
        "model": {"params": desc.params, "layers": desc.num_layers,
                  "train_flops_per_token": train_flops_per_token(desc, work.seq_len, causal=work.causal)},
        "workload": {"global_batch": work.global_batch, "seq_len": work.seq_len, "dtype": work.dtype,
                     "precision": work.precision, "reserve_bytes": work.reserve_bytes},
        "feasible": len(result.feasible),
        "top": [_candidate_json(c) for c in result.feasible[:top]],
        "rejected": [{"family": r.family, "layout": r.layout.name, "term": r.term, "over_bytes": r.over_bytes,
                      "memory_bytes": dict(r.memory.terms), "reason": r.reason(result.memory_limit)}
                     for r in result.rejected],
        "config_layout": own,
        "unmodelled": list(UNMODELLED),
    }


def _print_report(result: Any, desc: Any, work: Any, top: int, own_line: str | None) -> None:
    from hpfunc.autoparallel.flops import train_flops_per_token
    from hpfunc.autoparallel.hardware import format_bytes
    from hpfunc.autoparallel.memory_model import UNMODELLED
    from hpfunc.autoparallel.search import grouped_terms

    hw = result.hardware
    fpt = train_flops_per_token(desc, work.seq_len, causal=work.causal)
    print(f"model: {desc.params / 1e9:.2f} B parameters, {desc.num_layers} layers, {fpt / 1e9:.2f} GFLOP/token "
          f"(training, causal attention at half)")
    print(f"step: {work.global_batch} x {work.seq_len} tokens, {work.dtype}, model states {work.precision}; "
          f"{result.world} x {hw.name}, memory limit {format_bytes(result.memory_limit)} "
          f"(reserve {format_bytes(work.reserve_bytes)})")
    print(f"{len(result.feasible)} layouts fit; the {min(top, len(result.feasible))} fastest (estimated, a cost "
          f"model, not a measurement):")
    print(f"{'#':>3}  {'layout':44} {'memory':>10} {'states':>10} {'activ.':>10} {'step s':>8} {'tok/s/dev':>10} "
          f"{'MFU':>5}")
    peak = hw.peak_flops(work.dtype)
    for i, c in enumerate(result.feasible[:top]):
        g = grouped_terms(c.memory)
        t = c.time
        tok = t.tokens_per_second_per_device if t else float("nan")
        mfu = tok * fpt / peak if t else float("nan")
        print(f"{i + 1:>3}  {c.layout.name:44} {format_bytes(c.memory.total):>10} {format_bytes(g['model states']):>10} "
              f"{format_bytes(g['activations']):>10} {t.total if t else float('nan'):8.3f} {tok:10.0f} {mfu:5.1%}")
    best = result.best
    print(f"best: {best.layout.name}")
    print("  memory: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in best.memory.terms.items()))
    print("  time:   " + ", ".join(f"{k} {v:.3f} s" for k, v in best.time.terms.items()))
    if result.rejected:
        print(f"families that do not fit ({len(result.rejected)}, smallest footprint first):")
        for r in result.rejected[:_REJECTED_SHOWN]:
            print("  " + r.reason(result.memory_limit))
        if len(result.rejected) > _REJECTED_SHOWN:
            print(f"  ... {len(result.rejected) - _REJECTED_SHOWN} more (all in --json)")
    if own_line:
        print(own_line)
    print("not modelled (covered by the reserve): " + "; ".join(UNMODELLED))


def _own_layout(cfg: Any, desc: Any, work: Any, world: int, hw: Any, limit: float, result: Any) -> tuple[str | None, Any]:
    from hpfunc.autoparallel.configuration import LayoutError
    from hpfunc.autoparallel.hardware import format_bytes
    from hpfunc.autoparallel.search import evaluate, overflow
    from hpfunc.autoparallel.trainer_config import layout_of

    if not cfg.parallel.plan:
        return None, None
    try:
        lay = layout_of(cfg)
        lay.check(world, global_batch=work.global_batch, layers=desc.num_layers, num_experts=desc.num_experts,
                  tp_divides=tuple(sorted({d for l in desc.layers for d in l.tp_divides})))
    except LayoutError as err:
        return f"the config's own layout: cannot run on {world} devices: {err}", {"error": str(err)}
    c = evaluate(desc, lay, work, hw, memory_limit=limit)
    over = overflow(c.memory, limit)
    same = [x for x in result.feasible if x.layout.family == lay.family and x.time is not None]
    fam = (f"; its family {lay.family} fits as {same[0].layout.name} ({format_bytes(same[0].memory.total)}, "
           f"estimated {same[0].time.tokens_per_second_per_device:.0f} tokens/s/device, rank "
           f"{result.feasible.index(same[0]) + 1})" if same else f"; no layout of its family {lay.family} fits")
    family = ({"family": lay.family, "best": same[0].layout.name,
               "tokens_per_second_per_device": same[0].time.tokens_per_second_per_device} if same else None)
    if over:
        line = (f"the config's own layout {lay.name}: does not fit: needs {format_bytes(c.memory.total)} > "
                f"{format_bytes(limit)}; the limit is passed at the {over[0]} term (over by "
                f"{format_bytes(over[1])})" + fam)
        return line, {"layout": lay.name, "fits": False, "term": over[0], "over_bytes": over[1],
                      "memory_bytes": dict(c.memory.terms), "family_best": family}
    line = (f"the config's own layout {lay.name}: fits ({format_bytes(c.memory.total)}), estimated "
            f"{c.time.tokens_per_second_per_device:.0f} tokens/s/device" + fam)
    return line, {"layout": lay.name, "fits": True, "memory_bytes": dict(c.memory.terms),
                  "tokens_per_second_per_device": c.time.tokens_per_second_per_device, "family_best": family}


def main(argv: Sequence[str] | None = None) -> None:
    args = read_args(_parser, USAGE, argv)
    if args is None:
        return
    from hpfunc.autoparallel.configuration import LayoutError
    from hpfunc.autoparallel.hardware import HardwareError, hardware, parse_bytes
    from hpfunc.autoparallel.search import PlanError, search
    from hpfunc.autoparallel.trainer_config import check_runnable, describe_model, with_layout, workload_of
    from hpfunc.train.config import ConfigError, apply_overrides, load_config

    try:
        world = _int(args.devices, "--devices")
        top = _int(args.top, "--top")
        hw = hardware(args.hardware)
        limit = parse_bytes(args.memory) if args.memory else hw.hbm_bytes
        reserve = parse_bytes(args.reserve, key="--reserve", allow_zero=True) if args.reserve else None
        cfg = load_config(args.config, args.overrides)
        _, desc = describe_model(cfg)
        work = workload_of(cfg, precision=args.precision, reserve_bytes=reserve)
        result = search(desc, world, work, hw, memory_limit=limit)
        own_line, own = _own_layout(cfg, desc, work, world, hw, limit, result)
    except (ValueError, ConfigError, HardwareError, PlanError, LayoutError) as err:
        print(f"hpfunc plan: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    _print_report(result, desc, work, top, own_line)
    if args.json_path:
        pathlib.Path(args.json_path).write_text(json.dumps(report_json(result, desc=desc, work=work, own=own, top=top),
                                                           indent=1, default=str))
        print(f"wrote {args.json_path}")
    if args.write:
        import yaml

        raw = yaml.safe_load(pathlib.Path(args.config).read_text()) or {}
        data = with_layout(apply_overrides(raw, args.overrides), result.best.layout)
        try:
            check_runnable(data)
        except (ValueError, ConfigError) as err:  # a layout the trainer refuses is a planner bug: say so
            print(f"hpfunc plan: the best layout does not pass the trainer's check: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        best = result.best
        note = (f"# written by hpfunc plan: {best.layout.name} on {world} x {hw.name}, estimated "
                f"{best.time.tokens_per_second_per_device:.0f} tokens/s/device, peak {best.memory.total / 2**30:.1f} "
                f"GiB (a cost model's estimate)\n")
        if best.layout.pp == 1 and best.layout.remat != "none":
            note += (f"# the estimate assumes remat={best.layout.remat} on every layer; the trainer's config has no "
                     f"remat key outside a pp entry yet\n")
        pathlib.Path(args.write).write_text(note + yaml.safe_dump(data, sort_keys=False))
        print(f"wrote {args.write} (checked with the trainer's config loader)")


if __name__ == "__main__":
    main()
