"""Rank-side helpers for the expert-parallel tests: a Qwen3-MoE step under ``plans.ep`` (alone, with fsdp,
with tp) against single-device training on the same global batch, with skewed routings."""

from __future__ import annotations


import torch
from _parity_checks import check_step_against_one_device

LR = 1e-3
ADAM_EPS = 1e-5

# how the expert bias (selection only) skews the routing; n = ep ranks, E = experts
SKEWS = ("none", "one_expert", "one_rank", "idle_expert")


def skew_bias(kind: str, E: int, n: int) -> torch.Tensor:
    """An expert bias that forces a routing: ``one_expert`` every token picks expert 0 first;
    ``one_rank`` every pick falls on rank 0's experts (the other ranks receive no token; needs
    top-k <= E / n); ``idle_expert`` expert E - 1 never gets a token; ``none`` the router decides."""
    b = torch.zeros(E)
    if kind == "one_expert":
        b[0] = 10.0
    elif kind == "one_rank":
        b[: E // n] = 10.0
    elif kind == "idle_expert":
        b[-1] = -10.0
    return b


def skewed_params(cfg, seed: int, skew: str, n: int) -> dict:
    """``qwen3.init(key(seed), cfg)`` with every MoE layer's expert bias set to :func:`skew_bias`."""
    import hpfunc
    from hpfunc.models import qwen3

    full = qwen3.init(hpfunc.random.key(seed), cfg)
    bias = skew_bias(skew, cfg.num_experts, n)
    for layer in full["layers"]:
        if "moe" in layer:
            layer["moe"]["expert_bias"] = bias.clone()
    return full


def plan_of(cfg, mesh_shape: dict, roles: list[str]):
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans

    plan = plans.Plan()
    for axis, role in zip(mesh_shape, roles):
        plan = plan + {"ep": lambda a: plans.ep(a, parallel_plan.ep_experts(cfg)),
                       "fsdp": lambda a: plans.fsdp(a), "ddp": lambda a: plans.ddp(a),
                       "tp": lambda a: plans.tp(a, parallel_plan.tp_styles(cfg))}[role](axis)
    return plan


def run_ep_parity(mesh_shape: dict, roles: list[str], *, top_k: int = 2, experts: int = 8, skew: str = "none",
                  seed: int = 0, steps: int = 2, batch: int = 4, seq: int = 8, count_comm: bool = False) -> dict:
    """``steps`` AdamW steps of qwen3-moe-tiny (``experts``, ``top_k``, aux coefficient 0.1) under the plan,
    and on one device: loss, aux loss, expert load, gradients, updates and the independent trajectory
    agree (fp32, rtol 1e-5). Returns the per-rank facts the tests assert on (bytes, received rows)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = qwen3.preset("qwen3-moe-tiny", num_experts=experts, num_experts_per_tok=top_k,
                       router_aux_loss_coef=0.1)
    mesh = hpfunc.Mesh(mesh_shape)
    plan = plan_of(cfg, mesh_shape, roles)
    n_ep = mesh.axis_size(plan.ep_axis) if plan.ep_axis else 1
    full = skewed_params(cfg, seed, skew, n_ep)

    def loss_fn(p, b):
        value, aux = parallel_plan.loss(p, b, cfg)
        return value, {"aux_loss": aux["aux_loss"], "expert_load": aux["expert_load"]}

    def ref_loss(p, b):  # the single-device step on the whole global batch
        value, aux = qwen3.loss(p, b, cfg)
        return value, {"aux_loss": aux["aux_loss"], "expert_load": aux["expert_load"]}

    opt = optim.adamw(LR, eps=ADAM_EPS)
    step = parallel_train_step(loss_fn, opt, mesh, plan, has_aux=True, return_grads=True)
    params = step.shard_params(full)
    state = step.init_opt_state(params)
    ref_params, ref_state = full, opt.init(full)
    g = torch.Generator().manual_seed(seed + 1)
    out = {"bytes": None}
    for i in range(steps):
        b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)}
        at, at_state = to_full(params), to_full(state)
        if count_comm and i == 0:
            with hpfunc.comm_stats() as stats:
                params, state, metrics, grads = step(params, state, b)
            out["records"] = [(r.op, r.name, r.axes, r.payload_bytes, r.phase, float(r.sent_bytes))
                              for r in stats.records]
        else:
            params, state, metrics, grads = step(params, state, b)
        what = f"{mesh_shape} {roles} top{top_k} E{experts} {skew} step {i}"
        ref_params, ref_state, aux = check_step_against_one_device(
            what, (params, state, metrics, grads), at, at_state, b, ref_loss, opt, (ref_params, ref_state), i, LR)
        assert_trees_close(metrics["aux_loss"], aux["aux_loss"], rtol=1e-5, atol=1e-7, what=f"{what} aux loss")
        if i == 0:
            out["load"] = aux["expert_load"].tolist()
    # the experts are split: this rank holds E / n of them
    out["local_experts"] = params["layers"][1]["moe"]["experts"]["w_gate"].to_local().shape[0]
    out["loss"] = float(to_full(metrics["loss"]))
    return out


def dropped_by_hand(logits: torch.Tensor, bias: torch.Tensor, k: int, E: int, *, dispatcher: str, factor: float,
                    n: int) -> int:
    """The pairs a dispatcher drops for one rank's router logits ``[T, E]``, counted pair by pair:
    ``alltoall`` with a capacity factor keeps the first ``ceil(f T k / E)`` pairs of each expert in
    (token, slot) order; ``padded`` keeps the first ``max(1, ceil(f T k / n))`` pairs per destination
    rank in expert order (the stable sort by expert id)."""
    import math

    T = logits.shape[0]
    idx = torch.topk(torch.softmax(logits.float(), -1) + bias, k, dim=-1).indices.tolist()
    pairs = [(idx[t][j], t * k + j) for t in range(T) for j in range(k)]
    if dispatcher == "alltoall":
        cap, seen, dropped = math.ceil(factor * T * k / E), [0] * E, 0
        for e, _ in pairs:  # (token, slot) order
            seen[e] += 1
            dropped += seen[e] > cap
        return dropped
    buf, seen, dropped = max(1, math.ceil(factor * T * k / n)), [0] * n, 0
    for e, _ in sorted(pairs):  # expert order, ties in (token, slot) order
        seen[e // (E // n)] += 1
        dropped += seen[e // (E // n)] > buf
    return dropped


def run_dropped(mesh_shape: dict, roles: list[str], dispatcher: str, factor: float, seed: int = 0) -> dict:
    """One step of qwen3-moe-tiny (8 experts, top-2, expert 0 favoured) under the plan with the config's
    dispatcher: the step's ``dropped_pairs`` metric (summed by ``parallelize`` over the data shards) and
    this rank's pairs dropped per layer counted by hand from the router logits it saw."""
    import torch.nn.functional as F

    import hpfunc
    from hpfunc import lax, optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import to_full
    from hpfunc.transforms.parallelize import parallel_train_step

    knobs = ({"moe_capacity_factor": factor} if dispatcher == "alltoall"
             else {"moe_dispatcher": "padded", "moe_buffer_factor": factor})
    cfg = qwen3.preset("qwen3-moe-tiny", num_experts=8, num_experts_per_tok=2, **knobs)
    mesh = hpfunc.Mesh(mesh_shape)
    plan = plan_of(cfg, mesh_shape, roles)
    n_ep = mesh.axis_size(plan.ep_axis) if plan.ep_axis else 1
    full = qwen3.init(hpfunc.random.key(seed), cfg)
    bias = torch.zeros(8)
    bias[0] = 0.02  # expert 0 wins the close calls: it overflows
    for layer in full["layers"]:
        layer["moe"]["expert_bias"] = bias.clone()
    seen = []

    def loss_fn(p, b):
        logits, aux = parallel_plan.apply(p, b["tokens"], cfg, return_aux=True)
        seen.append([x.detach() for x in aux["router_logits"]])  # what this rank's routers scored
        labels = qwen3.shift_labels(b["tokens"])
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return ce, {"dropped_pairs": aux["dropped_pairs"]}

    step = parallel_train_step(loss_fn, optim.adamw(LR), mesh, plan, has_aux=True)
    params = step.shard_params(full)
    tokens = torch.randint(0, cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(seed + 1))
    _, _, metrics = step(params, step.init_opt_state(params), {"tokens": tokens})
    hand = [dropped_by_hand(x, bias, 2, 8, dispatcher=dispatcher, factor=factor, n=n_ep) for x in seen[-1]]
    with mesh:  # the tp ranks of an ETP group route the same tokens: count them once
        first_of_group = plan.tp_axis is None or lax.axis_index(plan.tp_axis) == 0
    return {"metric": to_full(metrics["dropped_pairs"]).tolist(), "hand": hand, "counted": bool(first_of_group)}


def run_saved_bytes(mode: str, E: int = 8, H: int = 64, I: int = 32, k: int = 2, T: int = 64) -> dict:
    """What one MoE layer's forward keeps for the backward (storage liveness) on this rank, next to the
    minimum its backward needs: the experts' input rows, their gate and up outputs and the hidden product
    (``rows x (H + 3 I)``: the weight gradients and SwiGLU's derivative), the layer input (the router's
    gradient) and the router probabilities (the softmax's), 4 bytes each. ``mode``: ``ep`` (dropless
    all-to-all), ``padded`` (buffers of ``B`` rows per rank, all computed) or ``one`` (no axis)."""
    import math

    import hpfunc
    from hpfunc import layout
    from hpfunc.memory import saved_activations
    from hpfunc.models.dispatch import PaddedAllToAll
    from hpfunc.models.moe import moe_block

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    n = 1 if mode == "one" else world
    mesh = hpfunc.Mesh({"ep": world})
    g = torch.Generator().manual_seed(0)
    full = {"router": torch.randn(E, H, generator=g), "w_gate": torch.randn(E, I, H, generator=g),
            "w_up": torch.randn(E, I, H, generator=g), "w_down": torch.randn(E, H, I, generator=g)}
    p = {name: (v.chunk(n)[rank % n] if name != "router" else v).clone().requires_grad_(True) for name, v in full.items()}
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1 + rank)).requires_grad_(True)
    cot = torch.randn(T, H)  # made outside the forward: not an activation
    dispatcher = PaddedAllToAll(1.5) if mode == "padded" else None
    received = []

    def fwd(p, x):
        with mesh, layout.expert_parallel(None if mode == "one" else "ep"):
            y, r = moe_block(x, p["router"], p["w_gate"], p["w_up"], p["w_down"], top_k=k, norm_topk_prob=True,
                             dispatcher=dispatcher)
        received.append(r.indices)
        return (y * cot).sum()

    report = saved_activations(fwd, p, x, state_argnums=(0,))
    if mode == "padded":
        rows = n * max(1, math.ceil(1.5 * T * k / n))  # the whole buffer goes through the experts
    elif mode == "ep":
        counts = torch.bincount(received[-1].reshape(-1), minlength=E)
        torch.distributed.all_reduce(counts)
        rows = int(counts.view(n, -1)[rank].sum())
    else:
        rows = T * k
    minimum = 4 * (rows * (H + 3 * I) + T * (H + E))
    return {"saved": report.device_bytes, "minimum": minimum, "rows": rows, "pairs": T * k}


