"""Run in the ranks of the compile tests (tests/train/test_compile.py): a parallelized step of the tiny dense
Qwen3 with its layers in compiled regions, beside the same step eager, on the same batches."""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.utils import counters

from hpfunc.train.callbacks import Callback

LR = 1e-2


class GraphCount(Callback):
    """Records, after every step, how many graphs dynamo has compiled in this process (its own counter,
    ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``), from the count at the start of the run."""

    every_rank = True

    def __init__(self) -> None:
        self.start = counters["stats"]["unique_graphs"]
        self.after_step: list[int] = []

    def on_step_end(self, trainer: Any, step: int, metrics: Any) -> None:
        self.after_step.append(counters["stats"]["unique_graphs"] - self.start)


def _plan(name: str, cfg: Any) -> tuple[Any, Any]:
    import hpfunc
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.transforms import plans

    if name == "fsdp":
        return hpfunc.Mesh({"fsdp": 2}), plans.fsdp("fsdp")
    if name == "fsdp_tp":
        return hpfunc.Mesh({"fsdp": 2, "tp": 2}), plans.fsdp("fsdp") + plans.tp("tp", parallel_plan.tp_styles(cfg))
    raise ValueError(name)


def compiled_vs_eager(name: str, steps: int, backend: str = "aot_eager", seq_of_step: Any = None,
                      via: str = "step") -> dict:
    """``steps`` AdamW steps of the eager and of the compiled step, interleaved, from the same parameters on
    the same global batches; per step: both losses, the bytes each sent (``hpfunc.comm_stats``), the
    regions' compilation counts and dynamo's graph counter. ``seq_of_step(i)``: the sequence length of
    step ``i`` (default 8 every step). ``via``: ``"step"`` compiles the front door's step
    (``parallel_train_step(..., compile=backend)``), ``"lowered"`` runs ``train_step.lower(state).compile(backend)``."""
    import functools

    import hpfunc
    from hpfunc import optim
    from hpfunc.models import qwen3
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.testing import to_full
    from hpfunc.transforms.parallelize import init_sharded, parallel_train_step

    cfg = qwen3.preset("qwen3-dense-tiny")
    mesh, plan = _plan(name, cfg)
    def loss(p, b):
        return parallel_plan.loss(p, b, cfg)[0]

    eager = parallel_train_step(loss, optim.adamw(LR), mesh, plan)
    compiled = parallel_train_step(loss, optim.adamw(LR), mesh, plan, compile=backend if via == "step" else False)
    init = functools.partial(qwen3.init, cfg=cfg)
    pe = init_sharded(init, mesh, plan, hpfunc.random.key(0), shapes=qwen3.param_shapes(cfg))
    pc = init_sharded(init, mesh, plan, hpfunc.random.key(0), shapes=qwen3.param_shapes(cfg))
    oe, oc = eager.init_opt_state(pe), compiled.init_opt_state(pc)
    if via == "step":
        regions = compiled.train_step.regions
    else:  # the program of this state's structure, compiled
        program = compiled.train_step.lower({"params": pc, "opt": oc}).compile(backend)
        regions = program.regions

        def compiled(p, o, b):
            state, metrics = program({"params": p, "opt": o}, b)
            return state["params"], state["opt"], metrics
    g = torch.Generator().manual_seed(0)
    out: dict[str, list] = {"eager": [], "compiled": [], "bytes_eager": [], "bytes_compiled": [], "regions": [],
                            "graphs": []}
    start = counters["stats"]["unique_graphs"]
    for i in range(steps):
        seq = 8 if seq_of_step is None else seq_of_step(i)
        b = {"tokens": torch.randint(0, cfg.vocab_size, (4, seq), generator=g)}
        with hpfunc.comm_stats() as se:
            pe, oe, me = eager(pe, oe, b)
        with hpfunc.comm_stats() as sc:
            pc, oc, mc = compiled(pc, oc, b)
        out["eager"].append(float(to_full(me["loss"])))
        out["compiled"].append(float(to_full(mc["loss"])))
        out["bytes_eager"].append(sorted((r.op, r.phase, r.sent_bytes) for r in se.records))
        out["bytes_compiled"].append(sorted((r.op, r.phase, r.sent_bytes) for r in sc.records))
        out["regions"].append(regions.compilations)
        out["graphs"].append(counters["stats"]["unique_graphs"] - start)
    full_e, full_c = to_full(pe), to_full(pc)
    out["param_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                            for a, b in zip(hpfunc.tree.leaves(full_c), hpfunc.tree.leaves(full_e)))
    return out
