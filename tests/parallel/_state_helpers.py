"""Rank-side helpers for the ``hpfunc.parallelize(step, mesh, plan)`` tests: the trainer's own
single-device step, distributed, against the same step on one device."""

from __future__ import annotations

import functools

import torch

import _parallel_helpers as H

LR = 1e-3


def optimizer(name: str, clip: float | None):
    from hpfunc import optim
    from hpfunc.models.qwen3 import parallel_plan

    tx = {"adamw": lambda: optim.adamw(LR, eps=H.ADAM_EPS, weight_decay=0.1),
          "muon_adamw": lambda: optim.muon_adamw(0.02, adam_learning_rate=LR, adam_eps=H.ADAM_EPS, weight_decay=0.1,
                                                 adamw_when=parallel_plan.adamw_when)}[name]()
    return tx if clip is None else optim.chain(optim.clip_by_global_norm(clip), tx)


def _sharded_loss(n_data: int):
    """The single-device twin of the sharded loss: the mean over data shards of the per-shard
    cross-entropy (equal targets per shard), and MoE's load-balancing term from the load of the whole
    batch (the step sums it over the data shards); aux floats averaged, integers (token and expert
    counts) summed: for the whole batch, the single-device ``qwen3.loss``."""
    from hpfunc.models import qwen3

    def loss_fn(params, batch, cfg):
        return qwen3.loss(params, batch, cfg)

    return loss_fn


def run_state_parity(name, model: str, seed: int, opt: str = "adamw", clip: float | None = None,
                     steps: int = 3, bias_rate: float = 0.0, micro: int = 1) -> dict:
    """``parallelize(make_train_step(...))`` vs ``make_train_step(...)`` on one device, ``steps`` steps:
    metrics (loss, ce, aux, grad norm, expert load) and the parameters after every step."""
    import hpfunc
    from hpfunc.models import qwen3
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms.parallelize import init_sharded

    cfg = H.config(model)
    mesh, plan = H.make(name, cfg)
    n_data = mesh.axis_size(tuple(a for a in mesh.axis_names if a in plan.data_axes)) if plan.data_axes else 1
    tx = optimizer(opt, clip)
    # with micro-batches (dense models: every micro-batch mean is over equally many targets, so the mean
    # of micro-batch means is the batch mean) the reference is still the plain one-device step
    step = make_train_step(cfg, tx, loss_fn=qwen3.parallel_plan.loss, expert_bias_rate=bias_rate,
                           num_microbatches=micro)
    ref_step = make_train_step(cfg, tx, loss_fn=_sharded_loss(n_data), expert_bias_rate=bias_rate)
    train_step = hpfunc.parallelize(step, mesh, plan)
    key = hpfunc.random.key(seed)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, key, shapes=qwen3.param_shapes(cfg))
    state = train_step.init_state(lambda p: init_train_state(p, tx), params)
    ref = init_train_state(qwen3.init(key, cfg), tx)
    assert_trees_close(to_full(state), ref, rtol=0, atol=0, what="init_state")
    for i, b in enumerate(H.batches(cfg, steps, 4, 8, seed)):
        state, metrics = train_step(state, b)
        ref, ref_metrics = ref_step(ref, b)
        m = to_full(metrics)
        for k in ("loss", "ce_loss", "aux_loss", "grad_norm"):
            assert_trees_close(m[k], ref_metrics[k], rtol=1e-5, atol=1e-6, what=f"step {i} {k}")
        if "expert_load" in ref_metrics:
            assert torch.equal(m["expert_load"], ref_metrics["expert_load"]), f"step {i} expert_load"
        # independent trajectories (see _parallel_helpers.run_parity for the Adam eps bound)
        assert_trees_close(to_full(state.params), ref.params, rtol=1e-5, atol=0.05 * LR * (i + 1),
                           what=f"step {i} params")
        assert_trees_close(to_full(state.opt_state), ref.opt_state, rtol=1e-4, atol=1e-6, what=f"step {i} opt_state")
        assert int(state.step.full_tensor()) == i + 1
    assert all(hpfunc.typeof(a) == hpfunc.typeof(b) for a, b in zip(hpfunc.tree.leaves(state.params),
                                                                     hpfunc.tree.leaves(params)))
    return {"loss": float(m["loss"])}


