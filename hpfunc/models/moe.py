"""Mixture-of-experts building blocks on plain tensors: top-k softmax router, grouped experts, MoE block,
load-balancing auxiliary loss and the auxiliary-loss-free expert bias.

Expert weights are stacked ``[E, out, in]`` (each expert in the ``nn.Linear`` orientation):
``w_gate, w_up [E, I, H]``, ``w_down [E, H, I]``. The number of experts is read from the stacked weights
and the router, so an expert-parallel transform can pass the local experts (dim 0 shards).

Grouped compute, no Python loop over experts: the ``T * k`` (token, expert) assignments are sorted by
expert id; each expert's rows then form one contiguous group, computed either by padding every group to
the largest group and running batched matmuls (``impl="bmm"``) or with ``torch.nn.functional.grouped_mm`` on the
unpadded groups (``impl="grouped_mm"``). ``impl="auto"`` (default) picks ``grouped_mm`` where torch has
it (it wastes no FLOPs on padding; on CPU about 2x faster than ``bmm`` on ``qwen3-moe-small``) and
``bmm`` otherwise.

Expert bias (auxiliary-loss-free balancing, DeepSeek-V3 style, on softmax scores here): a per-layer
vector added to the router probabilities only to *select* the top-k experts; the combine weights are the
unbiased probabilities. It is not differentiated (it is used under ``detach``) and is updated outside the
gradient step by :func:`update_expert_bias`. A trainer must keep it out of the optimizer (no weight decay,
no Adam moments): select it with :func:`is_expert_bias` on the parameter path, e.g. with an
``optim.partition`` whose predicate is ``is_expert_bias``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from hpfunc import lax, layout
from hpfunc import tree as _tree
from hpfunc.models.dispatch import AllToAll, count_ids, inverse_permutation, sum_pairs
from hpfunc.models.layers import swiglu_mlp
from hpfunc.models.swiglu import swiglu

EXPERT_BIAS_SUFFIX = "moe.expert_bias"


class Routing(NamedTuple):
    """What a router decided for ``T`` tokens: ``logits [T, E]`` (input dtype), ``probs [T, E]`` (float32
    softmax), ``weights [T, k]`` (combine weights, input dtype) and ``indices [T, k]`` (expert ids).
    :func:`moe_block` adds ``dropped``: the pairs its dispatcher did not compute (over an expert's capacity,
    or past a padded buffer; 0-d int64, on the device), ``None`` for a dropless dispatch."""

    logits: torch.Tensor
    probs: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    dropped: torch.Tensor | None = None


def route_topk(
    x: torch.Tensor,
    router: torch.Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    expert_bias: torch.Tensor | None = None,
) -> Routing:
    """Top-k softmax router (Qwen3-MoE): ``probs = softmax(x @ router.T)`` in float32.

    Selection is ``topk(probs + expert_bias)``; the combine weights are the *unbiased* ``probs`` of the
    selected experts, renormalised to sum to one when ``norm_topk_prob``. ``expert_bias`` never gets a
    gradient.

    >>> r = route_topk(torch.randn(5, 8), torch.randn(4, 8), top_k=2, norm_topk_prob=True)
    >>> r.indices.shape, bool(torch.allclose(r.weights.sum(-1), torch.ones(5)))
    (torch.Size([5, 2]), True)
    """
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if expert_bias is None:
        weights, indices = torch.topk(probs, top_k, dim=-1)
    else:
        with torch.no_grad():
            indices = torch.topk(probs.detach() + expert_bias.detach().float(), top_k, dim=-1).indices
        weights = probs.gather(-1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, weights.to(logits.dtype), indices)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Number of (token, slot) assignments per expert, ``[num_experts]`` int64.

    >>> expert_counts(torch.tensor([[0, 2], [2, 1]]), 4).tolist()
    [1, 1, 2, 0]
    """
    return count_ids(indices.reshape(-1), num_experts)  # no host sync on a GPU (bincount's is one)


