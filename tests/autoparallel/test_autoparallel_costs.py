"""The cost model against the formulas of docs/reference.md and against torch's FLOP counter."""

from __future__ import annotations

from fractions import Fraction

import attrs
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hpfunc import random
from hpfunc.autoparallel.comm_model import communication
from hpfunc.autoparallel.configuration import Layout, LayoutError, Workload
from hpfunc.autoparallel.flops import train_flops_per_token
from hpfunc.autoparallel.hardware import HardwareError, hardware, parse_bytes
from hpfunc.autoparallel.memory_model import layer_activation_bytes_per_token, memory
from hpfunc.models import qwen3
from hpfunc.models.qwen3.describe import describe

BIG = qwen3.preset("qwen3-30b-a3b")
D = describe(BIG)
PSI = qwen3.count_params(BIG)
WORK = Workload(global_batch=64, seq_len=4096)


def test_description_counts_equal_the_model():
    assert D.params == PSI == 30_532_122_624
    # active matmul parameters + head = the model's active parameters without the input embedding
    active_mm = sum(l.matmul_flops_per_token for l in D.layers) / 2 + D.head_flops_per_token / 2
    norms = sum(2 * BIG.hidden_size + 2 * BIG.head_dim for _ in D.layers) + BIG.hidden_size
    assert active_mm + norms + D.embed_params == qwen3.active_params(BIG)
    for name in ("qwen3-moe-tiny", "qwen3-dense-tiny", "qwen3-moe-small"):
        cfg = qwen3.preset(name)
        assert describe(cfg).params == qwen3.count_params(cfg), name


def test_qwen3_30b_a3b_flops_per_token():
    f = train_flops_per_token(D, 4096)
    assert 23.0e9 <= f <= 23.1e9  # docs/reference.md: 23.0-23.1 GFLOP/token with causal halving
    assert train_flops_per_token(D, 4096, causal=False) == pytest.approx(27.9e9, abs=0.05e9)


def _sdpa_cpu(q, k, v, *args, out_shape=None, **kw):
    b, h, s, d = q
    return 4 * b * h * s * k[2] * d  # torch's convention: scores and weighted values, no causal halving


def _sdpa_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kw):
    return 2 * _sdpa_cpu(q, k, v)


def _grouped_mm(a, b, *args, out_shape=None, **kw):
    if len(a) == 2 and len(b) == 3:  # tokens grouped by expert @ expert stacks
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # the weight gradient: groups along the contraction
        return 2 * a[0] * a[1] * b[1]
    raise AssertionError(f"unexpected grouped_mm shapes {a} {b}")


@pytest.mark.parametrize("name", ["qwen3-dense-tiny", "qwen3-moe-tiny"])
def test_flops_equal_torch_flop_counter(name):
    # A real forward and backward of the tiny model under torch's FLOP counter (CPU flash attention and
    # grouped_mm are not in torch's table: counted with torch's own conventions, above). torch counts
    # attention without causal halving, so the model is compared with causal=False.
    cfg = qwen3.preset(name)
    params = qwen3.init(random.key(0), cfg)
    for leaf in torch.utils._pytree.tree_leaves(params):
        leaf.requires_grad_(True)
    b, s = 2, 32
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
               aten._grouped_mm: _grouped_mm}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        loss, _ = qwen3.loss(params, {"tokens": tokens}, cfg, moe_impl="grouped_mm" if cfg.is_moe else "auto")
        loss.backward()
    counted = counter.get_total_flops()
    assert counted == train_flops_per_token(describe(cfg), s, causal=False) * b * s


def test_model_states_follow_the_reference_table():
    # docs/reference.md#model-state-memory, mixed precision: 16 Psi / n (ZeRO-3), 2 Psi + 14 Psi / n
    # (ZeRO-2), 4 Psi + 12 Psi / n (ZeRO-1), 16 Psi (DDP)
    n = 8
    cases = {Layout(fsdp=n): Fraction(16 * PSI, n), Layout(fsdp=n, zero=2): 2 * PSI + Fraction(14 * PSI, n),
             Layout(fsdp=n, zero=1): 4 * PSI + Fraction(12 * PSI, n), Layout(dp=n): 16 * PSI,
             Layout(ep=8): Fraction(16 * PSI, 8), Layout(ep=16): Fraction(16 * PSI, 16),
             Layout(ep=4, fsdp=2): Fraction(16 * PSI, 8)}
    for lay, expected in cases.items():
        got = memory(D, lay, WORK).model_states
        assert got == pytest.approx(float(expected), rel=1e-12), lay.name
    # 61.1 GB per rank at 8-way sharding (docs/reference.md)
    assert round(memory(D, Layout(ep=8), WORK).model_states / 1e9, 1) == 61.1


def test_activation_bytes_follow_korthikanti():
    s, b, h = 4096, 1, 2048
    layer = D.layers[0]
    one = Workload(global_batch=1, seq_len=s)
    assert layer_activation_bytes_per_token(layer, "full", Layout(), one) * s * b == 2 * s * b * h
    assert layer_activation_bytes_per_token(layer, "full", Layout(tp=4, sp=True), one) * s * b == 2 * s * b * h / 4
    # everything this layer keeps splits over tp with sp, and only the head-/feature-split part without
    none = layer_activation_bytes_per_token(layer, "none", Layout(), one)
    assert layer_activation_bytes_per_token(layer, "none", Layout(tp=4, sp=True), one) == pytest.approx(none / 4)
    assert none / 4 < layer_activation_bytes_per_token(layer, "none", Layout(tp=4), one) < none
    assert (layer_activation_bytes_per_token(layer, "full", Layout(), one)
            < layer_activation_bytes_per_token(layer, "selective", Layout(), one) < none)


