"""``hpfunc convert SRC DST``: a Qwen3 model's parameters between an hpfunc checkpoint (DCP), a Hugging
Face safetensors folder and a single ``torch.save`` file, streamed (never the whole model in memory).

Formats (``SRC``'s is detected, ``DST``'s is ``--to`` or a ``.pt`` / ``.pth`` suffix):

* ``dcp``: an hpfunc checkpoint folder (:func:`hpfunc.checkpoint.save`); the parameters are the keys
  under ``--prefix`` (default ``params``: a train state's ``params.layers.0.attn.wq``), stacked experts.
* ``hf``: ``config.json`` + ``*.safetensors`` (+ index); per-expert names as published, or transformers 5's
  fused ``gate_up_proj`` (read always, written with ``--fused-experts``).
* ``torch``: ``torch.save`` of a flat ``{Hugging Face name: tensor}`` (what ``model.state_dict()`` of a
  transformers model holds).

Every tensor is accounted for before anything is written: the source's names and shapes must be the
model's (:func:`~hpfunc.models.qwen3.hf_sharded.expected_tensors`; a missing, unexpected or misshapen
tensor is an error naming it). Streaming: an HF source is memory-mapped (page cache, not the process's
memory); a DCP source is read one parameter at a time; an HF target is written file by file (at most
``--max-shard-size`` of tensors held); a DCP target is written by DCP from the memory-mapped source
(stacked experts as pieces, never stacked in memory); a torch target is ``torch.save`` of memory-mapped
tensors (from a DCP source through a temporary HF folder).

>>> import tempfile, os, torch
>>> from hpfunc import random, tree
>>> from hpfunc.models import preset, qwen3
>>> cfg = preset("qwen3-moe-tiny")
>>> params = qwen3.init(random.key(0), cfg)
>>> d = tempfile.mkdtemp()
>>> qwen3.save_pretrained(params, cfg, d + "/hf")
>>> r = convert(d + "/hf", d + "/model.pt")                 # hf -> torch
>>> r.tensors, r.source, r.target
(69, 'hf', 'torch')
>>> _ = convert(d + "/model.pt", d + "/ckpt", to="dcp", cfg=cfg)   # torch -> dcp (the config is given)
>>> _ = convert(d + "/ckpt", d + "/back", to="hf", cfg=cfg)        # dcp -> hf
>>> _, back = qwen3.from_pretrained(d + "/back")
>>> all(torch.equal(a, b) for a, b in zip(tree.leaves(back), tree.leaves(params)))
True
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Iterator, Sequence

import attrs
import torch

from hpfunc import tree as _tree
from hpfunc.checkpoint.errors import CheckpointError
from hpfunc.checkpoint.safetensors_io import (Block, block_planner, check_names, header, mmap_safetensors, SUFFIX,
                                              write_folder)
from hpfunc.models.config import ConfigError, Qwen3Config
from hpfunc.models.qwen3.hf import CheckpointError as HFCheckpointError
from hpfunc.models.qwen3.hf import (BIAS_KEY, CONFIG_NAME, _EXPERT_PROJ, _parse_size, check_expert_bias_mode,
                                    expert_bias_names, hf_name, load_config)
from hpfunc.models.qwen3.hf_sharded import expected_tensors

__all__ = ["convert", "detect_format", "ConvertResult", "main", "FORMATS"]

FORMATS = ("dcp", "hf", "torch")
_MARKER = "hpfunc_checkpoint.json"


@attrs.frozen
class ConvertResult:
    """What a conversion did: formats, tensors written, parameters, bytes, seconds."""

    source: str
    target: str
    tensors: int
    parameters: int
    bytes: int
    seconds: float


def detect_format(path: str | os.PathLike) -> str:
    """``dcp``, ``hf`` or ``torch`` from what ``path`` holds (an error says what was found).

    >>> import tempfile
    >>> detect_format(tempfile.mkdtemp())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.checkpoint.errors.CheckpointError: convert: cannot tell the format of '...': a folder with neither ...
    """
    p = pathlib.Path(path)
    if p.is_dir():
        if (p / _MARKER).exists() or (p / ".metadata").exists():
            return "dcp"
        if any(p.glob(f"*{SUFFIX}")):
            return "hf"
        raise CheckpointError(f"convert: cannot tell the format of {os.fspath(p)!r}: a folder with neither "
                              f"{_MARKER} / .metadata (dcp) nor *{SUFFIX} files (hf)")
    if p.is_file():
        return "torch"
    raise CheckpointError(f"convert: {os.fspath(p)!r} does not exist")


# -- the model's names ---------------------------------------------------------------------------------------

@attrs.frozen
class _Param:
    path: str                   # the hpfunc parameter path
    shape: tuple[int, ...]
    names: tuple[str, ...]      # its Hugging Face tensors (E of them for an expert stack, 1 otherwise)
    fused: str | None = None    # with a fused source: the fused tensor and which rows are this leaf's
    rows: tuple[int, int] | None = None


def _params(cfg: Qwen3Config, *, fused: bool, bias_names: set[str]) -> list[_Param]:
    from hpfunc.models.qwen3.model import _is_shape, param_shapes

    out = []
    for path, shape in _tree.leaves_with_paths(param_shapes(cfg), is_leaf=_is_shape):
        shape = tuple(shape)
        if ".moe.experts." in path:
            layer, proj = path.split(".")[1], _EXPERT_PROJ[path.rsplit(".", 1)[-1]]
            pre = f"model.layers.{layer}.mlp.experts."
            if fused:
                I = shape[1]
                rows = None if proj == "down_proj" else (0, I) if proj == "gate_proj" else (I, 2 * I)
                name = pre + ("down_proj" if proj == "down_proj" else "gate_up_proj")
                out.append(_Param(path, shape, (name,), name, rows))
            else:
                out.append(_Param(path, shape, tuple(f"{pre}{e}.{proj}.weight" for e in range(shape[0]))))
        elif path.endswith("moe.expert_bias"):
            if hf_name(path) in bias_names:
                out.append(_Param(path, shape, (hf_name(path),)))
        else:
            out.append(_Param(path, shape, (hf_name(path),)))
    return out


# -- sources: {Hugging Face name: tensor}, lazily -------------------------------------------------------------

class _HFNamed:
    """A source seen as Hugging Face names: ``names`` (shape, dtype) up front, tensors on demand."""

    names: dict[str, tuple[tuple[int, ...], torch.dtype]]
    fused: bool

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _HFSource(_HFNamed):
    def __init__(self, path: pathlib.Path) -> None:
        self.names = header(path)
        self.fused = any(k.endswith("mlp.experts.gate_up_proj") for k in self.names)
        self._files = sorted(path.glob(f"*{SUFFIX}"))
        self._maps: dict[str, torch.Tensor] = {}
        for f in self._files:  # maps only: no tensor byte is read here
            self._maps.update(mmap_safetensors(f))

    def get(self, name: str) -> torch.Tensor:
        return self._maps[name]


class _TorchSource(_HFNamed):
    def __init__(self, path: pathlib.Path) -> None:
        try:
            sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"convert: {os.fspath(path)!r} is not a torch.save file of tensors: "
                                  f"{type(e).__name__}: {e}") from None
        if not isinstance(sd, dict):
            raise CheckpointError(f"convert: {os.fspath(path)!r} holds a {type(sd).__name__}; expected a dict "
                                  f"{{Hugging Face name: tensor}} (a model.state_dict())")
        flat = dict(_tree.leaves_with_paths(sd))
        bad = [k for k, v in flat.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"convert: {os.fspath(path)!r}: entries that are not tensors: {bad[:8]}")
        self._sd = flat
        self.names = {k: (tuple(v.shape), v.dtype) for k, v in flat.items()}
        self.fused = any(k.endswith("mlp.experts.gate_up_proj") for k in self.names)

    def get(self, name: str) -> torch.Tensor:
        return self._sd[name]


class _DCPSource(_HFNamed):
    """An hpfunc checkpoint's parameters under ``prefix``, read one parameter at a time."""

    def __init__(self, path: pathlib.Path, cfg: Qwen3Config, prefix: str) -> None:
        from hpfunc.checkpoint import info
        from hpfunc.checkpoint.marker import parse_dtype

        self._path, self._prefix = path, prefix
        keys = info(path)["keys"]
        pre = f"{prefix}." if prefix else ""
        self._saved = {k[len(pre):]: (tuple(v["shape"]), parse_dtype(v["dtype"])) for k, v in keys.items()
                       if k.startswith(pre) and v["kind"] == "tensor"}
        if not self._saved:
            raise CheckpointError(f"convert: checkpoint {os.fspath(path)!r} has no tensor under {prefix!r} "
                                  f"(its keys: {sorted(keys)[:8]}); pass --prefix")
        self._cache: tuple[str, torch.Tensor] | None = None
        # a zero expert bias is not published (save_pretrained's rule); the bias is E floats a layer
        bias = {hf_name(p) for p in self._saved if p.endswith("moe.expert_bias") and bool(self._load(p).ne(0).any())}
        self.fused = False
        self._by_name: dict[str, tuple[str, int | None]] = {}
        self.names = {}
        params = _params(cfg, fused=False, bias_names=bias)
        known = {p.path for p in params}
        extra = sorted(set(self._saved) - known - {q for q in self._saved if q.endswith("moe.expert_bias")})
        if extra:
            raise CheckpointError(f"convert: checkpoint {os.fspath(path)!r} has {len(extra)} tensor(s) under "
                                  f"{prefix!r} that the model config lacks: {extra[:8]}; give the model's config")
        for p in params:
            got = self._saved.get(p.path)
            if got is None:
                continue  # reported as missing names by the check
            shape, dtype = got
            if len(p.names) > 1:
                for e, n in enumerate(p.names):
                    self.names[n] = (shape[1:], dtype)
                    self._by_name[n] = (p.path, e)
            else:
                self.names[p.names[0]] = (shape, dtype)
                self._by_name[p.names[0]] = (p.path, None)

    def _load(self, path: str) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == path:
            return self._cache[1]
        import torch.distributed.checkpoint as dcp

        from hpfunc.checkpoint.dcp_io import _quiet_single_process

        shape, dtype = self._saved[path]
        key = f"{self._prefix}.{path}" if self._prefix else path
        sd = {key: torch.empty(shape, dtype=dtype)}
        with _quiet_single_process():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(self._path), no_dist=True)
        self._cache = (path, sd[key])  # the one parameter held: an expert stack serves its E names
        return sd[key]

    def get(self, name: str) -> torch.Tensor:
        path, e = self._by_name[name]
        t = self._load(path)
        return t if e is None else t[e]