def run_overlap(chunks: int, top_k: int = 2, E: int = 8, T: int = 12, seed: int = 0) -> dict:
    """One MoE layer on this rank's ``T`` tokens with ``AllToAll(chunks=c)``: the recorded exchange (each
    chunk's dispatch issued before the previous chunk's experts start computing, each combine issued
    before the next chunk's experts start), the all-to-alls the counter saw, and the output and
    gradients against one device's ``grouped_experts`` over every rank's tokens."""
    import hpfunc
    from hpfunc import lax, layout
    from hpfunc.models.dispatch import AllToAll, trace_exchange
    from hpfunc.models.moe import grouped_experts, route_topk, moe_block
    from hpfunc.testing import assert_trees_close

    world = torch.distributed.get_world_size()
    mesh = hpfunc.Mesh({"ep": world})
    g = torch.Generator().manual_seed(seed)
    Hd, I = 16, 8
    x = torch.randn(world * T, Hd, generator=g)
    full = {"router": torch.randn(E, Hd, generator=g), "w_gate": torch.randn(E, I, Hd, generator=g) * 0.3,
            "w_up": torch.randn(E, I, Hd, generator=g) * 0.3, "w_down": torch.randn(E, Hd, I, generator=g) * 0.3}
    cot = torch.randn(world * T, Hd, generator=g)
    ref_in = {k_: v.clone().requires_grad_(True) for k_, v in full.items()}
    ref_x = x.clone().requires_grad_(True)
    r_ = route_topk(ref_x, ref_in["router"], top_k=top_k, norm_topk_prob=True)
    ref = grouped_experts(ref_x, r_.indices, r_.weights, ref_in["w_gate"], ref_in["w_up"], ref_in["w_down"])
    ref_grads = torch.autograd.grad((ref * cot).sum(), [ref_x, *ref_in.values()])
    with mesh:
        r = lax.axis_index("ep")
    local = E // world
    mine = {k_: (v[r * local:(r + 1) * local] if k_ != "router" else v).clone().requires_grad_(True)
            for k_, v in full.items()}
    my_x = x[r * T:(r + 1) * T].clone().requires_grad_(True)
    with mesh, layout.expert_parallel("ep"), trace_exchange() as events, hpfunc.comm_stats() as stats:
        y, _ = moe_block(my_x, mine["router"], mine["w_gate"], mine["w_up"], mine["w_down"], top_k=top_k,
                         norm_topk_prob=True, dispatcher=AllToAll(chunks=chunks))
        grads = torch.autograd.grad((y * cot[r * T:(r + 1) * T]).sum(), [my_x, *mine.values()])
    what = f"chunks {chunks} top{top_k}"
    assert_trees_close(y, ref[r * T:(r + 1) * T], rtol=1e-5, atol=1e-5, what=f"{what} output")
    assert_trees_close(grads[0], ref_grads[0][r * T:(r + 1) * T], rtol=1e-5, atol=1e-5, what=f"{what} grad x")
    for name, a, b in zip(["w_gate", "w_up", "w_down"], grads[2:], ref_grads[2:]):  # every rank's tokens
        assert_trees_close(a, b[r * local:(r + 1) * local], rtol=1e-5, atol=1e-5, what=f"{what} grad {name}")
    router = grads[1].clone()
    torch.distributed.all_reduce(router)  # the router's gradient: a part from every rank's tokens
    assert_trees_close(router, ref_grads[1], rtol=1e-5, atol=1e-5, what=f"{what} grad router")
    return {"events": [(name, i) for _, name, i in events], "times": [t for t, _, _ in events],
            "a2a": [(rec.name, rec.phase) for rec in stats.records if rec.op == "all_to_all"]}
