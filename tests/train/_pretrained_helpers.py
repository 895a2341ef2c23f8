"""Rank side of the ``model.pretrained`` / ``parallel.sdc_check`` trainer test."""

from __future__ import annotations


def build_from_config(data: dict) -> dict:
    """``build_parallel_step`` of a config dict on this pool: the gathered first parameters and the plan."""
    import hpfunc
    from hpfunc.train.build import build_model_config, build_optimizer, build_schedule, check_buildable, model_dtype
    from hpfunc.train.config import load_config_dict
    from hpfunc.testing import to_full
    from hpfunc.train.distributed import build_parallel_step

    cfg = load_config_dict(data)
    model_cfg = check_buildable(cfg)
    optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, cfg.train.steps))
    mesh = hpfunc.Mesh(cfg.parallel.mesh)
    state, train_step = build_parallel_step(cfg, model_cfg, optimizer, lr, hpfunc.random.key(0), mesh,
                                            model_dtype(cfg.model))
    return {"params": to_full(state.params), "layouts": hpfunc.typeof(state.params),
            "sdc": train_step.plan.sdc_check, "model": build_model_config(cfg.model)}
