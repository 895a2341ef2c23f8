"""Pipeline schedules: simulated bubble ratio and peak in-flight activations vs the formulas of
docs/reference.md#pipeline-schedules.

Runs every generator of :mod:`hpfunc.schedules` for p in {2, 4, 8} and m in {p, 2p, 4p, 8p}
(v = 2 for interleaved 1F1B) under unit costs (F = B = W = 1, BW = 2), prints one table and writes
the rows as JSON.

Columns:
  bubble      idle / useful on rank 0 for one isolated step (the measure of the 1F1B literature)
  steady      the same when steps follow one another with post-validation overlap (what the
              zero-bubble papers drive to 0)
  formula     the bubble of docs/reference.md#pipeline-schedules, as a ratio (idle-time formulas are
              divided by the useful time 3m, or 6m for the two-chunk V schedules)
  peak        peak in-flight activations on rank 0 in microbatches of a full rank (stage-chunk
              activations / chunks per rank); formula beside it

Usage:
    python bench/schedules.py [--out bench/results/schedules.json] [--plots DIR] [--p 2 4 8]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from hpfunc.schedules import (  # noqa: E402
    dualpipev,
    gpipe,
    insert_comms,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    validate,
    zb_h1,
    zb_h2,
    zbv,
)

F = B = W = 1.0
V = 2


def formulas(name: str, p: int, m: int) -> tuple[float, str, float, str]:
    """(bubble ratio, measure it is compared with, peak in-flight, unit of the peak) from
    docs/reference.md#bubbles-and-peak-in-flight-activations. Peak units: "mb" = microbatches of a
    full rank, "chunks" = stage activations."""
    if name == "gpipe":
        return (p - 1) / m, "bubble", m, "mb"
    if name == "1f1b":
        return (p - 1) / m, "bubble", min(p, m), "mb"
    if name == "interleaved_1f1b":
        return (p - 1) / (V * m), "bubble", p * (1 + (p - 1) / (p * V)), "mb"
    if name == "zb_h1":
        return (p - 1) * (F + B - W) / (3 * m), "bubble", p, "mb"
    if name == "zb_h2":
        return (p - 1) * (F + B - 2 * W) / (3 * m), "steady", 2 * p - 1, "mb"
    if name == "zbv":
        return 0.0, "steady", p, "mb"
    if name == "dualpipev":
        # The DualPipe(V) row counts pipeline *stages* (DualPipe's PP: 2 per rank here) and its
        # memory in stage activations. F&B = F + B + W: no compute/communication overlap modelled.
        stages = 2 * p
        f_and_b = F + B + W
        return (stages / 2 - 1) * (f_and_b + B - 3 * W) / (6 * m), "bubble", stages + 1, "chunks"
    raise KeyError(name)


def why(name: str, p: int, m: int) -> str:
    """The known reason a small-m row departs from an asymptotic formula ('' if none)."""
    if name == "interleaved_1f1b" and m * V <= 2 * (p - 1) + (V - 1) * p:
        return "warm-up capped at m*v: every forward precedes the first backward"
    if name in ("zb_h2", "zbv") and m < 2 * p:
        return "m < 2p: too few microbatches to fill the warm-up"
    return ""


def schedules(p: int, m: int):
    yield "gpipe", gpipe(p, m)
    yield "1f1b", one_f_one_b(p, m)
    yield "interleaved_1f1b", interleaved_1f1b(p, m, V)
    yield "zb_h1", zb_h1(p, m)
    yield "zb_h2", zb_h2(p, m)
    yield "zbv", zbv(p, m)
    if m >= 2 * p:
        yield "dualpipev", dualpipev(p, m)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "schedules.json"))
    parser.add_argument("--plots", default=None, help="directory for one PNG chart per schedule (p=4, m=8)")
    parser.add_argument("--p", type=int, nargs="+", default=[2, 4, 8], help="pipeline sizes (default 2 4 8)")
    args = parser.parse_args(argv)

    rows = []
    start = time.perf_counter()
    header = (f"{'schedule':18s} {'p':>2s} {'m':>3s}  {'bubble':>7s} {'steady':>7s} {'formula':>7s} "
              f"{'(vs)':6s} {'peak':>6s} {'formula':>7s}  {'makespan':>8s}  note")
    print(header)
    print("-" * len(header))
    for p in args.p:
        for m in (p, 2 * p, 4 * p, 8 * p):
            for name, s in schedules(p, m):
                validate(insert_comms(s))
                r = simulate(s)
                f_bubble, measure, f_peak, unit = formulas(name, p, m)
                got = r.bubble_ratio[0] if measure == "bubble" else r.steady_bubble_ratio[0]
                peak = r.peak_inflight_mb[0] if unit == "mb" else r.peak_inflight[0]
                notes = []
                if not math.isclose(got, f_bubble, abs_tol=1e-9):
                    notes.append("bubble differs")
                if not math.isclose(peak, f_peak, abs_tol=1e-9):
                    notes.append("peak differs")
                if notes and why(name, p, m):
                    notes.append(why(name, p, m))
                if unit == "chunks":
                    notes.append("peak in stage activations")
                row = {
                    "schedule": name, "p": p, "m": m, "v": V if name == "interleaved_1f1b" else
                    (2 if name in ("zbv", "dualpipev") else 1),
                    "makespan": r.makespan,
                    "bubble_ratio": r.bubble_ratio[0],
                    "bubble_ratio_max": max(r.bubble_ratio.values()),
                    "steady_bubble_ratio": r.steady_bubble_ratio[0],
                    "idle": r.idle[0],
                    "formula_bubble_ratio": f_bubble,
                    "formula_compared_with": measure,
                    "peak_inflight_stage_chunks": r.peak_inflight[0],
                    "peak_inflight_microbatches": r.peak_inflight_mb[0],
                    "peak_until_w_stage_chunks": max(r.peak_until_w.values()),
                    "formula_peak_inflight": f_peak,
                    "peak_unit": unit,
                    "matches": not any("differs" in n for n in notes),
                    "note": "; ".join(notes),
                }
                rows.append(row)
                print(f"{name:18s} {p:2d} {m:3d}  {r.bubble_ratio[0]:7.4f} {r.steady_bubble_ratio[0]:7.4f} "
                      f"{f_bubble:7.4f} {measure:6s} {peak:6.2f} {f_peak:7.2f}  {r.makespan:8g}  "
                      f"{', '.join(notes)}")
    elapsed = time.perf_counter() - start
    ok = sum(r["matches"] for r in rows)
    print(f"\n{ok}/{len(rows)} rows match their formula; {elapsed:.1f} s")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from hpfunc.train.output import to_json  # strict JSON: a non-finite number is written as null

    out.write_text(to_json({"costs": {"F": F, "B": B, "W": W}, "rows": rows}, where=str(out), indent=1))
    print(f"wrote {out}")
    if args.plots:
        plots = Path(args.plots)
        plots.mkdir(parents=True, exist_ok=True)
        for name, s in schedules(4, 8):
            simulate(s).plot(plots / f"{name}_p4_m8.png")
        print(f"wrote charts to {plots}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
