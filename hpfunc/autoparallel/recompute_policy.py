"""The automatic recompute / swap policy: per layer, keep, recompute or swap each tagged saved value so
that the activations fit a memory budget at the least estimated extra time.

Each layer runs under ``remat`` with the policy ``save_and_offload_only_these_names(save, offload)``
(:mod:`hpfunc.transforms.policies`): its input is always kept (the region's input), a value named in
``save`` stays on the device, one in ``offload`` moves to host memory, everything else is recomputed
in the backward. The values and their sizes come from the model description
(:class:`~hpfunc.models.description.SavedValue`: the ``checkpoint_name`` tags).

Costs (seconds, from the hardware description): recomputing a value costs its FLOPs at the matmul
(or attention) efficiency plus its bytes written and read through HBM; swapping costs its bytes out
and back over the host link, hidden behind the step's compute when the device copies asynchronously
(``Hardware.async_copy``) up to that compute time, all of it otherwise. Starting from keeping
everything, the value with the least extra time per byte saved is recomputed or swapped until the
device bytes fit. Each value's choice costs at most its recompute, so the policy is never estimated
slower than recomputing every value (full recompute) under the same budget.

The chosen policy is plain data (:meth:`RecomputePlan.to_config`) and :func:`policies_from_config`
turns it back into one remat policy per layer.

    >>> from hpfunc.models.description import LayerDescription, SavedValue
    >>> layer = LayerDescription(hidden=4, dense_params=0, act_bytes=4, saved=(
    ...     SavedValue("up", 64.0, matmul=True, recompute_flops_per_token=256.0), SavedValue("act", 64.0)))
    >>> plan = choose_policy([layer, layer], tokens=8, seq_len=8, budget_bytes=2 * (16 + 64) * 8, hardware="h100")
    >>> plan.to_config()["layers"][0]
    {'save': ['up'], 'offload': []}
    >>> plan.device_bytes <= plan.budget_bytes
    True
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from hpfunc.autoparallel.flops import attention_positions
from hpfunc.autoparallel.hardware import Hardware, format_bytes, hardware
from hpfunc.models.description import LayerDescription, SavedValue

__all__ = ["RecomputePlan", "choose_policy", "policies_from_config", "PolicyBudgetError", "value_costs"]

SAVE, RECOMPUTE, OFFLOAD = "save", "recompute", "offload"


class PolicyBudgetError(ValueError):
    """The budget is below what the layers keep in any case (their inputs)."""


@attrs.frozen
class RecomputePlan:
    """Per layer, ``{name: "save" | "recompute" | "offload"}``; the bytes and the extra seconds estimated."""

    decisions: tuple[Mapping[str, str], ...]
    device_bytes: float
    host_bytes: float
    extra_seconds: float
    full_recompute_seconds: float
    budget_bytes: float

    def to_config(self) -> dict[str, Any]:
        """``{"budget_bytes", "layers": [{"save": [...], "offload": [...]}, ...]}``: the names each layer
        keeps and swaps (everything else is recomputed)."""
        return {"budget_bytes": self.budget_bytes, "estimated_extra_seconds": self.extra_seconds,
                "layers": [{"save": sorted(n for n, d in layer.items() if d == SAVE),
                            "offload": sorted(n for n, d in layer.items() if d == OFFLOAD)}
                           for layer in self.decisions]}


def value_costs(v: SavedValue, layer: LayerDescription, tokens: float, seq_len: int, hw: Hardware, *,
                dtype: str = "bfloat16", causal: bool = True) -> tuple[float, float]:
    """``(recompute seconds, swap seconds)`` of one value over ``tokens`` tokens."""
    peak = hw.peak_flops(dtype)
    memory_traffic = tokens * 2.0 * v.bytes_per_token / hw.hbm_bw
    if v.attention:
        flops = layer.attention_flops_per_token_per_position * attention_positions(seq_len, causal)
        recompute = tokens * flops / (peak * hw.attention_efficiency) + memory_traffic
    else:
        recompute = tokens * v.recompute_flops_per_token / (peak * hw.matmul_efficiency) + memory_traffic
    swap = tokens * 2.0 * v.bytes_per_token / hw.host_bw
    return recompute, swap


def _compute_seconds(layers: Sequence[LayerDescription], tokens: float, seq_len: int, hw: Hardware, dtype: str,
                     causal: bool) -> float:
    peak = hw.peak_flops(dtype)
    total = 0.0
    for layer in layers:
        mm = layer.matmul_flops_per_token / (peak * hw.matmul_efficiency)
        attn = layer.attention_flops_per_token_per_position * attention_positions(seq_len, causal) / (
            peak * hw.attention_efficiency)
        total += 3.0 * tokens * (mm + attn)
    return total


def choose_policy(layers: Sequence[LayerDescription], *, tokens: float, seq_len: int, budget_bytes: float,
                  hardware: str | Hardware = "h100", dtype: str = "bfloat16", causal: bool = True,
                  allow_swap: bool = True) -> RecomputePlan:
    """Keep / recompute / swap each tagged value of each layer so that the saved activations of one
    microbatch of ``tokens`` tokens fit ``budget_bytes`` (see the module docstring).

    Raises:
        PolicyBudgetError: the budget is below the layers' inputs, which every policy keeps.
    """
    hw = _hardware(hardware)
    inputs = sum(layer.act_bytes * layer.hidden * tokens for layer in layers)
    if budget_bytes < inputs:
        raise PolicyBudgetError(
            f"budget_bytes: {format_bytes(budget_bytes)} is below the layer inputs every remat region keeps "
            f"({format_bytes(inputs)} for {len(layers)} layers of {tokens:g} tokens); raise the budget or use fewer "
            f"tokens per microbatch")
    decisions = [{v.name: SAVE for v in layer.saved} for layer in layers]
    rows = []  # (layer index, value, bytes, recompute s, swap s)
    device = inputs
    for i, layer in enumerate(layers):
        for v in layer.saved:
            r, s = value_costs(v, layer, tokens, seq_len, hw, dtype=dtype, causal=causal)
            b = v.bytes_per_token * tokens
            rows.append((i, v, b, r, s))
            device += b
    full = sum(r for _, _, _, r, _ in rows)
    window = _compute_seconds(layers, tokens, seq_len, hw, dtype, causal) if hw.async_copy else 0.0
    swapped = 0.0  # seconds of swap traffic so far
    extra, host = 0.0, 0.0
    open_rows = sorted(rows, key=lambda x: -x[2])
    while device > budget_bytes and open_rows:
        best = None
        for k, (i, v, b, r, s) in enumerate(open_rows):
            if b <= 0:
                continue
            options = [(r, RECOMPUTE)]
            if allow_swap:
                options.append((max(0.0, swapped + s - window) - max(0.0, swapped - window), OFFLOAD))
            cost, what = min(options, key=lambda o: (o[0], o[1] != RECOMPUTE))
            key = cost / b
            if best is None or key < best[0]:
                best = (key, k, cost, what)
        if best is None:
            break
        _, k, cost, what = best
        i, v, b, r, s = open_rows.pop(k)
        decisions[i][v.name] = what
        device -= b
        extra += cost
        if what == OFFLOAD:
            swapped += s
            host += b
    return RecomputePlan(tuple(decisions), device, host, extra, full, float(budget_bytes))


def _hardware(h: str | Hardware) -> Hardware:
    return hardware(h)


def policies_from_config(config: Mapping[str, Any]) -> list[Any]:
    """One remat policy per layer from :meth:`RecomputePlan.to_config`'s data
    (``save_and_offload_only_these_names``)."""
    from hpfunc.transforms.policies import save_and_offload_only_these_names

    layers = config.get("layers") if isinstance(config, Mapping) else None
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"recompute policy config: expected a mapping with 'layers': a list of "
                         f"{{save: [...], offload: [...]}}, found {config!r}")
    out = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, Mapping) or set(layer) - {"save", "offload"}:
            raise ValueError(f"recompute policy config: layers[{i}]: expected {{save: [names], offload: [names]}}, "
                             f"found {layer!r}")
        out.append(save_and_offload_only_these_names(names_which_can_be_saved=list(layer.get("save", ())),
                                                     names_which_can_be_offloaded=list(layer.get("offload", ()))))
    return out
