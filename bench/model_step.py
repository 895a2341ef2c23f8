"""Forward + backward step of a small Qwen3-MoE: hpfunc vs transformers on the same weights and batch.

With ``--compile BACKEND`` (default ``inductor``; ``none`` leaves it out) a third step runs beside them:
hpfunc with each decoder layer's compute compiled as regions (:mod:`hpfunc.regions`,
``train.compile``), with its first step (the compilation) timed apart, its loss against eager hpfunc's
and the graphs compiled after the warmup (0 expected).

They run in one process, interleaved iteration by iteration with alternating order (so machine noise
hits all alike); the table reports the median wall time of each step, the ratio hpfunc / reference and
tokens per second, plus the best wall time and the median process CPU time (on a shared machine the
latter two are the more stable), and the JSON lands in ``--out``. The reference is ``Qwen3MoeForCausalLM`` (fp32) with the loss the trainer
uses (cross-entropy + ``router_aux_loss_coef`` x aux loss, ``output_router_logits=True``).

    .venv/bin/python bench/model_step.py                      # qwen3-moe-small, batch 2, seq 256
    .venv/bin/python bench/model_step.py --iters 10 --moe-impl grouped_mm
    .venv/bin/python bench/model_step.py --preset qwen3-dense-tiny --compile aot_eager
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--compile", default="inductor", choices=["inductor", "aot_eager", "eager", "none"],
                    help="torch.compile backend of the compiled-regions step ('none': no compiled step)")
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

    steps = {"hpfunc": step_hpfunc}
    compile_info: dict = {}
    if args.compile != "none":
        from torch._dynamo.utils import counters

        from hpfunc.regions import Regions

        regions = Regions(args.compile)
        grad_compiled = hpfunc.value_and_grad(
            lambda p, b: qwen3.loss(p, b, cfg, moe_impl=args.moe_impl, regions=regions), has_aux=True)

        def step_compiled() -> float:
            (value, _), grads = grad_compiled(params, batch)
            return float(value)

        t0 = time.perf_counter()
        loss_c = step_compiled()
        compile_info = {"backend": args.compile, "first_step_s": time.perf_counter() - t0, "loss": loss_c,
                        "graphs_first_step": counters["stats"]["unique_graphs"], "regions": regions.compilations}
        steps["compiled"] = step_compiled

    def step_ref() -> float:
        ref.zero_grad(set_to_none=True)
        out = ref(input_ids=tokens, labels=tokens, output_router_logits=cfg.is_moe)
        out.loss.backward()
        return float(out.loss.detach())

    loss_h, loss_r = step_hpfunc(), step_ref()
    steps["transformers"] = step_ref
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(args.warmup + args.iters):
        order = tuple(steps.items())
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((time.process_time() - c0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
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
        "hpfunc_min_ms": best["hpfunc"], "transformers_min_ms": best["transformers"],
        "ratio_min": best["hpfunc"] / best["transformers"],
        "hpfunc_cpu_ms": cpu_med["hpfunc"], "transformers_cpu_ms": cpu_med["transformers"],
        "ratio_cpu": cpu_med["hpfunc"] / cpu_med["transformers"],
        "samples_ms": times, "samples_cpu_ms": cpu, "load_average": os.getloadavg(),
    }
    if compile_info:
        compile_info.update(
            graphs_after_first_step=counters["stats"]["unique_graphs"] - compile_info["graphs_first_step"],
            rel_loss_diff=abs(compile_info["loss"] - loss_h) / abs(loss_h), ms=med["compiled"],
            min_ms=best["compiled"], cpu_ms=cpu_med["compiled"], vs_eager=med["compiled"] / med["hpfunc"],
            vs_eager_cpu=cpu_med["compiled"] / cpu_med["hpfunc"])
        result["compiled"] = compile_info
    print(f"{args.preset}: batch {args.batch} x seq {args.seq}, fwd+bwd fp32, {torch.get_num_threads()} threads, "
          f"median of {args.iters} (moe_impl={args.moe_impl}, reference attention={args.ref_attn})")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"loss  hpfunc {loss_h:.6f}  transformers {loss_r:.6f}")
    if compile_info:
        c = compile_info
        print(f"compiled ({c['backend']}): loss {c['loss']:.6f} (relative difference to eager "
              f"{c['rel_loss_diff']:.1e}), first step {c['first_step_s']:.1f} s, regions {c['regions']}, graphs "
              f"compiled after the first step: {c['graphs_after_first_step']}")
    print(f"{'impl':<22}{'ms':>9}{'ratio':>7}{'tokens/s':>10}{'min ms':>9}{'ratio':>7}{'cpu ms':>9}{'ratio':>7}")
    labels = {"hpfunc": "hpfunc", "compiled": "hpfunc compiled", "transformers": "transformers"}
    for name, label in ((k, labels[k]) for k in steps):
        r = lambda a, b: a[name] / b["transformers"]  # noqa: E731
        print(f"{label:<22}{med[name]:>9.1f}{r(med, med):>7.2f}{ntok / med[name] * 1e3:>10.0f}"
              f"{best[name]:>9.1f}{r(best, best):>7.2f}{cpu_med[name]:>9.1f}{r(cpu_med, cpu_med):>7.2f}")
    print("ms = median wall time; min ms = best wall time; cpu ms = median process CPU time "
          "(robust on a shared machine when --threads 1)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from hpfunc.train.output import to_json

    with open(args.out, "w") as f:
        f.write(to_json(result, where=str(args.out), indent=2))  # strict JSON (no NaN)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
