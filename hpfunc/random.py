"""Functional random numbers: keys are values, and sampling is the same for every sharding.

A key is a tiny ``int64`` tensor of two 32-bit words. Nothing here reads or writes torch's global
generator. Every element of a sampled tensor is a pure function of ``(key, global element index)``
(the Threefry-2x32 counter-based generator, 20 rounds), so a tensor sampled directly in shards, on
any mesh, equals the tensor one device would sample:

    >>> import torch
    >>> from hpfunc import random
    >>> k = random.key(0)
    >>> k1, k2 = random.split(k)
    >>> x = random.normal(k1, (4, 3))
    >>> x.shape, x.dtype
    (torch.Size([4, 3]), torch.float32)
    >>> bool((random.normal(k1, (4, 3)) == x).all())
    True

With ``sharding=NamedSharding(mesh, P("dp", None))`` the result is a DTensor holding exactly that
global tensor; inside :func:`hpfunc.shard_map`, ``spec=P("dp", None)`` returns this rank's block.

Sampling runs as tensor ops on the target device and never reads a value back to the host (the key's
words stay tensors), so a key on a GPU, or a sharding on a cuda mesh, samples there with the same
values as on the CPU. The device is, in this order: ``device=``, the sharding's mesh (``sharding=``)
or the current mesh (``spec=``), the key's own device:

    >>> normal(k1, (4, 3), device="meta").device  # no values: nothing was read back
    device(type='meta')
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "key",
    "split",
    "fold_in",
    "bits",
    "uniform",
    "normal",
    "truncated_normal",
    "randint",
    "bernoulli",
    "dropout",
    "permutation",
]

_M32 = 0xFFFFFFFF
_ROT = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _threefry2x32(k0: int | torch.Tensor, k1: int | torch.Tensor, x0: torch.Tensor,
                  x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011) on int64 tensors holding 32-bit words.

    The key words are Python ints or 0-dim int64 tensors on the counters' device (no host read)."""
    ks = (k0 & _M32, k1 & _M32, (k0 ^ k1 ^ _PARITY) & _M32)
    x0 = (x0 + ks[0]) & _M32
    x1 = (x1 + ks[1]) & _M32
    for i in range(5):
        for r in _ROT[(i % 2) * 4 : (i % 2) * 4 + 4]:
            x0 = (x0 + x1) & _M32
            x1 = _rotl(x1, r) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & _M32
        x1 = (x1 + ks[(i + 2) % 3] + i + 1) & _M32
    return x0, x1


def _words(k: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The key's two words as 0-dim int64 tensors on ``device`` (default: the key's): no host read."""
    if hasattr(k, "to_local"):  # a key stored as a (replicated) DTensor
        k = k.to_local()
    if not isinstance(k, torch.Tensor) or k.shape != (2,):
        raise TypeError(
            f"expected a key (an int64 tensor of shape (2,) from hpfunc.random.key), found "
            f"{type(k).__name__} of shape {tuple(getattr(k, 'shape', ()))}"
        )
    if k.dtype != torch.int64:
        raise TypeError(f"expected a key (an int64 tensor of shape (2,) from hpfunc.random.key), found dtype {k.dtype}")
    if device is not None:
        device = torch.device(device)
        if k.device.type != device.type or (device.index is not None and k.device.index != device.index):
            k = k.to(device, non_blocking=True)
    return k.unbind(0)  # not k[0]: Python indexing needs a device guard, which fake CUDA on a CPU build lacks


def _make_key(a: int, b: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor([a & _M32, b & _M32], dtype=torch.int64, device=device)


def key(seed: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """A new key from an integer seed (any Python int; 64 bits are used), on ``device`` (default CPU).

    >>> key(42)
    tensor([ 0, 42])
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, found {type(seed).__name__}")
    seed &= (1 << 64) - 1
    return _make_key(seed >> 32, seed, device)


def split(k: torch.Tensor, num: int = 2) -> torch.Tensor:
    """Split a key into ``num`` new independent keys, returned stacked as shape ``(num, 2)``.

    >>> a, b = split(key(0))
    >>> bool((a == b).all())
    False
    """
    if num < 1:
        raise ValueError(f"split needs num >= 1, found {num}")
    k0, k1 = _words(k)
    ctr = torch.arange(num, dtype=torch.int64, device=k0.device)
    w0, w1 = _threefry2x32(k0, k1, ctr, torch.zeros_like(ctr))
    return torch.stack([w0, w1], dim=1)


