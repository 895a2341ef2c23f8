"""Token data for training: load a corpus once, then sample batches as a pure function of (key, step).

Sources (``data.source`` in the config):

- ``stdlib`` (default): the ``*.py`` files of this Python's own standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and the ``test`` packages),
  sorted by path. Every machine with Python has it and nothing is downloaded. The corpus depends on
  the Python version; the sampling does not depend on the machine.
- ``text``: UTF-8 text files matched by globs (``**`` allowed), sorted.
- ``jsonl``: JSON lines, one document per line in ``data.text_field``.
- ``ids``: pre-tokenised ids, a ``.npy`` or a ``.pt`` holding an integer tensor (any shape; flattened).
  A damaged, truncated, empty, pickled or object-dtype file is a :class:`DataError` naming the file
  (pickles are never loaded: they can run code).

Text becomes bytes (vocab 256) unless ``data.tokenizer`` names a ``tokenizer.json`` for the
``tokenizers`` package. Documents are joined in order (bytes: with a newline), and the last
``val_fraction`` of the token stream is the validation split.

:func:`check_data` checks a loaded corpus against the run before any step: token ids within the
model's vocabulary, enough tokens in the training split for one window of ``seq_len + 1`` (the
message names the split, the files and the fix), and enough in the validation split when the run
evaluates.

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
import math
import os
import pathlib
import sysconfig
from typing import Any, Iterable, Sequence

import attrs
import numpy as np
import torch

from hpfunc import random
from hpfunc.train.config import Config, ConfigError, DataConfig

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
    "data_inputs",
    "check_data",
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
    """A tokenised corpus: 1-D train and validation token streams and the vocabulary size.

    ``files`` are the files read (empty for ``stdlib``: too many to name), ``empty`` those of them
    that held no tokens; error messages name them.
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    description: str
    files: tuple = ()
    empty: tuple = ()
    train_docs: torch.Tensor | None = None  # data.document_mask: each token's document index (int32)
    val_docs: torch.Tensor | None = None


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
            try:
                data = pathlib.Path(f).read_bytes()
            except OSError as e:
                raise DataError(f"{f}: cannot read the file: {e.strerror or e}") from None
            yield data.decode("utf-8", errors="replace")

    return _take_bytes(gen(), max_bytes)


def read_jsonl(files: Sequence[pathlib.Path], text_field: str = "text", *, max_bytes: int | None = None) -> list[str]:
    """One document per JSON line: the string in ``text_field``. Errors name the file and line."""

    def gen():
        for f in files:
            try:
                raw = pathlib.Path(f).read_bytes()
            except OSError as e:
                raise DataError(f"{f}: cannot read the file: {e.strerror or e}") from None
            for lineno, bline in enumerate(raw.splitlines(), 1):
                try:
                    line = bline.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{f}:{lineno}: not UTF-8 text (byte {e.start} of the line); "
                                    f"JSON lines must be UTF-8") from None
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


_NPY_FIX = "write it again with np.save(path, np.asarray(ids, dtype=np.int32))"
_PT_FIX = "write it again with torch.save(torch.as_tensor(ids, dtype=torch.int32), path)"


def _load_npy(f: pathlib.Path) -> np.ndarray:
    with open(f, "rb") as fh:
        head = fh.read(6)
    if not head:
        raise DataError(f"{f}: the file is empty (0 bytes), not a .npy array; {_NPY_FIX}")
    if head != b"\x93NUMPY":
        what = ("pickled Python data (not loaded: a pickle can run code)" if head[:1] == b"\x80"
                else "an .npz archive or a zip file" if head[:2] == b"PK"
                else f"data that does not start with the .npy signature (first bytes {head!r})")
        raise DataError(f"{f}: not a .npy array: the file holds {what}; {_NPY_FIX}")
    try:
        return np.load(f, allow_pickle=False)
    except ValueError as e:
        if "object" in str(e).lower() or "pickle" in str(e).lower():
            raise DataError(f"{f}: the array has dtype object (Python objects, stored as a pickle, which is not "
                            f"loaded: it can run code); token ids must be integers: {_NPY_FIX}") from None
        raise DataError(f"{f}: the .npy file is damaged or truncated ({_first_line(e)}); {_NPY_FIX}") from None
    except (EOFError, OSError) as e:
        raise DataError(f"{f}: the .npy file is damaged or truncated ({_first_line(e)}); {_NPY_FIX}") from None


