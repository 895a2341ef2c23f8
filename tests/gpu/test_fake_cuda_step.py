"""The trainer's whole parallel step on fake CUDA devices over the fake process group, world 8.

For each plan: ``make_train_step`` (the trainer's AdamW with a global-norm clip, its cosine schedule)
under ``hpfunc.parallelize`` with bf16 compute over fp32 storage, two steps of the tiny Qwen3 MoE, as
one rank of eight on fake ``cuda`` devices (torch's fake process group, ``FakeTensorMode``, the
shape-only CUDA runtime of ``hpfunc.testing.fake_cuda`` so that autograd runs as on a GPU, on its own
device thread). Each step is recorded by a ``DeviceRecorder``: every host sync (a fake tensor has no
value: each is answered with a stand-in and counted), every tensor made off the device.

What a step may do, per docs/gpu.md: no host sync at all (the learning-rate schedule is read on the
device, from a table of its values indexed by the step counter); off the device only host literals
lifted to it (``torch.tensor(x, device=cuda)``: the routing statistics' row count, the schedule's table,
the norm's zero). The expert-parallel plans run the padded dispatcher (the dropless one reads
its split sizes on the host, which a fake device cannot answer). The pipeline plans run as rank 0 (the
first stage: the last stage's first step reads the sender's shape header, which a fake device cannot
answer either).

All plans of one rank run in one fresh process (a spawn costs several seconds), so the parametrized
tests share two module-scoped runs.
"""

from __future__ import annotations

import pytest

from hpfunc.testing.fake_devices import run_on_fake_devices
from tests.gpu import _fake_pieces as fp

PADDED = {"moe_dispatcher": "padded"}
PP = {"schedule": "1f1b", "microbatches": 2}

# name -> (parallel section, model overrides); rank 5 of 8 for these
PLANS = {
    "fsdp": ({"mesh": {"fsdp": 8}, "plan": ["fsdp"]}, {}),
    "hsdp": ({"mesh": {"dp": 2, "fsdp": 4}, "plan": ["hsdp"]}, {}),
    "fsdp x tp": ({"mesh": {"fsdp": 4, "tp": 2}, "plan": ["fsdp", "tp"]}, {}),
    "fsdp x ep": ({"mesh": {"fsdp": 2, "ep": 4}, "plan": ["fsdp", "ep"]}, PADDED),
    "ep x tp": ({"mesh": {"ep": 4, "tp": 2}, "plan": ["ep", "tp"]}, PADDED),
}
# rank 0 of 8 (the first pipeline stage)
PIPELINE_PLANS = {
    "pp x fsdp": ({"mesh": {"pp": 2, "fsdp": 4}, "plan": [{"pp": PP}, "fsdp"]}, {}),
    "pp x ep x fsdp": ({"mesh": {"pp": 2, "ep": 2, "fsdp": 2}, "plan": [{"pp": PP}, "ep", "fsdp"]}, PADDED),
    "pp x fsdp, remat": ({"mesh": {"pp": 2, "fsdp": 4},
                          "plan": [{"pp": {**PP, "remat": "nothing_saveable"}}, "fsdp"]}, {}),
    "pp x fsdp, swap": ({"mesh": {"pp": 2, "fsdp": 4},
                         "plan": [{"pp": {**PP, "microbatches": 4, "max_resident": 1}}, "fsdp"]}, {}),
}

# The documented host syncs of a step (docs/gpu.md, "Host syncs"): none. (The learning-rate schedule read the
# step counter twice, in the optimizer's scale_by_schedule and in the lr metric, until the schedules became
# device tables: hpfunc.optim.schedules.Tabled.)
STEP_SYNCS: list = []
# The only tensors a step makes off the device: host literals lifted to it (torch.tensor(x, device=...):
# the routing statistics' row count, the lr schedule's table, a norm's zero, the pipeline's shape header),
# and views of the device mesh's rank table (a host tensor of rank ids) when a process group is looked up.
LIFTED = {"hpfunc/models/moe.py", "hpfunc/train/step.py", "hpfunc/layout/step.py", "hpfunc/host_to_device.py",
          "hpfunc/optim/schedules.py"}
MESH_TABLE = "hpfunc/mesh.py"


def _run(plans: dict, rank: int) -> dict:
    runs = [(name, parallel, model) for name, (parallel, model) in plans.items()]
    run = run_on_fake_devices(fp.trainer_steps, runs, world_size=8, rank=rank, isolated=True)
    assert run.record.host_syncs == []  # nothing outside the recorded steps synced either
    return run.result


@pytest.fixture(scope="module")
def data_plans() -> dict:
    return _run(PLANS, rank=5)


@pytest.fixture(scope="module")
def pipeline_plans() -> dict:
    return _run(PIPELINE_PLANS, rank=0)


def _check(result: dict) -> None:
    assert result["ok"], result.get("error", "") + "\n" + result.get("tb", "")
    assert result["state_devices"] == ["cuda"]  # params, optimizer state, step counter: all on the device
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        syncs = [(kind, op, where.split(":")[0], where.rsplit(" in ", 1)[1]) for kind, op, where in step["host_syncs"]]
        assert syncs == STEP_SYNCS
        for op, where in step["off_device"]:
            source = where.split(":")[0]
            assert (op == "lift_fresh" and source in LIFTED) or source == MESH_TABLE, (op, where)
        assert all(dev == "cuda" for shape, dev in step["metrics"].values()), step["metrics"]
        assert step["on_device"] > 1000  # the step ran: forward, backward and update, all recorded


@pytest.mark.parametrize("plan", list(PLANS))
def test_trainer_step_on_fake_cuda(data_plans, plan):
    _check(data_plans[plan])


@pytest.mark.parametrize("plan", list(PIPELINE_PLANS))
def test_pipelined_trainer_step_on_fake_cuda(pipeline_plans, plan):
    _check(pipeline_plans[plan])
