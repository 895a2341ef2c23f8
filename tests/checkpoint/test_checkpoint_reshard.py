"""Save on one mesh and plan, load on another: every tensor equal, in the target's layout.

Hypothesis draws the source among fsdp 4 (4 ranks), a 2 x 2 dp x tp mesh and fsdp 2 (2 ranks), and
loads on every other one and on one process, over the shapes (uneven ones included), dtypes and specs; and a real train state built
by ``hpfunc.parallelize(...).init_state`` with AdamW's moments, restored on another world size and
stepped on: the same as never stopping.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _ckpt_helpers as H

pytestmark = pytest.mark.multirank


MESHES = ({"fsdp": 4}, {"dp": 2, "tp": 2}, {"fsdp": 2})  # the source and target meshes drawn from


def _candidate_specs(axes: dict, ndim: int) -> list[tuple]:
    """Every spec of an ``ndim`` tensor on a mesh of ``axes``: replicated, one axis on one dim, both axes
    on one dim (a 2-axis mesh), the two axes on two dims."""
    names = list(axes)
    out = [()]
    for d in range(ndim):
        out += [(None,) * d + (a,) for a in names]
        if len(names) == 2:
            out.append((None,) * d + (tuple(names),))
    if ndim == 2 and len(names) == 2:
        out += [tuple(names), tuple(reversed(names))]
    return out


@st.composite
def states(draw):
    """``(leaves, source mesh, its specs, [(target mesh, its specs)])``: one to three leaves (uneven sizes
    included), a source mesh and every other mesh plus one process as targets, a spec per leaf each."""
    n = draw(st.integers(1, 3))
    leaves = []
    for i in range(n):
        ndim = draw(st.integers(1, 2))
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
        leaves.append((f"w{i}", shape, draw(st.sampled_from(sorted(H.DTYPES)))))

    def specs(axes):
        return {name: draw(st.sampled_from(_candidate_specs(axes, len(shape)))) for name, shape, _ in leaves}

    source = draw(st.sampled_from(MESHES))
    targets = [(axes, specs(axes)) for axes in MESHES if axes != source] + [(None, None)]
    return leaves, source, specs(source), targets


def _assert_equal_state(got: dict, want: dict) -> None:
    assert got["step"] == want["step"] and got["config"] == want["config"]
    assert torch.equal(got["rng"], want["rng"])
    assert set(got["params"]) == set(want["params"])
    for k, w in want["params"].items():
        g = got["params"][k]
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(g, w), k


def _layout(name_shape_dtype, spec, mesh) -> str:
    """The typeof string a leaf of that spec must have (``f32[8@fsdp,4]``)."""
    from hpfunc.sharding import _DTYPE_SHORT

    _, shape, dtype = name_shape_dtype
    dims = []
    for d, s in enumerate(shape):
        part = spec[d] if d < len(spec) else None
        axes = () if part is None else (part,) if isinstance(part, str) else part
        dims.append(str(s) if not axes else f"{s}@{axes[0]}" if len(axes) == 1 else f"{s}@({','.join(axes)})")
    return f"{_DTYPE_SHORT[H.DTYPES[dtype]]}[{','.join(dims)}]"


@settings(max_examples=3)
@given(case=states(), seed=st.integers(0, 2**16))
def test_a_checkpoint_loads_on_every_other_mesh_and_one_process(pools, tmp_path_factory, case, seed):
    leaves, source, source_specs, targets = case
    path = str(tmp_path_factory.mktemp("ckpt") / "step")
    pools(H.world(source)).run(H.save_sharded, path, leaves, seed, source, source_specs)
    want = H.full_state(leaves, seed)
    for axes, specs in targets:
        state, layouts = pools(H.world(axes)).run0(H.load_sharded, path, leaves, seed, axes, specs)
        _assert_equal_state(state, want)
        for leaf in leaves:
            spec = specs[leaf[0]] if specs else ()
            expected = _layout(leaf, spec, axes)
            assert layouts[leaf[0]] == expected, (source, axes, leaf, layouts[leaf[0]], expected)


def test_parallelize_train_state_restores_on_another_world_size(pools, tmp_path):
    path = str(tmp_path / "step_1")
    ref = pools(4).run0(H.train_and_save, path)
    for n, axes in ((2, {"fsdp": 2}), (1, {"fsdp": 1})):
        out = pools(n).run0(H.restore_and_step, path, axes)
        assert out["specs_ok"]
        # the restored state is the saved one exactly: params, AdamW's count, mu and nu, the step
        for (pa, a), (pb, b) in zip(_pairs(out["restored"]), _pairs(ref["saved"])):
            assert pa == pb
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), pa
        moments = [p for p, x in _pairs(out["restored"]) if p.startswith("opt.") and p.endswith(".w_in")]
        assert len(moments) == 2, moments  # AdamW's mu and nu of w_in, restored sharded
        # and stepping on from it gives what the 4-rank run computed next (reduction order differs)
        torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        for (pa, a), (_, b) in zip(_pairs(out["next"]), _pairs(ref["next"])):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=pa)


def _pairs(state):
    from hpfunc import tree

    return tree.leaves_with_paths(state)



def test_qwen3_moe_train_state_saved_on_fsdp4_restores_on_other_meshes_and_plans(pools, tmp_path):
    # the trainer's Qwen3-MoE state (params, AdamW moments) under hpfunc.parallelize, saved on fsdp 4;
    # each target is the state that plan lays out on its mesh (init_state with its state_specs)
    path = str(tmp_path / "step_2")
    saved = pools(4).run0(H.moe_train_and_save, path, 2)
    for n, axes, plan in ((2, {"fsdp": 2}, ["fsdp"]), (4, {"dp": 2, "tp": 2}, ["ddp", "tp"]),
                          (4, {"ep": 2, "fsdp": 2}, ["ep", "fsdp"]), (1, None, None)):
        out = pools(n).run0(H.moe_restore, path, axes, plan)
        a, b = _pairs(out["state"]), _pairs(saved)
        assert [p for p, _ in a] == [p for p, _ in b]
        moments = [x for _, x in _pairs(out["state"].opt_state) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        assert len(moments) > 40 and all(bool(m.ne(0).any()) for m in moments) and int(out["state"].step) == 2
        for (p, x), (_, y) in zip(a, b):
            assert (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y, (plan, p)
        experts = out["layouts"]["layers"][0]["moe"]["experts"]["w_gate"]
        assert experts == {"fsdp": "f32[8@fsdp,32,64]", "ep": "f32[8@ep,32@fsdp,64]"}.get(
            plan[0] if plan else None, experts), (plan, experts)
        if plan == ["ddp", "tp"]:
            assert "@tp" in out["layouts"]["layers"][0]["attn"]["wq"], out["layouts"]
