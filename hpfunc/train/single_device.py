"""The single-process trainer (no mesh) on ``parallel.device``: its first state and its step.

Without a mesh of several processes the trainer runs one pure step in this process, on the device
``parallel.device`` resolves to (:func:`hpfunc.train.device.resolve_device`: ``cuda`` when asked for or,
with ``auto``, when torch sees one; ``cpu`` otherwise). :func:`build_single_step` makes

* the parameters from the run's init key placed on that device (so the model's ``init`` creates them
  there), or a Hugging Face folder's weights read on the host and copied once;
* the optimizer state and the step counter on the same device (every leaf of the first state:
  :func:`hpfunc.host_to_device.put`), so that a step reads nothing from the host;
* the step itself (:func:`hpfunc.train.step.make_train_step`), which then makes every tensor on that device.

The loop feeds it the same way as a mesh's step (:class:`hpfunc.train.batch_feed.BatchFeed`, the scalars
held in :class:`hpfunc.train.readout.StepReadout` until a logging step on a device: docs/gpu.md). On the
CPU nothing moves: the state is what the model's ``init`` made.

    >>> from hpfunc import random
    >>> from hpfunc.train.build import build_optimizer, build_schedule, check_buildable
    >>> from hpfunc.train.config import load_config_dict
    >>> from hpfunc.train.model_spec import model_spec
    >>> cfg = load_config_dict({"model": {"num_hidden_layers": 1}, "train": {"steps": 2, "batch_size": 1,
    ...                         "seq_len": 8}})
    >>> spec, model_cfg = model_spec(cfg.model), check_buildable(cfg)
    >>> optimizer, lr = build_optimizer(cfg.optimizer, build_schedule(cfg.schedule, 2), spec)
    >>> state, step = build_single_step(cfg, model_cfg, spec, optimizer, lr, random.key(0), "cpu")
    >>> state, metrics = step(state, {"tokens": random.randint(random.key(1), (1, 9), 0, 256)})
    >>> int(state.step), metrics["loss"].device.type
    (1, 'cpu')
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hpfunc.host_to_device import put
from hpfunc.train.config import Config

__all__ = ["build_single_step"]


def build_single_step(cfg: Config, model_cfg: Any, spec: Any, optimizer: Any, lr: Callable[[int], float],
                      init_key: torch.Tensor, device: torch.device | str, *,
                      monitor: Any = None) -> tuple[Any, Callable]:
    """``(state, train_step)`` of the single-process trainer on ``device`` (see the module).

    Args:
      cfg, model_cfg, spec: the run's config, model config and :class:`~hpfunc.models.spec.ModelSpec`.
      optimizer, lr: from :func:`hpfunc.train.build.build_optimizer`.
      init_key: the parameters' key (``hpfunc.train.loop.data_keys``; a host key is copied to ``device``).
      device: where the state lives and the step runs (``"cpu"``, ``"cuda"``, ``cuda:0``).
      monitor: the precision monitor's probe (``make_train_step``'s), or ``None``.
    """
    from hpfunc.train.build import model_dtype
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.train.step_transforms import train_loss

    device = torch.device(device)
    dtype = model_dtype(cfg.model)
    if cfg.model.pretrained is not None:  # the Hugging Face folder's weights, checked against the config
        params = spec.hf.load_params(cfg.model.pretrained, model_cfg, dtype=dtype)
    else:
        params = spec.init(put(init_key, device), model_cfg, dtype=dtype)
    # every leaf on the device, the optimizer's counters and the step count included: a leaf left on the
    # host would be read there (a host sync) or copied to the device every step
    state = put(init_train_state(params, optimizer), device)
    tc = cfg.train
    step = make_train_step(model_cfg, optimizer, expert_bias_rate=tc.expert_bias_rate, lr_schedule=lr,
                           num_microbatches=tc.microbatches, loss_fn=train_loss(cfg, spec, on_mesh=False),
                           monitor=monitor)
    return state, step
