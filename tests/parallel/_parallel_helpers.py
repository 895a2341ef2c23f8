"""Rank-side helpers for the parallelize tests: plans by name, a sharded run and its single-device twin."""

from __future__ import annotations

import functools

import torch

# name -> (world, mesh axes, plan factory); every plan the tests exercise
PLANS = {
    "ddp": (2, {"dp": 2}, lambda pl, tp: pl.ddp("dp")),
    "fsdp": (2, {"fsdp": 2}, lambda pl, tp: pl.fsdp("fsdp")),
    "fsdp_keep": (2, {"fsdp": 2}, lambda pl, tp: pl.fsdp("fsdp", reshard_after_forward=False)),
    "zero1": (2, {"dp": 2}, lambda pl, tp: pl.zero1("dp")),
    "zero2": (2, {"dp": 2}, lambda pl, tp: pl.zero2("dp")),
    "tp": (2, {"tp": 2}, lambda pl, tp: tp("tp")),
    "fsdp4": (4, {"fsdp": 4}, lambda pl, tp: pl.fsdp("fsdp")),
    "ddp4": (4, {"dp": 4}, lambda pl, tp: pl.ddp("dp")),
    "hsdp": (4, {"dp": 2, "fsdp": 2}, lambda pl, tp: pl.hsdp("dp", "fsdp")),
    "fsdp_tp": (4, {"fsdp": 2, "tp": 2}, lambda pl, tp: pl.fsdp("fsdp") + tp("tp")),
    "ddp_tp": (4, {"dp": 2, "tp": 2}, lambda pl, tp: pl.ddp("dp") + tp("tp")),
    "zero2_tp": (4, {"dp": 2, "tp": 2}, lambda pl, tp: pl.zero2("dp") + tp("tp")),
    "hsdp_tp8": (8, {"dp": 2, "fsdp": 2, "tp": 2},
                 lambda pl, tp: pl.hsdp("dp", "fsdp") + tp("tp", vocab_parallel=True)),
    "tp_vocab": (2, {"tp": 2}, lambda pl, tp: tp("tp", vocab_parallel=True)),
    "fsdp_tp_vocab": (4, {"fsdp": 2, "tp": 2}, lambda pl, tp: pl.fsdp("fsdp") + tp("tp", vocab_parallel=True)),
}

# Megatron sequence parallelism on the tp axis (tests/parallel/test_parallel_sp.py); kept out of PLANS so
# that the tests iterating PLANS keep their size
SP_PLANS = {
    "tp_sp": (2, {"tp": 2}, lambda pl, tp: tp("tp", sequence_parallel=True)),
    "tp_sp_vocab": (2, {"tp": 2}, lambda pl, tp: tp("tp", vocab_parallel=True, sequence_parallel=True)),
    "fsdp_tp_sp": (4, {"fsdp": 2, "tp": 2}, lambda pl, tp: pl.fsdp("fsdp") + tp("tp", sequence_parallel=True)),
    "fsdp_tp_sp_vocab": (4, {"fsdp": 2, "tp": 2},
                         lambda pl, tp: pl.fsdp("fsdp") + tp("tp", vocab_parallel=True, sequence_parallel=True)),
    "zero2_tp_sp": (4, {"dp": 2, "tp": 2}, lambda pl, tp: pl.zero2("dp") + tp("tp", sequence_parallel=True)),
}
ALL_PLANS = {**PLANS, **SP_PLANS}

LR = 1e-3
ADAM_EPS = 1e-5


def tp_of(cfg):
    """``tp(axis, **modes)``: the tensor-parallel plan layer with the model's own styles."""
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans

    return lambda axis, **kw: plans.tp(axis, parallel_plan.tp_styles(cfg, **kw))


def make(name, cfg):
    """``name`` of :data:`PLANS`, or ``(mesh_shape, roles)`` with one role per mesh axis, for the model of ``cfg``."""
    import hpfunc
    from hpfunc.transforms import plans

    tp = tp_of(cfg)
    if isinstance(name, tuple):
        mesh_shape, roles = name
        plan = plans.Plan()
        for axis, role in zip(mesh_shape, roles):
            plan = plan + {
                "ddp": lambda a: plans.ddp(a), "fsdp": lambda a: plans.fsdp(a),
                "fsdp_keep": lambda a: plans.fsdp(a, reshard_after_forward=False),
                "zero1": lambda a: plans.zero1(a), "zero2": lambda a: plans.zero2(a),
                "tp": lambda a: tp(a), "tp_vocab": lambda a: tp(a, vocab_parallel=True),
            }[role](axis)
        return hpfunc.Mesh(mesh_shape), plan
    world, axes, factory = ALL_PLANS[name]
    return hpfunc.Mesh(axes), factory(plans, tp)