def test_communication_follows_the_reference_formulas():
    a = 2  # bf16 bytes
    n = 8
    c = {(x.collective, x.axis): x for x in communication(D, Layout(fsdp=n), WORK)}
    # FSDP with reshard after forward: 3 Psi (n-1)/n -- two all-gathers (the backward's without the
    # embedding, as hpfunc's step measures: docs/autoparallel.md) and a reduce-scatter, which hpfunc
    # runs in fp32 (the storage dtype) under mixed precision
    assert c[("all_gather", "fsdp")].bytes == pytest.approx((2 * PSI - D.embed_params) * a * (n - 1) / n)
    assert c[("reduce_scatter", "fsdp")].bytes == pytest.approx(PSI * 4 * (n - 1) / n)
    c = {(x.collective, x.axis): x for x in communication(D, Layout(dp=n), WORK)}
    assert c[("all_reduce", "dp")].bytes == pytest.approx(2 * PSI * 4 * (n - 1) / n)  # DDP: 2 Psi (n-1)/n, fp32
    # TP: 4 all-reduces of b s h per layer (2 forward, 2 backward); SP: the same volume as AG + RS
    t, L = 4, BIG.num_hidden_layers
    tokens = WORK.tokens / 4  # global batch over the fsdp=4 data shards, one microbatch
    c = {(x.collective, x.axis): x for x in communication(D, Layout(fsdp=4, tp=t), WORK)}
    assert c[("all_reduce", "tp")].count == 4 * L
    assert c[("all_reduce", "tp")].bytes == pytest.approx(4 * L * 2 * (t - 1) / t * tokens * 2048 * a)
    sp = {(x.collective, x.axis): x for x in communication(D, Layout(fsdp=4, tp=t, sp=True), WORK)}
    assert sp[("all_gather", "tp")].bytes + sp[("reduce_scatter", "tp")].bytes == pytest.approx(
        c[("all_reduce", "tp")].bytes)
    # EP: 4 all-to-alls per MoE layer of k h elements per token, (EP-1)/EP off-rank; 32 KiB/token in bf16
    ep = {(x.collective, x.axis): x for x in communication(D, Layout(ep=8), WORK)}
    x = ep[("all_to_all", "ep")]
    assert x.count == 4 * L
    assert x.bytes / (4 * L * WORK.tokens / 8) == 32 * 1024 * 7 / 8
    # the padded dispatcher's buffers (moe_buffer_factor 1.5) move 1.5 x as much
    padded = attrs.evolve(WORK, moe_buffer_factor=1.5)
    y = {(x.collective, x.axis): x for x in communication(D, Layout(ep=8), padded)}[("all_to_all", "ep")]
    assert y.bytes == pytest.approx(1.5 * x.bytes)


def test_bad_hardware_and_sizes_name_the_flag():
    with pytest.raises(HardwareError, match=r"--hardware: unknown hardware 'tpu'.*known: h100, h200, a100, cpu, or a profile PATH.json"):
        hardware("tpu")
    with pytest.raises(HardwareError, match=r"--memory: expected a positive size"):
        parse_bytes("lots")
    assert parse_bytes("80GiB") == 80 * 2**30
    with pytest.raises(LayoutError, match=r"layout.cp: context parallelism is not implemented"):
        Layout(cp=2)
    with pytest.raises(LayoutError, match=r"--devices: the layout ep8 remat=none fills 8 devices.*but 6 are given"):
        Layout(ep=8).check(6, global_batch=64, layers=48, num_experts=128)
    with pytest.raises(LayoutError, match=r"parallel.mesh.ep: 3 does not divide the model's 128 experts"):
        Layout(ep=3).check(3, global_batch=3, layers=48, num_experts=128)


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_layer_forward_ops_equal_the_dispatched_count(moe):
    # the host term of the time model charges each layer its forward's operators: count what the real
    # decoder layer dispatches (aten ops under a dispatch mode, autograd on, the local path)
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpfunc import tree
    from hpfunc.models.qwen3 import model as M

    kw = {} if moe else dict(num_experts=0, moe_intermediate_size=0, num_experts_per_tok=0)
    cfg = M.preset("qwen3-moe-tiny", **kw)
    g = torch.Generator().manual_seed(0)
    params = tree.tree_map(lambda s: (torch.randn(tuple(s), generator=g) * 0.02).requires_grad_(),
                           M.param_shapes(cfg)["layers"][0], is_leaf=lambda x: isinstance(x, torch.Size))
    h = torch.randn(2, 33, cfg.hidden_size, generator=g, requires_grad=True)
    cos, sin = M.rope_for(h, torch.arange(33)[None], cfg)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        M.decoder_layer(params, h, cos, sin, cfg)
    layer = describe(cfg, act_bytes=4).layers[0]
    assert layer.forward_ops == Count.ops
    assert layer.param_tensors == len(tree.leaves(params))