def run_comm_equal(name: str, micro: int = 1) -> int:
    """The front door moves exactly the bytes of ``parallel_train_step`` (whose volumes
    test_parallel_comm proves against the formulas): same collectives, axes, phases and bytes. With
    ``micro`` micro-batches and a plan without gathers the same holds: reductions run once per step."""
    from collections import Counter

    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    cfg = H.config("qwen3-dense-tiny", tie_word_embeddings=False)
    mesh, plan = H.make(name, cfg)
    tx = optim.adamw(LR)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                          shapes=qwen3.param_shapes(cfg))
    b = H.batches(cfg, 1, 4, 6, 0)[0]

    # the step's scalars are left out: parallel_train_step's loss pmean and the front door's loss with its
    # float metrics in one pmean (a few fp32 values), the grad-norm psum, the collective tagged "scalars"
    # carrying them together, and those riding a gradient bucket (CommRecord.rider_bytes)
    from hpfunc.comm import ring_sent_bytes

    scalars = 32

    def ours(r):
        return r.payload_bytes > scalars and r.tag != "scalars"

    def sent(r):
        return ring_sent_bytes(r.op, r.payload_bytes - r.rider_bytes, r.n) if r.rider_bytes else r.sent_bytes

    def records(stats):
        return Counter((r.op, r.axes, r.phase, sent(r)) for r in stats.records if ours(r))

    def totals(stats):  # micro-batches split TP's activation collectives in smaller ones: compare sums
        out = Counter()
        for r in stats.records:
            if ours(r):
                # a whole-batch step starts its gradient all-reduces in the backward, per layer; micro-batches
                # reduce their sum once after the last one: the bytes are the same, the phase is not
                out[(r.op, r.axes) if r.op == "all_reduce" else (r.op, r.axes, r.phase)] += sent(r)
        return out

    data = set(plan.data_axes)

    def data_records(stats):  # gradient reductions over the data axes: once per step either way (their bytes)
        out = Counter()
        for r in stats.records:
            if ours(r) and data & set(r.axes):
                out[(r.op, r.axes)] += sent(r)
        return out

    old = parallel_train_step(lambda p, bb: qwen3.parallel_plan.loss(p, bb, cfg)[0], tx, mesh, plan)
    opt_state = old.init_opt_state(params)
    with hpfunc.comm_stats() as s_old:
        old(params, opt_state, b)
    new = hpfunc.parallelize(make_train_step(cfg, tx, loss_fn=qwen3.parallel_plan.loss, num_microbatches=micro),
                             mesh, plan)
    state = new.init_state(lambda p: init_train_state(p, tx), params)
    with hpfunc.comm_stats() as s_new:
        new(state, b)
    if micro == 1:
        assert records(s_new) == records(s_old), (records(s_new) - records(s_old), records(s_old) - records(s_new))
    else:
        assert totals(s_new) == totals(s_old), (totals(s_new), totals(s_old))
        assert data_records(s_new) == data_records(s_old), (data_records(s_new), data_records(s_old))
    return sum(records(s_new).values())


