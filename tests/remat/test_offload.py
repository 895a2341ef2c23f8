"""offload: same gradients, and the bytes resident on device after forward drop by what the policy names."""

from __future__ import annotations

import warnings

import pytest
import torch

import hpfunc
from _remat_block import BlockConfig, assert_equal_trees, block, init_block, stack_loss
from hpfunc.memory import saved_activations
from hpfunc.transforms.remat import saved_activations as saved_under_policy
from hpfunc.transforms import remat as R
from hpfunc.transforms import offload as O

CFG = BlockConfig()


def setup(layers: int = 2, seed: int = 0):
    ps = [init_block(CFG, seed=seed + i) for i in range(layers)]
    x = torch.randn(2, 8, CFG.hidden, generator=torch.Generator().manual_seed(seed + 100))
    return ps, x


def grads(loss, ps, x):
    return hpfunc.value_and_grad(loss, argnums=(0, 1))(ps, x)


def reference(ps, x):
    return grads(lambda ps, x: stack_loss(ps, x, CFG), ps, x)


@pytest.mark.parametrize("kind", ["everything", "names", "dots", "predicate", "fused", "swap_policy"])
def test_offload_gradients_match(kind):
    ps, x = setup()
    layer = {
        "everything": O.offload(block),
        "names": O.offload(block, policy=O.offload_only_these_names("q", "mlp_hidden")),
        "dots": O.offload(block, policy=O.offload_dots()),
        "predicate": O.offload(block, policy=lambda op, name, t: t.numel() > 200),
        "fused": O.offload(block, bucket_bytes=1 << 20),
        "swap_policy": O.offload(block, policy=R.save_and_offload_only_these_names(
            names_which_can_be_saved=["q"], names_which_can_be_offloaded=["k", "v"])),
    }[kind]
    assert_equal_trees(reference(ps, x), grads(lambda ps, x: stack_loss(ps, x, CFG, layer_fn=layer), ps, x))


def test_remat_with_offloaded_names_matches_and_moves_bytes():
    ps, x = setup(layers=1)
    pol = R.save_and_offload_only_these_names(names_which_can_be_saved=["q"],
                                              names_which_can_be_offloaded=["k", "v", "mlp_hidden"])
    saved_only = R.save_only_these_names("q", "k", "v", "mlp_hidden")
    a = saved_under_policy(block, ps[0], x, CFG, policy=saved_only, state_argnums=(0,))
    b = saved_under_policy(block, ps[0], x, CFG, policy=pol, state_argnums=(0,))
    named = a.by_name()
    moved = named["k"] + named["v"] + named["mlp_hidden"]
    assert b.host_bytes == moved
    assert b.device_bytes == a.device_bytes - moved
    assert set(b.by_name("host")) == {"k", "v", "mlp_hidden"}


def per_layer_named_bytes(names):
    ps, x = setup(layers=1)
    base = saved_activations(block, ps[0], x, CFG, state_argnums=(0,))
    return base, sum(base.by_name()[n] for n in names)


@pytest.mark.parametrize("names", [("q",), ("k", "v"), ("attn_in", "mlp_in", "mlp_hidden")])
def test_resident_bytes_drop_by_what_the_policy_names(names):
    base, named = per_layer_named_bytes(names)
    ps, x = setup(layers=1)
    r = saved_activations(O.offload(block, policy=O.offload_only_these_names(*names)), ps[0], x, CFG,
                          state_argnums=(0,))
    assert named > 0
    assert r.host_bytes == named
    assert r.device_bytes == base.device_bytes - named
    assert set(r.by_name("host")) == set(names)


def test_every_layer_of_a_loop_offloads():
    names = ("q", "mlp_hidden")
    base, named = per_layer_named_bytes(names)
    n = 8
    ps, x = setup(layers=n)
    stats = O.OffloadStats()
    layer = O.offload(block, policy=O.offload_only_these_names(*names), stats=stats)  # one wrapper, 8 calls

    def loss(ps, x):
        return stack_loss(ps, x, CFG, layer_fn=layer)

    none = saved_activations(lambda ps, x: stack_loss(ps, x, CFG), ps, x, state_argnums=(0,))
    r = saved_activations(loss, ps, x, state_argnums=(0,))
    assert stats.per_call == [named] * n  # no silent no-op on any layer
    assert r.host_bytes == n * named
    assert r.device_bytes == none.device_bytes - n * named
    # and backward through all 8 still matches, reading layers last to first, each one asking for
    # the one before it to be brought back (prefetch) when it is first read
    stats.backward_order.clear()
    stats.prefetched.clear()
    first = stats._calls
    assert_equal_trees(reference(ps, x), grads(loss, ps, x))
    assert stats.backward_order == [first + i for i in reversed(range(n))]
    assert stats.prefetched == [(first + i, first + i - 1) for i in reversed(range(1, n))]


def test_whole_layer_swap_leaves_only_parameters_and_inputs():
    ps, x = setup(layers=1)
    base = saved_activations(block, ps[0], x, CFG, state_argnums=(0,))
    r = saved_activations(O.offload(block), ps[0], x, CFG, state_argnums=(0,))
    # what stays on device is the layer input (an argument, held by the caller anyway); params are state
    assert r.device_bytes == x.numel() * 4
    assert r.host_bytes == base.device_bytes - x.numel() * 4


