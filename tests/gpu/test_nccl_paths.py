"""What hpfunc does differently on NCCL than on gloo, shown on both: the collectives ``hpfunc.lax``
chooses by the process group's backend, and the environment a launcher gives NCCL ranks.

The NCCL side runs on torch's fake process group with fake CUDA tensors (its backend is not gloo, so
lax takes the native device paths: which ``c10d`` op is dispatched, and the output shapes and devices,
are checked); the gloo side on two real gloo ranks, with values.
"""

from __future__ import annotations

import json
import os

import torch

from hpfunc.testing.fake_devices import answer_host_syncs, run_on_fake_devices
from tests.gpu import _fake_pieces as fp


def test_lax_takes_the_native_collectives_off_gloo():
    run = run_on_fake_devices(fp.native_collectives, world_size=8, rank=5, mesh={"fsdp": 4, "tp": 2}, isolated=True,
                              on_host_sync=answer_host_syncs(1))
    out = run.result
    # the reduce-scatter itself, not gloo's all-reduce in place; its transpose: the all-gather
    assert out["psum_scatter_ops"] == ["_reduce_scatter_base_", "_allgather_base_"]
    assert out["grad"][:2] == ((8, 3), "cuda")
    # the split sizes, then the rows: both device tensors; the sizes' read is the documented sync (answered 1)
    assert out["all_to_all_ops"] == ["alltoall_base_", "alltoall_base_"]
    assert out["all_to_all"][:2] == ((4, 1), "cuda")
    assert [s.kind for s in run.record.host_syncs] == ["scalar read"] * 4  # one per rank of the axis
    # nothing lax made stayed on the host (gloo's path would exchange the sizes as a host tensor)
    assert [c for c in run.record.off_device if "hpfunc/lax.py" in c.where] == []


def _on_gloo():
    import hpfunc

    return fp.native_collectives(hpfunc.Mesh({"fsdp": 2}))


def test_lax_keeps_the_gloo_paths_with_values(pool2):
    out = pool2.run(_on_gloo)
    for me, o in enumerate(out):
        # gloo has the reduce-scatter on the CPU too (its all-reduce workaround is for tensors torch.func wraps,
        # which an autograd.Function under torch.func.grad does not see)
        assert o["psum_scatter_ops"] == ["_reduce_scatter_base_", "_allgather_base_"]
        assert o["all_to_all_ops"] == ["alltoall_base_", "alltoall_base_"]
        x0 = torch.arange(12, dtype=torch.float32).view(4, 3)
        assert torch.equal(torch.tensor(o["grad"][2]), 2 * (2 * x0 + 1))  # d/dx sum(block(x0 + x1)^2), tiled
        # rank 0 receives row 0 of each rank, rank 1 rows 1 and 2 of each (split [1, 2])
        assert o["all_to_all"][2] == ([0.0, 10.0] if me == 0 else [1.0, 2.0, 11.0, 12.0])


def test_the_launcher_gives_nccl_ranks_nccl_error_handling(tmp_path):
    from hpfunc.faults import nccl_environment
    from hpfunc.launch import run_ranks

    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\n"
                      "json.dump({k: v for k, v in os.environ.items() if k.startswith(('TORCH_NCCL', 'TORCH_FR'))},"
                      " open(sys.argv[1] + os.environ['RANK'], 'w'))\n")
    before = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("TORCH_NCCL", "TORCH_FR"))}
    try:
        for backend in ("nccl", "gloo"):
            assert run_ranks(["--standalone", "--nproc-per-node", "1", str(script), str(tmp_path / backend)],
                             nproc=1, timeout_s=40, backend=backend) == 0
    finally:
        os.environ.update(before)
    nccl = json.loads((tmp_path / "nccl0").read_text())
    assert nccl == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
                    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "42",  # the timeout + the launcher's grace
                    # the flight recorder: the last 2000 collective events, dumped when one times out
                    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    # torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING for every rank itself; the rest is hpfunc's, for NCCL only
    assert json.loads((tmp_path / "gloo0").read_text()).keys() <= {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    # a value the user set is theirs
    assert nccl_environment(40, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}).keys() == {
        "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT"}
    users = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert nccl_environment(40, users).keys() == {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING",
                                                  "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"}
    # torch 2.13 reads TORCH_FR_BUFFER_SIZE before the older name: a size given so is the user's too
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in nccl_environment(40, {"TORCH_FR_BUFFER_SIZE": "0"})
