"""chain, masked and partition route each leaf as specified; bad trees and labels fail by path."""

from __future__ import annotations

from typing import NamedTuple

import optree
import pytest
import torch

from hpfunc import optim

from _optim_helpers import randn, one_intra_op_thread  # noqa: F401 (autouse fixture)


class Attn(NamedTuple):
    wq: torch.Tensor
    wo: torch.Tensor


def model_params(seed: int = 0) -> dict:
    return {
        "embed_tokens": randn((10, 6), seed),
        "layers": [
            {"attn": Attn(randn((6, 6), seed + 1), randn((6, 6), seed + 2)), "input_norm": randn((6,), seed + 3),
             "mlp": {"experts": randn((2, 8, 6), seed + 4), "router": randn((2, 6), seed + 5)}},
            {"attn": Attn(randn((6, 6), seed + 6), randn((6, 6), seed + 7)), "input_norm": randn((6,), seed + 8),
             "mlp": {"experts": randn((2, 8, 6), seed + 9), "router": randn((2, 6), seed + 10)}},
        ],
        "lm_head": randn((10, 6), seed + 11),
    }


def run(tx, params, grads_seq):
    state = tx.init(params)
    for g in grads_seq:
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def by_path(tree) -> dict:
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return {".".join(map(str, p)): x for p, x in zip(paths, leaves)}


def grads_like(params, n: int = 3):
    return [optree.tree_map(lambda x, i=i: torch.randn_like(x) * (i + 1), params) for i in range(n)]


def test_partition_routes_each_leaf_by_path():
    params = model_params()
    torch.manual_seed(0)
    grads = grads_like(params)

    def label(path, leaf):
        if "norm" in path:
            return "frozen"
        return "sgd" if path.startswith("lm_head") else "adam"

    adam = optim.adamw(1e-2, weight_decay=0.1)
    sgd = optim.scale_by_learning_rate(0.5)
    frozen = optim.scale(0.0)
    got, state = run(optim.partition({"adam": adam, "sgd": sgd, "frozen": frozen}, label), params, grads)
    alone = {name: by_path(run(tx, params, grads)[0]) for name, tx in [("adam", adam), ("sgd", sgd), ("frozen", frozen)]}
    got = by_path(got)
    assert set(got) == set(alone["adam"])
    for path, value in got.items():
        expected = alone[label(path, value)][path]
        # A leaf labelled 'adam' changes exactly as adamw alone would change it, and so on.
        assert torch.equal(value, expected), path
    # States hold only their own leaves.
    assert set(by_path(state.inner_states["adam"][0].mu)) == {p for p in got if label(p, None) == "adam"}


def test_partition_with_label_tree_prefix():
    params = {"body": {"w": randn((3, 3), 0), "b": randn((3,), 1)}, "head": randn((3, 2), 2)}
    labels = {"body": "a", "head": "b"}  # prefix: every leaf under body is 'a'
    tx = optim.partition({"a": optim.scale(2.0), "b": optim.scale(-1.0)}, labels)
    g = optree.tree_map(torch.ones_like, params)
    u, _ = tx.update(g, tx.init(params), params)
    assert torch.equal(u["body"]["w"], torch.full((3, 3), 2.0)) and torch.equal(u["head"], -torch.ones(3, 2))


def test_partition_unknown_label_names_path():
    params = model_params()
    tx = optim.partition({"adam": optim.adamw(1e-3)}, lambda path, x: "muon" if "attn" in path else "adam")
    with pytest.raises(optim.UnknownLabelError, match=r"'layers\.0\.attn\.0' has label 'muon'.*known labels: 'adam'"):
        tx.init(params)


def test_partition_label_tree_wrong_structure():
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    tx = optim.partition({"x": optim.identity()}, {"a": "x", "c": "x"})
    with pytest.raises(optim.TreeMismatchError, match=r"labels must be .*entry at 'c'"):
        tx.init(params)
    tx = optim.partition({"x": optim.identity()}, {"a": "x"})
    with pytest.raises(optim.TreeMismatchError, match=r"leaf at 'b' that it does not cover"):
        tx.init(params)


