"""``train_step.lower(state, batch)``: one explicit, printable, runnable program per state structure;
``train_step(state, batch)`` finds it by the structure, lowers again for other shapes or dtypes, and
the step runs under ``FakeTensorMode`` over torch's fake process group (nothing depends on a tensor's
address or on attributes set on tensors)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import _lowered_helpers as L


@pytest.mark.multirank
def test_print_shows_every_parameter_with_its_gather_group_and_reduction(pools):
    fsdp, ddp, zero2 = (pools(2).run(L.run_printed, name) for name in ("fsdp", "ddp", "zero2"))
    for out in fsdp + ddp + zero2:
        assert out["same"] and out["losses"][1] < out["losses"][0], out
    text = fsdp[0]["text"]
    assert text.splitlines()[0].startswith("Lowered(fsdp=2; plan fsdp('fsdp'); batch P('fsdp'); 6 parameters, 6 state leaves"), text
    head, rows = _table(text)
    assert head == ["param", "shape", "storage", "compute", "opt", "gather", "reduce", "bucket"], text
    assert sorted(rows) == ["bias", "embed", "layers.0.wo", "layers.0.wq", "layers.1.wo", "layers.1.wq"], text
    # a layer's parameters are gathered together, a top-level one alone; FSDP's gradients need no reduction
    assert rows["layers.0.wq"] == ["(4, 4)", "P('fsdp')", "P()", "P('fsdp')", "layers.0 (2)", "-", "-"], text
    assert rows["embed"][4:] == ["alone (1)", "-", "-"], text
    # 3 does not divide by 2: the bias is replicated, its gradient all-reduced during the backward
    assert rows["bias"] == ["(3,)", "P()", "P()", "P()", "-", "psum fsdp [float32]", "0: top"], text
    _, ddp_rows = _table(ddp[0]["text"])
    assert {r[-2] for r in ddp_rows.values()} == {"psum dp [float32]"}, ddp[0]["text"]
    # the last layer's gradients are final first: its bucket is issued first, the top-level ones last
    assert [ddp_rows[p][-1] for p in ("layers.1.wq", "layers.0.wo", "embed", "bias")] == \
        ["0: layers.1", "1: layers.0", "2: top", "2: top"], ddp[0]["text"]
    # under the default bucket cap (25 MiB) the whole model's gradients are one bucket
    _, default_rows = _table(ddp[0]["default_text"])
    assert {r[-1] for r in default_rows.values()} == {"0: layers.1..top"}, ddp[0]["default_text"]
    assert "1 all-reduce bucket started in the backward" in ddp[0]["default_text"], ddp[0]["default_text"]
    _, zero_rows = _table(zero2[0]["text"])
    assert zero_rows["layers.1.wo"][-2:] == ["psum_scatter dp [float32]", "-"], zero2[0]["text"]


def _table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The column names and, per parameter, the other columns of a printed Lowered."""
    lines = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[1:]]
    return lines[0], {cols[0]: cols[1:] for cols in lines[1:]}


def test_lower_once_per_structure_and_again_for_other_shapes():
    import hpfunc
    from hpfunc.transforms import plans

    ts = hpfunc.parallelize(L._step, hpfunc.Mesh({"fsdp": 1}), plans.fsdp("fsdp"))
    state = {"params": ts.shard_params(L._params())}
    batch = torch.zeros(2, 2, dtype=torch.long)
    lowered = ts.lower(state, batch)
    state, _ = ts(state, batch)
    assert ts.lower(state) is lowered  # the step's own output: the same structure, shapes and layout
    other = L._params()
    other["bias"] = torch.zeros(5)
    other_state = {"params": ts.shard_params(other)}
    relowered = ts.lower(other_state)
    assert relowered is not lowered and "(5,)" in str(relowered)
    with pytest.raises(hpfunc.layout.PlanError, match="lowered for a state of structure"):
        lowered(other_state, batch)


_FAKE = textwrap.dedent("""
    import warnings
    warnings.simplefilter("error")  # e.g. "Accessing the data pointer of FakeTensor is deprecated"
    import torch, torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import hpfunc
    from hpfunc.transforms import plans

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = hpfunc.Mesh({"fsdp": 2})

    def step(state, batch):
        loss, g = hpfunc.value_and_grad(lambda p: ((batch @ p["w"]) ** 2).mean())(state["params"])
        return {"params": {"w": state["params"]["w"] - 0.1 * g["w"]}, "m": state["m"]}, {"loss": loss}

    ts = hpfunc.parallelize(step, mesh, plans.fsdp("fsdp"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        w = ts.shard_params({"w": torch.ones(4, 3)})
        state = ts.init_state(lambda p: {"params": p, "m": {"w": torch.zeros_like(p["w"])}}, w)
        for _ in range(2):
            new, metrics = ts(state, torch.ones(8, 4))
            assert new["params"]["w"] is not state["params"]["w"] and new["m"]["w"].shape == (4, 3)
            assert isinstance(new["params"]["w"]._local_tensor, FakeTensor), type(new["params"]["w"]._local_tensor)
            assert new["params"]["w"].shape == (4, 3) and new["params"]["w"].placements == state["m"]["w"].placements
            state = new
    print("ok", tuple(metrics["loss"].shape))
""")


