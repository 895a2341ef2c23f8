"""Rank-side helpers for test_parallel_compose.py: remat and offload of a layer, nested either way, inside
``hpfunc.parallelize``: gradients and updates against one device, and what stays alive after the forward
measured on storages (weak references), never on hpfunc's own records.

The model is a residual MLP stack (``layers.N.{norm, w_in, w_out}`` and a ``head``) whose layer is written
once for one device, with the tensor-parallel building blocks of :mod:`hpfunc.layout` (identities without an axis).

Liveness probe: a ``TorchDispatchMode`` notes every storage an op creates during the forward (weakly);
an identity autograd function on the loss runs first in the backward and counts, at that moment, the
storages still alive: kept for the backward. Each is classed as a *parameter* (the storage of a tensor the
model read from the step's parameter view: a gathered or cast parameter), a *host copy* (uint8: the
buffers ``offload`` copies into; the model itself makes no uint8 tensor) or an *activation*.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from _parallel_helpers import Spy

LR = 1e-3

# mesh axes -> plan, per name; the world size is the product of the axis sizes
PLANS = {
    "ddp2": ({"dp": 2}, lambda pl, tp: pl.ddp("dp")),
    "fsdp2": ({"fsdp": 2}, lambda pl, tp: pl.fsdp("fsdp")),
    "fsdp2_keep": ({"fsdp": 2}, lambda pl, tp: pl.fsdp("fsdp", reshard_after_forward=False)),
    "ddp4": ({"dp": 4}, lambda pl, tp: pl.ddp("dp")),
    "fsdp4": ({"fsdp": 4}, lambda pl, tp: pl.fsdp("fsdp")),
    "fsdp4_keep": ({"fsdp": 4}, lambda pl, tp: pl.fsdp("fsdp", reshard_after_forward=False)),
    "fsdp_tp": ({"fsdp": 2, "tp": 2}, lambda pl, tp: pl.fsdp("fsdp") + tp),
    "fsdp_keep_tp": ({"fsdp": 2, "tp": 2}, lambda pl, tp: pl.fsdp("fsdp", reshard_after_forward=False) + tp),
}

# what wraps each layer: (outer, inner) transforms with their policies
WRAPS = ["none", "remat_nothing", "remat_dots", "remat_names", "offload_everything", "offload_names",
         "offload_dots", "remat_of_offload", "offload_of_remat", "remat_swap"]


def world(name: str) -> int:
    n = 1
    for s in PLANS[name][0].values():
        n *= s
    return n


def wrap(kind: str):
    """The layer transform of ``kind`` (a function of the layer function)."""
    from hpfunc.transforms import offload as O
    from hpfunc.transforms import remat as R

    return {
        "none": lambda f: f,
        "remat_nothing": lambda f: R.remat(f, policy=R.nothing_saveable),
        "remat_dots": lambda f: R.remat(f, policy=R.dots_saveable),
        "remat_names": lambda f: R.remat(f, policy=R.save_only_these_names("hidden")),
        "offload_everything": lambda f: O.offload(f),
        "offload_names": lambda f: O.offload(f, policy=O.offload_only_these_names("hidden")),
        "offload_dots": lambda f: O.offload(f, policy=O.offload_dots()),
        "remat_of_offload": lambda f: R.remat(O.offload(f), policy=R.dots_saveable),
        "offload_of_remat": lambda f: O.offload(R.remat(f, policy=R.nothing_saveable)),
        "remat_swap": lambda f: R.remat(f, policy=R.save_and_offload_only_these_names(
            names_which_can_be_offloaded=["hidden"])),
    }[kind]


def layer(p, h):
    """One residual MLP block for one device; ``w_in`` column- and ``w_out`` row-parallel under TP."""
    from hpfunc import layout
    from hpfunc.models.layers import rms_norm
    from hpfunc.transforms.remat import checkpoint_name

    u = rms_norm(h, p["norm"], 1e-6)
    a = checkpoint_name(F.gelu(F.linear(u, p["w_in"])), "hidden")
    return h + layout.reduce_partial(F.linear(a, p["w_out"]))


def loss(params, batch, kind: str = "none", probe=None):
    layer_fn = wrap(kind)(layer)
    h = batch["x"]
    for lp in params["layers"]:
        h = layer_fn(lp, h)
    out = ((F.linear(h, params["head"]) - batch["y"]) ** 2).mean()
    return out if probe is None else _Probe.apply(out, probe)


def init(seed: int, dim: int, hidden: int, layers: int = 2) -> dict:
    from hpfunc import random

    key = random.key(seed)
    normal = lambda i, shape: random.normal(random.fold_in(key, i), shape, torch.float32, std=0.3)  # noqa: E731
    ls = [{"norm": 1.0 + normal(3 * i, (dim,)), "w_in": normal(3 * i + 1, (hidden, dim)),
           "w_out": normal(3 * i + 2, (dim, hidden))} for i in range(layers)]
    return {"layers": ls, "head": normal(99, (dim, dim))}


def tp_styles():
    from hpfunc.layout import ColwiseParallel, RowwiseParallel

    return {"layers.*.w_in": ColwiseParallel(), "layers.*.w_out": RowwiseParallel()}


# ---------------------------------------------------------------------------------------------
# Storage liveness


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


class _Births(TorchDispatchMode):
    """Notes (weakly) every storage an op creates while active. Keys are storage addresses, which a
    freed storage hands on: an entry whose storage died is replaced by the new one at its address, and
    only the last storage born at an address can still be alive."""

    def __init__(self):
        super().__init__()
        self.born: dict[int, tuple[StorageWeakRef, int, torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            k = _key(t)
            if k not in inputs and (k not in self.born or self.born[k][0].expired()):
                s = t.untyped_storage()
                self.born[k] = (StorageWeakRef(s), s.nbytes(), t.dtype)
        return out


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class _Probe(torch.autograd.Function):
    """Identity; its backward (the first to run) calls ``probe()``, while every saved tensor is still held."""

    @staticmethod
    def forward(x, probe):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.probe = inputs[1]

    @staticmethod
    def backward(ctx, g):
        ctx.probe()
        return g, None


def measured_loss(kind: str, record: dict, spy: bool):
    """``loss`` with the liveness probe; the probe writes alive bytes by class into ``record``.

    gloo's worker thread lets go of the buffers of the collective it ran last a moment after the caller's
    wait returns (the last gathered parameter or reduced activation, then, for a few milliseconds): when
    more bytes of a class are alive than ``record["expect"]`` says, the probe looks again for up to 0.5 s
    before it counts (a real leak stays)."""

    def fn(params, batch):
        births, seen = _Births(), {}  # seen: storages the model read as parameters (weakly: an address is reused)
        p = Spy(params, lambda v: seen.__setitem__(_key(v), StorageWeakRef(v.untyped_storage()))) if spy else params

        def count():
            gc.collect()
            out = {"param": 0, "host": 0, "activation": 0}
            for k, (ref, nbytes, dtype) in births.born.items():
                if ref.expired():
                    continue
                param = k in seen and not seen[k].expired()  # that very storage, not a later one at its address
                what = "param" if param else "host" if dtype == torch.uint8 else "activation"
                out[what] += nbytes
            return out

        def probe():
            out, expect = count(), record.get("expect")
            for _ in range(50 if expect is not None else 0):  # the one-device reference counts once
                if all(out[k] <= expect.get(k, 0) for k in out):
                    break
                time.sleep(0.01)
                out = count()
            record.update(out)

        with births:
            return loss(p, batch, kind, probe)

    return fn


# ---------------------------------------------------------------------------------------------
# One case on the ranks


def run_case(name: str, kind: str, seed: int = 0, dim: int = 8, hidden: int = 16, batch: int = 4, seq: int = 3):
    """Return the mismatches (empty: the case passes): gradients and the AdamW update vs one device; the
    bytes alive after the forward vs the same layers on one device with this rank's shapes.

    Every object alive before the case is frozen (``gc.freeze``) while it runs: the probe's ``gc.collect``
    then walks only what the case made (the forward's storages among them), not the rank's whole heap of
    imported modules (a full collection there took ~0.4 s, twice per case: most of the test's time)."""
    gc.freeze()
    try:
        return _run_case(name, kind, seed, dim, hidden, batch, seq)
    finally:
        gc.unfreeze()


def _run_case(name: str, kind: str, seed: int, dim: int, hidden: int, batch: int, seq: int) -> dict:
    import hpfunc
    from hpfunc import optim
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    axes, factory = PLANS[name]
    mesh = hpfunc.Mesh(axes)
    plan = factory(plans, plans.tp("tp", tp_styles()))
    record: dict = {}
    opt = optim.adamw(LR, eps=1e-5)
    step = parallel_train_step(measured_loss(kind, record, spy=True), opt, mesh, plan, return_grads=True)
    full = init(seed, dim, hidden)
    params = step.shard_params(full)
    res = step.resolve(params)

    def compute_numel(r):  # the block a gathered parameter is used as (its compute spec)
        n = 1
        for d, size in enumerate(r.shape):
            axes = r.spec.compute.dim_axes(d)
            n *= size // (mesh.axis_size(axes) if axes else 1)
        return n

    gathered = sum(4 * compute_numel(r) for r in res.values() if r.gather)
    want_param = 0 if plan.reshard_after_forward else gathered
    g = torch.Generator().manual_seed(seed + 1)
    b = {"x": torch.randn(batch, seq, dim, generator=g), "y": torch.randn(batch, seq, dim, generator=g)}
    n_data = mesh.axis_size(tuple(a for a in mesh.axis_names if a in plan.data_axes))

    # what the policy keeps on one device with this rank's shapes (its batch shard, its tensor-parallel blocks)
    tp = mesh.axis_size("tp") if "tp" in axes else 1

    def block(path, x):  # the shape of this rank's tensor-parallel block (the values do not matter)
        cut = tuple(slice(0, x.shape[d] // tp) if "tp" in res[path].spec.compute.dim_axes(d) else slice(None)
                    for d in range(x.ndim))
        return x[cut].clone().requires_grad_(True)

    local = hpfunc.tree.map_with_path(block, full)
    mine = {k: v.chunk(n_data)[0] for k, v in b.items()}
    expect: dict = {}
    hpfunc.value_and_grad(measured_loss(kind, expect, spy=False))(local, mine)
    record["expect"] = {"activation": expect["activation"], "host": expect["host"], "param": want_param}

    opt_state = step.init_opt_state(params)
    new_params, _, metrics, grads = step(params, opt_state, b)

    # 1. the gradient and the update are the single-device ones (the plain loss: no transform at all)
    def ref_loss(p):  # the mean over data shards of the shard means
        shards = zip(b["x"].chunk(n_data), b["y"].chunk(n_data))
        return torch.stack([loss(p, {"x": x, "y": y}) for x, y in shards]).mean()

    value, ref_grads = hpfunc.value_and_grad(ref_loss)(full)
    assert_trees_close(metrics["loss"], value, rtol=1e-5, atol=1e-6, what=f"{name}/{kind} loss")
    assert_trees_close(to_full(grads), ref_grads, rtol=1e-5, atol=1e-6, what=f"{name}/{kind} grads")
    u, _ = opt.update(ref_grads, opt.init(full), full)
    assert_trees_close(new_params, optim.apply_updates(full, u), rtol=1e-5, atol=1e-6, what=f"{name}/{kind} update")

    # 2. alive after the forward: this rank's activations and host copies are those of the same layers on
    # one device with this rank's shapes; no parameter is copied to the host, and gathered parameters stay
    # alive only without reshard after forward
    got = dict(record)
    problems = []
    if (got["activation"], got["host"]) != (expect["activation"], expect["host"]):
        problems.append(f"{name}/{kind}: alive activation/host bytes {got['activation']}/{got['host']}, one device "
                        f"{expect['activation']}/{expect['host']}")
    if got["param"] != want_param:
        problems.append(f"{name}/{kind}: gathered parameter bytes alive after forward {got['param']}, expected "
                        f"{want_param} (reshard_after_forward={plan.reshard_after_forward})")
    return {"problems": problems, "alive": got, "one_device": expect}


def run_remat_of_view(name: str, seed: int = 0, dim: int = 8, hidden: int = 16) -> list[str]:
    """Each layer wrapped in ``remat`` and called with the step's parameter view itself (no spy in
    between): the recompute receives the view's storage blocks back from autograd as new tensor objects
    (saved-tensor hooks are installed) and must still read them gathered. Returns the mismatches of the
    loss and gradients against one device, per policy."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.testing import assert_trees_close, to_full
    from hpfunc.transforms import plans
    from hpfunc.transforms import remat as R
    from hpfunc.transforms.parallelize import parallel_train_step

    axes, factory = PLANS[name]
    mesh = hpfunc.Mesh(axes)
    plan = factory(plans, plans.tp("tp", tp_styles()))
    full = init(seed, dim, hidden)
    g = torch.Generator().manual_seed(seed + 1)
    b = {"x": torch.randn(4, 3, dim, generator=g), "y": torch.randn(4, 3, dim, generator=g)}
    n_data = mesh.axis_size(tuple(a for a in mesh.axis_names if a in plan.data_axes))

    def ref_loss(p):  # the mean over data shards of the shard means
        shards = zip(b["x"].chunk(n_data), b["y"].chunk(n_data))
        return torch.stack([loss(p, {"x": x, "y": y}) for x, y in shards]).mean()

    value, ref_grads = hpfunc.value_and_grad(ref_loss)(full)
    problems = []
    for kind in ("remat_nothing", "remat_dots", "remat_names"):
        step = parallel_train_step(lambda p, bb, kind=kind: loss(p, bb, kind), optim.adamw(LR, eps=1e-5), mesh, plan,
                                   return_grads=True)
        params = step.shard_params(full)
        try:
            _, _, metrics, grads = step(params, step.init_opt_state(params), b)
            assert_trees_close(metrics["loss"], value, rtol=1e-5, atol=1e-6, what=f"{name}/{kind} loss")
            assert_trees_close(to_full(grads), ref_grads, rtol=1e-5, atol=1e-6, what=f"{name}/{kind} grads")
        except (AssertionError, RuntimeError) as err:
            problems.append(f"{name}/{kind}: {type(err).__name__}: {err}")
    return problems


def run_matrix(names: list[str], kinds: list[str] = WRAPS, **kw) -> list[dict]:
    return [{"name": n, "kind": k, **run_case(n, k, **kw)} for n in names for k in kinds]


def run_refused_orders() -> list[str]:
    """The orders of transforms that cannot make sense fail with a PlanError naming both, before any
    communication."""
    import hpfunc
    from hpfunc import optim
    from hpfunc.layout import PlanError
    from hpfunc.transforms import plans

    mesh = hpfunc.Mesh({"fsdp": 2})
    tx = optim.adamw(LR)
    batch = torch.ones(4, 3)
    msgs = []

    def sq_loss(p):
        return ((batch @ p["w"]) ** 2).mean()

    def plain(state, b):
        loss, g = hpfunc.value_and_grad(sq_loss)(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optim.apply_updates(state["params"], u), "opt": opt}, {"loss": loss}

    def remat_around_value_and_grad(state, b):
        hpfunc.remat(lambda p: hpfunc.value_and_grad(sq_loss)(p)[0])(state["params"])
        return state, {}

    inner = hpfunc.parallelize(plain, mesh, plans.fsdp("fsdp"))

    def nested(state, b):
        return inner(state, b)

    cases = [
        ("remat_around_value_and_grad", remat_around_value_and_grad, None,
         ["hpfunc.value_and_grad inside hpfunc.remat", "parallelize"]),
        ("step_inside_offload", plain, hpfunc.offload, ["called inside hpfunc.offload", "hpfunc.parallelize"]),
        ("step_inside_remat", plain, hpfunc.remat, ["called inside hpfunc.remat", "hpfunc.parallelize"]),
        ("nested_parallelize", nested, None, ["inside another one"]),
    ]
    for name, step, around, needles in cases:
        ts = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp"))
        params = ts.shard_params({"w": torch.ones(3, 2)})
        state = ts.init_state(lambda p: {"params": p, "opt": tx.init(p)}, params)
        call = ts if around is None else around(lambda s, b: ts(s, b))
        with hpfunc.comm_stats() as stats:
            try:
                if around is hpfunc.remat:  # remat needs a differentiable input to wrap anything
                    call(state, batch.requires_grad_(True))
                else:
                    call(state, batch)
            except PlanError as e:
                msg = str(e)
                assert all(n in msg for n in needles), (name, msg)
                assert not [r for r in stats.records if r.payload_bytes > 0], (name, stats.table())
                msgs.append(msg)
                continue
        raise AssertionError(f"{name}: no PlanError")
    return msgs