def test_mismatched_updates_and_state_name_the_path():
    params = model_params()
    tx = optim.adamw(1e-3)
    state = tx.init(params)
    grads = optree.tree_map(torch.zeros_like, params)
    del grads["layers"][1]["mlp"]["router"]
    with pytest.raises(optim.TreeMismatchError, match=r"'layers\.1\.mlp\.router'"):
        tx.update(grads, state, params)


def test_mismatched_leaf_shape_names_the_path():
    params = {"layers": [{"w": torch.zeros(3, 3)}]}
    tx = optim.adamw(1e-3)
    state = tx.init(params)
    with pytest.raises(optim.TreeMismatchError, match=r"'layers\.0\.w' updates has shape \(3, 4\)"):
        tx.update({"layers": [{"w": torch.zeros(3, 4)}]}, state, None)


def test_partition_mismatch_names_the_path():
    params = model_params()
    tx = optim.muon_adamw(0.02)
    state = tx.init(params)
    grads = optree.tree_map(torch.zeros_like, params)
    grads["extra"] = torch.zeros(3)
    with pytest.raises(optim.TreeMismatchError, match=r"'extra'"):
        tx.update(grads, state, params)


def test_chain_state_mismatch():
    tx = optim.chain(optim.scale(1.0), optim.scale(2.0))
    with pytest.raises(optim.TreeMismatchError, match="one entry per transformation"):
        tx.update({"w": torch.ones(1)}, (optim.EmptyState(),))


