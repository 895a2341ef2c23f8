"""The dry run: the trainer's real parallelized step of a config, for one rank of a large world, on
fake tensors and the fake process group, in one CPU process, allocating nothing.

:func:`dry_run` builds what ``hpfunc train`` builds for the config (model, plan with bf16 compute over
the stored dtype when ``model.dtype`` is bfloat16, the trainer's optimizer and schedule,
``make_train_step`` under :func:`hpfunc.parallelize`), as rank ``rank`` of ``world`` on fake
``device`` devices (:func:`hpfunc.testing.fake_devices.run_on_fake_devices`; ``cuda`` works on a
CPU-only torch through the shape-only runtime of :mod:`hpfunc.testing.fake_cuda`, in a fresh process),
runs one step and measures, for that rank:

* ``state_bytes``: the local shards of the state at rest (``params``, ``optimizer``: the optimizer
  state's tensors, its step counters included) and ``grads``: the gradients the optimizer receives in
  the step (their local shards, recorded by wrapping the optimizer's ``update``);
* ``step_peak_bytes``: the most bytes held at once by the storages the step itself creates
  (activations kept for backward, gathered parameters, gradients, temporaries, the new state before
  the old one is dropped), measured on storage liveness (weak references to fake storages, as
  :mod:`hpfunc.memory`), with the producing ops of what is alive at that moment (``peak_by_op``); the
  state at rest comes on top (``peak_bytes``);
* ``comm``: every collective of :mod:`hpfunc.lax` the step issues (:func:`hpfunc.comm_stats`), per
  collective, mesh axes and phase, bytes this rank sends under the ring formulas;
* ``flops``: torch's FLOP counter (:class:`torch.utils.flop_counter.FlopCounterMode`; attention
  counted unhalved as torch does, grouped GEMMs with torch's matmul convention);
* ``host_syncs``: the reads of device values the step makes (answered with a stand-in: a fake tensor
  has no value).

Beside them it reports the cost model's figures for the same layout (:mod:`hpfunc.autoparallel`:
model-state terms, communication, FLOPs and the step-time estimate on a hardware preset) and the
list of what neither models (:data:`~hpfunc.autoparallel.memory_model.UNMODELLED`).

Assumptions: MoE routing is data-dependent; on fake tensors the router's choices have no values, so
the dispatch runs on the padded dispatcher's buffers, once per routing assumption of
:func:`moe_cases` asked for (``moe``: the capacity worst case of the config's dispatcher by default,
forced-balanced, or both), each reported (``moe_cases``). The step makes no host sync (the learning
rate and step counter stay on the device); a read a plan makes is answered with a stand-in (1) and
counted. The step is the trainer's own (``precision:`` and ``activations:`` applied, the state in
``model.dtype``: :func:`hpfunc.train.distributed.parallel_train_step`). On fake tensors the state's
blocks are filled, not sampled (:func:`_blocks_like`). :func:`measure_step` runs the same step on real
tensors and a real process group (the cost model's check against real runs).

    >>> from hpfunc.autoparallel.dryrun import check_request
    >>> check_request({"model": {"preset": "qwen3-moe-tiny"}, "parallel": {"mesh": {"fsdp": 4}, "plan": ["fsdp"]}},
    ...               world=6)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.autoparallel.dryrun.DryRunError: parallel.mesh: the mesh {'fsdp': 4} has 4 ranks, --world is 6; ...
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Iterator, Mapping, Sequence

from hpfunc.autoparallel.memory_model import UNMODELLED

__all__ = ["DryRunError", "check_request", "dry_run", "dry_runs", "rank_step", "rank_steps", "measure_step", "positions",
           "moe_cases", "MOE_CHOICES", "DEFAULT_MOE", "DEFAULT_RESERVE",
           "PeakTracker", "format_report"]


DEFAULT_RESERVE = 4 * 2**30  # added to the measured peak for what neither measures (UNMODELLED)
MOE_CHOICES = {"both": ("forced_balanced", "capacity_worst_case"), "balanced": ("forced_balanced",),
               "worst": ("capacity_worst_case",)}
# one step, the case that decides whether a config fits (the report's main figures); ``both`` runs two
DEFAULT_MOE = "worst"


class DryRunError(ValueError):
    """A dry-run request the config cannot honour (the message names the config key or flag)."""


def _mesh_size(mesh: Mapping[str, int]) -> int:
    n = 1
    for v in mesh.values():
        n *= int(v)
    return n


def check_request(raw: Mapping[str, Any], *, world: int | None = None, rank: int = 0, device: str = "cuda",
                  hardware: str = "h100", moe: str = DEFAULT_MOE) -> tuple[Any, int]:
    """Check a dry-run request before any process or group starts: the config (the trainer's loader
    and plan check), the world the mesh fills, the rank, the device and the hardware name. Returns
    ``(config, world)``; raises :class:`DryRunError` naming the key otherwise."""
    from hpfunc.autoparallel.hardware import HardwareError
    from hpfunc.autoparallel.hardware import hardware as _hardware
    from hpfunc.train.config import ConfigError, load_config_dict

    try:
        _hardware(hardware)
    except HardwareError as err:
        raise DryRunError(f"--hardware: {err}") from None
    if device not in ("cuda", "cpu"):
        raise DryRunError(f"--device: expected cuda or cpu, found {device!r}")
    if moe not in MOE_CHOICES:
        raise DryRunError(f"--moe: expected one of {', '.join(MOE_CHOICES)}, found {moe!r}")
    try:
        cfg = load_config_dict(dict(raw))
    except (ConfigError, ValueError) as err:
        raise DryRunError(str(err)) from None
    mesh = dict(cfg.parallel.mesh or {})
    size = _mesh_size(mesh)
    if world is None:
        world = size
    if world < 1:
        raise DryRunError(f"--world: expected an integer >= 1, found {world}")
    if size != world:
        others = size // max(1, mesh.get("fsdp", 1))
        hint = (f"--set parallel.mesh.fsdp={world // others} or " if "fsdp" in mesh and world % others == 0 else "")
        raise DryRunError(f"parallel.mesh: the mesh {mesh} has {size} ranks, --world is {world}; the mesh must fill "
                          f"the world exactly: change its axes ({hint}--set 'parallel.mesh={{...}}') or pass --world {size}")
    if not 0 <= rank < world:
        raise DryRunError(f"--rank: expected a rank in [0, {world}), found {rank}")
    bs = cfg.train.batch_size
    data = 1
    for e in cfg.parallel.plan:
        if e.kind in ("ddp", "fsdp", "zero1", "zero2", "zero3", "hsdp", "ep"):
            for a in e.axes:
                data *= mesh[a]
    if data > 1 and bs % data:
        raise DryRunError(f"train.batch_size: {bs} sequences do not split over the {data} data ranks of "
                          f"parallel.mesh {mesh}; use a multiple of {data}")
    try:
        from hpfunc.train.build import check_buildable

        check_buildable(cfg)
    except (ConfigError, ValueError) as err:
        raise DryRunError(str(err)) from None
    return cfg, world


def positions(mesh: Mapping[str, int]) -> list[int]:
    """One rank of every distinct position of ``mesh`` (axes in order, the last varying fastest): every
    coordinate of ``pp`` (each stage holds other layers) and the first and last coordinate of every
    other axis (uneven dimensions shard like ``torch.chunk``: the first blocks are the larger, the last
    the smaller; the ranks in between equal one of them).

    >>> positions({"fsdp": 8, "ep": 8}), positions({"pp": 2, "fsdp": 4})
    ([0, 7, 56, 63], [0, 3, 4, 7])
    """
    import itertools

    names = list(mesh)
    choices = [range(mesh[a]) if a == "pp" else sorted({0, mesh[a] - 1}) for a in names]
    out = []
    for coord in itertools.product(*choices):
        r = 0
        for a, c in zip(names, coord):
            r = r * mesh[a] + c
        out.append(r)
    return out


class PeakTracker:
    """A dispatch mode that logs every storage an op creates (weakly) and keeps the most bytes those
    storages held alive at once, with the producing ops of what was alive then.

    A running total adds each new storage; it only overestimates (freed storages stay in it until the
    next sweep), so the exact live total is swept (weak references checked) only when the running
    total passes the peak: the peak is exact, and cheap to keep.

    >>> import torch
    >>> t = PeakTracker()
    >>> with t:
    ...     a = torch.ones(256)          # 1 KiB
    ...     b = a * 2                    # 1 KiB more: peak 2 KiB
    ...     del a, b
    ...     c = torch.ones(128)          # 512 B
    >>> t.peak, t.live()
    (2048, 512)
    """

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from hpfunc.memory._storage import StorageLog

        self.log = StorageLog()
        self.peak = 0
        self.peak_by_op: dict[str, int] = {}
        self._running = 0
        aten = torch.ops.aten
        self._resizes = frozenset({aten.resize_.default, aten.set_.source_Storage,
                                   aten.set_.source_Storage_storage_offset})
        self._mode = _ProducerWithPeak(self)
        assert isinstance(self._mode, TorchDispatchMode)

    def __enter__(self) -> "PeakTracker":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def live(self) -> int:
        return sum(n for _, n, *_ in self.log.alive())

    def _sweep(self) -> None:
        alive = self.log.alive()
        total = sum(n for _, n, *_ in alive)
        self._running = total
        if total > self.peak:
            self.peak = total
            by: collections.Counter = collections.Counter()
            for _, n, op, *_ in alive:
                by[(op or "?").replace("aten.", "")] += n
            self.peak_by_op = dict(by.most_common())

    def added(self, nbytes: int, resized: bool) -> None:
        self._running += nbytes
        if resized or self._running > self.peak:
            self._sweep()

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Log the storages ``func(*args, **kwargs)`` created (``out``'s that are not among the inputs')."""
        from hpfunc.memory._storage import _FRESH, storage_key, storage_nbytes, tensors_in

        outs = tensors_in(out)
        new = 0
        if outs:
            inputs = set() if func in _FRESH else {storage_key(t) for t in tensors_in((args, kwargs))}
            for t in outs:
                if storage_key(t) not in inputs and self.log.add(t, func):
                    new += storage_nbytes(t)
        resized = func in self._resizes
        if new or resized:
            self.added(new, resized)


