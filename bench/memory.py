"""Saved-activation bytes per remat/offload policy against the formulas, and CPU step time per policy.

Part 1 (exact, no memory used): one transformer layer at Qwen3-30B-A3B attention shapes (hidden 2048,
32 query heads x 128, 4 KV heads, SwiGLU width 6144, seq 4096, b 1, bf16) on fake tensors. For each
policy: bytes kept for backward on device and on host (measured by ``hpfunc.memory.saved_activations``),
in units of s*b*h, next to Korthikanti et al.'s GPT-layer formula and this layer's own formula.

Part 2 (timed, side by side in one run): a small stack of the same layer on real fp32 CPU tensors,
``value_and_grad`` step time of each policy against no remat (median of ``--steps`` steps, policies
interleaved so machine load hits them alike), with the saved bytes of that run.

    .venv/bin/python bench/memory.py                  # writes bench/results/memory.json
    .venv/bin/python bench/memory.py --steps 5 --out /tmp/m.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "remat"))

import hpfunc  # noqa: E402
from _remat_block import BlockConfig, block, init_block, stack_loss  # noqa: E402
from hpfunc.memory import saved_activations  # noqa: E402
from hpfunc.transforms import offload as O  # noqa: E402
from hpfunc.transforms import remat as R  # noqa: E402

SELECTIVE_NAMES = ("attn_in", "q", "k", "v", "mlp_in", "mlp_hidden")


def policies() -> dict:
    """name -> (how to wrap the layer, GPT formula in sbh or None, this layer's formula in sbh)."""
    a, s, h = 32, 4096, 2048
    lse_rsqrt = (4 * a + 2 * 4) / h  # fp32 logsumexp (a s b) and two rsqrt (s b), per s b h
    return {
        "no remat": (lambda f: f, 34.0, 49 + lse_rsqrt),
        "nothing_saveable (full)": (lambda f: R.remat(f, policy=R.nothing_saveable), 2.0, 2.0),
        "dots_with_no_batch_dims (selective)": (
            lambda f: R.remat(f, policy=R.dots_with_no_batch_dims_saveable), 34.0, 2 + 5 + 2 + 12 + 2),
        "dots_saveable": (lambda f: R.remat(f, policy=R.dots_saveable), None, 2 + 5 + 2 + 12 + 2 + 4 + 4 * a / h),
        "save_only_these_names(attn_in,q,k,v,mlp_in,mlp_hidden)": (
            lambda f: R.remat(f, policy=R.save_only_these_names(*SELECTIVE_NAMES)), None, 2 + 2 + 5 + 2 + 6),
        "save q,k,v / offload mlp_hidden": (
            lambda f: R.remat(f, policy=R.save_and_offload_only_these_names(
                names_which_can_be_saved=["q", "k", "v"], names_which_can_be_offloaded=["mlp_hidden"])),
            None, 2 + 5),
        "offload everything (whole-layer swap)": (lambda f: O.offload(f), None, 0.0),
        "offload q,k,v,mlp_hidden": (lambda f: O.offload(f, policy=O.offload_only_these_names(
            "q", "k", "v", "mlp_hidden")), None, 49 + lse_rsqrt - 11),
    }


def memory_table() -> list[dict]:
    cfg = BlockConfig(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144)
    s, b, h = 4096, 1, 2048
    sbh = s * b * h
    rows = []
    with FakeTensorMode():
        params = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in init_block(cfg, device="meta").items()}
        x = torch.empty(b, s, h, dtype=torch.bfloat16)
        for name, (wrap, gpt, ours) in policies().items():
            r = saved_activations(wrap(block), params, x, cfg, state_argnums=(0,))
            rows.append({
                "policy": name, "device_bytes": r.device_bytes, "host_bytes": r.host_bytes,
                "device_sbh": r.device_bytes / sbh, "host_sbh": r.host_bytes / sbh,
                "gpt_formula_sbh": gpt, "layer_formula_sbh": ours,
                "by_name_device": r.by_name("device"), "by_name_host": r.by_name("host"),
            })
    return rows


def step_times(steps: int, layers: int) -> list[dict]:
    torch.manual_seed(0)
    cfg = BlockConfig(hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=384)
    ps = [init_block(cfg, seed=i) for i in range(layers)]
    x = torch.randn(2, 128, cfg.hidden)
    fns = {}
    for name, (wrap, _, _) in policies().items():
        layer = wrap(block)
        fns[name] = (lambda layer: lambda ps, x: stack_loss(ps, x, cfg, layer_fn=layer))(layer)
    times: dict[str, list[float]] = {k: [] for k in fns}
    vg = {k: hpfunc.value_and_grad(f, argnums=(0, 1)) for k, f in fns.items()}
    ref = None
    for k, f in vg.items():  # warm up, and check every policy computes the same gradients
        _, g = f(ps, x)
        leaves = hpfunc.tree.leaves(g)
        ref = ref or leaves
        assert all(torch.equal(a, c) for a, c in zip(ref, leaves)), k
    for _ in range(steps):
        for k, f in vg.items():
            t = time.perf_counter()
            f(ps, x)
            times[k].append(time.perf_counter() - t)
    base = statistics.median(times["no remat"])
    rows = []
    for k, ts in times.items():
        r = saved_activations(fns[k], ps, x, state_argnums=(0,))
        med = statistics.median(ts)
        rows.append({"policy": k, "median_s": med, "vs_no_remat": med / base, "device_bytes": r.device_bytes,
                     "host_bytes": r.host_bytes})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory.json"))
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared CPU)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    mem = memory_table()
    print("Saved bytes per layer, Qwen3-30B-A3B attention shapes (h 2048, 32x128 q, 4 kv, ffn 6144, s 4096, b 1, bf16)")
    print(f"{'policy':58} {'device MiB':>10} {'host MiB':>9} {'dev sbh':>8} {'GPT formula':>11} {'layer formula':>13}")
    for r in mem:
        gpt = "-" if r["gpt_formula_sbh"] is None else f"{r['gpt_formula_sbh']:.1f}"
        print(f"{r['policy']:58} {r['device_bytes'] / 2**20:10.1f} {r['host_bytes'] / 2**20:9.1f} "
              f"{r['device_sbh']:8.3f} {gpt:>11} {r['layer_formula_sbh']:13.3f}")
    steps = step_times(args.steps, args.layers)
    print(f"\nCPU step time, {args.layers} layers (h 128, 4x32 q, 2 kv, ffn 384, s 128, b 2, fp32), "
          f"median of {args.steps}, threads {torch.get_num_threads()}")
    print(f"{'policy':58} {'step ms':>8} {'vs none':>8} {'device KiB':>10} {'host KiB':>9}")
    for r in steps:
        print(f"{r['policy']:58} {r['median_s'] * 1e3:8.1f} {r['vs_no_remat']:8.2f} "
              f"{r['device_bytes'] / 1024:10.0f} {r['host_bytes'] / 1024:9.0f}")
    result = {"memory_qwen3_layer": mem, "step_time_cpu": steps,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from hpfunc.train.output import to_json

    with open(args.out, "w") as fh:
        fh.write(to_json(result, where=str(args.out), indent=1))  # strict JSON (no NaN)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