def fold_in(k: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key derived from ``k`` and an integer (e.g. a step or ``axis_index``), on ``k``'s device.

    ``data`` may be a 0-dim integer tensor (a step counter kept on the device): it is not read back.

    >>> bool((fold_in(key(0), 1) == fold_in(key(0), 1)).all())
    True
    >>> bool((fold_in(key(0), torch.tensor(-5)) == fold_in(key(0), -5)).all())
    True
    """
    k0, k1 = _words(k)
    if isinstance(data, torch.Tensor):
        if data.numel() != 1 or data.dtype.is_floating_point or data.dtype.is_complex:
            raise TypeError(f"fold_in: data must be an int or a one-element integer tensor, found "
                            f"{data.dtype} of shape {tuple(data.shape)}")
        d = data.reshape(1).to(device=k0.device, dtype=torch.int64)
        # two's complement words: the same as the Python int's value modulo 2**64
        x0, x1 = d & _M32, ((d >> 32) & _M32) | (1 << 31)  # domain-separate from split
    else:
        d = int(data) & ((1 << 64) - 1)
        x0 = torch.tensor([d & _M32], dtype=torch.int64, device=k0.device)
        x1 = torch.tensor([((d >> 32) | (1 << 31)) & _M32], dtype=torch.int64, device=k0.device)
    w0, w1 = _threefry2x32(k0, k1, x0, x1)
    return torch.cat([w0, w1])


# ---------------------------------------------------------------------------------------------
# Index computation: global element indices of the block this rank holds.


def _global_indices(shape: Sequence[int], sharding=None, spec=None,
                    device: torch.device | None = None) -> tuple[torch.Tensor, Sequence[int]]:
    """Global row-major indices of the local block (int64, on ``device``), and the local shape."""
    from hpfunc import sharding as _sh

    shape = tuple(int(s) for s in shape)
    if sharding is not None and spec is not None:
        raise ValueError("pass either sharding= (global view) or spec= (inside shard_map), not both")
    if sharding is None and spec is None:
        starts, sizes = (0,) * len(shape), shape
    else:
        if sharding is not None:
            mesh, spec_ = sharding.mesh, sharding.spec
            coords = mesh.coordinate()
        else:
            mesh = _sh.current_mesh(required=True, what="random sampling with spec=")
            spec_ = spec
            coords = mesh.coordinate()
        starts, sizes = _sh.local_block(shape, mesh, _sh.as_spec(spec_), coords)
    numel = math.prod(shape)
    if numel >= 1 << 62:
        raise ValueError(f"tensor of {numel} elements is too large for the 62-bit element counter")
    idx = torch.zeros(sizes, dtype=torch.int64, device=device)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        view = [1] * len(shape)
        view[d] = sizes[d]
        idx = idx + (torch.arange(starts[d], starts[d] + sizes[d], dtype=torch.int64, device=device) * stride).view(view)
        stride *= shape[d]
    return idx, sizes


def _wrap(local: torch.Tensor, shape: Sequence[int], sharding) -> torch.Tensor:
    if sharding is None:
        return local
    from hpfunc import sharding as _sh

    return _sh.from_local(local, sharding, global_shape=tuple(shape))


def _target_device(k: torch.Tensor, sharding, spec, device) -> torch.device:
    """Where samples land: ``device=``, else the sharding's (or, with ``spec=``, the current) mesh's
    device type, else the key's device."""
    if device is not None:
        return torch.device(device)
    mesh = None
    if sharding is not None:
        mesh = sharding.mesh
    elif spec is not None:
        from hpfunc import sharding as _sh

        mesh = _sh.current_mesh(required=False)
    if mesh is not None and getattr(mesh, "device_type", "cpu") != "cpu":
        return _mesh_device(mesh.device_type)
    local = k.to_local() if hasattr(k, "to_local") else k
    return local.device if isinstance(local, torch.Tensor) else torch.device("cpu")


def _mesh_device(device_type: str) -> torch.device:
    # the current accelerator of this rank (cuda:LOCAL_RANK after torch.cuda.set_device)
    mod = getattr(torch, device_type, None)
    if mod is not None and hasattr(mod, "is_available") and mod.is_available():
        return torch.device(device_type, mod.current_device())
    return torch.device(device_type)


def _bits2(k: torch.Tensor, shape, sharding, spec, device=None) -> tuple[torch.Tensor, torch.Tensor, Sequence[int]]:
    dev = _target_device(k, sharding, spec, device)
    k0, k1 = _words(k, dev)
    idx, sizes = _global_indices(shape, sharding, spec, dev)
    w0, w1 = _threefry2x32(k0, k1, idx & _M32, idx >> 32)
    return w0, w1, sizes


def bits(k: torch.Tensor, shape: Sequence[int], *, sharding=None, spec=None,
         device: torch.device | str | None = None) -> torch.Tensor:
    """Uniform random 32-bit words (as int64 in ``[0, 2**32)``) of the given global shape."""
    w0, _, _ = _bits2(k, shape, sharding, spec, device)
    return _wrap(w0, shape, sharding)


def _unit(w: torch.Tensor) -> torch.Tensor:
    """32-bit words -> float32 in [0, 1) with 24 random bits."""
    return (w >> 8).to(torch.float32) * (1.0 / (1 << 24))


def uniform(
    k: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    minval: float = 0.0,
    maxval: float = 1.0,
    *,
    sharding=None,
    spec=None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniform samples in ``[minval, maxval)`` (24 random bits, computed in float32).

    >>> float(uniform(key(1), (1000,)).mean()) > 0.4
    True
    """
    w0, _, _ = _bits2(k, shape, sharding, spec, device)
    u = _unit(w0) * (maxval - minval) + minval
    return _wrap(u.to(dtype), shape, sharding)


def normal(
    k: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    *,
    std: float = 1.0,
    mean: float = 0.0,
    sharding=None,
    spec=None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normal samples (Box-Muller on two 32-bit words per element), scaled by ``std``.

    >>> x = normal(key(0), (10000,))
    >>> abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    True
    """
    w0, w1, _ = _bits2(k, shape, sharding, spec, device)
    u1 = ((w0 >> 8).to(torch.float64) + 1.0) * (1.0 / (1 << 24))  # (0, 1]
    u2 = (w1 >> 8).to(torch.float64) * (1.0 / (1 << 24))
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    out = (z * std + mean).to(dtype)
    return _wrap(out, shape, sharding)


def truncated_normal(
    k: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    *,
    std: float = 1.0,
    lower: float = -2.0,
    upper: float = 2.0,
    sharding=None,
    spec=None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Normal samples truncated to ``[lower, upper]`` (in units of std), by inverse CDF."""
    w0, _, _ = _bits2(k, shape, sharding, spec, device)
    u = ((w0 >> 8).to(torch.float64) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    cdf = lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))  # noqa: E731
    lo, hi = cdf(lower), cdf(upper)
    z = math.sqrt(2.0) * torch.erfinv(2.0 * (lo + u * (hi - lo)) - 1.0)
    out = (z.clamp(lower, upper) * std).to(dtype)
    return _wrap(out, shape, sharding)


def randint(
    k: torch.Tensor,
    shape: Sequence[int],
    low: int,
    high: int,
    dtype: torch.dtype = torch.int64,
    *,
    sharding=None,
    spec=None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Integers uniform in ``[low, high)`` (64 random bits per element, so the modulo bias is < 2**-32)."""
    if high <= low:
        raise ValueError(f"randint needs low < high, found low={low}, high={high}")
    w0, w1, _ = _bits2(k, shape, sharding, spec, device)
    span = high - low
    if span > 1 << 31:
        raise ValueError(f"randint span {span} exceeds 2**31")
    r = ((w0 % span) * ((1 << 32) % span) + w1 % span) % span
    return _wrap((r + low).to(dtype), shape, sharding)


def bernoulli(k: torch.Tensor, p: float, shape: Sequence[int], *, sharding=None, spec=None,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Booleans that are ``True`` with probability ``p``."""
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"bernoulli needs 0 <= p <= 1, found {p}")
    w0, _, _ = _bits2(k, shape, sharding, spec, device)
    return _wrap(_unit(w0) < p, shape, sharding)


def dropout(
    k: torch.Tensor,
    x: torch.Tensor,
    rate: float,
    *,
    spec=None,
    global_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """Inverted dropout: zero each element with probability ``rate`` and scale the rest by 1/(1-rate).

    On a plain tensor the mask covers ``x``. Inside ``shard_map``, pass the ``spec`` that ``x`` (the
    local block) has in the global array: the mask is then the block of the single-device mask, so
    dropout under TP/SP/CP equals dropout on one device. On a DTensor the sharding is read from it.

    >>> y = dropout(key(0), torch.ones(1000), 0.5)
    >>> sorted(set(y.tolist()))
    [0.0, 2.0]
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), found {rate}")
    if rate == 0.0:
        return x
    from hpfunc import sharding as _sh

    if _sh.is_dtensor(x):
        sh = _sh.sharding_of(x)
        keep = bernoulli(k, 1.0 - rate, tuple(x.shape), sharding=sh)
        return x * keep / (1.0 - rate)
    if spec is not None:
        if global_shape is None:
            mesh = _sh.current_mesh(required=True, what="dropout with spec=")
            global_shape = _sh.global_shape_of_block(tuple(x.shape), mesh, _sh.as_spec(spec))
        keep = bernoulli(k, 1.0 - rate, global_shape, spec=spec, device=x.device)
    else:
        keep = bernoulli(k, 1.0 - rate, tuple(x.shape), device=x.device)
    return x * keep.to(x.dtype) / (1.0 - rate)


def permutation(k: torch.Tensor, n: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """A random permutation of ``range(n)`` (argsort of random words; ties broken by index)."""
    w0, w1, _ = _bits2(k, (n,), None, None, device)
    return torch.argsort((w0 << 31) | (w1 >> 1), stable=True)
