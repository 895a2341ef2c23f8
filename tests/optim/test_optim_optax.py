"""hpfunc.optim mirrors optax: the same argument names in the same positional order, and the
semantic differences stated in docs/optim.md hold.

The optax signatures and formulas below were read from optax's source (google-deepmind/optax at
2edbcbe, August 2026: ``optax/_src/alias.py``, ``transform.py``, ``transforms/_adding.py``,
``_clipping.py``, ``_combining.py``, ``_masking.py``, ``schedules/_schedule.py``,
``contrib/_muon.py``); optax itself is not installed here, so its formulas are restated in torch.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from hpfunc import optim

from _optim_helpers import randn, one_intra_op_thread  # noqa: F401 (autouse fixture)

# hpfunc function -> (optax function, optax's parameters in order, those hpfunc does not have).
OPTAX = {
    "adamw": ("optax.adamw", ["learning_rate", "b1", "b2", "eps", "eps_root", "mu_dtype", "weight_decay", "mask",
                              "nesterov"], {"mu_dtype", "nesterov"}),
    "scale_by_adam": ("optax.scale_by_adam", ["b1", "b2", "eps", "eps_root", "mu_dtype", "nesterov"],
                      {"mu_dtype", "nesterov"}),
    "add_decayed_weights": ("optax.add_decayed_weights", ["weight_decay", "mask"], set()),
    "scale_by_learning_rate": ("optax.scale_by_learning_rate", ["learning_rate", "flip_sign"], set()),
    "scale": ("optax.scale", ["step_size"], set()),
    "scale_by_schedule": ("optax.scale_by_schedule", ["step_size_fn"], set()),
    "clip_by_global_norm": ("optax.clip_by_global_norm", ["max_norm"], set()),
    "global_norm": ("optax.global_norm", ["updates"], set()),
    "apply_updates": ("optax.apply_updates", ["params", "updates"], set()),
    "masked": ("optax.masked", ["inner", "mask", "mask_compatible_extra_args"], {"mask_compatible_extra_args"}),
    "partition": ("optax.partition", ["transforms", "param_labels", "mask_compatible_extra_args"],
                  {"mask_compatible_extra_args"}),
    "scale_by_muon": ("optax.contrib.scale_by_muon", ["ns_coeffs", "ns_steps", "beta", "eps", "mu_dtype", "nesterov",
                                                      "adaptive", "preconditioning", "weight_dimension_numbers"],
                      {"mu_dtype", "adaptive", "preconditioning", "weight_dimension_numbers"}),
    "muon_adamw": ("optax.contrib.muon", ["learning_rate", "ns_coeffs", "ns_steps", "beta", "eps", "weight_decay",
                                          "weight_decay_mask", "mu_dtype", "nesterov", "adaptive", "preconditioning",
                                          "adam_b1", "adam_b2", "adam_eps_root", "adam_weight_decay",
                                          "adam_learning_rate", "muon_weight_dimension_numbers", "consistent_rms"],
                   {"mu_dtype", "adaptive", "preconditioning", "muon_weight_dimension_numbers"}),
    # Muon alone has no optax twin; it takes the Muon half of optax.contrib.muon's arguments.
    "muon": ("optax.contrib.muon (Muon half)", ["learning_rate", "ns_coeffs", "ns_steps", "beta", "eps",
                                                "weight_decay", "weight_decay_mask", "mu_dtype", "nesterov",
                                                "consistent_rms"], {"mu_dtype"}),
    "constant": ("optax.constant_schedule", ["value"], set()),
    "linear": ("optax.linear_schedule", ["init_value", "end_value", "transition_steps", "transition_begin"], set()),
    "linear_warmup_cosine_decay": ("optax.warmup_cosine_decay_schedule",
                                   ["init_value", "peak_value", "warmup_steps", "decay_steps", "end_value",
                                    "exponent"], set()),
}


@pytest.mark.parametrize("name", sorted(OPTAX))
def test_signature_mirrors_optax(name):
    """Every optax argument hpfunc has is named as in optax; hpfunc's positional arguments are a prefix
    of optax's order (after the first argument hpfunc lacks, the rest are keyword-only, so optax code
    either binds the same meaning or fails with a TypeError); what hpfunc lacks is exactly the
    documented set."""
    optax_name, optax_params, missing = OPTAX[name]
    params = inspect.signature(getattr(optim, name)).parameters
    positional = [p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == optax_params[: len(positional)], (optax_name, positional)
    assert {p for p in optax_params if p not in params} == missing, optax_name
    first_missing = next((i for i, p in enumerate(optax_params) if p in missing), len(optax_params))
    assert len(positional) <= first_missing, (optax_name, positional)


# ---- Muon: no bias correction (optax.contrib.scale_by_muon divides by 1 - beta^t) -----------------
def optax_muon_direction(grads: list[torch.Tensor], beta: float, nesterov: bool) -> list[torch.Tensor]:
    """optax's mu_hat restated: mu = beta mu + (1 - beta) g;  mu_hat = mu / (1 - beta^t), or with
    Nesterov beta mu / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t); then Newton-Schulz."""
    mu, out = torch.zeros_like(grads[0]), []
    for t, g in enumerate(grads, start=1):
        mu = beta * mu + (1 - beta) * g
        if nesterov:
            mu_hat = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
        else:
            mu_hat = mu / (1 - beta**t)
        out.append(optim.newton_schulz(mu_hat.double()).float())
    return out


def ours_muon_direction(grads: list[torch.Tensor], beta: float, nesterov: bool) -> list[torch.Tensor]:
    tx = optim.scale_by_muon(beta=beta, nesterov=nesterov)
    state, out = tx.init({"w": grads[0].double()}), []
    for g in grads:
        u, state = tx.update({"w": g.double()}, state)
        out.append((u["w"] / optim.muon_scale(g.shape)).float())
    return out


def test_muon_without_bias_correction_same_direction_without_nesterov():
    grads = [randn((6, 9), 20 + t) for t in range(8)]
    for o, x in zip(optax_muon_direction(grads, 0.9, False), ours_muon_direction(grads, 0.9, False)):
        torch.testing.assert_close(x, o, rtol=1e-5, atol=1e-6)  # only eps / norm separates them


def test_muon_without_bias_correction_nesterov_differs_early_then_agrees():
    grads = [randn((6, 9), 40 + t) for t in range(60)]
    optax_dirs, ours = optax_muon_direction(grads, 0.5, True), ours_muon_direction(grads, 0.5, True)
    torch.testing.assert_close(ours[0], optax_dirs[0], rtol=1e-5, atol=1e-6)  # t = 1: both are NS(g)
    assert (ours[1] - optax_dirs[1]).abs().max() > 1e-2  # t = 2: the weights of g and m differ
    torch.testing.assert_close(ours[-1], optax_dirs[-1], rtol=1e-5, atol=1e-6)  # beta^t -> 0


def test_muon_shape_factor_is_for_torch_orientation():
    """optax scales by sqrt(max(1, fan_out / fan_in)) with fan_in = shape[0] ([in, out], x @ W);
    hpfunc reads [out, in] (a torch Linear weight): the same array gets the transposed rule."""
    optax_factor = lambda shape: math.sqrt(max(1, shape[1] / shape[0]))  # noqa: E731
    for shape in [(8, 2), (2, 8), (5, 5)]:
        assert optim.muon_scale(shape) == optax_factor(shape[::-1])
    assert optim.muon_scale((8, 2)) != optax_factor((8, 2))


# ---- clipping: torch's formula, not optax's ------------------------------------------------------
def test_clip_by_global_norm_uses_torch_formula_not_optax():
    def optax_clip(g: torch.Tensor, max_norm: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(g)
        return g if norm < max_norm else g / norm * max_norm

    tx = optim.clip_by_global_norm(1.0)
    at = torch.tensor([0.6, 0.8], dtype=torch.float64)  # norm exactly 1: optax keeps it, hpfunc scales
    ours = tx.update({"g": at}, tx.init(None))[0]["g"]
    assert torch.equal(optax_clip(at, 1.0), at)
    torch.testing.assert_close(ours, at / (1.0 + 1e-6), rtol=1e-12, atol=0)
    above = at * 3
    ours = tx.update({"g": above}, tx.init(None))[0]["g"]
    torch.testing.assert_close(ours, optax_clip(above, 1.0) * 3.0 / (3.0 + 1e-6), rtol=1e-12, atol=0)


# ---- AdamW: the same maths as optax.adamw (eps outside the root, decay times the scheduled rate) ----
def test_adamw_equals_optax_formula_including_eps_root():
    b1, b2, eps, eps_root, wd = 0.8, 0.95, 1e-3, 1e-4, 0.1
    schedule = optim.linear(0.05, 0.01, 5)
    p = randn((4, 3), 0).double()
    grads = [randn((4, 3), 1 + t).double() for t in range(8)]
    tx = optim.adamw(schedule, b1, b2, eps, eps_root, weight_decay=wd)
    ours, state = p, tx.init(p)
    ref, mu, nu = p, torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        u, state = tx.update(g, state, ours)
        ours = optim.apply_updates(ours, u)
        mu, nu = b1 * mu + (1 - b1) * g, b2 * nu + (1 - b2) * g * g
        m_hat, v_hat = mu / (1 - b1**t), nu / (1 - b2**t)
        ref = ref - schedule(t - 1) * (m_hat / (torch.sqrt(v_hat + eps_root) + eps) + wd * ref)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)


def test_adamw_default_weight_decay_is_torchs():
    assert inspect.signature(optim.adamw).parameters["weight_decay"].default == 1e-2  # optax: 1e-4
    assert inspect.signature(torch.optim.AdamW.__init__).parameters["weight_decay"].default == 1e-2


# ---- schedules ------------------------------------------------------------------------------------
def test_warmup_cosine_decay_equals_optax_formula():
    """optax: linear warmup joined at warmup_steps to peak * ((1 - alpha) c ** exponent + alpha),
    alpha = end / peak, c = (1 + cos(pi min(s, T) / T)) / 2, T = decay_steps - warmup_steps."""
    init, peak, warmup, decay, end = 0.1, 2.0, 4, 20, 0.3
    for exponent in (1.0, 2.0):
        f = optim.linear_warmup_cosine_decay(init, peak, warmup, decay, end, exponent)
        for step in range(30):
            if step < warmup:
                want = init + (peak - init) * step / warmup
            else:
                s, total = min(step - warmup, decay - warmup), decay - warmup
                c = 0.5 * (1 + math.cos(math.pi * s / total))
                want = peak * ((1 - end / peak) * c**exponent + end / peak)
            assert math.isclose(f(step), want, rel_tol=1e-12, abs_tol=1e-15), (exponent, step)


def test_linear_with_zero_transition_steps_differs_from_optax():
    """optax holds init_value forever when transition_steps <= 0; hpfunc jumps at transition_begin."""
    f = optim.linear(1.0, 0.0, 0, 3)
    assert [f(s) for s in range(5)] == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_warmup_cosine_without_decay_phase_is_allowed():
    """optax raises for decay_steps == warmup_steps (cosine_decay_schedule needs positive steps)."""
    f = optim.linear_warmup_cosine_decay(0.0, 1.0, 3, 3, 0.25)
    assert [f(s) for s in range(5)] == [0.0, 1 / 3, 2 / 3, 0.25, 0.25]


def test_warmup_cosine_with_zero_peak_still_reaches_end_value():
    """optax uses alpha = 0 when peak_value == 0, so it returns 0 after the warmup whatever end_value."""
    f = optim.linear_warmup_cosine_decay(0.0, 0.0, 2, 6, 0.5)
    assert f(2) == 0.0 and 0.0 < f(4) < 0.5 and f(6) == 0.5
