"""Rank-side helpers of the layout-scopes tests: every scope of ``hpfunc.layout.Scopes`` bound around a
parallelized step call, read back in the step's body and in the function it differentiates."""

from __future__ import annotations

import torch


def scopes_seen_inside_a_step() -> dict:
    """Two fsdp steps of a small MLP (SGD written in the step) called inside every scope the library binds.
    Returns, per place (the step's body, the differentiated function): whether the engine's binding was
    in force there (proof that the read is inside it) and which scope members differ from those bound
    around the call; plus the loss against the same step called with no scope."""
    import contextlib

    import hpfunc
    from hpfunc import layout
    from hpfunc.memory._names import name_scope
    from hpfunc.models.context_attention import trace_ring
    from hpfunc.models.dispatch import trace_exchange
    from hpfunc.optim.base import streaming_state
    from hpfunc.train.precision_probe import PrecisionProbe, steps_done
    from hpfunc.transforms import plans
    from hpfunc.transforms.engine.sdc import inject_bit_flip
    from hpfunc.transforms.pipeline import record_timeline

    seen: dict = {}

    def step(state, batch):
        seen["body"] = (layout.current() is not None, layout.scopes())

        def loss(p):
            seen["loss"] = (layout.data_axes() == ("fsdp",) and layout.current() is None, layout.scopes())
            h = torch.tanh(batch["x"] @ p["w_in"].T)
            return ((h @ p["w_out"].T - batch["y"]) ** 2).mean()

        value, g = hpfunc.value_and_grad(loss)(state["params"])
        return {"params": hpfunc.tree.tree_map(lambda w, d: w - 0.1 * d, state["params"], g)}, {"loss": value}

    ts = hpfunc.parallelize(step, hpfunc.Mesh({"fsdp": 2}), plans.fsdp("fsdp"))
    gen = torch.Generator().manual_seed(0)
    full = {"w_in": torch.randn(8, 4, generator=gen), "w_out": torch.randn(2, 8, generator=gen)}
    batch = {"x": torch.randn(4, 4, generator=gen), "y": torch.randn(4, 2, generator=gen)}
    state = {"params": ts.shard_params(full)}
    _, plain = ts(state, batch)
    with contextlib.ExitStack() as stack:
        for scope in (streaming_state(1 << 20), inject_bit_flip(rank=99, path="none", bit=0), record_timeline(),
                      trace_exchange(), trace_ring(), name_scope(), PrecisionProbe().recording(), steps_done(7),
                      layout.scoped(checkpoint_tag="outside")):
            stack.enter_context(scope)
        outside = layout.scopes()
        assert all(getattr(outside, a.name) is not None for a in type(outside).__attrs_attrs__), outside
        _, m = ts(state, batch)
    out = {"value": float(m["loss"].full_tensor()), "plain_value": float(plain["loss"].full_tensor())}
    for where, (inside_engine, scopes) in seen.items():
        out[where] = (inside_engine, [a.name for a in type(scopes).__attrs_attrs__
                                      if getattr(scopes, a.name) is not getattr(outside, a.name)])
    return out
