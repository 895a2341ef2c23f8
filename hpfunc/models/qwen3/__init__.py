"""Qwen3 (dense and MoE): the pure model, its Hugging Face checkpoints and, beside it, its parallel plan.

* :mod:`~hpfunc.models.qwen3.model`: ``init``, ``apply``, ``loss`` and the parameter layout (re-exported
  here: ``qwen3.init(key, cfg)``);
* :mod:`~hpfunc.models.qwen3.hf`: ``from_pretrained`` / ``save_pretrained`` (re-exported here);
* :mod:`~hpfunc.models.qwen3.parallel_plan`: what Qwen3 knows about being distributed: its
  tensor-parallel styles (attention split by whole heads), its pipeline stages and the optimizer
  routing of its parameters (the model itself reads the layout a step binds through
  :mod:`hpfunc.layout`: :mod:`~hpfunc.models.qwen3.layout_ops`).

>>> from hpfunc import random
>>> from hpfunc.models import qwen3
>>> cfg = qwen3.preset("qwen3-dense-tiny")
>>> sorted(qwen3.init(random.key(0), cfg))
['embed', 'final_norm', 'layers']
"""

from hpfunc.models.qwen3 import hf, model, parallel_plan
from hpfunc.models.qwen3.hf import from_pretrained, save_pretrained
from hpfunc.models.qwen3.model import (IGNORE_INDEX, ConfigError, Qwen3Config, RopeScaling, active_params, apply,
                                       check_tokens, count_params, init, is_expert_bias, loss, param_shapes, preset,
                                       shift_labels, update_expert_bias)

__all__ = ["Qwen3Config", "RopeScaling", "ConfigError", "preset", "param_shapes", "init", "apply", "loss",
           "shift_labels", "count_params", "active_params", "check_tokens", "from_pretrained", "save_pretrained",
           "update_expert_bias", "is_expert_bias", "IGNORE_INDEX", "model", "hf", "parallel_plan"]
