"""Checkpoints of whole train states through ``torch.distributed.checkpoint``: atomic, verified,
resharded on load, optionally asynchronous.

* :func:`save` / :func:`load`: a state pytree (DTensor parameters and optimizer state, plain tensors,
  ints, RNG keys, a config dict) to a folder of DCP files plus a completion marker, and back into any
  layout (:func:`abstract`, :func:`abstract_like`, :class:`Abstract`): another mesh, plan or world size.
* :class:`CheckpointManager`, :func:`latest`: a run's checkpoints by step, retention, restore.
* :class:`AsyncSaver`: staging to host memory, the write in the background, one save in flight.

Modules: ``abstract`` (targets), ``dcp_io`` (save, load), ``marker`` (the completion marker),
``files`` (fsync, checksums, atomic folders), ``async_save``, ``manager``, ``errors``. See
``docs/checkpoint.md``.

>>> import tempfile, torch
>>> from hpfunc import checkpoint
>>> manager = checkpoint.CheckpointManager(tempfile.mkdtemp(), keep_last=1)
>>> _ = manager.save({"w": torch.ones(2), "step": 10}, 10)
>>> manager.restore(checkpoint.abstract({"w": torch.zeros(2), "step": 0}))["step"]
10
"""

from hpfunc.checkpoint.abstract import Abstract, abstract, abstract_like
from hpfunc.checkpoint.async_save import AsyncSaver, PendingSave
from hpfunc.checkpoint.dcp_io import SaveResult, info, load, save
from hpfunc.checkpoint.errors import (CheckpointError, CheckpointMismatchError, CorruptCheckpointError,
                                      IncompleteCheckpointError)
from hpfunc.checkpoint.manager import CheckpointManager, complete_steps, latest, newest_verified, set_aside, step_dir
from hpfunc.checkpoint.marker import MARKER

__all__ = ["save", "load", "info", "SaveResult", "Abstract", "abstract", "abstract_like", "CheckpointManager",
           "latest", "complete_steps", "step_dir", "newest_verified", "set_aside", "AsyncSaver", "PendingSave", "CheckpointError",
           "IncompleteCheckpointError", "CorruptCheckpointError", "CheckpointMismatchError", "MARKER"]
