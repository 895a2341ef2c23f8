"""``qwen3.check_tokens`` on a (fake) CUDA device: no host read, for a plain tensor and for a DTensor's
blocks (each rank asserts on its own block; ``aten._assert_async`` has no DTensor sharding rule). A read
of the ids (the CPU path's ``int(tokens.min())``) fails here, and so does the assert on the DTensor itself."""

from __future__ import annotations

import torch

from hpfunc.models.qwen3.tokens import check_tokens
from hpfunc.testing.fake_devices import DeviceRecorder, fake_world


def test_check_tokens_reads_nothing_on_a_device_plain_or_sharded():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with fake_world(4, 1):
        mesh = init_device_mesh("cuda", (4,))
        with FakeTensorMode(allow_non_fake_inputs=True), DeviceRecorder("cuda", "raise"):
            block = torch.zeros(2, 8, dtype=torch.int64, device="cuda")
            check_tokens(block, 100)
            check_tokens(DTensor.from_local(block, mesh, [Shard(0)]), 100)