def _producer_with_peak_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __init__(self, tracker: PeakTracker) -> None:
            super().__init__()
            self.tracker = tracker

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.tracker.observe(func, args, kwargs, out)
            return out

    return _Mode


def _ProducerWithPeak(tracker: PeakTracker) -> Any:  # noqa: N802 -- a class made on first use (torch imported late)
    return _producer_with_peak_class()(tracker)


def _step_probe_class() -> type:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpfunc.testing.fake_devices import NO_SYNC, device_of

    class _StepProbe(TorchDispatchMode):
        """One dispatch mode for what a measured fake step records per op (instead of four stacked: each
        mode costs every op a Python frame): the host syncs answered (a :class:`DeviceRecorder`'s checks,
        not entered), the storages for the peak (a :class:`PeakTracker`, not entered) and the FLOPs (a
        ``FlopCounterMode``'s formulas and counts, not entered: ops without a formula are decomposed
        first, as it does)."""

        def __init__(self, rec: Any, tracker: PeakTracker, flops: Any) -> None:
            super().__init__()
            self.rec, self.tracker, self.flops = rec, tracker, flops
            self.registry = flops.flop_registry
            self._decomposable: dict[Any, bool] = {}
            self.prim_device = torch.ops.prim.device.default

        def _decompose(self, func: Any) -> bool:
            hit = self._decomposable.get(func)
            if hit is None:
                hit = self._decomposable[func] = (func._overloadpacket not in self.registry
                                                  and func is not self.prim_device and func._can_decompose())
            return hit

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is self.prim_device:  # half the ops the step dispatches (autograd asks every input's device)
                return device_of(args)
            kwargs = kwargs or {}
            if self.rec.may_sync(func):
                answer = self.rec.host_sync(func, args, kwargs)
                if answer is not NO_SYNC:
                    return answer
            if self._decompose(func):
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            out = func(*args, **kwargs)
            packet = func._overloadpacket
            if packet in self.registry:
                self.flops.flop_counts["Global"][packet] += self.registry[packet](*args, **kwargs, out_val=out)
            self.tracker.observe(func, args, kwargs, out)
            return out

    return _StepProbe


