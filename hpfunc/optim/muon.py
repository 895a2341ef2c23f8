"""Muon's update direction: momentum, then Newton-Schulz orthogonalisation of each matrix."""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, Optional

import torch

from hpfunc.optim import _tree
from hpfunc.optim._dtypes import zeros_state
from hpfunc.optim.base import GradientTransformation, Params, Updates
from hpfunc.optim.errors import UnsupportedLeafError
from hpfunc import layout

__all__ = [
    "NS_COEFFICIENTS",
    "newton_schulz",
    "muon_scale",
    "ScaleByMuonState",
    "scale_by_muon",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients ``(a, b, c)`` published with Muon (Jordan et al., 2024)."""

MuonScaling = Optional[Literal["sqrt_aspect", "match_adamw_rms"]]


@torch.no_grad()
def newton_schulz(
    g: torch.Tensor,
    *,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximately orthogonalise ``g`` (``U V^T`` of its SVD ``U S V^T``) by a quintic iteration.

    ``g`` is a matrix ``[rows, cols]`` or a batch ``[..., rows, cols]`` (each matrix separately).
    A wide orientation is used internally (transposing when ``rows > cols``) so that ``X X^T`` is the
    smaller Gram matrix; each matrix is first divided by its Frobenius norm (plus ``eps``) so its
    singular values lie in ``[0, 1]``, then ``steps`` times::

        A = X X^T;  X <- a X + (b A + c A A) X

    The published coefficients do not converge to exactly 1: singular values end roughly in
    ``[0.7, 1.2]``, which is what Muon wants (speed over precision).

    Args:
      g: the matrix or batch of matrices.
      steps: number of iterations.
      coefficients: ``(a, b, c)``.
      eps: added to the norm before dividing.
      dtype: dtype of the iteration (default: ``g``'s dtype). ``torch.bfloat16`` is the published
        choice on accelerators; the result is returned in ``g``'s dtype.

    Example:
        >>> import torch
        >>> g = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        >>> s = torch.linalg.svdvals(newton_schulz(g))
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    if g.ndim < 2:
        raise UnsupportedLeafError(f"newton_schulz: expected a matrix or batch of matrices, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype) if dtype is not None else g
    tall = g.shape[-2] > g.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + (c * gram) @ gram
        x = a * x + poly @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def muon_scale(shape: torch.Size | tuple[int, ...], scaling: MuonScaling) -> float:
    """The per-matrix factor applied after orthogonalisation (``rows, cols`` = last two dims).

    * ``"sqrt_aspect"``: ``max(1, rows / cols) ** 0.5`` (published Muon; ``rows`` = fan-out of a
      torch ``Linear`` weight ``[out, in]``).
    * ``"match_adamw_rms"``: ``0.2 * sqrt(max(rows, cols))`` (Moonlight, Liu et al. 2025), giving
      updates of about AdamW's RMS so that AdamW's learning rate and weight decay carry over.
    * ``None``: ``1``.

    >>> muon_scale((8, 2), "sqrt_aspect"), muon_scale((2, 8), "sqrt_aspect")
    (2.0, 1.0)
    """
    rows, cols = shape[-2], shape[-1]
    if scaling == "sqrt_aspect":
        return max(1.0, rows / cols) ** 0.5
    if scaling == "match_adamw_rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if scaling is None:
        return 1.0
    raise ValueError(f"muon: scaling must be 'sqrt_aspect', 'match_adamw_rms' or None, got {scaling!r}")


class ScaleByMuonState(NamedTuple):
    """State of :func:`scale_by_muon`: the momentum buffers, fp32, shaped like the params."""

    momentum: Updates


def _check_leaf(path: str, x: torch.Tensor, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        return  # zeros_state names non-tensor leaves
    if x.ndim not in (2, 3):
        raise UnsupportedLeafError(
            f"{where}: the leaf at '{path}' has shape {tuple(x.shape)} (ndim {x.ndim}); Muon "
            "orthogonalises matrices [rows, cols] and stacks of matrices [n, rows, cols] only. "
            "Route it to another optimizer, e.g. muon_adamw(...) or "
            "partition({'muon': muon(...), 'adamw': adamw(...)}, labels)."
        )
    placements = getattr(x, "placements", None)
    if placements is not None and not all(p.is_replicate() for p in placements):
        raise UnsupportedLeafError(
            f"{where}: the leaf at '{path}' is a DTensor with placements {tuple(placements)}; Muon "
            "currently supports plain tensors and fully replicated DTensors (orthogonalising a "
            "sharded matrix needs a gather or a shard-aware Newton-Schulz, not implemented yet). "
            "Reshard it to replicated for the update, or route it to adamw."
        )


def _orthogonalise(u: torch.Tensor, **ns_kwargs) -> torch.Tensor:
    to_local = getattr(u, "to_local", None)
    if to_local is None:
        return newton_schulz(u, **ns_kwargs)
    # Replicated DTensor: every rank holds the whole matrix, so the local computation is the global
    # one; running it on the local tensor avoids per-op DTensor dispatch.
    from torch.distributed.tensor import DTensor

    local = newton_schulz(to_local(), **ns_kwargs)
    return DTensor.from_local(local, u.device_mesh, u.placements, run_check=False)


def _orthogonalise_block(ctx: Any, path: str, u: torch.Tensor, scaling: MuonScaling, ns_kwargs: dict) -> torch.Tensor:
    """Inside :func:`hpfunc.parallelize`: ``u`` is this rank's block of a (stack of) matrices.

    A matrix sharded along its rows or columns is all-gathered on those dimensions, orthogonalised
    whole, and cut back to this rank's block (a stack sharded only on its first dimension, the
    experts, is orthogonalised locally: each matrix is whole). Gathering moves the matrix once,
    ``(n-1)/n`` of it per rank; a shard-aware Newton-Schulz would all-reduce a ``rows x rows`` Gram
    matrix (or more) in each of its 5 iterations, more bytes than one gather for every shape we train,
    and its result would differ from the single-device one by reduction order.
    """
    from hpfunc import lax

    leaf = ctx.leaf(path, u, "scale_by_muon")
    dims = [(d, leaf.spec.opt.dim_axes(d)) for d in (u.ndim - 2, u.ndim - 1)]
    dims = [(d, axes) for d, axes in dims if axes]
    full = u
    for d, axes in dims:
        full = lax.all_gather(full, axes if len(axes) > 1 else axes[0], axis=d, tiled=True)
    o = _orthogonalise(full, **ns_kwargs) * muon_scale(full.shape, scaling)
    for d, axes in dims:
        n = lax.axis_size(axes)
        k = o.shape[d] // n
        o = o.narrow(d, lax.axis_index(axes) * k, k)
    return o


def scale_by_muon(
    momentum: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_eps: float = 1e-7,
    ns_dtype: torch.dtype | None = None,
    scaling: MuonScaling = "sqrt_aspect",
) -> GradientTransformation:
    """Muon's direction (Jordan et al., 2024): momentum, Nesterov, Newton-Schulz, shape scaling.

    For each matrix leaf with incoming update ``g`` and momentum buffer ``m``::

        m <- momentum * m + (1 - momentum) * g           (an EMA, as in the published code)
        u  = (1 - momentum) * g + momentum * m   if nesterov else   m
        out = newton_schulz(u, steps=ns_steps) * muon_scale(shape, scaling)

    A 3-D leaf ``[n, rows, cols]`` (stacked MoE expert weights ``[E, out, in]``) is a batch of ``n``
    independent matrices. Buffers are fp32; the output is fp32.

    Sharding: plain tensors and fully replicated DTensors are supported; a sharded DTensor is
    rejected with an error naming its path. Inside a step run by :func:`hpfunc.parallelize` the
    leaves are blocks and a matrix sharded on its rows or columns is gathered, orthogonalised whole
    and cut back (see ``_orthogonalise_block`` for why gather rather than a shard-aware iteration).

    Args:
      momentum: the EMA coefficient of the momentum buffer.
      nesterov: use the Nesterov look-ahead ``lerp(g, m, momentum)`` instead of ``m``.
      ns_steps: Newton-Schulz iterations.
      ns_coefficients: ``(a, b, c)`` of the quintic iteration.
      ns_eps: added to each matrix's norm before normalising.
      ns_dtype: dtype of the iteration; ``None`` keeps fp32, ``torch.bfloat16`` is the published
        (faster, less exact) choice on accelerators.
      scaling: ``"sqrt_aspect"``, ``"match_adamw_rms"`` or ``None``; see :func:`muon_scale`.

    Raises:
      UnsupportedLeafError: a leaf is not 2-D or 3-D, or is a sharded DTensor (names the path).

    Example:
        >>> import torch
        >>> tx = scale_by_muon()
        >>> params = {"w": torch.zeros(4, 4)}
        >>> u, state = tx.update({"w": torch.diag(torch.tensor([0.1, 0.5, 1.0, 4.0]))}, tx.init(params))
        >>> s = torch.linalg.svdvals(u["w"])  # spread before, near 1 after
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    momentum = float(momentum)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"scale_by_muon: momentum must be in [0, 1), got {momentum}")
    muon_scale((1, 1), scaling)  # validates `scaling` now rather than at the first update
    ns_kwargs = dict(steps=ns_steps, coefficients=ns_coefficients, eps=ns_eps, dtype=ns_dtype)

    def check_all(tree: Updates, where: str) -> None:
        for path, x in zip(*_tree.paths_and_leaves(tree)[:2]):
            _check_leaf(path, x, where)

    def init(params: Params) -> ScaleByMuonState:
        check_all(params, "scale_by_muon.init")
        return ScaleByMuonState(momentum=zeros_state(params, "scale_by_muon.init"))

    @torch.no_grad()
    def update(updates: Updates, state: ScaleByMuonState, params: Params | None = None):
        del params
        (g_leaves, m_leaves), spec = _tree.flatten_aligned(
            [updates, state.momentum], ["updates", "state.momentum"], "scale_by_muon"
        )
        _tree.check_shapes(g_leaves, m_leaves, updates, "updates", "state.momentum", "scale_by_muon")
        if any(g.ndim not in (2, 3) for g in g_leaves):
            check_all(updates, "scale_by_muon.update")
        ctx = layout.current()
        paths = _tree.paths(updates) if ctx is not None else [None] * len(g_leaves)
        out, bufs = [], []
        for path, g, m in zip(paths, g_leaves, m_leaves):
            g = g.to(m.dtype)
            m = torch.lerp(m, g, 1.0 - momentum)
            u = torch.lerp(g, m, momentum) if nesterov else m
            if ctx is None:
                out.append(_orthogonalise(u, **ns_kwargs) * muon_scale(u.shape, scaling))
            else:
                out.append(_orthogonalise_block(ctx, path, u, scaling, ns_kwargs))
            bufs.append(m)
        return _tree.unflatten(spec, out), ScaleByMuonState(momentum=_tree.unflatten(spec, bufs))

    return GradientTransformation(init, update)
