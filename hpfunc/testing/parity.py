"""Parity assertions: a sharded computation against the same pure function on one device.

    >>> import torch
    >>> from hpfunc.testing import assert_trees_close
    >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2)})

``assert_parity(fn, reference, *args)`` runs ``value_and_grad`` of ``fn`` on the (possibly sharded)
arguments and of ``reference`` on their full values, and compares values and gradients leaf by leaf
(DTensors are gathered first). Failures name the pytree path, the max abs/rel error and the
tolerance.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from hpfunc import tree as _tree
from hpfunc.autodiff import value_and_grad

__all__ = ["assert_trees_close", "assert_parity", "to_full", "tolerance"]

_TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-10, 1e-12),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The project's default ``(rtol, atol)`` for a dtype (fp32: 1e-5; bf16: 1e-2)."""
    return _TOL.get(dtype, (0.0, 0.0))


def to_full(tree: Any) -> Any:
    """Replace DTensor leaves by their full (global) value; detach everything."""
    def conv(x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.full_tensor().detach()
        if isinstance(x, torch.Tensor):
            return x.detach()
        return x

    return _tree.tree_map(conv, tree)


def assert_trees_close(actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None,
                       what: str = "value") -> None:
    """Assert two trees have the same structure and leaves that agree to ``rtol``/``atol``."""
    actual, expected = to_full(actual), to_full(expected)
    _tree.check_same_structure(expected, actual, what=what)
    exp = dict(_tree.leaves_with_paths(expected))
    for path, a in _tree.leaves_with_paths(actual):
        e = exp[path]
        where = f"{what}{'.' + path if path else ''}"
        if not isinstance(a, torch.Tensor):
            if a != e:
                raise AssertionError(f"{where}: {a!r} != {e!r}")
            continue
        if tuple(a.shape) != tuple(e.shape):
            raise AssertionError(f"{where}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
        r, t = tolerance(e.dtype) if (rtol is None or atol is None) else (rtol, atol)
        r = r if rtol is None else rtol
        t = t if atol is None else atol
        if not e.is_floating_point():
            if not torch.equal(a, e):
                raise AssertionError(f"{where}: integer tensors differ")
            continue
        a64, e64 = a.double(), e.double()
        if not torch.allclose(a64, e64, rtol=r, atol=t, equal_nan=True):
            err = (a64 - e64).abs()
            rel = (err / e64.abs().clamp_min(1e-30)).max().item()
            raise AssertionError(
                f"{where}: max abs err {err.max().item():.3e}, max rel err {rel:.3e} exceed rtol={r:g}, atol={t:g} "
                f"(shape {tuple(a.shape)})"
            )


def assert_parity(fn: Callable, reference: Callable, *args: Any, argnums: int | tuple[int, ...] = 0,
                  has_aux: bool = False, rtol: float | None = None, atol: float | None = None) -> tuple[Any, Any]:
    """Compare ``value_and_grad(fn)(*args)`` with ``value_and_grad(reference)(*full_args)``.

    Returns ``(value, grads)`` of ``fn`` for further checks.
    """
    v1, g1 = value_and_grad(fn, argnums=argnums, has_aux=has_aux)(*args)
    full_args = to_full(list(args))
    v2, g2 = value_and_grad(reference, argnums=argnums, has_aux=has_aux)(*full_args)
    assert_trees_close(v1, v2, rtol=rtol, atol=atol, what="value")
    assert_trees_close(g1, g2, rtol=rtol, atol=atol, what="grad")
    return v1, g1
