"""The pure train_step: no mutation, determinism, and the expert bias moved only by the sign rule."""

from __future__ import annotations

import attrs
import pytest
import torch

from hpfunc import optim, random, tree
from hpfunc.models import qwen3
from hpfunc.models.moe import is_expert_bias
from hpfunc.train.step import init_train_state, make_train_step, merge_params, split_params


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models run fastest on one thread; restore the process setting for other tests.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup():
    cfg = attrs.evolve(qwen3.preset("qwen3-moe-tiny"), hidden_size=32, moe_intermediate_size=16, intermediate_size=32)
    params = qwen3.init(random.key(0), cfg)
    tokens = random.randint(random.key(1), (2, 17), 0, 256)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    return cfg, params, batch


def clone(t):
    return tree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, t)


def assert_tree_equal(a, b):
    la, lb = tree.leaves_with_paths(a), tree.leaves_with_paths(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        assert torch.equal(x, y), p


def bias_leaves(params):
    return {p: x for p, x in tree.leaves_with_paths(params) if is_expert_bias(p)}


def test_split_merge_round_trip(setup):
    _, params, _ = setup
    trained, frozen = split_params(params, is_expert_bias)
    assert len(tree.leaves(frozen)) == 2 and len(tree.leaves(trained)) == len(tree.leaves(params)) - 2
    assert_tree_equal(merge_params(trained, frozen), params)


def test_train_step_is_pure_and_deterministic(setup):
    cfg, params, batch = setup
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    state = init_train_state(params, tx)
    step = make_train_step(cfg, tx, expert_bias_rate=1e-2, lr_schedule=lambda s: 1e-2)
    before_state, before_batch = clone(state), clone(batch)
    new1, m1 = step(state, batch)
    assert_tree_equal(state, before_state)  # nothing was modified in place
    assert_tree_equal(batch, before_batch)
    new2, m2 = step(state, batch)
    assert_tree_equal(new1, new2)  # same inputs, same outputs
    assert float(m1["loss"]) == float(m2["loss"])
    assert int(new1.step) == 1 and int(state.step) == 0
    assert set(m1) >= {"loss", "ce_loss", "aux_loss", "grad_norm", "lr", "expert_load"}
    assert m1["expert_load"].shape == (2, 8) and float(m1["lr"]) == pytest.approx(1e-2)
    changed = [p for (p, x), (_, y) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(new1.params))
               if not torch.equal(x, y)]
    assert "embed" in changed and "layers.0.moe.experts.w_gate" in changed


def test_expert_bias_moves_only_by_sign_rule(setup):
    cfg, params, batch = setup
    # A large rate, weight decay and momentum would all show on the bias if it reached the optimizer.
    tx = optim.adamw(0.5, weight_decay=0.5)
    state = init_train_state(params, tx)
    assert not any(is_expert_bias(p) for p, _ in tree.leaves_with_paths(state.opt_state))
    rate = 0.125
    step = make_train_step(cfg, tx, expert_bias_rate=rate)
    for _ in range(3):
        old = bias_leaves(state.params)
        state, metrics = step(state, batch)
        load = metrics["expert_load"].to(torch.float32)
        new = bias_leaves(state.params)
        for i, path in enumerate(sorted(old, key=lambda p: int(p.split(".")[1]))):
            expected = old[path] + rate * torch.sign(load[i].mean() - load[i])
            assert torch.equal(new[path], expected), path
    # With rate 0 the bias never changes, whatever the optimizer does to the other params.
    step0 = make_train_step(cfg, tx, expert_bias_rate=0.0)
    s0 = init_train_state(params, tx)
    for _ in range(2):
        s0, _ = step0(s0, batch)
    assert_tree_equal(bias_leaves(s0.params), bias_leaves(params))


def test_aux_loss_coef_enters_objective(setup):
    cfg, params, batch = setup
    tx = optim.adamw(1e-3)
    state = init_train_state(params, tx)
    _, m0 = make_train_step(cfg, tx, aux_loss_coef=0.0)(state, batch)
    _, m1 = make_train_step(cfg, tx, aux_loss_coef=1.0)(state, batch)
    assert float(m0["loss"]) == pytest.approx(float(m0["ce_loss"]))
    assert float(m1["loss"]) == pytest.approx(float(m1["ce_loss"]) + float(m1["aux_loss"]), rel=1e-6)


def test_dense_model_and_muon_adamw():
    cfg = qwen3.preset("qwen3-dense-tiny")
    params = qwen3.init(random.key(0), cfg)
    tx = optim.muon_adamw(0.02, adam_learning_rate=3e-3)
    state = init_train_state(params, tx)
    batch = {"tokens": random.randint(random.key(2), (2, 16), 0, 256)}
    state, metrics = make_train_step(cfg, tx, expert_bias_rate=1e-3)(state, batch)
    assert "expert_load" not in metrics or metrics["expert_load"].numel() == 0
    assert torch.isfinite(metrics["loss"])
