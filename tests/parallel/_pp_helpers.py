"""Rank-side helpers for the pipeline tests: a Qwen3 step under ``plans.pp`` (alone, with fsdp, tp, ep)
against single-device training on the same global batch, microbatch by microbatch."""

from __future__ import annotations

import torch

LR = 1e-3
ADAM_EPS = 1e-5


def plan_of(cfg, mesh_shape: dict, roles: list[str], schedule: str, m: int, layers=None, virtual_stages=None,
            remat=None, max_resident=None):
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans
    from hpfunc.transforms.pipeline_plan import stages_per_rank

    plan = plans.Plan()
    for axis, role in zip(mesh_shape, roles):
        if role == "pp":
            n = mesh_shape[axis] * stages_per_rank(schedule, virtual_stages)
            stages = parallel_plan.pipeline_stages(cfg, n, layers=layers)
            plan = plan + plans.pp(axis, stages, schedule=schedule, microbatches=m, virtual_stages=virtual_stages,
                                   remat=remat, max_resident=max_resident)
        else:
            plan = plan + {"ep": lambda a: plans.ep(a, parallel_plan.ep_experts(cfg)),
                           "fsdp": lambda a: plans.fsdp(a), "ddp": lambda a: plans.ddp(a),
                           "tp": lambda a: plans.tp(a, parallel_plan.tp_styles(cfg)),
                           "cp": lambda a: plans.cp(a, impl="ring"),
                           "cp_ulysses": lambda a: plans.cp(a, impl="ulysses")}[role](axis)
    return plan


def model_cfg(kind: str, layers: int, tied: bool):
    from hpfunc.models import qwen3

    if kind == "moe":
        return qwen3.preset("qwen3-moe-tiny", num_hidden_layers=layers, router_aux_loss_coef=0.1,
                            tie_word_embeddings=tied)
    return qwen3.preset("qwen3-dense-tiny", num_hidden_layers=layers, tie_word_embeddings=tied)


def microbatches_of(batch: dict, n_data: int, m: int) -> list[dict]:
    """The pipelined run's microbatch ``i``: chunk ``i`` of every data shard, all shards together."""
    shards = [{k: v.chunk(n_data)[j] for k, v in batch.items()} for j in range(n_data)]
    return [{k: torch.cat([s[k].chunk(m)[i] for s in shards]) for k in batch} for i in range(m)]


def _counted(step, args: tuple, out: dict | None):
    """``step(*args)``; with ``out``, its communication records go to ``out["records"]``."""
    import hpfunc

    if out is None:
        return step(*args)
    with hpfunc.comm_stats() as stats:
        result = step(*args)
    out["records"] = [(r.op, r.name, r.axes, r.payload_bytes, r.phase, float(r.sent_bytes), r.tag)
                      for r in stats.records]
    return result


