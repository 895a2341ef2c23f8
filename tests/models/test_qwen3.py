"""init / apply / loss contracts beyond parity: positions, labels, dtypes, determinism, tied weights."""

from __future__ import annotations

import pytest
import torch

import hpfunc
from hpfunc.models import preset, qwen3


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("qwen3-moe-tiny")
    return cfg, qwen3.init(hpfunc.random.key(0), cfg)


def test_init_is_deterministic_and_keyed(tiny) -> None:
    cfg, params = tiny
    again = qwen3.init(hpfunc.random.key(0), cfg)
    other = qwen3.init(hpfunc.random.key(1), cfg)
    assert torch.equal(again["layers"][1]["moe"]["experts"]["w_up"], params["layers"][1]["moe"]["experts"]["w_up"])
    assert not torch.equal(other["embed"], params["embed"])
    assert torch.equal(params["final_norm"], torch.ones(cfg.hidden_size))
    assert abs(params["embed"].std().item() - cfg.initializer_range) < 0.002
    paths = [p for p, _ in hpfunc.tree.leaves_with_paths(params)]
    assert "layers.1.attn.wq" in paths and "layers.0.moe.experts.w_down" in paths and "lm_head" in paths


def test_batched_positions_equal_shared_positions(tiny) -> None:
    cfg, params = tiny
    tokens = torch.randint(0, 256, (2, 6))
    shared = qwen3.apply(params, tokens, cfg, positions=torch.arange(3, 9))
    batched = qwen3.apply(params, tokens, cfg, positions=torch.arange(3, 9).expand(2, -1))
    torch.testing.assert_close(shared, batched)
    assert not torch.allclose(shared, qwen3.apply(params, tokens, cfg))


def test_default_labels_are_shifted_tokens(tiny) -> None:
    cfg, params = tiny
    tokens = torch.randint(0, 256, (2, 7))
    implicit, aux = qwen3.loss(params, {"tokens": tokens}, cfg)
    explicit, _ = qwen3.loss(params, {"tokens": tokens, "labels": qwen3.shift_labels(tokens)}, cfg)
    assert torch.equal(implicit, explicit)
    logits = qwen3.apply(params, tokens, cfg)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(aux["ce_loss"], ce)
    torch.testing.assert_close(implicit, ce + cfg.router_aux_loss_coef * aux["aux_loss"])
    assert aux["tokens"].item() == 12
    with pytest.raises(ValueError, match="labels"):
        qwen3.loss(params, {"tokens": tokens, "labels": tokens[:, :3]}, cfg)


def test_dense_model_has_no_aux_loss_and_tied_head() -> None:
    cfg = preset("qwen3-dense-tiny")
    params = qwen3.init(hpfunc.random.key(0), cfg)
    assert "lm_head" not in params and cfg.moe_layers == ()
    value, aux = qwen3.loss(params, {"tokens": torch.randint(0, 256, (1, 5))}, cfg)
    assert aux["aux_loss"].item() == 0.0 and torch.equal(value, aux["ce_loss"].reshape(value.shape))
    assert aux["expert_load"].shape == (0, 0)
    assert qwen3.update_expert_bias(params, aux["expert_load"], 0.1) is not params  # a no-op rebuild


def test_bfloat16_forward(tiny) -> None:
    cfg, params = tiny
    p16 = hpfunc.tree.map_with_path(lambda p, t: t if qwen3.is_expert_bias(p) else t.to(torch.bfloat16), params)
    tokens = torch.randint(0, 256, (1, 8))
    out = qwen3.apply(p16, tokens, cfg)
    assert out.dtype == torch.bfloat16 and p16["layers"][0]["moe"]["expert_bias"].dtype == torch.float32
    torch.testing.assert_close(out.float(), qwen3.apply(params, tokens, cfg), atol=0.05, rtol=0.05)


def test_bad_token_tensors_are_rejected(tiny) -> None:
    cfg, params = tiny
    with pytest.raises(TypeError, match="integer"):
        qwen3.apply(params, torch.zeros(1, 3), cfg)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        qwen3.apply(params, torch.zeros(3, dtype=torch.long), cfg)


def test_moe_impls_agree(tiny) -> None:
    cfg, params = tiny
    tokens = torch.randint(0, 256, (2, 9))
    a = qwen3.apply(params, tokens, cfg, moe_impl="bmm")
    b = qwen3.apply(params, tokens, cfg, moe_impl="grouped_mm")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_bound_tensor_parallel_axis_reaches_every_seam(monkeypatch) -> None:
    # The model reads its tensor-parallel layout from hpfunc.layout (no hook parameters): under a bound axis
    # every row-parallel output (attention and MLP/MoE per layer) goes through layout.reduce_partial and
    # every block input through layout.gather_sequence; as identities they leave the model unchanged, with
    # the attention output bias moved after the reduction.
    from hpfunc import layout

    cfg = preset("qwen3-moe-tiny", attention_bias=True, num_hidden_layers=2, decoder_sparse_step=2)
    params = qwen3.init(hpfunc.random.key(3), cfg)
    params = hpfunc.tree.map_with_path(lambda p, t: t + 0.01 if p.endswith(".bo") else t, params)
    batch = {"tokens": torch.randint(0, 256, (2, 5))}
    full, full_loss = qwen3.apply(params, batch["tokens"], cfg), qwen3.loss(params, batch, cfg)[0]
    seen = {"reduce": 0, "gather": 0}

    def counting(name, fn):
        def seam(x, **kw):
            seen[name] += 1
            return fn(x, **kw)
        return seam

    monkeypatch.setattr(layout, "reduce_partial", counting("reduce", layout.reduce_partial))
    monkeypatch.setattr(layout, "gather_sequence", counting("gather", layout.gather_sequence))
    with hpfunc.Mesh({"tp": 1}), layout.tensor_parallel("tp"):
        same = qwen3.apply(params, batch["tokens"], cfg)
        same_loss = qwen3.loss(params, batch, cfg)[0]
    torch.testing.assert_close(same, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(same_loss, full_loss, atol=1e-6, rtol=1e-6)
    assert seen == {"reduce": 2 * 2 * cfg.num_hidden_layers, "gather": 2 * 2 * cfg.num_hidden_layers}


def test_removed_hook_parameters_say_how_to_migrate() -> None:
    cfg = preset("qwen3-dense-tiny")
    params = qwen3.init(hpfunc.random.key(0), cfg)
    batch = {"tokens": torch.zeros(1, 3, dtype=torch.long)}
    with pytest.raises(TypeError, match=r"qwen3.loss: the parallel hook parameter reduce_partial was removed; .*"
                                        r"hpfunc.layout.tensor_parallel\('tp'\)"):
        qwen3.loss(params, batch, cfg, reduce_partial=lambda y: y)
    with pytest.raises(TypeError, match="qwen3.apply: the parallel hook parameters embed, head were removed"):
        qwen3.apply(params, batch["tokens"], cfg, head=None, embed=None)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'regoins'"):
        qwen3.loss(params, batch, cfg, regoins=None)