def checkpoint_model_config(path: str | os.PathLike) -> Qwen3Config | None:
    """The model config an hpfunc checkpoint carries in its metadata (``metadata["model"]``, a Hugging
    Face ``config.json`` dict, which ``hpfunc train`` and ``convert --to dcp`` write), or ``None``.

    >>> import tempfile, torch
    >>> from hpfunc import checkpoint
    >>> from hpfunc.models import preset
    >>> d = tempfile.mkdtemp() + "/c"
    >>> _ = checkpoint.save(d, {"w": torch.ones(1)}, step=0, metadata={"model": preset("qwen3-dense-tiny").to_hf_dict()})
    >>> checkpoint_model_config(d) == preset("qwen3-dense-tiny")
    True
    """
    from hpfunc.checkpoint import info
    from hpfunc.models.config import ConfigError

    meta = info(path).get("metadata") or {}
    model = meta.get("model")
    if model is None:
        return None
    try:
        return Qwen3Config.from_hf_dict(model)
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{os.fspath(path)!r}: the model config in its metadata (key 'model') is not a "
                              f"Qwen3 config: {e}") from None


def _source(path: pathlib.Path, fmt: str, cfg: Qwen3Config | None, prefix: str) -> tuple[_HFNamed, Qwen3Config]:
    if fmt == "hf":
        src: _HFNamed = _HFSource(path)
        if cfg is None:
            cfg = load_config(path)
        return src, cfg
    if cfg is None and fmt == "dcp":
        cfg = checkpoint_model_config(path)
        if cfg is None:
            meta = __import__("hpfunc.checkpoint", fromlist=["info"]).info(path).get("metadata") or {}
            why = ("it was written by `hpfunc train` before checkpoints carried their model config"
                   if "config" in meta else "its metadata has no 'model' entry (a checkpoint saved from Python)")
            raise CheckpointError(f"convert: {os.fspath(path)!r} does not say which model it holds: {why}; pass "
                                  f"--config (a preset name or a config.json)")
    if cfg is None:
        raise CheckpointError(f"convert: a {fmt} file holds no model config; pass --config (a preset name or a "
                              f"config.json)")
    return (_DCPSource(path, cfg, prefix) if fmt == "dcp" else _TorchSource(path)), cfg