def run_errors() -> list[str]:
    """Misuse inside a parallelized step fails on every rank with a message naming the culprit."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.transforms import plans
    from hpfunc.transforms.plans import PlanError

    mesh = hpfunc.Mesh({"fsdp": 2})
    plan = plans.fsdp("fsdp")
    tx = optim.adamw(LR)
    init = lambda p: {"params": p, "opt": tx.init(p)}  # noqa: E731
    params = {"w": torch.ones(4, 3)}
    batch = torch.ones(4, 4)
    msgs = []

    def expect(step, match: str, **kw) -> None:
        ts = hpfunc.parallelize(step, mesh, plan, **kw)
        try:
            state = ts.init_state(init, ts.shard_params(params)) if not kw else {"weights": ts.shard_params(params)}
            ts(state, batch)
        except PlanError as e:
            assert match in str(e), str(e)
            msgs.append(str(e))
        else:
            raise AssertionError(f"no PlanError for {match!r}")

    def grad_of_batch(state, b):
        hpfunc.value_and_grad(lambda x: x.sum())(b)
        return state, {}

    def wrong_shape(state, b):
        return {"params": {"w": torch.zeros(4, 3)}, "opt": state["opt"]}, {}

    def norm_of_other(state, b):
        return state, {"n": optim.global_norm({"activations": b})}

    expect(grad_of_batch, "is not one of the state's parameters")
    expect(wrong_shape, "'w'")
    expect(norm_of_other, "'activations' is not a parameter path")
    expect(lambda s, b: (s, {}), "the state has no 'params'", params="params")
    return msgs


def run_donated(name, model: str = "qwen3-dense-tiny", steps: int = 3) -> dict:
    """``parallelize(step, ..., donate_state=True)`` against ``donate_state=False`` on the same batches:
    metrics, parameters and optimizer state equal bit for bit after every step; the donated run's
    moments (and, without ZeRO, its parameter blocks) live in the memory the step was handed.
    Returns, per step, whether the moments and the parameters were written in place."""
    import hpfunc
    from hpfunc.models import qwen3
    from hpfunc.testing import to_full
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms.parallelize import init_sharded

    cfg = H.config(model)
    mesh, plan = H.make(name, cfg)
    tx = optimizer("adamw", 0.5)
    step = make_train_step(cfg, tx, loss_fn=qwen3.parallel_plan.loss)
    runs = {d: hpfunc.parallelize(step, mesh, plan, donate_state=d) for d in (False, True)}
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                          shapes=qwen3.param_shapes(cfg))
    states = {d: runs[d].init_state(lambda p: init_train_state(p, tx), params) for d in runs}

    def ptrs(tree):
        return [x.to_local().data_ptr() for x in hpfunc.tree.leaves(tree) if x.numel()]

    reused = []
    for i, b in enumerate(H.batches(cfg, steps, 4, 8, 0)):
        before = {"mu": ptrs(states[True].opt_state[1][0].mu), "params": ptrs(states[True].params)}
        out = {d: runs[d](states[d], b) for d in runs}
        states = {d: out[d][0] for d in runs}
        after = {"mu": ptrs(states[True].opt_state[1][0].mu), "params": ptrs(states[True].params)}
        reused.append({k: before[k] == after[k] for k in before})
        for k in ("loss", "grad_norm"):
            assert torch.equal(to_full(out[True][1][k]), to_full(out[False][1][k])), f"{name} step {i} {k}"
        for a, c in zip(hpfunc.tree.leaves(to_full(states[True])), hpfunc.tree.leaves(to_full(states[False]))):
            assert torch.equal(a, c), f"{name} step {i}: donated state differs"
    return {"reused": reused}


def run_marked_state() -> dict:
    """A state laid out as the lowered step planned (its own output, or DTensors made elsewhere with the
    planned layout: compared leaf by leaf) comes back into it on the short path (no layout check); a
    leaf laid out otherwise sends the state the checked way (redistributed, with the same result), and
    a parameter laid out otherwise than planned is still a PlanError. Returns how many states took the
    checked way, and the losses."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.transforms import lowered as par
    from hpfunc.transforms import plans
    from hpfunc.transforms.plans import PlanError

    mesh = hpfunc.Mesh({"fsdp": 2})
    tx = optim.adamw(LR)

    def step(state, b):
        loss, g = hpfunc.value_and_grad(lambda p: ((b @ p["w"]) ** 2).mean())(state["params"])
        new, opt = optim.update_and_apply(tx, g, state["opt"], state["params"])
        return {"params": new, "opt": opt}, {"loss": loss}

    checked = []
    original = par.check_params
    par.check_params = lambda *a, **k: (checked.append(1), original(*a, **k))[1]
    try:
        ts = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp"))
        full = {"w": torch.arange(12.0).reshape(4, 3) / 10}
        state = ts.init_state(lambda p: {"params": p, "opt": tx.init(p)}, ts.shard_params(full))
        checked.clear()  # (init_state checks the parameters it is given)
        batch = torch.ones(4, 4)
        losses = []
        for _ in range(2):
            state, m = ts(state, batch)
            losses.append(float(m["loss"].full_tensor()))
        marked = len(checked)
        # the same values and layout, made outside the step: compared with the plan, not checked again
        fresh = dict(state, params={"w": hpfunc.shard(state["params"]["w"].full_tensor(), mesh, hpfunc.P("fsdp"))})
        _, m_fresh = ts(fresh, batch)
        after_fresh = len(checked) - marked
        # an optimizer leaf laid out otherwise (replicated): checked and redistributed, computed alike
        other_layout = hpfunc.tree.tree_map(
            lambda x: hpfunc.reshard(x, hpfunc.P()) if isinstance(x, torch.Tensor) and x.ndim == 2 else x, state["opt"])
        _, m_other = ts(dict(state, opt=other_layout), batch)
        after_other = len(checked) - marked - after_fresh
        _, m_same = ts(state, batch)
        other = hpfunc.parallelize(step, mesh, plans.ddp("fsdp"))  # another plan: w is stored otherwise
        try:
            other(state, batch)
            wrong = "no error"
        except PlanError as err:
            wrong = str(err)
    finally:
        par.check_params = original
    return {"marked": marked, "after_fresh": after_fresh, "after_other": after_other, "losses": losses,
            "fresh": float(m_fresh["loss"].full_tensor()), "other": float(m_other["loss"].full_tensor()),
            "same": float(m_same["loss"].full_tensor()), "wrong": wrong}


