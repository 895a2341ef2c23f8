"""Token data for training: load a corpus once, then sample batches as a pure function of (key, step).

Sources (``data.source`` in the config):

- ``stdlib`` (default): the ``*.py`` files of this Python's own standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and the ``test`` packages),
  sorted by path. Every machine with Python has it and nothing is downloaded. The corpus depends on
  the Python version; the sampling does not depend on the machine.
- ``text``: UTF-8 text files matched by globs (``**`` allowed), sorted.
- ``jsonl``: JSON lines, one document per line in ``data.text_field``.
- ``ids``: pre-tokenised ids, a ``.npy`` or a ``.pt`` holding an integer tensor (any shape; flattened).

Text becomes bytes (vocab 256) unless ``data.tokenizer`` names a ``tokenizer.json`` for the
``tokenizers`` package. Documents are joined in order (bytes: with a newline), and the last
``val_fraction`` of the token stream is the validation split.

A batch is ``B`` windows of ``S + 1`` tokens at start offsets drawn with :mod:`hpfunc.random`
(counter-based), so the same seed and step give the same batch on any machine:

    >>> import torch
    >>> from hpfunc import random
    >>> data = TokenData(train=torch.arange(100) % 256, val=torch.arange(20), vocab_size=256, description="demo")
    >>> b = sample_batch(data.train, random.key(0), step=3, batch_size=2, seq_len=8)
    >>> b["tokens"].shape, b["labels"].shape
    (torch.Size([2, 8]), torch.Size([2, 8]))
    >>> bool((b["tokens"][:, 1:] == b["labels"][:, :-1]).all())
    True
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import sysconfig
from typing import Iterable, Sequence

import attrs
import numpy as np
import torch

from hpfunc import random
from hpfunc.train.config import ConfigError, DataConfig

__all__ = [
    "DataError",
    "TokenData",
    "stdlib_files",
    "expand_globs",
    "read_text_files",
    "read_jsonl",
    "read_ids",
    "tokenize_bytes",
    "tokenize_with",
    "load_data",
    "split_train_val",
    "window_starts",
    "sample_batch",
    "eval_batches",
]

BYTE_VOCAB = 256
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(ConfigError):
    """The data named by the config cannot be read or does not fit the request."""


@attrs.frozen
class TokenData:
    """A tokenised corpus: 1-D train and validation token streams and the vocabulary size."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    description: str


# ---------------------------------------------------------------------------------------------
# Reading.


