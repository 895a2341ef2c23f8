"""The optimizers run on DTensor leaves and agree with the same run on plain tensors."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multirank


def _dtensor_checks() -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from hpfunc import optim

    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)  # same values on every rank
    plain = {"w": torch.randn(8, 4, generator=gen), "v": torch.randn(6, generator=gen), "b": torch.randn(4, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in plain.items()} for _ in range(3)]
    layout = {"w": [Shard(0)], "v": [Shard(0)], "b": [Replicate()]}

    def dist(tree):
        return {k: distribute_tensor(v, mesh, layout[k]) for k, v in tree.items()}

    def full(x):
        return x.full_tensor() if isinstance(x, DTensor) else x

    def run(tx, params, grads):
        state = tx.init(params)
        for g in grads:
            u, state = tx.update(g, state, params)
            params = optim.apply_updates(params, u)
        return params, state

    out = {}
    out["global_norm"] = abs(optim.global_norm(dist(grads[0])).item() - optim.global_norm(grads[0]).item())
    out["global_norm_is_plain"] = not isinstance(optim.global_norm(dist(grads[0])), DTensor)

    tx = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))
    got, state = run(tx, dist(plain), [dist(g) for g in grads])
    ref, _ = run(tx, plain, grads)
    out["adamw_placements_kept"] = all(got[k].placements == tuple(layout[k]) for k in got)
    out["adamw_state_placements"] = all(state[1][0].mu[k].placements == tuple(layout[k]) for k in got)
    out["adamw"] = max((full(got[k]) - ref[k]).abs().max().item() for k in ref)

    mats = {"wq": torch.randn(6, 4, generator=gen), "experts": torch.randn(2, 3, 5, generator=gen)}
    mgrads = [{k: torch.randn(v.shape, generator=gen) for k, v in mats.items()} for _ in range(3)]
    rep = lambda t: {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in t.items()}
    tx = optim.muon(0.02, weight_decay=0.1)
    got, _ = run(tx, rep(mats), [rep(g) for g in mgrads])
    ref, _ = run(tx, mats, mgrads)
    out["muon_replicated"] = max((full(got[k]) - ref[k]).abs().max().item() for k in ref)
    out["muon_is_dtensor"] = all(isinstance(got[k], DTensor) for k in got)

    try:
        tx.init({"layers": [{"wq": distribute_tensor(mats["wq"], mesh, [Shard(0)])}]})
        out["muon_sharded_error"] = ""
    except optim.UnsupportedLeafError as e:
        out["muon_sharded_error"] = str(e)
    return out


def test_optimizers_on_dtensors(pool2):
    results = pool2.run(_dtensor_checks)
    for r in results:
        assert r["global_norm"] < 1e-5 and r["global_norm_is_plain"]
        assert r["adamw_placements_kept"] and r["adamw_state_placements"]
        assert r["adamw"] < 1e-6
        assert r["muon_replicated"] < 1e-6 and r["muon_is_dtensor"]
        assert "'layers.0.wq'" in r["muon_sharded_error"] and "Shard(dim=0)" in r["muon_sharded_error"]
    assert results[0] == results[1]