def run_pp_parity(mesh_shape: dict, roles: list[str], *, schedule: str = "1f1b", m: int = 4, kind: str = "dense",
                  layers: int = 4, split=None, tied: bool = False, seed: int = 0, steps: int = 2, batch: int = 8,
                  seq: int = 8, virtual_stages=None, count_comm: bool = False, remat=None,
                  max_resident=None) -> dict:
    """``steps`` AdamW steps of a tiny Qwen3 under the plan and on one device: loss, aux, gradients and
    updated parameters of this rank's stages agree (fp32, rtol 1e-5)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = model_cfg(kind, layers, tied)
    mesh = hpfunc.Mesh(mesh_shape)
    plan = plan_of(cfg, mesh_shape, roles, schedule, m, split, virtual_stages, remat, max_resident)
    n_data = 1
    for axis in plan.data_axes:
        n_data *= mesh.axis_size(axis)
    full = qwen3.init(hpfunc.random.key(seed), cfg)

    def loss_fn(p, b):
        value, aux = parallel_plan.loss(p, b, cfg)
        return value, {"aux_loss": aux["aux_loss"], "expert_load": aux["expert_load"], "ce_loss": aux["ce_loss"]}

    def ref_loss(p, b):  # one device: the mean over the pipeline's microbatches
        total, ce, auxl, load = 0.0, 0.0, 0.0, 0
        for mb in microbatches_of(b, n_data, m):
            value, aux = qwen3.loss(p, mb, cfg)
            total, ce, auxl, load = total + value / m, ce + aux["ce_loss"] / m, auxl + aux["aux_loss"] / m, \
                load + aux["expert_load"]
        return total, {"aux_loss": auxl, "expert_load": load, "ce_loss": ce}

    opt = optim.adamw(LR, eps=ADAM_EPS)
    step = parallel_train_step(loss_fn, opt, mesh, plan, has_aux=True, return_grads=True)
    params = step.shard_params(full)
    state = step.init_opt_state(params)
    ref_params, ref_state = full, opt.init(full)
    g = torch.Generator().manual_seed(seed + 1)
    out: dict = {"local_paths": [p for p, _ in hpfunc.tree.leaves_with_paths(params)]}
    # the bytes of this rank's stages' parameters, whole (what FSDP gathers once per step)
    out["stage_bytes"] = sum(x.numel() * x.element_size() for _, x in hpfunc.tree.leaves_with_paths(
        plan.local_params(full, mesh)))
    for i in range(steps):
        b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)}
        counted: dict | None = {} if count_comm else None
        params, state, metrics, grads = _counted(step, (params, state, b), counted)
        if counted is not None:  # out["records"]: the first step's; out["records_per_step"]: every step's
            out.setdefault("records_per_step", []).append(counted["records"])
            out.setdefault("records", counted["records"])
        (value, aux), ref_grads = hpfunc.value_and_grad(ref_loss, has_aux=True)(ref_params, b)
        what = f"{mesh_shape} {roles} {schedule} m{m} {kind} L{layers} {split} tied={tied} step {i}"
        assert_trees_close(metrics["loss"], value, rtol=1e-5, atol=1e-6, what=f"{what} loss")
        assert_trees_close(metrics["ce_loss"], aux["ce_loss"], rtol=1e-5, atol=1e-6, what=f"{what} ce")
        assert_trees_close(metrics["aux_loss"], aux["aux_loss"], rtol=1e-5, atol=1e-7, what=f"{what} aux loss")
        assert torch.equal(to_full(metrics["expert_load"]).to(torch.int64),
                           torch.as_tensor(aux["expert_load"]).to(torch.int64)), f"{what} expert load"
        ref_local = plan.local_params(ref_grads, mesh)
        got = hpfunc.tree.leaves_with_paths(to_full(grads))
        want = dict(hpfunc.tree.leaves_with_paths(ref_local))
        assert [p for p, _ in got] == list(want), f"{what}: local gradient paths"
        for path, gr in got:
            r = want[path]
            scale = float(r.abs().max()) or 1.0
            assert_trees_close(gr, r, rtol=1e-5, atol=1e-5 * scale, what=f"{what} grad {path}")
        updates, ref_state = opt.update(ref_grads, ref_state, ref_params)
        ref_params = optim.apply_updates(ref_params, updates)
        assert_trees_close(to_full(params), plan.local_params(ref_params, mesh), rtol=1e-5,
                           atol=0.05 * LR * (i + 1), what=f"{what} params")
        out["grad_norm"] = float(to_full(metrics["grad_norm"]))
        out["ref_grad_norm"] = float(optim.global_norm(ref_grads))
        assert abs(out["grad_norm"] - out["ref_grad_norm"]) <= 1e-5 * out["ref_grad_norm"], f"{what} grad norm"
    out["loss"] = float(to_full(metrics["loss"]))
    return out


def run_timeline(schedule: str = "1f1b", m: int = 4) -> dict:
    """One pipelined step of the tiny dense Qwen3 on 2 pipeline ranks with the timeline recorded:
    ``{action: [(what, seconds), ...]}`` plus this rank's action order."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms.parallelize import parallel_train_step
    from hpfunc.transforms.pipeline import record_timeline

    cfg = model_cfg("dense", 4, False)
    mesh = hpfunc.Mesh({"pp": 2})
    plan = plan_of(cfg, {"pp": 2}, ["pp"], schedule, m)
    step = parallel_train_step(lambda p, b: parallel_plan.loss(p, b, cfg), optim.adamw(LR), mesh, plan,
                               has_aux=True)
    from hpfunc.models import qwen3

    params = step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
    state = step.init_opt_state(params)
    b = {"tokens": torch.randint(0, cfg.vocab_size, (8, 8), generator=torch.Generator().manual_seed(0))}
    step(params, state, b)  # warm
    with record_timeline() as events:
        step(params, state, b)
    return {"events": events, "actions": [str(a) for a in plan.pipeline_schedule(mesh).actions[mesh.axis_index("pp")]]}