def _check(src: _HFNamed, cfg: Qwen3Config, where: pathlib.Path, written_bias: set[str] | None = None
           ) -> list[_Param]:
    """Every source tensor against the model; the parameters to write (the biases in ``written_bias``
    only, when given)."""
    bias = {n for n in src.names if n.endswith(BIAS_KEY)}
    want = expected_tensors(cfg, fused_experts=src.fused)
    want.update({n: ((cfg.num_experts,), torch.float32) for n in bias})
    found = dict(src.names)
    if cfg.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # a tied checkpoint may store it too (the embedding is used)
    check_names(where, found, {k: s for k, (s, _) in want.items()},
                hint="give the model's config (--config) or convert a checkpoint of this model")
    return _params(cfg, fused=src.fused, bias_names=bias if written_bias is None else bias & written_bias)


def _bias_to_write(src: _HFNamed, cfg: Qwen3Config, to: str, mode: str) -> set[str] | None:
    """The expert biases an export into the Hugging Face layout (``hf``, ``torch``) writes, by ``mode``
    (an :class:`~hpfunc.models.qwen3.hf.ExpertBiasError` for a nonzero one under ``refuse``); ``None``
    (all) for a dcp target."""
    if to == "dcp":
        return None
    nonzero = {}
    for n in src.names:
        if n.endswith(BIAS_KEY):
            m = float(src.get(n).abs().max())
            if m > 0:
                nonzero[n] = m
    effect = str(_bias_effect(src, cfg)) if nonzero and mode == "refuse" else ""
    return expert_bias_names(nonzero, mode, where="convert", option="--expert-bias", effect=effect)


