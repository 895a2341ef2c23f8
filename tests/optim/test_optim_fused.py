"""``update_and_apply``: AdamW's fused update-and-apply equals torch's fused AdamW bit for bit (it runs
torch's fused kernel), its foreach form (where that kernel does not apply) torch's foreach AdamW, and
the two-call path (``update`` then ``apply_updates``) both to rounding, with the same state."""

from __future__ import annotations

import optree
import pytest
import math

import torch
from hypothesis import given, settings, strategies as st

from hpfunc import optim

from _optim_helpers import grad_sequence, randn, torch_steps, one_intra_op_thread  # noqa: F401 (autouse fixture)

STEPS = 12
SHAPES = st.sampled_from([
    {"w": (3, 5)},
    {"w": (8, 4), "b": (4,)},
    {"scalar": (), "v": (7,), "m": (2, 3, 4)},
    {"emb": (16, 8), "head": (8, 16), "norm": (8,)},
])


def _decays(path: str, x: torch.Tensor) -> bool:
    return x.ndim >= 2


def torch_adamw(params0, grads, *, lr, b1, b2, eps, wd, schedule=None, masked=False, fused=False) -> dict:
    """``torch.optim.AdamW(foreach=True)`` (``fused=True`` with ``fused``); with ``masked`` the 1-d and 0-d
    leaves in a group without decay."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in params0.items()}
    if masked:
        groups = [{"params": [p for p in params.values() if p.ndim >= 2]},
                  {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    else:
        groups = [{"params": list(params.values())}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                            **({"fused": True} if fused else {"foreach": True}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule(step) / lr) if schedule else None
    return torch_steps(opt, params, grads, sched)


def fused_run(params0, grads, tx, *, donate: bool = False) -> tuple[dict, object]:
    params = {k: v.clone() for k, v in params0.items()} if donate else dict(params0)
    state = tx.init(params)
    for g in grads:
        params, state = optim.update_and_apply(tx, g, state, params, donate=donate)
    return params, state


def two_call_run(params0, grads, tx) -> tuple[dict, object]:
    params, state = dict(params0), tx.init(params0)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


@settings(max_examples=25, deadline=None)
@given(shapes=SHAPES, lr=st.floats(1e-4, 0.1), b1=st.sampled_from([0.0, 0.9, 0.95]),
       b2=st.sampled_from([0.9, 0.999]), eps=st.sampled_from([1e-8, 1e-3]), wd=st.sampled_from([0.0, 0.1]),
       use_schedule=st.booleans(), masked=st.booleans(), seed=st.integers(0, 2**16),
       chunk=st.sampled_from([1 << 20, 1, 24, 100]), donate=st.booleans(), kernel=st.booleans())
def test_fused_adamw_is_torch_adamw_bit_for_bit(shapes, lr, b1, b2, eps, wd, use_schedule, masked, seed, chunk,
                                                donate, kernel):
    """With torch's fused kernel, torch's ``AdamW(fused=True)``; without it (the foreach form, here forced)
    torch's ``AdamW(foreach=True)``, also with the leaves cut into groups of ``chunk`` elements (one leaf
    per group at 1). Both also with the state donated (written in place)."""
    from hpfunc.optim import adamw_apply

    params0 = {k: randn(s, seed=seed + i) for i, (k, s) in enumerate(sorted(shapes.items()))}
    grads = grad_sequence(shapes, STEPS, seed)
    schedule = (optim.linear_warmup_cosine_decay(0.0, lr, warmup_steps=3, decay_steps=9, end_value=lr / 10)
                if use_schedule else None)
    tx = optim.adamw(schedule or lr, b1, b2, eps, weight_decay=wd, mask=_decays if masked else None)
    expected = torch_adamw(params0, grads, lr=lr, b1=b1, b2=b2, eps=eps, wd=wd, schedule=schedule, masked=masked,
                           fused=kernel)
    saved = adamw_apply._CHUNK_ELEMENTS, adamw_apply._FUSED
    adamw_apply._CHUNK_ELEMENTS, adamw_apply._FUSED = chunk, (saved[1] if kernel else None)
    try:
        got, _ = fused_run(params0, grads, tx, donate=donate)
    finally:
        adamw_apply._CHUNK_ELEMENTS, adamw_apply._FUSED = saved
    for k in expected:
        assert torch.equal(got[k], expected[k]), f"{k}: max |diff| {(got[k] - expected[k]).abs().max():.3e}"
    two, _ = two_call_run(params0, grads, tx)  # the chain rounds differently, within a few ulps
    for k in expected:
        torch.testing.assert_close(two[k], expected[k], atol=1e-6, rtol=2e-6)


def test_the_state_is_the_chains_and_the_paths_interchange_step_by_step():
    """Fused and two-call steps alternate freely: same state structure, counts and moments."""
    shapes = {"emb": (16, 8), "head": (8, 16), "norm": (8,)}
    params0 = {k: randn(s, i) for i, (k, s) in enumerate(sorted(shapes.items()))}
    grads = grad_sequence(shapes, 6, 4)
    tx = optim.chain(optim.clip_by_global_norm(0.5),
                     optim.adamw(optim.linear(1e-2, 1e-3, 6), weight_decay=0.1, mask=_decays))
    assert isinstance(tx.update, optim.FusedUpdate)
    params, state = dict(params0), tx.init(params0)
    for i, g in enumerate(grads):
        if i % 2:
            params, state = optim.update_and_apply(tx, g, state, params)
        else:
            u, state = tx.update(g, state, params)
            params = optim.apply_updates(params, u)
    ref, ref_state = two_call_run(params0, grads, tx)
    assert optree.tree_structure(state) == optree.tree_structure(ref_state)
    for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(ref_state)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    for k in ref:
        torch.testing.assert_close(params[k], ref[k], atol=1e-7, rtol=1e-6)
    assert int(state[1][0].count) == 6 and int(state[1][2].count) == 6  # adam's and the schedule's counts


def test_leaves_it_cannot_fuse_take_the_two_call_path():
    """bf16 params (fp32 moments) and frozen (None) leaves: the same as update then apply_updates."""
    params = {"w": randn((4, 4), 0, torch.bfloat16), "b": randn((4,), 1, torch.bfloat16), "frozen": None}
    grads = {"w": randn((4, 4), 2, torch.bfloat16), "b": randn((4,), 3, torch.bfloat16), "frozen": None}
    tx = optim.adamw(1e-2, weight_decay=0.1)
    got, state = optim.update_and_apply(tx, grads, tx.init(params), params)
    u, ref_state = tx.update(grads, tx.init(params), params)
    ref = optim.apply_updates(params, u)
    assert got["frozen"] is None and got["w"].dtype == torch.bfloat16
    for k in ("w", "b"):
        assert torch.equal(got[k], ref[k])
    assert state[0].mu["w"].dtype == torch.float32


def test_only_chains_ending_in_a_fused_transformation_fuse():
    adamw = optim.adamw(1e-3)
    assert isinstance(optim.chain(optim.clip_by_global_norm(1.0), adamw).update, optim.FusedUpdate)
    assert not isinstance(optim.chain(adamw, optim.scale(2.0)).update, optim.FusedUpdate)
    params = {"w": torch.ones(3)}
    tx = optim.chain(adamw, optim.scale(2.0))  # not fused: update_and_apply is update + apply_updates
    got, _ = optim.update_and_apply(tx, {"w": torch.ones(3)}, tx.init(params), params)
    u, _ = tx.update({"w": torch.ones(3)}, tx.init(params), params)
    assert torch.equal(got["w"], optim.apply_updates(params, u)["w"])


def test_inputs_are_not_modified_and_errors_are_the_chains():
    params = {"w": torch.ones(2, 2)}
    grads = {"w": torch.full((2, 2), 0.5)}
    tx = optim.adamw(0.1)
    state = tx.init(params)
    before = [x.clone() for x in optree.tree_leaves((params, grads, state))]
    optim.update_and_apply(tx, grads, state, params)
    for a, b in zip(optree.tree_leaves((params, grads, state)), before):
        assert torch.equal(a, b)
    with pytest.raises(optim.TreeMismatchError, match="chain: expected a state tuple"):
        optim.update_and_apply(tx, grads, (state[0],), params)
    with pytest.raises(optim.TreeMismatchError, match="'x'"):
        optim.update_and_apply(tx, {"w": torch.ones(2, 2), "x": torch.ones(1)}, state, params)


def test_a_rate_the_dtype_cannot_hold_gives_what_the_chain_gives():
    """lr 1e39 overflows fp32: the chain's infinities, not an error from a foreach scalar."""
    params = {"w": torch.ones(2, 2)}
    grads = {"w": torch.full((2, 2), 0.5)}
    tx = optim.adamw(1e39)
    got, _ = optim.update_and_apply(tx, grads, tx.init(params), params)
    u, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(got["w"], optim.apply_updates(params, u)["w"]) and not torch.isfinite(got["w"]).any()


