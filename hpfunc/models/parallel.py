"""Tensor- and sequence-parallel Qwen3 forward and loss: :mod:`qwen3` with parallel hooks.

With no tensor-parallel axis bound these are exactly :func:`hpfunc.models.qwen3.apply` / ``loss``.
Inside :func:`tensor_parallel` (``hpfunc.transforms.parallelize`` binds it from the plan) the attention
and MLP/MoE weights are Megatron shards (column-parallel ``wq, wk, wv, w_gate, w_up``, row-parallel
``wo, w_down``), each block computes its local heads / intermediate features, and the model's hooks
add the collectives:

* **tensor parallel**: the row-parallel partial outputs are summed with :func:`hpfunc.lax.psum`, two
  all-reduces of ``b s h`` per layer forward and, by the transpose, two backward;
* **sequence parallel** (``sequence_parallel=True``, Megatron-SP): the residual stream, the RMSNorms
  and the residual adds work on this rank's block of the sequence; the normalised input of attention
  and MLP/MoE is all-gathered along the sequence (:func:`gather_sequence`) and their partial outputs
  are reduce-scattered along it (:func:`reduce_partial`): two all-gathers and two reduce-scatters of
  ``b s h`` per layer forward, the same backward, the bytes of TP's all-reduces. The embedding output
  is this rank's sequence block (a replicated table looks up only those tokens), and the loss is
  computed on that block: the head and cross-entropy of each token run on one rank only, and the sum
  of the per-token losses is all-reduced (one scalar) and divided by the global count of targets;
* **vocabulary parallel** (``vocab_parallel=True``): the embedding and head are split by vocabulary
  rows; the masked lookup is summed (reduce-scattered along the sequence under sequence parallelism),
  the head sees the whole sequence (gathered first under sequence parallelism) and the cross-entropy
  reduces a max, a sum of exponentials and the target logit over the axis.

:func:`scatter_sequence`, :func:`gather_sequence` and :func:`reduce_partial` are the building blocks
for other models (identities without a bound axis, so the same code runs on one device).

    >>> import torch
    >>> from hpfunc import random
    >>> from hpfunc.models import qwen3
    >>> cfg = qwen3.preset("qwen3-dense-tiny")
    >>> p = qwen3.init(random.key(0), cfg)
    >>> b = {"tokens": torch.randint(0, 256, (2, 8))}
    >>> bool(torch.equal(loss(p, b, cfg)[0], qwen3.loss(p, b, cfg)[0]))
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator

import attrs
import torch
import torch.nn.functional as F

from hpfunc import lax
from hpfunc.models import qwen3
from hpfunc.models.config import Qwen3Config

__all__ = ["tensor_parallel", "tp_axis", "sequence_parallel", "scatter_sequence", "gather_sequence",
           "reduce_partial", "apply", "loss"]


@attrs.frozen
class _Binding:
    axis: str | None = None
    vocab: bool = False
    sequence: bool = False


_TP: contextvars.ContextVar[_Binding] = contextvars.ContextVar("hpfunc_tp", default=_Binding())


@contextlib.contextmanager
def tensor_parallel(axis: str | None, *, vocab_parallel: bool = False,
                    sequence_parallel: bool = False) -> Iterator[None]:
    """Bind the mesh axis over which row-parallel outputs are reduced (``None``: no tensor parallelism).

    ``vocab_parallel``: the embedding and head are split by vocabulary rows over it too.
    ``sequence_parallel``: activations between blocks are split along the sequence over it.
    ``parallel_train_step`` binds ``plan.tp_axis``, ``plan.tp_vocab_parallel`` and
    ``plan.tp_sequence_parallel``.
    """
    on = axis is not None
    token = _TP.set(_Binding(axis, bool(vocab_parallel) and on, bool(sequence_parallel) and on))
    try:
        yield
    finally:
        _TP.reset(token)


def tp_axis() -> str | None:
    """The bound tensor-parallel axis, or ``None``."""
    return _TP.get().axis


def sequence_parallel() -> bool:
    """Whether activations between blocks are split along the sequence over :func:`tp_axis`."""
    return _TP.get().sequence


def _sequence_block(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    from hpfunc.transforms.plans import PlanError

    n = lax.axis_size(axis)
    if x.shape[dim] % n:
        raise PlanError(f"sequence parallelism over {axis!r} ({n} ranks) needs dimension {dim} (the sequence) "
                        f"of shape {tuple(x.shape)} to divide evenly; pad the sequence to a multiple of {n}")
    k = x.shape[dim] // n
    return x.narrow(dim, lax.axis_index(axis) * k, k)


def scatter_sequence(x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
    """Under sequence parallelism, this rank's block of ``x`` (replicated over the axis) along ``dim``:
    no communication; the gradient is zero outside the block and is summed over the axis by whoever
    owns ``x`` (the step, for a replicated parameter). Otherwise ``x``."""
    b = _TP.get()
    return _sequence_block(x, dim, b.axis) if b.sequence else x


def gather_sequence(x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
    """Under sequence parallelism, the whole sequence from every rank's block (``all_gather`` along
    ``dim``; its transpose reduce-scatters the gradient). Otherwise ``x``. Use it on the input of a
    column-parallel block."""
    b = _TP.get()
    return lax.all_gather(x, b.axis, axis=dim, tiled=True) if b.sequence else x


def reduce_partial(y: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
    """The output of a row-parallel block from this rank's partial sum: ``psum`` over the bound axis,
    or under sequence parallelism ``psum_scatter`` along ``dim`` (this rank's sequence block of the
    sum). Without a bound axis, ``y``."""
    b = _TP.get()
    if b.axis is None:
        return y
    if b.sequence:
        return lax.psum_scatter(y, b.axis, scatter_dimension=dim, tiled=True)
    return lax.psum(y, b.axis)


def _embed(tokens: torch.Tensor, table: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Embedding lookup: a replicated table looks up this rank's sequence block (no communication); a
    table split by vocabulary rows looks up its own ids and sums over the axis (reduce-scatters along the
    sequence under sequence parallelism)."""
    b = _TP.get()
    rows = table.shape[0]
    if not b.vocab or rows == cfg.vocab_size:
        return F.embedding(scatter_sequence(tokens), table)
    local = tokens - lax.axis_index(b.axis) * rows
    mine = (local >= 0) & (local < rows)
    h = F.embedding(local.clamp(0, rows - 1), table) * mine.unsqueeze(-1).to(table.dtype)
    return reduce_partial(h)


