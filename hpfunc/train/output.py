"""What a run leaves behind, and how it is written: a folder the run owns, files that are whole or absent.

The output folder (``output.dir``) holds ``config.yaml``, ``metrics.jsonl``, ``loss.png``,
``sample.txt`` and ``summary.json`` (written last: its presence means the run finished).
:class:`RunFolder` owns the folder for one run: an exclusive ``fcntl.flock`` on the lock file
``.hpfunc-train.lock`` held for the whole run (a second run into the folder is refused, naming the
folder and the holder's pid), a refusal of a folder that holds another run's files unless told to
overwrite, and a refusal of any output path that is one of the run's inputs (its config, data files,
tokenizer). Whole files are written atomically (:func:`write_atomic`: a hidden temp file, fsync,
rename), so a file is either complete or absent whatever moment the process dies; after a
``kill -9`` the only possible leftover is such a hidden ``.NAME.partial.PID`` temp file, which the
next run with overwrite removes.

Metrics are appended one JSON object per line as the run goes (a crash keeps what was logged); a
line is written whole or not at all (a failed write is cut back to the previous line). Training
lines carry ``step`` (steps done), ``loss`` (mean objective over the steps since the last line),
``ce_loss``, ``aux_loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``elapsed_s`` and, for MoE,
``expert_imbalance`` (max over mean expert load, averaged over layers) and ``expert_load``
(per-layer token counts of the last step). Evaluation lines carry ``step`` and ``val_loss``. Every
JSON written is strict JSON: a non-finite number becomes ``null`` with a warning that names it.

Example:
    >>> import tempfile, json, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with MetricsWriter(d / "metrics.jsonl") as w:
    ...     w.write({"step": 1, "loss": 5.5})
    >>> read_metrics(d / "metrics.jsonl")
    [{'step': 1, 'loss': 5.5}]
    >>> with RunFolder(d / "run") as folder:
    ...     folder.start()
    ...     _ = folder.write_json("summary.json", {"steps": 1})
    >>> sorted(p.name for p in (d / "run").iterdir())  # the lock file is gone with the run
    ['summary.json']
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import math
import os
import pathlib
import sys
import warnings
from typing import Any, Iterable, Sequence, TextIO

from hpfunc.durable import fsync_dir
from hpfunc.train.config import ConfigError

__all__ = [
    "OutputError",
    "OutputWriteError",
    "RUN_FILES",
    "LOCK_FILE",
    "RunFolder",
    "write_atomic",
    "to_json",
    "MetricsWriter",
    "read_metrics",
    "Progress",
    "plot_losses",
    "format_summary",
]

# The files a run writes, in the order of a run's end (summary.json last: the run finished).
RUN_FILES = ("config.yaml", "metrics.jsonl", "sample.txt", "loss.png", "summary.json")
LOCK_FILE = ".hpfunc-train.lock"
_PARTIAL = ".partial."  # temp files: .NAME.partial.PID


class OutputError(ConfigError):
    """The output folder cannot be used for this run (unwritable, in use, holds another run or an input).

    A config error (exit status 2): the message names ``output.dir``, the folder and the fix.
    """


class OutputWriteError(RuntimeError):
    """Writing an output file failed (a full disk, a file size limit, ...). The message names the file;
    what was written before is intact."""

    def __init__(self, message: str, path: str | pathlib.Path):
        super().__init__(message)
        self.path = pathlib.Path(path)


def _why(e: OSError) -> str:
    """``No space left on device (ENOSPC)``, with a hint for the errors a user can act on."""
    name = errno.errorcode.get(e.errno or 0, "")
    text = f"{e.strerror or e}" + (f" ({name})" if name else "")
    hint = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
            errno.EFBIG: "the file size limit (ulimit -f) is reached",
            errno.EROFS: "the file system is mounted read-only"}.get(e.errno or 0)
    return f"{text}: {hint}" if hint else text


def _is_partial(name: str) -> bool:
    return name.startswith(".") and _PARTIAL in name


# ---------------------------------------------------------------------------------------------
# Strict JSON and atomic files.


def to_json(obj: Any, *, where: str = "JSON", indent: int | None = None) -> str:
    """Strict JSON text of ``obj`` (tensors and numpy values become numbers and lists).

    JSON has no NaN or infinity: a non-finite number is written as ``null`` and a ``RuntimeWarning``
    names it (``where: loss = nan``); the text never holds ``NaN`` (``allow_nan=False``).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     to_json({"step": 3, "lr": float("inf")}, where="metrics.jsonl")
    ...     print(w[0].message)
    '{"step": 3, "lr": null}'
    metrics.jsonl: lr = inf written as null (JSON has no NaN or infinity)
    """
    notes: list[str] = []

    def plain(v: Any, path: str) -> Any:
        if hasattr(v, "tolist"):
            v = v.tolist()
        if isinstance(v, float) and not math.isfinite(v):
            notes.append(f"{path or 'value'} = {v}")
            return None
        if isinstance(v, dict):
            return {k: plain(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return v

    out = plain(obj, "")
    if notes:
        warnings.warn(f"{where}: {', '.join(notes)} written as null (JSON has no NaN or infinity)",
                      RuntimeWarning, stacklevel=2)
    return json.dumps(out, indent=indent, allow_nan=False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - a regular file either writes or raises
            raise OSError(errno.EIO, "write returned 0")
        view = view[n:]


def write_atomic(path: str | pathlib.Path, data: bytes | str) -> pathlib.Path:
    """Write ``data`` to ``path`` so that the file is either the old one, or the new one complete.

    The bytes go to a hidden temp file beside it (``.NAME.partial.PID``), which is fsynced and renamed
    over ``path``. On an error the temp file is removed and :class:`OutputWriteError` names the file.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
    >>> write_atomic(p, "hello").read_text()
    'hello'
    """
    path = pathlib.Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}{_PARTIAL}{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        old = "the previous file is unchanged" if path.exists() else "it was not created"
        raise OutputWriteError(f"cannot write {path}: {_why(e)}; {old} (the files written before are intact); "
                               f"free space or choose another output.dir", path) from None
    fsync_dir(path.parent)
    return path


# ---------------------------------------------------------------------------------------------
# The run's folder.


class RunFolder:
    """Exclusive use of an output folder for one run.

    :meth:`claim` (or ``with``) creates the folder, takes the lock and checks the folder: it raises
    :class:`OutputError` (naming ``key``, the folder and the fix) when the folder cannot be created or
    written, is in use by another run, holds a previous run's files (unless ``overwrite``), or when a
    file the run writes would be one of ``inputs`` (even with ``overwrite``: a run never writes over
    its config or data). :meth:`start`, called just before the first write, removes a previous run's
    files when overwriting, so a run that fails before it (on its data, say) leaves the old run whole.
    :meth:`release` (the end of the ``with``) removes the lock file and lets the lock go; a killed
    process loses the lock with its life (the kernel drops it), so a stale lock file never blocks.

    Args:
      path: the folder.
      overwrite: replace a previous run's files (``hpfunc train --overwrite``).
      inputs: ``(what, path)`` of the run's input files, e.g. ``("config", "cfg.yaml")``.
      inherited: the token of a lock that the launching process holds for this run (on a mesh, the
        ``hpfunc train`` parent claims the folder before it starts the ranks and hands the token to
        rank 0, which then works under that lock).
      key: the config key the messages name.
      resume: the run continues the one in the folder (``hpfunc train --resume``): its files are
        accepted; :meth:`start` removes only the end-of-run files (``sample.txt``, ``loss.png``,
        ``summary.json``) and temp files, and the trainer cuts ``metrics.jsonl`` back to the checkpoint.
      hint: appended to the refusal of a folder holding a run (e.g. how to resume it).
    """

    def __init__(self, path: str | pathlib.Path, *, overwrite: bool = False,
                 inputs: Sequence[tuple[str, str | pathlib.Path]] = (), inherited: str | None = None,
                 key: str = "output.dir", resume: bool = False, hint: str = ""):
        self.path = pathlib.Path(path)
        self.overwrite = overwrite
        self.resume = resume
        self.hint = hint
        self.inputs = [(what, pathlib.Path(p)) for what, p in inputs]
        self.inherited = inherited
        self.key = key
        self.token: str | None = None
        self._fd: int | None = None
        self._started = False

    # -- claiming

    def claim(self) -> "RunFolder":
        """Create the folder if needed, take its lock and check it (see the class docstring)."""
        self._make_folder()
        self._lock()
        try:
            self._check_inputs()
            self._check_empty()
        except BaseException:
            self.release()
            raise
        return self

    def _make_folder(self) -> None:
        p, key = self.path, self.key
        try:
            p.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise OutputError(f"{key}: {p} exists and is not a folder; choose a folder path (--out DIR)") from None
        except NotADirectoryError:
            parent = next((q for q in p.parents if q.exists() and not q.is_dir()), None)
            where = f" ({parent} is a file)" if parent is not None else ""
            raise OutputError(f"{key}: cannot create the folder {p}: a part of the path is not a folder{where}; "
                              f"choose another output folder (--out DIR)") from None
        except OSError as e:
            raise OutputError(f"{key}: cannot create the folder {p}: {_why(e)}; choose a folder you can write "
                              f"(--out DIR)") from None

    def _lock(self) -> None:
        lock, key = self.path / LOCK_FILE, self.key
        for _ in range(20):  # retried only when an owner removed the file between our open and our lock
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as e:
                raise OutputError(f"{key}: cannot write into the folder {self.path} (creating its lock file "
                                  f"{LOCK_FILE}: {_why(e)}); choose a folder you can write (--out DIR)") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if self.inherited is not None and holder.get("token") == self.inherited:
                    self.token = self.inherited  # the launching process holds it for this run
                    return
                pid = holder.get("pid")
                raise OutputError(f"{key}: the folder {self.path} is in use by another run"
                                  f"{f' (pid {pid})' if pid else ''}: it holds the lock {lock}; wait for that run "
                                  f"to finish, or choose another folder (--out DIR)") from None
            except OSError as e:
                os.close(fd)
                raise OutputError(f"{key}: cannot lock {lock}: {_why(e)} (the folder's file system may not "
                                  f"support flock); choose a folder on a local disk (--out DIR)") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                same = False
            if not same:  # the previous owner unlinked it after we opened it: lock the file at the path
                os.close(fd)
                continue
            self.token = f"{os.getpid()}-{os.urandom(8).hex()}"
            try:
                os.ftruncate(fd, 0)
                _write_all(fd, (json.dumps({"pid": os.getpid(), "token": self.token}) + "\n").encode())
            except OSError as e:
                os.close(fd)
                raise OutputError(f"{key}: cannot write into the folder {self.path} ({LOCK_FILE}: {_why(e)}); "
                                  f"free space or choose another folder (--out DIR)") from None
            self._fd = fd
            return
        raise OutputError(f"{key}: could not lock {lock}: other runs keep replacing it; "
                          f"choose another folder (--out DIR)")

    def _check_inputs(self) -> None:
        for name in (*RUN_FILES, LOCK_FILE):
            target = self.path / name
            if not target.exists():
                continue
            for what, inp in self.inputs:
                with contextlib.suppress(OSError):
                    if inp.exists() and os.path.samefile(target, inp):
                        raise OutputError(
                            f"{self.key}: the run writes {name} in {self.path}, and that file is its input {what} "
                            f"{inp}; a run never writes over its inputs, so choose another output folder "
                            f"(--out DIR){' or move the config out of it' if what == 'config' else ''}")

    def previous_run(self) -> list[str]:
        """The names of a previous run's files in the folder (its outputs and leftover temp files)."""
        names = [n for n in RUN_FILES if os.path.lexists(self.path / n)]
        with contextlib.suppress(OSError):
            names += sorted(p.name for p in self.path.iterdir() if _is_partial(p.name))
        return names

    def _check_empty(self) -> None:
        found = self.previous_run()
        if not found or self.overwrite or self.resume:
            return
        state = ("it finished" if "summary.json" in found
                 else "it did not finish: no summary.json")
        raise OutputError(f"{self.key}: the folder {self.path} already holds a run ({', '.join(found)}; {state}); "
                          f"rerun with --overwrite to replace it (run(..., overwrite=True) from Python), or "
                          f"choose another folder (--out DIR){self.hint}")

    # -- writing

    def start(self) -> None:
        """Called just before the run's first write: with overwrite, remove the previous run's files."""
        if self._started:
            return
        self._started = True
        keep = ("config.yaml", "metrics.jsonl") if self.resume else ()
        for name in self.previous_run():
            if name in keep:
                continue
            p = self.path / name
            try:
                if p.is_dir() and not p.is_symlink():
                    raise OutputError(f"{self.key}: {p} is a folder where the run writes its file {name}; "
                                      f"remove it or choose another output folder (--out DIR)")
                p.unlink(missing_ok=True)
            except OutputError:
                raise
            except OSError as e:
                raise OutputWriteError(f"cannot remove the previous run's {p}: {_why(e)}", p) from None

    def file(self, name: str) -> pathlib.Path:
        return self.path / name

    def write_text(self, name: str, text: str) -> pathlib.Path:
        """Write ``name`` in the folder atomically (:func:`write_atomic`)."""
        return write_atomic(self.path / name, text)

    def write_json(self, name: str, obj: Any, *, indent: int | None = 2) -> pathlib.Path:
        """Write ``obj`` as strict JSON (:func:`to_json`) to ``name``, atomically."""
        return write_atomic(self.path / name, to_json(obj, where=str(self.path / name), indent=indent) + "\n")

    # -- releasing

    def release(self) -> None:
        """Remove the lock file and let the lock go (nothing when the lock is the launcher's)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.unlink(self.path / LOCK_FILE)  # while still holding it: see _lock's same-file check
        os.close(fd)

    def __enter__(self) -> "RunFolder":
        return self.claim()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
        holder = json.loads(text) if text else {}
        if isinstance(holder, dict):
            return holder
    return {}


# ---------------------------------------------------------------------------------------------
# Metrics.


class MetricsWriter:
    """Append-only JSONL writer: each record is one whole line, written with one append.

    A write that fails part-way (a full disk) is cut back to the end of the previous line, so the
    file never holds a torn line, and raises :class:`OutputWriteError` naming the file and the step.
    The file is opened for appending (a torn tail left by a killed writer is cut off first, with a
    warning) and fsynced on close.
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.lines = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                           | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            raise OutputWriteError(f"cannot open {self.path} for appending: {_why(e)}; choose another "
                                   f"output.dir", self.path) from None
        self._size = os.fstat(self._fd).st_size
        if self._size:
            with open(self.path, "rb") as fh:
                data = fh.read()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                warnings.warn(f"{self.path}: cutting off an incomplete last line of {len(data) - keep} bytes "
                              f"(a writer stopped in the middle of it)", RuntimeWarning, stacklevel=2)
                os.ftruncate(self._fd, keep)
                self._size = keep
            self.lines = data[:keep].count(b"\n")

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: the metrics writer is closed")
        data = (to_json(record, where=f"{self.path} (step {record.get('step')})") + "\n").encode("utf-8")
        try:
            _write_all(self._fd, data)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)  # no torn line: back to the end of the previous one
            raise OutputWriteError(
                f"cannot write {self.path}: {_why(e)}; the line of step {record.get('step')} was not written, the "
                f"{self.lines} line(s) before it are intact; free space or choose another output.dir",
                self.path) from None
        self._size += len(data)
        self.lines += 1

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with contextlib.suppress(OSError):
                os.fsync(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in order.

    An incomplete last line (no newline at its end: a writer killed in the middle of it) is skipped
    with a ``RuntimeWarning``; any other line that is not a JSON object raises ``ValueError`` naming
    the file and the line.
    """
    path = pathlib.Path(path)
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    records = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        torn = i == len(lines)  # the text after the last newline
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, found {type(record).__name__}")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if torn:
                warnings.warn(f"{path}:{i}: skipping an incomplete last line ({len(raw)} bytes without a newline; "
                              f"a run stopped while writing it)", RuntimeWarning, stacklevel=2)
                continue
            raise ValueError(f"{path}:{i}: not a metrics record ({e}); the file is damaged at this line") from None
        records.append(record)
    return records


class Progress:
    """A tqdm bar on a terminal, plain lines otherwise (logs, CI), or nothing.

    ``mode``: ``"auto"`` (bar when stdout is a TTY), ``"bar"``, ``"lines"`` or ``"none"``.
    """

    def __init__(self, total: int, mode: str = "auto", stream: TextIO | None = None):
        self.stream = sys.stdout if stream is None else stream
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode = mode
        self.total = total
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            try:
                width = os.get_terminal_size(self.stream.fileno()).columns
            except (OSError, AttributeError, ValueError):
                width = 0
            # A pseudo-terminal may report 0 columns; tqdm would then draw nothing.
            self._bar = tqdm(total=total, file=self.stream, unit="step", leave=True,
                             **({"dynamic_ncols": True} if width > 0 else {"ncols": 100, "nrows": 40}))

    def update(self, step: int, record: dict[str, Any] | None = None) -> None:
        """Advance to ``step`` steps done; ``record`` (a logged metrics line) is shown when given."""
        if self._bar is not None:
            if record:  # keep the history above the bar, the latest values on it
                self._bar.write(self._line(step, record), file=self.stream)
                self._bar.set_postfix_str(_short(record), refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.mode == "lines" and record:
            print(self._line(step, record), file=self.stream, flush=True)

    def _line(self, step: int, record: dict[str, Any]) -> str:
        return f"step {step:>{len(str(self.total))}}/{self.total}  {_short(record)}"

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.mode != "none":
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _short(record: dict[str, Any]) -> str:
    parts = []
    for key, fmt in (("loss", ".4f"), ("val_loss", ".4f"), ("grad_norm", ".3f"), ("lr", ".2e"),
                     ("expert_imbalance", ".2f"), ("tokens_per_s", ",.0f")):
        v = record.get(key)
        if isinstance(v, (int, float)):
            name = {"tokens_per_s": "tok/s", "expert_imbalance": "imbalance"}.get(key, key)
            parts.append(f"{name} {v:{fmt}}")
    return "  ".join(parts)


def plot_losses(records: Iterable[dict[str, Any]], path: str | pathlib.Path, *, title: str = "") -> pathlib.Path:
    """Training (and validation) loss against steps, saved as a PNG (matplotlib's Agg canvas, no pyplot),
    written atomically (:func:`write_atomic`)."""
    # A bare Figure renders with the Agg canvas and leaves pyplot's global backend and state alone.
    from matplotlib.figure import Figure

    records = list(records)
    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    val = [(r["step"], r["val_loss"]) for r in records if isinstance(r.get("val_loss"), (int, float))]
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return write_atomic(path, buf.getvalue())  # a whole PNG or none


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run lines printed to the console."""
    lines = [
        f"done: {summary['steps']} steps in {summary['train_time_s']:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tokens/s, {summary['tokens']:,} tokens)",
        f"loss: first {summary['first_loss']:.4f} -> last {summary['last_loss']:.4f} "
        f"(mean of the last {summary['last_window']} steps)",
    ]
    if summary.get("val_loss") is not None:
        lines.append(f"validation loss: {summary['val_loss']:.4f}")
    lines.append(f"outputs: {summary['out_dir']}")
    return "\n".join(lines)
