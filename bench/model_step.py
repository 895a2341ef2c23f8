"""Forward + backward step of a small Qwen3-MoE: hpfunc vs transformers on the same weights and batch.

Both run in one process, interleaved iteration by iteration (so machine noise hits both alike); the
table reports the median step time of each, the ratio hpfunc / reference and tokens per second, and
the JSON lands in ``--out``. The reference is ``Qwen3MoeForCausalLM`` (fp32) with the loss the trainer
uses (cross-entropy + ``router_aux_loss_coef`` x aux loss, ``output_router_logits=True``).

    .venv/bin/python bench/model_step.py                      # qwen3-moe-small, batch 2, seq 256
    .venv/bin/python bench/model_step.py --iters 10 --moe-impl grouped_mm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-moe-small")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--moe-impl", default="auto", choices=["auto", "bmm", "grouped_mm"])
    ap.add_argument("--ref-attn", default="sdpa", choices=["sdpa", "eager"],
                    help="attention implementation of the transformers reference")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "model_step.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    import hpfunc
    from hpfunc.models import qwen3

    cfg = qwen3.preset(args.preset)
    params = qwen3.init(hpfunc.random.key(0), cfg)
    with tempfile.TemporaryDirectory() as d:
        qwen3.save_pretrained(params, cfg, d)
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation=args.ref_attn,
                                                                dtype=torch.float32)
    ref.train()
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens}
    grad_fn = hpfunc.value_and_grad(
        lambda p, b: qwen3.loss(p, b, cfg, moe_impl=args.moe_impl), has_aux=True)

    def step_hpfunc() -> float:
        (value, _), grads = grad_fn(params, batch)
        return float(value)

    def step_ref() -> float:
        ref.zero_grad(set_to_none=True)
        out = ref(input_ids=tokens, labels=tokens, output_router_logits=cfg.is_moe)
        out.loss.backward()
        return float(out.loss.detach())

    loss_h, loss_r = step_hpfunc(), step_ref()
    times: dict[str, list[float]] = {"hpfunc": [], "transformers": []}
    for i in range(args.warmup + args.iters):
        for name, fn in (("hpfunc", step_hpfunc), ("transformers", step_ref)):
            t0 = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    ntok = args.batch * args.seq
    result = {
        "preset": args.preset, "batch": args.batch, "seq": args.seq, "iters": args.iters,
        "moe_impl": args.moe_impl, "ref_attn": args.ref_attn, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
        "loss_hpfunc": loss_h, "loss_transformers": loss_r,
        "hpfunc_ms": med["hpfunc"], "transformers_ms": med["transformers"],
        "ratio": med["hpfunc"] / med["transformers"],
        "hpfunc_tokens_per_s": ntok / med["hpfunc"] * 1e3,
        "transformers_tokens_per_s": ntok / med["transformers"] * 1e3,
        "samples_ms": times,
    }
    print(f"{args.preset}: batch {args.batch} x seq {args.seq}, fwd+bwd fp32, {torch.get_num_threads()} threads, "
          f"median of {args.iters} (moe_impl={args.moe_impl}, reference attention={args.ref_attn})")
    print(f"loss  hpfunc {loss_h:.6f}  transformers {loss_r:.6f}")
    print(f"{'impl':<14}{'ms':>10}{'ratio':>8}{'tokens/s':>12}")
    print(f"{'hpfunc':<14}{med['hpfunc']:>10.1f}{result['ratio']:>8.2f}{result['hpfunc_tokens_per_s']:>12.0f}")
    print(f"{'transformers':<14}{med['transformers']:>10.1f}{1.0:>8.2f}{result['transformers_tokens_per_s']:>12.0f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
