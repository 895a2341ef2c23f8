"""A scope bound around a parallelized step call (``hpfunc.layout.Scopes``: a recorder, a test hook, the
trainer's step count) reaches the step's body and the function it differentiates, although the engine
binds its own layouts (made when the step was lowered) for both."""

from __future__ import annotations

import pytest

import _scopes_helpers as H

pytestmark = pytest.mark.multirank


def test_every_scope_bound_around_a_step_is_seen_in_its_body_and_its_loss(pools):
    for out in pools(2).run(H.scopes_seen_inside_a_step):
        assert out["body"] == (True, []), out  # in the engine's binding of the body, every member the caller's
        assert out["loss"] == (True, []), out  # in the engine's binding of the differentiated function, too
        assert out["value"] == out["plain_value"]  # the same step on the same state and batch: the scopes only record
