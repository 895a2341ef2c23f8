"""remat composes with shard_map: collectives inside a recomputed region, on 2 gloo ranks.

The recompute re-issues the region's forward collectives during backward. Backward is SPMD (every
rank runs the same graph in the same order), so every rank re-issues them in the same order: no
deadlock, one extra collective per recomputed one (counted below), gradients unchanged.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multirank


def run_remat_over_shard_map(seed: int) -> dict:
    import torch

    import hpfunc
    from hpfunc import P
    from hpfunc.transforms import remat as R

    mesh = hpfunc.Mesh({"dp": 2})
    g = torch.Generator().manual_seed(seed)
    params = {"w1": torch.randn(4, 8, generator=g), "w2": torch.randn(8, 4, generator=g)}
    x = torch.randn(6, 4, generator=g)  # global batch, sharded over dp

    def local(p, x):
        h = R.checkpoint_name(torch.tanh(x @ p["w1"]), "h")
        s = hpfunc.lax.psum(h.sum(0, keepdim=True), "dp") + h  # a collective inside the region
        s = R.checkpoint_name(s, "s")
        y = torch.tanh(s @ p["w2"])
        return hpfunc.lax.psum((y ** 2).sum(), "dp")

    mapped = hpfunc.shard_map(local, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())

    def scalar(v):
        return v.to_local() if hasattr(v, "to_local") else v

    variants = {
        "plain": lambda p, x: scalar(mapped(p, x)),
        "remat_outside_full": R.remat(lambda p, x: scalar(mapped(p, x))),
        "remat_outside_dots": R.remat(lambda p, x: scalar(mapped(p, x)), policy=R.dots_saveable),
        # saving every op would cache the buffer a collective then reduces in place: it must be
        # evicted from the cache, not reduced a second time in the recompute
        "remat_outside_every_op": R.remat(lambda p, x: scalar(mapped(p, x)), policy=lambda op, name, t: True),
        "remat_inside_names": lambda p, x: scalar(hpfunc.shard_map(
            R.remat(local, policy=R.save_only_these_names("s")), mesh=mesh, in_specs=(P(), P("dp")),
            out_specs=P())(p, x)),
        "remat_inside_full": lambda p, x: scalar(hpfunc.shard_map(
            R.remat(local), mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())(p, x)),
    }
    out = {}
    for k, fn in variants.items():
        with hpfunc.comm_stats() as stats:
            value, grads = hpfunc.value_and_grad(fn)(params, x)
        calls = [(r.name, r.phase) for r in stats.records]
        out[k] = (value.detach(), {n: t.detach() for n, t in grads.items()}, calls)
    return out


def test_remat_over_shard_map_with_psum_matches(pool2):
    for seed in (0, 1):
        per_rank = pool2.run(run_remat_over_shard_map, seed)
        for res in per_rank:
            value, grads, plain_calls = res["plain"]
            for k, (v, g, calls) in res.items():
                assert torch_equal(v, value), k
                for n in grads:
                    assert torch_equal(g[n], grads[n]), (k, n)
                fwd = [c for c in calls if c[1] == "forward"]
                assert fwd == [c for c in plain_calls if c[1] == "forward"], k
            # Recompute re-issues the first psum during backward: the recompute replays ops in
            # order and stops early once backward has what it needs (the last psum's output is
            # needed by nothing in backward). Saving "s" does not spare the re-issue: the replay
            # has to pass the psum to reach the ops after it that are recomputed.
            n_plain = len(plain_calls)
            extra = {k: len(c) - n_plain for k, (_, _, c) in res.items()}
            assert extra == {"plain": 0, "remat_outside_full": 1, "remat_outside_dots": 1,
                             "remat_outside_every_op": 1, "remat_inside_names": 1, "remat_inside_full": 1}, extra
        # every rank computed the same gradients
        for n in per_rank[0]["plain"][1]:
            assert torch_equal(per_rank[0]["plain"][1][n], per_rank[1]["plain"][1][n])


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def run_global_view(seed: int) -> dict:
    import torch

    import hpfunc
    from hpfunc import P
    from hpfunc.memory import saved_activations
    from hpfunc.transforms import offload as O
    from hpfunc.transforms import remat as R

    mesh = hpfunc.Mesh({"dp": 2})
    g = torch.Generator().manual_seed(seed)
    w = hpfunc.shard(torch.randn(4, 4, generator=g), mesh, P())
    x = hpfunc.shard(torch.randn(8, 4, generator=g), mesh, P("dp"))

    def f(w, x):
        return torch.tanh(R.checkpoint_name(x @ w, "h")).sum()

    out = {}
    for k, fn in {"plain": f, "full": R.remat(f), "names": R.remat(f, policy=R.save_only_these_names("h")),
                  "offload": O.offload(f)}.items():
        grad = hpfunc.grad(fn)(w, x)
        out[k] = (grad.full_tensor(), saved_activations(fn, w, x, state_argnums=(0,)).device_bytes)
    out["x_local_bytes"] = x.to_local().numel() * x.element_size()
    return out


def test_remat_and_offload_on_dtensors_in_the_global_view(pool2):
    import torch

    for res in pool2.run(run_global_view, 0):
        x_bytes = res.pop("x_local_bytes")
        want = res["plain"][0]
        for k, (g, _) in res.items():
            assert torch.equal(g, want), k
        # bytes are those of each rank's local shard (the full recompute keeps x): saved_activations
        # measures copies of its arguments, each in a storage of its own, whatever storage the
        # caller's local block is a view of
        assert res["full"][1] == x_bytes
