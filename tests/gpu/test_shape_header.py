"""hpfunc.transforms.shape_header: a header sent and received with batch_isend_irecv between two gloo
ranks (real values), and the header the pipeline's wire sends."""

from __future__ import annotations

import torch

from hpfunc.transforms import shape_header
from hpfunc.transforms.pipeline import wire


def _exchange():
    import torch.distributed as dist

    me = dist.get_rank()
    if me == 0:
        ops = [shape_header.header_send_op([torch.zeros(2, 5, 3), torch.zeros(7, dtype=torch.bool)], 1, None, 0, "cpu")]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return None
    buf, op = shape_header.header_recv_op(0, None, 0, "cpu")
    for w in dist.batch_isend_irecv([op]):
        w.wait()
    return shape_header.decode(buf.tolist())


def test_a_header_crosses_ranks_and_is_the_pipeline_wire_header(pool2):
    assert pool2.run(_exchange)[1] == [((2, 5, 3), torch.float32), ((7,), torch.bool)]
    fields = wire.Wire.header_fields([torch.zeros(2, 5, 3)])  # the pipeline's wire speaks this module's layout
    assert fields == shape_header.encode([torch.zeros(2, 5, 3)]) and len(fields) == shape_header.HEADER_LEN
