"""Rank-side helpers for the hot-expert replica tests: the dispatcher alone against ``grouped_experts`` on
one device, and a Qwen3-MoE step under ``plans.ep`` whose placement is re-decided from the step's
reported load, against single-device training."""

from __future__ import annotations

import torch
from _parity_checks import check_step_against_one_device, experts_problem

LR = 1e-3
ADAM_EPS = 1e-5


def skewed_indices(T: int, k: int, E: int, skew: float, g: torch.Generator) -> torch.Tensor:
    """``[T, k]`` distinct experts per token; with probability ``skew`` a token's first pick is expert 0
    (the rest random), so expert 0 and rank 0 are hot."""
    if T == 0:
        return torch.zeros(0, k, dtype=torch.long)
    rows = []
    for _ in range(T):
        perm = torch.randperm(E, generator=g)
        if float(torch.rand((), generator=g)) < skew:
            perm = torch.cat((torch.tensor([0]), perm[perm != 0]))
        rows.append(perm[:k])
    return torch.stack(rows)


def run_replicated_dispatch(world: int, tokens: list[int], k: int, E: int, skew: float, slots: int,
                            seed: int, break_grad_sum: bool = False) -> dict:
    """Every rank routes its own ``tokens[rank]`` tokens; the placement is decided from the global load.
    The output and the gradients of the tokens, the combine weights and this rank's expert weights
    (summed over the copies) equal one device's ``grouped_experts`` (fp64, 1e-10). Returns the rows each
    rank received with and without the copies, and the expected rows."""
    import hpfunc
    from hpfunc import lax
    from hpfunc.models import hot_experts as hot
    from hpfunc.models.moe import expert_ffn
    from hpfunc.testing import assert_trees_close

    mesh = hpfunc.Mesh({"ep": world})
    g = torch.Generator().manual_seed(seed)
    T = sum(tokens)
    prob = experts_problem(g, T, k, E, lambda: skewed_indices(T, k, E, skew, g))
    x, idx, w, wg, wu, wd, ref, cot, ref_grads = (prob[n] for n in ("x", "idx", "w", "wg", "wu", "wd", "ref", "cot",
                                                                   "ref_grads"))

    load = torch.bincount(idx.reshape(-1), minlength=E)  # the global load (the same on every rank)
    placement = hot.place_hot_experts(load, ranks=world, slots=slots)
    local = E // world
    with mesh:
        r = lax.axis_index("ep")
        lo, hi = sum(tokens[:r]), sum(tokens[: r + 1])
        mine = [t.clone().requires_grad_(True) for t in (x[lo:hi], w[lo:hi], wg[r * local:(r + 1) * local],
                                                          wu[r * local:(r + 1) * local], wd[r * local:(r + 1) * local])]
        d = hot.ReplicatedAllToAll(placement)
        sent = d.dispatch(mine[0], idx[lo:hi], num_experts=E, axis="ep")
        if break_grad_sum:  # the deliberate bug: the copies' gradients never reach their owner
            copies = [c.detach() for c in d.copy_weights(*mine[2:], axis="ep")]
            ys = torch.cat((expert_ffn(sent.tokens[: sent.own_rows], sent.counts[:local], *mine[2:], impl="bmm"),
                            expert_ffn(sent.tokens[sent.own_rows:], sent.counts[local:], *copies, impl="bmm")))
        else:
            ys = d.expert_outputs(sent, *mine[2:], impl="bmm")
        out = d.combine(ys, sent, mine[1])
        got = torch.autograd.grad((out * cot[lo:hi]).sum(), mine, allow_unused=True)
        plain = hot.ReplicatedAllToAll(hot.no_replicas(E, world)).dispatch(x[lo:hi], idx[lo:hi], num_experts=E,
                                                                           axis="ep")
    what = f"world {world} tokens {tokens} top{k} E{E} skew {skew} slots {slots} {placement.copies}"
    assert_trees_close(out, ref[lo:hi], rtol=1e-10, atol=1e-12, what=f"{what} output")
    names = ["x", "weights", "w_gate", "w_up", "w_down"]
    for name, a, b in zip(names[:2], got[:2], ref_grads[:2]):
        assert_trees_close(a, b[lo:hi], rtol=1e-10, atol=1e-12, what=f"{what} grad {name}")
    for name, a, b in zip(names[2:], got[2:], ref_grads[2:]):  # every rank's tokens, through every copy
        b = b[r * local:(r + 1) * local]
        assert_trees_close(torch.zeros_like(b) if a is None else a, b, rtol=1e-10, atol=1e-12,
                           what=f"{what} grad {name}")
    assert sent.counts.shape[0] == len(placement.experts_on(r))
    return {"rows": int(sent.counts.sum()), "plain_rows": int(plain.counts.sum()),
            "expected": hot.expected_rank_rows(load, placement)[r],
            "copies_here": len(placement.copies[r]), "placement": placement.copies,
            "replicated": [e for e in range(E) if len(placement.holders(e)) > 1 and r in placement.holders(e)]}


