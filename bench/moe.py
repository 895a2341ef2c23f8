"""One MoE layer on 2 and 4 gloo ranks: expert parallelism vs the experts replicated (and vs EP x ETP).

In the same ranks, interleaved iteration by iteration, a forward + backward + gradient reduction of one
MoE layer (router + ``E`` SwiGLU experts, top-``k``) on each rank's ``T`` tokens, through
``hpfunc.parallelize``:

- ``replicated``: every rank holds every expert (``plans.ddp``): no all-to-all, gradients all-reduced;
- ``ep``: the experts split over the ranks (``plans.ep``): two all-to-alls forward, two backward;
- ``ep 2 chunks``: the same with ``AllToAll(chunks=2)``: each half's all-to-alls overlap the other's experts;
- ``ep x etp`` (4 ranks): experts split 2 ways over ``ep`` and their hidden features 2 ways over ``tp``.

Per mode and routing (``uniform``: the router's own; ``skewed``: an expert bias sending most pairs to
the first rank's experts) the table gives the median step time, the bytes this rank sends per step
(``hpfunc.comm_stats``: all-to-all, all-reduce and the rest), the activation bytes the forward keeps for
the backward (storage liveness, :func:`hpfunc.memory.saved_activations`) next to the minimum the
backward needs, and the max / mean of the pairs the ranks' experts receive. The load average is printed;
the JSON lands in ``--out``.

    .venv/bin/python bench/moe.py
    .venv/bin/python bench/moe.py --hidden 2048 --inter 768 --experts 16 --top-k 8 --tokens 64 --iters 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch


def _layer_params(E: int, H: int, I: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(E, H, generator=g) * H ** -0.5,
            "w_gate": torch.randn(E, I, H, generator=g) * H ** -0.5,
            "w_up": torch.randn(E, I, H, generator=g) * H ** -0.5,
            "w_down": torch.randn(E, H, I, generator=g) * I ** -0.5}


def rank_bench(args: dict) -> dict:
    import time

    import hpfunc
    from hpfunc import layout, optim
    from hpfunc.layout import ColwiseParallel, RowwiseParallel
    from hpfunc.memory import saved_activations
    from hpfunc.models.moe import moe_block
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    torch.set_num_threads(1)
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    E, H, I, k, T = args["experts"], args["hidden"], args["inter"], args["top_k"], args["tokens"]
    from hpfunc.models.dispatch import AllToAll

    modes = {"replicated": ({"dp": world}, plans.ddp("dp")),
             "ep": ({"ep": world}, plans.ep("ep", ["w_*"])),
             "ep 2 chunks": ({"ep": world}, plans.ep("ep", ["w_*"]))}  # dispatch overlapped with compute
    dispatchers = {"ep 2 chunks": AllToAll(chunks=2)}
    if world == 4:
        etp = {"w_gate": ColwiseParallel(), "w_up": ColwiseParallel(), "w_down": RowwiseParallel()}
        modes["ep x etp"] = ({"ep": 2, "tp": 2}, plans.ep("ep", ["w_*"]) + plans.tp("tp", etp))
    full = _layer_params(E, H, I, 0)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(world * T, H, generator=g)}

    def routing_bias(kind: str, n: int) -> torch.Tensor:
        b = torch.zeros(E)
        if kind == "skewed":
            b[: max(E // n, k)] = 0.05  # the first rank's experts win most of the close calls
        return b

    results = {}
    for routing in ("uniform", "skewed"):
        for name, (axes, plan) in modes.items():
            mesh = hpfunc.Mesh(axes)
            n_ep = axes.get("ep", 1)
            bias = routing_bias(routing, n_ep)
            received = []
            dispatcher = dispatchers.get(name)

            def loss(p, b):
                y, r = moe_block(b["x"], p["router"], p["w_gate"], p["w_up"], p["w_down"], top_k=k,
                                 norm_topk_prob=True, expert_bias=bias, dispatcher=dispatcher)
                y = layout.reduce_partial(y)  # ETP: the experts' partial outputs summed over tp
                received.append(r.indices.detach())
                return (y.float() ** 2).mean()

            step = parallel_train_step(loss, optim.adamw(1e-3), mesh, plan)
            params = step.shard_params(full)
            opt_state = step.init_opt_state(params)
            for _ in range(2):  # warm up
                step(params, opt_state, batch)
            with hpfunc.comm_stats() as stats:
                step(params, opt_state, batch)
            times = []
            for _ in range(args["iters"]):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                step(params, opt_state, batch)
                times.append((time.perf_counter() - t0) * 1e3)
            # the pairs each expert-parallel rank receives (the whole step's routing, from every rank)
            idx = torch.cat([torch.zeros(0, k, dtype=torch.long)] + received[-1:])
            counts = torch.bincount(idx.reshape(-1), minlength=E).float()
            torch.distributed.all_reduce(counts)
            counts /= axes.get("tp", 1)  # the tp ranks of an ETP group route the same tokens
            per_rank = counts.view(n_ep, -1).sum(1) if n_ep > 1 else counts.sum(0, keepdim=True)
            # saved activation bytes of the forward, in the layout the step uses (local blocks)
            my_x = batch["x"].chunk(world)[rank] if "tp" not in axes else batch["x"].chunk(2)[rank // 2]

            def fwd(p, x):
                with mesh, layout.expert_parallel("ep" if "ep" in axes else None), \
                        layout.tensor_parallel("tp" if "tp" in axes else None):
                    y, _ = moe_block(x, p["router"], p["w_gate"], p["w_up"], p["w_down"], top_k=k,
                                     norm_topk_prob=True, expert_bias=bias, dispatcher=dispatcher)
                    return layout.reduce_partial(y).float().pow(2).mean()

            gathered = {p: (full[p].chunk(axes["tp"], dim=2 if p == "w_down" else 1)[rank % 2]
                            if "tp" in axes and p != "router" else full[p]) for p in full}
            if n_ep > 1:
                e_rank = rank // axes.get("tp", 1)
                gathered = {p: (v.chunk(n_ep)[e_rank] if p != "router" else v) for p, v in gathered.items()}
            report = saved_activations(fwd, {p: v.requires_grad_(True) for p, v in gathered.items()},
                                       my_x.requires_grad_(True), state_argnums=(0,))
            n_rows = int(per_rank[rank // axes.get("tp", 1)]) if n_ep > 1 else my_x.shape[0] * k  # rows computed here
            i_local = gathered["w_gate"].shape[1]
            # the backward needs the experts' input rows, their gate and up outputs and the hidden product
            # (for the three weight gradients and SwiGLU's derivative), the layer input (router gradient),
            # the router probabilities and the layer output (the loss squares it): 4 bytes each
            minimum = 4 * (n_rows * (H + 3 * i_local) + my_x.shape[0] * (2 * H + E))
            results[f"{routing}/{name}"] = {
                "ms": statistics.median(times),
                "sent_bytes": {op: float(stats.total_sent_bytes(op=op)) for op in
                               ("all_to_all", "all_reduce", "all_gather", "reduce_scatter")},
                "saved_bytes": report.device_bytes, "min_saved_bytes": minimum,
                "rank_rows": per_rank.tolist(),
                "rank_max_over_mean": float(per_rank.max() / per_rank.mean().clamp_min(1e-9)),
            }
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=96)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe.json"))
    a = ap.parse_args(argv)
    from hpfunc.testing import RankPool
    from hpfunc.train.output import to_json

    args = {"experts": a.experts, "hidden": a.hidden, "inter": a.inter, "top_k": a.top_k, "tokens": a.tokens,
            "iters": a.iters}
    out = {"args": args, "worlds": {}}
    for world in [int(w) for w in a.worlds.split(",")]:
        with RankPool(world, timeout=1800) as pool:
            res = pool.run(rank_bench, args)
        out["worlds"][world] = res
        load = os.getloadavg()
        print(f"\n{world} ranks: MoE layer E={a.experts} top-{a.top_k} hidden {a.hidden} expert hidden {a.inter}, "
              f"{a.tokens} tokens per rank, fp32; load average {load[0]:.2f}")
        print(f"{'routing/mode':<22}{'ms':>8}{'a2a KiB':>9}{'AR KiB':>8}{'AG+RS KiB':>10}{'saved KiB':>10}"
              f"{'min KiB':>9}{'rank max/mean':>14}")
        for key, r in res[0].items():
            s = r["sent_bytes"]
            print(f"{key:<22}{r['ms']:>8.2f}{s['all_to_all'] / 1024:>9.1f}{s['all_reduce'] / 1024:>8.1f}"
                  f"{(s['all_gather'] + s['reduce_scatter']) / 1024:>10.1f}{r['saved_bytes'] / 1024:>10.1f}"
                  f"{r['min_saved_bytes'] / 1024:>9.1f}{r['rank_max_over_mean']:>14.2f}")
        out.setdefault("load_average", []).append(load)
    print("\nms: median step (forward, backward, gradient reduction, AdamW) on rank 0; KiB: bytes rank 0 sends per "
          "step; saved: activation bytes rank 0's forward keeps for backward (storage liveness); min: what the "
          "backward needs; rank max/mean: the pairs the expert-parallel ranks receive")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(to_json(out, where=a.out, indent=2))
    print(f"wrote {a.out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
