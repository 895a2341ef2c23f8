"""Qwen3 Hugging Face checkpoints from and into a sharded state, by every rank, through DCP.

:func:`export_pretrained` writes the folder that :func:`~hpfunc.models.qwen3.hf.save_pretrained` writes
(``config.json``, safetensors files, ``model.safetensors.index.json``; per-expert keys as published on
the hub, or transformers 5's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` with
``fused_experts=True``) from DTensor parameters on any mesh: each rank writes its own blocks
(:mod:`hpfunc.checkpoint.safetensors_io`), no rank gathers the model. :func:`import_pretrained` reads a
folder into a target layout (an abstract state from :func:`hpfunc.checkpoint.abstract_like`, or
allocated DTensors), each rank only the slices of its blocks, in either expert layout.

The name mapping is :func:`~hpfunc.models.qwen3.hf.hf_name`; a stacked expert leaf ``[E, ...]`` becomes,
for each expert ``e``, the view ``local[e - e0]`` of this rank's block (a piece of the global tensor
``experts.e``), so the experts' ep and fsdp splits need no communication.

>>> import tempfile, torch
>>> from hpfunc import random
>>> from hpfunc.models import preset, qwen3
>>> cfg = preset("qwen3-moe-tiny")
>>> params = qwen3.init(random.key(0), cfg)
>>> d = tempfile.mkdtemp() + "/hf"
>>> export_pretrained(params, cfg, d)
>>> cfg2, back = qwen3.from_pretrained(d)                  # the one-process reader agrees
>>> bool(torch.equal(back["layers"][0]["moe"]["experts"]["w_up"], params["layers"][0]["moe"]["experts"]["w_up"]))
True
>>> again = import_pretrained(d, qwen3.model.param_shapes(cfg), cfg)
>>> bool(torch.equal(again["embed"], params["embed"]))
True
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from hpfunc import tree as _tree
from hpfunc.checkpoint import _ranks
from hpfunc.checkpoint.abstract import Abstract, abstract, empty, is_abstract_leaf
from hpfunc.checkpoint.errors import CheckpointMismatchError
from hpfunc.checkpoint.safetensors_io import (Block, check_names, file_indices, header, load_safetensors, nbytes,
                                              save_safetensors)
from hpfunc.models.config import Qwen3Config
from hpfunc.models.qwen3.hf import CONFIG_NAME, _EXPERT_PROJ, _parse_size, expert_bias_names, hf_name, load_config

__all__ = ["export_pretrained", "import_pretrained", "hf_blocks", "expected_tensors"]


def _expert_parts(path: str) -> tuple[str, str]:
    layer, proj = path.split(".")[1], _EXPERT_PROJ[path.rsplit(".", 1)[-1]]
    return layer, proj


def _is_expert(path: str) -> bool:
    return ".moe.experts." in path


def _fused_name(layer: str, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts." + ("down_proj" if proj == "down_proj" else "gate_up_proj")


def hf_blocks(params: Any, cfg: Qwen3Config, *, fused_experts: bool = False, expert_bias: set[str] = frozenset(),
              for_write: bool = True) -> dict[str, Block]:
    """``{Hugging Face name: Block}``: this rank's pieces of every published tensor, views of ``params``' blocks.

    ``expert_bias``: the paths of the ``moe.expert_bias`` leaves to include (the others are not
    published). ``for_write``: the fused ``gate_up_proj`` of a rank that holds part of dimension 1 is two
    pieces, which a save cannot store; it must then be a single adjacent block.
    """
    out: dict[str, Block] = {}
    fused: dict[str, dict[str, Any]] = {}
    for path, leaf in _tree.leaves_with_paths(params):
        block = Block.of(leaf)
        if _is_expert(path):
            layer, proj = _expert_parts(path)
            E = block.shape[0]
            if fused_experts:
                fused.setdefault(_fused_name(layer, proj), {})[proj] = block
                continue
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(E)]
            experts = {n: Block(block.shape[1:], block.dtype) for n in names}
            for off, local in block.pieces:
                for j in range(local.shape[0]):
                    experts[names[off[0] + j]].pieces.append((tuple(off[1:]), local[j]))
            out.update(experts)
        elif path.endswith("moe.expert_bias"):
            if path in expert_bias:
                out[hf_name(path)] = block
        else:
            out[hf_name(path)] = block
    for name, parts in fused.items():
        if "down_proj" in parts:
            out[name] = parts["down_proj"]
            continue
        gate, up = parts["gate_proj"], parts["up_proj"]
        E, I, H = gate.shape
        b = Block((E, 2 * I, H), gate.dtype)
        for (og, g), (ou, u) in zip(gate.pieces, up.pieces):
            if for_write:
                if og[1] != 0 or g.shape[1] != I:
                    raise CheckpointMismatchError(
                        f"export_pretrained(fused_experts=True): {name!r} is gate_proj and up_proj concatenated on "
                        f"dimension 1, which this rank holds only rows {og[1]}..{og[1] + g.shape[1]} of {I}; the "
                        f"fused layout needs whole rows per rank (shard the experts on dimensions 0 or 2), or "
                        f"export the published per-expert layout (fused_experts=False)")
                b.pieces.append(((og[0], 0, og[2]), torch.cat([g, u], dim=1)))
            else:
                b.pieces += [((og[0], og[1], og[2]), g), ((ou[0], I + ou[1], ou[2]), u)]
        out[name] = b
    return out


def expected_tensors(cfg: Qwen3Config, *, fused_experts: bool = False, expert_bias: bool = False,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of the checkpoint of ``cfg`` (no memory: meta tensors).

    >>> from hpfunc.models import preset
    >>> names = expected_tensors(preset("qwen3-moe-tiny"))
    >>> names["model.layers.1.mlp.experts.7.down_proj.weight"]
    ((64, 32), torch.bfloat16)
    """
    from hpfunc.models.qwen3.model import _is_shape, param_shapes

    meta = _tree.tree_map(lambda s: torch.empty(s, dtype=dtype, device="meta"), param_shapes(cfg), is_leaf=_is_shape)
    bias = {p for p, _ in _tree.leaves_with_paths(meta) if p.endswith("moe.expert_bias")} if expert_bias else set()
    return {k: (b.shape, b.dtype) for k, b in hf_blocks(meta, cfg, fused_experts=fused_experts, expert_bias=bias,
                                                      for_write=False).items()}


