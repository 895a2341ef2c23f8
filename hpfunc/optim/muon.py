"""Muon's update direction: momentum, then Newton-Schulz orthogonalisation of each matrix."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

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

@torch.no_grad()
def newton_schulz(
    x: torch.Tensor,
    ns_coeffs: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    *,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximately orthogonalise ``x`` (``U V^T`` of its SVD ``U S V^T``) by a quintic iteration.

    ``x`` is a matrix ``[rows, cols]`` or a batch ``[..., rows, cols]`` (each matrix separately).
    A wide orientation is used internally (transposing when ``rows > cols``) so that ``X X^T`` is the
    smaller Gram matrix; each matrix is first divided by its Frobenius norm plus ``eps`` so its
    singular values lie in ``[0, 1]``, then ``ns_steps`` times, with ``(a, b, c) = ns_coeffs``::

        A = X X^T;  X <- a X + (b A + c A A) X

    The published coefficients do not converge to exactly 1: singular values end roughly in
    ``[0.7, 1.2]``, which is what Muon wants (speed over precision).

    Each iteration is two fused multiply-adds (``torch.addmm`` / ``torch.baddbmm``) in the op order of
    ``torch.optim.Muon``'s iteration, so that in bf16 a matrix gets the same bits as there (checked on
    the CPU; the normalisation differs only for norms within a few hundred ``eps``, see
    ``docs/optim.md``).

    Differences from ``optax.contrib.orthogonalize_via_newton_schulz``: one ``(a, b, c)`` triple for
    every step (no per-step coefficient table), no ``preconditioning`` choice (always Frobenius),
    ``eps`` defaults to 1e-7 (torch's and the published value; optax's is 1e-8), and every leading
    dimension is a batch dimension (optax: ``dimension_numbers``).

    Args:
      x: the matrix or batch of matrices.
      ns_coeffs: ``(a, b, c)``.
      ns_steps: number of iterations.
      eps: added to each matrix's norm before dividing.
      dtype: dtype of the iteration (default: ``x``'s dtype). ``torch.bfloat16`` is the published
        choice on accelerators; the result is returned in ``x``'s dtype.

    Example:
        >>> import torch
        >>> g = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        >>> s = torch.linalg.svdvals(newton_schulz(g))
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    if x.ndim < 2:
        raise UnsupportedLeafError(
            f"newton_schulz: expected a matrix [rows, cols] or a batch [..., rows, cols], got shape "
            f"{tuple(x.shape)}"
        )
    if len(ns_coeffs) != 3:
        raise ValueError(f"newton_schulz: ns_coeffs must be one (a, b, c) triple, got {ns_coeffs!r}")
    a, b, c = (float(v) for v in ns_coeffs)
    batch_shape = x.shape[:-2]
    y = x.to(dtype) if dtype is not None else x
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        y = y.mT
    y = y / (torch.linalg.matrix_norm(y, keepdim=True) + eps)
    if y.ndim == 2:
        for _ in range(ns_steps):
            gram = y @ y.mT
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    else:
        y = y.reshape(-1, *y.shape[-2:])  # baddbmm wants one batch dimension
        for _ in range(ns_steps):
            gram = y @ y.mT
            y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
        y = y.reshape(*batch_shape, *y.shape[-2:])
    if tall:
        y = y.mT
    return y.to(x.dtype)


def muon_scale(shape: torch.Size | tuple[int, ...], consistent_rms: float | None = None) -> float:
    """The per-matrix factor applied after orthogonalisation (``rows, cols`` = last two dims).

    Matrices are in torch's orientation ``[out, in]`` (a ``Linear`` weight), so ``rows`` is the
    fan-out and ``cols`` the fan-in:

    * ``consistent_rms=None``: ``max(1, rows / cols) ** 0.5 = max(1, fan_out / fan_in) ** 0.5``
      (published Muon; torch's ``adjust_lr_fn="original"``).
    * ``consistent_rms=r``: ``r * sqrt(max(rows, cols))``; ``r = 0.2`` is Moonlight's (Liu et al.
      2025) and torch's ``adjust_lr_fn="match_rms_adamw"``: updates of about AdamW's RMS, so that
      AdamW's learning rate and weight decay carry over.

    optax states the same rules in fan-in/fan-out terms but for its orientation ``[in, out]``
    (``x @ W``): an array of shape ``(8, 2)`` is fan-out 8 here and fan-out 2 in optax, so
    the factors differ unless the weights are transposed when porting.

    >>> muon_scale((8, 2)), muon_scale((2, 8)), muon_scale((4, 25), consistent_rms=0.2)
    (2.0, 1.0, 1.0)
    """
    rows, cols = shape[-2], shape[-1]
    if consistent_rms is None:
        return max(1.0, rows / cols) ** 0.5
    return float(consistent_rms) * math.sqrt(max(rows, cols))


def _check_consistent_rms(consistent_rms: Any, where: str) -> None:
    if consistent_rms is None:
        return
    if isinstance(consistent_rms, bool) or not isinstance(consistent_rms, (int, float)) or not consistent_rms > 0:
        raise ValueError(
            f"{where}: consistent_rms must be None (width scaling sqrt(max(1, rows / cols))) or a "
            f"positive float (0.2 matches AdamW's update RMS), got {consistent_rms!r}"
        )


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
            "partition({'muon': muon(...), 'adamw': adamw(...)}, param_labels)."
        )
    placements = getattr(x, "placements", None)
    if placements is not None and not all(p.is_replicate() for p in placements):
        raise UnsupportedLeafError(
            f"{where}: the leaf at '{path}' is a DTensor with placements {tuple(placements)}; Muon "
            "supports plain tensors and fully replicated DTensors (inside hpfunc.parallelize it "
            "gathers sharded matrices itself). Reshard it to replicated for the update, run the step "
            "under hpfunc.parallelize, or route it to adamw."
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


def _orthogonalise_block(path: str, u: torch.Tensor, consistent_rms: float | None, ns_kwargs: dict) -> torch.Tensor:
    """Inside :func:`hpfunc.parallelize`: ``u`` is this rank's block of a (stack of) matrices.

    A matrix sharded along its rows or columns is all-gathered on those dimensions
    (:func:`hpfunc.layout.gather_block`), orthogonalised whole, scaled by its global shape, and cut
    back to this rank's block (:func:`hpfunc.layout.local_block`); a stack sharded only on its first
    dimension, the experts, is orthogonalised locally (each matrix is whole). Gathering moves the
    matrix once, ``(n-1)/n`` of it per rank; a shard-aware Newton-Schulz would all-reduce a
    ``rows x rows`` Gram matrix (or more) in each of its 5 iterations, more bytes than one gather for
    every shape we train, and its result would differ from the single-device one by reduction order.
    """
    full = layout.gather_block(path, u, dims=(-2, -1))
    o = _orthogonalise(full, **ns_kwargs) * muon_scale(full.shape, consistent_rms)
    return layout.local_block(path, o, dims=(-2, -1))


def scale_by_muon(
    ns_coeffs: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-7,
    *,
    nesterov: bool = True,
    consistent_rms: float | None = None,
    ns_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Muon's direction (Jordan et al., 2024): momentum, Nesterov, Newton-Schulz, shape scaling.

    For each matrix leaf with incoming update ``g`` and momentum buffer ``m``::

        m <- beta * m + (1 - beta) * g                  (an EMA, as in the published code)
        u  = (1 - beta) * g + beta * m   if nesterov else   m
        out = newton_schulz(u, ns_coeffs, ns_steps, eps=eps) * muon_scale(shape, consistent_rms)

    A 3-D leaf ``[n, rows, cols]`` (stacked MoE expert weights ``[E, out, in]``) is a batch of ``n``
    independent matrices. Buffers are fp32 (fp64 for fp64 params); the output is fp32.

    Chained with decay and the learning rate (:func:`~hpfunc.optim.muon`) this is the update of
    ``torch.optim.Muon`` (``momentum=beta``, ``ns_coefficients=ns_coeffs``, ``adjust_lr_fn="original"``
    for ``consistent_rms=None``, ``"match_rms_adamw"`` for 0.2), which always iterates in bf16: with
    ``ns_dtype=torch.bfloat16`` the two agree to fp32 rounding unless a matrix's norm is within a few
    hundred ``eps`` (torch clamps the norm to ``eps``, this adds ``eps``); see
    ``tests/optim/test_optim_muon_torch.py``. Where it differs from ``optax.contrib.scale_by_muon``
    (same argument names and positional order):

    * no bias correction of ``m`` (optax divides by ``1 - beta^t``). Newton-Schulz normalises the scale
      away, so without Nesterov the direction is the same (up to ``eps``); with Nesterov the weights
      of ``g`` and ``m`` in ``u`` differ in the first steps and agree as ``beta^t -> 0``;
    * the shape factor :func:`muon_scale` is applied here (in optax it is a separate
      ``scale_by_shape`` in ``optax.contrib.muon``'s chain), for matrices in torch's ``[out, in]``
      orientation;
    * ``eps`` defaults to 1e-7 (optax: 1e-8); no ``mu_dtype`` (the buffer is fp32), ``adaptive``,
      ``preconditioning`` or ``weight_dimension_numbers`` (the last two dimensions are the matrix).

    Sharding: plain tensors and fully replicated DTensors are supported; a sharded DTensor is
    rejected with an error naming its path. Inside a step run by :func:`hpfunc.parallelize` the
    leaves are blocks and a matrix sharded on its rows or columns is gathered, orthogonalised whole
    and cut back through :mod:`hpfunc.layout` (see ``_orthogonalise_block`` for why gather rather
    than a shard-aware iteration).

    Args:
      ns_coeffs: ``(a, b, c)`` of the quintic Newton-Schulz iteration.
      ns_steps: Newton-Schulz iterations.
      beta: the EMA coefficient of the momentum buffer (torch's ``momentum``).
      eps: added to each matrix's Frobenius norm before normalising.
      nesterov: use the Nesterov look-ahead ``lerp(g, m, beta)`` instead of ``m``.
      consistent_rms: ``None`` for the published width scaling, or a float ``r`` for
        ``r * sqrt(max(rows, cols))``; see :func:`muon_scale`.
      ns_dtype: dtype of the iteration; ``None`` keeps fp32, ``torch.bfloat16`` is the published
        (faster, less exact) choice on accelerators and what ``torch.optim.Muon`` always uses.

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
    beta = float(beta)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"scale_by_muon: beta (the momentum EMA coefficient) must be in [0, 1), got {beta}")
    _check_consistent_rms(consistent_rms, "scale_by_muon")
    if len(ns_coeffs) != 3:
        raise ValueError(
            f"scale_by_muon: ns_coeffs must be one (a, b, c) triple, got {ns_coeffs!r} (optax's per-step "
            "coefficient tables are not supported)"
        )
    ns_kwargs = dict(ns_coeffs=tuple(ns_coeffs), ns_steps=int(ns_steps), eps=float(eps), dtype=ns_dtype)

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
        in_step = layout.current() is not None
        paths = _tree.paths(updates) if in_step else [None] * len(g_leaves)
        out, bufs = [], []
        for path, g, m in zip(paths, g_leaves, m_leaves):
            g = g.to(m.dtype)
            m = torch.lerp(m, g, 1.0 - beta)
            u = torch.lerp(g, m, beta) if nesterov else m
            if in_step:
                out.append(_orthogonalise_block(path, u, consistent_rms, ns_kwargs))
            else:
                out.append(_orthogonalise(u, **ns_kwargs) * muon_scale(u.shape, consistent_rms))
            bufs.append(m)
        return _tree.unflatten(spec, out), ScaleByMuonState(momentum=_tree.unflatten(spec, bufs))

    return GradientTransformation(init, update)
