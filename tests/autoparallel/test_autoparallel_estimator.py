"""The cost model's peak memory within 10% of the measured peak (storage liveness) of the real step on
4 gloo ranks, for five plans of the tiny Qwen3 MoE (:mod:`hpfunc.autoparallel.estimator_check`).

Deliberate bug tried: the estimator without its gradient term (``grads`` set to 0 in
``memory_model.memory``) fails for fsdp x tp (ratio 0.949 -> 0.896) and the 1F1B pipeline (0.922 -> 0.864).
The bound holds at this workload (8 x 64 tokens); docs/autoparallel.md shows where it does not (other
batch and sequence sizes).
"""

from __future__ import annotations

import pytest

from hpfunc.autoparallel.dryrun import measure_step
from hpfunc.autoparallel.estimator_check import PLANS, config, estimate

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def measured(pool4) -> dict:
    return {name: pool4.run(measure_step, config(name), timed_steps=0) for name in PLANS}


@pytest.mark.parametrize("plan", list(PLANS))
def test_estimated_peak_within_10_percent_of_the_measured(measured, plan):
    ranks = measured[plan]
    peak = max(r["peak_bytes"] for r in ranks)
    est = estimate(config(plan))
    assert 0.9 <= est["memory_total_bytes"] / peak <= 1.1, (plan, est["memory_total_bytes"], peak, est["memory_bytes"],
                                                           ranks[0]["peak_by_op"])
    # the state at rest is what the estimate's model states say, on every rank: 12 Psi / n in fp32 AdamW
    # (parameters 4, moments 8; the gradients come on top inside the step)
    states = est["memory_bytes"]
    at_rest = states["params"] + states["optimizer"]
    assert max(r["at_rest_bytes"] for r in ranks) == pytest.approx(at_rest, rel=0.02)
