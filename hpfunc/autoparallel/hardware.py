"""Hardware descriptions for the cost model: peak FLOP/s by dtype, memory, bandwidths, efficiencies.

The presets are datasheet figures (dense, no sparsity) plus the efficiencies the cost model applies
to them, which are assumptions, not measurements: ``matmul_efficiency`` (the fraction of the peak a
large GEMM reaches), ``attention_efficiency`` (fused attention), ``moe_efficiency`` (grouped expert
GEMMs of a few hundred rows per expert), ``link_efficiency`` (the fraction of a link's bandwidth a
ring collective reaches). ``hbm_bytes`` is what the device offers to the framework (an "80 GB" H100
reports 79.2 GiB to torch).

    >>> h = hardware("h100")
    >>> h.peak_flops("bfloat16") / 1e12, h.ranks_per_node
    (989.0, 8)
    >>> parse_bytes("80GiB") == 80 * 2**30, parse_bytes("80GB") == 80 * 10**9
    (True, True)
"""

from __future__ import annotations

import difflib
import re
from typing import Mapping

import attrs

__all__ = ["Hardware", "HARDWARE", "hardware", "parse_bytes", "HardwareError", "format_bytes", "to_json",
           "load_profile"]


class HardwareError(ValueError):
    """An unknown hardware name or a memory size that cannot be read."""


@attrs.frozen(kw_only=True)
class Hardware:
    """One accelerator type and the links between them.

    Bandwidths are bytes per second one device sends (unidirectional): ``intra_node_bw`` between
    devices of a node (NVLink), ``inter_node_bw`` per device to other nodes (its NIC share),
    ``host_bw`` between the device and host memory (activation swap), ``hbm_bw`` to its own memory.
    ``latency_s`` is paid once per collective. ``op_overhead_s`` is the host's time per operator it
    dispatches: on a CPU it adds to the compute (``host_overlap=False``, the same thread runs both); on
    a GPU the host queues kernels ahead of the device and only the larger of the two counts (the GPU
    presets leave it at 0: at the sizes they plan, a layer's kernels take far longer than their launch).
    """

    name: str
    flops: Mapping[str, float]  # dtype name -> dense peak FLOP/s
    hbm_bytes: int
    hbm_bw: float
    intra_node_bw: float
    inter_node_bw: float
    host_bw: float
    ranks_per_node: int
    latency_s: float = 10e-6
    matmul_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    moe_efficiency: float = 0.45
    link_efficiency: float = 0.8
    async_copy: bool = True  # device-host copies overlap compute (a copy stream); False: they add to the step
    op_overhead_s: float = 0.0  # host seconds per dispatched operator (framework, autograd, launch)
    host_overlap: bool = True  # the device runs while the host dispatches (a GPU); False: they add (a CPU)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (``bfloat16``, ``float16``, ``float32``, ``float8``)."""
        try:
            return float(self.flops[dtype])
        except KeyError:
            raise HardwareError(f"hardware {self.name!r}: no peak FLOP/s for dtype {dtype!r}; known: "
                                f"{', '.join(self.flops)}") from None