_EFFECT_MAX_BYTES = 2 * 10**9


def _bias_effect(src: _HFNamed, cfg: Qwen3Config) -> str:
    """What dropping the bias does to the source model's logits, measured when the model is small enough
    to hold (up to 2 GB); else nothing."""
    from hpfunc.models.qwen3.hf import expert_bias_effect
    from hpfunc.models.qwen3.model import _is_shape, param_shapes

    size = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in src.names.values())
    if size > _EFFECT_MAX_BYTES:
        return ""
    bias = {n for n in src.names if n.endswith(BIAS_KEY)}
    whole = {}
    for p in _params(cfg, fused=src.fused, bias_names=bias):
        block = _param_tensor(src, p)
        t = torch.empty(p.shape, dtype=block.dtype)
        for off, piece in block.pieces:
            t[tuple(slice(o, o + n) for o, n in zip(off, piece.shape))] = piece
        whole[p.path] = t
    params = _tree.map_with_path(lambda path, shape: whole.get(path, torch.zeros(shape)), param_shapes(cfg),
                                 is_leaf=_is_shape)
    return str(expert_bias_effect(params, cfg))


# -- targets --------------------------------------------------------------------------------------------------

def _param_tensor(src: _HFNamed, p: _Param) -> Block:
    """One parameter as a Block of source tensors (views; the expert stack as E pieces, never stacked)."""
    if p.fused is not None:
        t = src.get(p.fused)
        if p.rows is not None:
            t = t[:, p.rows[0]:p.rows[1]]
        return Block(p.shape, t.dtype, [((0,) * len(p.shape), t)])
    if len(p.names) > 1:
        pieces = [((e,) + (0,) * (len(p.shape) - 1), src.get(n).unsqueeze(0)) for e, n in enumerate(p.names)]
        return Block(p.shape, pieces[0][1].dtype, pieces)
    t = src.get(p.names[0])
    return Block(p.shape, t.dtype, [((0,) * len(p.shape), t)])