def grouped_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * SwiGLU_{indices[t, j]}(x[t])`` for ``x [T, H]``, stacked experts.

    Args:
      x: tokens ``[T, H]``.
      indices, weights: ``[T, k]`` expert ids (in ``[0, E)``) and combine weights.
      w_gate, w_up: ``[E, I, H]``; w_down: ``[E, H, I]``.
      impl: ``"bmm"`` (pad each expert group to the largest, batched matmul), ``"grouped_mm"``
        (``torch.nn.functional.grouped_mm`` over unpadded groups) or ``"auto"``.

    >>> T, H, I, E = 6, 8, 4, 3
    >>> y = grouped_experts(torch.randn(T, H), torch.randint(0, E, (T, 2)), torch.rand(T, 2),
    ...                     torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I))
    >>> y.shape
    torch.Size([6, 8])
    """
    T, H = x.shape
    E, k = w_gate.shape[0], indices.shape[-1]
    flat = indices.reshape(-1)
    with torch.no_grad():
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, E)
        token_of = order // k
    combine = weights.reshape(-1)[order].unsqueeze(-1)
    ys = expert_ffn(x[token_of], counts, w_gate, w_up, w_down, scale=combine, impl=impl)
    return sum_pairs(ys, inverse_permutation(order), T, k)



def expert_ffn(
    xs: torch.Tensor,
    counts: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Each expert's SwiGLU on its own rows: ``xs [N, H]`` grouped by expert (``counts [E]`` rows for
    expert ``e``, in order), stacked weights as in :func:`grouped_experts`; ``scale [N, 1]`` (the
    combine weights) multiplies each row's output. Returns ``[N, H_out]`` in the rows' order. The
    experts' compute alone: token dispatch (:mod:`hpfunc.models.dispatch`) is separate.

    >>> xs, w = torch.randn(5, 8), torch.randn(2, 4, 8)
    >>> y = expert_ffn(xs, torch.tensor([2, 3]), w, w, torch.randn(2, 8, 4))
    >>> y.shape
    torch.Size([5, 8])
    """
    N, H = xs.shape
    E = w_gate.shape[0]
    fake = _is_fake(xs)
    if impl == "auto":
        impl = "grouped_mm" if _grouped_mm_supported(xs, fake) else "bmm"
    if impl == "grouped_mm":
        # The grouped_mm outputs' gradients are always fresh contiguous tensors here (they come
        # through a multiply or the index_add's gather), which grouped_mm's CPU backward needs
        # (an expanded, stride-0 gradient is rejected).
        offs = torch.cumsum(counts, 0).to(torch.int32)
        # torch's shape-only (fake/meta) kernel insists on bf16: dry runs compute in bf16 (values are
        # meaningless there anyway) and cast back.
        cast = fake and xs.dtype != torch.bfloat16

        def gmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            if cast:
                return F.grouped_mm(a.bfloat16(), w.transpose(1, 2).bfloat16(), offs=offs).to(a.dtype)
            return F.grouped_mm(a, w.transpose(1, 2), offs=offs)

        # Two grouped matmuls, not one over torch.cat((w_gate, w_up), 1): the concatenated weight would be
        # a new tensor the backward keeps, a copy of both weights per MoE layer (38.6 GB of bf16 over the
        # 48 layers of Qwen3-30B-A3B without expert parallelism). The fused one was 3-5% faster on CPU.
        # Scale before the down projection (I <= H in Qwen3: fewer multiplies), inside the SwiGLU: the
        # backward then keeps gate, up and the scaled product only (no silu output, no unscaled product,
        # no expert output for the scale's gradient).
        return gmm(swiglu(gmm(xs, w_gate), gmm(xs, w_up), scale), w_down)
    if impl == "bmm":
        with torch.no_grad():
            cap = int(counts.max()) if N else 0
            starts = torch.cumsum(counts, 0) - counts
            expert_of = torch.repeat_interleave(torch.arange(E, device=xs.device), counts)
            slot = expert_of * cap + (torch.arange(N, device=xs.device) - starts[expert_of])
            # Padding slots read an extra zero row (index N): a pure gather, whose backward is one index_add.
            source = torch.full((E * cap,), N, dtype=torch.int64, device=xs.device)
            source[slot] = torch.arange(N, device=xs.device)
        buf = torch.cat((xs, xs.new_zeros(1, H)))[source].view(E, cap, H)
        s = None if scale is None else torch.cat((scale, scale.new_zeros(1, 1)))[source].view(E, cap, 1)
        h = swiglu(torch.bmm(buf, w_gate.transpose(1, 2)), torch.bmm(buf, w_up.transpose(1, 2)), s)
        return torch.bmm(h, w_down.transpose(1, 2)).view(E * cap, w_down.shape[1])[slot]  # (N may be 0)
    raise ValueError(f"grouped_experts: impl must be 'auto', 'bmm' or 'grouped_mm', found {impl!r}")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


