"""Logit, gradient and aux-loss parity with transformers' Qwen3 / Qwen3-MoE (fp32, eager attention),
through both checkpoint directions: HF save_pretrained -> our from_pretrained, and ours -> HF."""

from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfunc
from hpfunc.models import RopeScaling, qwen3
from hpfunc.models.config import Qwen3Config

from ._hf import hf_grad_tree, hf_model, max_abs_diff

transformers = pytest.importorskip("transformers")

TOL = 1e-5


@st.composite
def tiny_configs(draw) -> Qwen3Config:
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    layers = draw(st.integers(1, 3))
    rope = draw(st.sampled_from([None, "linear", "yarn"]))
    scaling = None if rope is None else RopeScaling(rope_type=rope, factor=draw(st.sampled_from([2.0, 4.0])))
    common = dict(
        vocab_size=draw(st.sampled_from([37, 64])),
        hidden_size=draw(st.sampled_from([16, 24, 32])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=draw(st.sampled_from([4, 8, 16])),
        intermediate_size=draw(st.sampled_from([8, 24])),
        rope_theta=draw(st.sampled_from([100.0, 10000.0])),
        rope_scaling=scaling,
        max_position_embeddings=64,
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
    )
    if draw(st.booleans()):  # MoE
        experts = draw(st.integers(2, 8))
        step = draw(st.sampled_from([1, 1, 2])) if layers > 1 else 1
        only = draw(st.sets(st.integers(0, layers - 1), max_size=layers - 1)) if layers > 1 else set()
        cfg = Qwen3Config(
            **common, num_experts=experts, num_experts_per_tok=draw(st.integers(1, min(experts, 4))),
            moe_intermediate_size=draw(st.sampled_from([4, 12])), norm_topk_prob=draw(st.booleans()),
            decoder_sparse_step=step, mlp_only_layers=tuple(sorted(only)),
            router_aux_loss_coef=draw(st.sampled_from([0.001, 0.1])))
        if not cfg.moe_layers:  # the reference's aux loss needs at least one MoE layer
            cfg = cfg.replace(mlp_only_layers=(), decoder_sparse_step=1)
        return cfg
    return Qwen3Config(**common)


@settings(max_examples=12, deadline=None)
@given(cfg=tiny_configs(), batch=st.integers(1, 2), seq=st.integers(1, 12), offset=st.sampled_from([0, 5]),
       seed=st.integers(0, 2**16))
def test_parity_with_transformers(cfg: Qwen3Config, batch: int, seq: int, offset: int, seed: int) -> None:
    ref = hf_model(cfg, seed=seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        loaded_cfg, params = qwen3.from_pretrained(d)
    assert loaded_cfg == cfg

    # Logits (also at shifted positions).
    positions = torch.arange(seq) + offset
    out = ref(input_ids=tokens, position_ids=positions[None].expand(batch, -1), labels=tokens,
              output_router_logits=cfg.is_moe)
    logits, aux = qwen3.apply(params, tokens, cfg, positions=positions, return_aux=True)
    assert (logits - out.logits).abs().max().item() <= TOL
    if cfg.is_moe:
        assert abs(aux["aux_loss"].item() - out.aux_loss.item()) <= TOL
        assert aux["expert_load"].shape == (len(cfg.moe_layers), cfg.num_experts)
        assert aux["expert_load"].sum().item() == len(cfg.moe_layers) * batch * seq * cfg.num_experts_per_tok

    # Loss and gradients of every parameter (position 0 default, as the trainer uses it).
    ref.zero_grad(set_to_none=True)
    ref_out = ref(input_ids=tokens, labels=tokens, output_router_logits=cfg.is_moe)
    if seq > 1:
        ref_out.loss.backward()
        (value, laux), grads = hpfunc.value_and_grad(qwen3.loss, has_aux=True)(params, {"tokens": tokens}, cfg)
        assert abs(value.item() - ref_out.loss.item()) <= TOL
        assert laux["tokens"].item() == batch * (seq - 1)
        err, where = max_abs_diff(grads, hf_grad_tree(ref, params))
        assert err <= TOL, f"gradient of {where} differs by {err}"

    # Our checkpoint loads in transformers with identical logits.
    with tempfile.TemporaryDirectory() as d:
        qwen3.save_pretrained(params, cfg, d)
        back = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    back_logits = back(input_ids=tokens).logits
    ours = qwen3.apply(params, tokens, cfg)
    assert (back_logits - ours).abs().max().item() <= TOL
    assert (back_logits - out.logits if offset == 0 else back_logits - ref(input_ids=tokens).logits
            ).abs().max().item() <= TOL


def test_labels_with_ignore_index_match_reference() -> None:
    cfg = qwen3.preset("qwen3-moe-tiny")
    ref = hf_model(cfg, seed=1)
    params = _params_of(ref, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    hf_labels = tokens.clone()
    hf_labels[0, :4] = -100
    out = ref(input_ids=tokens, labels=hf_labels, output_router_logits=True)
    value, aux = qwen3.loss(params, {"tokens": tokens, "labels": qwen3.shift_labels(hf_labels)}, cfg)
    assert abs(value.item() - out.loss.item()) <= TOL
    assert aux["tokens"].item() == (qwen3.shift_labels(hf_labels) != -100).sum().item()


def _params_of(ref, cfg):
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        return qwen3.from_pretrained(d)[1]


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "qwen3-dense-tiny"])
def test_bfloat16_logits_close_to_reference(name: str) -> None:
    # bf16 has 8 mantissa bits: logits of magnitude ~3 differ by a few ulps (0.0156 each) because
    # attention kernels and expert accumulation order differ.
    cfg = qwen3.preset(name)
    ref = hf_model(cfg, seed=0).to(torch.bfloat16)
    params = _params_of(ref, cfg)
    assert params["embed"].dtype == torch.bfloat16
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, theirs = qwen3.apply(params, tokens, cfg).float(), ref(input_ids=tokens).logits.float()
    assert (ours - theirs).abs().max().item() <= 0.1
    assert (ours - theirs).abs().mean().item() <= 0.01
