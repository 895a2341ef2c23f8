"""The ``parallel:`` grammar: a mesh of named axes and a plan of entries, each bound to its mesh axes.

Syntax only: :mod:`hpfunc.train.distributed` checks the plan against the model and builds the
:class:`hpfunc.transforms.plans.Plan`. Entries without ``axis:`` take the mesh axes that no entry names,
in mesh order (``hsdp`` takes two)::

    parallel:
      mesh: {fsdp: 2, tp: 2}
      plan: [fsdp, {tp: {vocab_parallel: true}}]

    >>> pc = parse_parallel({"mesh": {"dp": 2, "fsdp": 2}, "plan": ["hsdp"]}, "parallel")
    >>> pc.plan[0].axes, pc.data_axes
    (('dp', 'fsdp'), ('dp', 'fsdp'))
    >>> parse_parallel({"mesh": {"fsdp": 2}, "plan": ["fsdq"]}, "parallel")
    Traceback (most recent call last):
    ...
    hpfunc.train.config.ConfigError: parallel.plan[0]: unknown plan 'fsdq'; did you mean 'fsdp'? expected one of ...
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

from hpfunc.faults import DEFAULT_TIMEOUT_S
from hpfunc.train.config.errors import ConfigError, flow, found
from hpfunc.train.config.schema import (
    OPEN_SECTIONS, OPTION_TYPES, PLAN_KINDS, Config, ParallelConfig, PlanEntry,
)
from hpfunc.train.config.structure import Structurer
from hpfunc.transforms.state_offload import KINDS as OFFLOAD_STATE  # parallel.offload_state: the plan's own list

__all__ = ["parse_parallel", "SDC_CHECKS", "DEVICES"]

# converts the plan entries' option values (and suggests keys from the whole schema); no grammar hooks
_PLAIN = Structurer(Config, open_fields=OPEN_SECTIONS)

SDC_CHECKS = ("off", "raise", "warn")
DEVICES = ("auto", "cpu", "cuda")  # parallel.device; resolved on the machine by hpfunc.train.device
_PARALLEL_KEYS = ("mesh", "plan", "timeout_s", "sdc_check", "max_restarts", "device", "offload_state")


def parse_parallel(data: Any, path: str) -> ParallelConfig:
    """``{mesh: {axis: size}, plan: [entry, ...]}`` -> :class:`ParallelConfig` with every axis bound.

    Entries without ``axis:`` take the mesh axes that no entry names explicitly, in mesh order
    (``hsdp`` takes two). A mesh axis of size > 1 left without an entry is an error.
    """
    if data is None:
        return ParallelConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping with mesh and plan, found {found(data)}")
    for key in data:
        if key not in _PARALLEL_KEYS:
            raise ConfigError(_PLAIN.unknown_key_message(path, key, list(_PARALLEL_KEYS)))
    device = data.get("device", "auto")
    if device not in DEVICES:
        close = difflib.get_close_matches(str(device), DEVICES, n=1)
        raise ConfigError(f"{path}.device: expected one of {', '.join(DEVICES)} (auto: cuda when available), found "
                          f"{found(device)}{f'; did you mean {close[0]!r}?' if close else ''}")
    offload_state, offload_layers = _parse_offload_state(data.get("offload_state"), f"{path}.offload_state")
    timeout_s = _parse_timeout(data.get("timeout_s", DEFAULT_TIMEOUT_S), f"{path}.timeout_s")
    sdc_check = data.get("sdc_check", "off")
    if sdc_check is False:  # YAML reads a bare off as false
        sdc_check = "off"
    if sdc_check not in SDC_CHECKS:
        raise ConfigError(f"{path}.sdc_check: expected one of {', '.join(SDC_CHECKS)} (compare the replicas of "
                          f"every reduced gradient each step; raise or warn on a mismatch), found {found(sdc_check)}")
    max_restarts = data.get("max_restarts", 0)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"{path}.max_restarts: expected an integer >= 0 (how many times the group of ranks is "
                          f"restarted after a rank fails; 0: never), found {found(max_restarts)}")
    mesh = _parse_mesh(data.get("mesh"), f"{path}.mesh")
    raw_plan = data.get("plan")
    if raw_plan is None:
        raw_plan = []
    elif isinstance(raw_plan, (str, Mapping)):
        raw_plan = [raw_plan]
    elif not isinstance(raw_plan, (list, tuple)):
        raise ConfigError(f"{path}.plan: expected a list of plan entries (e.g. [fsdp, tp]), found {found(raw_plan)}")
    parsed = [_parse_plan_entry(e, f"{path}.plan[{i}]") for i, e in enumerate(raw_plan)]
    size = 1
    for s in mesh.values():
        size *= s
    if parsed and not mesh:
        raise ConfigError(f"{path}.mesh: {path}.plan needs a mesh of named axes, e.g. mesh: {{fsdp: 2, tp: 2}}")
    if size > 1 and not parsed:
        example = ", ".join(a if a in PLAN_KINDS else "ddp" for a, s in mesh.items())
        raise ConfigError(f"{path}.plan: missing; the mesh {flow(mesh)} ({size} processes) needs a plan with one "
                          f"entry per mesh axis, in mesh order, e.g. plan: [{example}]")
    return ParallelConfig(mesh=mesh, plan=_bind_axes(parsed, mesh, path), timeout_s=timeout_s, sdc_check=sdc_check,
                          max_restarts=max_restarts, device=device, offload_state=tuple(offload_state),
                          offload_layers=offload_layers)


def _parse_offload_state(value: Any, path: str) -> tuple[tuple[str, ...], str | None]:
    r"""``parallel.offload_state``: a kind, or a list of kinds, of state kept in host memory between steps;
    ``params`` alone (every parameter) or as ``{params: PATTERN}`` (the parameters whose dotted path the
    regular expression matches at its start, e.g. ``{params: 'layers\.[0-3]\.'}``). Returns the kinds and
    the pattern (``None``: all)."""
    items = value or ()
    items = (items,) if isinstance(items, (str, Mapping)) else items
    expected = (f"expected {' or '.join(OFFLOAD_STATE)} (or a list of them: the state kept in host memory between "
                f"steps; params of chosen layers as {{params: PATTERN}}, a regular expression matched at the start "
                f"of the dotted parameter path)")
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{path}: {expected}, found {found(value)}")
    kinds: list[str] = []
    layers = None
    for k, item in enumerate(items):
        where = f"{path}[{k}]" if isinstance(value, (list, tuple)) else path
        if isinstance(item, Mapping):
            if list(item) != ["params"] or not isinstance(item["params"], str):
                raise ConfigError(f"{where}: {expected}, found {found(item)}")
            layers = item["params"]
            try:
                re.compile(layers)
            except re.error as e:
                raise ConfigError(f"{where}.params: {layers!r} is not a regular expression ({e}); write the start of "
                                  f"the parameter paths to offload, e.g. 'layers\\.[0-3]\\.'") from None
            item = "params"
        if item not in OFFLOAD_STATE:
            raise ConfigError(f"{where}: {expected}, found {found(item)}")
        kinds.append(item)
    return tuple(dict.fromkeys(kinds)), layers


def _parse_timeout(value: Any, path: str) -> float:
    """``parallel.timeout_s``: seconds (> 0) a collective may wait for its peers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{path}: expected a number of seconds > 0 that a collective may wait for the other "
                          f"ranks (default {DEFAULT_TIMEOUT_S:g}), found {found(value)}")
    return float(value)


