"""Rank-side helpers for test_dfunction.py: a fused SwiGLU-free MLP (silu) as a dfunction whose backward
recomputes the activation, against autograd of the plain function: in the global view, and as the layer
of a model trained by ``hpfunc.parallelize`` with fsdp x tp (and under ``hpfunc.remat``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import hpfunc
from hpfunc import P, lax


def mlp_block(x, w_in, w_out, axis):
    """The plain per-rank function: column-parallel ``w_in``, row-parallel ``w_out``, summed over ``axis``."""
    y = F.linear(F.silu(F.linear(x, w_in)), w_out)
    return lax.psum(y, axis) if axis else y


def make_fused(axis: str, bug: str | None = None):
    """The same function as a dfunction whose residuals are only its inputs: the backward recomputes the
    pre-activation (``bug``: a deliberately wrong backward, to see the tests fail)."""

    @hpfunc.dfunction(in_specs=(P(), P(axis, None), P(None, axis)), out_specs=P())
    def fused(x, w_in, w_out):
        return mlp_block(x, w_in, w_out, axis)

    def fwd(x, w_in, w_out):
        return fused.fn(x, w_in, w_out), (x, w_in, w_out)  # nothing of the hidden layer is kept

    def bwd(res, g):
        x, w_in, w_out = res
        gz = lax.psum(g, axis)  # the transpose of the forward's psum
        pre = F.linear(x, w_in)  # recomputed
        s = torch.sigmoid(pre)
        h = pre * s
        gh = gz @ w_out
        gpre = gh * (s * (1 + pre * (1 - s)))
        if bug == "no_psum":
            gpre = g @ w_out * (s * (1 + pre * (1 - s)))
        gw_out = gz.reshape(-1, gz.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        gw_in = gpre.reshape(-1, gpre.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        gx = gpre @ w_in
        return gx, gw_in, gw_out

    return fused.defvjp(fwd, bwd)


def run_global_view(seed: int, bug: str | None = None) -> float:
    """The dfunction on DTensors (x replicated, weights split over tp) vs the plain function on one device:
    the largest |difference| over value and gradients."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = hpfunc.Mesh({"tp": 2})
    g = torch.Generator().manual_seed(seed)
    x, w_in, w_out = torch.randn(3, 5, 4, generator=g), torch.randn(8, 4, generator=g), torch.randn(4, 8, generator=g)
    fused = make_fused("tp", bug)
    dm = mesh.device_mesh
    args = (distribute_tensor(x, dm, [Replicate()]), distribute_tensor(w_in, dm, [Shard(0)]),
            distribute_tensor(w_out, dm, [Shard(1)]))
    c = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
    v, gs = hpfunc.value_and_grad(lambda *a: (fused(*a).full_tensor() * c).sum(), argnums=(0, 1, 2))(*args)
    rv, rgs = hpfunc.value_and_grad(lambda *a: (mlp_block(*a, None) * c).sum(), argnums=(0, 1, 2))(x, w_in, w_out)
    diffs = [float((v - rv).abs())] + [float((a.full_tensor() - b).abs().max()) for a, b in zip(gs, rgs)]
    return max(diffs)


# ---------------------------------------------------------------------------------------------
# A model whose MLP is the dfunction, trained through hpfunc.parallelize


def layer(norm, w_in, w_out, h, fused):
    from hpfunc import layout
    from hpfunc.models.layers import rms_norm

    u = rms_norm(h, norm, 1e-6)
    if fused is None:  # the plain model: one device, or the layout seam's TP hooks
        return h + layout.reduce_partial(F.linear(F.silu(F.linear(u, w_in)), w_out))
    return h + fused(u, w_in, w_out)


def loss(params, batch, fused=None, remat=False):
    fn = (lambda *a: layer(*a, fused))
    if remat:
        fn = hpfunc.remat(fn, policy=hpfunc.checkpoint_policies.nothing_saveable)
    h = batch["x"]
    for lp in params["layers"]:
        # the parameters read before remat: a remat'd function that reads the step's parameter view
        # itself re-reads the storage block when recomputed (see the report of issue 26)
        h = fn(lp["norm"], lp["w_in"], lp["w_out"], h)
    return ((F.linear(h, params["head"]) - batch["y"]) ** 2).mean()


