"""Sampling text from a trained model: a pure function of (params, prompt, key), for a quick look.

No KV cache: each new token re-runs the model over the last ``context`` tokens, which is fine for
the tiny demo models this is meant for (a hundred tokens take a second or two on a CPU).

Example:
    >>> import torch
    >>> from hpfunc import random
    >>> from hpfunc.models import registry
    >>> spec = registry.resolve(None, preset=registry.DEFAULT_PRESET)
    >>> cfg = spec.preset(registry.DEFAULT_PRESET)
    >>> params = spec.init(random.key(0), cfg)
    >>> out = generate(params, cfg, torch.tensor([100, 101, 102]), 5, random.key(1), apply=spec.apply)
    >>> again = generate(params, cfg, torch.tensor([100, 101, 102]), 5, random.key(1), apply=spec.apply)
    >>> out.shape, bool((again == out).all())
    (torch.Size([5]), True)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hpfunc import random
from hpfunc import tree as _tree

__all__ = ["generate", "sample_text"]


def generate(
    params: Any,
    cfg: Any,
    prompt: torch.Tensor,
    num_tokens: int,
    key: torch.Tensor,
    *,
    temperature: float = 0.8,
    context: int = 256,
    apply: Callable[[Any, torch.Tensor, Any], torch.Tensor],
) -> torch.Tensor:
    """``num_tokens`` new token ids after ``prompt`` (1-D int), sampled at ``temperature``.

    Token ``i`` is drawn by the Gumbel-max trick with noise from ``fold_in(key, i)``, so the output
    is the same on every machine for the same params. ``temperature=0`` is greedy decoding. ``apply``:
    the model's ``(params, tokens, cfg) -> logits`` (its spec's ``apply``). The prompt and the key go to
    the parameters' device (a model trained on a GPU samples there); the ids come back on it.
    """
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(
            f"generate: the prompt must be a non-empty 1-D tensor of ids, found shape {tuple(prompt.shape)}"
        )
    device = next((x.device for x in _tree.leaves(params) if isinstance(x, torch.Tensor)), prompt.device)
    ids, key = prompt.to(device, torch.int64), key.to(device)
    out = []
    with torch.no_grad():
        for i in range(num_tokens):
            logits = apply(params, ids[-context:][None, :], cfg)[0, -1].float()
            if temperature > 0:
                u = random.uniform(random.fold_in(key, i), logits.shape, minval=1e-7, maxval=1.0)
                logits = logits / temperature - torch.log(-torch.log(u))
            nxt = logits.argmax().reshape(1)
            out.append(nxt)
            ids = torch.cat([ids, nxt])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=device)


def sample_text(params: Any, cfg: Any, prompt: str, num_tokens: int, key: torch.Tensor, **kw: Any) -> str:
    """Byte-level convenience: encode ``prompt`` as UTF-8, generate, decode (invalid bytes replaced)."""
    ids = torch.tensor(list(prompt.encode("utf-8")), dtype=torch.int64)
    new = generate(params, cfg, ids, num_tokens, key, **kw)
    return prompt + bytes(new.clamp(0, 255).tolist()).decode("utf-8", errors="replace")
