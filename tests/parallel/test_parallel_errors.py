"""Bad plans and batches fail with a ValueError naming the path or axis, before any communication."""

from __future__ import annotations

import pytest

import _parallel_helpers as H

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("case,needles", [
    ("unknown_path", ["layers.*.attn.wqq", "matches no parameter path", "did you mean"]),
    ("unknown_axis", ["'fdsp'", "mesh axes are ('fsdp',)"]),
    ("unknown_axis_in_rule", ["'embed'", "'tp'"]),
    ("not_divisible", ["'w'", "dimension 0 of size 3", "2 ranks"]),
    ("tp_heads", ["layers.0.attn.wk", "tp('tp')", "1 heads of 16"]),
    ("batch", ["tokens", "(3, 8)", "('fsdp',)"]),
    ("compute_not_prefix", ["'embed'", "prefix"]),
])
def test_bad_input_is_a_clear_value_error(pool2, case, needles):
    msg = pool2.run(H.run_bad_input, case)[0]
    for n in needles:
        assert n in msg, msg