def _hf_stream(src: _HFNamed, params: list[_Param], cfg: Qwen3Config, fused_out: bool
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` in parameter order in the target's expert layout."""
    pending: dict[str, torch.Tensor] = {}
    for p in params:
        if ".moe.experts." not in p.path or fused_out == src.fused:
            if p.fused is not None and p.rows is not None:
                if p.rows[0] == 0:  # the fused tensor once (its gate half comes first)
                    yield p.fused, src.get(p.fused)
                continue
            for n in p.names:
                yield n, src.get(n)
            continue
        layer, proj = p.path.split(".")[1], _EXPERT_PROJ[p.path.rsplit(".", 1)[-1]]
        pre = f"model.layers.{layer}.mlp.experts."
        if fused_out:  # per-expert source -> fused: one stack per tensor, one layer at a time
            stacked = torch.stack([src.get(n) for n in p.names])
            if proj == "down_proj":
                yield pre + "down_proj", stacked
            elif proj == "gate_proj":
                pending[layer] = stacked
            else:
                yield pre + "gate_up_proj", torch.cat([pending.pop(layer), stacked], dim=1)
        else:  # fused source -> per-expert: views of the mapped fused tensor
            t = _param_tensor(src, p).pieces[0][1]
            for e in range(p.shape[0]):
                yield f"{pre}{e}.{proj}.weight", t[e]


def _config_bytes(cfg: Qwen3Config, dtype: torch.dtype) -> bytes:
    config = cfg.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(config, indent=2, sort_keys=True, allow_nan=False).encode()


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str | None = None, source_format: str | None = None,
            cfg: Qwen3Config | None = None, fused_experts: bool = False, max_shard_size: int | str = "5GB",
            prefix: str = "params", expert_bias: str = "refuse") -> ConvertResult:
    """Convert the Qwen3 parameters at ``src`` into ``dst`` in format ``to`` (see the module docstring).

    ``cfg``: the model config (default: an HF source's ``config.json``, or the ``model`` entry of a dcp
    source's metadata, which ``hpfunc train`` checkpoints carry; needed for a torch source).
    ``expert_bias``: a nonzero MoE expert bias written into the Hugging Face layout (``hf``, ``torch``)
    refuses unless ``"drop"`` or ``"keep"`` (see :func:`hpfunc.models.qwen3.hf.save_pretrained`).
    ``dst`` is written atomically (an old one is replaced).
    """
    start = time.perf_counter()
    src_p, dst_p = pathlib.Path(src), pathlib.Path(dst)
    fmt = source_format or detect_format(src_p)
    to = to or ("torch" if dst_p.suffix in (".pt", ".pth") else None)
    for name, value in (("--from", fmt), ("--to", to)):
        if value not in FORMATS:
            raise CheckpointError(f"convert: {name} must be one of {', '.join(FORMATS)}, found {value!r}"
                                  + ("; give --to (or a .pt destination for torch)" if value is None else ""))
    if fmt == to:
        raise CheckpointError(f"convert: {os.fspath(src_p)!r} is {fmt} already; copy it, or pick another --to")
    check_expert_bias_mode(expert_bias, "convert")
    source, cfg = _source(src_p, fmt, cfg, prefix)
    params = _check(source, cfg, src_p)
    written_bias = _bias_to_write(source, cfg, to, expert_bias)
    if written_bias is not None:
        params = _check(source, cfg, src_p, written_bias)
    dtype = next(iter(source.names.values()))[1]
    count = sum(torch.Size(s).numel() for s, _ in source.names.values())
    nbytes = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in source.names.values())
    if to == "hf":
        written = write_folder(dst_p, _hf_stream(source, params, cfg, fused_experts), limit=_parse_size(max_shard_size),
                               extra={**_carried_files(src_p, fmt), CONFIG_NAME: _config_bytes(cfg, dtype)})
        n = len(written)
    elif to == "dcp":
        from hpfunc.checkpoint.dcp_io import _quiet_single_process, write_flat

        pre = f"{prefix}." if prefix else ""
        from hpfunc.models.qwen3.model import _is_shape as _shape_leaf, param_shapes as _param_shapes

        order = [q for q, _ in _tree.leaves_with_paths(_param_shapes(cfg), is_leaf=_shape_leaf)]
        flat = {pre + p.path: _param_tensor(source, p) for p in params}
        from hpfunc.models.qwen3.model import _is_shape, param_shapes

        for path, shape in _tree.leaves_with_paths(param_shapes(cfg), is_leaf=_is_shape):
            if path.endswith("moe.expert_bias") and pre + path not in flat:  # not published: zero
                flat[pre + path] = Block.whole(torch.zeros(shape, dtype=torch.float32))
        flat = dict(sorted(flat.items(), key=lambda kv: order.index(kv[0][len(pre):])))
        with _quiet_single_process():
            write_flat(dst_p, flat, step=0, metadata={"converted_from": os.fspath(src_p), "format": fmt,
                                                      "model": cfg.to_hf_dict()}, planner=block_planner())
        n = len(flat)
    else:
        scratch = None
        if fmt == "dcp":  # torch.save wants every tensor at once: map them from a temporary HF folder
            scratch = pathlib.Path(tempfile.mkdtemp(prefix=".convert-", dir=dst_p.absolute().parent))
            write_folder(scratch / "hf", _hf_stream(source, params, cfg, fused_experts),
                         limit=_parse_size(max_shard_size))
            source = _HFSource(scratch / "hf")
            params = _check(source, cfg, scratch / "hf", written_bias)
        try:
            sd = dict(_hf_stream(source, params, cfg, fused_experts))
            tmp = dst_p.with_name(f".{dst_p.name}.partial-{os.getpid()}")
            torch.save(sd, tmp)
            from hpfunc.durable import fsync_dir, fsync_file

            fsync_file(tmp)
            os.replace(tmp, dst_p)
            fsync_dir(dst_p.absolute().parent)
            n = len(sd)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
    return ConvertResult(fmt, to, n, count, nbytes, time.perf_counter() - start)


def _carried_files(src: pathlib.Path, fmt: str) -> dict[str, bytes]:
    """The tokenizer and generation files an HF export carries over: from the source folder itself, or
    for a trainer checkpoint from the Hugging Face folder it started from (its config's
    ``model.pretrained``, when that folder is still there)."""
    from hpfunc.models.hub import CARRIED_FILES

    folder: str | None = None
    if fmt == "hf":
        folder = os.fspath(src)
    elif fmt == "dcp":
        from hpfunc.checkpoint import info

        meta = info(src).get("metadata") or {}
        folder = ((meta.get("config") or {}).get("model") or {}).get("pretrained")
    if not folder or not os.path.isdir(folder):
        return {}
    out = {}
    for name in CARRIED_FILES:
        file = os.path.join(folder, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                out[name] = f.read()
    return out


def _config_arg(value: str | None) -> Qwen3Config | None:
    """``--config``: a preset name, a config.json, or a folder holding one."""
    if value is None:
        return None
    from hpfunc.models import config as qcfg

    if value in qcfg.PRESETS:
        return qcfg.preset(value)
    p = pathlib.Path(value)
    if p.is_dir():
        return load_config(p)
    if p.is_file():
        try:
            return Qwen3Config.from_hf_dict(json.loads(p.read_text()))
        except (json.JSONDecodeError, ConfigError, TypeError) as e:
            raise CheckpointError(f"convert: --config {value!r}: not a Qwen3 config.json: {e}") from None
    raise CheckpointError(f"convert: --config {value!r} is neither a preset ({', '.join(qcfg.PRESETS)}) nor a "
                          f"config.json (or a folder holding one)")


def main(argv: Sequence[str] | None = None) -> None:
    """``hpfunc convert SRC DST [--to FORMAT] [--from FORMAT] [--config C] [--fused-experts] ...``."""
    ap = argparse.ArgumentParser(prog="hpfunc convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--to", choices=FORMATS, help="the format of DST (default: torch for a .pt / .pth DST)")
    ap.add_argument("--from", dest="source_format", choices=FORMATS, help="the format of SRC (default: detected)")
    ap.add_argument("--config", help="the model: a preset name or a config.json (default: an hf SRC's config.json, "
                                     "a dcp SRC's metadata)")
    ap.add_argument("--expert-bias", choices=("refuse", "keep", "drop"), default="refuse",
                    help="a nonzero MoE expert-selection bias, which transformers' Qwen3-MoE drops: refuse the export "
                         "(default), drop it (the logits change), or keep it for hpfunc's readers")
    ap.add_argument("--fused-experts", action="store_true", help="write transformers 5's fused gate_up_proj layout")
    ap.add_argument("--max-shard-size", default="5GB", help="hf: the largest safetensors file (default 5GB)")
    ap.add_argument("--prefix", default="params", help="dcp: the key prefix of the parameters (default params)")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = _config_arg(args.config)
        r = convert(args.src, args.dst, to=args.to, source_format=args.source_format, cfg=cfg,
                    fused_experts=args.fused_experts, max_shard_size=args.max_shard_size, prefix=args.prefix,
                    expert_bias=args.expert_bias)
    except (CheckpointError, HFCheckpointError, ConfigError) as e:
        print(f"hpfunc convert: {str(e).removeprefix('convert: ')}", file=sys.stderr)  # the command named once
        raise SystemExit(1) from None
    print(f"{r.source} -> {r.target}: {r.tensors} tensors, {r.parameters:,} parameters, "
          f"{r.bytes / 1e6:.1f} MB in {r.seconds:.2f} s -> {args.dst}")
