"""Kernel choice: grouped expert matmuls through F.grouped_mm where the device and dtype take it, the
padded bmm fallback where not (float64 on the CPU), and the float64 step against the float32 one."""

from __future__ import annotations

import attrs
import pytest
import torch

from hpfunc import optim, random, tree
from hpfunc.models import moe, qwen3
from hpfunc.train.step import init_train_state, make_train_step


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_auto_picks_grouped_mm_where_supported_and_bmm_for_float64():
    x = torch.zeros(2, 8)
    assert moe._grouped_mm_supported(x, fake=False)
    assert moe._grouped_mm_supported(x.bfloat16(), fake=False)
    assert not moe._grouped_mm_supported(x.double(), fake=False)  # CPU grouped_mm refuses Double
    assert moe._grouped_mm_supported(x.double(), fake=True)  # a dry run takes the bf16 detour
    with pytest.raises(RuntimeError, match="Double"):  # why the fallback exists (torch 2.13)
        moe.expert_ffn(x.double(), torch.tensor([1, 1]), *(torch.zeros(2, 16, 8, dtype=torch.float64),) * 2,
                       torch.zeros(2, 8, 16, dtype=torch.float64), impl="grouped_mm")


def test_float64_experts_equal_float32_grouped_mm():
    g = torch.Generator().manual_seed(0)
    T, E, k, H, I = 24, 4, 2, 16, 8
    x = torch.randn(T, H, generator=g)
    ws = [torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)]
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)

    def run(dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (x, w, *ws)]
        y = moe.grouped_experts(leaves[0], idx, leaves[1], *leaves[2:])  # impl="auto"
        return y, torch.autograd.grad(y.square().sum(), leaves)

    y32, g32 = run(torch.float32)
    y64, g64 = run(torch.float64)
    torch.testing.assert_close(y64.float(), y32, rtol=1e-5, atol=1e-5)
    for a, b in zip(g64, g32):  # fp32 rounding, relative to each gradient's scale
        torch.testing.assert_close(a.float(), b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_float64_moe_train_step_equals_float32_reference():
    cfg = attrs.evolve(qwen3.preset("qwen3-moe-tiny"), hidden_size=32, moe_intermediate_size=16, intermediate_size=32)
    tokens = random.randint(random.key(1), (2, 17), 0, 256)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    tx = optim.adamw(1e-3, weight_decay=0.1)

    def run(dtype):
        params = qwen3.init(random.key(0), cfg, dtype)
        step = make_train_step(cfg, tx, expert_bias_rate=1e-2)
        state = init_train_state(params, tx)
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        return torch.stack(losses), state.params

    l32, p32 = run(torch.float32)
    l64, p64 = run(torch.float64)
    torch.testing.assert_close(l64.float(), l32, rtol=1e-5, atol=1e-6)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p64), tree.leaves_with_paths(p32)):
        assert a.dtype == (torch.float32 if path.endswith("expert_bias") else torch.float64), path
        torch.testing.assert_close(a.float(), b, rtol=1e-5, atol=1e-5, msg=path)
