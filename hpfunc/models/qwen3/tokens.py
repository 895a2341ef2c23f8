"""What Qwen3 checks and derives from its input tokens: the vocabulary and shape checks, the document ids of
packed sequences and the next-token targets (shared by the model, its layout-dependent pieces and its
pipeline stages; no layout).

    >>> shift_labels(torch.tensor([[5, 6, 7]])).tolist()
    [[6, 7, -100]]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "check_tokens", "check_doc_ids", "shift_labels"]

IGNORE_INDEX = -100


def _is_fake(t: torch.Tensor) -> bool:
    # FakeTensor / meta dry runs have no values to check.
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the offending id when ``tokens`` fall outside ``[0, vocab_size)``.

    On the CPU the ids are read and a bad one is named at once. On an accelerator reading them would be a
    host sync every forward (two scalar reads), so the check is a device-side assert
    (``torch._assert_async``): no host read, and a bad id fails the step at the next synchronisation with
    the range in the message. ``hpfunc train`` checks every id of its corpus on the host before the first
    step (``hpfunc.train.data.check_data``), so there the assert never fires.

    >>> check_tokens(torch.tensor([[1, 2]]), vocab_size=3)
    >>> check_tokens(torch.tensor([[1, 7]]), vocab_size=3)
    Traceback (most recent call last):
    ...
    ValueError: apply: token id 7 is outside the vocabulary [0, 3) (vocab_size=3; min id 1, max id 7)
    """
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"apply: tokens must be an integer tensor, found dtype {tokens.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"apply: tokens must be [batch, seq], found shape {tuple(tokens.shape)}")
    if tokens.device.type == "meta" or tokens.numel() == 0:
        return
    if tokens.device.type != "cpu":
        from torch.distributed.tensor import DTensor

        local = tokens.to_local() if isinstance(tokens, DTensor) else tokens  # each rank asserts on its block
        torch._assert_async(((local >= 0) & (local < vocab_size)).all(),
                            f"apply: a token id is outside the vocabulary [0, {vocab_size}) (vocab_size={vocab_size})")
        return
    if _is_fake(tokens):
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise ValueError(f"apply: token id {bad} is outside the vocabulary [0, {vocab_size}) "
                         f"(vocab_size={vocab_size}; min id {lo}, max id {hi})")


def check_doc_ids(doc_ids: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``doc_ids`` checked against the tokens' ``[B, S]`` shape (an integer tensor of that shape)."""
    if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool or tuple(doc_ids.shape) != tuple(shape):
        raise ValueError(f"document ids (batch['doc_ids']): expected an integer tensor of the tokens' shape "
                         f"{tuple(shape)}, found {doc_ids.dtype} {tuple(doc_ids.shape)}")
    return doc_ids


def shift_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets aligned with the logits: ``labels[:, s] = tokens[:, s + 1]``, last = -100.

    >>> shift_labels(torch.tensor([[1, 2, 3]])).tolist()
    [[2, 3, -100]]
    """
    return F.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)