def flow(mesh: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{a}: {s}" for a, s in mesh.items()) + "}"


def _parse_mesh(data: Any, path: str) -> dict[str, int]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of axis name to size (e.g. {{fsdp: 2, tp: 2}}), "
                          f"found {found(data)}")
    mesh = {}
    for axis, size in data.items():
        if not isinstance(axis, str) or not axis:
            raise ConfigError(f"{path}: axis names must be non-empty strings, found {found(axis)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{path}.{axis}: expected an integer axis size >= 1, found {found(size)}")
        mesh[axis] = size
    return mesh


def _parse_plan_entry(entry: Any, path: str) -> tuple[str, tuple[str, ...] | None, dict[str, Any], str]:
    """``(kind, explicit axes or None, options with defaults, path of the entry's options)``."""
    if isinstance(entry, str):
        kind, opts = entry, {}
    elif isinstance(entry, Mapping) and len(entry) == 1:
        ((kind, opts),) = entry.items()
        if opts is None:
            opts = {}
        if not isinstance(kind, str):
            raise ConfigError(f"{path}: expected a plan name, found {found(kind)}")
    else:
        raise ConfigError(f"{path}: expected a plan name (fsdp) or one name with its options "
                          f"({{tp: {{vocab_parallel: true}}}}), found {found(entry)}")
    if kind not in PLAN_KINDS:
        close = difflib.get_close_matches(kind, list(PLAN_KINDS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{path}: unknown plan {kind!r}; {hint}expected one of {', '.join(PLAN_KINDS)}")
    if not isinstance(opts, Mapping):
        raise ConfigError(f"{path}.{kind}: expected a mapping of options (e.g. {{{kind}: {{axis: {kind}}}}}), "
                          f"found {found(opts)}")
    n_axes, defaults = PLAN_KINDS[kind]
    where = f"{path}.{kind}"
    axis_key = "axes" if n_axes > 1 else "axis"
    allowed = [axis_key, *defaults]
    options = dict(defaults)
    axes = None
    for key, value in opts.items():
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}.{key}: unknown option of {kind}; {hint}expected one of {', '.join(allowed)}")
        if key == "axis":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}.axis: expected a mesh axis name, found {found(value)}")
            axes = (value,)
        elif key == "axes":
            if (not isinstance(value, (list, tuple)) or len(value) != n_axes
                    or not all(isinstance(a, str) and a for a in value)):
                raise ConfigError(f"{where}.axes: expected {n_axes} mesh axis names (replicate, shard), "
                                  f"found {found(value)}")
            axes = tuple(value)
        else:
            options[key] = _PLAIN.convert(value, OPTION_TYPES.get((kind, key), type(defaults[key])), f"{where}.{key}")
    return kind, axes, options, where


