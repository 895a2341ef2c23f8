"""The optimizers flatten with hpfunc's optree namespace: a node type registered there (as
hpfunc.tree.register_node does for hpfunc's own types) is a container, not a leaf."""

from __future__ import annotations

import torch

from hpfunc import optim, tree

from _optim_helpers import randn, one_intra_op_thread  # noqa: F401 (autouse fixture)


class Pair:
    """A container known only to hpfunc's namespace (not to optree's global registry)."""

    def __init__(self, first, second):
        self.first, self.second = first, second


tree.register_node(Pair, lambda p: ((p.first, p.second), None, ("first", "second")), lambda _, xs: Pair(*xs))


def test_optimizers_see_through_nodes_of_hpfunc_namespace():
    params = {"layer": Pair(randn((4, 4), 0), randn((4,), 1))}
    grads = {"layer": Pair(randn((4, 4), 2), randn((4,), 3))}
    tx = optim.chain(optim.clip_by_global_norm(1.0),
                     optim.muon_adamw(0.02, adam_learning_rate=1e-3, weight_decay=0.1))
    state = tx.init(params)
    routes = state[1].inner_states
    assert isinstance(routes["muon"][0].momentum["layer"], Pair)  # state shaped like the params
    assert [p for p, _ in tree.leaves_with_paths(routes["muon"][0].momentum)] == ["layer.first"]
    updates, state = tx.update(grads, state, params)
    new = optim.apply_updates(params, updates)
    assert isinstance(new["layer"], Pair) and new["layer"].second.shape == (4,)
    expected = optim.global_norm([grads["layer"].first, grads["layer"].second])
    torch.testing.assert_close(optim.global_norm(grads), expected)


def test_mismatch_inside_a_namespace_node_names_the_path():
    params = {"layer": Pair(torch.zeros(2, 2), torch.zeros(2))}
    tx = optim.adamw(1e-3)
    state = tx.init(params)
    try:
        tx.update({"layer": Pair(torch.zeros(2, 2), None)}, state, params)
    except optim.TreeMismatchError as e:
        assert "'layer.second'" in str(e)
    else:
        raise AssertionError("expected a TreeMismatchError naming layer.second")