def model_loss(cfg, plan):
    """``parallel_plan.loss(p, b, cfg)[0]``: the step binds the plan's tp axis and its vocabulary / sequence modes."""
    from hpfunc.models.qwen3 import parallel_plan

    return lambda p, b: parallel_plan.loss(p, b, cfg)[0]


def config(model: str, **overrides):
    from hpfunc.models import qwen3

    return qwen3.preset(model, **overrides)


def batches(cfg, steps: int, batch: int, seq: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)} for _ in range(steps)]


def run_parity(name: str, model: str, seed: int, steps: int = 2, clip_norm: float | None = None,
               tie: bool | None = None, overrides: dict | None = None) -> dict:
    """Train ``steps`` AdamW steps sharded by plan ``name`` and on one device (the same global batches);
    return the largest errors (scaled) seen for loss, grads, grad norm and params."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    torch.manual_seed(0)
    overrides = dict(overrides or {}) if tie is None else {**(overrides or {}), "tie_word_embeddings": tie}
    cfg = config(model, **overrides)
    mesh, plan = make(name, cfg)
    key = hpfunc.random.key(seed)
    n_data = mesh.axis_size(tuple(a for a in mesh.axis_names if a in plan.data_axes)) if plan.data_axes else 1

    loss_fn = model_loss(cfg, plan)

    def ref_loss(p, b):
        # the single-device loss of the whole global batch: the mean over data shards of the per-shard
        # cross-entropy (equal targets per shard) plus MoE's load-balancing term, which the step computes
        # from the load of the whole batch (summed over the data shards), as on one device
        return qwen3.loss(p, b, cfg)[0]

    # eps 1e-5 (not 1e-8) bounds the slope of Adam's g / (sqrt(v) + eps) for the trajectory check below
    opt = optim.adamw(LR, eps=ADAM_EPS)
    ref_opt = opt if clip_norm is None else optim.chain(optim.clip_by_global_norm(clip_norm), opt)
    step = parallel_train_step(loss_fn, opt, mesh, plan, clip_norm=clip_norm, return_grads=True)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, key, shapes=qwen3.param_shapes(cfg))
    ref_params = qwen3.init(key, cfg)
    assert_trees_close(params, ref_params, rtol=0, atol=0, what="init_sharded")
    state = step.init_opt_state(params)
    ref_state = ref_opt.init(ref_params)
    for i, b in enumerate(batches(cfg, steps, 4, 8, seed)):
        at = to_full(params)  # the sharded run's current params, to compare this step's loss and grads exactly
        at_state = to_full(state)
        params, state, metrics, grads = step(params, state, b)
        value, ref_grads = hpfunc.value_and_grad(ref_loss)(at, b)
        assert_trees_close(metrics["loss"], value, rtol=1e-5, atol=1e-6, what=f"step {i} loss")
        assert_trees_close(metrics["grad_norm"], optim.global_norm(ref_grads), rtol=1e-5, atol=1e-7,
                           what=f"step {i} grad_norm")
        # gradients: fp32, different summation order (shards, all-reduce): rtol 1e-5 plus an absolute
        # floor of 1e-5 of the largest gradient entry, for entries that cancel to nearly zero
        for (path, g), r in zip(hpfunc.tree.leaves_with_paths(to_full(grads)), hpfunc.tree.leaves(ref_grads)):
            scale = float(r.abs().max()) or 1.0
            assert_trees_close(g, r, rtol=1e-5, atol=1e-5 * scale, what=f"step {i} grad {path}")
        # the optimizer on shards is the single-device optimizer: the same update from the same state and grads
        gfull = to_full(grads)
        if clip_norm is not None:
            clip = optim.clip_by_global_norm(clip_norm)
            gfull, _ = clip.update(gfull, clip.init(None))
        u, _ = opt.update(gfull, at_state, at)
        assert_trees_close(params, optim.apply_updates(at, u), rtol=1e-5, atol=1e-7, what=f"step {i} update")
        # the independent single-device trajectory
        _, tgrads = hpfunc.value_and_grad(ref_loss)(ref_params, b)
        updates, ref_state = ref_opt.update(tgrads, ref_state, ref_params)
        ref_params = optim.apply_updates(ref_params, updates)
        # independent trajectories: Adam's g / (sqrt(v) + eps) has slope up to 1 / eps for |g| <~ eps, so a
        # gradient entry near zero whose rounding differs by d (the summation order differs; the gradient
        # check above allows d up to 1e-5 of the leaf's largest entry) moves its parameter by up to
        # lr d / eps. With eps = 1e-5 that is <= 0.01 lr for d <= 1e-7; allowed: 0.05 lr per step.
        # (eps = 1e-6 failed this on a derandomized SP example, 0.14 lr after two steps for an embedding
        # row of vocabulary-parallel x sequence-parallel TP whose gradient is ~1e-8; with the default
        # eps = 1e-8 such entries move by up to ~lr: see the sweep note in docs/parallel.md.)
        assert_trees_close(params, ref_params, rtol=1e-5, atol=0.05 * LR * (i + 1), what=f"step {i} params")
    # same specs in and out
    assert all(hpfunc.typeof(a) == hpfunc.typeof(b) for a, b in zip(
        hpfunc.tree.leaves(params), hpfunc.tree.leaves(init_sharded(
            functools.partial(qwen3.init, cfg=cfg), mesh, plan, key, shapes=qwen3.param_shapes(cfg)))))
    return {"loss": float(metrics["loss"].full_tensor())}


def run_dense_loss_is_full_batch_loss(seed: int) -> float:
    """For a dense model the mean of shard means equals the full-batch mean (equal targets per shard)."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = config("qwen3-dense-tiny")
    mesh, plan = make("fsdp", cfg)
    p = qwen3.init(hpfunc.random.key(seed), cfg)
    step = parallel_train_step(lambda q, b: qwen3.parallel_plan.loss(q, b, cfg)[0], optim.adamw(LR), mesh, plan)
    params = step.shard_params(p)
    b = batches(cfg, 1, 4, 8, seed)[0]
    _, _, m = step(params, step.init_opt_state(params), b)
    full = qwen3.loss(p, b, cfg)[0]
    torch.testing.assert_close(m["loss"].full_tensor(), full, rtol=1e-6, atol=1e-6)
    return float(full)