_T = 1e12
HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 SXM 80 GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 450 GB/s per direction,
    # 400 Gb/s InfiniBand per GPU, PCIe 5 x16 ~ 55 GB/s to the host.
    "h100": Hardware(name="h100", flops={"bfloat16": 989 * _T, "float16": 989 * _T, "float32": 67 * _T,
                                         "tf32": 495 * _T, "float8": 1979 * _T},
                     hbm_bytes=int(79.2 * 2**30), hbm_bw=3.35e12, intra_node_bw=450e9, inter_node_bw=50e9,
                     host_bw=55e9, ranks_per_node=8),
    # NVIDIA H200 SXM 141 GB: the H100's compute with 4.8 TB/s HBM3e.
    "h200": Hardware(name="h200", flops={"bfloat16": 989 * _T, "float16": 989 * _T, "float32": 67 * _T,
                                         "tf32": 495 * _T, "float8": 1979 * _T},
                     hbm_bytes=int(139.8 * 2**30), hbm_bw=4.8e12, intra_node_bw=450e9, inter_node_bw=50e9,
                     host_bw=55e9, ranks_per_node=8),
    # NVIDIA A100 SXM 80 GB: 312 TFLOP/s bf16, 2.04 TB/s, NVLink 3 300 GB/s per direction, 200 Gb/s IB.
    "a100": Hardware(name="a100", flops={"bfloat16": 312 * _T, "float16": 312 * _T, "float32": 19.5 * _T,
                                         "tf32": 156 * _T},
                     hbm_bytes=int(79.2 * 2**30), hbm_bw=2.04e12, intra_node_bw=300e9, inter_node_bw=25e9,
                     host_bw=25e9, ranks_per_node=8),
    # This project's CPU machine, nominal (not measured: `hpfunc dryrun --calibrate` is to replace it):
    # one process per rank over gloo on loopback.
    "cpu": Hardware(name="cpu", flops={"float32": 50e9, "bfloat16": 10e9, "float64": 25e9},
                    hbm_bytes=8 * 2**30, hbm_bw=10e9, intra_node_bw=2e9, inter_node_bw=1e9, host_bw=10e9,
                    ranks_per_node=2, latency_s=200e-6, matmul_efficiency=0.5, attention_efficiency=0.3,
                    moe_efficiency=0.3, link_efficiency=0.5, async_copy=False, op_overhead_s=20e-6,
                    host_overlap=False),
}


def to_json(hw: Hardware) -> dict:
    """``hw`` as plain data (what ``hpfunc dryrun --calibrate`` writes and :func:`hardware` reads back)."""
    d = attrs.asdict(hw)
    d["flops"] = dict(hw.flops)
    return d


def load_profile(path: str) -> Hardware:
    """The hardware profile in the JSON file ``path`` (the keys of :class:`Hardware`)."""
    import json
    import pathlib

    try:
        data = json.loads(pathlib.Path(path).read_text())
        return Hardware(**data)
    except (OSError, ValueError, TypeError) as err:
        raise HardwareError(f"--hardware: {path!r} is not a hardware profile (a JSON object with the fields of "
                            f"hpfunc.autoparallel.hardware.Hardware, as `hpfunc dryrun --calibrate` writes): {err}"
                            ) from None


def hardware(name: str | Hardware) -> Hardware:
    """The preset called ``name`` (``h100``, ``h200``, ``a100``, ``cpu``); a :class:`Hardware` as is.

    >>> try:
    ...     hardware("h800")
    ... except HardwareError as e:
    ...     print(e)
    --hardware: unknown hardware 'h800'; did you mean 'h200'? known: h100, h200, a100, cpu, or a profile PATH.json
    """
    if isinstance(name, Hardware):
        return name
    if name in HARDWARE:
        return HARDWARE[name]
    if str(name).endswith(".json"):  # a measured profile (hpfunc dryrun --calibrate)
        return load_profile(str(name))
    close = difflib.get_close_matches(str(name), list(HARDWARE), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise HardwareError(f"--hardware: unknown hardware {name!r}; {hint}known: {', '.join(HARDWARE)}, or a profile "
                        f"PATH.json")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float, *, key: str = "--memory", allow_zero: bool = False) -> int:
    """``"80GiB"`` (binary), ``"80GB"`` (decimal), ``"1.5e9"`` or a number of bytes."""
    what = "a size >= 0" if allow_zero else "a positive size"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        if value < 0 or (value == 0 and not allow_zero):
            raise HardwareError(f"{key}: expected {what}, found {text!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or (float(m.group(1)) == 0 and not allow_zero):
        raise HardwareError(f"{key}: expected {what} such as 80GiB, 80GB or 85e9 (bytes), found {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB (or MiB below 1 GiB), for tables.

    >>> format_bytes(3 * 2**30), format_bytes(5 * 2**20)
    ('3.00 GiB', '5.0 MiB')
    """
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"
