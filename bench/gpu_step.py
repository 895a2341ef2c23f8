"""One GPU: a Qwen3-30B-A3B-shaped layer stack, forward + backward + AdamW, bf16 compute with fp32 master
state; tokens/s and TFLOP/s per GPU next to the published figures (docs/reference.md).

The real shapes (hidden 2048, 32 heads x 128, 4 KV heads, 128 experts top-8, expert FFN 768, vocab
151,936), ``--layers`` of the 48 (as many as fit one GPU: each layer holds about 0.63 B parameters, 16
bytes each with bf16 compute copies, fp32 master weights and two fp32 moments). Each step casts the
fp32 master parameters to bf16, runs the loss and its gradient in bf16 (attention through SDPA, the
experts through ``F.grouped_mm``), and applies the fused AdamW to the fp32 master state.

Routing: ``real`` (the router's top-8, the dropless grouped experts) and ``forced`` (every token's 8
experts assigned round robin, so each expert gets exactly ``tokens x 8 / 128`` rows: the "forced load
balance" of the published MoE tables; the router still runs and its weights still scale the outputs).

FLOP convention (stated with the numbers): per token ``6 x (active parameters - input embedding)``
+ causal attention ``6 x seq x (heads x head_dim) x layers`` (the ``12 s h L`` of full attention,
halved for the causal mask), as NeMo AutoModel and Megatron-Bridge count it (docs/reference.md: 23.0
GFLOP/token for the 48-layer model at seq 4096). :func:`flops_per_token` with ``causal=False`` is what
``torch.utils.flop_counter`` counts (a test checks it on a tiny model).

    python bench/gpu_step.py                    # 4 layers, batch 1 x seq 4096, both routings
    python bench/gpu_step.py --layers 8 --steps 10
    python bench/gpu_step.py --tiny             # a tiny model on this machine (CPU when no GPU): a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

# Published per-GPU figures (docs/reference.md, "Published throughput"; H100, Qwen3-30B-A3B).
PUBLISHED = [
    ("Megatron-Bridge, 16 x H100 EP16 BF16, forced balance", 13011, 299),
    ("Megatron-Bridge, 16 x H100 EP16 BF16, real routing", 8655, 199),
    ("NeMo AutoModel, 8 x H100 EP8 FSDP8 BF16, seq 4096", 12040, 277),
]


def flops_per_token(cfg: Any, seq: int, *, causal: bool = True) -> float:
    """Training FLOPs per token: ``6 x (active params - input embedding) + attention`` (see the module)."""
    from hpfunc.models import qwen3

    active = qwen3.active_params(cfg) - cfg.vocab_size * cfg.hidden_size
    attention = 12 * seq * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 6 * active + (attention / 2 if causal else attention)


class ForcedBalance:
    """A bench-only MoE dispatcher: each token's ``k`` experts are ``(t * k + j) mod E`` (every expert gets the
    same number of rows, within one), the router's choice ignored; its combine weights are kept."""

    def exchange(self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, expert_fn: Any, *,
                 num_experts: int, axis: Any) -> tuple[torch.Tensor, None]:
        T, k = indices.shape
        pairs = T * k
        forced = torch.arange(pairs, device=flat.device) % num_experts
        order = forced.argsort(stable=True)  # pairs grouped by expert
        base, extra = divmod(pairs, num_experts)
        counts = torch.tensor([base + (e < extra) for e in range(num_experts)], device=flat.device)  # known here
        token = order // k
        out = expert_fn(flat.index_select(0, token), counts, weights.reshape(-1, 1).index_select(0, order))
        return torch.zeros_like(flat).index_add(0, token, out), None


