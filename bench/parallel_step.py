"""hpfunc.parallel_train_step vs hand-written PyTorch (DDP, FSDP2 ``fully_shard``) on the same model.

For the dense tiny Qwen3 (untied) on 2 and 4 gloo ranks it runs, interleaved in one process per rank,
a full training step (forward, backward, AdamW) of

  * hpfunc ``plans.ddp``  next to ``torch.nn.parallel.DistributedDataParallel``,
  * hpfunc ``plans.fsdp`` next to FSDP2 ``fully_shard`` per layer + root (reshard after forward),

and reports the median step times, their ratio, the bytes each rank sends per step as counted by
hpfunc.comm_stats next to the REFERENCE.md formula (DDP 2 Psi (n-1)/n, FSDP 3 Psi (n-1)/n less the
embedding table, which the backward does not need), and the model-state bytes per rank.

The PyTorch twins wrap the *same* building blocks (hpfunc.models) in nn.Modules, so the compute is
identical and the difference is the framework overhead plus the communication schedule.

Usage:  python bench/parallel_step.py [--ranks 2,4] [--iters 8] [--batch 8] [--seq 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _torch_model(cfg, params):
    """An nn.Module with the hpfunc parameter tree as nn.Parameters; one submodule per layer so that
    FSDP2 can shard (and gather) layer by layer."""
    from torch import nn

    from hpfunc.models.attention import gqa_attention
    from hpfunc.models.layers import rms_norm, swiglu_mlp
    from hpfunc.models.rope import rope_inv_freq, rope_tables

    class Layer(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.attn_norm = nn.Parameter(p["attn_norm"].clone())
            self.mlp_norm = nn.Parameter(p["mlp_norm"].clone())
            self.attn = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in p["attn"].items()})
            self.mlp = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in p["mlp"].items()})

        def forward(self, h, cos, sin):
            a = self.attn
            h = h + gqa_attention(rms_norm(h, self.attn_norm, cfg.rms_norm_eps), a["wq"], a["wk"], a["wv"], a["wo"],
                                  a["q_norm"], a["k_norm"], cos, sin, eps=cfg.rms_norm_eps)
            x = rms_norm(h, self.mlp_norm, cfg.rms_norm_eps)
            return h + swiglu_mlp(x, self.mlp["w_gate"], self.mlp["w_up"], self.mlp["w_down"])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Parameter(params["embed"].clone())
            self.layers = nn.ModuleList([Layer(lp) for lp in params["layers"]])
            self.final_norm = nn.Parameter(params["final_norm"].clone())
            self.lm_head = nn.Parameter(params["lm_head"].clone())

        def forward(self, tokens):
            import torch.nn.functional as F

            from hpfunc.models import qwen3

            h = F.embedding(tokens, self.embed)
            S = tokens.shape[1]
            inv, sc = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    max_position_embeddings=cfg.max_position_embeddings)
            cos, sin = rope_tables(torch.arange(S), inv, sc, dtype=h.dtype)
            for layer in self.layers:
                h = layer(h, cos, sin)
            logits = F.linear(rms_norm(h, self.final_norm, cfg.rms_norm_eps), self.lm_head)
            labels = qwen3.shift_labels(tokens)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    return Model()


def _bench_on_rank(batch: int, seq: int, iters: int) -> dict:
    import math

    import torch.distributed as dist

    import hpfunc
    from hpfunc import optim
    from hpfunc.models import parallel, qwen3
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    torch.set_num_threads(1)
    n = dist.get_world_size()
    rank = dist.get_rank()
    cfg = qwen3.preset("qwen3-dense-tiny", tie_word_embeddings=False)
    full = qwen3.init(hpfunc.random.key(0), cfg)
    psi = sum(p.numel() for p in hpfunc.tree.leaves(full))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    local = tokens.chunk(n)[rank]
    lr = 1e-3
    results = {"ranks": n, "psi": psi, "batch": batch, "seq": seq}

    def timed(fn):
        fn()  # warm-up
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    for kind in ("ddp", "fsdp"):
        mesh = hpfunc.Mesh({kind if kind == "fsdp" else "dp": n})
        plan = plans.fsdp("fsdp") if kind == "fsdp" else plans.ddp("dp")
        step = parallel_train_step(lambda p, b: parallel.loss(p, b, cfg)[0], optim.adamw(lr), mesh, plan)
        state = {"p": step.shard_params(full)}
        state["o"] = step.init_opt_state(state["p"])

        def hp_step():
            state["p"], state["o"], m = step(state["p"], state["o"], {"tokens": tokens})

        model = _torch_model(cfg, full)
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            tmodel = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=mesh.device_mesh)
            tmodel = fully_shard(model, mesh=mesh.device_mesh)
        topt = torch.optim.AdamW(tmodel.parameters(), lr=lr, weight_decay=1e-2, foreach=False)

        def torch_step():
            topt.zero_grad(set_to_none=True)
            tmodel(local).backward()
            topt.step()

        # interleave: hpfunc, torch, hpfunc, torch ... (same load for both)
        t_h, t_t = [], []
        for _ in range(2):
            t_h.append(timed(hp_step))
            t_t.append(timed(torch_step))
        with hpfunc.comm_stats() as stats:
            hp_step()
        sent = float(stats.total_sent_bytes())
        f = (n - 1) / n
        formula = 2 * f * 4 * psi if kind == "ddp" else f * 4 * (3 * psi - full["embed"].numel())
        local_bytes = sum(x.to_local().numel() * 4 for x in hpfunc.tree.leaves(state["p"]))
        local_bytes += sum(x.to_local().numel() * 4 for x in hpfunc.tree.leaves(state["o"])
                           if isinstance(x, torch.Tensor) and x.ndim > 0)
        results[kind] = {"hpfunc_ms": 1e3 * min(t_h), "torch_ms": 1e3 * min(t_t),
                         "ratio": min(t_h) / min(t_t), "sent_bytes": sent, "formula_bytes": formula,
                         "params_plus_adam_bytes_per_rank": local_bytes,
                         "expected_bytes_per_rank": 12 * psi if kind == "ddp" else 12 * psi / n}
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from hpfunc.testing import RankPool

    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        with RankPool(n, timeout=900) as pool:
            r = pool.run(_bench_on_rank, args.batch, args.seq, args.iters)[0]
        rows.append(r)
        for kind in ("ddp", "fsdp"):
            k = r[kind]
            print(f"{n} ranks {kind:5s} hpfunc {k['hpfunc_ms']:7.1f} ms  torch {k['torch_ms']:7.1f} ms  "
                  f"ratio {k['ratio']:.2f}  sent {k['sent_bytes']:.0f} B (formula {k['formula_bytes']:.0f} + 2 scalars)  "
                  f"params+adam/rank {k['params_plus_adam_bytes_per_rank']} B (expected {k['expected_bytes_per_rank']:.0f})",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
