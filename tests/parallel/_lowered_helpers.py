"""Rank functions of test_lowered.py: ``train_step.lower(state, batch)`` printed on a real mesh."""

from __future__ import annotations

import time

import torch


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(8, 4, generator=g),
            "layers": [{"wq": torch.randn(4, 4, generator=g) / 2, "wo": torch.randn(4, 4, generator=g) / 2}
                       for _ in range(2)],
            "bias": torch.randn(3, generator=g)}


def _step(state, batch):
    import hpfunc

    def loss(p):
        h = p["embed"][batch]
        for layer in p["layers"]:
            h = h @ layer["wq"] @ layer["wo"]
        return (h[..., :3] + p["bias"]).pow(2).mean()

    value, g = hpfunc.value_and_grad(loss)(state["params"])
    new = hpfunc.tree.tree_map(lambda w, d: w - 0.01 * d, state["params"], g)
    return {"params": new}, {"loss": value}


def _probe(on_forward=None, on_backward=None) -> type:
    """An identity autograd function that calls ``on_forward()`` when its forward runs and
    ``on_backward()`` when its backward does: it marks a point of the model in both passes."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(x):
            if on_forward is not None:
                on_forward()
            return x.view_as(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            if on_backward is not None:
                on_backward()
            return g

    return Probe


def run_printed(plan_name: str) -> dict:
    """``str(train_step.lower(state, batch))`` under ``plan_name`` on 2 ranks, whether the step found it
    (the same object) after running, and the loss of two steps run by the Lowered and the step."""
    import hpfunc
    from hpfunc.transforms import plans

    axis = {"fsdp": "fsdp", "ddp": "dp", "zero2": "dp"}[plan_name]
    plan = getattr(plans, plan_name)(axis)
    # one all-reduce bucket per layer (the bucket cap 0), to show their order; under the default cap the
    # small model's gradients share one bucket (default_text)
    ts = hpfunc.parallelize(_step, hpfunc.Mesh({axis: 2}), plan.with_bucket_cap(0))
    state = {"params": ts.shard_params(_params())}
    batch = torch.arange(8).reshape(4, 2) % 8
    default_text = str(hpfunc.parallelize(_step, hpfunc.Mesh({axis: 2}), plan).lower(state, batch))
    lowered = ts.lower(state, batch)
    text = str(lowered)
    state, m1 = lowered(state, batch)
    state, m2 = ts(state, batch)
    return {"text": text, "default_text": default_text, "same": ts.lower(state) is lowered,
            "losses": [float(m1["loss"].full_tensor()), float(m2["loss"].full_tensor())]}


def run_reductions_during_backward(plan_name: str) -> dict:
    """One step of the small model under ``plan_name`` on 2 ranks, with an identity autograd function on
    the embedding's output: its backward runs after every layer's (it is the model's first op), and
    counts the gradient all-reduces the comm counter has seen issued by then. Returns that count, the
    number of gradient all-reduces in all and their phases."""
    import hpfunc
    from hpfunc.transforms import plans

    axis = "dp"
    seen: list[int] = []
    times: list[float] = []
    stats_box: list = []

    def note_reduces():
        seen.append(sum(1 for r in stats_box[0].records if r.op == "all_reduce" and r.payload_bytes > 8))
        times.append(time.perf_counter())

    Probe = _probe(on_backward=note_reduces)  # (counts into the stats of the run going on)

    def step(state, batch):
        def loss(p):
            h = Probe.apply(p["embed"][batch])
            for layer in p["layers"]:
                h = h @ layer["wq"] @ layer["wo"]
            return (h[..., :3] + p["bias"]).pow(2).mean()

        value, g = hpfunc.value_and_grad(loss)(state["params"])
        return {"params": hpfunc.tree.tree_map(lambda w, d: w - 0.01 * d, state["params"], g)}, {"loss": value}

    # one bucket per layer (cap 0): the default cap would put the small model's gradients in one
    ts = hpfunc.parallelize(step, hpfunc.Mesh({axis: 2}), getattr(plans, plan_name)(axis).with_bucket_cap(0))
    state = {"params": ts.shard_params(_params())}
    batch = torch.arange(8).reshape(4, 2) % 8
    hooks = _count_hooks()
    with hooks, hpfunc.comm_stats() as stats:
        stats_box.append(stats)
        ts(state, batch)
    grads = [r for r in stats.records if r.op == "all_reduce" and r.payload_bytes > 8]
    # the default cap: the small model's gradients in one bucket, started as the backward returns
    one = hpfunc.parallelize(step, hpfunc.Mesh({axis: 2}), getattr(plans, plan_name)(axis))
    one_hooks = _count_hooks()
    with one_hooks, hpfunc.comm_stats() as one_stats:
        stats_box[0] = one_stats
        one(state, batch)
    return {"before_first_layer_backward": seen[0], "all_reduces": len(grads),
            "phases": sorted({r.phase for r in grads}), "bytes": sum(r.payload_bytes - r.rider_bytes for r in grads),
            "rider_bytes": sum(r.rider_bytes for r in grads),
            "overlapped": overlapping(stats, grads, times[0]), "hooks": hooks.count,
            "one_bucket": [(r.op, r.phase, r.payload_bytes - r.rider_bytes) for r in one_stats.records
                           if r.op == "all_reduce"], "one_bucket_hooks": one_hooks.count}


class _count_hooks:
    """Inside: counts the gradient hooks registered on tensors (``Tensor.register_hook``)."""

    def __enter__(self):
        self.count, self.real = 0, torch.Tensor.register_hook

        def counting(t, hook):
            self.count += 1
            return self.real(t, hook)

        torch.Tensor.register_hook = counting
        return self

    def __exit__(self, *exc):
        torch.Tensor.register_hook = self.real


def overlapping(stats, records, t: float) -> int:
    """How many of ``records`` were issued before ``t`` and waited for after it (the comm counter's issue
    and wait times): collectives in flight while the op that ran at ``t`` computed."""
    waited: dict[int, float] = {}
    for w in stats.waits:  # the first wait (a collective waited for early and again later was not in flight)
        waited.setdefault(id(w.record), w.waited_at)
    return sum(1 for r in records if r.issued_at < t < waited.get(id(r), float("-inf")))


def run_prefetch(reshard: bool, remat: bool | str, mixed: tuple | None = None, steps: int = 3) -> dict:
    """``steps`` steps of the small model under fsdp on 2 ranks (reshard after forward on or off, each
    layer in ``remat`` or not), with an identity autograd function on layer 0's first product: its
    forward runs while layer 0 computes, and notes the forward all-gathers the comm counter has seen
    issued by then. Returns those counts per step, every step's gathered bytes by phase, the losses and
    the final parameters (full), and the same of the step run on one device; and, per step, the
    reduce-scatters issued without waiting (``async``) by the time the backward reaches the model's
    first op. ``remat``: each layer in ``hpfunc.remat`` (``True``) or with the named policy; ``mixed``:
    ``(param_dtype, reduce_dtype)`` names of the plan's mixed precision (``"float64"`` computes in fp64:
    equal to the fp32 device within fp32's tolerance)."""
    import hpfunc
    from hpfunc.transforms import plans

    seen: list[int] = []
    scattered: list[int] = []
    stats_box: list = []

    regathered: list[int] = []
    at: dict[str, float] = {}  # when the probes ran (this step)

    def at_first_op_backward():
        if stats_box:
            scattered.append(sum(1 for r in stats_box[-1].records if r.op == "reduce_scatter" and r.tag == "async"))
            at["first op backward"] = time.perf_counter()

    def between_backward():
        regathered.append(sum(1 for r in stats_box[-1].records if r.op == "all_gather" and r.phase == "backward"))
        at["between backward"] = time.perf_counter()

    def layer0_forward():
        if stats_box and torch._C._current_graph_task_id() == -1:  # not a remat's recompute
            seen.append(sum(1 for r in stats_box[-1].records if r.op == "all_gather" and r.phase == "forward"))
            at["layer 0 forward"] = time.perf_counter()

    FirstOp = _probe(on_backward=at_first_op_backward)  # the model's first op: its backward runs after every layer's
    Between = _probe(on_backward=between_backward)  # on layer 1's input: its backward runs before layer 0's
    Probe = _probe(on_forward=layer0_forward)  # on layer 0's first product: its forward runs while layer 0 computes

    def layer_fn(lp, h, first):
        h = h @ lp["wq"]
        if first:
            h = Probe.apply(h)
        return h @ lp["wo"]

    def step(state, batch):
        def loss(p):
            h = FirstOp.apply(p["embed"][batch])
            for k, lp in enumerate(p["layers"]):
                if k == 1 and stats_box:
                    h = Between.apply(h)
                policy = None if remat in (False, True) else getattr(__import__("hpfunc.transforms.remat", fromlist=["remat"]), remat)
                f = hpfunc.remat(lambda lp, h, k=k: layer_fn(lp, h, k == 0), policy=policy) if remat else (
                    lambda lp, h, k=k: layer_fn(lp, h, k == 0))
                h = f(lp, h)
            return (h[..., :3] + p["bias"]).pow(2).mean()

        value, g = hpfunc.value_and_grad(loss)(state["params"])
        return {"params": hpfunc.tree.tree_map(lambda w, d: w - 0.01 * d, state["params"], g)}, {"loss": value}

    batch = torch.arange(8).reshape(4, 2) % 8
    ref_state, ref_losses = {"params": _params()}, []
    for _ in range(steps):  # one device (both ranks' batch: fsdp's mean over data shards is the global mean)
        ref_state, m = step(ref_state, batch)
        ref_losses.append(float(m["loss"]))
    plan = plans.fsdp("fsdp", reshard_after_forward=reshard)
    if mixed is not None:
        plan = plan.with_mixed_precision(*(None if d is None else getattr(torch, d) for d in mixed))
    ts = hpfunc.parallelize(step, hpfunc.Mesh({"fsdp": 2}), plan)
    state = {"params": ts.shard_params(_params())}
    losses, gathered, overlapped = [], [], []
    for _ in range(steps):
        at.clear()
        with hpfunc.comm_stats() as stats:
            stats_box.append(stats)
            state, m = ts(state, batch)
        losses.append(float(m["loss"].full_tensor()))
        # collectives in flight (issued before, waited for after) while each probe's op ran
        fwd = [r for r in stats.records if r.op == "all_gather" and r.phase == "forward"]
        bwd = [r for r in stats.records if r.op == "all_gather" and r.phase == "backward"]
        rs = [r for r in stats.records if r.op == "reduce_scatter"]
        overlapped.append([overlapping(stats, fwd, at["layer 0 forward"]),
                           overlapping(stats, bwd, at["between backward"]) if "between backward" in at else 0,
                           overlapping(stats, rs, at["first op backward"])])
        by_phase: dict = {}
        for r in stats.records:
            if r.op in ("all_gather", "reduce_scatter"):
                by_phase[(r.op, r.phase)] = by_phase.get((r.op, r.phase), 0) + r.payload_bytes
        gathered.append(by_phase)
    full = ts.full_params(state["params"])
    return {"seen": seen, "scattered": scattered, "regathered": regathered, "overlapped": overlapped, "bytes": gathered, "losses": losses, "ref_losses": ref_losses,
            "params": hpfunc.tree.leaves(full), "ref_params": hpfunc.tree.leaves(ref_state["params"]),
            "orders": ts.lower(state).gather_orders, "regather_orders": ts.lower(state).regather_orders}
