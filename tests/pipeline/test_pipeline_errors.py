"""Bad input gives clear ValueErrors; stage functions run exactly where the schedule has work."""

from __future__ import annotations

import pytest
import torch

import hpfunc
from hpfunc.schedules import one_f_one_b, zbv
from hpfunc.transforms.pipeline import PipelineError, pipeline_map, split_microbatches


def _fns(n):
    return [lambda p, x: x @ p["w"] for _ in range(n)]


def _loss(y, mb):
    return (y ** 2).mean()


def _first(mb):
    return mb["x"]


def catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report it to the test process
        return type(e).__name__, isinstance(e, ValueError), str(e)
    return None


def bad_inputs():
    pp = hpfunc.Mesh({"pp": 2})
    step = pipeline_map(_fns(2), one_f_one_b(2, 4), pp, loss_fn=_loss, first_input=_first)
    params = {s: {"w": torch.eye(3)} for s in step.local_stages}
    return {
        "batch": catch(lambda: step(params, {"x": torch.randn(6, 3)})),
        "stages": catch(lambda: pipeline_map(_fns(3), one_f_one_b(2, 4), pp, loss_fn=_loss)),
        "v_stages": catch(lambda: pipeline_map(_fns(2), zbv(2, 4), pp, loss_fn=_loss)),
        "axis": catch(lambda: pipeline_map(_fns(2), one_f_one_b(2, 4), hpfunc.Mesh({"dp": 2}), loss_fn=_loss)),
        "ranks": catch(lambda: pipeline_map(_fns(4), one_f_one_b(4, 4), pp, loss_fn=_loss)),
        "fsdp": catch(lambda: pipeline_map(_fns(2), one_f_one_b(2, 4), hpfunc.Mesh({"pp": 2, "fsdp": 1}),
                                           loss_fn=_loss, fsdp_axis="fsdp")),
        "params": catch(lambda: step({}, {"x": torch.randn(8, 3)})),
    }


@pytest.mark.multirank
def test_bad_inputs(pool2):
    res = pool2.run0(bad_inputs)
    expect = {
        "batch": "batch size 6.*multiple of schedule.num_microbatches=4",
        "stages": "got 3 stage functions but schedule .* has 2 stages",
        "v_stages": "got 2 stage functions but schedule .* has 4 stages",
        "axis": "has no pipeline axis 'pp'.*axes are \\('dp',\\)",
        "ranks": "runs on ranks \\(0, 1, 2, 3\\) but mesh axis 'pp' has size 2",
        "fsdp": "fsdp_axis given but the schedule has no UNSHARD/REDUCE_GRAD",
        "params": "holds stages \\(\\d,\\) but params has no entry",
    }
    import re

    for key, pattern in expect.items():
        assert res[key] is not None, key
        name, is_value_error, msg = res[key]
        assert is_value_error and name in ("PipelineError", "ValueError"), (key, name, msg)
        assert re.search(pattern, msg), (key, msg)


def test_split_microbatches():
    batch = {"x": torch.arange(8).reshape(8, 1), "meta": "kept"}
    mbs = split_microbatches(batch, 4)
    assert [mb["x"].flatten().tolist() for mb in mbs] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(mb["meta"] == "kept" for mb in mbs)
    with pytest.raises(PipelineError, match="'x' \\(batch size 8\\) into 3 microbatches"):
        split_microbatches(batch, 3)


def counted_run():
    """Each local stage function runs exactly m times (no padding or bubble microbatches)."""
    mesh = hpfunc.Mesh({"pp": 2})
    calls = []

    def make(s):
        def fn(p, x):
            calls.append(s)
            return torch.tanh(x @ p["w"])
        return fn

    m = 4
    step = pipeline_map([make(s) for s in range(4)], zbv(2, m), mesh, loss_fn=_loss, first_input=_first)
    params = {s: {"w": torch.eye(3) * (1 + s)} for s in range(4)}   # all stages: each rank picks its own
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    loss, grads = step(params, {"x": x})
    finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(g["w"]).all()) for g in grads.values())
    assert sorted(grads) == list(step.local_stages)
    return sorted(calls), step.local_stages, finite


@pytest.mark.multirank
def test_stage_calls_exact(pool2):
    for calls, stages, finite in pool2.run(counted_run):
        assert calls == sorted(s for s in stages for _ in range(4))
        assert finite


def headers_and_shape_changes():
    """Forward messages name their shapes in a header the first time a (stage, microbatch, microbatch
    shapes) key passes, and never again: steps 1 and 2 on one batch shape, then a new batch shape
    (headers again), then the first shape (none). A stage whose outputs change shape for the same key
    is an error at the sender, before anything is sent."""
    from hpfunc.schedules import Action, ActionKind

    pp = hpfunc.Mesh({"pp": 2})
    step = pipeline_map(_fns(2), one_f_one_b(2, 4), pp, loss_fn=_loss, first_input=_first)
    params = {s: {"w": torch.eye(3) * (s + 1)} for s in step.local_stages}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 3, generator=g), None, torch.randn(16, 3, generator=g), None]
    batches[1], batches[3] = batches[0], batches[0]
    headers, losses = [], []
    for x in batches:
        with hpfunc.comm_stats() as stats:
            loss, _ = step(params, {"x": x})
        headers.append(sum(r.tag == "header" for r in stats.records))
        losses.append(float(loss))
    send = Action(ActionKind.SEND_F, 0, 0, peer=1)
    mb = {"x": torch.zeros(2, 5)}
    first = step._forward_header([torch.zeros(2, 3)], send, mb)
    again = step._forward_header([torch.zeros(2, 3)], send, mb)
    changed = catch(lambda: step._forward_header([torch.zeros(2, 4)], send, mb))
    return {"headers": headers, "losses": losses, "first": first, "again": again, "changed": changed}


@pytest.mark.multirank
def test_forward_headers_only_until_the_shapes_are_known(pool2):
    out = pool2.run(headers_and_shape_changes)
    assert out[0]["headers"] == [4, 0, 4, 0] and out[1]["headers"] == [0, 0, 0, 0]
    for o in out:
        assert o["losses"][1] == o["losses"][0] == o["losses"][3]
        assert o["first"] is True and o["again"] is False
        name, is_value_error, msg = o["changed"]
        assert name == "PipelineError" and is_value_error
        assert "now outputs [((2, 4), torch.float32)]" in msg and "must follow from its microbatch's shapes" in msg