def run_unpipelined_loss() -> str:
    """A step whose loss is the model's single-device ``qwen3.loss`` under a pp plan: the error it raises."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.layout import PlanError
    from hpfunc.models import qwen3
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = model_cfg("dense", 4, False)
    mesh = hpfunc.Mesh({"pp": 2})
    step = parallel_train_step(lambda p, b: qwen3.loss(p, b, cfg), optim.adamw(LR), mesh,
                               plan_of(cfg, {"pp": 2}, ["pp"], "1f1b", 2), has_aux=True)
    params = step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
    try:
        step(params, step.init_opt_state(params), {"tokens": torch.zeros(4, 8, dtype=torch.long)})
    except PlanError as err:
        return str(err)
    return "no error"


def run_stage_reaching_around_its_params() -> str:
    """Stage functions that read the step's parameters from a tree they closed over (the lazy view the
    loss received) instead of their own ``params`` argument: the error each rank raises."""
    import hpfunc
    from hpfunc import layout, optim
    from hpfunc.layout import PlanError, Stages
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    box: dict = {}
    stages = Stages(num_stages=2, paths=("a", "b"), stage_of=lambda path: (0,) if path == "a" else (1,),
                    forward=lambda s, p, carry, mb: ((mb["x"] * box["p"]["a"],) if s == 0
                                                     else (carry[0] * box["p"]["b"],)),
                    loss=lambda p, carry, mb: ((carry[0] ** 2).mean(), {}), aux_template=lambda mb: {})

    def loss(params, batch):
        box["p"] = params
        return layout.runner().run(params, batch)

    step = parallel_train_step(loss, optim.adamw(LR), hpfunc.Mesh({"pp": 2}),
                               plans.pp("pp", stages, schedule="1f1b", microbatches=2), has_aux=True)
    params = step.shard_params({"a": torch.ones(3), "b": torch.ones(3)})
    try:
        step(params, step.init_opt_state(params), {"x": torch.ones(4, 3)})
    except PlanError as err:
        return str(err)
    return "no error"


def run_norm_of_gradients_scaled_in_place() -> tuple[float, float]:
    """The global norm of a pipelined step's gradients (reduced with the loss), then of the same gradient
    tensors doubled in place (which must be computed again): ``(first, second)``."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import to_full

    cfg = model_cfg("dense", 4, False)
    plan = plan_of(cfg, {"pp": 2}, ["pp"], "1f1b", 2)

    def step(state, batch):
        (_, _), grads = hpfunc.value_and_grad(lambda p: parallel_plan.loss(p, batch, cfg), has_aux=True)(state["params"])
        first = optim.global_norm(grads)
        for g in hpfunc.tree.leaves(grads):
            g.mul_(2)
        return state, {"first": first, "second": optim.global_norm(grads)}

    train_step = hpfunc.parallelize(step, hpfunc.Mesh({"pp": 2}), plan)
    params = train_step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
    state = train_step.init_state(lambda p: {"params": p}, params)
    _, metrics = train_step(state, {"tokens": torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))})
    return float(to_full(metrics["first"])), float(to_full(metrics["second"]))


def run_pipelined_state_checks() -> int:
    """How many of three pipelined steps (the state holds None for the other rank's stages) checked the
    state's layout: none, the state being laid out as lowered (the lowered step's expected layouts line
    up with the None positions too)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms import lowered as par

    cfg = model_cfg("dense", 4, False)
    tx = optim.adamw(LR)
    step = hpfunc.parallelize(make_train_step(cfg, tx, loss_fn=parallel_plan.loss), hpfunc.Mesh({"pp": 2}),
                              plan_of(cfg, {"pp": 2}, ["pp"], "1f1b", 2))
    state = step.init_state(lambda p: init_train_state(p, tx), step.shard_params(qwen3.init(hpfunc.random.key(0), cfg)))
    checked = []
    original = par.check_params
    par.check_params = lambda *a, **k: (checked.append(1), original(*a, **k))[1]
    try:
        for _ in range(3):
            state, _ = step(state, {"tokens": torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))})
    finally:
        par.check_params = original
    return len(checked)


def _resident_probe(exclude: set):
    """A layer on the saved-tensor stack that remembers every storage kept for backward by weak
    reference only (storages in ``exclude`` apart) and, each time one is added, sums the bytes of those
    still alive: ``probe.peak`` is the most saved-activation bytes resident at once. Whether a storage
    is alive is the measurement; nothing the executor counts is read.

    It sees what autograd saves (its pack hook: parameters never reach it, the step's own layer outside
    it owns them; what a pipeline swap brings back at ``SWAP_IN`` is handed outward to it again) and,
    being a :class:`hpfunc.memory` recorder, the outputs selective recompute caches (remat reports
    those to the recorder as it stores them: they bypass saved-tensor hooks)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from hpfunc.memory._recorder import Recorder
    from hpfunc.memory._storage import live_total, local, storage_key

    class Probe(Recorder):
        name = "test.resident_probe"

        def __init__(self) -> None:
            super().__init__()
            self.refs: dict = {}
            self.peak = 0

        def note(self, t, *, kind, name=None, op=None):
            # remat's inputs are noted too: they are saved as well (packed here) unless they are
            # parameters (owned by the step) or the batch (excluded)
            key = storage_key(t)
            if kind in ("saved", "cached") and key not in exclude:
                old = self.refs.get(key)
                if old is None or old.expired():
                    self.refs[key] = StorageWeakRef(local(t).untyped_storage())
            self.peak = max(self.peak, live_total(self.refs))

    return Probe()