def test_fsdp_step_runs_under_fake_tensor_mode_and_fake_process_group():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("HPFUNC_CHECK_REP", None)  # the exact check reads values: a fake run has none
    out = subprocess.run([sys.executable, "-c", _FAKE], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0 and "ok ()" in out.stdout, out.stderr[-3000:]


@pytest.mark.multirank
def test_gradient_all_reduces_start_while_the_backward_runs(pools):
    """DDP: each layer's gradients are all-reduced as soon as that layer's backward is done, before the
    backward reaches the first op of the model (the comm counter sees them issued by then, and waited
    for after it), in one bucket per layer plus one for the top-level parameters, with the bytes of one
    all-reduce of all."""
    for out in pools(2).run(L.run_reductions_during_backward, "ddp"):
        assert out["before_first_layer_backward"] == 2, out  # layers.1 and layers.0, not yet the top bucket
        assert out["all_reduces"] == 3 and out["phases"] == ["backward"], out
        assert out["bytes"] == 4 * (8 * 4 + 2 * 2 * 16 + 3), out  # every parameter once, fp32
        # the trace: both layers' all-reduces were issued before the first op's backward ran and waited for
        # after it (the comm counter's issue and wait times)
        assert out["overlapped"] == 2, out
        # gradient hooks only for the buckets started during the backward (layers.1 and layers.0: wq, wo
        # each); the last bucket (the top-level parameters) starts as the backward returns, hook-free
        assert out["hooks"] == 4, out
        # under the default cap the small model is one bucket: one all-reduce (with the loss riding it) in
        # the backward's phase, and no gradient hook at all
        assert out["one_bucket"] == [("all_reduce", "backward", 4 * (8 * 4 + 2 * 2 * 16 + 3))], out
        assert out["one_bucket_hooks"] == 0, out


@pytest.mark.multirank
@pytest.mark.parametrize("reshard,remat,mixed", [
    (True, False, None), (False, False, None), (True, True, None), (True, "dots_saveable", None),
    (True, False, ("float64", None)), (True, "dots_saveable", ("bfloat16", "float32"))])
def test_fsdp_forward_prefetches_the_next_layer_while_this_one_computes(pools, reshard, remat, mixed):
    """FSDP: from the second step on, gathering layer 0 issues layer 1's all-gather before layer 0
    computes (3 forward gathers seen by then: embed, layers.0, layers.1; the first step, which records
    the order of reads, 2); with reshard after forward, the backward's re-gather of layer 1 issues layer
    0's before layer 1's backward computes (2 backward gathers seen when the backward leaves layer 1;
    the first step, which records the order of re-gathers, 1); the backward issues the layers'
    reduce-scatters without waiting; with the bytes of every phase unchanged from step to step and
    losses and parameters equal to one device's over 3 steps (a remat's recompute re-gathers in its
    turn, landing the prefetched group, never gathering or prefetching twice; under a selective policy
    too, whose recompute must run the forward's ops). Under mixed precision the same, the gathers
    moving the compute dtype: fp64 compute (its reduce dtype fp64, not the fp32 storage's) equals the
    fp32 device at fp32's tolerance; bf16 compute with an fp32 reduction at bf16's."""
    from hpfunc.testing import assert_trees_close
    from hpfunc.testing.parity import tolerance

    itemsize = 4 if mixed is None else getattr(torch, mixed[0]).itemsize
    rtol, atol = (1e-5, 1e-7) if mixed is None or mixed[0] != "bfloat16" else tolerance(torch.bfloat16)
    for out in pools(2).run(L.run_prefetch, reshard, remat, mixed):
        assert out["seen"] == [2, 3, 3], out["seen"]
        # both layers' gradient reduce-scatters were issued without waiting before the backward reached the
        # model's first op (the step waits for them after the backward)
        assert out["scattered"] == [2, 2, 2], out["scattered"]
        # one differentiation, of every leaf: embed, layers.0, layers.1 (the bias is replicated)
        assert list(out["orders"].values()) == [(1, 2, 4)], out["orders"]
        # re-gathered in the backward: on the first step layers.1 then layers.0 (the embedding's lookup saves no
        # weight); from the second on layers.1, the last layer the forward reads, stays gathered for the
        # backward (differentiate.kept_after_forward) and layers.0's re-gather is issued as it starts --
        # unless a remat's recompute reads layers.1 again (then nothing is kept: it would be gathered anyway)
        kept = reshard and not remat
        assert out["regathered"] == ([1, 1, 1] if kept else [1, 2, 2] if reshard else [0, 0, 0]), out["regathered"]
        # the trace, per step: gathers issued before and waited for after layer 0's forward op; backward
        # gathers in flight when the backward leaves layer 1; reduce-scatters in flight at the first op
        assert out["overlapped"] == [[0, 0, 2]] + [[1, 1 if reshard else 0, 2]] * 2, out["overlapped"]
        assert list(out["regather_orders"].values()) == [(2,) if kept else (4, 2) if reshard else ()], \
            out["regather_orders"]
        assert out["bytes"][1] == out["bytes"][2], out["bytes"]
        first, later = out["bytes"][0].pop(("all_gather", "backward"), 0), out["bytes"][1].pop(("all_gather", "backward"), 0)
        assert out["bytes"][0] == out["bytes"][1], out["bytes"]  # every other phase and collective: the same
        # the layers' two 4 x 4 weights each, gathered again in the compute dtype: both layers on the first
        # step, layers.0 only after it (both with a remat)
        layer = 2 * 16 * itemsize
        assert (first, later) == ((2 * layer, layer) if kept else (2 * layer, 2 * layer) if reshard else (0, 0)), \
            out["bytes"]
        assert_trees_close(torch.tensor(out["losses"]), torch.tensor(out["ref_losses"]), rtol=rtol, atol=atol, what="losses")
        assert_trees_close(out["params"], out["ref_params"], rtol=rtol, atol=atol, what="params")