def _setup(name: str, model: str = "qwen3-dense-tiny", **overrides):
    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    cfg = config(model, **overrides)
    mesh, plan = make(name, cfg)
    step = parallel_train_step(model_loss(cfg, plan), optim.adamw(LR), mesh, plan, return_grads=True)
    params = init_sharded(functools.partial(qwen3.init, cfg=cfg), mesh, plan, hpfunc.random.key(0),
                          shapes=qwen3.param_shapes(cfg))
    return mesh, plan, cfg, step, params


def run_comm(name: str, batch: int = 4, seq: int = 6, step_no: int = 0) -> dict:
    """One step under comm_stats (step ``step_no``: the ones before it run uncounted): the bytes each rank
    sends, split by collective and phase.

    Records of at most 8 bytes (the loss pmean and the grad-norm psum, one scalar each) and those tagged
    ``"scalars"`` (the loss, statistics and gradient norm in one all-reduce) are left out;
    the step's scalars riding a gradient bucket (``CommRecord.rider_bytes``) are counted apart from its
    gradient bytes (``"scalars"``: collectives carrying them, ``"rider_bytes"``: their bytes).
    """
    from hpfunc.comm import ring_sent_bytes
    import math

    import hpfunc
    from hpfunc.models import qwen3

    mesh, plan, cfg, step, params = _setup(name, tie_word_embeddings=False)
    state = step.init_opt_state(params)
    b = batches(cfg, 1, batch, seq, 0)[0]
    for _ in range(step_no):
        params, state, *_ = step(params, state, b)
    with hpfunc.comm_stats() as stats:
        step(params, state, b)
    shapes = dict(hpfunc.tree.leaves_with_paths(qwen3.param_shapes(cfg), is_leaf=lambda x: isinstance(x, torch.Size)))
    last = f"layers.{cfg.num_hidden_layers - 1}."
    out = {"psi": sum(math.prod(s) for s in shapes.values()), "embed": math.prod(shapes["embed"]),
           # what the forward reads last, kept gathered for the backward from the second step on
           "kept": sum(math.prod(s) for p, s in shapes.items() if p.startswith(last) or p in ("final_norm", "lm_head")),
           "layers": cfg.num_hidden_layers,
           "act_bytes": batch // mesh.axis_size(plan.data_axes) * seq * cfg.hidden_size * 4,
           "scalars": sum(1 for r in stats.records if r.payload_bytes <= 8 or r.rider_bytes or r.tag == "scalars"),
           "rider_bytes": sum(r.rider_bytes for r in stats.records)}
    for r in stats.records:
        if r.payload_bytes <= 8 or r.tag == "scalars":
            continue
        k = (r.op, r.axes, r.phase)
        out.setdefault(k, [0, 0])
        out[k][0] += 1
        out[k][1] += ring_sent_bytes(r.op, r.payload_bytes - r.rider_bytes, r.n) if r.rider_bytes else r.sent_bytes
    # psums of activations (TP): their own key, by payload size
    out["act_psum"] = {ph: sum(1 for r in stats.records if r.op == "all_reduce" and r.phase == ph
                               and r.payload_bytes == out["act_bytes"]) for ph in ("forward", "backward")}
    # every record on the tp axis, for the sequence-parallel tests: (op, phase, payload bytes, sent bytes)
    out["tp_records"] = [(r.op, r.phase, r.payload_bytes, r.sent_bytes) for r in stats.records if r.axes == ("tp",)]
    out["replicated_numel"] = {p: math.prod(s) for p, s in shapes.items()}
    res = plan.resolve(qwen3.param_shapes(cfg), mesh)
    out["tp_replicated_numel"] = sum(math.prod(r.shape) for r in res.values() if "tp" in r.replicated)
    # FSDP gathers: one per layer (its parameters packed) and one per top-level parameter
    out["gather_groups"] = len({p.split(".")[0] + "." + p.split(".")[1] if p.split(".")[0] == "layers" else p
                                for p, r in res.items() if r.gather})
    return out