def build(cfg: Any, device: torch.device, dtype: torch.dtype, routing: str, lr: float = 1e-4):
    """``(master, opt_state, step)``: fp32 master parameters on ``device``, their AdamW state, and
    ``step(master, opt_state, batch) -> (master, opt_state, loss)`` computing in ``dtype``."""
    from hpfunc import optim, random, tree
    from hpfunc.models import qwen3
    from hpfunc.models.moe import is_expert_bias

    master = qwen3.init(random.key(0, device=device), cfg)  # sampled on the device (hpfunc.random)
    trained = {p for p, _ in tree.leaves_with_paths(master) if not is_expert_bias(p)}
    tx = optim.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1)
    opt_state = tx.init(master)
    n_moe = sum(1 for p in trained if p.endswith("moe.router"))
    dispatchers = [ForcedBalance()] * n_moe if routing == "forced" else None

    def step(master, opt_state, batch):
        compute = tree.map_with_path(  # the expert bias stays float32, as the model keeps it
            lambda path, p: (p if is_expert_bias(path) else p.to(dtype)).detach().requires_grad_(), master)
        leaves = tree.leaves(compute)
        loss, _ = qwen3.loss(compute, batch, cfg, moe_dispatchers=dispatchers)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        spec = tree.structure(compute)
        grads = tree.unflatten(spec, [torch.zeros_like(m) if g is None else g.float()
                                      for g, m in zip(grads, tree.leaves(master))])
        master, opt_state = optim.update_and_apply(tx, grads, opt_state, master)
        return master, opt_state, loss.detach()

    return master, opt_state, step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg: Any, device: torch.device, dtype: torch.dtype, routing: str, batch: int, seq: int, warmup: int,
            steps: int) -> dict:
    from hpfunc import random

    master, opt_state, step = build(cfg, device, dtype, routing)
    tokens = random.randint(random.key(1, device=device), (batch, seq), 0, cfg.vocab_size)
    data = {"tokens": tokens}
    for _ in range(warmup):
        master, opt_state, loss = step(master, opt_state, data)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses = []
    for _ in range(steps):
        master, opt_state, loss = step(master, opt_state, data)
        losses.append(loss)
    _sync(device)
    dt = (time.perf_counter() - t0) / steps
    tok_s = batch * seq / dt
    fpt = flops_per_token(cfg, seq)
    out = {"routing": routing, "step_s": dt, "tokens_per_s": tok_s, "tflops": tok_s * fpt / 1e12,
           "gflop_per_token": fpt / 1e9, "losses": [float(x) for x in torch.stack(losses).float().cpu()]}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del master, opt_state
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 48 (each ~0.63 B parameters)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--routing", default="both", choices=["both", "forced", "real"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="qwen3-moe-tiny, batch 2 x seq 64, 1+2 steps (a smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "gpu_step.json"))
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _report import write_json

    from hpfunc.models import qwen3

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    if args.tiny:
        cfg = qwen3.preset("qwen3-moe-tiny")
        args.batch, args.seq, args.warmup, args.steps = 2, 64, 1, 2
    else:
        cfg = qwen3.preset("qwen3-30b-a3b", num_hidden_layers=args.layers)
    dtype = torch.bfloat16
    routings = ["forced", "real"] if args.routing == "both" else [args.routing]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_step: {cfg.num_hidden_layers} layers (hidden {cfg.hidden_size}, {cfg.num_experts} experts top-"
          f"{cfg.num_experts_per_tok}), batch {args.batch} x seq {args.seq}, bf16 compute + fp32 master, on {name}")
    print(f"FLOPs/token = 6 x (active params - input embedding) + causal attention 6 x seq x q-width x layers = "
          f"{flops_per_token(cfg, args.seq) / 1e9:.2f} GFLOP (48 layers at seq 4096: "
          f"{flops_per_token(qwen3.preset('qwen3-30b-a3b'), 4096) / 1e9:.2f})")
    rows = [measure(cfg, device, dtype, r, args.batch, args.seq, args.warmup, args.steps) for r in routings]
    print(f"{'run':<58}{'tokens/s/GPU':>14}{'TFLOP/s/GPU':>13}")
    for r in rows:
        mem = f", peak {r['peak_gib']:.1f} GiB" if "peak_gib" in r else ""
        print(f"{'hpfunc, ' + r['routing'] + ' routing' + mem:<58}{r['tokens_per_s']:>14,.0f}{r['tflops']:>13.1f}")
    for label, tok, tf in PUBLISHED:
        print(f"{label:<58}{tok:>14,}{tf:>13}")
    result = {"device": name, "layers": cfg.num_hidden_layers, "batch": args.batch, "seq": args.seq,
              "tiny": args.tiny, "flop_convention": "6 x (active - input embedding) + causal attention (halved)",
              "runs": rows, "published": [dict(zip(("setup", "tokens_per_s", "tflops"), p)) for p in PUBLISHED]}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