def test_fusion_packs_small_tensors_into_one_copy():
    ps, x = setup(layers=1)
    plain, fused = O.OffloadStats(), O.OffloadStats()
    for stats, bucket in ((plain, 0), (fused, 1 << 20)):
        hpfunc.grad(lambda p, x: block(p, x, CFG).sum())(ps[0], x)  # warm
        f = O.offload(block, bucket_bytes=bucket, stats=stats)
        hpfunc.grad(lambda p, x: f(p, x, CFG).sum())(ps[0], x)
    assert plain.tensors_offloaded == fused.tensors_offloaded > 5
    assert plain.copies == plain.tensors_offloaded
    assert fused.copies == 1
    assert plain.offloaded_bytes == fused.offloaded_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_pinned_memory_without_cuda_says_so():
    with pytest.warns(O.MemoryKindWarning, match="pinned_host.*no(ne)?"):
        O.offload(block, memory_kind="pinned_host")
    with pytest.raises(ValueError, match="no CUDA device"):
        O.stream_to({"w": torch.ones(2)}, "cuda")
    with pytest.raises(ValueError, match="memory_kind"):
        O.offload(block, memory_kind="hbm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        O.offload(block)  # the default picks what exists


def test_offload_inside_remat_defers_to_recompute():
    ps, x = setup(layers=1)
    stats = O.OffloadStats()
    inner = O.offload(block, stats=stats)
    f = R.remat(lambda p, x: inner(p, x, CFG).sum())
    r = saved_activations(f, ps[0], x, state_argnums=(0,))
    assert stats.offloaded_bytes == 0 and r.host_bytes == 0
    assert r.device_bytes == x.numel() * 4
    assert_equal_trees(hpfunc.grad(lambda p: block(p, x, CFG).sum())(ps[0]), hpfunc.grad(f)(ps[0], x))


# ---- state offload ---------------------------------------------------------------------------


def test_offload_state_selects_by_path_and_copies():
    params = {"layers": [{"w": torch.randn(3, 3), "b": torch.randn(3)} for _ in range(2)], "step": torch.tensor(4)}
    host = O.offload_state(params, lambda path, x: path.endswith(".w"))
    for i in range(2):
        w, hw = params["layers"][i]["w"], host["layers"][i]["w"]
        assert torch.equal(w, hw) and hw.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
        assert host["layers"][i]["b"] is params["layers"][i]["b"]
    assert host["step"] is params["step"]
    back = O.stream_to(host, "cpu")
    assert_equal_trees(params, back)
    meta = O.stream_to(host, "meta", lambda p, x: p.endswith(".w"))
    assert meta["layers"][0]["w"].is_meta and meta["layers"][0]["w"].shape == (3, 3)
    assert not meta["layers"][0]["b"].is_meta
    dry = O.offload_state({"w": torch.empty(2, 5, device="meta")})
    assert dry["w"].device.type == "cpu" and dry["w"].shape == (2, 5)


def test_prefetch_streams_one_layer_ahead_and_training_matches():
    ps, x = setup(layers=4)
    host = [O.offload_state(p) for p in ps]
    pulled = []

    def source():
        for i, p in enumerate(host):
            pulled.append(i)
            yield p

    seen = []
    h = x
    for i, p in enumerate(O.prefetch(source(), "cpu", depth=1)):
        seen.append(len(pulled))  # layers already issued when layer i is handed out
        h = block(p, h, CFG)
    assert seen == [2, 3, 4, 4]
    want = x
    for p in ps:
        want = block(p, want, CFG)
    assert torch.equal(h, want)
    with pytest.raises(ValueError, match="depth"):
        next(O.prefetch(host, "cpu", depth=-1))


def test_gradients_and_optimizer_state_roundtrip_through_host():
    ps, x = setup(layers=1)
    g = hpfunc.grad(lambda p: block(p, x, CFG).sum())(ps[0])
    state = {"grads": g, "mu": hpfunc.tree.tree_map(torch.zeros_like, g)}
    host = O.offload_state(state, lambda path, leaf: path.startswith("grads") or path.startswith("mu"))
    assert_equal_trees(state, O.stream_to(host, "cpu"))


def test_offload_around_remat_moves_the_layer_inputs():
    # torch.utils.checkpoint keeps a region's inputs as saved tensors, so an enclosing offload moves
    # them: full recompute with the layer inputs in host memory.
    n = 4
    ps, x = setup(layers=n)
    layer = O.offload(R.remat(block))
    loss = lambda ps, x: stack_loss(ps, x, CFG, layer_fn=layer)  # noqa: E731
    plain = saved_activations(lambda ps, x: stack_loss(ps, x, CFG, layer_fn=R.remat(block)), ps, x,
                              state_argnums=(0,))
    r = saved_activations(loss, ps, x, state_argnums=(0,))
    per_input = x.numel() * 4
    assert plain.by_kind()["remat_input"] == n * per_input
    assert r.host_bytes == (n - 1) * per_input  # layers 1..n-1; layer 0's input is the caller's x
    assert r.device_bytes == plain.device_bytes - (n - 1) * per_input
    assert_equal_trees(reference(ps, x), grads(loss, ps, x))