def run_aux_stats_packed() -> dict:
    """A step whose differentiated function returns float and integer ``aux`` statistics of several
    dtypes, under ddp on this pool: the values (floats averaged, integers summed over the data shards)
    and the collectives that reduced them (with a float64 statistic and, ``fp32``, without it)."""
    import hpfunc
    from hpfunc.transforms import plans

    def make(with_double):
        def step(state, batch):
            def f(p):
                y = batch @ p["w"]
                aux = {"s": y.sum(), "v": batch.mean(0), "n": torch.tensor(batch.shape[0]),
                       "m": torch.tensor([batch.shape[0], 1], dtype=torch.int32)}
                if with_double:
                    aux["d"] = batch.double().sum()
                return y.pow(2).mean(), aux

            (loss, aux), g = hpfunc.value_and_grad(f, has_aux=True)(state["params"])
            return state, {"loss": loss, **aux}
        return step

    out = {}
    for with_double in (True, False):
        ts = hpfunc.parallelize(make(with_double), hpfunc.Mesh({"dp": 2}), plans.ddp("dp"))
        state = {"params": ts.shard_params({"w": torch.arange(3.0)})}
        batch = torch.arange(12.0).reshape(4, 3)
        ts(state, batch)
        with hpfunc.comm_stats() as stats:
            _, m = ts(state, batch)
        records = sorted((r.name, r.payload_bytes, r.tag) for r in stats.records)
        if with_double:
            out.update(records=records, **{k: v.full_tensor() for k, v in m.items()})
        else:
            out.update(records_fp32=records, fp32={k: v.full_tensor() for k, v in m.items()})
    return out


def run_front_scalars(name: str, steps: int = 3) -> list[dict]:
    """The front door's train step (AdamW, the grad-norm metric) for ``steps`` steps: per step, the
    collectives carrying its scalars (the loss, aux statistics, gradient norm) and how many collectives
    it made in all, with the metrics."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms.parallelize import init_sharded

    cfg = H.config("qwen3-dense-tiny", tie_word_embeddings=False)
    mesh, plan = H.make(name, cfg)
    tx = optim.adamw(LR)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                          shapes=qwen3.param_shapes(cfg))
    ts = hpfunc.parallelize(make_train_step(cfg, tx, loss_fn=qwen3.parallel_plan.loss), mesh, plan)
    state = ts.init_state(lambda p: init_train_state(p, tx), params)
    out = []
    for b in H.batches(cfg, steps, 4, 6, 0):
        with hpfunc.comm_stats() as stats:
            state, m = ts(state, b)
        out.append({"scalars": [(r.op, r.axes, r.payload_bytes) for r in stats.records if r.tag == "scalars"],
                    "small": [(r.op, r.name, r.payload_bytes) for r in stats.records
                              if r.tag != "scalars" and r.payload_bytes <= 64],
                    "riders": [r.rider_bytes for r in stats.records if r.rider_bytes],
                    "collectives": len(stats.records),
                    "metrics": {k: v.full_tensor() for k, v in m.items() if v.numel()}})
    return out
