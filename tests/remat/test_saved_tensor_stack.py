"""The saved-tensor stack on one device: offload, remat, the recorder and an owning layer at any nesting.

Each nesting order is checked two ways: gradients bit-exact against the unwrapped function, and the
bytes that stay alive (``saved_activations`` measures storage liveness, not what the transforms say
they did). The owning layer models a parallelized step: it claims the parameters it gathered, so an
``offload`` nested inside leaves them to the step's re-gather instead of copying them to the host.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfunc
from _remat_block import NAMES, BlockConfig, assert_equal_trees, block, init_block, stack_loss
from hpfunc import saved_tensors
from hpfunc.memory import saved_activations
from hpfunc.memory._names import name_scope
from hpfunc.memory._recorder import current_recorder
from hpfunc.memory._storage import storage_key, storage_nbytes
from hpfunc.transforms import offload as O
from hpfunc.transforms import remat as R

CFG = BlockConfig()
# names whose storage this block's autograd saves (mlp_out feeds an add, which saves nothing)
SAVED_NAMES = tuple(n for n in NAMES if n != "mlp_out")


def setup(layers: int = 1, seed: int = 0, cfg: BlockConfig = CFG, batch: int = 2, seq: int = 8):
    ps = [init_block(cfg, seed=seed + i) for i in range(layers)]
    x = torch.randn(batch, seq, cfg.hidden, generator=torch.Generator().manual_seed(seed + 100))
    return ps, x


def grads(loss, ps, x):
    return hpfunc.value_and_grad(loss, argnums=(0, 1))(ps, x)


def reference(ps, x, cfg=CFG):
    return grads(lambda ps, x: stack_loss(ps, x, cfg), ps, x)


# ---- offload inside offload -------------------------------------------------------------------


@settings(deadline=None)
@given(inner=st.frozensets(st.sampled_from(SAVED_NAMES)), outer=st.frozensets(st.sampled_from(SAVED_NAMES)),
       seed=st.integers(0, 3), heads=st.sampled_from([(4, 2), (2, 1), (4, 4)]), seq=st.sampled_from([4, 8]))
def test_offload_inside_offload_moves_each_policys_names_once(inner, outer, seed, heads, seq):
    cfg = BlockConfig(heads=heads[0], kv_heads=heads[1])
    ps, x = setup(seed=seed, cfg=cfg, seq=seq)
    si, so = O.OffloadStats(), O.OffloadStats()
    f_in = O.offload(block, policy=O.offload_only_these_names(*inner), stats=si)
    layer = O.offload(lambda p, x, cfg: f_in(p, x, cfg), policy=O.offload_only_these_names(*outer), stats=so)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.UnknownNameWarning)  # an empty name set names nothing
        base = saved_activations(block, ps[0], x, cfg, state_argnums=(0,))
        r = saved_activations(layer, ps[0], x, cfg, state_argnums=(0,))
        named = base.by_name()

        def named_bytes(names):
            return sum(named[n] for n in names)

        # the inner one moves its names; the outer one only what the inner one handed on
        assert si.per_call[-1] == named_bytes(inner)
        assert so.per_call[-1] == named_bytes(outer - inner)
        moved = named_bytes(inner | outer)
        assert r.host_bytes == moved  # nothing copied twice: one host copy per named storage
        assert r.device_bytes == base.device_bytes - moved
        assert set(r.by_name("host")) == set(inner | outer)
        assert_equal_trees(reference(ps, x, cfg), grads(lambda ps, x: stack_loss(ps, x, cfg, layer_fn=layer), ps, x))


def test_offload_everything_inside_offload_everything_copies_once():
    ps, x = setup()
    si, so = O.OffloadStats(), O.OffloadStats()
    inner = O.offload(block, stats=si)
    layer = O.offload(lambda p, x, cfg: inner(p, x, cfg), stats=so)
    single = saved_activations(O.offload(block), ps[0], x, CFG, state_argnums=(0,))
    r = saved_activations(layer, ps[0], x, CFG, state_argnums=(0,))
    assert so.offloaded_bytes == 0 and si.offloaded_bytes == single.host_bytes > 0
    assert (r.device_bytes, r.host_bytes) == (single.device_bytes, single.host_bytes)


# ---- offload inside remat, remat inside offload -----------------------------------------------


REMAT_POLICIES = {
    "full": R.nothing_saveable,
    "dots": R.dots_saveable,
    "names": R.save_only_these_names("q", "mlp_hidden"),
    "swap": R.save_and_offload_only_these_names(names_which_can_be_saved=["q"],
                                                names_which_can_be_offloaded=["k", "v"]),
}


@pytest.mark.parametrize("policy", list(REMAT_POLICIES))
def test_offload_inside_remat_is_a_no_op_and_values_are_recomputed(policy):
    ps, x = setup(layers=2)
    stats = O.OffloadStats()
    calls = []

    def counted(p, x, cfg):
        calls.append(1)
        return block(p, x, cfg)

    inner = O.offload(counted, stats=stats)
    layer = R.remat(inner, policy=REMAT_POLICIES[policy])
    alone = saved_activations(R.remat(block, policy=REMAT_POLICIES[policy]), ps[0], x, CFG, state_argnums=(0,))
    r = saved_activations(layer, ps[0], x, CFG, state_argnums=(0,))
    # torch's checkpoint owns what the region saves: the offload moves nothing, the region keeps
    # exactly what the remat policy alone keeps (its own OFFLOAD decisions included)
    assert stats.offloaded_bytes == 0 and stats.tensors_offloaded == 0
    assert (r.device_bytes, r.host_bytes, r.by_kind()) == (alone.device_bytes, alone.host_bytes, alone.by_kind())
    calls.clear()
    assert_equal_trees(reference(ps, x), grads(lambda ps, x: stack_loss(ps, x, CFG, layer_fn=layer), ps, x))
    assert len(calls) == 4  # 2 layers, each run in forward and again in the recompute
    assert stats.offloaded_bytes == 0


def test_remat_inside_offload_offloads_the_region_input():
    ps, x = setup()

    def with_region(layer_fn):
        # the region's input is made inside the measured function (x + 1 saves nothing itself), as
        # a layer's input is the previous layer's output
        return lambda p, x: layer_fn(p, x + 1, CFG)

    plain = saved_activations(with_region(R.remat(block)), ps[0], x, state_argnums=(0,))
    r = saved_activations(with_region(O.offload(R.remat(block))), ps[0], x, state_argnums=(0,))
    input_bytes = x.numel() * x.element_size()
    assert plain.by_kind() == {"remat_input": input_bytes}
    assert r.device_bytes == 0
    assert r.host_bytes == input_bytes and r.by_kind() == {"offloaded": input_bytes}
    ps, x = setup(layers=3)  # layers 1 and 2 get their input from the layer before: offloaded
    stats = O.OffloadStats()
    layer = O.offload(R.remat(block), stats=stats)
    assert_equal_trees(reference(ps, x), grads(lambda ps, x: stack_loss(ps, x, CFG, layer_fn=layer), ps, x))
    assert stats.per_call == [0, input_bytes, input_bytes]


# ---- a layer outside offload sees what stays ----------------------------------------------------


class StoragesSeen(saved_tensors.Layer):
    """Records the storages handed to it (each once), with their bytes."""

    name = "test.storages_seen"

    def __init__(self) -> None:
        self.nbytes: dict[int, int] = {}

    def pack(self, t, outer):
        # a saved storage stays alive through the forward: its key is not reused meanwhile
        self.nbytes.setdefault(storage_key(t), storage_nbytes(t))
        return outer.pack(t)


@pytest.mark.parametrize("names", [("q",), ("k", "v", "mlp_hidden"), ()])
def test_a_layer_outside_offload_sees_what_stays(names):
    ps, x = setup()
    p = {k: v.detach().requires_grad_() for k, v in ps[0].items()}
    xi = x.detach().requires_grad_()

    def seen(layer_fn):
        lay = StoragesSeen()
        with name_scope() as names, saved_tensors.layer(lay):
            out = layer_fn(p, xi, CFG).sum()
        by_name: dict[str, int] = {}
        for key, n in lay.nbytes.items():  # named now that every tag is made (and the graph is alive)
            name = names.name_of_key(key) or "(untagged)"
            by_name[name] = by_name.get(name, 0) + n
        out.backward()
        return by_name

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.UnknownNameWarning)
        everything = seen(block)
        stays = seen(O.offload(block, policy=O.offload_only_these_names(*names)))
    assert set(names) <= set(everything)
    assert stays == {n: b for n, b in everything.items() if n not in names}


# ---- an owning layer outside offload: the FSDP step's gathered weights --------------------------


class ParameterOwner(saved_tensors.Layer):
    """A stand-in for a parallelized step's layer: it owns the parameters it "gathered" and keeps them
    (detached) whatever is nested inside. Claims only, like the step without reshard-after-forward."""

    name = "test.parameter_owner"
    needs_hooks = False

    def __init__(self) -> None:
        self.keys: set[int] = set()

    def gather(self, params: dict) -> dict:
        full = {k: v.clone() for k, v in params.items()}  # a new storage with a grad_fn, as all_gather's output
        self.keys |= {storage_key(v) for v in full.values()}
        return full

    def owns(self, t):
        return storage_key(t) in self.keys

    def pack(self, t, outer):
        # called for what it owns, and for what a layer inside hands outward (not its own: passed on)
        return t.detach() if self.owns(t) else outer.pack(t)


def owned_step(layer_fn, owner: ParameterOwner | None):
    def step(p, x):
        if owner is None:
            return layer_fn({k: v.clone() for k, v in p.items()}, x, CFG)
        with saved_tensors.layer(owner):
            return layer_fn(owner.gather(p), x, CFG)

    return step


@pytest.mark.parametrize("policy", ["everything", "dots"])
def test_an_owner_outside_offload_keeps_its_parameters_out_of_the_host_copy(policy):
    ps, x = setup()
    pol = {"everything": O.offload_everything, "dots": O.offload_dots()}[policy]
    s_plain, s_owned = O.OffloadStats(), O.OffloadStats()
    plain = saved_activations(owned_step(O.offload(block, policy=pol, stats=s_plain), None), ps[0], x,
                              state_argnums=(0,))
    owned = saved_activations(owned_step(O.offload(block, policy=pol, stats=s_owned), ParameterOwner()), ps[0], x,
                              state_argnums=(0,))
    weights = sum(v.numel() * v.element_size() for v in ps[0].values())
    # without an owner, the gathered weights (saved by the matmuls and norms) are offloaded by a policy
    # that offloads everything, and kept (handed outward) by one that offloads only matmul outputs
    moved = weights if policy == "everything" else 0
    if policy == "everything":
        kept = saved_activations(owned_step(block, None), ps[0], x, state_argnums=(0,))
        assert plain.host_bytes == kept.device_bytes - x.numel() * 4  # all but the held layer input
    # measured by liveness: the owned weights stay alive on device and no host buffer holds them
    assert owned.host_bytes == plain.host_bytes - moved > 0
    assert owned.device_bytes == plain.device_bytes + moved
    assert s_owned.offloaded_bytes == s_plain.offloaded_bytes - moved
    assert owned.by_kind()["other"] == weights  # the owner keeps them: never handed to the recorder
    ref = hpfunc.grad(lambda p: block(p, x, CFG).float().pow(2).mean())(ps[0])
    for owner in (None, ParameterOwner()):
        g = hpfunc.grad(lambda p: owned_step(O.offload(block, policy=pol), owner)(p, x).float().pow(2).mean())(ps[0])
        assert_equal_trees(ref, g)


def test_a_claim_only_layer_is_asked_under_an_outer_layer_with_hooks():
    # The owner installs no hooks of its own; the recorder outside does. Tensors saved inside the
    # owner must still be offered to its owns() first (saved_tensors installs the longer chain).
    ps, x = setup()
    owner = ParameterOwner()
    r = saved_activations(owned_step(block, owner), ps[0], x, state_argnums=(0,))
    weights = sum(v.numel() * v.element_size() for v in ps[0].values())
    by_kind = r.by_kind()
    assert by_kind["other"] == weights  # alive (the owner keeps them) but never handed to the recorder
    plain = saved_activations(owned_step(block, None), ps[0], x, state_argnums=(0,))
    assert plain.by_kind() == {"saved": by_kind["saved"] + weights}


# ---- the measurement is liveness ----------------------------------------------------------------


class _CtxHeld(torch.autograd.Function):
    """Keeps a tensor for backward as a ctx attribute: no saved-tensor hook ever sees it."""

    @staticmethod
    def forward(ctx, x):
        ctx.kept = torch.tanh(x.detach())
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * (1 - ctx.kept ** 2)


def test_storages_kept_outside_hooks_still_count():
    x = torch.randn(3, 5)
    r = saved_activations(lambda x: _CtxHeld.apply(x).sum(), x)
    assert r.by_kind() == {"other": 3 * 5 * 4}


def test_arguments_count_only_if_the_graph_keeps_them():
    # The argument copies are dropped before measuring: an index tensor counts when embedding saves
    # it, not when it is unused; a float argument used without being saved does not count either.
    w, idx = torch.randn(10, 4), torch.tensor([1, 2, 3])
    kept = saved_activations(lambda w, x, i: torch.nn.functional.embedding(i, w).sum() + x.sum(), w,
                             torch.ones(5), idx, state_argnums=(0,))
    assert kept.by_kind() == {"saved": 3 * 8} and kept.state_bytes == 0  # the gradient of w needs no w
    unused = saved_activations(lambda w, x, i: (w * 2).sum() + x.sum(), w, torch.ones(5), idx, state_argnums=(0,))
    assert unused.entries == [] and unused.state_bytes == 0


class _ClaimsToMove(saved_tensors.Layer):
    """A layer that says (to the recorder) it moved every tensor, and keeps them all on device."""

    name = "test.claims_to_move"

    def pack(self, t, outer):
        return ("kept", t.detach())

    def unpack(self, packed, outer):
        return packed[1]


def test_reports_do_not_trust_what_transforms_say():
    ps, x = setup()

    def liar(p, x):
        rec = current_recorder()
        with saved_tensors.layer(_ClaimsToMove()):
            out = block(p, x, CFG)
        rec.note(torch.ones(1000), kind="saved")  # a label on a storage that dies: not counted
        return out

    honest = saved_activations(block, ps[0], x, CFG, state_argnums=(0,))
    r = saved_activations(liar, ps[0], x, state_argnums=(0,))
    assert r.device_bytes == honest.device_bytes and r.host_bytes == 0
    assert set(r.by_kind()) == {"other"}


# ---- any nesting order: gradients unchanged -----------------------------------------------------


def _wrap(kind: str, names: frozenset):
    if kind == "offload_names":
        return lambda f: O.offload(f, policy=O.offload_only_these_names(*names))
    if kind == "offload_all":
        return lambda f: O.offload(f, bucket_bytes=1 << 12)
    if kind == "offload_dots":
        return lambda f: O.offload(f, policy=O.offload_dots())
    if kind == "remat_names":
        return lambda f: R.remat(f, policy=R.save_only_these_names(*names))
    if kind == "remat_swap":
        return lambda f: R.remat(f, policy=R.save_and_offload_only_these_names(names_which_can_be_offloaded=names))
    return lambda f: R.remat(f)


wrap_st = st.tuples(st.sampled_from(["offload_names", "offload_all", "offload_dots", "remat_names", "remat_swap",
                                      "remat_full"]),
                    st.frozensets(st.sampled_from(NAMES), min_size=1))


@settings(deadline=None)
@given(wraps=st.lists(wrap_st, min_size=1, max_size=3), owner=st.booleans(), seed=st.integers(0, 3))
def test_any_nesting_order_keeps_gradients_bit_exact(wraps, owner, seed):
    ps, x = setup(layers=2, seed=seed)
    layer = block
    for kind, names in wraps:
        layer = _wrap(kind, names)(layer)
    own = ParameterOwner() if owner else None

    def loss(ps, x):
        for p in ps:
            x = owned_step(layer, own)(p, x)
        return (x.float() ** 2).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.UnknownNameWarning)
        assert_equal_trees(reference(ps, x), grads(loss, ps, x))
        r = saved_activations(loss, ps, x, state_argnums=(0,))
        none = saved_activations(lambda ps, x: stack_loss(ps, x, CFG), ps, x, state_argnums=(0,))
    # With at most one selective remat in the stack, nothing is kept twice: at most what no
    # transform keeps, plus the gathered copies of the weights (the owner keeps them; without one the
    # step's "gather" makes them too; a remat region's inputs are among these and the layer inputs
    # autograd saves anyway). Two selective remats keep both caches (torch's nesting, see
    # test_nested_selective_remat_keeps_both_caches).
    if sum(kind in ("remat_names", "remat_swap") for kind, _ in wraps) <= 1:
        weights = 2 * sum(v.numel() * v.element_size() for v in ps[0].values())
        padding = 64 * len(r.entries)  # host buffers shared by small storages align each one
        assert r.device_bytes + r.host_bytes <= none.device_bytes + weights + padding


def test_nested_selective_remat_keeps_both_caches():
    # torch's nested checkpoint: the inner region's selective cache is made during the outer
    # forward and read when backward recomputes the inner region, so it stays alive under an outer
    # full recompute (JAX would keep the outer region's inputs only). Two offloading policies that
    # name the same value each keep a host copy of it.
    ps, x = setup()
    f = lambda p, x: block(p, x + 1, CFG)  # noqa: E731 -- the region input made inside, 1 KiB
    swap_k = R.save_and_offload_only_these_names(names_which_can_be_offloaded=["k"])

    def measure(fn):
        r = saved_activations(fn, ps[0], x, state_argnums=(0,))
        return r.device_bytes, r.host_bytes

    inp, k = x.numel() * 4, named_bytes_of(["k"])
    dots = measure(R.remat(f, policy=R.dots_saveable))
    assert measure(R.remat(R.remat(f))) == (inp, 0)
    assert measure(R.remat(R.remat(f, policy=R.dots_saveable))) == dots
    assert measure(R.remat(R.remat(f), policy=R.dots_saveable)) == dots
    assert measure(R.remat(R.remat(f, policy=swap_k), policy=swap_k)) == (inp, 2 * k)


def named_bytes_of(names):
    ps, x = setup()
    by = saved_activations(block, ps[0], x, CFG, state_argnums=(0,)).by_name()
    return sum(by[n] for n in names)
