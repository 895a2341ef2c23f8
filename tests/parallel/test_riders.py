"""The step's scalars riding one all-reduce (hpfunc.transforms.engine.riders): the sum of the packed
vectors of n ranks unpacks to exactly what separate collectives give -- floating means and sums (to
the carrier's rounding), integer sums exactly (two's complement, wrapping as an int64 psum does), and
the weight leaving out the ranks of axes the values are not reduced over. The ranks are simulated: the
all-reduce is the sum of their vectors, in a random order."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpfunc.transforms.engine.riders import Riders, limb_bits

INT64 = st.integers(-(2**63), 2**63 - 1)


def _all_reduce(vectors: list[torch.Tensor], seed: int) -> torch.Tensor:
    order = list(range(len(vectors)))
    random.Random(seed).shuffle(order)
    total = torch.zeros_like(vectors[0])
    for k in order:
        total = total + vectors[k]
    return total


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 64), ints=st.lists(INT64, min_size=1, max_size=4), carrier=st.sampled_from(["32", "64"]),
       seed=st.integers(0, 2**16))
def test_integer_sums_are_exact_and_wrap(n, ints, carrier, seed):
    dtype = torch.float32 if carrier == "32" else torch.float64
    rng = random.Random(seed)
    per_rank = [torch.tensor([rng.choice(ints + [rng.randint(-(2**63), 2**63 - 1)]) for _ in ints]) for _ in range(n)]
    riders = [Riders([x], ["sum"], dtype, n=n) for x in per_rank]
    assert riders[0].fits()
    got = riders[0].unpack(_all_reduce([r.pack() for r in riders], seed))[0]
    want = torch.stack(per_rank).sum(0)  # int64: wraps modulo 2**64
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 16), seed=st.integers(0, 2**16), shape=st.sampled_from([(), (3,), (2, 2)]))
def test_floating_means_and_sums(n, seed, shape):
    g = torch.Generator().manual_seed(seed)
    loss = [torch.randn(shape, generator=g) for _ in range(n)]
    norm = [torch.rand((), generator=g, dtype=torch.float64) for _ in range(n)]
    small = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(n)]
    riders = [Riders([a, b, c], ["mean", "sum", "mean"], torch.float64, n=n) for a, b, c in zip(loss, norm, small)]
    out = riders[0].unpack(_all_reduce([r.pack() for r in riders], seed))
    torch.testing.assert_close(out[0], torch.stack(loss).double().mean(0).float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[1], torch.stack(norm).sum(0), rtol=1e-12, atol=0)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float64 and out[2].dtype == torch.bfloat16
    assert out[0].shape == torch.Size(shape) and out[2].shape == torch.Size(shape)
    torch.testing.assert_close(out[2].float(), torch.stack(small).float().mean(0), rtol=1e-2, atol=1e-2)


def test_the_mean_of_fp32_values_equals_pmean_bitwise():
    # in an fp32 carrier: the same sum and the same 1/n scaling as lax.pmean's psum * (1/n)
    xs = [torch.tensor(0.1), torch.tensor(0.7), torch.tensor(1e-3)]
    riders = [Riders([x], ["mean"], torch.float32, n=3) for x in xs]
    got = riders[0].unpack(xs[0].reshape(1) + xs[1].reshape(1) + xs[2].reshape(1))[0]
    assert got.item() == ((xs[0] + xs[1] + xs[2]) * (1.0 / 3)).item()


def test_weight_zero_ranks_add_nothing():
    # a collective over 4 ranks (data 2 x tp 2) carrying values reduced over the 2 data ranks: the tp
    # rank 1 of each data rank has weight 0
    values = {(d, t): (torch.tensor(float(10 * d + 1)), torch.tensor(d + 5)) for d in range(2) for t in range(2)}
    riders = {k: Riders(list(v), ["mean", "sum"], torch.float32, n=2, ranks=4, weight=1.0 if k[1] == 0 else 0.0)
              for k, v in values.items()}
    out = riders[(0, 0)].unpack(_all_reduce([r.pack() for r in riders.values()], 0))
    assert out[0].item() == (1.0 + 11.0) / 2 and out[1].item() == 5 + 6


def test_what_cannot_ride():
    assert not Riders([torch.tensor(1.0, dtype=torch.float64)], ["mean"], torch.float32, n=2).fits()
    assert not Riders([torch.tensor(True)], ["sum"], torch.float32, n=2).fits()
    assert not Riders([torch.tensor(1j)], ["mean"], torch.float64, n=2).fits()
    # integer limbs: 12 bits in fp32 while n * 4095 < 2**24 (n <= 4097), 32 bits in fp64 while
    # n * (2**32 - 1) < 2**53
    assert limb_bits(torch.float32, 4097) == 12 and limb_bits(torch.float32, 4098) is None
    assert limb_bits(torch.float64, 2**21) == 32 and limb_bits(torch.float64, 2**21 + 1) is None
    assert limb_bits(torch.bfloat16, 2) is None
    assert not Riders([torch.tensor(3)], ["sum"], torch.float32, n=8192).fits()
    assert Riders([torch.tensor(3)], ["sum"], torch.float64, n=8192).fits()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int64])
def test_integer_dtypes_come_back(dtype):
    xs = [torch.tensor([1, 2], dtype=dtype), torch.tensor([3, 4], dtype=dtype)]
    riders = [Riders([x], ["sum"], torch.float32, n=2) for x in xs]
    got = riders[0].unpack(riders[0].pack() + riders[1].pack())[0]
    assert got.dtype == dtype and got.tolist() == [4, 6]