def stdlib_files(root: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    """The standard library's ``*.py`` files, sorted by their path relative to ``root``.

    Third-party packages (``site-packages``) and the bulky test suites are left out.

    >>> files = stdlib_files()
    >>> any(f.name == "json" or f.parent.name == "json" for f in files)
    True
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune while walking: site-packages alone can hold more files than the stdlib.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_PARTS]
        files.extend(pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(root).as_posix())


def expand_globs(patterns: Sequence[str], *, what: str = "data.paths") -> list[pathlib.Path]:
    """Files matched by the glob patterns (``**`` recursive), each pattern's matches sorted, no repeats.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "b.txt").write_text("b"); (d / "a.txt").write_text("a")
    1
    1
    >>> [p.name for p in expand_globs([str(d / "*.txt"), str(d / "a.txt")])]
    ['a.txt', 'b.txt']
    """
    out: list[pathlib.Path] = []
    seen = set()
    for i, pattern in enumerate(patterns):
        matches = sorted(p for p in glob.glob(pattern, recursive=True) if pathlib.Path(p).is_file())
        if not matches:
            raise DataError(f"{what}.{i}: the pattern {pattern!r} matches no file")
        for m in matches:
            if m not in seen:
                seen.add(m)
                out.append(pathlib.Path(m))
    return out


def _take_bytes(texts: Iterable[str], max_bytes: int | None) -> list[str]:
    out, total = [], 0
    for t in texts:
        if max_bytes is not None and total >= max_bytes:
            break
        out.append(t)
        total += len(t.encode("utf-8", errors="replace"))
    return out


def read_text_files(files: Sequence[pathlib.Path], *, max_bytes: int | None = None) -> list[str]:
    """The files' contents as text (UTF-8; undecodable bytes replaced), in order, up to ``max_bytes``."""

    def gen():
        for f in files:
            yield pathlib.Path(f).read_bytes().decode("utf-8", errors="replace")

    return _take_bytes(gen(), max_bytes)


def read_jsonl(files: Sequence[pathlib.Path], text_field: str = "text", *, max_bytes: int | None = None) -> list[str]:
    """One document per JSON line: the string in ``text_field``. Errors name the file and line."""

    def gen():
        for f in files:
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{f}:{lineno}: not valid JSON ({e.msg})") from None
                    if not isinstance(record, dict) or text_field not in record:
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise DataError(
                            f"{f}:{lineno}: expected an object with the text field {text_field!r} "
                            f"(data.text_field), found {keys}"
                        )
                    text = record[text_field]
                    if not isinstance(text, str):
                        raise DataError(
                            f"{f}:{lineno}: field {text_field!r} must be a string, found {type(text).__name__}"
                        )
                    yield text

    return _take_bytes(gen(), max_bytes)


def read_ids(files: Sequence[pathlib.Path]) -> torch.Tensor:
    """Pre-tokenised ids from ``.npy`` / ``.pt`` files, flattened and concatenated (int64).

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "ids.npy"
    >>> np.save(f, np.array([[3, 1], [4, 1]], dtype=np.uint16))
    >>> read_ids([f]).tolist()
    [3, 1, 4, 1]
    """
    parts = []
    for f in files:
        f = pathlib.Path(f)
        if f.suffix == ".npy":
            arr = np.load(f, allow_pickle=False)
            t = torch.from_numpy(np.ascontiguousarray(arr))
        elif f.suffix == ".pt":
            t = torch.load(f, map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor):
                raise DataError(f"{f}: expected a saved integer tensor, found {type(t).__name__}")
        else:
            raise DataError(f"{f}: pre-tokenised ids must be a .npy or .pt file, found suffix {f.suffix!r}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise DataError(f"{f}: expected integer token ids, found dtype {t.dtype}")
        t = t.reshape(-1).to(torch.int64)
        if t.numel() and int(t.min()) < 0:
            raise DataError(f"{f}: token ids must be >= 0, found {int(t.min())}")
        parts.append(t)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Tokenising.


def tokenize_bytes(texts: Sequence[str]) -> torch.Tensor:
    """UTF-8 bytes of the documents joined by newlines, as a ``uint8`` tensor (vocab 256).

    >>> tokenize_bytes(["ab", "c"]).tolist()
    [97, 98, 10, 99]
    """
    blob = "\n".join(texts).encode("utf-8", errors="replace")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)


def tokenize_with(texts: Sequence[str], tokenizer_path: str) -> tuple[torch.Tensor, int]:
    """Token ids from a ``tokenizers`` ``tokenizer.json``: ``(ids int64, vocab_size)``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - the extra is optional
        raise DataError(
            "data.tokenizer: reading a tokenizer.json needs the `tokenizers` package "
            "(pip install 'hpfunc[tokenizers]')"
        ) from None
    try:
        tok = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # tokenizers raises a plain Exception with a Rust message
        raise DataError(f"data.tokenizer: cannot load {tokenizer_path!r}: {e}") from None
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts)):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int64), int(tok.get_vocab_size())


def _compact(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # The stream is gathered by index per batch; a narrow dtype keeps big corpora small in memory.
    if vocab_size <= 256:
        return ids.to(torch.uint8)
    if vocab_size <= 2**31:
        return ids.to(torch.int32)
    return ids.to(torch.int64)


def split_train_val(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of the stream for training, the rest for validation.

    >>> tr, va = split_train_val(torch.arange(10), 0.2)
    >>> tr.tolist(), va.tolist()
    ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    """
    n_val = int(round(ids.numel() * val_fraction))
    return ids[: ids.numel() - n_val], ids[ids.numel() - n_val :]


def load_data(cfg: DataConfig) -> TokenData:
    """Read and tokenise the corpus the config names; split it into train and validation streams.

    >>> from hpfunc.train.config import load_config_dict
    >>> data = load_data(load_config_dict({"data": {"max_bytes": 1000, "val_fraction": 0.1}}).data)
    >>> data.vocab_size, data.train.dtype, data.val.numel() > 0
    (256, torch.uint8, True)
    """
    vocab = BYTE_VOCAB
    if cfg.source == "ids":
        files = expand_globs(cfg.paths or [])
        ids = read_ids(files)
        vocab = int(ids.max()) + 1 if ids.numel() else 1
        what = f"{len(files)} id file(s)"
    else:
        if cfg.source == "stdlib":
            files = stdlib_files()
            texts = read_text_files(files, max_bytes=cfg.max_bytes)
            what = f"python stdlib ({len(texts)} of {len(files)} .py files)"
        elif cfg.source == "text":
            files = expand_globs(cfg.paths or [])
            texts = read_text_files(files, max_bytes=cfg.max_bytes)
            what = f"{len(texts)} text file(s)"
        elif cfg.source == "jsonl":
            files = expand_globs(cfg.paths or [])
            texts = read_jsonl(files, cfg.text_field, max_bytes=cfg.max_bytes)
            what = f"{len(texts)} JSONL document(s) from {len(files)} file(s)"
        else:  # the config check keeps this unreachable
            raise DataError(f"data.source: unknown source {cfg.source!r}")
        if cfg.tokenizer:
            ids, vocab = tokenize_with(texts, cfg.tokenizer)
            what += f", tokenizer {pathlib.Path(cfg.tokenizer).name}"
        else:
            ids = tokenize_bytes(texts)
            what += ", bytes"
    train, val = split_train_val(_compact(ids, vocab), cfg.val_fraction)
    return TokenData(train=train, val=val, vocab_size=vocab, description=f"{what}: {ids.numel():,} tokens")


# ---------------------------------------------------------------------------------------------
# Sampling.


def window_starts(key: torch.Tensor, step: int, num_tokens: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Start offsets of the ``batch_size`` windows of ``seq_len + 1`` tokens for ``step``.

    A pure function of its arguments (``fold_in(key, step)`` then :func:`hpfunc.random.randint`).

    >>> window_starts(random.key(0), 0, 1_000_000, 4, 128).tolist()  # the same on every machine
    [632157, 856104, 715626, 752078]
    """
    span = num_tokens - seq_len
    if span < 1:
        raise DataError(
            f"the token stream has {num_tokens} tokens, too few for one window of seq_len + 1 = "
            f"{seq_len + 1}; use more data, a larger data.val_fraction split, or a smaller train.seq_len"
        )
    return random.randint(random.fold_in(key, step), (batch_size,), 0, span)


def sample_batch(
    tokens: torch.Tensor, key: torch.Tensor, step: int, batch_size: int, seq_len: int
) -> dict[str, torch.Tensor]:
    """``{"tokens": int64[B, S], "labels": int64[B, S]}`` where labels are the next tokens."""
    starts = window_starts(key, step, tokens.numel(), batch_size, seq_len)
    idx = starts[:, None] + torch.arange(seq_len + 1, dtype=torch.int64)
    windows = tokens[idx].to(torch.int64)
    return {"tokens": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}


def eval_batches(
    tokens: torch.Tensor, key: torch.Tensor, num_batches: int, batch_size: int, seq_len: int
) -> list[dict[str, torch.Tensor]]:
    """A fixed list of validation batches (the same at every evaluation of a run).

    >>> [b["tokens"].shape for b in eval_batches(torch.arange(100), random.key(0), 2, 3, 5)]
    [torch.Size([3, 5]), torch.Size([3, 5])]
    """
    return [sample_batch(tokens, key, i, batch_size, seq_len) for i in range(num_batches)]