def init(seed: int, dim: int = 8, hidden: int = 16, layers: int = 2) -> dict:
    from hpfunc import random

    key = random.key(seed)
    normal = lambda i, shape: random.normal(random.fold_in(key, i), shape, torch.float32, std=0.3)  # noqa: E731
    ls = [{"norm": 1.0 + normal(3 * i, (dim,)), "w_in": normal(3 * i + 1, (hidden, dim)),
           "w_out": normal(3 * i + 2, (dim, hidden))} for i in range(layers)]
    return {"layers": ls, "head": normal(99, (dim, dim))}


def run_parallelize(seed: int, remat: bool, bug: str | None = None) -> dict:
    """fsdp x tp (2 x 2): the model with the fused dfunction vs the same model with the plain MLP, both
    through ``parallel_train_step``; and both against one device. Returns the largest differences."""
    from hpfunc import optim
    from hpfunc.layout import ColwiseParallel, RowwiseParallel
    from hpfunc.testing import to_full
    from hpfunc.transforms import plans
    from hpfunc.transforms.parallelize import parallel_train_step

    mesh = hpfunc.Mesh({"fsdp": 2, "tp": 2})
    plan = plans.fsdp("fsdp") + plans.tp("tp", {"layers.*.w_in": ColwiseParallel(),
                                                 "layers.*.w_out": RowwiseParallel()})
    opt = optim.adamw(1e-2, eps=1e-5)
    fused = make_fused("tp", bug)
    g = torch.Generator().manual_seed(seed + 1)
    batch = {"x": torch.randn(4, 3, 8, generator=g), "y": torch.randn(4, 3, 8, generator=g)}
    out = {}
    results = {}
    for name, f in (("fused", fused), ("plain", None)):
        step = parallel_train_step(lambda p, b, f=f: loss(p, b, f, remat), opt, mesh, plan, return_grads=True)
        full = init(seed)
        params = step.shard_params(full)
        opt_state = step.init_opt_state(params)
        losses = []
        for _ in range(2):
            params, opt_state, metrics, grads = step(params, opt_state, batch)
            losses.append(float(metrics["loss"]))
        results[name] = (losses, to_full(grads), to_full(params))

    # one device: the mean over the two data shards of the plain loss, two AdamW steps
    full = init(seed)
    state = opt.init(full)
    ref_losses = []
    for _ in range(2):
        def ref_loss(p):
            shards = zip(batch["x"].chunk(2), batch["y"].chunk(2))
            return torch.stack([loss(p, {"x": x, "y": y}) for x, y in shards]).mean()
        v, ref_grads = hpfunc.value_and_grad(ref_loss)(full)
        u, state = opt.update(ref_grads, state, full)
        full = optim.apply_updates(full, u)
        ref_losses.append(float(v))

    def gap(a, b):
        la, _ = hpfunc.tree.flatten(a)
        lb, _ = hpfunc.tree.flatten(b)
        return max(float(((x - y).abs() / (1e-6 + 1e-5 * y.abs())).max()) for x, y in zip(la, lb))

    fl, fg, fp = results["fused"]
    pl, pg, pp = results["plain"]
    out["fused_vs_plain"] = max(gap(fg, pg), gap(fp, pp), max(abs(a - b) / (1e-6 + 1e-5 * abs(b)) for a, b in zip(fl, pl)))
    out["fused_vs_one_device"] = max(gap(fp, full), max(abs(a - b) / (1e-6 + 1e-5 * abs(b))
                                                          for a, b in zip(fl, ref_losses)))
    return out


def run_errors() -> list[str]:
    """The misuses a dfunction reports, each as its message."""
    from hpfunc.ops import DFunctionError

    mesh = hpfunc.Mesh({"tp": 2})
    msgs = []
    x = torch.ones(2, 4, requires_grad=True)

    bad_shape = hpfunc.dfunction(lambda x: x * 2, in_specs=P(), out_specs=P())
    bad_shape.defvjp(lambda x: (x * 2, None), lambda res, g: (g.sum(0),))
    wrong_axis = hpfunc.dfunction(lambda x: x, in_specs=P("dp"), out_specs=P("dp"))
    bad_count = hpfunc.dfunction(lambda x: x * 2, in_specs=P(), out_specs=P())
    bad_count.defvjp(lambda x: (x * 2, None), lambda res, g: (g, g))
    for f in (lambda: bad_shape(x).sum().backward(), lambda: wrong_axis(x), lambda: bad_count(x).sum().backward()):
        try:
            with mesh:
                f()
            msgs.append("no error")
        except DFunctionError as e:
            msgs.append(str(e))
    return msgs
