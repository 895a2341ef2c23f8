"""hpfunc's distributed training step vs the same training written directly with torch.distributed.

On the dense tiny Qwen3 (untied embeddings), with gloo ranks on CPU, it times full training steps
(forward, backward, AdamW) side by side, interleaved step by step in one process per rank:

======  ===========  ====================================================================================
ranks   plan         PyTorch twin
======  ===========  ====================================================================================
1       (one rank)   the plain single-device ``make_train_step`` step, and a plain torch loop
                     (``nn.Module`` + ``torch.optim.AdamW``)
2, 4    ddp          ``DistributedDataParallel``
2, 4    fsdp         FSDP2 ``fully_shard`` per layer + root (reshard after forward)
2       tp           ``parallelize_module``: ``ColwiseParallel`` on wq/wk/wv/w_gate/w_up, ``RowwiseParallel``
                     on wo/w_down (``PrepareModuleInput`` makes the block input one replicated DTensor,
                     as torchtitan does, so each block all-reduces its input gradient once)
4       fsdp x tp    the same TP on the ``tp`` axis of a 2-D DeviceMesh, then FSDP2 on its ``fsdp`` axis
======  ===========  ====================================================================================

Each hpfunc plan runs two ways: ``parallel_train_step(loss, optim.adamw(lr), mesh, plan)`` and the
front door ``hpfunc.parallelize(make_train_step(cfg, optim.adamw(lr), loss_fn=qwen3.parallel_plan.loss), mesh,
plan)``. A step's time is the slowest rank's; the table shows the median over ``--iters`` steps and
the ratio hpfunc / PyTorch (1-rank rows: hpfunc / the plain single-device step, and that step / the
torch loop). Goals (issue 4): ratio <= 1.0 on 2 and 4 ranks, <= 1.05 on one rank.

Bytes: what each rank sends per step by the ring formulas, for hpfunc as counted by
``hpfunc.comm_stats`` and for PyTorch from the c10d ops it dispatches, next to the formula of
docs/reference.md#communication-volumes: DDP ``2 Psi (n-1)/n``; FSDP with reshard after forward
``3 Psi (n-1)/n`` less the embedding
table (the backward does not regather a lookup table) and less what the forward reads last (the last
layer, final norm and head, which hpfunc keeps gathered for the backward from the second step on;
FSDP2 keeps its root unit -- embedding, final norm, head -- gathered through the backward, so it sends
``(3 Psi - Psi_root)(n-1)/n``);
Megatron TP ``2 + 2`` all-reduces of ``b s h`` per layer, plus one all-reduce of the gradients of the
parameters replicated over ``tp`` (hpfunc's per-rank semantics split their gradient over the ranks;
the torch twin computes it whole on every rank instead); Psi in bytes of the block each rank
gathers. The rest are the step's scalars (loss, norms, metrics). The number of collectives per step
is shown too (on gloo each costs a round trip). ``params+adam`` is the model state each rank holds.

The PyTorch twins are ``nn.Module`` s over the *same* building blocks (``hpfunc.models`` rms_norm,
rope, sdpa) with ``nn.Linear`` projections, so the arithmetic is the same and the difference is the
framework overhead plus the communication schedule. The attention reads its head counts from the
projections' local widths, so it runs unchanged on TP shards.

The machine is shared and noisy: compare the ratios of one run, not absolute times across runs.

Usage:  python bench/parallel_step.py [--ranks 1,2,4] [--iters 10] [--batch 8] [--seq 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

_HP = ("parallel_train_step", "parallelize")
_KINDS = {1: ("single",), 2: ("ddp", "fsdp", "tp"), 4: ("ddp", "fsdp", "fsdp_tp")}


# ---------------------------------------------------------------------------------------------
# The PyTorch twin


def _torch_model(cfg, params):
    """Qwen3 as an nn.Module holding copies of ``params``: one submodule per layer (FSDP2's unit), and
    ``nn.Linear`` projections (what ``parallelize_module``'s styles act on)."""
    import torch.nn.functional as F
    from torch import nn

    from hpfunc.models import qwen3
    from hpfunc.models.layers import rms_norm
    from hpfunc.models.rope import apply_rope, rope_inv_freq, rope_tables

    eps = cfg.rms_norm_eps

    def linear(w):
        m = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        m.weight = nn.Parameter(w.detach().clone())
        return m

    class Attention(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (linear(p[k]) for k in ("wq", "wk", "wv", "wo"))
            self.q_norm = nn.Parameter(p["q_norm"].clone())
            self.k_norm = nn.Parameter(p["k_norm"].clone())

        def forward(self, x, cos, sin):
            B, S, _ = x.shape
            D = self.q_norm.shape[0]
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
            hq, hkv = q.shape[-1] // D, k.shape[-1] // D  # local heads: ColwiseParallel returns the shard
            q = rms_norm(q.view(B, S, hq, D), self.q_norm, eps).transpose(1, 2)
            k = rms_norm(k.view(B, S, hkv, D), self.k_norm, eps).transpose(1, 2)
            v = v.view(B, S, hkv, D).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
            return self.wo(out.transpose(1, 2).reshape(B, S, hq * D))

    class Mlp(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.w_gate, self.w_up, self.w_down = (linear(p[k]) for k in ("w_gate", "w_up", "w_down"))

        def forward(self, x):
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    class Layer(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.attn_norm = nn.Parameter(p["attn_norm"].clone())
            self.mlp_norm = nn.Parameter(p["mlp_norm"].clone())
            self.attn = Attention(p["attn"])
            self.mlp = Mlp(p["mlp"])

        def forward(self, h, cos, sin):
            h = h + self.attn(rms_norm(h, self.attn_norm, eps), cos, sin)
            return h + self.mlp(rms_norm(h, self.mlp_norm, eps))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Parameter(params["embed"].clone())
            self.layers = nn.ModuleList([Layer(lp) for lp in params["layers"]])
            self.final_norm = nn.Parameter(params["final_norm"].clone())
            self.lm_head = nn.Parameter(params["lm_head"].clone())

        def forward(self, tokens):
            h = F.embedding(tokens, self.embed)
            inv, sc = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    max_position_embeddings=cfg.max_position_embeddings)
            cos, sin = rope_tables(torch.arange(tokens.shape[1]), inv, sc, dtype=h.dtype)
            for layer in self.layers:
                h = layer(h, cos, sin)
            logits = F.linear(rms_norm(h, self.final_norm, eps), self.lm_head)
            labels = qwen3.shift_labels(tokens)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=qwen3.IGNORE_INDEX)

    return Model()


def _tensor_parallel(layer, tp_mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    one_input = PrepareModuleInput(input_layouts=(Replicate(), None, None), desired_input_layouts=(Replicate(), None, None))
    parallelize_module(layer, tp_mesh, {
        "attn": one_input,
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(), "mlp.w_down": RowwiseParallel(),
    })


def _torch_step(kind, mesh, cfg, full, tokens, lr):
    """``(step, local tokens)``: one training step of the twin for ``kind`` on ``mesh``."""
    import torch.distributed as dist

    model = _torch_model(cfg, full)
    dm = mesh.device_mesh if kind != "single" else None
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif kind in ("fsdp", "fsdp_tp"):
        from torch.distributed.fsdp import fully_shard

        data = dm["fsdp"] if kind == "fsdp_tp" else dm
        for layer in model.layers:
            if kind == "fsdp_tp":
                _tensor_parallel(layer, dm["tp"])
            fully_shard(layer, mesh=data)
        model = fully_shard(model, mesh=data)
    elif kind == "tp":
        for layer in model.layers:
            _tensor_parallel(layer, dm)
    if kind in ("ddp", "fsdp"):
        local = tokens.chunk(dist.get_world_size())[dist.get_rank()]
    elif kind == "fsdp_tp":
        local = tokens.chunk(mesh.axis_size("fsdp"))[mesh.axis_index("fsdp")]
    else:
        local = tokens
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)

    def step():
        opt.zero_grad(set_to_none=True)
        model(local).backward()
        opt.step()

    return step


def _torch_comm(step):
    """``(bytes each rank sends, number of collectives)`` in one call of ``step``, by the ring formulas
    of hpfunc.comm (broadcast: (n-1)/n M), counted from the c10d ops PyTorch dispatches (the ops DDP's
    reducer, FSDP2 and DTensor all go through)."""
    from fractions import Fraction

    from torch.utils._python_dispatch import TorchDispatchMode

    from hpfunc.comm import ring_sent_bytes

    kinds = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
             "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
             "all_gather_into_tensor": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
             "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "broadcast_": "broadcast"}
    tally = {"sent": Fraction(0), "calls": 0, "unknown": []}

    def group_size(args):
        from torch._C._distributed_c10d import ProcessGroup
        from torch.distributed.distributed_c10d import _resolve_process_group

        for a in args:
            if isinstance(a, torch.ScriptObject):
                return ProcessGroup.unbox(a).size()
        return _resolve_process_group(args[-1]).size()  # functional collectives: (..., group_name)

    def tensors(a):
        if isinstance(a, torch.Tensor):
            return [a]
        if isinstance(a, (list, tuple)):
            return [t for x in a for t in tensors(x)]
        return []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns, _, name = func._schema.name.partition("::")
            if ns in ("c10d", "_c10d_functional") and name not in ("wait_tensor", "_wrap_tensor_autograd", "barrier",
                                                                  "monitored_barrier"):
                kind = kinds.get(name)
                if kind is None:
                    tally["unknown"].append(func._schema.name)
                else:
                    n = group_size(args)
                    # payload M = the full array: the output of a gather, the input of the others
                    blocks = tensors(args[0]) if kind != "reduce_scatter" else tensors(args[1] if ns == "c10d" else args[0])
                    if ns == "_c10d_functional" and kind == "all_gather":
                        blocks = [t.repeat(n) for t in tensors(args[0])]  # input block; M = n blocks
                    m = sum(t.numel() * t.element_size() for t in blocks)
                    tally["sent"] += Fraction((n - 1) * m, n) if kind == "broadcast" else ring_sent_bytes(kind, m, n)
                    tally["calls"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return float(tally["sent"]), tally["calls"], tally["unknown"]


# ---------------------------------------------------------------------------------------------
# hpfunc


def _mesh_plan(kind, n, cfg):
    import hpfunc
    from hpfunc.transforms import plans

    def tp(axis):  # Megatron TP with the model's own table
        from hpfunc.models.qwen3 import parallel_plan

        return plans.tp(axis, parallel_plan.tp_styles(cfg))

    if kind == "ddp":
        return hpfunc.Mesh({"dp": n}), plans.ddp("dp")
    if kind in ("fsdp", "single"):
        return hpfunc.Mesh({"fsdp": n}), plans.fsdp("fsdp")
    if kind == "tp":
        return hpfunc.Mesh({"tp": n}), tp("tp")
    if kind == "fsdp_tp":
        return hpfunc.Mesh({"fsdp": n // 2, "tp": 2}), plans.fsdp("fsdp") + tp("tp")
    raise ValueError(kind)


def _parallel_loss():
    from hpfunc.models.qwen3.parallel_plan import loss

    return loss


def _hpfunc_steps(mesh, plan, cfg, full, tokens, lr):
    """``({name: step}, {name: () -> bytes sent in one step}, state bytes per rank)``."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms.parallelize import parallel_train_step

    batch = {"tokens": tokens}
    loss = _parallel_loss()
    pts = parallel_train_step(lambda p, b: loss(p, b, cfg)[0], optim.adamw(lr), mesh, plan)
    s1 = {"p": pts.shard_params(full)}
    s1["o"] = pts.init_opt_state(s1["p"])

    def hp_pts():
        s1["p"], s1["o"], _ = pts(s1["p"], s1["o"], batch)

    tx = optim.adamw(lr)
    front = hpfunc.parallelize(make_train_step(cfg, tx, loss_fn=loss), mesh, plan)
    s2 = {"s": front.init_state(lambda p: init_train_state(p, tx), front.shard_params(full))}

    def hp_front():
        s2["s"], _ = front(s2["s"], batch)

    def sent(fn):
        def count():
            with hpfunc.comm_stats() as stats:
                fn()
            return float(stats.total_sent_bytes()), stats.count()
        return count

    state_bytes = sum(x.to_local().numel() * x.element_size() for x in hpfunc.tree.leaves((s1["p"], s1["o"]))
                      if isinstance(x, torch.Tensor) and x.ndim > 0)
    return ({"parallel_train_step": hp_pts, "parallelize": hp_front},
            {"parallel_train_step": sent(hp_pts), "parallelize": sent(hp_front)}, state_bytes)


def _formula(kind, mesh, plan, cfg, full, batch, seq):
    """Bytes each rank sends per step by the formulas of docs/reference.md#communication-volumes,
    and the parts they are made of."""
    import math

    from hpfunc.comm import ring_sent_bytes

    res = plan.resolve(full, mesh)
    parts = {}
    if kind == "ddp":
        psi = sum(math.prod(r.shape) for r in res.values())
        parts["grad all-reduce 2 Psi (n-1)/n"] = ring_sent_bytes("all_reduce", 4 * psi, mesh.size)
    if kind in ("fsdp", "fsdp_tp"):
        d = mesh.axis_size("fsdp")
        # what each rank gathers: the compute block of every FSDP-stored parameter (its TP shard)
        block = {p: math.prod(r.shape) // mesh.axis_size(r.spec.compute.axes) for p, r in res.items() if r.gather}
        psi = sum(block.values())
        # the backward gathers again all but the embedding (a lookup saves no weight) and what the forward reads
        # last (the last layer, final norm and head: kept gathered for the backward, which needs them first)
        last = f"layers.{cfg.num_hidden_layers - 1}."
        kept = sum(b for p, b in block.items() if p.startswith(last) or "." not in p and p != "embed")
        parts["fsdp (3 Psi - Psi_embed - Psi_kept)(n-1)/n"] = ring_sent_bytes(
            "all_gather", 4 * (3 * psi - block["embed"] - kept), d)
    if kind in ("tp", "fsdp_tp"):
        t = mesh.axis_size("tp")
        b = batch // mesh.axis_size(plan.data_axes) if plan.data_axes else batch
        act = 4 * b * seq * cfg.hidden_size
        parts["tp 4 L all-reduce(b s h)"] = 4 * cfg.num_hidden_layers * ring_sent_bytes("all_reduce", act, t)
        # the gradients of parameters replicated over tp (their storage block) are all-reduced over tp
        rep = sum(math.prod(r.shape) // mesh.axis_size(r.spec.storage.axes) for r in res.values()
                  if "tp" in r.replicated)
        parts["tp-replicated grads all-reduce"] = ring_sent_bytes("all_reduce", 4 * rep, t)
    return float(sum(parts.values())), {k: float(v) for k, v in parts.items()}


# ---------------------------------------------------------------------------------------------
# Timing


def _interleaved(steps, iters, warmup=2):
    """Per-step times of every step function, run round-robin (alternating order) after a warm-up.
    Every rank runs the same sequence; a barrier before each step keeps the ranks' clocks aligned."""
    import torch.distributed as dist

    for f in steps.values():
        for _ in range(warmup):
            f()
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}  # CPU seconds of this rank's process (its gloo threads included)
    names = list(steps)
    for i in range(iters):
        for k in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            steps[k]()
            times[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return times, cpu


def _bench_on_rank(batch, seq, iters, kinds=None):
    import torch.distributed as dist

    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.train.step import init_train_state, make_train_step

    torch.set_num_threads(1)
    n = dist.get_world_size()
    cfg = qwen3.preset("qwen3-dense-tiny", tie_word_embeddings=False)
    full = qwen3.init(hpfunc.random.key(0), cfg)
    psi = sum(p.numel() for p in hpfunc.tree.leaves(full))
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    lr = 1e-3
    out = {"ranks": n, "psi": psi, "batch": batch, "seq": seq, "kinds": {}}
    for kind in kinds or _KINDS[n]:
        mesh, plan = _mesh_plan(kind, n, cfg)
        steps, counters, state_bytes = _hpfunc_steps(mesh, plan, cfg, full, tokens, lr)
        if kind == "single":
            tx = optim.adamw(lr)
            plain = make_train_step(cfg, tx, loss_fn=_parallel_loss())
            st = {"s": init_train_state(hpfunc.tree.tree_map(lambda x: x.clone(), full), tx)}

            def plain_step():
                st["s"], _ = plain(st["s"], {"tokens": tokens})

            steps["plain step"] = plain_step
        steps["torch"] = _torch_step(kind, mesh, cfg, full, tokens, lr)
        times, cpu = _interleaved(steps, iters)
        formula, parts = _formula(kind, mesh, plan, cfg, full, batch, seq) if n > 1 else (0.0, {})
        sent = {k: c() for k, c in counters.items()}
        if n > 1:
            sent["torch"] = _torch_comm(steps["torch"])[:2]
        out["kinds"][kind] = {"times": times, "cpu": cpu, "sent": {k: v[0] for k, v in sent.items()},
                              "calls": {k: v[1] for k, v in sent.items()}, "formula": formula,
                              "formula_parts": parts, "state_bytes": state_bytes}
    return out


def _summarise(per_rank):
    """Step time = the slowest rank's, per step; medians and ratios."""
    r0 = per_rank[0]
    rows = []
    for kind, k in r0["kinds"].items():
        med = {}
        for name in k["times"]:
            slowest = [max(r["kinds"][kind]["times"][name][i] for r in per_rank)
                       for i in range(len(k["times"][name]))]
            med[name] = 1e3 * statistics.median(slowest)
        # CPU time per step summed over the ranks (the work done, whatever the machine's load): median
        cpu = {name: 1e3 * statistics.median([sum(r["kinds"][kind]["cpu"][name][i] for r in per_rank)
                                              for i in range(len(k["cpu"][name]))]) for name in k["cpu"]}
        base = "plain step" if kind == "single" else "torch"
        row = {"ranks": r0["ranks"], "plan": kind, "ms": med, "cpu_ms": cpu, "baseline": base,
               "ratio": {h: med[h] / med[base] for h in _HP},
               "cpu_ratio": {h: cpu[h] / cpu[base] for h in _HP},
               "sent_bytes": k["sent"], "collectives": k["calls"], "formula_bytes": k["formula"],
               "formula_parts": k["formula_parts"],
               "params_plus_adam_bytes_per_rank": k["state_bytes"], "psi": r0["psi"]}
        if kind == "single":
            row["ratio"]["plain step / torch"] = med["plain step"] / med["torch"]
            row["ratio"]["parallelize / torch"] = med["parallelize"] / med["torch"]
        rows.append(row)
    return rows


def _print_table(rows):
    print(f"{'ranks':>5} {'plan':<8} {'pts ms':>7} {'front ms':>8} {'base ms':>7} {'base':<10} {'pts/base':>8} "
          f"{'front/base':>10} | {'sent B/rank: pts':>16} {'front':>8} {'formula':>8} {'torch':>8} | "
          f"{'collectives pts/front/torch':>27} | params+adam B/rank")
    for r in rows:
        ms, ra, sb, c = r["ms"], r["ratio"], r["sent_bytes"], r["collectives"]
        torch_b = f"{sb['torch']:8.0f}" if "torch" in sb else f"{'-':>8}"
        calls = f"{c['parallel_train_step']}/{c['parallelize']}/{c.get('torch', '-')}"
        print(f"{r['ranks']:>5} {r['plan']:<8} {ms['parallel_train_step']:7.1f} {ms['parallelize']:8.1f} "
              f"{ms[r['baseline']]:7.1f} {r['baseline']:<10} {ra['parallel_train_step']:8.2f} {ra['parallelize']:10.2f} | "
              f"{sb['parallel_train_step']:16.0f} {sb['parallelize']:8.0f} {r['formula_bytes']:8.0f} {torch_b} | "
              f"{calls:>27} | {r['params_plus_adam_bytes_per_rank']}")
        cr = r["cpu_ratio"]
        print(f"{'':>5} {'':<8} CPU ms/step (all ranks): pts {r['cpu_ms']['parallel_train_step']:.1f}, front "
              f"{r['cpu_ms']['parallelize']:.1f}, base {r['cpu_ms'][r['baseline']]:.1f}; CPU pts/base "
              f"{cr['parallel_train_step']:.2f}, front/base {cr['parallelize']:.2f}")
        if r["plan"] == "single":
            print(f"{'':>5} {'':<8} torch loop {ms['torch']:.1f} ms; plain step / torch loop {ra['plain step / torch']:.2f}, "
                  f"parallelize / torch loop {ra['parallelize / torch']:.2f}")
    print("pts = parallel_train_step, front = hpfunc.parallelize(make_train_step(...)); base = the torch twin (on 1 rank "
          "the plain single-device make_train_step); ms = median step time of the slowest rank; sent = bytes each rank "
          "sends per step by the ring formulas (hpfunc.comm_stats; torch: its c10d ops)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--kinds", default=None, help="comma-separated subset of ddp,fsdp,tp,fsdp_tp,single")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from hpfunc.testing import RankPool

    rows = []
    load = [os.getloadavg()[0]]
    for n in [int(x) for x in args.ranks.split(",")]:
        kinds = [k for k in args.kinds.split(",") if k in _KINDS[n]] if args.kinds else None
        if kinds == []:
            continue
        with RankPool(n, timeout=900) as pool:
            per_rank = pool.run(_bench_on_rank, args.batch, args.seq, args.iters, kinds)
        rows += _summarise(per_rank)
        load.append(os.getloadavg()[0])
    _print_table(rows)
    print(f"load average (1 min) during the run: {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        from hpfunc.train.output import to_json  # strict JSON: a non-finite number is written as null

        Path(args.out).write_text(to_json({"rows": rows, "load_average": load, "cores": os.cpu_count()},
                                          where=args.out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
