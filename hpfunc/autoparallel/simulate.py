"""Single-card cluster simulation: all N ranks of a parallel training config, with real values, in one
process, with the per-step losses of the real N-process run.

:func:`simulate` runs the program every rank of ``hpfunc train`` runs (:class:`hpfunc.train.Trainer` on
``parallel.mesh``) once per rank, in N threads of this process. Each thread is a whole rank: its own
default process group, ``hpfunc.Mesh`` and DeviceMesh with their axis groups, its own data shard,
parameter and optimizer blocks, its own ContextVar scopes (a thread starts with an empty context, so
the layout binding, the current mesh and the comm counter of one rank are never seen by another).
Nothing of the step is replaced: the collectives are gloo's, as in ``hpfunc train`` on gloo ranks, so
the simulation's per-step losses equal the real run's (bitwise in the tests).

The mechanism is torch's own, the one its ``MultiThreadedTestCase`` uses: ``torch.distributed``'s world
(default group, group maps, counters) made thread-local (``ThreadLocalWorld`` of
``torch.testing._internal.distributed.multi_threaded_pg``) and c10d's registry of groups by name in
thread-isolation mode; each thread then calls ``init_process_group("gloo", store=..., rank=r)`` on one
in-process :class:`torch.distributed.HashStore`. Both are private torch APIs (checked on torch 2.13).
torch's ``LocalTensorMode`` (one SPMD program over per-rank values) does not fit hpfunc: hpfunc's ranks
run Python that depends on the rank (``dist.get_rank()`` picks a slice of the mesh's rank table, the
data shard, rank 0's writes), which ``LocalTensorMode`` answers with a symbolic integer.

What a simulation is not: it computes every rank on this host's CPU (``parallel.device`` is set to
``cpu``), one rank at a time under Python's GIL, so its wall time says nothing about the real run's;
the memory it needs is the sum of all ranks'. Use small sizes (``--set``) and few steps.

A rank that raises is reported as :class:`SimulationError` naming it, once every rank has stopped:
the failed rank's process groups are destroyed and its frames cleared, so that its gloo connections
close as a dead process's do and the peers waiting on it fail at once. Not always: in the tests a peer
that entered a collective with the failed rank after that rank had gone waited out
``parallel.timeout_s`` (as a rank waiting forever does).

Example (two ranks of a tiny dense model, fsdp over 2, two steps; ~2 s)::

    >>> cfg = {"model": {"preset": "qwen3-dense-tiny", "num_hidden_layers": 1}, "data": {"max_bytes": 20000},
    ...        "train": {"steps": 2, "batch_size": 2, "seq_len": 8, "num_threads": 1, "eval_every": 0},
    ...        "output": {"progress": "none", "plot": False, "sample_tokens": 0},
    ...        "parallel": {"mesh": {"fsdp": 2}, "plan": ["fsdp"]}}
    >>> sim = simulate(cfg)
    >>> len(sim.ranks), len(sim.losses), sim.disagreements()
    (2, 2, [])
    >>> sim.ranks[1].coordinate
    {'fsdp': 1}
    >>> simulate(cfg, world=3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpfunc.autoparallel.simulate.SimulationInputError: parallel.mesh: the mesh {'fsdp': 2} has 2 ranks, the world is 3; ...
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import gc
import math
import pathlib
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs

__all__ = ["SimulationError", "SimulationInputError", "RankRun", "Simulation", "simulate", "rank_run",
           "check_request", "format_simulation", "compare_records"]


class SimulationInputError(ValueError):
    """A simulation request the config cannot honour; the message names the config key or the argument."""


class SimulationError(RuntimeError):
    """A simulated rank failed. The message names the rank that failed first (the cause) and its error;
    ``failures`` holds ``(rank, error text, traceback text)`` of every rank that failed, cause first."""

    def __init__(self, message: str, failures: Sequence[tuple[int, str, str]] = ()):
        super().__init__(message)
        self.failures = list(failures)


@attrs.frozen
class RankRun:
    """What one rank did: its mesh coordinate, its per-step metrics (the scalars the step returned, on
    that rank), the collectives it issued (``hpfunc.comm_stats``: per collective, mesh axes and phase)
    and the L2 norm of its local block of every parameter after the last step (float64)."""

    rank: int
    coordinate: dict[str, int]
    steps: tuple[dict[str, float], ...]
    comm: tuple[dict[str, Any], ...]
    param_norms: dict[str, float]
    seconds: float

    @property
    def losses(self) -> list[float]:
        """This rank's loss of each applied step."""
        return [s["loss"] for s in self.steps]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True)


