"""Pipeline schedules as data.

A schedule is ``{rank: [Action]}`` plus a stage placement (:mod:`.ir`). Generators produce
compute-only schedules (:mod:`.generators`); passes lower them (:mod:`.passes`); :func:`validate`
proves them runnable (:mod:`.validate`); :func:`simulate` measures them (:mod:`.simulate`);
:func:`read_csv` / :func:`write_csv` exchange them with ``torch.distributed.pipelining``
(:mod:`.csv_io`); :func:`balance_layers` sizes the stages (:mod:`.balance`).

Example:
    >>> from hpfunc.schedules import zbv, insert_comms, validate, simulate
    >>> s = validate(insert_comms(zbv(4, 8)))
    >>> r = simulate(s)
    >>> r.steady_bubble_ratio[0], r.peak_inflight_mb[0]
    (0.0, 4.0)
"""

from .balance import balance_layers, recompute_under_limit, stage_bounds, stage_costs
from .csv_io import (
    action_from_torch_str,
    action_to_torch_str,
    from_torch_pipeline_order,
    read_csv,
    to_torch_pipeline_order,
    write_csv,
)
from .generators import GENERATORS, dualpipev, gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_h2, zbv
from .ir import Action, ActionKind, Schedule, loop_placement, v_placement
from .passes import insert_comms, insert_fsdp, insert_swaps, merge_backward, split_backward
from .simulate import Event, SimResult, cost_function, simulate
from .validate import ScheduleError, dependencies, execution_order, expected_peer, validate

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "loop_placement",
    "v_placement",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_h2",
    "zbv",
    "dualpipev",
    "GENERATORS",
    "insert_comms",
    "split_backward",
    "merge_backward",
    "insert_fsdp",
    "insert_swaps",
    "ScheduleError",
    "validate",
    "dependencies",
    "execution_order",
    "expected_peer",
    "simulate",
    "cost_function",
    "SimResult",
    "Event",
    "read_csv",
    "write_csv",
    "action_to_torch_str",
    "action_from_torch_str",
    "to_torch_pipeline_order",
    "from_torch_pipeline_order",
    "balance_layers",
    "recompute_under_limit",
    "stage_costs",
    "stage_bounds",
]
