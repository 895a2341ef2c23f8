"""remat gives the gradients of the unwrapped function exactly, for every policy, name set and nesting."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfunc
from _remat_block import NAMES, BlockConfig, assert_equal_trees, block, init_block, stack_loss
from hpfunc.transforms import remat as R
from hpfunc.transforms.offload import offload

CFG = BlockConfig()


def setup(layers: int = 2, seed: int = 0):
    ps = [init_block(CFG, seed=seed + i) for i in range(layers)]
    x = torch.randn(2, 8, CFG.hidden, generator=torch.Generator().manual_seed(seed + 100))
    return ps, x


def grads(loss, ps, x):
    value, g = hpfunc.value_and_grad(loss, argnums=(0, 1))(ps, x)
    return value, g


def reference(ps, x):
    return grads(lambda ps, x: stack_loss(ps, x, CFG), ps, x)


POLICIES = {
    "nothing_saveable": R.nothing_saveable,
    "everything_saveable": R.everything_saveable,
    "dots_saveable": R.dots_saveable,
    "dots_with_no_batch_dims_saveable": R.dots_with_no_batch_dims_saveable,
    "save_only_these_names": R.save_only_these_names("q", "k", "v", "mlp_hidden"),
    "save_any_names_but_these": R.save_any_names_but_these("attn_out", "mlp_hidden"),
    "save_and_offload_only_these_names": R.save_and_offload_only_these_names(
        names_which_can_be_saved=["q"], names_which_can_be_offloaded=["k", "v", "mlp_hidden"]),
    "save_from_both_policies": R.save_from_both_policies(R.dots_with_no_batch_dims_saveable,
                                                         R.save_only_these_names("attn_out")),
    "predicate": lambda op, name, t: t.numel() >= 256 and name is not None,
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_policy_matches_unwrapped(name):
    ps, x = setup()
    ref = reference(ps, x)
    layer = R.remat(block, policy=POLICIES[name])
    out = grads(lambda ps, x: stack_loss(ps, x, CFG, layer_fn=layer), ps, x)
    assert_equal_trees(ref, out)


def _policy(draw_kind: str, names: frozenset, saved: frozenset):
    if draw_kind == "only":
        return R.save_only_these_names(*names)
    if draw_kind == "but":
        return R.save_any_names_but_these(*names)
    if draw_kind == "swap":
        return R.save_and_offload_only_these_names(names_which_can_be_saved=names - saved,
                                                   names_which_can_be_offloaded=names & saved)
    return POLICIES[draw_kind]


policy_st = st.builds(
    _policy,
    st.sampled_from(["only", "but", "swap", "nothing_saveable", "everything_saveable", "dots_saveable",
                     "dots_with_no_batch_dims_saveable", "predicate"]),
    st.frozensets(st.sampled_from(NAMES), min_size=1),
    st.frozensets(st.sampled_from(NAMES)),
)


@settings(max_examples=25, deadline=None)
@given(outer=st.none() | policy_st, inner=st.none() | policy_st, inner_offload=st.booleans(),
       seed=st.integers(0, 3))
def test_policies_names_and_nesting(outer, inner, inner_offload, seed):
    """Per-layer remat (or offload), inside an optional remat of the whole loss."""
    ps, x = setup(seed=seed)
    ref = reference(ps, x)
    layer = block
    if inner is not None:
        layer = R.remat(layer, policy=inner)
    if inner_offload:
        layer = offload(layer)
    loss = lambda ps, x: stack_loss(ps, x, CFG, layer_fn=layer)  # noqa: E731
    if outer is not None:
        loss = R.remat(loss, policy=outer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.UnknownNameWarning)
        out = grads(loss, ps, x)
    assert_equal_trees(ref, out)


def test_remat_inside_remat_inside_remat():
    ps, x = setup(layers=3)
    ref = reference(ps, x)
    inner = R.remat(block, policy=R.save_only_these_names("q"))

    def two(ps, x, cfg):
        return inner(ps[1], inner(ps[0], x, cfg), cfg)

    mid = R.remat(two, policy=R.dots_saveable)

    def loss(ps, x):
        h = mid(ps[:2], x, CFG)
        h = inner(ps[2], h, CFG)
        return (h ** 2).mean()

    assert_equal_trees(ref, grads(R.remat(loss), ps, x))


def test_decorator_forms_and_pytree_io():
    @R.remat
    def f(tree):
        return {"y": torch.tanh(tree["a"] @ tree["b"]), "n": 3}

    @R.remat(policy=R.dots_saveable)
    def g(tree):
        return {"y": torch.tanh(tree["a"] @ tree["b"]), "n": 3}

    tree = {"a": torch.randn(3, 4), "b": torch.randn(4, 2)}
    want = hpfunc.grad(lambda t: torch.tanh(t["a"] @ t["b"]).sum())(tree)
    for fn in (f, g):
        out = hpfunc.grad(lambda t: fn(t)["y"].sum())(tree)
        assert_equal_trees(want, out)
        assert fn(tree)["n"] == 3


def test_checkpoint_name_is_identity_on_trees():
    t = {"a": torch.randn(3), "b": [torch.randn(2)], "c": None}
    out = R.checkpoint_name(t, "x")
    assert torch.equal(out["a"], t["a"]) and out["a"].data_ptr() == t["a"].data_ptr()
    assert out["c"] is None
    with pytest.raises(TypeError, match="name must be a string"):
        R.checkpoint_name(t["a"], 3)


def test_policy_sees_the_name_on_the_tagged_op():
    seen = []

    def spy(op, name, t):
        if name is not None:
            seen.append((str(op), name, tuple(t.shape)))
        return False

    ps, x = setup(layers=1)
    hpfunc.grad(R.remat(lambda p, x: block(p, x, CFG).sum(), policy=spy))(ps[0], x)
    names = [n for _, n, _ in seen]
    assert names == list(NAMES)
    assert all(op == "aten.alias.default" for op, _, _ in seen)


def test_unknown_name_warns_with_known_names():
    ps, x = setup(layers=1)
    layer = R.remat(block, policy=R.save_only_these_names("q", "querry"))
    with pytest.warns(R.UnknownNameWarning, match=r"\['querry'\].*names tagged: .*attn_out.*q") as rec:
        hpfunc.grad(lambda p, x: layer(p, x, CFG).sum())(ps[0], x)
    assert len(rec) == 1


def test_known_names_do_not_warn():
    ps, x = setup(layers=1)
    layer = R.remat(block, policy=R.save_only_these_names("q", "k"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", R.UnknownNameWarning)
        hpfunc.grad(lambda p, x: layer(p, x, CFG).sum())(ps[0], x)


def test_rng_is_replayed_in_recompute():
    def f(w, x):
        return (torch.nn.functional.dropout(x @ w, 0.5, training=True) ** 2).sum()

    w, x = torch.randn(4, 4), torch.randn(3, 4)
    torch.manual_seed(0)
    want = hpfunc.grad(f)(w, x)
    torch.manual_seed(0)
    got = hpfunc.grad(R.remat(f))(w, x)
    assert torch.equal(want, got)


def test_bad_policy_type():
    with pytest.raises(TypeError, match="remat policy"):
        R.remat(block, policy=3)
    with pytest.raises(ValueError, match="both to save and to offload"):
        R.save_and_offload_only_these_names(names_which_can_be_saved=["q"], names_which_can_be_offloaded=["q"])


def test_in_place_ops_on_cached_values_are_replayed_once():
    # Like a collective's all_reduce_: an op mutates a buffer a policy cached. The cache entry is
    # evicted (recomputed), so the replayed mutation is applied once, not on top of the cached value.
    def f(w, x):
        y = x @ w
        y.mul_(3.0)
        return torch.tanh(y).sum()

    w, x = torch.randn(4, 4), torch.randn(3, 4)
    want = hpfunc.grad(f)(w, x)
    for pol in (lambda op, name, t: True, R.dots_saveable):
        assert torch.equal(hpfunc.grad(R.remat(f, policy=pol))(w, x), want)


def test_tags_are_per_thread():
    # Tag names live in context variables: two threads remat-ing at once see only their own names.
    import threading

    ps, x = setup(layers=1)
    want = hpfunc.grad(lambda p: block(p, x, CFG).sum())(ps[0])
    results, errors = {}, []

    def work(k):
        try:
            seen = []

            def spy(op, name, t):
                if name is not None:
                    seen.append(name)
                return name == "q"

            for _ in range(5):
                g = hpfunc.grad(R.remat(lambda p: block(p, x, CFG).sum(), policy=spy))(ps[0])
                assert_equal_trees(want, g)
            results[k] = seen
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0] == results[1] == list(NAMES) * 5