@attrs.frozen
class Simulation:
    """The result of :func:`simulate`: one :class:`RankRun` per rank (in rank order), rank 0's records (the
    lines of its metrics.jsonl) and summary, the wall time, and the output folder (``None`` when it was
    a temporary one, removed)."""

    world: int
    mesh: dict[str, int]
    ranks: tuple[RankRun, ...]
    records: tuple[dict[str, Any], ...]
    summary: dict[str, Any] | None
    seconds: float
    out_dir: str | None

    @property
    def losses(self) -> list[float]:
        """The per-step losses (rank 0's; every rank holds the same value: see :meth:`disagreements`)."""
        return self.ranks[0].losses

    def disagreements(self) -> list[str]:
        """The ranks whose per-step losses differ from rank 0's (the loss is replicated: none should)."""
        want = self.ranks[0].losses
        return [f"rank {r.rank}: {r.losses} (rank 0: {want})" for r in self.ranks[1:] if r.losses != want]

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "mesh": dict(self.mesh), "seconds": self.seconds, "out_dir": self.out_dir,
                "losses": self.losses, "ranks": [r.to_dict() for r in self.ranks],
                "records": list(self.records), "summary": self.summary}


# -- the request --------------------------------------------------------------------------------------------

def _load(config: Any, overrides: Sequence[str]) -> Any:
    from hpfunc.train.config import Config, config_to_dict, load_config, load_config_dict

    if isinstance(config, Config):
        return load_config_dict(config_to_dict(config), overrides) if overrides else config
    if isinstance(config, Mapping):
        return load_config_dict(dict(config), overrides)
    if isinstance(config, (str, pathlib.Path)):
        if not pathlib.Path(config).is_file():
            raise SimulationInputError(f"CONFIG: no file {str(config)!r}")
        return load_config(config, overrides)
    raise TypeError(f"simulate: expected a YAML path, a mapping or a hpfunc.train.Config, found "
                    f"{type(config).__name__}")


def check_request(config: Any, *, world: int | None = None, steps: int | None = None,
                  overrides: Sequence[str] = ()) -> tuple[Any, int]:
    """The checked config of a simulation and its world size, before any thread or group starts: the
    trainer's own checks (config, plan, callbacks), then ``world`` against ``parallel.mesh`` and
    ``steps``. ``steps`` sets ``train.steps`` (the run is that of the config with ``--set
    train.steps=K``, its schedule included); ``parallel.device`` is set to ``cpu``. Raises
    :class:`SimulationInputError` naming the key or the argument."""
    from hpfunc.train.config import ConfigError
    from hpfunc.train.trainer import Trainer

    extra = list(overrides)
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise SimulationInputError(f"--steps: expected an integer >= 1, found {steps!r}")
        extra.append(f"train.steps={steps}")
    extra.append("parallel.device=cpu")
    try:
        cfg = _load(config, extra)
        Trainer(cfg, echo=False)  # the trainer's checks: model, plan, batch split, callbacks and their options
    except ConfigError as err:
        raise SimulationInputError(str(err)) from None
    mesh = dict(cfg.parallel.mesh or {})
    size = math.prod(int(v) for v in mesh.values()) if mesh else 1
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise SimulationInputError(f"--world: expected an integer >= 1, found {world!r}")
    if size <= 1:
        raise SimulationInputError(
            f"parallel.mesh: {mesh or 'none'} is one process; there is nothing to simulate: set a mesh of more "
            f"than one rank (e.g. --set 'parallel={{mesh: {{fsdp: 2}}, plan: [fsdp]}}') or run hpfunc train")
    world = size if world is None else world
    if size != world:
        others = size // max(1, mesh.get("fsdp", 1))
        hint = (f"--set parallel.mesh.fsdp={world // others} or " if "fsdp" in mesh and world % others == 0 else "")
        raise SimulationInputError(
            f"parallel.mesh: the mesh {mesh} has {size} ranks, the world is {world}; the mesh must fill the world "
            f"exactly: change its axes ({hint}--set 'parallel.mesh={{...}}') or simulate --world {size}")
    return cfg, world


# -- one rank -----------------------------------------------------------------------------------------------