def run_pp_resident(mesh_shape: dict, schedule: str, *, m: int = 4, layers: int = 4, batch: int = 8, seq: int = 8,
                    max_resident=None, remat=None) -> dict:
    """One pipelined step of the tiny dense Qwen3 (plain ``pp``) with the saved-activation bytes resident
    on this rank measured by storage liveness (:func:`_resident_probe`, pushed inside the function the
    step differentiates, the batch excluded), beside what the model says one stage-microbatch keeps:
    :func:`hpfunc.memory.saved_activations` of each local stage on one microbatch on one device (with
    the stage's remat policy), and the schedule the step executed with ``simulate``'s counts."""
    import hpfunc
    from hpfunc import optim, saved_tensors
    from hpfunc.memory import saved_activations
    from hpfunc.memory._storage import storage_key
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.schedules import simulate
    from hpfunc.transforms.parallelize import parallel_train_step
    from hpfunc.transforms.remat import remat as remat_fn

    cfg = model_cfg("dense", layers, False)
    mesh = hpfunc.Mesh(mesh_shape)
    plan = plan_of(cfg, mesh_shape, list(mesh_shape), schedule, m, remat=remat, max_resident=max_resident)
    probes = []

    def loss_fn(p, b):
        probes.append(_resident_probe({storage_key(x) for x in b.values()}))
        with saved_tensors.layer(probes[-1]):
            return parallel_plan.loss(p, b, cfg)

    full = qwen3.init(hpfunc.random.key(0), cfg)
    step = parallel_train_step(loss_fn, optim.adamw(LR), mesh, plan, has_aux=True)
    params = step.shard_params(full)
    b = {"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))}
    step(params, step.init_opt_state(params), b)

    # one stage-microbatch on one device: the carry each stage receives, and what its graph keeps
    layer, r = plan.pipeline, mesh.axis_index("pp")
    sched = plan.pipeline_schedule(mesh)
    stages, mb = layer.stages, {"tokens": b["tokens"][: batch // m]}
    carries, carry = [], None
    with torch.no_grad():
        for s in range(stages.num_stages):
            carries.append(carry)
            carry = stages.forward(s, full, carry, mb)
    stage_bytes = {}
    for s in sched.stages_of(r):
        policy = layer.remat_policy(s)
        wrap = (lambda f: f) if policy is False else (lambda f, policy=policy: remat_fn(f, policy=policy))
        forward = wrap(lambda p, c, s=s: stages.forward(s, p, c, mb))
        head = wrap(lambda p, y: stages.loss(p, y, mb)[0])  # the last stage's loss: a region of its own

        def fn(p, c, s=s, forward=forward, head=head):
            y = forward(p, c)
            return head(p, y) if s == stages.num_stages - 1 else y

        stage_bytes[s] = saved_activations(fn, full, carries[s], state_argnums=(0,)).device_bytes
    sim = simulate(sched)
    return {"peak": probes[0].peak, "stage_bytes": stage_bytes, "boundary": batch // m * seq * cfg.hidden_size * 4,
            "actions": [(a.kind.name, a.stage) for a in sched.actions[r]],
            "peak_resident": sim.peak_resident[r], "peak_resident_until_w": sim.peak_resident_until_w[r],
            "peak_until_w": sim.peak_until_w[r]}


def run_pp_fsdp_trace(steps: int = 2, m: int = 2) -> dict:
    """``steps`` AdamW steps of the tiny dense Qwen3 (4 layers) on ``{pp: 2, fsdp: 2}`` under 1F1B with
    ``m`` microbatches, each under the comm counter, with every decoder layer's forward timed (a layer
    transform bound in the loss: ``(start, end)`` per layer run, recomputes excluded). Returns per step the
    collectives over ``fsdp`` as ``(op, bytes, tag, issued_at, waited_at or None)``, the layers' windows,
    the stage's whole bytes (``stage_bytes``) and the losses (parity is ``run_pp_parity``'s)."""
    import time

    import hpfunc
    from hpfunc import layout, optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = model_cfg("dense", 4, False)
    shape = {"pp": 2, "fsdp": 2}
    mesh = hpfunc.Mesh(shape)
    plan = plan_of(cfg, shape, ["pp", "fsdp"], "1f1b", m)
    windows: list = []

    def timed(index, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if torch._C._current_graph_task_id() == -1:  # not a recompute in a backward
                windows.append((index, t0, time.perf_counter()))
            return out
        return run

    def loss_fn(p, b):
        with layout.layer_transforms(timed):
            value, aux = parallel_plan.loss(p, b, cfg)
        return value, {"ce_loss": aux["ce_loss"]}

    step = parallel_train_step(loss_fn, optim.adamw(LR, eps=ADAM_EPS), mesh, plan, has_aux=True)
    full = qwen3.init(hpfunc.random.key(0), cfg)
    params = step.shard_params(full)
    state = step.init_opt_state(params)
    g = torch.Generator().manual_seed(1)
    out: dict = {"steps": [], "stage_bytes": sum(x.numel() * x.element_size() for _, x in hpfunc.tree.leaves_with_paths(
        plan.local_params(full, mesh)))}
    for _ in range(steps):
        b = {"tokens": torch.randint(0, cfg.vocab_size, (8, 8), generator=g)}
        windows.clear()
        with hpfunc.comm_stats() as stats:
            params, state, metrics = step(params, state, b)
        waited: dict = {}
        for w in stats.waits:  # the first wait
            waited.setdefault(id(w.record), w.waited_at)
        out["steps"].append({
            "records": [(r.op, r.payload_bytes, r.tag, r.issued_at, waited.get(id(r))) for r in stats.records
                        if r.axes == ("fsdp",) and r.op in ("all_gather", "reduce_scatter")],
            "layers": list(windows), "loss": float(metrics["loss"].full_tensor())})
    return out


def gathers_in_flight_across_layers(step: dict) -> int:
    """How many all-gathers were issued while a decoder layer computed its forward and landed after that
    layer ended (a layer's gather in flight while the layer before it computes)."""
    return sum(1 for op, _, _, issued, waited in step["records"] if op == "all_gather" and waited is not None
               and any(t0 < issued < t1 < waited for _, t0, t1 in step["layers"]))


def scatters_in_flight_together(step: dict) -> int:
    """How many reduce-scatters were still in flight (issued, not waited for) when the next one was issued:
    the backward going on past them."""
    rs = sorted((issued, waited) for op, _, _, issued, waited in step["records"] if op == "reduce_scatter")
    return sum(1 for (i0, w0), (i1, _) in zip(rs, rs[1:]) if w0 is not None and i1 < w0)


def run_pp_fsdp_mixed(steps: int = 2) -> list[float]:
    """``steps`` AdamW steps of the tiny dense Qwen3 on ``{pp: 2, fsdp: 2}`` (1F1B, m = 2) with fp32
    parameters, and again computing in fp64 (``with_mixed_precision(param_dtype=float64)``: the stages'
    gathers move fp64, the reduce-scatters sum fp64 into carriers, cast back after the wait): the losses
    agree at fp32's rtol 1e-5 and the gradients at 1e-4. Returns the fp64 run's losses."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = model_cfg("dense", 4, False)
    shape = {"pp": 2, "fsdp": 2}
    mesh = hpfunc.Mesh(shape)
    runs = []
    for mixed in (None, torch.float64):
        plan = plan_of(cfg, shape, ["pp", "fsdp"], "1f1b", 2)
        if mixed is not None:
            plan = plan.with_mixed_precision(param_dtype=mixed)
        step = parallel_train_step(lambda p, b: parallel_plan.loss(p, b, cfg)[0], optim.adamw(LR, eps=ADAM_EPS), mesh,
                                   plan, return_grads=True)
        params = step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
        state = step.init_opt_state(params)
        g = torch.Generator().manual_seed(1)
        run = []
        for _ in range(steps):
            b = {"tokens": torch.randint(0, cfg.vocab_size, (8, 8), generator=g)}
            params, state, metrics, grads = step(params, state, b)
            run.append((float(to_full(metrics["loss"])), to_full(grads)))
        runs.append(run)
    for k, ((l32, g32), (l64, g64)) in enumerate(zip(*runs)):
        assert abs(l32 - l64) <= 1e-5 * abs(l32), (k, l32, l64)
        assert_trees_close(g64, g32, rtol=1e-4, atol=1e-6, what=f"step {k} gradients, fp64 compute")
    return [loss for loss, _ in runs[1]]