# The dtypes torch's CPU grouped_mm takes (float64 is refused: "Expected mat_a to be Float32, BFloat16 or
# Float16 matrix, got Double"); its CUDA kernels take bfloat16 (sm80+).
_CPU_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_supported(x: torch.Tensor, fake: bool) -> bool:
    """Whether ``impl="auto"`` runs ``F.grouped_mm`` on ``x``'s device and dtype; else the padded ``bmm``."""
    if not hasattr(F, "grouped_mm"):
        return False
    if fake:
        return True  # dry runs take the bf16 detour (values are meaningless there)
    if x.device.type == "cpu":
        return x.dtype in _CPU_GROUPED_MM_DTYPES
    return x.dtype == torch.bfloat16


def moe_block(
    x: torch.Tensor,
    router: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    expert_bias: torch.Tensor | None = None,
    shared: dict[str, torch.Tensor] | None = None,
    impl: str = "auto",
    dispatcher: Any = None,
    regions: Any = None,
) -> tuple[torch.Tensor, Routing]:
    """Sparse MoE feed-forward ``[..., H] -> [..., H]``; returns the output and the :class:`Routing`.

    ``shared`` (Qwen2-MoE style, absent in Qwen3) holds ``w_gate, w_up, w_down`` of an always-on SwiGLU
    expert and ``gate [1, H]``, whose sigmoid scales it.

    Under expert parallelism (an axis bound by the step, :func:`hpfunc.layout.ep_axis`) the expert
    stacks are this rank's ``E / n`` experts: ``dispatcher`` (default
    :class:`hpfunc.models.dispatch.AllToAll`, dropless) sends each (token, expert) pair to the rank
    holding its expert, :func:`expert_ffn` computes the local experts, and the outputs come back. A
    ``dispatcher`` given without a bound axis runs with ``axis=None`` (every expert here), so that its
    capacity or buffer drops the same pairs on one device; ``routing.dropped`` counts them. A
    dispatcher with an ``expert_outputs(sent, w_gate, w_up, w_down, *, impl)`` method computes the
    received rows itself (:class:`hpfunc.models.hot_experts.ReplicatedAllToAll`: this rank's experts and
    its copies of hot experts).

    ``regions`` (a :class:`hpfunc.regions.Regions`): the router (``moe.router``) and the shared expert
    (``moe.shared``) run as compiled regions; the routed experts and their dispatch stay eager (their
    group sizes are data: a new shape every batch; the dispatch may be a collective).

    >>> E, H, I = 4, 8, 4
    >>> y, r = moe_block(torch.randn(2, 3, H), torch.randn(E, H), torch.randn(E, I, H),
    ...                  torch.randn(E, I, H), torch.randn(E, H, I), top_k=2, norm_topk_prob=False)
    >>> y.shape, r.indices.shape
    (torch.Size([2, 3, 8]), torch.Size([6, 2]))
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if regions is None:
        routing = route_topk(flat, router, top_k=top_k, norm_topk_prob=norm_topk_prob, expert_bias=expert_bias)
    else:
        routing = Routing(*regions("moe.router", _route, flat, router, top_k, norm_topk_prob, expert_bias))
    axis = layout.ep_axis()
    if axis is None and dispatcher is None:
        y = grouped_experts(flat, routing.indices, routing.weights, w_gate, w_up, w_down, impl=impl)
    else:  # expert parallel (this rank holds E / n of the experts; the pairs travel to them and back), or a
        # dispatcher that drops pairs, which then drops them on one device too (n = 1)
        E, n = router.shape[0], (1 if axis is None else lax.axis_size(axis))
        if w_gate.shape[0] * n != E:
            raise layout.PlanError(
                f"moe_block: the router scores {E} experts but this rank holds {w_gate.shape[0]} of them on the "
                f"expert-parallel axis {axis!r} of size {n}; the expert stacks must be split on dimension 0 over "
                f"{axis!r} (plans.ep) and the router replicated")
        dispatcher = AllToAll() if dispatcher is None else dispatcher
        if hasattr(dispatcher, "expert_outputs"):  # a dispatcher computing more experts than its own (copies)
            sent = dispatcher.dispatch(flat, routing.indices, num_experts=E, axis=axis)
            y = dispatcher.combine(dispatcher.expert_outputs(sent, w_gate, w_up, w_down, impl=impl), sent,
                                   routing.weights)
        elif hasattr(dispatcher, "exchange"):  # the whole exchange in the dispatcher (it may overlap chunks)
            y, dropped = dispatcher.exchange(
                flat, routing.indices, routing.weights,
                lambda t, c, s: expert_ffn(t, c, w_gate, w_up, w_down, scale=s, impl=impl), num_experts=E, axis=axis)
            routing = routing._replace(dropped=dropped)
        elif getattr(dispatcher, "weights_at_experts", False):
            # the combine weights travel with the rows and scale them inside the experts' SwiGLU: the
            # backward keeps no expert output for the weights' gradient
            sent = dispatcher.dispatch(flat, routing.indices, num_experts=E, axis=axis, weights=routing.weights)
            y = dispatcher.combine(expert_ffn(sent.tokens, sent.counts, w_gate, w_up, w_down, scale=sent.scale,
                                              impl=impl), sent)
        else:  # a dispatcher that weights the returned outputs itself
            sent = dispatcher.dispatch(flat, routing.indices, num_experts=E, axis=axis)
            y = dispatcher.combine(expert_ffn(sent.tokens, sent.counts, w_gate, w_up, w_down, impl=impl), sent,
                                   routing.weights)
        if not hasattr(dispatcher, "exchange"):
            routing = routing._replace(dropped=getattr(sent, "dropped", getattr(sent, "overflow", None)))
    if shared is not None:
        y = y + (_shared_expert(flat, shared) if regions is None
                 else regions("moe.shared", _shared_expert, flat, shared))
    return y.view(shape), routing


def _route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool,
           expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """:func:`route_topk` as a tuple (a compiled region's output)."""
    return tuple(route_topk(x, router, top_k=top_k, norm_topk_prob=norm_topk_prob, expert_bias=expert_bias)[:4])


def _shared_expert(x: torch.Tensor, shared: dict[str, torch.Tensor]) -> torch.Tensor:
    """The always-on SwiGLU expert scaled by the sigmoid of its gate."""
    return torch.sigmoid(F.linear(x, shared["gate"])) * swiglu_mlp(x, shared["w_gate"], shared["w_up"],
                                                                    shared["w_down"])


def load_balancing_loss(routings: Sequence[Routing], num_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss exactly as Hugging Face's Qwen3-MoE ``load_balancing_loss_func``.

    Over all MoE layers pooled together (not averaged per layer): with ``N`` = layers x tokens rows,
    ``f_e = (# top-k assignments to e) / N`` (sums to k) and ``P_e = (sum of router probs of e) / N``,
    the loss is ``E * sum_e f_e P_e``. Only ``P`` carries gradient. ``f`` counts the experts actually
    selected (identical to the reference's unbiased top-k while the expert bias is zero).

    Inside a parallelized step whose batch is split over data axes (:func:`hpfunc.layout.data_axes`),
    ``f``, ``P`` and ``N`` are those of the whole step's batch, summed over the data shards (two small
    all-reduces forward, of ``E + 1`` and ``E`` floats, and one of ``E`` backward): the single-device
    definition, not a per-shard statistic. Every shard then holds the same value.

    >>> r = route_topk(torch.randn(5, 8), torch.randn(4, 8), top_k=2, norm_topk_prob=False)
    >>> float(load_balancing_loss([r], 4)) > 0
    True
    """
    if not routings:
        raise ValueError("load_balancing_loss: no MoE layer routings given")
    return balancing_loss_from_stats(*routing_stats(routings, num_experts), num_experts)


def routing_stats(routings: Sequence[Routing], num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts [E], prob_sum [E], rows [])`` of some MoE layers' routings, pooled (float32): what
    :func:`load_balancing_loss` needs. Stats of disjoint sets of layers add (a pipeline carries them
    from stage to stage).

    >>> r = route_topk(torch.randn(5, 8), torch.randn(4, 8), top_k=2, norm_topk_prob=False)
    >>> [tuple(t.shape) for t in routing_stats([r], 4)]
    [(4,), (4,), ()]
    """
    counts = sum(expert_counts(r.indices, num_experts).float() for r in routings)
    prob_sum = sum(r.probs.float().sum(0) for r in routings)
    # a fill on the device, not a host literal copied there (a copy from pageable host memory waits for
    # the device; and a recompute on CUDA's autograd thread found no fake mode for the literal's copy)
    rows = torch.full((), float(sum(r.probs.shape[0] for r in routings)), device=prob_sum.device)
    return counts, prob_sum, rows


def balancing_loss_from_stats(counts: torch.Tensor, prob_sum: torch.Tensor, rows: torch.Tensor,
                              num_experts: int) -> torch.Tensor:
    """:func:`load_balancing_loss` from pooled :func:`routing_stats` (summed over the step's data shards
    here, inside a parallelized step)."""
    counts, rows = counts.detach(), rows.detach()
    axes = layout.data_axes()
    if axes:  # inside a parallelized step: the load of the whole step's batch, over every data shard
        with torch.no_grad():
            both = lax.psum(torch.cat((counts, rows.reshape(1).to(counts.dtype))), axes)
        counts, rows = both[:-1], both[-1]
        prob_sum = lax.psum(prob_sum, axes)  # transpose psum: each shard's probabilities get the whole gradient
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def is_expert_bias(path: str) -> bool:
    """True for the expert-bias leaves (``layers.N.moe.expert_bias``), which must bypass the optimizer.

    >>> is_expert_bias("layers.3.moe.expert_bias"), is_expert_bias("layers.3.moe.router")
    (True, False)
    """
    return path == EXPERT_BIAS_SUFFIX or path.endswith("." + EXPERT_BIAS_SUFFIX)


def update_expert_bias(params: Any, expert_load: torch.Tensor, rate: float) -> Any:
    """Return ``params`` with each MoE layer's bias moved toward uniform load (no gradient involved).

    ``bias += rate * sign(mean(load) - load)`` per layer, where ``expert_load [n_moe_layers, E]`` holds
    token counts in MoE-layer order (as ``loss``/``apply`` return it in ``aux["expert_load"]``).
    Overloaded experts become less likely to be selected, underloaded more.

    >>> p = {"layers": [{"moe": {"expert_bias": torch.zeros(3)}}]}
    >>> update_expert_bias(p, torch.tensor([[5.0, 1.0, 0.0]]), 0.1)["layers"][0]["moe"]["expert_bias"]
    tensor([-0.1000,  0.1000,  0.1000])
    """
    # rows follow the model's MoE layers: under a pipeline this rank holds only some of them
    paths = [p for p in layout.model_paths(params) if is_expert_bias(p)]
    if expert_load.dim() != 2 or expert_load.shape[0] != len(paths):
        raise ValueError(
            f"update_expert_bias: expected expert_load [n_moe_layers={len(paths)}, E], "
            f"found shape {tuple(expert_load.shape)}")
    row = {p: i for i, p in enumerate(paths)}

    def step(path: str, leaf: torch.Tensor) -> torch.Tensor:
        if path not in row:
            return leaf
        load = expert_load[row[path]].to(device=leaf.device, dtype=torch.float32)
        delta = rate * torch.sign(load.mean() - load)
        delta = layout.local_block(path, delta)  # inside hpfunc.parallelize: this rank's experts
        if delta.shape != leaf.shape:
            raise ValueError(f"update_expert_bias: {path} has shape {tuple(leaf.shape)}, "
                             f"expert_load row has {tuple(load.shape)}")
        with torch.no_grad():
            return leaf + delta.to(leaf.dtype)

    return _tree.map_with_path(step, params)