def _flash_attention_mode() -> Any:
    """A function mode that runs ``F.scaled_dot_product_attention`` (no mask, no dropout, on a cuda
    tensor) as the CUDA flash-attention op: on a CPU-only torch the fake CUDA device has no kernel
    choice, so torch would take its math path (scores and fp32 probabilities materialised, ``s^2`` per
    head) where a GPU with bf16 inputs runs flash attention (output and log-sum-exp kept)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    flash = torch.ops.aten._scaled_dot_product_flash_attention.default

    class _Flash(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                q, k, v = args[:3]
                mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
                dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
                causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
                if mask is None and not dropout and q.device.type == "cuda" and q.dtype in (torch.bfloat16,
                                                                                            torch.float16):
                    return flash(q, k, v, 0.0, bool(causal), False, scale=kwargs.get("scale"))[0]
            return func(*args, **kwargs)

    return _Flash()


def _local_bytes(tree_: Any) -> dict[str, int]:
    """Bytes of the local shards of a pytree's tensors, by dtype."""
    import torch

    from hpfunc import tree
    from hpfunc.memory._storage import local

    out: collections.Counter = collections.Counter()
    for x in tree.leaves(tree_):
        if isinstance(x, torch.Tensor):
            t = local(x)
            out[str(t.dtype).replace("torch.", "")] += t.numel() * t.element_size()
    return dict(out)


def _grouped_mm_flops(a, b, *args, out_shape=None, **kw) -> int:
    # torch's matmul convention (2 m k n) summed over the groups: a 2-D x 3-D grouped GEMM multiplies
    # every row of a with one group's matrix
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # the weight gradient: (k, m) x (m, n) split into groups along m
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[-1]


def _sdpa_cpu_flops(q, k, v, *args, out_shape=None, **kw) -> int:
    b, h, s, d = q
    return 4 * b * h * s * k[2] * d


def _sdpa_cpu_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kw) -> int:
    return 2 * _sdpa_cpu_flops(q, k, v)


def _flop_mapping() -> dict:
    import torch

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
            aten._grouped_mm: _grouped_mm_flops}