def _head(h: torch.Tensor, weight: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Logits; a head split by vocabulary rows needs every position, gathered under sequence parallelism
    (then these are this rank's vocabulary columns of the logits)."""
    if _TP.get().vocab and weight.shape[0] != cfg.vocab_size:
        h = gather_sequence(h)
    return F.linear(h, weight)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """Mean cross-entropy over non-ignored targets, for logits that are this rank's sequence block
    (one scalar all-reduce of the summed losses) or this rank's vocabulary columns (three small
    all-reduces of [tokens]: a max, a sum of exponentials and the target logit)."""
    axis = tp_axis()
    x = logits.float()
    cols = x.shape[-1]
    if x.shape[1] != labels.shape[1]:  # this rank's sequence block, full vocabulary
        count = (labels != qwen3.IGNORE_INDEX).sum()
        y = scatter_sequence(labels)
        nll = F.cross_entropy(x.reshape(-1, cols), y.reshape(-1), ignore_index=qwen3.IGNORE_INDEX,
                              reduction="sum")
        return lax.psum(nll, axis) / count
    x, y = x.reshape(-1, cols), labels.reshape(-1)
    if cols == cfg.vocab_size:
        return F.cross_entropy(x, y, ignore_index=qwen3.IGNORE_INDEX)
    valid = y != qwen3.IGNORE_INDEX
    # log-sum-exp is shift invariant: the max needs no gradient
    m = lax.pmax(x.detach().amax(-1), axis)
    sumexp = lax.psum(torch.exp(x - m[:, None]).sum(-1), axis)
    local = y - lax.axis_index(axis) * cols
    mine = (local >= 0) & (local < cols) & valid
    target = lax.psum(x.gather(1, local.clamp(0, cols - 1)[:, None]).squeeze(1) * mine, axis)
    nll = torch.log(sumexp) + m - target
    return (nll * valid).sum() / valid.sum()


def _hooks(cfg: Qwen3Config, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """qwen3's hooks for the bound layout (none without an axis), after checking the sequence length."""
    b = _TP.get()
    if b.axis is None:
        return {}
    if b.sequence:
        from hpfunc.transforms.plans import check_sequence

        n = lax.axis_size(b.axis)
        for name, x in batch.items():
            if isinstance(x, torch.Tensor):
                check_sequence(x, name, b.axis, n)
    return {"embed": functools.partial(_embed, cfg=cfg), "gather_input": gather_sequence,
            "reduce_partial": reduce_partial, "head": functools.partial(_head, cfg=cfg)}


def apply(params: dict, tokens: torch.Tensor, cfg: Qwen3Config, *, return_aux: bool = False,
          moe_impl: str = "auto") -> Any:
    """:func:`qwen3.apply` in the bound tensor-/sequence-parallel layout.

    The logits are the full ``[B, S, V]`` under tensor parallelism; this rank's sequence block
    ``[B, S / n, V]`` under sequence parallelism; this rank's vocabulary columns ``[B, S, V / n]`` with a
    vocabulary-parallel head (with or without sequence parallelism). ``aux`` is the same on every rank.
    """
    return qwen3.apply(params, tokens, cfg, return_aux=return_aux, moe_impl=moe_impl,
                       **_hooks(cfg, {"tokens": tokens}))


def loss(params: dict, batch: dict, cfg: Qwen3Config, *, moe_impl: str = "auto") -> tuple[torch.Tensor, dict]:
    """:func:`qwen3.loss` in the bound layout (identical without a bound axis); the value is the same on
    every rank of the axis."""
    hooks = _hooks(cfg, batch)
    if hooks:
        hooks["cross_entropy"] = functools.partial(_cross_entropy, cfg=cfg)
    return qwen3.loss(params, batch, cfg, moe_impl=moe_impl, **hooks)


def init(key: torch.Tensor, cfg: Qwen3Config, *, shardings: Any = None, dtype: torch.dtype = torch.float32) -> dict:
    """:func:`qwen3.init` with each leaf created directly as a DTensor with ``shardings`` (a tree of
    ``NamedSharding`` shaped like :func:`qwen3.param_shapes`): every rank samples only its own block
    (counter-based :mod:`hpfunc.random`), and the global values equal ``qwen3.init(key, cfg)``.
    Without ``shardings`` it is ``qwen3.init``."""
    if shardings is None:
        return qwen3.init(key, cfg, dtype)
    from hpfunc import random as _random
    from hpfunc import tree as _tree
    from hpfunc.sharding import from_local

    shapes = qwen3.param_shapes(cfg)
    is_shape = lambda x: isinstance(x, torch.Size)  # noqa: E731
    leaves = _tree.leaves_with_paths(shapes, is_leaf=is_shape)
    index = {path: i for i, (path, _) in enumerate(leaves)}
    sh_by_path = dict(_tree.leaves_with_paths(shardings, is_leaf=lambda x: hasattr(x, "spec")))

    def make(path: str, shape: torch.Size) -> torch.Tensor:
        name = path.rsplit(".", 1)[-1]
        leaf_dtype = torch.float32 if name == "expert_bias" else dtype
        sh = sh_by_path[path]
        if name in qwen3._ONES or name in qwen3._ZEROS:
            from hpfunc.sharding import local_block

            _, sizes = local_block(tuple(shape), sh.mesh, sh.spec, sh.mesh.coordinate())
            fill = torch.ones if name in qwen3._ONES else torch.zeros
            return from_local(fill(sizes, dtype=leaf_dtype), sh, global_shape=tuple(shape))
        return _random.normal(_random.fold_in(key, index[path]), tuple(shape), leaf_dtype,
                              std=cfg.initializer_range, sharding=sh)

    return _tree.map_with_path(make, shapes, is_leaf=is_shape)
