"""Auto-parallel planning: a cost model of memory, communication, FLOPs and step time per rank, the
search over parallel layouts (``hpfunc plan``), pipeline stage balancing and the automatic
recompute/swap policy. See docs/autoparallel.md; every figure here is an estimate from a model.

* :mod:`~hpfunc.autoparallel.hardware`: hardware presets (``h100``, ``h200``, ``a100``, ``cpu``);
* :mod:`~hpfunc.autoparallel.configuration`: :class:`Layout` and :class:`Workload`;
* :mod:`~hpfunc.autoparallel.flops`, :mod:`~hpfunc.autoparallel.memory_model`,
  :mod:`~hpfunc.autoparallel.comm_model`, :mod:`~hpfunc.autoparallel.step_time`,
  :mod:`~hpfunc.autoparallel.pipeline_time`: the terms of the cost model;
* :mod:`~hpfunc.autoparallel.search` (SAPP-ND), :mod:`~hpfunc.autoparallel.stage_balance` (SAPP-PPB),
  :mod:`~hpfunc.autoparallel.recompute_policy`;
* :mod:`~hpfunc.autoparallel.trainer_config`, :mod:`~hpfunc.autoparallel.plan_cli`: the trainer's YAML
  and the ``hpfunc plan`` command.

    >>> from hpfunc.autoparallel import Layout, Workload, search
    >>> from hpfunc.models.qwen3 import preset
    >>> from hpfunc.models.qwen3.describe import describe
    >>> best = search(describe(preset("qwen3-30b-a3b")), 8, Workload(global_batch=64, seq_len=4096), "h100").best
    >>> best.memory.total <= 79.2 * 2**30
    True
"""

from hpfunc.autoparallel.configuration import Layout, LayoutError, Workload
from hpfunc.autoparallel.hardware import HARDWARE, Hardware, hardware, parse_bytes
from hpfunc.autoparallel.memory_model import memory
from hpfunc.autoparallel.search import PlanError, evaluate, search
from hpfunc.autoparallel.step_time import step_time

__all__ = ["Layout", "LayoutError", "Workload", "Hardware", "HARDWARE", "hardware", "parse_bytes", "memory",
           "step_time", "search", "evaluate", "PlanError"]