def _blocks_like(init: Any, key: Any, *, shardings: Any) -> Any:
    """What ``init(key, shardings=shardings)`` makes (each leaf's shape, dtype and sharding), filled with
    zeros instead of sampled: on fake tensors the values do not exist, and sampling a counter-based
    normal runs ~30 elementwise ops per leaf through the fake mode (most of the 48-layer x 128-expert
    Qwen3 state's 73 s). The dtypes come from ``init`` on the meta device (no work)."""
    from hpfunc import tree
    from hpfunc.sharding import NamedSharding, full

    meta = init(key, device="meta")
    by_path = dict(tree.leaves_with_paths(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)))

    def make(path: str, m: Any) -> Any:
        if path not in by_path:
            return None  # a leaf this (pipeline) rank does not hold
        return full(tuple(m.shape), 0.0, dtype=m.dtype, sharding=by_path[path])

    return tree.map_with_path(make, meta)


def _build(raw: Mapping[str, Any], device_type: str, say: Any, *, fake: bool = False) -> dict:
    """What ``hpfunc train`` builds for ``raw`` on this process's (fake or real) world: the mesh, the
    parallel step (:func:`hpfunc.train.distributed.parallel_train_step`, the trainer's own: its plan with
    ``precision:`` applied, its loss with the ``activations:`` policies), the first sharded state in
    ``model.dtype``, one batch and the list the optimizer records its gradients' bytes into."""
    import functools
    import itertools

    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    from hpfunc import random
    from hpfunc.mesh import Mesh
    from hpfunc.train.build import build_optimizer, build_schedule, check_buildable, model_dtype
    from hpfunc.train.config import load_config_dict
    from hpfunc.train.distributed import parallel_train_step
    from hpfunc.train.model_spec import model_spec
    from hpfunc.train.step import init_train_state
    from hpfunc.transforms.parallelize import init_sharded

    cfg = load_config_dict(dict(raw))
    spec = model_spec(cfg.model)
    mesh_axes = dict(cfg.parallel.mesh)
    with _disable_current_modes():  # a DeviceMesh is made of real rank tensors, and so are its groups
        mesh = Mesh(mesh_axes, device_type=device_type)
        names = list(mesh_axes)
        for r in range(2, len(names) + 1):
            for axes in itertools.combinations(names, r):
                mesh.group(axes)
        coordinate = tuple(int(c) for c in mesh.coordinate())
    say(f"mesh {mesh_axes}, rank {dist.get_rank()} at {dict(zip(names, coordinate))}")
    model_cfg = check_buildable(cfg)
    if cfg.train.aux_loss_coef is not None and spec.with_aux_loss_coef is not None:  # as the trainer's loop
        model_cfg = spec.with_aux_loss_coef(model_cfg, cfg.train.aux_loss_coef)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps), spec)
    grads_seen: list[dict[str, int]] = []
    optimizer = _recording_grads(optimizer, grads_seen)

    def step_of(mcfg: Any) -> Any:
        return parallel_train_step(cfg, mcfg, optimizer, lr, mesh, compiled=False)[0]

    train_step, plan = parallel_train_step(cfg, model_cfg, optimizer, lr, mesh, compiled=False)
    key = random.key(0, device=device_type)
    init = functools.partial(spec.init, cfg=model_cfg, dtype=model_dtype(cfg.model))
    if fake:  # a fake tensor has no values: fill the blocks instead of sampling them (see _blocks_like)
        init = functools.partial(_blocks_like, init)
    say("initialising the sharded state")
    params = init_sharded(init, mesh, plan, key, shapes=spec.param_shapes(model_cfg))
    state = train_step.init_state(lambda p: init_train_state(p, optimizer), params)
    tokens = random.randint(random.fold_in(key, 100), (cfg.train.batch_size, cfg.train.seq_len + 1), 0,
                            spec.vocab_size(model_cfg))
    return {"cfg": cfg, "model_cfg": model_cfg, "coordinate": dict(zip(names, coordinate)), "train_step": train_step,
            "step_of": step_of, "state": state, "batch": {"tokens": tokens}, "grads_seen": grads_seen}


def _sayer(progress: bool | str) -> Any:
    import sys

    t_start, c_start = time.perf_counter(), time.process_time()

    def say(msg: str) -> None:
        line = f"[dryrun {time.perf_counter() - t_start:6.1f} s, cpu {time.process_time() - c_start:6.1f} s] {msg}"
        if isinstance(progress, str):
            with open(progress, "a") as f:
                f.write(line + "\n")
        elif progress:
            print(line, file=sys.stderr, flush=True)

    return say


