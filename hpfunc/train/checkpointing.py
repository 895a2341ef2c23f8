"""The trainer's checkpoints: what a run saves, where, how ``--resume`` finds one, and what must match.

A checkpoint of ``hpfunc train`` is a :mod:`hpfunc.checkpoint` folder ``<checkpoint.dir>/step_00000010``
(default ``checkpoint.dir``: ``<output.dir>/checkpoints``) holding the whole train state:

- ``params`` (the expert bias of an MoE model is one of them), ``opt_state``, ``step`` (the optimizer
  steps applied: the learning-rate schedule's position) and ``data_step`` (the batches consumed: the
  data position; it is ahead of ``step`` by the steps a non-finite guard skipped). The batch of a
  step is a pure function of (seed, data step), so there is no other RNG or data state.
- as metadata (strict JSON in the marker): the resolved config, the model's Hugging Face config
  (``model``) and the loop's running totals
  (first loss, the last losses for the summary's mean, the open logging window, train time, skips),
  so a resumed run's metrics lines and summary are those of an uninterrupted one.

:func:`resolve_resume` turns ``--resume auto|never|PATH`` into a checkpoint folder (or none);
:func:`check_compatible` compares the saved config with the run's: a different model or optimizer
is a :class:`~hpfunc.train.config.ConfigError` naming the key, a different ``parallel:`` section is
a mesh change (the state is loaded through the abstract target of the new layout, resharded).

>>> from hpfunc.train.config import load_config_dict, config_to_dict
>>> saved = config_to_dict(load_config_dict({}))
>>> check_compatible(saved, load_config_dict({"parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"]}}), "ckpt")
[]
>>> check_compatible(saved, load_config_dict({"model": {"hidden_size": 32}}), "ckpt")
Traceback (most recent call last):
...
hpfunc.train.config.ConfigError: model.hidden_size: the checkpoint ckpt was saved with 64, this run has 32; ...
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import attrs

from hpfunc.train.config import Config, ConfigError, config_to_dict

__all__ = ["checkpoint_root", "resolve_resume", "check_compatible", "saved_tree", "restore_state",
           "truncate_metrics", "TrainCheckpoints", "RESTART_ENV", "restart_count", "ResumePlan", "plan_resume",
           "clear_checkpoints", "set_aside_damaged", "check_checkpoint_dir"]

# torch's elastic launcher numbers the attempts of a worker group (0: the first start)
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"

# Sections that may change on resume without a word: the layout, where outputs go, how often to save.
_FREE = ("parallel", "output", "checkpoint")


def restart_count() -> int:
    """Which attempt of an elastic worker group this process belongs to (0 outside one, or the first)."""
    try:
        return int(os.environ.get(RESTART_ENV, "0") or 0)
    except ValueError:
        return 0


def checkpoint_root(cfg: Config, out: str | os.PathLike) -> pathlib.Path:
    """``checkpoint.dir``, or ``<output.dir>/checkpoints`` when it is null.

    >>> from hpfunc.train.config import load_config_dict
    >>> str(checkpoint_root(load_config_dict({}), "runs/x"))
    'runs/x/checkpoints'
    """
    return pathlib.Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else pathlib.Path(out) / "checkpoints"


def resolve_resume(resume: str, root: pathlib.Path) -> pathlib.Path | None:
    """The checkpoint folder ``--resume`` names: ``never`` -> None; ``auto`` -> the newest verified
    checkpoint under ``root`` (every file's size and CRC-32 as its marker records; None if there is
    none); a path -> that checkpoint folder, or the newest verified one under that folder. A path with no complete checkpoint is a ConfigError naming ``--resume``.

    >>> import tempfile, pathlib
    >>> resolve_resume("auto", pathlib.Path(tempfile.mkdtemp())) is None
    True
    """
    from hpfunc import checkpoint

    if resume == "never":
        return None
    if resume == "auto":
        return checkpoint.newest_verified(root)[0]
    path = pathlib.Path(resume)
    if (path / checkpoint.MARKER).exists():
        try:
            checkpoint.info(path)
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"--resume: {e}") from None
        return path
    found = checkpoint.newest_verified(path)[0] if path.is_dir() else None
    if found is None:
        why = "does not exist" if not path.exists() else "is not a complete checkpoint and holds none"
        raise ConfigError(f"--resume: {path} {why}; give a checkpoint folder (…/checkpoints/step_00000100), the "
                          f"folder holding them, `auto` (the newest of this run, if any) or `never`")
    return found


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flat(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def check_compatible(saved: dict, cfg: Config, where: str) -> list[str]:
    """Compare a checkpoint's saved config with this run's; return the keys that differ but may.

    The model is compared as built (the preset with its overrides: ``model.hidden_size: 64`` written out
    or left to the preset is the same model): a field that differs, ``model.dtype`` or
    ``optimizer.name`` (the optimizer state's structure) raises :class:`ConfigError` naming the key;
    ``parallel``, ``output`` and ``checkpoint`` keys may differ silently (a new mesh is a resharded load);
    any other differing key (a learning rate, the number of steps) is returned, for the run to print.
    """
    from hpfunc.train.build import build_model_config, model_spec
    from hpfunc.train.config import load_config_dict

    try:
        old_cfg = load_config_dict(saved)
    except ConfigError as e:
        raise ConfigError(f"--resume: the config saved in the checkpoint {where} does not load here ({e}); resume "
                          f"with the hpfunc version that wrote it, or start a new run") from None
    old_name, new_name = model_spec(old_cfg.model).name, model_spec(cfg.model).name
    if old_name != new_name:
        raise ConfigError(f"model.name: the checkpoint {where} was saved with the model {old_name!r}, this run trains "
                          f"{new_name!r}; resume with --set model.name={old_name}, or start a new run")
    old_model, new_model = build_model_config(old_cfg.model), build_model_config(cfg.model)
    pairs = [(f"model.{f.name}", getattr(old_model, f.name), getattr(new_model, f.name))
             for f in attrs.fields(type(new_model))]
    pairs += [("model.dtype", old_cfg.model.dtype, cfg.model.dtype),
              ("optimizer.name", old_cfg.optimizer.name, cfg.optimizer.name)]
    for key, a, b in pairs:
        if a != b:
            raise ConfigError(
                f"{key}: the checkpoint {where} was saved with {a!r}, this run has {b!r}; the saved parameters or "
                f"optimizer state would not fit. Resume with the saved value (--set {key}={a}), or start a new "
                f"run (another output.dir, or --resume never --overwrite)")
    old, new = _flat(config_to_dict(old_cfg)), _flat(config_to_dict(cfg))
    notes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a != b and key.split(".", 1)[0] not in (*_FREE, "model"):
            notes.append(f"{key}: {a!r} -> {b!r}")
    return notes


def saved_tree(state: Any, data_step: int) -> dict[str, Any]:
    """What a checkpoint holds of a :class:`~hpfunc.train.step.TrainState`: a dict (named keys, not the
    NamedTuple's positions) plus the data position."""
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step, "data_step": int(data_step)}


def restore_state(path: pathlib.Path, like: Any, process_group: Any = None) -> tuple[Any, int]:
    """Load ``path`` into the layout of the state ``like`` (this run's first state, on this run's mesh):
    ``(state, data_step)``. Every rank calls it."""
    from hpfunc import checkpoint
    from hpfunc.train.step import TrainState

    target = checkpoint.abstract(saved_tree(like, 0))
    got = checkpoint.load(path, target, process_group=process_group)
    return TrainState(params=got["params"], opt_state=got["opt_state"], step=got["step"]), int(got["data_step"])


def truncate_metrics(path: pathlib.Path, step: int) -> list[dict[str, Any]]:
    """Keep the records of ``metrics.jsonl`` up to ``step`` (training and validation lines), rewritten
    atomically; return them. A resumed run appends from the step after, so no step appears twice."""
    from hpfunc.train.output import read_metrics, to_json, write_atomic

    if not path.exists():
        return []
    kept = [r for r in read_metrics(path) if isinstance(r.get("step"), int) and r["step"] <= step]
    write_atomic(path, "".join(to_json(r, where=str(path)) + "\n" for r in kept))
    return kept


class TrainCheckpoints:
    """The run's checkpoints: :meth:`save` every ``checkpoint.every`` steps (async by default), a
    synchronous :meth:`save_now` for last words, both pruned by ``keep_last`` / ``keep_every``.

    Creating it is a collective call on a mesh (an async saver makes a process group of its own).
    """

    def __init__(self, cfg: Config, root: pathlib.Path, *, asynchronous: bool | None = None):
        from hpfunc import checkpoint

        cc = cfg.checkpoint
        self.cfg = cfg
        self.root = root
        self.every = cc.every
        self.asynchronous = cc.async_save if asynchronous is None else asynchronous
        self.manager = checkpoint.CheckpointManager(root, keep_last=cc.keep_last, keep_every=cc.keep_every,
                                                    async_save=self.asynchronous, timeout_s=cc.timeout_s)
        self._sync = checkpoint.CheckpointManager(root, keep_last=cc.keep_last, keep_every=cc.keep_every)
        self.blocked_s: list[float] = []  # what each save held the loop for
        self.write_s: list[float] = []  # how long each write took (in the background when async)
        self._pending: Any = None
        self._model: dict[str, Any] | None = None

    def metadata(self, loop: dict[str, Any]) -> dict[str, Any]:
        # "model": the built model as a Hugging Face config.json dict, so that a reader without the
        # trainer (``hpfunc convert``) knows the model (the model's ``convert.checkpoint_model_config``)
        if self._model is None:
            from hpfunc.train.build import build_model_config, model_spec

            self._model = model_spec(self.cfg.model).to_dict(build_model_config(self.cfg.model))
        return {"config": config_to_dict(self.cfg), "model": self._model, "loop": loop}

    def due(self, done: int) -> bool:
        return self.every > 0 and done % self.every == 0

    def save(self, state: Any, data_step: int, loop: dict[str, Any]) -> None:
        """Save the state after ``data_step`` steps (every rank calls it)."""
        t = time.perf_counter()
        self._collect()
        out = self.manager.save(saved_tree(state, data_step), data_step, metadata=self.metadata(loop))
        if self.asynchronous:
            self._pending = out
            self.blocked_s.append(out.blocked_s)
        else:
            self.blocked_s.append(time.perf_counter() - t)
            self.write_s.append(out.seconds)

    def _collect(self) -> None:
        # the saver waits for the save in flight anyway; collected here on every rank at the same call
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.write_s.append(pending.wait().seconds)

    def in_flight(self) -> bool:
        """Whether an asynchronous save was started and not yet collected (the same on every rank)."""
        return self._pending is not None

    def failed(self) -> bool:
        """Whether this rank's asynchronous save in flight has finished with an error (no waiting)."""
        return self._pending is not None and self._pending.failed()

    def wait(self) -> None:
        """Finish the save in flight (its error is raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.write_s.append(pending.wait().seconds)
        self.manager.wait()

    def save_now(self, state: Any, data_step: int, loop: dict[str, Any], *, process_group: Any = None) -> Any:
        """A synchronous save of ``state`` (last words), after the save in flight; on ``process_group``."""
        self.wait()
        return self._sync.save(saved_tree(state, data_step), data_step, metadata=self.metadata(loop),
                               process_group=process_group)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


@attrs.frozen
class ResumePlan:
    """Where a run starts: ``path`` (the checkpoint to load; None: from scratch), ``restart`` (the attempt
    of an elastic worker group), ``resume`` (the run continues the one in its folder), ``notes`` (config
    keys that differ from the checkpoint's, allowed)."""

    path: pathlib.Path | None = None
    restart: int = 0
    resume: bool = False
    notes: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # damaged newer checkpoints passed over (and renamed), one line each


def check_checkpoint_dir(root: pathlib.Path) -> None:
    """``checkpoint.dir`` can be written: created if absent, a file made and removed in it (before any
    rank starts; a read-only or unwritable folder would otherwise fail at the first save). An
    :class:`~hpfunc.train.output.OutputError` naming the key, the folder and the cause.

    >>> import tempfile, pathlib
    >>> check_checkpoint_dir(pathlib.Path(tempfile.mkdtemp()) / "ckpts")
    """
    import tempfile

    from hpfunc.train.output import OutputError, _why

    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hpfunc-write-check.", dir=root)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise OutputError(f"checkpoint.dir: {root} exists and is not a folder; choose a folder path") from None
    except NotADirectoryError:
        raise OutputError(f"checkpoint.dir: cannot create the folder {root}: a part of the path is not a folder; "
                          f"choose another checkpoint folder") from None
    except OSError as e:
        raise OutputError(f"checkpoint.dir: cannot write into the folder {root}: {_why(e)}; choose a folder you can "
                          f"write (--set checkpoint.dir=DIR)") from None


def set_aside_damaged(resume: str, root: pathlib.Path) -> list[str]:
    """For ``--resume auto`` (or a folder of checkpoints): rename each ``step_*`` folder newer than the
    newest verified checkpoint (no marker, a truncated or missing file, a checksum mismatch) to
    ``NAME.damaged`` and return one line per folder saying which, why and where it is kept."""
    from hpfunc import checkpoint

    folder = root if resume == "auto" else pathlib.Path(resume)
    if resume == "never" or (folder / checkpoint.MARKER).exists() or not folder.is_dir():
        return []
    found, skipped = checkpoint.newest_verified(folder)
    lines = []
    for damaged, why in skipped:
        try:
            kept = f"it is kept as {checkpoint.set_aside(damaged)} (remove it when done with it)"
        except OSError as e:  # a read-only folder: skipped all the same, left where it is
            kept = f"it could not be renamed ({e.strerror or e}) and is left in place"
        lines.append(f"--resume {resume}: skipped the damaged checkpoint {damaged.name} ({why}); {kept}; resuming "
                     f"from {found.name if found is not None else 'step 0 (no verified checkpoint)'}")
    return lines


def plan_resume(cfg: Config, out: str | os.PathLike, mode: str, *, overwrite: bool) -> ResumePlan:
    """Decide, from files only (no process group), where the run starts and check it, before anything
    is written: the checkpoint ``--resume`` names, its config against this run's
    (:func:`check_compatible`), and for a fresh run that ``checkpoint.dir`` holds no other run's
    checkpoints (unless ``overwrite``). A restarted elastic attempt always resumes (``auto``): the files
    in the folder are its own first attempt's.

    >>> import tempfile
    >>> from hpfunc.train.config import load_config_dict
    >>> plan_resume(load_config_dict({}), tempfile.mkdtemp(), "auto", overwrite=False).path is None
    True
    """
    from hpfunc import checkpoint
    from hpfunc.train.output import OutputError

    restart = restart_count()
    if restart:
        mode, overwrite = "auto", False
    if mode != "never" and overwrite:
        raise ConfigError("--resume: a resumed run continues the run in its folder, --overwrite replaces it; "
                          "give one of them")
    root = checkpoint_root(cfg, out)
    if cfg.checkpoint.dir and cfg.checkpoint.every > 0:
        check_checkpoint_dir(root)  # the output folder (and a checkpoint folder inside it) is RunFolder's
    skipped = set_aside_damaged(mode, root)
    path = resolve_resume(mode, root)
    notes: list[str] = []
    if path is not None:
        meta = checkpoint.info(path).get("metadata")
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict) or "loop" not in meta:
            raise ConfigError(f"--resume: {path} is a checkpoint, but not one of `hpfunc train` (its metadata has no "
                              f"config and loop position); resume from a checkpoint a training run saved")
        notes = check_compatible(meta["config"], cfg, str(path))
    elif mode == "never" and not overwrite and checkpoint.complete_steps(root):
        steps = checkpoint.complete_steps(root)
        raise OutputError(f"checkpoint.dir: {root} holds checkpoints of a previous run (steps {steps[0]} to "
                          f"{steps[-1]}); continue that run with --resume auto, replace it with --overwrite, or "
                          f"choose another folder (checkpoint.dir, --out DIR)")
    return ResumePlan(path=path, restart=restart, resume=path is not None or restart > 0, notes=tuple(notes),
                      skipped=tuple(skipped))


def clear_checkpoints(root: pathlib.Path) -> None:
    """Remove the checkpoints under ``root`` (a run that overwrites its folder; rank 0)."""
    import shutil

    from hpfunc import checkpoint
    from hpfunc.checkpoint.files import is_partial, remove_dir

    for s in checkpoint.complete_steps(root):
        remove_dir(checkpoint.step_dir(root, s))
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (is_partial(p.name) or p.name.startswith("step_")):
                shutil.rmtree(p, ignore_errors=True)
