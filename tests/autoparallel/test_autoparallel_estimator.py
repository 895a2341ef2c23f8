"""The cost model's peak memory within 10% of the measured peak (storage liveness) of the real step on
4 gloo ranks, for five plans of the tiny Qwen3 MoE (:mod:`hpfunc.autoparallel.estimator_check`) at two
workloads each (8 x 64 and 16 x 64 tokens: model states and activations in different proportions).

Deliberate bugs tried: without the SwiGLU backward's temporaries (``backward`` 0 in
``memory_model.backward_phase_bytes``) 5 of the 10 fail (fsdp 4 at 8 x 64: 0.888, the pipelines down to
0.73); offline against the same measured peaks, the previous model's sum of both phases (the loss and
the layer's backward) puts 8 of the 10 above 1.1, and the fp32 RMSNorm counted without its input and
normalised value puts fsdp x tp at 0.81. The ranking test: ranking by the modelled wall step
(``step_seconds``) instead of the ranks' busy time fails all three workloads, as does dropping both the
host term and the collective latency (dropping the host term alone does not fail it).
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


# CPU milliseconds of one step summed over the 4 ranks, measured by bench/estimator.py on this 2-core
# machine (docs/autoparallel.md: three runs at load averages about 10, 50 and 22; the least of 3 steps,
# the median of 7, the median of 9). Recorded data, not timed here.
MEASURED_CPU_MS = {
    (8, 32): [{"fsdp4": 182.4, "fsdp2xtp2": 238.0, "fsdp2xep2": 454.3, "pp2xfsdp2 1f1b": 142.6,
               "pp2xfsdp2 1f1b remat=full": 214.3},
              {"fsdp4": 258.6, "fsdp2xtp2": 286.7, "fsdp2xep2": 562.0, "pp2xfsdp2 1f1b": 185.9,
               "pp2xfsdp2 1f1b remat=full": 258.8},
              {"fsdp4": 223.3, "fsdp2xtp2": 170.5, "fsdp2xep2": 327.0, "pp2xfsdp2 1f1b": 124.6, "pp2xfsdp2 1f1b remat=full": 147.1}],
    (8, 64): [{"fsdp4": 265.7, "fsdp2xtp2": 226.4, "fsdp2xep2": 401.9, "pp2xfsdp2 1f1b": 146.8,
               "pp2xfsdp2 1f1b remat=full": 178.6},
              {"fsdp4": 298.2, "fsdp2xtp2": 283.2, "fsdp2xep2": 577.0, "pp2xfsdp2 1f1b": 178.5,
               "pp2xfsdp2 1f1b remat=full": 274.3},
              {"fsdp4": 182.2, "fsdp2xtp2": 201.5, "fsdp2xep2": 480.9, "pp2xfsdp2 1f1b": 162.1, "pp2xfsdp2 1f1b remat=full": 193.3}],
    (16, 64): [{"fsdp4": 237.4, "fsdp2xtp2": 223.9, "fsdp2xep2": 506.0, "pp2xfsdp2 1f1b": 170.9,
                "pp2xfsdp2 1f1b remat=full": 251.2},
               {"fsdp4": 328.4, "fsdp2xtp2": 252.0, "fsdp2xep2": 402.4, "pp2xfsdp2 1f1b": 190.2,
                "pp2xfsdp2 1f1b remat=full": 295.7},
              {"fsdp4": 187.9, "fsdp2xtp2": 215.1, "fsdp2xep2": 444.9, "pp2xfsdp2 1f1b": 150.3, "pp2xfsdp2 1f1b remat=full": 201.2}],
}


def _settled_pairs(runs: list[dict], margin: float = 1.10) -> list[tuple[str, str]]:
    """(faster, slower) for every pair of plans measured in the same order, more than 10% apart, in
    every run (closer pairs are within the noise of this loaded machine)."""
    plans = list(runs[0])
    out = []
    for a in plans:
        for b in plans:
            if a != b and all(r[a] * margin < r[b] for r in runs):
                out.append((a, b))
    return out


@pytest.mark.parametrize("workload", list(MEASURED_CPU_MS), ids=lambda wl: f"{wl[0]}x{wl[1]}")
def test_estimated_ranking_agrees_with_the_measured_one(workload):
    # the cost model on the `cpu` preset ranks the plans by their ranks' busy time summed (4 ranks share
    # 2 cores: one rank's wait is another's compute); every pair whose measured order held in every
    # run must be ranked the same (the pairs whose order flipped between runs are within the noise)
    runs = MEASURED_CPU_MS[workload]
    pairs = _settled_pairs(runs)
    assert len(pairs) >= 7  # 1F1B fastest, fsdp x ep slowest, 1F1B below its recompute variant
    busy = {p: estimate(config(p, batch_size=workload[0], seq_len=workload[1]))["busy_seconds"] for p in PLANS}
    wrong = [(a, b, busy[a], busy[b]) for a, b in pairs if not busy[a] < busy[b]]
    assert not wrong, wrong
