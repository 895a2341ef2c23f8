"""``hpfunc.dfunction``: a fused MLP whose hand-written backward recomputes its activation equals
autograd of the plain function, on DTensors (the global view) and as a layer trained by
``hpfunc.parallelize`` with fsdp x tp, with and without ``hpfunc.remat``; a wrong backward is caught;
misuses name the argument."""

from __future__ import annotations

import pytest

import _dfunction_helpers as H

pytestmark = pytest.mark.multirank


def test_global_view_equals_autograd_of_the_plain_function(pool2):
    assert max(pool2.run(H.run_global_view, 0)) < 1e-5


def test_a_wrong_backward_is_caught(pool2):
    # the cotangent of the output used without the psum that transposes the forward's
    assert min(pool2.run(H.run_global_view, 0, "no_psum")) > 1e-2


def test_inside_parallelize_fsdp_x_tp_under_remat(pools):
    # two AdamW steps of a model whose layers are remat'd: losses, gradients and parameters equal the
    # plain model's parallelized step and one device
    for out in pools(4).run(H.run_parallelize, 3, True):
        assert out["fused_vs_plain"] <= 1.0 and out["fused_vs_one_device"] <= 1.0, out


def test_misuse_names_the_argument(pool2):
    shape, axis, count = pool2.run(H.run_errors)[0]
    assert "cotangent of args[0] (leaf 0) is torch.float32 (4,), but this rank's block of the argument is " \
           "torch.float32 (2, 4)" in shape
    assert "args[0] has spec P('dp') naming mesh axis 'dp', but the bound mesh has axes ('tp',)" in axis
    assert "bwd must return a tuple with one cotangent per argument (1), found tuple of length 2" in count
