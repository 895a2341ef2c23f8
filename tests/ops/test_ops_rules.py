"""Registered custom ops on DTensors equal one device (values and gradients, fp32 1e-5) for random
shapes and layouts on 1-D and 2-D meshes: a matmul (a contracted dimension marked ``sum``), a row-wise
softmax with an ``impl`` (its row split over ranks), a row reduction. A rule that forgets to mark the
contracted dimension is caught by the same check; malformed rules and rules that contradict the op's
shapes are errors at registration naming the dimension."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _ops_helpers as H
from hpfunc.ops import RuleError, parse, register

MESHES = [(2, {"a": 2}), (4, {"a": 4}), (4, {"a": 2, "b": 2})]


@st.composite
def cases(draw, name):
    world, mesh_shape = draw(st.sampled_from(MESHES))
    side = st.integers(1, 3).map(lambda k: 4 * k)  # divisible by every mesh axis: DTensor keeps the shards
    if name == "matmul":
        shapes = [(draw(side), draw(side)), (0, draw(side))]
        shapes[1] = (shapes[0][1], shapes[1][1])
    else:
        shapes = [tuple(draw(st.lists(side, min_size=1, max_size=3)))]
    layouts = [[draw(st.sampled_from([None] + list(range(len(s))))) for _ in mesh_shape] for s in shapes]
    return world, mesh_shape, shapes, layouts, draw(st.integers(0, 2**16))


@pytest.mark.multirank
@settings(max_examples=12)
@given(data=st.data())
def test_registered_ops_match_one_device(pools, data):
    name = data.draw(st.sampled_from(["matmul", "row_softmax", "row_sumsq"]))
    world, mesh_shape, shapes, layouts, seed = data.draw(cases(name))
    for err, placements in pools(world).run(H.op_parity, name, mesh_shape, shapes, layouts, seed):
        assert err <= 1.0, (name, mesh_shape, shapes, layouts, err, placements)


@pytest.mark.multirank
def test_the_layouts_are_the_rules(pools):
    # the contracted dimension split on both operands: a partial sum, completed on use
    (err, placements), _ = pools(2).run(H.op_parity, "matmul", {"a": 2}, [(4, 8), (8, 4)], [[1], [0]], 0)
    assert err <= 1.0 and placements == "(Partial(sum),)"
    # the softmax's own row split stays split: the impl completes max and sum across ranks
    (err, placements), _ = pools(2).run(H.op_parity, "row_softmax", {"a": 2}, [(4, 8)], [[1]], 1)
    assert err <= 1.0 and placements == "(Shard(dim=1),)"


@pytest.mark.multirank
def test_a_contracted_dimension_not_marked_is_caught(pools):
    """The wrong rule 'i k, k n -> i n' (k unmarked) is accepted (as Shardy accepts it) and gives each
    rank's partial product as if it were the whole: the parity check above fails on it."""
    (err, placements), _ = pools(2).run(H.op_parity, "matmul_unmarked", {"a": 2}, [(4, 8), (8, 4)], [[1], [0]], 0)
    assert err > 1.0 and placements == "(Replicate(),)"


@pytest.mark.parametrize("rule,match", [
    ("i k, k n -> i k | sum k", r"marked sum but appears in result 0"),
    ("i k, k n", r"exactly one '->'"),
    ("i k, k n -> i n | add k", r"unknown mark 'add'"),
    ("i k, k n -> i n | sum z", r"names dimension 'z', which no tensor has"),
    ("i k!, k n -> i n", r"operand 0 has the token 'k!'"),
])
def test_malformed_rules(rule, match):
    with pytest.raises(RuleError, match=match):
        parse(rule)


@pytest.mark.parametrize("rule,match", [
    # n and k swapped in the result: the op gives k's size where the rule says n
    ("i k, k n -> i k", r"result 0 dimension 1 is named 'k' \(size 3 in the check\) but the op gives size 4, "
                        r"the size the rule gave dimension 'n'"),
    ("i k, j n -> i n | sum k", r"the op rejects inputs shaped as the rule names them .* i=2, k=3, j=4, n=5"),
    ("i k -> i", r"names 1 operand\(s\) but the op has 2 tensor argument\(s\) \(x, w\)"),
    ("i k, k n -> i", r"result 0 is named i \(1 dimensions\) but the op returns rank 2"),
])
def test_rules_contradicting_the_op_fail_at_registration(rule, match):
    with pytest.raises(RuleError, match=match):
        register(H.matmul, rule)