@settings(max_examples=15, deadline=None)
@given(shapes=SHAPES, group_bytes=st.sampled_from([0, 40, 200, 1 << 20]), use_schedule=st.booleans(),
       masked=st.booleans(), clip=st.booleans(), donate=st.booleans(), seed=st.integers(0, 2**16),
       held=st.sampled_from(["state", "params", "both"]))
def test_a_streamed_update_is_the_unstreamed_one_bit_for_bit(shapes, group_bytes, use_schedule, masked, clip, donate,
                                                            seed, held):
    """Inside ``optim.streaming_state(group_bytes)`` the moments (held in host memory: on the CPU every leaf
    is) go through the "device" by groups of at most ``group_bytes`` bytes (one leaf at least), each group a
    real copy in, updated, copied back to fresh buffers: params and state equal the unstreamed update's bit
    for bit, each step copies back once per group, and the old moments are left as they were. ``held``:
    what is streamed (the moments; the parameters, ``with_state_offload("params")``; both)."""
    from hpfunc import copy_stream
    from hpfunc.optim.adamw_apply import _byte_groups

    params0 = {k: randn(s, seed=seed + i) for i, (k, s) in enumerate(sorted(shapes.items()))}
    grads = grad_sequence(shapes, 3, seed)
    lr = 1e-2
    schedule = optim.linear_warmup_cosine_decay(0.0, lr, warmup_steps=1, decay_steps=4) if use_schedule else None
    tx = optim.adamw(schedule or lr, weight_decay=0.1, mask=_decays if masked else None)
    if clip:
        tx = optim.chain(optim.clip_by_global_norm(1.0), tx)
    expected, expected_state = fused_run(params0, grads, tx, donate=donate)
    calls: list[int] = []
    real = copy_stream.to_host

    def counting(tensors, **kw):
        calls.append(len(tensors))
        return real(tensors, **kw)

    copy_stream.to_host = counting
    try:
        with optim.streaming_state(group_bytes, state=held != "params", params=held != "state"):
            params = {k: v.clone() for k, v in params0.items()}
            state = tx.init(params)
            for g in grads:
                old = [x.clone() for x in optree.tree_leaves(state)]
                old_refs = optree.tree_leaves(state)
                params, state = optim.update_and_apply(tx, g, state, params, donate=donate)
                if held != "params" or not donate:  # the held moments are not written (donated ones on the device are)
                    assert all(torch.equal(a, b) for a, b in zip(old, old_refs))
    finally:
        copy_stream.to_host = real
    adam = state[-1][0] if clip else state[0]
    moments = sorted(shapes)  # the flattening order of a dict: sorted keys
    per = (2 if held != "params" else 0) + (1 if held != "state" else 0)  # tensors streamed per leaf
    groups = _byte_groups([4 * per * math.prod(shapes[k]) for k in moments], group_bytes)
    assert calls == [per * (b - a) for a, b in groups] * len(grads), (calls, groups)
    for k in expected:
        assert torch.equal(params[k], expected[k]), k
    for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(expected_state)):
        assert torch.equal(a, b)
    assert adam.mu.keys() == expected.keys()