def run_replica_training(mesh_shape: dict, roles: list[str], *, skew: str = "one_expert", slots: int = 1,
                         every: int = 1, steps: int = 3, top_k: int = 2, experts: int = 8, seed: int = 0,
                         batch: int = 4, seq: int = 8) -> dict:
    """``steps`` AdamW steps of qwen3-moe-tiny under the plan with hot-expert replicas, the placement of
    each MoE layer re-decided every ``every`` steps from the previous step's reported global load
    (``metrics["expert_load"]``); at every step the loss, the gradients and the updated parameters equal
    single-device training at the same parameters (fp32, rtol 1e-5), and the trajectory stays with the
    independent single-device one."""
    import _ep_helpers as EP

    import hpfunc
    from hpfunc import optim
    from hpfunc.models import hot_experts as hot
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = qwen3.preset("qwen3-moe-tiny", num_experts=experts, num_experts_per_tok=top_k, router_aux_loss_coef=0.1)
    mesh = hpfunc.Mesh(mesh_shape)
    plan = EP.plan_of(cfg, mesh_shape, roles)
    n_ep = mesh.axis_size(plan.ep_axis)
    full = EP.skewed_params(cfg, seed, skew, n_ep)

    def ref_loss(p, b):
        value, aux = qwen3.loss(p, b, cfg)
        return value, {"aux_loss": aux["aux_loss"], "expert_load": aux["expert_load"]}

    def make_step(placements):
        dispatchers = [hot.ReplicatedAllToAll(p) for p in placements]

        def loss_fn(p, b):
            value, aux = parallel_plan.loss(p, b, cfg, moe_dispatchers=dispatchers)
            return value, {"aux_loss": aux["aux_loss"], "expert_load": aux["expert_load"]}

        return parallel_train_step(loss_fn, opt, mesh, plan, has_aux=True, return_grads=True)

    opt = optim.adamw(LR, eps=ADAM_EPS)
    placements = [hot.no_replicas(experts, n_ep)] * len(cfg.moe_layers)
    step = make_step(placements)
    params = step.shard_params(full)
    state = step.init_opt_state(params)
    ref_params, ref_state = full, opt.init(full)
    g = torch.Generator().manual_seed(seed + 1)
    history = []
    for i in range(steps):
        b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)}
        at, at_state = to_full(params), to_full(state)
        params, state, metrics, grads = step(params, state, b)
        history.append([p.copies for p in placements])
        what = f"{mesh_shape} {roles} {skew} slots {slots} step {i} {history[-1]}"
        ref_params, ref_state, _ = check_step_against_one_device(
            what, (params, state, metrics, grads), at, at_state, b, ref_loss, opt, (ref_params, ref_state), i, LR)
        load = to_full(metrics["expert_load"])
        if (i + 1) % every == 0:  # re-decide from the global load this step reported (same on every rank)
            new = [hot.place_hot_experts(row, ranks=n_ep, slots=slots) for row in load]
            if new != placements:
                placements = new
                step = make_step(placements)  # same mesh and plan: the state carries over unchanged
    return {"placements": history, "local_experts": params["layers"][1]["moe"]["experts"]["w_gate"].to_local().shape[0]}