def rank_step(raw: Mapping[str, Any], device_type: str = "cuda", progress: bool | str = False,
              moe: str = DEFAULT_MOE) -> dict:
    """Build the trainer's parallel step for ``raw`` and run one step as this process's rank of the
    fake world (call it through :func:`hpfunc.testing.fake_devices.run_on_fake_devices`); returns the
    measurements (see the module). ``progress``: print each phase to stderr (``True``) or append it to
    the file of that name (an isolated process's output is not shown). ``moe``: the routing
    assumptions an MoE model's step is run under (:data:`MOE_CHOICES`, :func:`moe_cases`), one step each."""
    import os

    import torch.distributed as dist

    os.environ.pop("HPFUNC_CHECK_REP", None)  # the replication check reads values: fake tensors have none
    say = _sayer(progress)
    b = _build(raw, device_type, say, fake=True)
    cfg, state, train_step, grads_seen = b["cfg"], b["state"], b["train_step"], b["grads_seen"]
    state_bytes = {"params": _local_bytes(state.params), "optimizer": _local_bytes(state.opt_state)}
    say(f"running one step: batch {cfg.train.batch_size} x {cfg.train.seq_len}, "
        f"{cfg.train.microbatches} microbatch(es)")
    import attrs

    mc = b["model_cfg"]
    ep = _ep_size(cfg)
    cases = moe_cases(mc, ep)
    # without expert parallelism the dropless path's shapes do not depend on the routing (every rank
    # computes its T k rows): the config's own step measures both cases
    own = not cases or (ep == 1 and mc.moe_dispatcher != "padded")
    if not own:
        cases = {k: v for k, v in cases.items() if k in MOE_CHOICES[moe]}
    runs: dict[float, dict] = {}
    measured_cases: dict[str, dict] = {}
    for name, factor in cases.items():  # MoE: each routing assumption on the padded dispatcher's shapes
        if factor not in runs:
            if own:
                runs[factor] = _measure_fake_step(train_step, state, b["batch"], device_type)
            else:
                say(f"MoE {name}: the padded dispatcher with buffers of {factor:g} x the balanced rows")
                mcfg = attrs.evolve(mc, moe_dispatcher="padded", moe_capacity_factor=None, moe_dispatch_chunks=1,
                                    moe_buffer_factor=factor)
                runs[factor] = _measure_fake_step(b["step_of"](mcfg), state, b["batch"], device_type)
        case = runs[factor]
        measured_cases[name] = {"moe_buffer_factor": factor, "step_peak_bytes": case["tracker"].peak,
                                "flops": int(case["flops"].get_total_flops()),
                                "comm": case["stats"].by_collective(), "step_seconds_on_fake_tensors": case["seconds"]}
    main = (runs[cases.get("capacity_worst_case", cases.get("forced_balanced"))] if cases
            else _measure_fake_step(train_step, state, b["batch"], device_type))
    del grads_seen[:-max(1, len(grads_seen) // max(1, len(runs)))]  # the gradients of one step
    rec, tracker, flops, stats, step_s = main["rec"], main["tracker"], main["flops"], main["stats"], main["seconds"]
    say(f"step done in {step_s:.1f} s")
    comm = stats.by_collective()
    by_op = {str(op).replace("aten.", ""): int(n) for op, n in flops.get_flop_counts().get("Global", {}).items()}
    grads: collections.Counter = collections.Counter()
    for g in grads_seen:
        grads.update(g)
    state_bytes["grads"] = dict(grads)
    return {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "coordinate": b["coordinate"],
        "state_bytes": state_bytes,
        "step_peak_bytes": tracker.peak, "peak_by_op": dict(list(tracker.peak_by_op.items())[:10]),
        "comm": comm, "moe_cases": measured_cases,
        "flops": int(flops.get_total_flops()), "flops_by_op": by_op,
        "host_syncs": [f"{s.kind}: aten.{s.op} at {s.where}" for s in rec.host_syncs],
        "step_seconds_on_fake_tensors": step_s, "microbatches_seen": len(grads_seen),
        "attention": ("flash (16-bit cuda inputs without mask run as aten._scaled_dot_product_flash_attention)"
                      if device_type == "cuda" else "as torch chooses on cpu"),
    }




def moe_cases(model_cfg: Any, ep: int) -> dict[str, float]:
    """The routing assumptions a dry run measures for an MoE model (none for a dense one), as the
    padded dispatcher's buffer factor (rows per destination over the balanced count) that gives their
    shapes: ``forced_balanced`` (1: every rank receives exactly its share, as the published MoE
    throughputs assume) and ``capacity_worst_case``: the most the config's dispatcher can hold, its own
    ``moe_buffer_factor`` for the padded one, the capacity factor for a capped all-to-all, and ``ep``
    for the dropless one (every pair of every source sent to one rank)."""
    if not getattr(model_cfg, "num_experts", 0):
        return {}
    if model_cfg.moe_dispatcher == "padded":
        worst = float(model_cfg.moe_buffer_factor)
    elif model_cfg.moe_capacity_factor is not None:
        worst = float(model_cfg.moe_capacity_factor)
    else:
        worst = float(max(1, ep))
    return {"forced_balanced": 1.0, "capacity_worst_case": max(1.0, worst)}


def _ep_size(cfg: Any) -> int:
    n = 1
    for e in cfg.parallel.plan:
        if e.kind == "ep":
            for a in e.axes:
                n *= cfg.parallel.mesh[a]
    return n


def _measure_fake_step(train_step: Any, state: Any, batch: Any, device_type: str) -> dict:
    """One step on fake tensors under the FLOP counter, the comm counter, the host-sync recorder and
    the peak tracker."""
    from torch.utils.flop_counter import FlopCounterMode

    from hpfunc.comm import comm_stats
    from hpfunc.testing.fake_devices import DeviceRecorder, answer_host_syncs

    rec = DeviceRecorder(device_type, on_host_sync=answer_host_syncs(1))  # its checks only (not entered)
    tracker = PeakTracker()
    flops = FlopCounterMode(display=False, custom_mapping=_flop_mapping())  # its formulas and counts (not entered)
    attention = _flash_attention_mode() if device_type == "cuda" else contextlib.nullcontext()
    t0 = time.perf_counter()
    with comm_stats() as stats, _step_probe_class()(rec, tracker, flops), attention:
        new_state, metrics = train_step(state, batch)
        del new_state, metrics
    return {"rec": rec, "tracker": tracker, "flops": flops, "stats": stats, "seconds": time.perf_counter() - t0}


def measure_step(raw: Mapping[str, Any], *, timed_steps: int = 3) -> dict:
    """The trainer's step of ``raw`` on this process's **real** process group (every rank calls it, e.g.
    through :meth:`hpfunc.testing.RankPool.run`), measured: the first step under :class:`PeakTracker`
    (storage liveness on real storages: ``step_peak_bytes``; ``peak_bytes`` adds the state at rest, the
    local shards of the parameters and optimizer state), then ``timed_steps`` more steps timed without
    the tracker (``step_seconds``: each, wall clock; the first one is the warm-up and is not among them).

    The step is the one :func:`rank_step` runs on fake tensors, on the CPU with real values.
    """
    import torch.distributed as dist

    say = _sayer(False)
    b = _build(raw, "cpu", say)
    state, train_step = b["state"], b["train_step"]
    at_rest = sum(_local_bytes(state.params).values()) + sum(_local_bytes(state.opt_state).values())
    tracker = PeakTracker()
    with tracker:
        state, metrics = train_step(state, b["batch"])
    loss = float(metrics["loss"])
    del metrics
    seconds = []
    for _ in range(timed_steps):
        dist.barrier()
        t0 = time.perf_counter()
        state, metrics = train_step(state, b["batch"])
        float(metrics["loss"])
        seconds.append(time.perf_counter() - t0)
    return {"rank": dist.get_rank(), "coordinate": b["coordinate"], "at_rest_bytes": at_rest,
            "step_peak_bytes": tracker.peak, "peak_bytes": at_rest + tracker.peak,
            "peak_by_op": dict(list(tracker.peak_by_op.items())[:8]), "loss": loss, "step_seconds": seconds}


def _recording_grads(tx: Any, sink: list) -> Any:
    """``tx`` whose ``update`` (and fused ``apply``) first records the local bytes of the gradients."""

    def update(updates, state, params=None):
        sink.append(_local_bytes(updates))
        return tx.update(updates, state, params)

    inner_apply = getattr(tx.update, "apply", None)
    if inner_apply is not None:
        def apply(updates, state, params, *, donate=False):
            sink.append(_local_bytes(updates))
            return inner_apply(updates, state, params, donate=donate)

        update.apply = apply  # type: ignore[attr-defined]
    return tx._replace(update=update)


@contextlib.contextmanager
def _progress_file(wanted: bool) -> Iterator[str | None]:
    """A file the isolated process appends its progress to, echoed to stderr by a thread here."""
    if not wanted:
        yield None
        return
    import os
    import sys
    import tempfile
    import threading

    fd, path = tempfile.mkstemp(prefix="hpfunc-dryrun-", suffix=".log")
    os.close(fd)
    stop = threading.Event()

    def echo() -> None:
        with open(path) as f:
            while True:
                line = f.readline()
                if line:
                    print(line, end="", file=sys.stderr, flush=True)
                elif stop.wait(0.5):
                    print(f.read(), end="", file=sys.stderr, flush=True)
                    return

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()
        os.unlink(path)


def dry_run(raw: Mapping[str, Any], *, world: int | None = None, rank: int = 0, device: str = "cuda",
            hardware: Any = "h100", progress: bool = False, reserve_bytes: int = DEFAULT_RESERVE,
            moe: str = DEFAULT_MOE) -> dict:
    """The dry-run report of the raw config mapping ``raw`` for ``rank`` of ``world`` (default: the
    mesh's size): the measurements of :func:`rank_step` and the cost model's figures for the same
    layout (keys: docs/autoparallel.md#hpfunc-dryrun). ``device="cuda"`` runs in a fresh process
    (the fake CUDA runtime is loaded before torch there); ``cpu`` in this one, which must have no
    default process group. ``moe``: an MoE model's routing assumptions, one step each: ``worst`` (the
    default: the capacity worst case), ``balanced`` (forced-balanced) or ``both``."""
    return dry_runs([raw], world=world, rank=rank, device=device, hardware=hardware, progress=progress,
                    reserve_bytes=reserve_bytes, moe=moe)[0]


def dry_runs(raws: Sequence[Mapping[str, Any]], *, world: int | None = None, rank: int = 0, device: str = "cuda",
             hardware: Any = "h100", progress: bool = False, reserve_bytes: int = DEFAULT_RESERVE,
             moe: str = DEFAULT_MOE) -> list[dict]:
    """:func:`dry_run` of several configs of one world size, one after the other in one (fresh) process."""
    import sys

    from hpfunc.testing import fake_cuda
    from hpfunc.testing.fake_devices import run_on_fake_devices

    checked = [check_request(raw, world=world, rank=rank, device=device, hardware=hardware, moe=moe) for raw in raws]
    worlds = {w for _, w in checked}
    if len(worlds) != 1:
        raise DryRunError(f"parallel.mesh: dry_runs needs configs of one world size, found sizes {sorted(worlds)}")
    world = worlds.pop()
    t0 = time.perf_counter()
    isolated = fake_cuda.needed(device)
    if progress:
        print(f"[dryrun] rank {rank} of {world} on fake {device} devices"
              + (" (in a fresh process: the fake CUDA runtime)" if isolated else ""), file=sys.stderr, flush=True)
    with _progress_file(progress and isolated) as path:
        run = run_on_fake_devices(rank_steps, [dict(r) for r in raws], device, path or progress, moe, world_size=world,
                                  rank=rank, device_type=device, isolated=isolated)
    seconds = (time.perf_counter() - t0) / len(raws)
    return [_assemble(cfg, measured, world=world, rank=rank, device=device, hardware=hardware, seconds=seconds,
                      reserve_bytes=reserve_bytes)
            for (cfg, _), measured in zip(checked, run.result)]


def rank_steps(raws: Sequence[Mapping[str, Any]], device_type: str = "cuda", progress: bool | str = False,
               moe: str = DEFAULT_MOE) -> list:
    """:func:`rank_step` of each config, in order, in this fake world."""
    return [rank_step(raw, device_type, progress, moe) for raw in raws]


def _assemble(cfg: Any, measured: dict, *, world: int, rank: int, device: str, hardware: Any,
              seconds: float, reserve_bytes: int = 0) -> dict:
    import attrs

    from hpfunc.autoparallel.comm_model import communication
    from hpfunc.autoparallel.flops import train_flops_per_token
    from hpfunc.autoparallel.hardware import hardware as _hardware
    from hpfunc.autoparallel.memory_model import memory
    from hpfunc.autoparallel.step_time import step_time
    from hpfunc.autoparallel.trainer_config import describe_model, layout_of, workload_of

    hw = _hardware(hardware)
    _, desc = describe_model(cfg)
    work = workload_of(cfg, reserve_bytes=reserve_bytes)
    report: dict[str, Any] = {"world": world, "rank": rank, "device": device, "hardware": hw.name,
                              "mesh": dict(cfg.parallel.mesh), "seconds": seconds, **measured}
    sb = measured["state_bytes"]
    report["state_total_bytes"] = {k: sum(v.values()) for k, v in sb.items()}
    at_rest = report["state_total_bytes"]["params"] + report["state_total_bytes"]["optimizer"]
    report["peak_bytes"] = at_rest + measured["step_peak_bytes"]
    report["reserve_bytes"] = int(reserve_bytes)
    report["peak_with_reserve_bytes"] = report["peak_bytes"] + int(reserve_bytes)
    seq = cfg.train.seq_len
    tokens_rank = None
    report["model"] = {"params": desc.params, "layers": desc.num_layers,
                       "train_flops_per_token": train_flops_per_token(desc, seq, causal=True),
                       "train_flops_per_token_unhalved": train_flops_per_token(desc, seq, causal=False)}
    estimate: dict[str, Any] = {"layout": None}
    try:
        lay = layout_of(cfg)
        tokens_rank = work.global_batch * work.seq_len / lay.data_shards
        mem = memory(desc, lay, work)
        t = step_time(desc, lay, work, hw)
        estimate = {
            "layout": lay.name, "memory_bytes": dict(mem.terms), "memory_total_bytes": mem.total,
            "comm": [{"collective": c.collective, "axes": c.axis, "group": c.group, "count": c.count,
                      "sent_bytes": c.bytes, "phase": c.phase} for c in communication(desc, lay, work)],
            "step_seconds": t.total, "time_seconds": dict(t.terms),
            "tokens_per_second_per_device": t.tokens_per_second_per_device,
            "rank_tokens": tokens_rank,
        }
        for name, case in measured.get("moe_cases", {}).items():  # the cost model under the same assumption
            w = attrs.evolve(work, moe_buffer_factor=case["moe_buffer_factor"])
            case["peak_bytes"] = at_rest + case["step_peak_bytes"]
            case["estimate_memory_total_bytes"] = memory(desc, lay, w).total
            case["estimate_step_seconds"] = step_time(desc, lay, w, hw).total
    except ValueError as err:  # a layout the cost model does not describe: the measurements stand alone
        estimate = {"layout": None, "error": str(err)}
    report["estimate"] = estimate
    report["unmodelled"] = list(UNMODELLED)
    return report


def format_report(r: Mapping[str, Any]) -> str:
    """The report as text (what ``hpfunc dryrun`` prints)."""
    from hpfunc.autoparallel.hardware import format_bytes

    sb = r["state_total_bytes"]
    lines = [f"dry run: rank {r['rank']} of {r['world']} at {r['coordinate']} on fake {r['device']} devices, "
             f"mesh {r['mesh']}; {r['seconds']:.1f} s (the step {r['step_seconds_on_fake_tensors']:.1f} s on fake "
             f"tensors)",
             f"model: {r['model']['params'] / 1e9:.3f} B parameters, {r['model']['layers']} layers",
             "measured on this rank (fake tensors, storage liveness, the comm counter, torch's FLOP counter):",
             f"  params     {format_bytes(sb['params']):>12}  {r['state_bytes']['params']}",
             f"  grads      {format_bytes(sb['grads']):>12}  {r['state_bytes']['grads']} "
             f"(summed over the {r['microbatches_seen']} optimizer call(s))",
             f"  optimizer  {format_bytes(sb['optimizer']):>12}  {r['state_bytes']['optimizer']}",
             f"  step peak  {format_bytes(r['step_peak_bytes']):>12}  (storages the step creates, alive at once; "
             f"on top of the state at rest)",
             f"  peak       {format_bytes(r['peak_bytes']):>12}  (params + optimizer state + step peak)",
             f"  + reserve  {format_bytes(r['peak_with_reserve_bytes']):>12}  (the peak + the reserve "
             f"{format_bytes(r['reserve_bytes'])} for what is not modelled: --reserve)",
             "  the step peak's composition (producing op): " + ", ".join(
                 f"{op} {format_bytes(n)}" for op, n in list(r["peak_by_op"].items())[:6]),
             f"  FLOPs      {r['flops'] / 1e12:.4f} TFLOP this step (torch's counter, attention unhalved)",
             "  communication this rank sends (ring formulas):"]
    for c in r["comm"]:
        lines.append(f"    {c['collective']:15} {c['axes'] or '-':10} n={c['group']:<4} {c['phase']:8} x{c['count']:<5} "
                     f"{format_bytes(c['sent_bytes']):>12}")
    for name, c in r.get("moe_cases", {}).items():
        a2a = sum(e["sent_bytes"] for e in c["comm"] if e["collective"] == "all_to_all")
        est = (f"; cost model {format_bytes(c['estimate_memory_total_bytes'])} with the reserve"
               if "estimate_memory_total_bytes" in c else "")
        lines.append(f"  MoE {name:20} (buffers {c['moe_buffer_factor']:g} x balanced): peak "
                     f"{format_bytes(c.get('peak_bytes', c['step_peak_bytes']))}, all-to-all {format_bytes(a2a)}, "
                     f"{c['flops'] / 1e12:.4f} TFLOP{est}")
    if r["host_syncs"]:
        lines.append(f"  host syncs answered with a stand-in: {len(r['host_syncs'])}")
    e = r["estimate"]
    if e.get("layout"):
        lines.append(f"cost model ({e['layout']}, {r['hardware']}): memory {format_bytes(e['memory_total_bytes'])} "
                     f"(" + ", ".join(f"{k} {format_bytes(v)}" for k, v in e["memory_bytes"].items()) + ")")
        lines.append(f"  step {e['step_seconds']:.3f} s, {e['tokens_per_second_per_device']:.0f} tokens/s/device "
                     "(" + ", ".join(f"{k} {v:.3f}" for k, v in e["time_seconds"].items()) + ")")
        lines.append(f"  FLOPs this rank: {r['model']['train_flops_per_token_unhalved'] * e['rank_tokens'] / 1e12:.4f} "
                     f"TFLOP unhalved, {r['model']['train_flops_per_token'] * e['rank_tokens'] / 1e12:.4f} with causal "
                     f"halving (tp and ep splits not applied)")
    else:
        lines.append(f"cost model: no estimate ({e.get('error')})")
    lines.append("not modelled (neither measured nor estimated): " + "; ".join(r["unmodelled"]))
    return "\n".join(lines)