def _bind_axes(parsed: list, mesh: Mapping[str, int], path: str) -> tuple[PlanEntry, ...]:
    owner: dict[str, str] = {}

    def claim(a: str, key: str, entry: str) -> None:
        """``a`` taken by ``entry``: an axis of the mesh that no other entry took."""
        if a not in mesh:
            close = difflib.get_close_matches(a, list(mesh), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}: {a!r} is not an axis of {path}.mesh {flow(mesh)}{hint}")
        if a in owner:
            raise ConfigError(f"{key}: mesh axis {a!r} is already used by {owner[a]}")
        owner[a] = entry

    for i, (kind, axes, options, where) in enumerate(parsed):
        entry = f"{path}.plan[{i}] ({kind})"
        extra = options.get("ulysses_axis") if kind == "cp" else None  # hybrid cp takes a second axis
        if extra is not None:
            claim(extra, f"{where}.ulysses_axis", entry)
        for a in axes or ():
            claim(a, f"{where}.{'axes' if len(axes) > 1 else 'axis'}", entry)
    free = [a for a in mesh if a not in owner]
    entries = []
    for i, (kind, axes, options, where) in enumerate(parsed):
        if axes is None:
            n = PLAN_KINDS[kind][0]
            if len(free) < n:
                raise ConfigError(
                    f"{path}.plan[{i}]: no mesh axis left for {kind!r} (it takes {n}); entries take the axes of "
                    f"{path}.mesh {flow(mesh)} in order, one each (hsdp two); add an axis or name one with axis:"
                )
            axes, free = tuple(free[:n]), free[n:]
            for a in axes:
                owner[a] = f"{path}.plan[{i}] ({kind})"
        entries.append(PlanEntry(kind, axes, options))
    for a in free:
        if mesh[a] > 1:
            raise ConfigError(f"{path}.mesh.{a}: the axis has size {mesh[a]} but no entry of {path}.plan runs "
                              f"over it; add one (one entry per mesh axis, in mesh order) or set its size to 1")
    for kind, what in (("tp", "tensor"), ("ep", "expert"), ("cp", "context")):
        found = [i for i, e in enumerate(entries) if e.kind == kind]
        if len(found) > 1:
            raise ConfigError(f"{path}.plan[{found[1]}]: a second {kind} entry; {what} parallelism runs over one "
                              f"mesh axis")
    return tuple(entries)
