"""``lax.ppermute_start``: the permutation posted without waiting equals ``lax.ppermute`` in value and
gradient (its transpose is the inverse permutation, posted in the backward), also with compute and a
second transfer in flight between post and wait; the counter records it once per send, in each phase."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.multirank


def run_start(world: int, perm: list, shape: tuple, seed: int) -> tuple:
    import torch.distributed as dist

    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh({"x": world})
    r = dist.get_rank()
    g = torch.Generator().manual_seed(seed * 31 + r)
    x0 = torch.randn(shape, generator=g)
    c1, c2 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    with mesh:
        outs = []
        for asynchronous in (False, True):
            x = x0.clone().requires_grad_(True)
            with hpfunc.comm_stats() as stats:
                if asynchronous:
                    first = lax.ppermute_start(x, "x", perm)
                    second = lax.ppermute_start(x * 2, "x", perm)  # two transfers in flight at once
                    busy = (x * x).sum()  # compute between post and wait
                    y2, y1 = second.wait(), first.wait()
                else:
                    y1, y2, busy = lax.ppermute(x, "x", perm), lax.ppermute(x * 2, "x", perm), (x * x).sum()
                (gx,) = torch.autograd.grad((y1 * c1).sum() + (y2 * c2).sum() + busy, x)
            counts = {(rec.name, rec.phase): 0 for rec in stats.records}
            for rec in stats.records:
                counts[(rec.name, rec.phase)] += 1
            outs.append((y1.detach(), y2.detach(), gx, counts))
    return outs


@settings(max_examples=8)
@given(data=st.data())
def test_ppermute_start_equals_ppermute(pools, data):
    world = data.draw(st.sampled_from([2, 4]))
    kind = data.draw(st.sampled_from(["shift", "random"]))
    if kind == "shift":
        k = data.draw(st.integers(1, world - 1))
        perm = [(i, (i + k) % world) for i in range(world)]
    else:
        dst = data.draw(st.permutations(list(range(world))))
        keep = data.draw(st.lists(st.booleans(), min_size=world, max_size=world))
        perm = [(i, d) for i, (d, kp) in enumerate(zip(dst, keep)) if kp]
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    for r, (sync, asyn) in enumerate(pools(world).run(run_start, world, perm, shape, data.draw(st.integers(0, 999)))):
        for a, b in zip(sync[:3], asyn[:3]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        sends = sum(1 for s, d in perm if s == r and d != r)  # forward; the backward sends what r received
        receives = sum(1 for s, d in perm if d == r and s != r)
        want = {("ppermute_start", "forward"): 2 * sends, ("ppermute_start", "backward"): 2 * receives}
        assert asyn[3] == {k: v for k, v in want.items() if v}, (r, perm, asyn[3])
        assert {k[1]: v for k, v in asyn[3].items()} == {k[1]: v for k, v in sync[3].items()}


def test_ppermute_start_waits_once(pools):
    def run() -> str:
        import hpfunc
        from hpfunc import lax

        with hpfunc.Mesh({"x": 2}):
            pending = lax.ppermute_start(torch.ones(2), "x", [(0, 1), (1, 0)])
            pending.wait()
            try:
                pending.wait()
            except RuntimeError as e:
                return str(e)
        return "no error"

    assert "already waited" in pools(2).run0(run)
