"""The cost model's peak memory within 10% of the measured peak (storage liveness) of the real step on
4 gloo ranks, for five plans of the tiny Qwen3 MoE (:mod:`hpfunc.autoparallel.estimator_check`) at two
workloads each (8 x 64 and 16 x 64 tokens: model states and activations in different proportions).

Deliberate bugs tried: the estimator's peak as the sum of its phases (the loss's backward and a layer's
backward both counted, as the previous model did) fails fsdp x tp and the 1F1B pipeline at 16 x 64 (and
others); without the SwiGLU backward's temporaries (``backward`` 0) fsdp 4 at 16 x 64 falls to
0.84; the gradient term always held (not only after a microbatch's backward) fails none alone (it moves
the pipelines by +6%), so it is not claimed as caught.
"""

from __future__ import annotations

import pytest

from hpfunc.autoparallel.estimator_check import PLANS, WORKLOADS, config, estimate, measure

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def measured(pool4) -> dict:
    return {(name, wl): pool4.run(measure, config(name, batch_size=wl[0], seq_len=wl[1]))
            for wl in WORKLOADS for name in PLANS}


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda wl: f"{wl[0]}x{wl[1]}")
@pytest.mark.parametrize("plan", list(PLANS))
def test_estimated_peak_within_10_percent_of_the_measured(measured, plan, workload):
    ranks = measured[(plan, workload)]
    peak = max(r["peak_bytes"] for r in ranks)
    est = estimate(config(plan, batch_size=workload[0], seq_len=workload[1]))
    assert 0.9 <= est["memory_total_bytes"] / peak <= 1.1, (plan, workload, est["memory_total_bytes"], peak,
                                                           est["memory_bytes"], ranks[0]["peak_by_op"])
    # the state at rest is what the estimate's model states say, on every rank: 12 Psi / n in fp32 AdamW
    # (parameters 4, moments 8; the gradients come on top inside the step)
    states = est["memory_bytes"]
    at_rest = states["params"] + states["optimizer"]
    assert max(r["at_rest_bytes"] for r in ranks) == pytest.approx(at_rest, rel=0.02)