def test_apply_updates_mismatch_names_path():
    with pytest.raises(optim.TreeMismatchError, match=r"'b'"):
        optim.apply_updates({"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1)})


@pytest.mark.parametrize(
    "mask",
    [
        {"w": True, "b": False},
        lambda path, x: x.ndim == 2,
        lambda params: {k: v.ndim == 2 for k, v in params.items()},
    ],
    ids=["tree", "path_leaf", "params_fn"],
)
def test_masked_applies_inner_only_to_selected(mask):
    params = {"w": randn((2, 3), 0), "b": randn((3,), 1)}
    tx = optim.masked(optim.adamw(0.1), mask)
    state = tx.init(params)
    assert set(by_path(state.inner_state[0].mu)) == {"w"}
    g = {"w": randn((2, 3), 2), "b": randn((3,), 3)}
    u, _ = tx.update(g, state, params)
    assert torch.equal(u["b"], g["b"])  # passed through untouched
    u_alone, _ = optim.adamw(0.1).update({"w": g["w"]}, optim.adamw(0.1).init({"w": params["w"]}), {"w": params["w"]})
    assert torch.equal(u["w"], u_alone["w"])


def test_masked_rejects_non_bool_mask():
    with pytest.raises(TypeError, match=r"'w' must be a Python bool"):
        optim.masked(optim.identity(), {"w": 1}).init({"w": torch.zeros(1)})


def test_muon_adamw_default_routing_reads_only_the_leaf():
    """The generic default (optim.is_not_matrix) sends every matrix and stack to Muon, names unread:
    embeddings, router and head included; only non-matrices go to AdamW."""
    params = model_params()
    labels = {path: ("adamw" if optim.is_not_matrix(path, x) else "muon") for path, x in by_path(params).items()}
    assert {p for p, label in labels.items() if label == "adamw"} == {"layers.0.input_norm", "layers.1.input_norm"}
    renamed = {"a": params["embed_tokens"], "b": params["layers"][0]["input_norm"]}  # names do not matter
    assert [optim.is_not_matrix(p, x) for p, x in renamed.items()] == [False, True]
    torch.manual_seed(1)
    grads = grads_like(params)
    tx = optim.muon_adamw(0.02, weight_decay=0.1, adam_learning_rate=1e-3)
    got, state = run(tx, params, grads)
    assert set(by_path(state.inner_states["muon"][0].momentum)) == {p for p, v in labels.items() if v == "muon"}
    muon_alone = optim.muon(0.02, weight_decay=0.1)
    adam_alone = optim.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    for path, value in by_path(got).items():
        sub = {path: by_path(params)[path]}
        seq = [{path: by_path(g)[path]} for g in grads]
        expected = run(muon_alone if labels[path] == "muon" else adam_alone, sub, seq)[0][path]
        assert torch.equal(value, expected), path


def test_muon_adamw_adam_hyperparameters_reach_adamw():
    """adam_b1/adam_b2/adam_eps/adam_eps_root/adam_weight_decay/adam_learning_rate configure the AdamW
    half exactly like adamw(...) with the same values; beta/eps/weight_decay configure Muon."""
    params = {"w": randn((4, 6), 0), "v": randn((5,), 1)}
    torch.manual_seed(2)
    grads = grads_like(params, 4)
    tx = optim.muon_adamw(0.03, (3.0, -4.0, 2.0), 3, 0.8, 1e-6, 0.05, adam_b1=0.7, adam_b2=0.9, adam_eps=1e-3,
                          adam_eps_root=1e-4, adam_weight_decay=0.2, adam_learning_rate=1e-2)
    got = run(tx, params, grads)[0]
    want_v = run(optim.adamw(1e-2, 0.7, 0.9, 1e-3, 1e-4, weight_decay=0.2), {"v": params["v"]},
                 [{"v": g["v"]} for g in grads])[0]["v"]
    want_w = run(optim.muon(0.03, (3.0, -4.0, 2.0), 3, 0.8, 1e-6, 0.05), {"w": params["w"]},
                 [{"w": g["w"]} for g in grads])[0]["w"]
    assert torch.equal(got["v"], want_v) and torch.equal(got["w"], want_w)


@pytest.mark.parametrize(
    "mask", [lambda path, x: path != "layers.0.input_norm" and path != "embed_tokens",
             {"embed_tokens": False, "layers": [{"input_norm": False, "attn": True, "mlp": True}, True],
              "lm_head": True}],
    ids=["path_leaf", "tree"],
)
def test_muon_adamw_weight_decay_mask_applies_to_both_halves(mask):
    params = model_params()
    zeros = optree.tree_map(torch.zeros_like, params)
    tx = optim.muon_adamw(0.1, weight_decay=0.5, weight_decay_mask=mask, adam_learning_rate=0.1)
    updates, _ = tx.update(zeros, tx.init(params), params)
    u = by_path(updates)
    # A zero gradient: Newton-Schulz of 0 is 0 and Adam's direction is 0, so what is left is the decay.
    for path, p in by_path(params).items():
        decayed = path not in ("layers.0.input_norm", "embed_tokens")
        expected = -0.1 * 0.5 * p if decayed else torch.zeros_like(p)
        torch.testing.assert_close(u[path], expected, rtol=1e-6, atol=0, msg=lambda m: f"{path}: {m}")


def test_muon_adamw_rejects_non_callable_routing():
    with pytest.raises(TypeError, match="adamw_when must be a callable"):
        optim.muon_adamw(0.02, adamw_when={"w": True})


def test_muon_adamw_custom_predicate():
    params = {"wq": torch.zeros(4, 4), "wk": torch.zeros(4, 4)}
    tx = optim.muon_adamw(0.02, adamw_when=lambda path, x: path == "wk")
    state = tx.init(params)
    assert set(by_path(state.inner_states["adamw"][0].mu)) == {"wk"}
    assert set(by_path(state.inner_states["muon"][0].momentum)) == {"wq"}


def test_muon_alone_on_model_rejects_embedding_norm():
    with pytest.raises(optim.UnsupportedLeafError, match=r"'layers\.0\.input_norm'"):
        optim.muon(0.02).init(model_params())
