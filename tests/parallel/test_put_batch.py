"""``ParallelizedStep.put_batch`` / :func:`hpfunc.host_to_device.put_blocks`: each rank keeps only its block
of the global host batch, as a DTensor the step takes as it is, with the values of the whole-batch call.

On four gloo ranks, mesh ``{dp: 2, fsdp: 2}`` under HSDP (both axes split the batch, in mesh order): each
rank's block holds exactly rows ``[i B/4, (i+1) B/4)`` of the host batch for its data index ``i``, and
two steps fed by ``put_batch`` give the losses and parameters of two steps fed the global batch, bit for
bit (the trainer's own parity tests, ``tests/train``, run their batches through it too). The per-rank
copy's size on a CUDA device is measured on fake CUDA in ``tests/gpu/test_fake_cuda_loop.py``.
"""

from __future__ import annotations

import pytest
import torch


def _blocks_and_steps() -> dict:
    import hpfunc
    from hpfunc import optim
    from hpfunc.host_to_device import put_blocks
    from hpfunc.sharding import P
    from hpfunc.transforms import plans

    tx = optim.adamw(0.1)

    def step(state, batch):
        def loss(p):
            h = torch.tanh(batch["x"] @ p["w"])
            return ((h.sum(-1) - batch["y"]) ** 2).mean()

        value, g = hpfunc.value_and_grad(loss)(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optim.apply_updates(state["params"], u), "opt": opt}, {"loss": value}

    mesh = hpfunc.Mesh({"dp": 2, "fsdp": 2})
    train_step = hpfunc.parallelize(step, mesh, plans.hsdp("dp", "fsdp"))
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    batches = [{"x": torch.randn(8, 6, generator=torch.Generator().manual_seed(n)),
                "y": torch.randn(8, generator=torch.Generator().manual_seed(10 + n))} for n in range(2)]

    def run(feed):
        state = train_step.init_state(lambda p: {"params": p, "opt": tx.init(p)}, train_step.shard_params({"w": w}))
        losses = []
        for b in batches:
            state, metrics = train_step(state, feed(b))
            losses.append(metrics["loss"].full_tensor())
        return losses, state["params"]["w"].full_tensor()

    blocks = put_blocks(batches[0], mesh, P(("dp", "fsdp")))
    i = mesh.axis_index(("dp", "fsdp"))
    return {"index": i, "x_block": blocks["x"].to_local(), "x_rows": batches[0]["x"][2 * i: 2 * i + 2],
            "shape": tuple(blocks["x"].shape), "placements": tuple(str(p) for p in blocks["x"].placements),
            "whole": run(lambda b: b), "blocks": run(train_step.put_batch)}


def test_each_rank_keeps_its_block_and_the_steps_equal_the_whole_batch(pool4):
    out = pool4.run(_blocks_and_steps)
    assert sorted(r["index"] for r in out) == [0, 1, 2, 3]
    for r in out:
        assert r["shape"] == (8, 6) and r["placements"] == ("S(0)", "S(0)")  # the global shape, split on both axes
        assert torch.equal(r["x_block"], r["x_rows"])
        (whole_losses, whole_w), (block_losses, block_w) = r["whole"], r["blocks"]
        assert all(torch.equal(a, b) for a, b in zip(whole_losses, block_losses))  # bit for bit
        assert torch.equal(whole_w, block_w)


def test_a_batch_that_does_not_divide_names_the_leaf(pool4):
    def bad():
        import hpfunc
        from hpfunc.host_to_device import put_blocks
        from hpfunc.sharding import P

        with pytest.raises(ValueError, match=r"put_blocks: leaf 'tokens' of shape \(3, 5\): dimension 0 does not "
                                             r"divide over the mesh axes \('dp',\) \(4 ranks\)"):
            put_blocks({"tokens": torch.zeros(3, 5)}, hpfunc.Mesh({"dp": 4}), P("dp"))
        return True

    assert pool4.run(bad) == [True] * 4