def run_state_bytes(name: str) -> dict:
    """Bytes of parameters, reduced gradients and optimizer state held by this rank after one step."""
    import math

    import hpfunc
    from hpfunc.models import qwen3
    from torch.distributed.tensor import DTensor

    mesh, plan, cfg, step, params = _setup(name, tie_word_embeddings=False)
    state = step.init_opt_state(params)
    params, state, _, grads = step(params, state, batches(cfg, 1, 4, 6, 0)[0])

    def local_bytes(tree):
        total = 0
        for x in hpfunc.tree.leaves(tree):
            if isinstance(x, torch.Tensor) and x.ndim > 0:
                loc = x.to_local() if isinstance(x, DTensor) else x
                total += loc.numel() * loc.element_size()
        return total

    psi = sum(math.prod(s) for s in hpfunc.tree.leaves(qwen3.param_shapes(cfg), is_leaf=lambda x: isinstance(x, torch.Size)))
    return {"psi": psi, "params": local_bytes(params), "grads": local_bytes(grads), "opt": local_bytes(state),
            "n": mesh.size}


def run_bad_input(case: str) -> str:
    """Trigger one bad input; return the error message (and check nothing was communicated)."""
    import hpfunc
    from hpfunc import P, layout, optim
    from hpfunc.models import qwen3
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = config("qwen3-dense-tiny")
    tp = tp_of(cfg)
    mesh = hpfunc.Mesh({"fsdp": 2})
    plan = plans.fsdp("fsdp")
    shapes = qwen3.param_shapes(cfg)
    tree = shapes
    batch = {"tokens": torch.zeros(4, 8, dtype=torch.long)}
    if case == "unknown_path":
        plan = plan.with_rules([("layers.*.attn.wqq", plans.LeafSpec(P("fsdp"), P()))])
    elif case == "unknown_axis":
        plan = plans.fsdp("fdsp")
    elif case == "unknown_axis_in_rule":
        plan = plan.with_rules([("embed", P("tp"))])
    elif case == "not_divisible":
        tree = {"w": torch.Size([3, 4])}
        plan = plan.with_rules([("w", plans.LeafSpec(P("fsdp"), P()))])
    elif case == "tp_heads":
        cfg = config("qwen3-dense-tiny", num_key_value_heads=1)
        tree = qwen3.param_shapes(cfg)
        mesh, plan = hpfunc.Mesh({"tp": 2}), tp_of(cfg)("tp")
    elif case == "batch":
        batch = {"tokens": torch.zeros(3, 8, dtype=torch.long)}
    elif case == "compute_not_prefix":
        plan = plan.with_rules([("embed", plans.LeafSpec(P("fsdp"), P(None, "fsdp")))])
    elif case in ("sp_sequence", "sp_sequence_plan", "sp_sequence_model"):  # 7 tokens do not split over tp = 2
        mesh, plan = hpfunc.Mesh({"tp": 2}), tp("tp", sequence_parallel=True)
        batch = {"tokens": torch.zeros(4, 7, dtype=torch.long)}
    elif case == "two_tp_layers":
        mesh, plan = hpfunc.Mesh({"tp": 2}), tp("tp") + tp("tp", sequence_parallel=True)
    elif case == "style_pattern":
        mesh = hpfunc.Mesh({"tp": 2})
        plan = plans.tp("tp", {"layers.*.attn.wq": plans.ColwiseParallel(),
                               "layers.*.atn.wo": plans.RowwiseParallel()})
    elif case == "style_rank":
        mesh = hpfunc.Mesh({"tp": 2})
        plan = plans.tp("tp", {"layers.*.attn.wq": plans.ColwiseParallel(), "embed": plans.VocabParallel(),
                               "final_norm": plans.VocabParallel()})
    with hpfunc.comm_stats() as stats:
        try:
            step = parallel_train_step(model_loss(cfg, plan), optim.adamw(LR), mesh, plan)  # checks the mesh
            if case == "sp_sequence_plan":
                plan.check_batch(batch, mesh)
            elif case == "sp_sequence_model":  # the model checks too, when called without a step
                with mesh, layout.tensor_parallel("tp", sequence_parallel=True):
                    qwen3.parallel_plan.loss(qwen3.init(hpfunc.random.key(0), cfg), batch, cfg)
            elif case in ("batch", "sp_sequence"):
                params = step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
                state = step.init_opt_state(params)
                stats.records.clear()
                step(params, state, batch)
            else:
                plan.resolve(tree, mesh)
        except ValueError as e:
            assert not stats.records, stats.table()
            return str(e)
    raise AssertionError(f"{case}: no error")