def _step_recorder(steps: list, on_step: Callable[[int, dict[str, float]], None] | None) -> Any:
    from hpfunc.train.callbacks.base import Callback, scalars

    class _Steps(Callback):
        every_rank = True  # each rank's own values

        def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
            values = scalars(metrics)
            steps.append({"step": float(step), **values})
            if on_step is not None:
                on_step(step, values)

    return _Steps()


def _local_norms(params: Any) -> dict[str, float]:
    import torch
    from torch.distributed.tensor import DTensor

    from hpfunc import tree

    out = {}
    for path, x in tree.leaves_with_paths(params):
        if isinstance(x, torch.Tensor):
            block = x.to_local() if isinstance(x, DTensor) else x
            out[path] = float(block.detach().double().norm())
    return out


def rank_run(config: Any, *, overrides: Sequence[str] = (), out_dir: str | pathlib.Path | None = None,
             overwrite: bool = False, echo: bool = False,
             on_step: Callable[[int, dict[str, float]], None] | None = None) -> RankRun:
    """Train ``config`` as this process's rank of its process group (a rank of ``hpfunc launch`` or of a
    :class:`~hpfunc.testing.RankPool`, or a simulated rank) and record what the rank did
    (:class:`RankRun`). The same function runs in each thread of :func:`simulate`, so a real run of it
    on N processes is the simulation's reference, rank for rank. ``on_step(step, scalars)`` is called
    after each applied step; rank 0 writes the run's folder (``out_dir``, as ``hpfunc train --out``)."""
    import torch.distributed as dist

    from hpfunc.comm import comm_stats
    from hpfunc.train.trainer import Trainer

    t0 = time.perf_counter()
    steps: list[dict[str, float]] = []
    trainer = Trainer(_load(config, overrides), callbacks=[_step_recorder(steps, on_step)], out_dir=out_dir,
                      echo=echo, overwrite=overwrite)
    with comm_stats() as stats:
        result = trainer.run()
    mesh = trainer.mesh
    coordinate = dict(zip(mesh.axis_names, mesh.coordinate())) if mesh is not None else {}
    return RankRun(rank=dist.get_rank() if dist.is_initialized() else 0, coordinate=coordinate, steps=tuple(steps),
                   comm=tuple(stats.by_collective()), param_norms=_local_norms(result.state.params),
                   seconds=time.perf_counter() - t0)


# -- N ranks in one process ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _thread_local_world() -> Iterator[Any]:
    """torch.distributed's world made thread-local for the duration (torch's own mechanism for
    in-process ranks); this thread's own world (its default group, if any) is back afterwards."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    c10d = dist.distributed_c10d
    if isinstance(c10d._world, ThreadLocalWorld):
        raise SimulationError("simulate: a simulation is already running in this process (torch.distributed's "
                              "world is thread-local); simulations run one at a time")
    saved = c10d._world
    world = c10d._world = ThreadLocalWorld()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        yield world
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        c10d._world = saved


def _preimport() -> None:
    """Import what the ranks run here first: N threads importing one module at once is slow and can
    trip over a module half-initialised by another, and a rank importing for seconds keeps its peers
    waiting in a collective (against ``parallel.timeout_s``)."""
    import torch._dynamo  # noqa: F401 -- DTensor.from_local imports it on first use: seconds, once
    import hpfunc.train.callbacks.base  # noqa: F401
    import hpfunc.train.distributed  # noqa: F401
    import hpfunc.train.loop  # noqa: F401
    import hpfunc.transforms.parallelize  # noqa: F401
    from hpfunc.train.build import model_spec

    del model_spec


def _clear_frames(error: BaseException) -> None:
    """Clear the locals of every frame in ``error``'s tracebacks, its causes and contexts included."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]


@attrs.define
class _Failure:
    rank: int
    when: float
    text: str
    trace: str
    peer_lost: bool


def simulate(config: Any, *, world: int | None = None, steps: int | None = None, overrides: Sequence[str] = (),
             out_dir: str | pathlib.Path | None = None, overwrite: bool = False, progress: bool = False,
             echo: bool = False) -> Simulation:
    """Run every rank of the parallel training ``config`` (a YAML path, a mapping or a
    :class:`hpfunc.train.Config`) in one process, one thread per rank over real gloo process groups,
    and return each rank's record (:class:`Simulation`).

    Args:
      world: the number of ranks (default: the size of ``parallel.mesh``, which must equal it).
      steps: ``train.steps`` of the simulated run (default: the config's).
      overrides: ``key.path=value`` strings, as ``hpfunc train --set``.
      out_dir: rank 0's output folder (metrics.jsonl, summary.json, ...); default a temporary folder,
        removed afterwards (the records and summary are in the result). ``overwrite`` as ``hpfunc train``.
      progress: print the start, each step once every rank has finished it (with the loss and whether
        the ranks agree) and the end to stderr.
      echo: rank 0 prints what ``hpfunc train`` prints (its start lines, progress and summary).

    Raises:
      SimulationInputError: a config error or a world the mesh does not fill (before anything starts).
      SimulationError: a rank failed (naming the first one).
    """
    import torch
    import torch.distributed as dist

    from hpfunc.faults import is_comm_failure
    from hpfunc.mesh import forget_process_group

    cfg, world = check_request(config, world=world, steps=steps, overrides=overrides)
    _preimport()
    mesh = dict(cfg.parallel.mesh)
    t0 = time.perf_counter()

    def say(text: str) -> None:
        if progress:
            print(f"[simulate {time.perf_counter() - t0:6.1f} s] {text}", file=sys.stderr, flush=True)

    lock = threading.Lock()
    step_values: dict[int, dict[int, dict[str, float]]] = collections.defaultdict(dict)
    total = cfg.train.steps

    def on_step(rank: int, step: int, values: dict[str, float]) -> None:
        with lock:
            step_values[step][rank] = values
            if len(step_values[step]) != world:
                return
            losses = [step_values[step][r].get("loss") for r in range(world)]
            agree = (f"the same on all {world} ranks" if len(set(losses)) == 1 else
                     "RANKS DIFFER: " + ", ".join(f"rank {r} {x!r}" for r, x in enumerate(losses)))
            del step_values[step]
        say(f"step {step}/{total}: loss {losses[0]:.6f} ({agree})")

    results: dict[int, RankRun] = {}
    failures: list[_Failure] = []
    threads_before = torch.get_num_threads()
    say(f"{world} ranks of mesh {mesh} in one process: a thread per rank, gloo process groups over an "
        f"in-process store; {total} step(s) of batch {cfg.train.batch_size} x {cfg.train.seq_len}")
    with contextlib.ExitStack() as stack:
        folder = str(out_dir) if out_dir is not None else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="hpfunc-simulate-"))
        world_obj = stack.enter_context(_thread_local_world())
        store = dist.HashStore()
        timeout = datetime.timedelta(seconds=float(cfg.parallel.timeout_s))

        def rank_main(rank: int) -> None:
            failed = False
            try:
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
                results[rank] = rank_run(cfg, out_dir=folder, overwrite=overwrite, echo=echo and rank == 0,
                                         on_step=lambda s, v: on_step(rank, s, v))
            except BaseException as e:  # noqa: BLE001 -- reported by the main thread, naming the rank
                failed = True
                with lock:
                    failures.append(_Failure(rank, time.monotonic(), f"{type(e).__name__}: {e}",
                                             "".join(traceback.format_exception(e)), is_comm_failure(e)))
                _clear_frames(e)  # the frames hold this rank's groups alive
                del e
            finally:
                if dist.distributed_c10d._world is world_obj and dist.is_initialized():
                    forget_process_group()
                    dist.destroy_process_group()
                    if failed:
                        # the failed rank's gloo context goes now, closing its connections: its peers' waits
                        # fail at once (as when a process dies) instead of after parallel.timeout_s
                        gc.collect()

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"hpfunc-simulated-rank-{r}", daemon=True)
                   for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.set_num_threads(threads_before)  # each rank sets train.num_threads (process-wide) and restores it
        if failures:
            failures.sort(key=lambda f: (f.peer_lost, f.when))  # the cause: the first that did not just lose a peer
            first = failures[0]
            others = [f.rank for f in failures[1:]]
            more = f"; ranks {others} failed after it" if others else ""
            say(f"rank {first.rank} failed: {first.text.splitlines()[0]}")
            raise SimulationError(f"simulated rank {first.rank} of {world} failed: {first.text}{more}",
                                  [(f.rank, f.text, f.trace) for f in failures])
        records, summary = _rank0_outputs(folder)
    seconds = time.perf_counter() - t0
    sim = Simulation(world=world, mesh=mesh, ranks=tuple(results[r] for r in range(world)), records=records,
                     summary=summary, seconds=seconds, out_dir=str(out_dir) if out_dir is not None else None)
    bad = sim.disagreements()
    say(f"done: {len(sim.losses)} step(s) on {world} ranks in {seconds:.1f} s"
        + (f"; ranks disagree: {bad}" if bad else ""))
    return sim


def _rank0_outputs(folder: str) -> tuple[tuple[dict[str, Any], ...], dict[str, Any] | None]:
    import json

    from hpfunc.train.output import read_metrics

    path = pathlib.Path(folder)
    records = tuple(read_metrics(path / "metrics.jsonl")) if (path / "metrics.jsonl").exists() else ()
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else None
    return records, summary


# -- reports ------------------------------------------------------------------------------------------------

def compare_records(simulated: Sequence[Mapping[str, Any]], real: Sequence[Mapping[str, Any]], *,
                    rtol: float = 1e-5) -> tuple[list[tuple[int, float, float | None]], float, list[str]]:
    """Compare the ``loss`` lines of two runs' metrics (a simulation's records and a real run's
    metrics.jsonl), step by step: ``(rows (step, simulated, real), the largest relative difference,
    problems)``; ``problems`` lists the steps beyond ``rtol`` and the steps one run logged and the other not.

    >>> compare_records([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}],
    ...                 [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.0}])[1:]
    (0.25, ['step 2: loss 1.5 simulated, 2.0 real (relative difference 2.50e-01 > rtol 1e-05)', 'step 3: logged by the real run only'])
    """
    sim = {int(r["step"]): float(r["loss"]) for r in simulated if "loss" in r}
    ref = {int(r["step"]): float(r["loss"]) for r in real if "loss" in r}
    rows, worst, problems = [], 0.0, []
    for step in sorted(set(sim) | set(ref)):
        a, b = sim.get(step), ref.get(step)
        rows.append((step, a, b))
        if a is None or b is None:
            problems.append(f"step {step}: logged by the {'real run' if a is None else 'simulation'} only")
            continue
        rel = abs(a - b) / max(abs(b), 1e-30)
        worst = max(worst, rel)
        if rel > rtol:
            problems.append(f"step {step}: loss {a!r} simulated, {b!r} real (relative difference {rel:.2e} > rtol "
                            f"{rtol:g})")
    return rows, worst, problems


def format_simulation(sim: Simulation) -> str:
    """The simulation as text (what ``hpfunc simulate`` prints): the per-step losses and gradient norms
    on every rank, then per rank its coordinate, the norm of its parameter blocks and what it sent."""
    from hpfunc.autoparallel.hardware import format_bytes

    lines = [f"simulated {sim.world} ranks of mesh {sim.mesh} in one process (a thread per rank, gloo): "
             f"{len(sim.losses)} step(s) in {sim.seconds:.1f} s",
             f"  {'step':>4}  {'loss':>12}  {'grad_norm':>12}  ranks"]
    for i, s in enumerate(sim.ranks[0].steps):
        same = all(r.steps[i] == s for r in sim.ranks[1:] if len(r.steps) > i)
        lines.append(f"  {int(s['step']):>4}  {s['loss']:>12.6f}  {s.get('grad_norm', float('nan')):>12.6f}  "
                     + (f"all {sim.world} equal" if same else "DIFFER: " + ", ".join(
                         f"rank {r.rank} {r.steps[i].get('loss')!r}" for r in sim.ranks if len(r.steps) > i)))
    lines.append(f"  {'rank':>4}  {'coordinate':<28}  {'|local params|':>14}  sent (hpfunc.lax collectives)")
    for r in sim.ranks:
        coord = ", ".join(f"{k} {v}" for k, v in r.coordinate.items())
        norm = math.sqrt(sum(v * v for v in r.param_norms.values()))
        sent = collections.Counter()
        for c in r.comm:
            sent[c["collective"]] += c["sent_bytes"]
        lines.append(f"  {r.rank:>4}  {coord:<28}  {norm:>14.6f}  "
                     + ", ".join(f"{op} {format_bytes(int(n))}" for op, n in sorted(sent.items())))
    bad = sim.disagreements()
    if bad:
        lines.append("the ranks' losses differ (they are replicated values; a bug): " + "; ".join(bad))
    return "\n".join(lines)
