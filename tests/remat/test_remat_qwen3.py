"""remat and offload on the tiny Qwen3 dense and MoE models: gradients equal the plain loss exactly."""

from __future__ import annotations

import warnings

import pytest
import torch

import hpfunc
from hpfunc.transforms import offload as O
from hpfunc.transforms import remat as R

qwen3 = pytest.importorskip("hpfunc.models.qwen3")

POLICIES = {
    "nothing_saveable": R.nothing_saveable,
    "dots_saveable": R.dots_saveable,
    "dots_with_no_batch_dims_saveable": R.dots_with_no_batch_dims_saveable,
    "every_op": lambda op, name, t: True,
}


@pytest.fixture(scope="module", params=["qwen3-dense-tiny", "qwen3-moe-tiny"])
def model(request):
    cfg = qwen3.preset(request.param)
    params = qwen3.init(hpfunc.random.key(0), cfg)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))}
    want = hpfunc.value_and_grad(lambda p: qwen3.loss(p, batch, cfg), has_aux=True)(params)
    return cfg, params, batch, want


def check(model, wrap):
    cfg, params, batch, ((value, _), grads) = model
    (v, _), g = hpfunc.value_and_grad(wrap(lambda p: qwen3.loss(p, batch, cfg)), has_aux=True)(params)
    assert torch.equal(v, value)
    for (path, a), b in zip(hpfunc.tree.leaves_with_paths(grads), hpfunc.tree.leaves(g), strict=True):
        assert torch.equal(a, b), path


@pytest.mark.parametrize("policy", list(POLICIES))
def test_remat_whole_loss(model, policy):
    check(model, lambda f: R.remat(f, policy=POLICIES[policy]))


def test_offload_whole_loss(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(model, lambda f: O.offload(f, bucket_bytes=1 << 16))


def test_remat_then_offload_nested(model):
    check(model, lambda f: O.offload(R.remat(f, policy=R.dots_saveable)))