def _whole_rows(path: str, x: Any) -> Any:
    """An expert gate/up stack whose dimension 1 is split, resharded so that each rank holds whole rows.

    The fused ``gate_up_proj`` is ``cat(gate, up)`` on dimension 1: a rank's gate and up pieces are
    adjacent (one block, which DCP's safetensors writer needs) only when it holds all of dimension 1.
    The axes of dimension 1 move to dimension 2 when it is free and divides, else the rows are
    replicated; one expert stack at a time, never the model.
    """
    from torch.distributed.tensor import DTensor

    from hpfunc.sharding import P, reshard, sharding_of

    if not (isinstance(x, DTensor) and _is_expert(path) and not path.endswith("w_down")):
        return x
    sh = sharding_of(x)
    parts = list(sh.spec) + [None] * (x.ndim - len(sh.spec))
    if parts[1] is None:
        return x
    axes = (parts[1],) if isinstance(parts[1], str) else tuple(parts[1])
    n = 1
    for a in axes:
        n *= sh.mesh.axis_size(a)
    parts[2] = parts[1] if parts[2] is None and x.shape[2] % n == 0 else parts[2]
    parts[1] = None
    return reshard(x, P(*parts))


def _nonzero_bias(params: Any, group: Any) -> dict[str, float]:
    """``{path: max |bias|}`` of the expert biases that are nonzero on any rank; all ranks agree."""
    local = {}
    for p, x in _tree.leaves_with_paths(params):
        if p.endswith("moe.expert_bias"):
            m = max((float(t.abs().max()) for _, t in Block.of(x).pieces if t.numel()), default=0.0)
            if m > 0:
                local[p] = m
    out: dict[str, float] = {}
    for part in _ranks.all_gather(local, group):
        for p, m in part.items():
            out[p] = max(m, out.get(p, 0.0))
    return out