def _load_pt(f: pathlib.Path) -> torch.Tensor:
    import pickle

    with open(f, "rb") as fh:
        head = fh.read(4)
    if not head:
        raise DataError(f"{f}: the file is empty (0 bytes), not a saved tensor; {_PT_FIX}")
    if head[:2] != b"PK" and head[:1] != b"\x80":  # torch.save: a zip archive (or the legacy pickle format)
        raise DataError(f"{f}: not a file written by torch.save (first bytes {head!r}); {_PT_FIX}")
    try:
        t = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = [ln.strip() for ln in str(e).splitlines() if "Unsupported" in ln]
        what = f" ({found[0].split(' was not')[0].replace('WeightsUnpickler error: ', '')[:120]})" if found else ""
        raise DataError(f"{f}: the file holds Python objects other than tensors{what}, which are not loaded "
                        f"(weights-only loading: a pickle can run code); {_PT_FIX}") from None
    except Exception as e:  # torch raises RuntimeError / EOFError / ... with the reader's message
        reason = _first_line(e).split(". ")[0][:160] if str(e).strip() else "it ends too early"
        raise DataError(f"{f}: the .pt file is damaged or truncated ({type(e).__name__}: {reason}); "
                        f"{_PT_FIX}") from None
    if not isinstance(t, torch.Tensor):
        raise DataError(f"{f}: expected a saved integer tensor, found {type(t).__name__}; {_PT_FIX}")
    return t


def read_ids(files: Sequence[pathlib.Path]) -> torch.Tensor:
    """Pre-tokenised ids from ``.npy`` / ``.pt`` files, flattened and concatenated (int64).

    Pickled data is never loaded (``allow_pickle=False``, ``weights_only=True``); a file that cannot
    be read as an integer array is a :class:`DataError` naming it and saying how to write it.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "ids.npy"
    >>> np.save(f, np.array([[3, 1], [4, 1]], dtype=np.uint16))
    >>> read_ids([f]).tolist()
    [3, 1, 4, 1]
    """
    parts = []
    for f in files:
        f = pathlib.Path(f)
        try:
            if f.suffix == ".npy":
                arr = _load_npy(f)
                if arr.dtype.kind not in "iu":
                    raise DataError(f"{f}: expected integer token ids, found dtype {arr.dtype}; {_NPY_FIX}")
                if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) >= 2**63:
                    raise DataError(f"{f}: token id {int(arr.max())} does not fit in int64")
                t = torch.from_numpy(np.ascontiguousarray(arr.reshape(-1)).astype(np.int64, copy=False))
            elif f.suffix == ".pt":
                t = _load_pt(f)
            else:
                raise DataError(f"{f}: pre-tokenised ids must be a .npy or .pt file, found suffix {f.suffix!r}")
        except OSError as e:
            raise DataError(f"{f}: cannot read the file: {e.strerror or e}") from None
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


