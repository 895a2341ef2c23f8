"""hpfunc.microbatch on one device: the mean over micro-batches equals the whole batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfunc


@settings(max_examples=20)
@given(num=st.sampled_from([1, 2, 3, 6]), rows=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_mean_of_microbatches_is_the_whole_batch(num, rows, seed):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    batch = {"x": torch.randn(6 * rows, 4, generator=g), "y": torch.randint(0, 3, (6 * rows,), generator=g)}

    def loss(p, b):
        logits = b["x"] @ p["w"] + p["b"]
        ce = torch.nn.functional.cross_entropy(logits, b["y"])
        return ce, {"ce": ce, "count": (b["y"] >= 0).sum()}

    (v1, a1), g1 = hpfunc.value_and_grad(loss, has_aux=True)(params, batch)
    (vk, ak), gk = hpfunc.microbatch(hpfunc.value_and_grad(loss, has_aux=True), num)(params, batch)
    torch.testing.assert_close(vk, v1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gk, g1, rtol=1e-5, atol=1e-6)
    assert int(ak["count"]) == int(a1["count"])  # integers are summed


def test_bad_split_names_the_leaf():
    f = hpfunc.microbatch(hpfunc.value_and_grad(lambda p, b: (p * b["x"]).sum()), 4)
    with pytest.raises(ValueError, match="leaf 'x' of shape \\(6,\\) does not split into 4"):
        f(torch.ones(()), {"x": torch.ones(6)})
    with pytest.raises(ValueError, match="num must be an integer >= 1"):
        hpfunc.microbatch(f, 0)