def export_pretrained(params: Any, cfg: Qwen3Config, path: str | os.PathLike, *, fused_experts: bool = False,
                      max_shard_size: int | str = "5GB", expert_bias: str = "refuse",
                      process_group: Any = None) -> None:
    """Write a Hugging Face folder of ``params`` (DTensors on any mesh, or plain tensors); every rank calls it.

    Atomic (written in ``.NAME.partial``, synced, renamed). Files are cut at ``max_shard_size`` in
    parameter order (all of a layer together); with ``fused_experts`` an expert gate/up stack split on
    its dimension 1 is first resharded to whole rows per rank (one stack at a time).

    ``expert_bias``: as in :func:`~hpfunc.models.qwen3.hf.save_pretrained`: a nonzero expert bias (which
    transformers' Qwen3-MoE drops) makes every rank raise :class:`~hpfunc.models.qwen3.hf.ExpertBiasError`
    before anything is written, unless ``"drop"`` (not written) or ``"keep"`` (written as
    ``mlp.gate.e_score_correction_bias``) is given.
    """
    nonzero = _nonzero_bias(params, process_group)
    keep = expert_bias_names({hf_name(p): m for p, m in nonzero.items()}, expert_bias, where="export_pretrained")
    bias = {p for p in nonzero if hf_name(p) in keep}
    if fused_experts:
        params = _tree.map_with_path(_whole_rows, params)
    blocks = hf_blocks(params, cfg, fused_experts=fused_experts, expert_bias=bias)
    files = file_indices({k: nbytes(b.shape, b.dtype) for k, b in blocks.items()}, _parse_size(max_shard_size))
    config = cfg.to_hf_dict()
    config["torch_dtype"] = str(params["embed"].dtype).removeprefix("torch.")
    extra = {CONFIG_NAME: json.dumps(config, indent=2, sort_keys=True, allow_nan=False).encode()}
    save_safetensors(path, blocks, files=files, extra=extra, process_group=process_group)


_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _expert_hint(found: dict, cfg: Qwen3Config) -> str:
    ids = {int(m.group(2)) for k in found if (m := _EXPERT_KEY.match(k))}
    if ids and len(ids) != cfg.num_experts:
        return (f"the checkpoint has {len(ids)} experts per MoE layer (ids {min(ids)}..{max(ids)}), the config "
                f"num_experts={cfg.num_experts}: build the target from the checkpoint's config.json")
    return "build the target from the checkpoint's config.json (hpfunc.models.qwen3.hf.load_config)"


def import_pretrained(path: str | os.PathLike, target: Any, cfg: Qwen3Config | None = None, *,
                      process_group: Any = None) -> Any:
    """Read the Hugging Face folder ``path`` into the layout of ``target``; every rank calls it.

    ``target``: the parameter tree as :class:`~hpfunc.checkpoint.Abstract` leaves (with shardings:
    ``checkpoint.abstract_like(specs, mesh, shapes)``), ``torch.Size`` leaves (plain fp32 tensors), or
    tensors / DTensors whose layout and dtype are used (values are not). Each rank allocates and reads
    only its blocks. Either expert layout is read; a missing expert bias is zeros. Every tensor is
    accounted for: a missing or unexpected tensor, an expert count or a shape that differs is a
    :class:`~hpfunc.checkpoint.CheckpointMismatchError` naming the tensors, before anything is read.
    """
    cfg = load_config(path) if cfg is None else cfg
    found = header(path)
    abstract_target = _tree.tree_map(lambda x: Abstract(tuple(x), torch.float32) if isinstance(x, torch.Size)
                                     else abstract(x) if isinstance(x, torch.Tensor) else x,
                                     target, is_leaf=is_abstract_leaf)
    state = _tree.tree_map(empty, abstract_target, is_leaf=lambda x: isinstance(x, Abstract))
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in found)
    bias_paths = {p for p, _ in _tree.leaves_with_paths(state) if p.endswith("moe.expert_bias")}
    with_bias = {p for p in bias_paths if hf_name(p) in found}
    blocks = hf_blocks(state, cfg, fused_experts=fused, expert_bias=with_bias, for_write=False)
    tied_copy = None
    if cfg.tie_word_embeddings and "lm_head.weight" in found:
        # a tied checkpoint that stores lm_head too: it must equal the embedding (read into a scratch block)
        emb = blocks["model.embed_tokens.weight"]
        tied_copy = Block(emb.shape, emb.dtype, [(off, torch.empty_like(t)) for off, t in emb.pieces])
        blocks["lm_head.weight"] = tied_copy
    check_names(path, found, {k: b.shape for k, b in blocks.items()}, hint=_expert_hint(found, cfg))
    load_safetensors(path, blocks, process_group=process_group)
    for p in bias_paths - with_bias:
        for _, t in Block.of(_tree_get(state, p)).pieces:
            t.zero_()
    if tied_copy is not None:
        same = all(torch.equal(a, b) for (_, a), (_, b) in zip(tied_copy.pieces, blocks["model.embed_tokens.weight"].pieces))
        if not all(_ranks.all_gather(same, process_group)):
            raise CheckpointMismatchError(f"{os.fspath(path)!r}: tie_word_embeddings is true but 'lm_head.weight' "
                                          f"differs from 'model.embed_tokens.weight'")
    return state


def _tree_get(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree
