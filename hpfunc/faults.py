"""Faults of a multi-process run, noticed and named: ranks die with their launcher, a heartbeat names a
rank that stops responding, and a collective that times out or loses a peer says which one it was.

What the hpfunc launchers (``hpfunc launch``, ``hpfunc train``) and their ranks do with this module:

- **A rank dies with its launcher.** :func:`guard_rank`, run first in every rank (by ``hpfunc.rank``,
  the entry point the launchers start), asks the kernel to SIGKILL the rank when its parent dies
  (Linux ``prctl(PR_SET_PDEATHSIG)``), then checks that the launcher is still its parent (it may
  have died while the rank was importing torch). The heartbeat thread checks it again on every beat,
  for systems without ``prctl``.
- **Heartbeat.** A daemon thread of each rank touches ``<dir>/rank<N>`` (holding the rank's pid)
  every :func:`heartbeat_interval` seconds (1 s for the default timeout): one ``utime`` call, nothing
  on the training thread. The launcher's :class:`Watchdog` reads the files' ages: a rank silent for
  longer than the collective timeout plus :func:`watchdog_grace` (stopped by SIGSTOP or a debugger,
  or stuck holding the interpreter) is named on stderr and killed, so the job ends.
- **Collective timeout.** :func:`hpfunc.mesh.init_distributed` starts the process group with the
  timeout (``parallel.timeout_s`` of ``hpfunc train``, ``hpfunc launch --timeout``, else
  :data:`DEFAULT_TIMEOUT_S`) and a :class:`hpfunc.Mesh` gives its axis groups the same one. When a
  collective of :mod:`hpfunc.lax` fails (gloo raises ``RuntimeError``: ``Timed out waiting 10000ms
  for recv operation to complete``, or ``Connection closed by peer`` once a peer is gone),
  :class:`CollectiveError` names the rank, the collective and its mesh axes, the source line that
  issued it, and the ranks whose heartbeat stopped (or, when every rank is alive, says that some
  rank did not issue the same collective). :func:`translate` does the same from the traceback for a
  collective issued outside :mod:`hpfunc.lax` (a DTensor's ``full_tensor()``, a raw
  ``torch.distributed`` call), without the axis.

The launcher tells its ranks what they need in the environment: :data:`ENV_LAUNCHER_PID`,
:data:`ENV_TIMEOUT`, :data:`ENV_HEARTBEAT_DIR` (see :meth:`Watchdog.env`). This module imports only
the standard library, so the core (:mod:`hpfunc.lax`, :mod:`hpfunc.mesh`) can use it.

Example (the message of a collective that timed out, built from gloo's error; in a rank, its number
(its process group's, else ``RANK``) replaces the ``?`` and the heartbeats say which rank is silent):

    >>> gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
    ...                     "for recv operation to complete")
    >>> print(collective_error(gloo, name="psum", axes=("dp",), n=2, frames=[("script.py", 7)]))
    ... # doctest: +ELLIPSIS
    rank ...: psum over mesh axis 'dp' (2 ranks), issued at ...script.py:7, timed out after 10 s (the
    collective timeout; gloo: Timed out waiting 10000ms for recv operation to complete); the ranks are
    not watched by an hpfunc launcher (no heartbeat): ...
"""

from __future__ import annotations

import linecache
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Sequence, TextIO

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_LAUNCHER_PID",
    "ENV_TIMEOUT",
    "ENV_HEARTBEAT_DIR",
    "CollectiveError",
    "check_timeout",
    "timeout_from_env",
    "heartbeat_interval",
    "watchdog_grace",
    "is_comm_failure",
    "collective_error",
    "raise_collective_error",
    "translate",
    "guard_rank",
    "gone_peers",
    "record_failure",
    "pop_failure",
    "Heartbeat",
    "Watchdog",
    "nccl_environment",
]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a collective may wait for its peers before it fails (torch's own default for gloo is 30 min)."""

ENV_LAUNCHER_PID = "HPFUNC_LAUNCHER_PID"  # the pid the ranks must have as parent
ENV_TIMEOUT = "HPFUNC_TIMEOUT_S"  # the collective timeout, in seconds
ENV_HEARTBEAT_DIR = "HPFUNC_HEARTBEAT_DIR"  # where the ranks' heartbeat files are

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# frames that are the machinery of a collective, not the code that issued it
_MACHINERY = tuple(os.path.join(_HERE, f) for f in ("lax.py", "comm.py", "faults.py"))
_TORCH = os.sep + "torch" + os.sep
_TORCH_DIST = _TORCH + "distributed" + os.sep
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
# the rank entry and the interpreter's own runners: never "the caller"
_RUNNERS = (os.path.join(_HERE, "rank.py"), os.path.join(_HERE, "cli.py"), os.sep + "runpy.py")

# gloo's and c10d's words for a collective that lost its peers (RuntimeError messages)
# gloo also reports a timeout as the pair it closed ("Application timeout caused pair closure")
_TIMEOUT_WORDS = ("Timed out", "timed out", "timeout caused pair closure")
_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
               "Read error", "Write error")


class CollectiveError(RuntimeError):
    """A collective did not complete: it timed out waiting for its peers, or a peer's connection
    closed. The message names the rank, the collective and its mesh axes, where it was issued, and
    the rank to look at; ``__cause__`` is the backend's own error."""


def check_timeout(value: Any, where: str) -> float:
    """``value`` as a number of seconds > 0, or ``ValueError`` naming ``where`` (a key, an option).

    >>> check_timeout("10", "--timeout")
    10.0
    >>> check_timeout(0, "--timeout")
    Traceback (most recent call last):
    ValueError: --timeout: expected a number of seconds > 0 (e.g. 300), found 0
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a number of seconds > 0 (e.g. 300), found {value!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{where}: expected a number of seconds > 0 (e.g. 300), found {value!r}")
    return seconds


def timeout_from_env(default: float = DEFAULT_TIMEOUT_S) -> float:
    """The collective timeout a launcher set for this rank (:data:`ENV_TIMEOUT`), else ``default``."""
    raw = os.environ.get(ENV_TIMEOUT)
    return default if raw in (None, "") else check_timeout(raw, f"environment variable {ENV_TIMEOUT}")


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats of a rank: a tenth of the timeout, between 0.05 s and 1 s.

    >>> heartbeat_interval(300), heartbeat_interval(5)
    (1.0, 0.5)
    """
    return min(1.0, max(0.05, timeout_s / 10))


def watchdog_grace(timeout_s: float) -> float:
    """How much longer than the timeout the launcher waits before it kills a silent rank: the ranks
    waiting on it time out first and name the collective they were in."""
    return max(2.0, 2 * heartbeat_interval(timeout_s))


# ---------------------------------------------------------------------------------------------
# Collective failures


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is a backend's error for a collective that lost its peers (a timeout, a closed
    connection), as opposed to a usage error (a wrong shape, an unknown group).

    >>> is_comm_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5261"))
    True
    >>> is_comm_failure(RuntimeError("Application timeout caused pair closure"))
    True
    >>> is_comm_failure(RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"))
    False
    """
    if isinstance(e, CollectiveError):
        return True
    if not isinstance(e, RuntimeError):
        return False
    dist = sys.modules.get("torch.distributed")
    backend_error = getattr(dist, "DistBackendError", None) if dist is not None else None
    if backend_error is not None and isinstance(e, backend_error):
        return True
    text = str(e)
    return any(w in text for w in _TIMEOUT_WORDS + _PEER_WORDS)


def _backend_detail(e: BaseException) -> tuple[str, str, float | None]:
    """``(kind, "backend: first sentence of its message", timeout in s if it says)`` where kind is
    ``"timeout"`` or ``"peer"``."""
    text = str(e).strip()
    backend = "gloo" if "gloo" in text else "nccl" if "nccl" in text.lower() else "backend"
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's [path/to/file.cc:123] prefix
    first = re.split(r"(?<=[.!])\s", text, maxsplit=1)[0].rstrip(".")
    ms = re.search(r"(\d+)\s*ms", text)
    kind = "peer" if any(w in text for w in _PEER_WORDS) else "timeout"
    return kind, f"{backend}: {first[:200]}", (int(ms.group(1)) / 1000 if ms else None)


def _rank() -> str:
    """This rank's number: its default process group's when one is running (also right for a rank
    simulated in a thread of one process, hpfunc.autoparallel.simulate), else the launcher's ``RANK``.
    torch is not imported here: only read when the program has loaded it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return os.environ.get("RANK", "?")


def _rel(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.relpath(path, _ROOT) if path.startswith(_ROOT + os.sep) else path


def _is_machinery(fn: str) -> bool:
    return fn.startswith(_MACHINERY) or _TORCH in fn


def _where(frames: Sequence[tuple[str, int]]) -> tuple[str, str]:
    """From ``(filename, line)`` pairs, innermost first: the line that issued the collective (the
    first outside hpfunc.lax / hpfunc.comm / torch) and the innermost line of the user's own code
    outside hpfunc ("" when it is the same line or there is none)."""
    issued = caller = ""
    for fn, line in frames:
        if fn.startswith("<"):  # <frozen runpy>, <string>, <stdin>
            continue
        fn = os.path.abspath(fn)
        if _is_machinery(fn) or fn.endswith(_RUNNERS):
            continue
        here = f"{_rel(fn)}:{line}"
        if not issued:
            issued = here
        stdlib = fn.startswith(_STDLIB) and "site-packages" not in fn  # contextlib, functools: not a caller
        if not fn.startswith(_HERE + os.sep) and not stdlib:
            caller = "" if here == issued else here
            break
    return issued or "?", caller


def _stack_frames(skip: int) -> list[tuple[str, int]]:
    f = sys._getframe(skip + 1)
    out = []
    while f is not None:
        out.append((f.f_code.co_filename, f.f_lineno))
        f = f.f_back
    return out


def _beats(directory: str) -> dict[int, tuple[int, float]]:
    """``{rank: (pid, seconds since its last heartbeat)}`` from a heartbeat folder."""
    out: dict[int, tuple[int, float]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    now = time.time()
    for name in names:
        if not name.startswith("rank") or not name[4:].isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            age = now - os.stat(path).st_mtime
            with open(path) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        out[int(name[4:])] = (pid, max(age, 0.0))
    return out


def proc_state(pid: int) -> str:
    """A few words on a process's scheduler state (Linux ``/proc``; "" elsewhere or when normal)."""
    st = _stat(pid)
    if st is None:
        return ""
    return {"T": "its process is stopped: SIGSTOP or SIGTSTP", "t": "its process is stopped by a debugger",
            "D": "its process is in uninterruptible I/O", "Z": "its process has exited"}.get(st[0], "")


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state letter, parent pid)`` of a process from ``/proc``, or None (gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _peers(timeout_s: float | None) -> tuple[str, str]:
    """What the heartbeats say about the other ranks: ``(silent, alive)``, one of them "" (``silent``
    names the ranks whose heartbeat stopped; ``alive`` says what it means that none did)."""
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    if not directory:
        return "", ("the ranks are not watched by an hpfunc launcher (no heartbeat): look at the other ranks' "
                    "errors, and whether one of them stopped, crashed or did not issue this collective")
    timeout_s = timeout_s or timeout_from_env()
    limit = min(timeout_s, max(5 * heartbeat_interval(timeout_s), 3.0))
    me = _rank()
    beats = {r: v for r, v in _beats(directory).items() if str(r) != me}
    silent = {r: v for r, v in beats.items() if v[1] > limit}
    if silent:
        parts = []
        for r, (pid, age) in sorted(silent.items()):
            state = proc_state(pid)
            parts.append(f"rank {r} (pid {pid}) has sent no heartbeat for {age:.1f} s"
                         f"{f' ({state})' if state else ''}")
        who = "that rank is" if len(silent) == 1 else "those ranks are"
        return f"{'; '.join(parts)}: {who} stopped or hung, look there", ""
    if not beats:
        return "", "no other rank's heartbeat is known"
    oldest = max(age for _, age in beats.values())
    return "", (f"every other rank is alive (heartbeats at most {oldest:.1f} s old), so some rank of this group "
                f"did not issue the same collective: one called on some ranks only, or collectives issued in a "
                f"different order on different ranks")


def _compose(what: str, issued: str, caller: str, e: BaseException) -> str:
    kind, detail, seconds = _backend_detail(e)
    at = f"issued at {issued}" + (f" (from {caller})" if caller else "")
    silent, alive = _peers(seconds)
    if kind == "peer":
        return (f"rank {_rank()}: {what}, {at}, failed: a peer of this group closed its connection ({detail}); "
                f"{silent or 'another rank exited or was killed'}. The error of the rank that went away (printed by "
                f"that rank or the launcher) is the cause")
    took = f"{seconds:g} s" if seconds else "the timeout"
    return (f"rank {_rank()}: {what}, {at}, timed out after {took} (the collective timeout; {detail}); "
            f"{silent or alive}. If a rank legitimately works longer than that between two collectives, raise the "
            f"timeout (parallel.timeout_s of hpfunc train, hpfunc launch --timeout S)")


def _describe(name: str, axes: Sequence[str], n: int | None) -> str:
    names = ", ".join(repr(a) for a in axes)
    ax = f"mesh ax{'is' if len(axes) == 1 else 'es'} {names}" if axes else "no mesh axis"
    return f"{name} over {ax}" + (f" ({n} ranks)" if n else "")


def collective_error(e: BaseException, *, name: str, axes: Sequence[str], n: int | None = None,
                     frames: Sequence[tuple[str, int]] | None = None, backward: bool = False) -> CollectiveError:
    """The :class:`CollectiveError` for the backend error ``e`` of collective ``name`` (an
    :mod:`hpfunc.lax` function) over mesh ``axes`` of ``n`` ranks (``backward``: a transpose run
    by autograd); ``frames`` (innermost first) default to the caller's stack."""
    issued, caller = _where(_stack_frames(1) if frames is None else frames)
    what = _describe(name, tuple(axes), n) + (" in the backward pass" if backward else "")
    return CollectiveError(_compose(what, issued, caller, e))


def raise_collective_error(e: RuntimeError, name: str, axes: Sequence[str], n: int) -> None:
    """Called where :mod:`hpfunc.lax` catches a collective's ``RuntimeError``: raise the
    :class:`CollectiveError` for it if it is a lost-peer failure; return (the caller re-raises ``e``)
    otherwise."""
    if isinstance(e, CollectiveError) or not is_comm_failure(e):
        return
    torch = sys.modules.get("torch")
    backward = torch is not None and torch._C._current_graph_task_id() != -1
    raise collective_error(e, name=name, axes=axes, n=n, frames=_stack_frames(1), backward=backward) from e


def translate(e: BaseException) -> CollectiveError | None:
    """``e`` as a :class:`CollectiveError` when it is a lost-peer failure of a collective (already one,
    or a backend error raised outside :mod:`hpfunc.lax`, named from its traceback); else None."""
    if isinstance(e, CollectiveError):
        return e
    if not is_comm_failure(e):
        return None
    tb = e.__traceback__
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    frames.reverse()  # innermost first
    if not any(_TORCH_DIST in os.path.abspath(fn) for fn, _ in frames):
        return None  # not raised by a torch.distributed call: an error of the program's own
    issued, caller = _where(frames)
    what = "a torch.distributed collective outside hpfunc.lax (mesh axis not known)"
    fn, _, line = issued.rpartition(":")
    if fn and line.isdigit():
        code = linecache.getline(fn if os.path.isabs(fn) else os.path.join(_ROOT, fn), int(line)).strip()
        if code:
            what = f"a torch.distributed collective outside hpfunc.lax, in `{code[:100]}` (mesh axis not known)"
    err = CollectiveError(_compose(what, issued, caller, e))
    err.__cause__ = e
    return err


def gone_peers() -> list[str]:
    """The other ranks of this launch that cannot take part in a collective any more, from their
    heartbeats: ``"rank 1 (pid 4242) has exited"`` for a process that is gone, or ``"... sent no heartbeat
    for 12.0 s"`` for one silent for longer than the collective timeout. Empty outside an hpfunc launch
    (no heartbeat folder): then only a collective with a timeout can tell.

    >>> import os; os.environ.pop(ENV_HEARTBEAT_DIR, None) and None; gone_peers()
    []
    """
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    if not directory:
        return []
    limit = timeout_from_env()
    me = _rank()
    out = []
    for r, (pid, age) in sorted(_beats(directory).items()):
        if str(r) == me:
            continue
        st = _stat(pid)
        if st is None or st[0] == "Z":
            out.append(f"rank {r} (pid {pid}) has exited")
        elif age > limit:
            out.append(f"rank {r} (pid {pid}) sent no heartbeat for {age:.1f} s")
    return out


_FAILURE = "failure.json"  # in the heartbeat folder: the first failure a rank of this launch noticed


def record_failure(what: str) -> None:
    """Note, for the ranks of a restarted worker group, when a rank of this launch first noticed a failure
    (a lost peer, a failed step): the first note stands until :func:`pop_failure` takes it. Nothing
    outside an hpfunc launch."""
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    if not directory:
        return
    import json

    try:
        fd = os.open(os.path.join(directory, _FAILURE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:  # noted already (or the launcher is gone)
        return
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"time": time.time(), "rank": _rank(), "what": what[:300]}))


def pop_failure() -> dict[str, Any] | None:
    """The failure :func:`record_failure` noted (``{"time", "rank", "what"}``), removed; None if none."""
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    if not directory:
        return None
    import json

    path = os.path.join(directory, _FAILURE)
    try:
        with open(path) as f:
            note = json.loads(f.read())
        os.unlink(path)
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


# ---------------------------------------------------------------------------------------------
# The rank side: die with the launcher, beat


def _set_parent_death_signal(sig: int) -> bool:
    """Linux: have the kernel send ``sig`` to this process when its parent dies. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        return libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned(parent_pid: int) -> None:
    print(f"hpfunc [rank {_rank()}]: the launcher (pid {parent_pid}) is gone; this rank exits", file=sys.stderr,
          flush=True)
    os._exit(1)


class Heartbeat:
    """A rank's heartbeat: a daemon thread touching ``<directory>/rank<rank>`` every ``interval``
    seconds, and exiting the process if its parent is no longer ``parent_pid``."""

    def __init__(self, directory: str, rank: int, interval: float, parent_pid: int | None = None):
        self.path = os.path.join(directory, f"rank{rank}")
        self.interval = interval
        self.parent_pid = parent_pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hpfunc-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        with open(self.path, "w") as f:
            f.write(f"{os.getpid()}\n")
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                _orphaned(self.parent_pid)
            try:
                os.utime(self.path)
            except OSError:  # the launcher removed the folder: it is shutting down
                return

    def stop(self) -> None:
        """Stop beating and remove the file (a rank that finished is not a silent one)."""
        self._stop.set()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def guard_rank() -> Heartbeat | None:
    """Run first in a rank an hpfunc launcher started (the environment says so): die with the
    launcher, and start the heartbeat. Returns the heartbeat (None outside such a launch)."""
    raw = os.environ.get(ENV_LAUNCHER_PID)
    if not raw:
        return None
    parent = int(raw)
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before the line above
        _orphaned(parent)
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    if not directory or not os.path.isdir(directory):
        return None
    beat = Heartbeat(directory, int(os.environ.get("RANK", "0")), heartbeat_interval(timeout_from_env()), parent)
    return beat.start()


# ---------------------------------------------------------------------------------------------
# The launcher side

# NCCL's own error handling, which gloo does not need (a gloo collective raises in the thread that issued
# it; an NCCL one is queued on a stream and fails, or hangs, later): the variables torch's NCCL process
# group reads, the values an hpfunc launcher gives its ranks when their backend is NCCL
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
NCCL_HEARTBEAT_TIMEOUT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
# the flight recorder (a ring buffer of each rank's last collectives, dumped when the watchdog finds one
# timed out): torch 2.13 reads the buffer size from TORCH_FR_BUFFER_SIZE, else TORCH_NCCL_TRACE_BUFFER_SIZE
# (c10d/FlightRecorder.hpp; its C++ default 2000, the torchcomms path's "0": distributed_c10d.py), and
# dumps on a timeout with TORCH_NCCL_DUMP_ON_TIMEOUT (with the monitor on and a buffer > 0:
# c10d/ProcessGroupNCCL.hpp) to the file prefix TORCH_FR_DUMP_TEMP_FILE (older name
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE) plus the rank
NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
TRACE_BUFFER_ENTRIES = 2000  # torch's own default in FlightRecorder.hpp, given explicitly


def nccl_environment(timeout_s: float, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables an hpfunc launcher adds to its ranks' environment when they start NCCL (those
    ``environ``, default ``os.environ``, sets already are left as the user set them):

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: NCCL's watchdog thread aborts the communicators of a
      collective that outlived the collective timeout and ends the rank, so the launcher sees it fail
      (and restarts the group under ``parallel.max_restarts``) instead of the rank waiting forever on
      a stream;
    - ``TORCH_NCCL_ENABLE_MONITORING=1`` and ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: the monitor of that
      watchdog thread ends the rank when the watchdog itself stops beating for the collective timeout
      plus :func:`watchdog_grace`, the same limit the launcher's :class:`Watchdog` gives hpfunc's own
      heartbeat (which works on NCCL as on gloo: a file each rank touches from a thread of its own);
    - ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: NCCL's flight recorder
      keeps each rank's last 2000 collective events (start and end of each: the op, its process group,
      sequence number, sizes, state, the Python stack that issued it), and the watchdog dumps them when it
      finds a collective timed out, before the rank is ended: the dumps of all ranks show which rank did
      not join which collective (``torchfrtrace``, :mod:`torch.distributed.flight_recorder`, reads them).
      The dump files are torch's ``TORCH_FR_DUMP_TEMP_FILE`` prefix plus the rank (torch's default, or
      the user's). A buffer size the user gave under either name (``TORCH_FR_BUFFER_SIZE``, which torch
      reads first) is kept.

    >>> env = nccl_environment(300, environ={})
    >>> env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]
    ('1', '302')
    >>> env["TORCH_NCCL_TRACE_BUFFER_SIZE"], env["TORCH_NCCL_DUMP_ON_TIMEOUT"]
    ('2000', '1')
    >>> nccl_environment(300, environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}).get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    >>> "TORCH_NCCL_TRACE_BUFFER_SIZE" in nccl_environment(300, environ={"TORCH_FR_BUFFER_SIZE": "0"})
    False
    """
    env = os.environ if environ is None else environ
    timeout_s = check_timeout(timeout_s, "timeout")
    want = {NCCL_ASYNC_ERROR_HANDLING: "1", NCCL_ENABLE_MONITORING: "1",
            NCCL_HEARTBEAT_TIMEOUT: str(int(math.ceil(timeout_s + watchdog_grace(timeout_s)))),
            NCCL_DUMP_ON_TIMEOUT: "1"}
    if FR_BUFFER_SIZE not in env:  # torch reads it before the older name: the user's size either way
        want[NCCL_TRACE_BUFFER_SIZE] = str(TRACE_BUFFER_ENTRIES)
    return {k: v for k, v in want.items() if k not in env}



class Watchdog:
    """The launcher's side of the heartbeat: a folder for the ranks' files, the environment that
    tells the ranks about it, and a thread naming (on ``stream``) and killing a rank whose heartbeat
    stopped for longer than ``timeout_s`` + :func:`watchdog_grace`.

    ``killed`` maps each rank it killed to the line it printed. Use it around the launch::

        with Watchdog(nproc=4, timeout_s=300, who="hpfunc launch") as dog:
            env = dog.env()     # for the ranks' environment
            ...                 # start the ranks, wait for them
    """

    def __init__(self, nproc: int | None, timeout_s: float, *, who: str = "hpfunc", stream: TextIO | None = None):
        self.nproc = nproc
        self.timeout_s = check_timeout(timeout_s, "timeout")
        self.who = who
        self.stream = stream
        self.interval = heartbeat_interval(self.timeout_s)
        self.limit = self.timeout_s + watchdog_grace(self.timeout_s)
        self.killed: dict[int, str] = {}
        self._killed_pids: set[int] = set()  # by pid: an elastic restart brings a rank back as a new process
        self.directory: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        """The environment variables the ranks need (inside the ``with``)."""
        assert self.directory is not None, "Watchdog.env() is for inside `with Watchdog(...)`"
        return {ENV_LAUNCHER_PID: str(os.getpid()), ENV_TIMEOUT: repr(self.timeout_s),
                ENV_HEARTBEAT_DIR: self.directory}

    def __enter__(self) -> "Watchdog":
        self.directory = tempfile.mkdtemp(prefix=f"hpfunc-heartbeat-{os.getpid()}-")
        self._thread = threading.Thread(target=self._watch, name="hpfunc-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.directory is not None:
            import shutil

            shutil.rmtree(self.directory, ignore_errors=True)

    def _watch(self) -> None:
        assert self.directory is not None
        me = os.getpid()
        while not self._stop.wait(self.interval):
            for rank, (pid, age) in sorted(_beats(self.directory).items()):
                if pid in self._killed_pids or age <= self.limit:
                    continue
                st = _stat(pid)
                if st is None or st[1] != me or st[0] == "Z":
                    continue  # gone, or not our child any more: the launcher reports its exit
                state = proc_state(pid)
                of = f" of {self.nproc}" if self.nproc else ""
                line = (f"{self.who}: rank {rank}{of} (pid {pid}) stopped responding: no heartbeat for "
                        f"{age:.1f} s, longer than the collective timeout of {self.timeout_s:g} s"
                        f"{f'; {state}' if state else ''}; killing it")
                self.killed[rank] = line
                self._killed_pids.add(pid)
                print(line, file=self.stream or sys.stderr, flush=True)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
