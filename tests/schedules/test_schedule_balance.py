"""balance_layers against brute force, and uneven stages in simulation."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpfunc.schedules import balance_layers, one_f_one_b, simulate, stage_bounds, stage_costs


def brute_force_best(costs: list[float], k: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=1, max_size=9).flatmap(
        lambda c: st.tuples(st.just(c), st.integers(1, len(c)))
    )
)
def test_optimal_against_brute_force(case: tuple[list[int], int]) -> None:
    costs, k = case
    layers = balance_layers(costs, k)
    assert len(layers) == k and all(n >= 1 for n in layers) and sum(layers) == len(costs)
    assert max(stage_costs(costs, layers)) == pytest.approx(brute_force_best(costs, k))


def test_embedding_and_head_are_costed_layers() -> None:
    # embedding 2, 8 decoder layers of 1, head 4 (large vocabulary): the head gets a short stage.
    costs = [2] + [1] * 8 + [4]
    layers = balance_layers(costs, 4)
    assert layers == (2, 3, 3, 2) or max(stage_costs(costs, layers)) == brute_force_best(costs, 4)
    assert max(stage_costs(costs, layers)) == 4
    assert stage_bounds(layers)[-1][1] == len(costs)


def test_floats() -> None:
    layers = balance_layers([0.1, 0.2, 0.3, 0.4, 0.5], 2)
    assert max(stage_costs([0.1, 0.2, 0.3, 0.4, 0.5], layers)) == pytest.approx(0.9)


@pytest.mark.parametrize("costs,k,exc,match", [
    ([1, 2], 3, ValueError, "2 layers cannot fill 3"),
    ([1, 2], 0, ValueError, "num_stages must be >= 1"),
    ([1, -2], 1, ValueError, r"layer cost \[1\] must be a finite number >= 0"),
    ([1, float("inf")], 1, ValueError, "finite"),
    ([1, 2], 1.0, TypeError, "num_stages must be an int"),
])
def test_bad_input(costs, k, exc, match) -> None:
    with pytest.raises(exc, match=match):
        balance_layers(costs, k)


def test_stage_costs_checks_counts() -> None:
    with pytest.raises(ValueError, match="add up to 3, but 4 layers"):
        stage_costs([1, 1, 1, 1], (1, 2))
    with pytest.raises(ValueError, match=r"layers\[1\] must be >= 1"):
        stage_bounds((2, 0))


def test_balanced_stages_simulate_faster() -> None:
    costs = [3] + [1] * 10 + [5]
    p, m = 4, 8
    naive = (3, 3, 3, 3)
    balanced = balance_layers(costs, p)
    s_naive = one_f_one_b(p, m).replace(stage_layers=naive)
    s_bal = one_f_one_b(p, m).replace(stage_layers=balanced)
    t_naive = simulate(s_naive, stage_scale=dict(enumerate(stage_costs(costs, s_naive.stage_layers))))
    t_bal = simulate(s_bal, stage_scale=dict(enumerate(stage_costs(costs, s_bal.stage_layers))))
    assert t_bal.makespan < t_naive.makespan
    assert s_bal.stage_layers == balanced and sum(balanced) == len(costs)


def test_recompute_under_limit_switches_the_largest_stages_of_the_ranks_over_it():
    from hpfunc.schedules import one_f_one_b, recompute_under_limit, zbv

    # 1F1B on 2 ranks, 4 microbatches: rank 0 holds 2 stage-microbatches at once, rank 1 one
    assert recompute_under_limit(one_f_one_b(2, 4), [100.0, 100.0], 200.0) == (None, None)
    assert recompute_under_limit(one_f_one_b(2, 4), [100.0, 100.0], 150.0) == ("nothing_saveable", None)
    assert recompute_under_limit(one_f_one_b(2, 4), [100.0, 300.0], 150.0) == ("nothing_saveable", "nothing_saveable")
    # ZBV: 4 resident per rank; rank 0 holds stages 0 and 3: the larger one goes first
    got = recompute_under_limit(zbv(2, 4), [10.0, 10.0, 10.0, 50.0], 100.0, recompute_bytes=[1.0] * 4)
    assert got == (None, None, None, "nothing_saveable")
    with pytest.raises(ValueError, match=r"rank 0 holds up to 2 stage-microbatches; even recomputing its stages \[0\]"):
        recompute_under_limit(one_f_one_b(2, 4), [100.0, 100.0], 15.0)
    with pytest.raises(ValueError, match="3 stage sizes for 2 stages"):
        recompute_under_limit(one_f_one_b(2, 4), [1.0, 1.0, 1.0], 15.0)
