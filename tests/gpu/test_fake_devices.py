"""hpfunc.testing.fake_devices and the pieces of a step that run on fake CUDA devices today.

Each fake-device run is one spawned process (isolated=True: the fake process group must be this
process's default group), so the checks are grouped to keep the spawns few.
"""

from __future__ import annotations

import pytest
import torch

from hpfunc import random as hr
from hpfunc.testing.fake_devices import DeviceRecorder, HostSyncError, answer_host_syncs, run_on_fake_devices
from tests.gpu import _fake_pieces as fp

MESH = {"fsdp": 4, "tp": 2}


def test_random_values_on_the_cpu_are_the_published_ones():
    # The values of the host implementation before sampling moved to tensor ops (taken from it): the
    # key words are no longer read back, the numbers did not change.
    k = hr.key(1234)
    k1, k2 = hr.split(k).unbind(0)
    k3 = hr.fold_in(k2, 7)
    assert hr.bits(k2, (5,)).tolist() == [280223847, 3282457379, 432567247, 4187181036, 3759728009]
    assert hr.normal(k1, (3,)).tolist() == [0.17326374351978302, 0.4202148914337158, 0.18282800912857056]
    assert hr.randint(k3, (4,), 3, 11).tolist() == [6, 7, 4, 8]
    assert hr.permutation(k2, 6).tolist() == [0, 2, 5, 1, 4, 3]
    assert hr.fold_in(k, -5).tolist() == [4167134095, 3658351220]
    # a step counter kept as a tensor folds in like the int
    assert torch.equal(hr.fold_in(k2, torch.tensor(7)), k3)
    assert torch.equal(hr.fold_in(k, torch.tensor(-5)), hr.fold_in(k, -5))


def test_random_samples_on_fake_cuda_with_cpu_shapes_and_no_host_sync():
    cpu_meta, _ = fp.sample_all("cpu")
    run = run_on_fake_devices(fp.random_on_fake, world_size=8, rank=3, mesh=MESH, isolated=True)
    assert run.result == {n: (shape, dtype, "cuda") for n, (shape, dtype, _) in cpu_meta.items()}
    assert run.record.host_syncs == []
    # off the device: only the host literals torch.tensor(..., device="cuda") lifts (the key's two words,
    # the folded-in step), never a sampled tensor
    assert {c.op for c in run.record.off_device} == {"lift_fresh"}, run.record.off_device
    assert all(len(c.shape) <= 1 and (not c.shape or c.shape[0] <= 2) for c in run.record.off_device)
    assert run.record.devices["cuda"] > 100


def test_recorder_names_host_syncs_and_strays():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = DeviceRecorder("cuda", on_host_sync=answer_host_syncs(3))
    with FakeTensorMode(), rec:
        x = torch.ones(6, device="cuda")
        n = x.sum().item()  # scalar read, answered 3 (int(t) on fake cuda meets the device-guard limit)
        torch.arange(n)  # a CPU tensor
        x.cpu()  # a blocking copy to the host
        x.to("cpu", non_blocking=True)  # not a sync
    assert n == 3
    assert [(s.kind, s.op) for s in rec.host_syncs] == [("scalar read", "_local_scalar_dense"),
                                                        ("copy to host", "_to_copy")]
    assert all("test_fake_devices.py" in s.where for s in rec.host_syncs)
    assert [c.op for c in rec.off_device] == ["arange", "_to_copy", "_to_copy"]
    with pytest.raises(HostSyncError, match=r"data-dependent shape: aten.nonzero\) at .*test_fake_devices.py"):
        with FakeTensorMode(), DeviceRecorder("cuda"):
            # the aten op: Tensor.nonzero's Python binding wants a CUDA device guard first (docs/gpu.md)
            torch.ops.aten.nonzero(torch.ones(6, device="cuda"))
    with pytest.raises(HostSyncError, match="no stand-in"):
        with FakeTensorMode(), DeviceRecorder("cuda", on_host_sync=answer_host_syncs(3)):
            torch.ops.aten.nonzero(torch.ones(6, device="cuda"))


def test_adamw_update_on_fake_cuda_keeps_tensors_on_the_device_and_syncs_nothing():
    # The step counter lives on the host by design (optim.base.new_count): reading it for the bias
    # corrections waits for no device, so it is no host sync; it is the only tensor off the device.
    run = run_on_fake_devices(fp.adamw_update, world_size=8, rank=3, mesh=MESH, isolated=True,
                              on_host_sync=answer_host_syncs(1))
    assert run.result == {"w": ((64, 32), "cuda"), "b": ((32,), "cuda")}
    assert run.record.host_syncs == []
    # the bias corrections, from the host count
    assert {r.where.split(":")[0] for r in run.record.host_reads} == {"hpfunc/optim/_ops.py"}
    assert {(c.shape, c.dtype) for c in run.record.off_device if c.op != "lift_fresh"} == {((), torch.int64)}


def test_a_scalar_read_of_a_host_tensor_is_no_sync():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = DeviceRecorder("cuda", on_host_sync=answer_host_syncs(2))
    with FakeTensorMode(), rec:
        assert torch.zeros((), dtype=torch.int64).add(1).item() == 2  # a fake tensor: the stand-in answers
    assert rec.host_syncs == [] and [r.kind for r in rec.host_reads] == ["host read"]


def test_lax_collectives_on_the_fake_process_group():
    run = run_on_fake_devices(fp.lax_collectives, world_size=256, rank=77, mesh={"fsdp": 32, "tp": 8}, isolated=True)
    assert run.result == ((8, 4), (256, 4), (8, 4), "cuda")
    assert run.record.host_syncs == [] and run.record.off_device == []


def test_forward_and_backward_on_fake_cuda_and_errors_come_back():
    # Python indexing and autograd on fake CUDA need the shape-only CUDA runtime (hpfunc.testing.fake_cuda),
    # which the isolated process loads before torch: the tiny MoE's loss and gradient run there.
    run = run_on_fake_devices(fp.tiny_moe_forward_backward, world_size=8, rank=3, mesh=MESH, isolated=True)
    assert run.result == ("cuda", 27)
    assert run.record.host_syncs == []
    with pytest.raises(RuntimeError, match=r"boom(.|\n)*isolated fake-device process(.|\n)*raise_boom"):
        run_on_fake_devices(fp.raise_boom, world_size=8, rank=3, isolated=True)