class Spy:
    """Wraps the step's lazy parameter view and calls ``on_read(tensor)`` for every parameter the model reads."""

    def __init__(self, inner, on_read):
        self._inner, self._on_read = inner, on_read

    def _wrap(self, v):
        from collections.abc import Mapping, Sequence

        if isinstance(v, torch.Tensor):
            self._on_read(v)
            return v
        if isinstance(v, (Mapping, Sequence)) and not isinstance(v, str):
            return Spy(v, self._on_read)
        return v

    def __getitem__(self, k):
        return self._wrap(self._inner[k])

    def get(self, k, default=None):
        return self._wrap(self._inner[k]) if k in self._inner else default

    def __contains__(self, k):
        return k in self._inner

    def __iter__(self):
        if hasattr(self._inner, "keys"):
            return iter(self._inner)
        return (self[i] for i in range(len(self._inner)))

    def __len__(self):
        return len(self._inner)


def run_alive_after_forward(name: str) -> dict:
    """Bytes of gathered (full) parameters still alive when the forward has returned, i.e. held for the
    backward: what reshard_after_forward saves."""
    import gc

    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.transforms.parallelize import parallel_train_step

    cfg = config("qwen3-dense-tiny", tie_word_embeddings=False)
    mesh, plan = make(name, cfg)
    seen = {}

    def loss_fn(p, b):
        import weakref

        refs = []

        def on_read(v):  # the storage owner: autograd may save a view (w.t()) that keeps it, not the view read
            root = v._base if v._base is not None else v
            refs.append((weakref.ref(root), v.numel() * v.element_size()))

        out = qwen3.parallel_plan.loss(Spy(p, on_read), b, cfg)[0]
        gc.collect()
        seen["read"] = sum(n for _, n in refs)
        seen["alive"] = sum(n for r, n in refs if r() is not None)
        return out

    step = parallel_train_step(loss_fn, optim.adamw(LR), mesh, plan)
    params = step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
    step(params, step.init_opt_state(params), batches(cfg, 1, 4, 6, 0)[0])
    shapes = qwen3.param_shapes(cfg)
    seen["psi_bytes"] = 4 * sum(s.numel() for s in hpfunc.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, torch.Size)))
    seen["embed_bytes"] = 4 * shapes["embed"].numel()
    return seen
