"""SAPP-PPB: the stage split against brute force; the fast makespan replay against simulate."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpfunc.autoparallel.configuration import Layout, Workload
from hpfunc.autoparallel.memory_model import memory
from hpfunc.autoparallel.pipeline_time import makespan
from hpfunc.autoparallel.stage_balance import BalanceError, balance_layout, balance_stages
from hpfunc.models import qwen3
from hpfunc.models.qwen3.describe import describe
from hpfunc.schedules import GENERATORS, simulate


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def _brute(costs, acts, k, inflight, limit, states, first_cost, last_cost, first_bytes, last_bytes):
    n = len(costs["none"])
    best = math.inf
    for layers in _compositions(n, k):
        start, worst = 0, 0.0
        for s, c in enumerate(layers):
            options = []
            for kind in costs:
                b = (sum(states[start:start + c]) + inflight[s] * sum(acts[kind][start:start + c])
                     + (first_bytes if s == 0 else 0) + (last_bytes if s == k - 1 else 0))
                if b <= limit:
                    options.append(sum(costs[kind][start:start + c]) + (first_cost if s == 0 else 0)
                                   + (last_cost if s == k - 1 else 0))
            worst = max(worst, min(options, default=math.inf))
            start += c
        best = min(best, worst)
    return best


@st.composite
def cases(draw):
    n = draw(st.integers(2, 7))
    k = draw(st.integers(1, min(n, 4)))
    none = draw(st.lists(st.floats(0.5, 3.0), min_size=n, max_size=n))
    slow = draw(st.floats(1.0, 1.5))
    a_none = draw(st.lists(st.floats(1.0, 10.0), min_size=n, max_size=n))
    states = draw(st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n))
    inflight = tuple(draw(st.integers(1, k)) for _ in range(k))
    limit = draw(st.floats(5.0, 80.0))
    extras = draw(st.tuples(st.floats(0, 3), st.floats(0, 4), st.floats(0, 5), st.floats(0, 10)))
    costs = {"none": none, "full": [c * slow for c in none]}
    acts = {"none": a_none, "full": [a / 8 for a in a_none]}
    return costs, acts, k, inflight, limit, states, *extras


@settings(max_examples=60, deadline=None)
@given(cases())
def test_split_is_within_one_layer_of_brute_force(case):
    costs, acts, k, inflight, limit, states, fc, lc, fb, lb = case
    brute = _brute(costs, acts, k, inflight, limit, states, fc, lc, fb, lb)
    if brute == math.inf:
        with pytest.raises(BalanceError, match="no split"):
            balance_stages(costs, acts, num_stages=k, inflight=inflight, limit=limit, state_bytes=states,
                           first_cost=fc, last_cost=lc, first_bytes=fb, last_bytes=lb)
        return
    r = balance_stages(costs, acts, num_stages=k, inflight=inflight, limit=limit, state_bytes=states,
                       first_cost=fc, last_cost=lc, first_bytes=fb, last_bytes=lb)
    one_layer = max(max(v) for v in costs.values())
    assert r.max_cost <= brute + one_layer  # the bound; the program is exact:
    assert r.max_cost == pytest.approx(brute, rel=1e-9, abs=1e-12)
    assert sum(r.layers) == len(costs["none"]) and all(c >= 1 for c in r.layers)
    assert all(b <= limit for b in r.stage_bytes)


def test_balanced_pipeline_fits_and_is_not_slower():
    from hpfunc.autoparallel.search import evaluate

    d = describe(qwen3.preset("qwen3-30b-a3b"))
    work = Workload(global_batch=64, seq_len=4096)
    limit = 80 * 2**30
    lay = Layout(pp=4, ep=2, microbatches=16, remat="full")
    bal = balance_layout(d, lay, work, "h100", memory_limit=limit)
    assert sum(bal.layers_per_stage) == 48 and len(bal.stage_remat) == 4
    assert memory(d, bal, work).total <= limit
    before, after = evaluate(d, lay, work, "h100", memory_limit=limit), evaluate(d, bal, work, "h100", memory_limit=limit)
    assert after.time.total <= before.time.total
    # it is a config the trainer takes: layers_per_stage and one remat policy per stage
    pp = bal.parallel_section()["plan"][0]["pp"]
    assert pp["layers_per_stage"] == list(bal.layers_per_stage) and len(pp["remat"]) == 4


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["1f1b", "interleaved_1f1b", "zb_h1", "zbv", "gpipe"]), st.integers(2, 4),
       st.integers(1, 3), st.lists(st.floats(0.1, 3.0), min_size=16, max_size=16))
def test_makespan_replay_equals_simulate(name, p, mult, values):
    m = p * mult
    v = 2
    gen = GENERATORS[name]
    sched = gen(p, m, v) if name == "interleaved_1f1b" else gen(p, m)
    table = {(kind, s): values[(i * 5 + s) % 16] for i, kind in enumerate(("F", "B", "W", "BW")) for s in range(8)}
    fast = makespan(name, p, m, v, lambda kind, s: table.get((kind, s), 0.0))
    slow = simulate(sched, lambda a: table.get((a.kind.value, a.stage), 0.0) if a.is_compute else 0.0).makespan
    assert fast == pytest.approx(slow, rel=1e-12)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zb_h1", "zbv", "gpipe"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12)])
def test_peak_inflight_equals_simulate(name, p, m):
    from hpfunc.autoparallel.pipeline_time import peak_inflight

    gen = GENERATORS[name]
    sched = gen(p, m, 2) if name == "interleaved_1f1b" else gen(p, m)
    r = simulate(sched)
    assert peak_inflight(name, p, m, 2) == tuple(r.peak_resident_until_w[k] for k in range(p))
