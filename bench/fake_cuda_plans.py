"""The trainer's whole step of a model on fake CUDA devices, per plan and world size: runs or not, host syncs, time.

    python bench/fake_cuda_plans.py                                  # Qwen3-30B-A3B, worlds 8 and 256, every plan
    python bench/fake_cuda_plans.py --world 8 --plans "fsdp; pp x fsdp, remat"

Each (world, plan) runs one step of ``tests.gpu._fake_pieces.trainer_steps`` (``make_train_step`` under
``hpfunc.parallelize``: the trainer's AdamW with a global-norm clip and its cosine schedule, bf16 compute
over fp32 storage) in its own fresh process, as one rank of the fake world (rank 0 for the pipeline plans:
the first stage; 5 of 8 / 77 of 256 for the others), on fake ``cuda`` devices over torch's fake process
group. Expert-parallel plans use the padded dispatcher (the dropless one reads split sizes no fake device
can answer). It prints a table (ok, host syncs of the step, tensors made on the device, seconds) and
writes ``bench/results/fake_cuda_plans.json``. Slow (minutes per 30B plan on a shared CPU): never in the
test suite; docs/gpu.md holds the last results.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _report import write_json  # noqa: E402

PADDED = {"moe_dispatcher": "padded"}


def plans_for(world: int) -> dict:
    """name -> (parallel section, model overrides, rank) for a world of 8 or 256 (Qwen3-30B-A3B: 4 KV
    heads bound tp at 4; 128 experts; 48 layers in pp stages)."""
    big = world >= 64
    pp = 4 if big else 2
    tp = 4 if big else 2
    ep = 8 if big else 4
    rank = 77 if big else 5
    pipe = {"schedule": "1f1b", "microbatches": 2}
    return {
        "fsdp": ({"mesh": {"fsdp": world}, "plan": ["fsdp"]}, {}, rank),
        "hsdp": ({"mesh": {"dp": 8 if big else 2, "fsdp": world // (8 if big else 2)}, "plan": ["hsdp"]}, {}, rank),
        "fsdp x tp": ({"mesh": {"fsdp": world // tp, "tp": tp}, "plan": ["fsdp", "tp"]}, {}, rank),
        "fsdp x ep": ({"mesh": {"fsdp": world // ep, "ep": ep}, "plan": ["fsdp", "ep"]}, PADDED, rank),
        "ep x tp": ({"mesh": {"ep": world // tp, "tp": tp}, "plan": ["ep", "tp"]}, PADDED, rank),
        "pp x fsdp": ({"mesh": {"pp": pp, "fsdp": world // pp}, "plan": [{"pp": pipe}, "fsdp"]}, {}, 0),
        "pp x ep x fsdp": ({"mesh": {"pp": pp, "ep": 8 if big else 2, "fsdp": world // (pp * (8 if big else 2))},
                            "plan": [{"pp": pipe}, "ep", "fsdp"]}, PADDED, 0),
        "pp x fsdp, remat": ({"mesh": {"pp": pp, "fsdp": world // pp},
                              "plan": [{"pp": {**pipe, "remat": "nothing_saveable"}}, "fsdp"]}, {}, 0),
        "pp x fsdp, swap": ({"mesh": {"pp": pp, "fsdp": world // pp},
                             "plan": [{"pp": {**pipe, "microbatches": 4, "max_resident": 1}}, "fsdp"]}, {}, 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--world", type=int, action="append", help="world size (repeatable; default 8 and 256)")
    ap.add_argument("--plans", default="", help="plan names separated by semicolons (default: all)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "fake_cuda_plans.json"))
    args = ap.parse_args()

    from hpfunc.testing.fake_devices import run_on_fake_devices
    from tests.gpu import _fake_pieces as fp

    rows = []
    for world in args.world or [8, 256]:
        table = plans_for(world)
        names = [n.strip() for n in args.plans.split(";") if n.strip()] or list(table)
        for name in names:
            parallel, model, rank = table[name]
            t0 = time.perf_counter()
            try:
                run = run_on_fake_devices(fp.trainer_steps, [(name, parallel, model)], steps=1, preset=args.preset,
                                          world_size=world, rank=rank, isolated=True)
                r = run.result[name]
                row = {"world": world, "plan": name, "mesh": parallel["mesh"], "rank": rank, "ok": r["ok"],
                       "error": r.get("error"),
                       "host_syncs": [s for st in r.get("steps", []) for s in st["host_syncs"]],
                       "on_device": sum(st["on_device"] for st in r.get("steps", [])),
                       "state_devices": r.get("state_devices"),
                       "step_s": sum(st["seconds"] for st in r.get("steps", []))}
            except Exception as e:  # noqa: BLE001 -- recorded per row
                row = {"world": world, "plan": name, "mesh": parallel["mesh"], "rank": rank, "ok": False,
                       "error": f"{type(e).__name__}: {str(e)[:500]}"}
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(f"{world:>5} {name:<18} {str(parallel['mesh']):<34} {'ok' if row['ok'] else 'FAIL':<5}"
                  f"{len(row.get('host_syncs', [])):>3} syncs {row.get('on_device', 0):>7} on device "
                  f"{row['wall_s']:>7.1f} s {'' if row['ok'] else row['error'][:200]}", flush=True)
            write_json(args.json, {"preset": args.preset, "rows": rows})


if __name__ == "__main__":
    main()
