"""comm_stats: every collective counted with the ring formula of docs/reference.md#ring-collectives."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from hpfunc.comm import ring_sent_bytes

pytestmark = pytest.mark.multirank


def test_ring_formulas():
    assert ring_sent_bytes("all_reduce", 1024, 4) == Fraction(2 * 3 * 1024, 4)
    assert ring_sent_bytes("all_gather", 1024, 4) == 768
    assert ring_sent_bytes("reduce_scatter", 1024, 8) == 896
    assert ring_sent_bytes("all_to_all", 1024, 2) == 512
    assert ring_sent_bytes("all_reduce", 1024, 1) == 0


def run_counts():
    import hpfunc
    from hpfunc import lax

    mesh = hpfunc.Mesh({"dp": 2, "tp": 2})
    x = torch.ones(64, requires_grad=True)  # 256 bytes
    with hpfunc.comm_stats() as stats, mesh:
        y = lax.psum(x, "dp")                                 # all-reduce 256 B on 2
        z = lax.all_gather(y, ("dp", "tp"), tiled=True)       # all-gather 1024 B on 4
        w = lax.psum_scatter(z, "tp", tiled=True)             # reduce-scatter 1024 B on 2
        v = lax.all_to_all(w.reshape(16, 8), "tp", 0, 1)      # all-to-all 512 B on 2
        v.sum().backward()
    return [(r.op, r.axes, r.n, r.payload_bytes, r.sent_bytes, r.phase) for r in stats.records], stats.table()


def test_comm_stats_counts_forward_and_backward(pool4):
    records, table = pool4.run(run_counts)[0]
    fwd = [r for r in records if r[5] == "forward"]
    bwd = [r for r in records if r[5] == "backward"]
    assert fwd == [
        ("all_reduce", ("dp",), 2, 256, 256, "forward"),
        ("all_gather", ("dp", "tp"), 4, 1024, 768, "forward"),
        ("reduce_scatter", ("tp",), 2, 1024, 512, "forward"),
        ("all_to_all", ("tp",), 2, 512, 256, "forward"),
    ]
    # transposes in reverse order: all-to-all, all-gather, reduce-scatter, all-reduce
    assert [(r[0], r[1]) for r in bwd] == [("all_to_all", ("tp",)), ("all_gather", ("tp",)),
                                           ("reduce_scatter", ("dp", "tp")), ("all_reduce", ("dp",))]
    assert "total: 8 calls" in table and "test_comm.py" in table