def _load_tokenizer(tokenizer_path: str) -> Any:
    """A ``tokenizers`` tokenizer from its ``tokenizer.json``; errors name ``data.tokenizer``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - the extra is optional
        raise DataError(
            "data.tokenizer: reading a tokenizer.json needs the `tokenizers` package "
            "(pip install 'hpfunc[tokenizers]')"
        ) from None
    try:
        return Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # tokenizers raises a plain Exception with a Rust message
        raise DataError(f"data.tokenizer: cannot load {tokenizer_path!r}: {e}") from None


def tokenize_with(texts: Sequence[str], tokenizer_path: str) -> tuple[torch.Tensor, int]:
    """Token ids from a ``tokenizers`` ``tokenizer.json``: ``(ids int64, vocab_size)``."""
    tok = _load_tokenizer(tokenizer_path)
    ids, _ = tokenize_documents_with(texts, tok)
    return ids, int(tok.get_vocab_size())


def tokenize_documents_with(texts: Sequence[str], tok: Any) -> tuple[torch.Tensor, list[int]]:
    """``(ids int64, tokens per document)`` of the texts through a loaded ``tokenizers`` tokenizer."""
    ids: list[int] = []
    lengths: list[int] = []
    for enc in tok.encode_batch(list(texts)):
        ids.extend(enc.ids)
        lengths.append(len(enc.ids))
    return torch.tensor(ids, dtype=torch.int64), lengths


def byte_document_lengths(texts: Sequence[str]) -> list[int]:
    """Tokens per document of :func:`tokenize_bytes` (a document's joining newline is its last token).

    >>> byte_document_lengths(["ab", "c"]), tokenize_bytes(["ab", "c"]).numel()
    ([3, 1], 4)
    """
    return [len(t.encode("utf-8", errors="replace")) + (i + 1 < len(texts)) for i, t in enumerate(texts)]


def document_index(lengths: Sequence[int]) -> torch.Tensor:
    """Each token's document (int32), from the tokens per document of the stream.

    >>> document_index([3, 0, 2]).tolist()
    [0, 0, 0, 2, 2]
    """
    counts = torch.tensor(list(lengths), dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)


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
    named: list[pathlib.Path] = []  # the files to name in messages (not the whole stdlib)
    empty: list[pathlib.Path] = []
    lengths: list[int] | None = None  # tokens per document (a file of ids, a text, a JSONL record)
    if cfg.source == "ids":
        files = named = expand_globs(cfg.paths or [])
        parts = [read_ids([f]) for f in files]
        empty = [f for f, p in zip(files, parts) if p.numel() == 0]
        ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        lengths = [p.numel() for p in parts]
        vocab = int(ids.max()) + 1 if ids.numel() else 1
        what = f"{len(files)} id file(s)"
    else:
        if cfg.source == "stdlib":
            files = stdlib_files()
            texts = read_text_files(files, max_bytes=cfg.max_bytes)
            what = f"python stdlib ({len(texts)} of {len(files)} .py files)"
        elif cfg.source == "text":
            files = named = expand_globs(cfg.paths or [])
            texts = read_text_files(files, max_bytes=cfg.max_bytes)
            empty = [f for f, t in zip(files, texts) if not t]
            what = f"{len(texts)} text file(s)"
        elif cfg.source == "jsonl":
            files = named = expand_globs(cfg.paths or [])
            texts = read_jsonl(files, cfg.text_field, max_bytes=cfg.max_bytes)
            what = f"{len(texts)} JSONL document(s) from {len(files)} file(s)"
        else:  # the config check keeps this unreachable
            raise DataError(f"data.source: unknown source {cfg.source!r}")
        if cfg.tokenizer:
            if cfg.document_mask:
                tok = _load_tokenizer(cfg.tokenizer)
                ids, lengths = tokenize_documents_with(texts, tok)
                vocab = int(tok.get_vocab_size())
            else:
                ids, vocab = tokenize_with(texts, cfg.tokenizer)
            what += f", tokenizer {pathlib.Path(cfg.tokenizer).name}"
        else:
            ids = tokenize_bytes(texts)
            lengths = byte_document_lengths(texts)
            what += ", bytes"
    train, val = split_train_val(_compact(ids, vocab), cfg.val_fraction)
    train_docs = val_docs = None
    if cfg.document_mask:
        train_docs, val_docs = split_train_val(document_index(lengths or []), cfg.val_fraction)
        what += f", {len(lengths or [])} documents"
    return TokenData(train=train, val=val, vocab_size=vocab, description=f"{what}: {ids.numel():,} tokens",
                     files=tuple(str(f) for f in named), empty=tuple(str(f) for f in empty),
                     train_docs=train_docs, val_docs=val_docs)


def data_inputs(cfg: DataConfig) -> list[tuple[str, str]]:
    """``(what, path)`` of the files the data section names (what its globs match now) and its tokenizer:
    the inputs a run must never write over (:class:`hpfunc.train.output.RunFolder` refuses it)."""
    found = [("data file (data.paths)", f) for pattern in cfg.paths or () for f in glob.glob(pattern, recursive=True)]
    if cfg.tokenizer:
        found.append(("tokenizer (data.tokenizer)", cfg.tokenizer))
    return found


def check_data_files(cfg: DataConfig) -> None:
    """The files the data section names exist (each ``data.paths`` pattern matches a file, the tokenizer
    is a file): checked before any rank starts, a :class:`DataError` naming the key.

    >>> from hpfunc.train.config import load_config_dict
    >>> check_data_files(load_config_dict({"data": {"source": "text", "paths": ["/nowhere/*.txt"]}}).data)
    Traceback (most recent call last):
    ...
    hpfunc.train.data.DataError: data.paths.0: the pattern '/nowhere/*.txt' matches no file
    """
    if cfg.source in ("text", "jsonl", "ids"):
        expand_globs(cfg.paths or [])
    if cfg.tokenizer and not pathlib.Path(cfg.tokenizer).is_file():
        raise DataError(f"data.tokenizer: {cfg.tokenizer!r} is not a file; give the path of a tokenizer.json")


def _names(files: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(files[:most])
    return shown + (f" and {len(files) - most} more" if len(files) > most else "")


def check_data(data: TokenData, cfg: Config, vocab_size: int) -> None:
    """Raise :class:`DataError` (a :class:`ConfigError`) naming the key, the split and the files when the
    corpus cannot feed the run: a token id beyond the model's vocabulary (``model.vocab_size``), a
    training split shorter than one window of ``train.seq_len + 1`` tokens, or, when the run evaluates
    (``data.val_fraction > 0`` and ``train.eval_batches > 0``), a validation split that short.

    Windows are drawn with replacement, so the batch size needs no more tokens than one window.

    >>> from hpfunc.train.config import load_config_dict
    >>> cfg = load_config_dict({"train": {"seq_len": 8}, "data": {"val_fraction": 0.5}})
    >>> data = TokenData(train=torch.arange(6), val=torch.arange(6), vocab_size=6, description="12 tokens")
    >>> try:
    ...     check_data(data, cfg, vocab_size=256)
    ... except DataError as e:
    ...     print(str(e).split(" (the data")[0])
    data.val_fraction: the training split has 6 tokens, too few for one window of train.seq_len + 1 = 9 tokens
    """
    if data.vocab_size > vocab_size:
        raise DataError(
            f"model.vocab_size: the data has token ids up to {data.vocab_size - 1} but the model's vocabulary "
            f"is {vocab_size}; set model.vocab_size: {data.vocab_size} (or more)"
        )
    dc, tc = cfg.data, cfg.train
    need = tc.seq_len + 1
    n_train, n_val = data.train.numel(), data.val.numel()
    total = n_train + n_val
    if data.files and len(data.empty) == len(data.files):
        source = f"{_names(data.empty)} {'is' if len(data.empty) == 1 else 'are'} empty"
    else:
        source = f"{data.description}" + (f", from {_names(data.files)}" if data.files else "")
        if data.empty:
            source += f"; empty: {_names(data.empty)}"
    evaluates = dc.val_fraction > 0 and tc.eval_batches > 0
    # the val_fraction that leaves a window on each side (train alone when the run does not evaluate)
    lo = math.ceil(need / total * 1000) / 1000 if evaluates and total else 0.0
    hi = math.floor((total - need) / total * 1000) / 1000 if total else -1.0
    both = f"set data.val_fraction between {lo:g} and {hi:g} (now {dc.val_fraction})"
    no_split = (f"add data (each split needs {need} tokens, {2 * need} in all) or lower train.seq_len (to at most "
                f"{max(total // 2 - 1, 1)})")
    if n_train < need:
        split = (f"data.val_fraction {dc.val_fraction} keeps the last {n_val:,} for validation" if n_val
                 else "none kept for validation")
        if total < need:  # not enough data at all: more data or a shorter window
            # data.max_bytes is to blame only where it cut the text short (bytes are tokens without a tokenizer)
            capped = dc.max_bytes is not None and dc.source != "ids" and (bool(dc.tokenizer) or total >= dc.max_bytes)
            key = "data.max_bytes" if capped else ("data.paths" if dc.paths else "data")
            more = f"raise data.max_bytes (now {dc.max_bytes:,})" if key == "data.max_bytes" else (
                "add data (data.paths)" if dc.paths else "add data")
            fix = f"{more} or lower train.seq_len (to at most {total - 1})" if total > 1 else more
        elif lo > hi:  # the run evaluates, and no split gives both sides a window
            key, fix = "data.val_fraction", f"{no_split}, or train without validation (data.val_fraction: 0)"
        else:  # the validation split takes too much: give the training split more
            key = "data.val_fraction"
            fix = (both if evaluates else f"lower data.val_fraction (now {dc.val_fraction}; at most {hi:g} leaves "
                   f"{need} tokens for training)") + f", lower train.seq_len (to at most {max(n_train - 1, 1)}) or add data"
        raise DataError(f"{key}: the training split has {n_train:,} tokens, too few for one window of "
                        f"train.seq_len + 1 = {need} tokens (the data: {source}; {split}); {fix}")
    if evaluates and n_val < need:
        fix = both if lo <= hi else no_split
        raise DataError(
            f"data.val_fraction: the validation split has {n_val:,} tokens (data.val_fraction {dc.val_fraction} of "
            f"the data: {source}), too few for one window of train.seq_len + 1 = {need} tokens, and the run evaluates "
            f"(train.eval_batches: {tc.eval_batches}); {fix}, or set train.eval_batches: 0 to train without "
            f"validation")


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
            f"{seq_len + 1}; use more data or a smaller train.seq_len (for the training split, a smaller "
            f"data.val_fraction; for the validation split, a larger one)"
        )
    return random.randint(random.fold_in(key, step), (batch_size,), 0, span)


def sample_batch(
    tokens: torch.Tensor, key: torch.Tensor, step: int, batch_size: int, seq_len: int,
    docs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``{"tokens": int64[B, S], "labels": int64[B, S]}`` where labels are the next tokens; with
    ``docs`` (each token's document, :attr:`TokenData.train_docs`) also ``"doc_ids": int64[B, S]``,
    counted from 0 in each window, so that a token attends only within its own document.

    >>> b = sample_batch(torch.arange(10), random.key(0), 0, 1, 4, docs=torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2]))
    >>> b["tokens"].tolist(), b["doc_ids"].tolist()
    ([[1, 2, 3, 4]], [[0, 0, 1, 1]])
    """
    starts = window_starts(key, step, tokens.numel(), batch_size, seq_len)
    idx = starts[:, None] + torch.arange(seq_len + 1, dtype=torch.int64)
    windows = tokens[idx].to(torch.int64)
    batch = {"tokens": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}
    if docs is not None:
        d = docs[idx[:, :-1]].to(torch.int64)
        batch["doc_ids"] = (d - d[:, :1]).contiguous()
    return batch


def eval_batches(
    tokens: torch.Tensor, key: torch.Tensor, num_batches: int, batch_size: int, seq_len: int,
    docs: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """A fixed list of validation batches (the same at every evaluation of a run).

    >>> [b["tokens"].shape for b in eval_batches(torch.arange(100), random.key(0), 2, 3, 5)]
    [torch.Size([3, 5]), torch.Size([3, 5])]
    """
    return [sample_batch(tokens, key, i, batch_size, seq_len, docs) for i in range(num_batches)]
