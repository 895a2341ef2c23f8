"""Run a function as one rank of a large world on fake devices: no accelerator, no peers, no values.

:func:`run_on_fake_devices` runs ``fn`` as rank ``rank`` of a world of ``world_size`` on devices of
type ``device_type`` (``"cuda"`` works on a CPU-only build of torch): torch's fake process group
(``init_process_group("fake")``: every collective returns at once, with garbage values) and
``FakeTensorMode`` (tensors carry shape, dtype and device, never data). A :class:`DeviceRecorder`
sits above the fake mode and sees every aten op the function runs. It records

* the device of every tensor an op creates (``devices``, and the ones off the target device in
  ``off_device`` with the op and the source line);
* every **host sync**, three kinds:

  (a read of a CPU tensor waits for no device and is not counted: hpfunc's optimizer step counters
  live on the host for that reason)

  - ``"scalar read"``: ``aten._local_scalar_dense`` (``.item()``, ``.tolist()``, ``int(t)``, ``float(t)``,
    ``bool(t)``, an ``if`` on a tensor), and the other ops torch tags ``data_dependent_output``
    (``torch.equal``, ...);
  - ``"data-dependent shape"``: ops torch tags ``dynamic_output_shape`` (``nonzero``, ``masked_select``,
    ``unique``, ``repeat_interleave`` without ``output_size``, boolean-mask indexing): the host must
    wait for the device to learn the output's size;
  - ``"copy to host"``: a blocking copy from the device to the CPU (``.cpu()``, ``.to("cpu")``,
    ``copy_`` into a CPU tensor without ``non_blocking=True``).

On a fake tensor a host sync has no answer. ``on_host_sync="raise"`` (the default) raises
:class:`HostSyncError` naming the op and the source line; a callable ``on_host_sync(sync, func, args,
kwargs)`` answers it instead (a stand-in value of the op's result: e.g. the worst-case capacity for a
padded dispatcher), and the run goes on, every sync counted. The mesh is made outside FakeTensorMode
(a DeviceMesh needs real rank tensors).

The process must not have a default process group already (the fake one becomes the default for the
duration of the call and is destroyed after it); ``isolated=True`` runs the whole call in a fresh
spawned process instead (``fn`` and its result must then be picklable).

Example (rank 5 of 256 on a ``{fsdp: 32, tp: 8}`` mesh of fake GPUs; ``fn`` must be importable)::

    def f(mesh):
        x = torch.randn(1024, 1024, device=mesh.device_type)
        return tuple((x @ x).shape), mesh.coordinate()

    out = run_on_fake_devices(f, world_size=256, rank=5, mesh={"fsdp": 32, "tp": 8}, isolated=True)
    out.result                 # ((1024, 1024), (0, 5))
    out.record.host_syncs      # []

The recorder alone, under a fake mode (no process group needed):

    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> rec = DeviceRecorder("cuda")
    >>> with FakeTensorMode(), rec:
    ...     x = torch.ones(4, device="cuda")
    ...     i = torch.arange(4)  # no device: a CPU tensor, recorded off the device
    >>> dict(rec.devices), [(c.op, c.device) for c in rec.off_device]
    ({'cuda': 1, 'cpu': 1}, [('arange', 'cpu')])
    >>> [(c.op, c.device) for c in rec.off_device]
    [('arange', 'cpu')]
    >>> with FakeTensorMode(), rec:
    ...     torch.ones(4, device="cuda").sum().item()
    Traceback (most recent call last):
    ...
    hpfunc.testing.fake_devices.HostSyncError: host sync (scalar read: aten._local_scalar_dense) at ...
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import traceback
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NO_SYNC", "device_of", "HostSync", "Created", "HostSyncError", "DeviceRecorder", "FakeRun", "fake_world",
           "run_on_fake_devices", "answer_host_syncs"]

_aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS = os.path.abspath(__file__)
_SKIP = (_TORCH_DIR, _THIS, os.path.dirname(contextlib.__file__))


NO_SYNC = object()  # DeviceRecorder.host_sync's answer for an op that is no host sync (or a copy that runs)


class HostSync(NamedTuple):
    """One host sync: its kind (``"scalar read"``, ``"data-dependent shape"``, ``"copy to host"``),
    the aten op and the innermost source line outside torch (``file:line in function``)."""

    kind: str
    op: str
    where: str


class Created(NamedTuple):
    """A tensor an op created off the target device."""

    op: str
    device: str
    shape: tuple
    dtype: torch.dtype
    where: str


class HostSyncError(RuntimeError):
    """A host sync on fake devices with ``on_host_sync="raise"``: the message names the op and line."""


def _where() -> str:
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if not f.startswith(_SKIP):
            return f"{os.path.relpath(f) if f.startswith(os.getcwd()) else f}:{fr.lineno} in {fr.name}"
    return "<unknown>"


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


def _has_tag(func: Any, name: str) -> bool:
    tag = getattr(torch.Tag, name, None)
    return tag is not None and tag in getattr(func, "tags", ())


def _shape_given(func: Any, args: tuple, kwargs: dict) -> bool:
    """Ops torch tags data-dependent whose output size is known here without the values: ``aten.index``
    with integer indices only (the indices' shape; the boolean-mask form does wait for the device) and
    ``repeat_interleave`` given its ``output_size``."""
    if func is _aten.index.Tensor:
        return all(i is None or not (i.dtype == torch.bool or i.dtype == torch.uint8) for i in args[1])
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is not None
    return False


_PRIM_DEVICE = torch.ops.prim.device.default


def device_of(args: tuple) -> Any:
    """The answer to ``prim.device(t)`` (``t.device``), as the fake tensor gives it, without passing it down
    the modes below: autograd asks the device of every input of every op it records or runs, about half
    the ops a fake training step dispatches. A tensor that is not fake is asked itself."""
    from torch._subclasses.fake_tensor import FakeTensor

    (t,) = args
    if isinstance(t, FakeTensor):
        return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
    return _PRIM_DEVICE(t)


class DeviceRecorder(TorchDispatchMode):
    """A dispatch mode that records where every tensor is created and every host sync (see the module).

    Enter it inside ``FakeTensorMode`` (it must see each op before the fake mode does).

    Attributes:
      devices: ``Counter`` of device types over every tensor every op returned.
      off_device: :class:`Created` for each tensor returned on another device type than ``device_type``.
      host_syncs: :class:`HostSync` in the order they happened.
      host_reads: reads of a host (CPU) tensor's value: no device waits for them, so they are not host
        syncs; on fake tensors they need an answer all the same (kind ``"host read"``).
    """

    def __init__(self, device_type: str = "cuda", on_host_sync: Union[str, Callable] = "raise"):
        super().__init__()
        if on_host_sync != "raise" and not callable(on_host_sync):
            raise ValueError(f"on_host_sync: expected 'raise' or a callable (sync, func, args, kwargs) -> result, "
                             f"found {on_host_sync!r}")
        self.device_type = device_type
        self.on_host_sync = on_host_sync
        self.devices: collections.Counter = collections.Counter()
        self.off_device: list[Created] = []
        self.host_syncs: list[HostSync] = []
        self.host_reads: list[HostSync] = []  # values of host tensors read (no device waits; still no value)
        self._may_sync: dict[Any, bool] = {}  # per op: can it be a host sync at all (most ops cannot)

    def may_sync(self, func: Any) -> bool:
        """Whether ``func`` can be a host sync for some arguments (a scalar read, a data-dependent shape,
        a copy): checked once per op, so that the other ops pay one dictionary lookup."""
        hit = self._may_sync.get(func)
        if hit is None:
            hit = self._may_sync[func] = (
                func is _aten._local_scalar_dense.default or func is _aten._to_copy.default
                or func is _aten.copy_.default or _has_tag(func, "data_dependent_output")
                or _has_tag(func, "dynamic_output_shape"))
        return hit

    def host_sync(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Record the host sync ``func(*args, **kwargs)`` makes, if any, and answer it: the stand-in of
        ``on_host_sync`` (raised on with ``"raise"``), or :data:`NO_SYNC` when the op is no sync or a
        copy to host (which runs as it is)."""
        kind = self._sync_kind(func, args, kwargs)
        if kind is None:
            return NO_SYNC
        sync = HostSync(kind, str(func.overloadpacket.__name__), _where())
        (self.host_reads if kind == "host read" else self.host_syncs).append(sync)
        if self.on_host_sync == "raise":
            if kind == "host read":
                raise HostSyncError(
                    f"a value of a host tensor is read (aten.{sync.op}) at {sync.where}: no device waits for it, "
                    f"but a fake tensor has no value; answer it with on_host_sync=")
            raise HostSyncError(
                f"host sync ({sync.kind}: aten.{sync.op}) at {sync.where}; a step on {self.device_type} must "
                f"keep values on the device (or document this sync and answer it with on_host_sync=)")
        if kind == "copy to host":
            return NO_SYNC
        return self.on_host_sync(sync, func, args, kwargs)

    def _sync_kind(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        # reading a value of a host tensor waits for no device: only device tensors' reads count
        on_device = any(t.device.type != "cpu" for t in _tensors(list(args)))
        if func is _aten._local_scalar_dense.default or _has_tag(func, "data_dependent_output"):
            return "scalar read" if on_device else "host read"
        if on_device and _has_tag(func, "dynamic_output_shape") and not _shape_given(func, args, kwargs):
            return "data-dependent shape"
        if func is _aten._to_copy.default:
            src, dev = args[0], kwargs.get("device")
            if (dev is not None and torch.device(dev).type == "cpu" and src.device.type != "cpu"
                    and not kwargs.get("non_blocking", False)):
                return "copy to host"
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if (dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu"
                    and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))):
                return "copy to host"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE:
            return device_of(args)
        kwargs = kwargs or {}
        if self.may_sync(func):
            answer = self.host_sync(func, args, kwargs)
            if answer is not NO_SYNC:
                return answer
        out = func(*args, **kwargs)
        for t in _tensors(out):
            dev = t.device.type
            self.devices[dev] += 1
            if dev != self.device_type:
                self.off_device.append(Created(str(func.overloadpacket.__name__), str(t.device), tuple(t.shape),
                                               t.dtype, _where()))
        return out


class answer_host_syncs:  # noqa: N801 -- used like a function: on_host_sync=answer_host_syncs(4)
    """An ``on_host_sync`` policy for dry runs: a scalar read answers ``scalar`` (cast to the tensor's
    kind); a data-dependent shape still raises (it has no stand-in shape). Picklable (isolated runs).

    >>> answer_host_syncs(7)(HostSync("scalar read", "_local_scalar_dense", ""),
    ...                      torch.ops.aten._local_scalar_dense.default, (torch.zeros((), dtype=torch.long),), {})
    7
    """

    def __init__(self, scalar: Union[int, float, bool] = 0):
        self.scalar = scalar

    def __call__(self, sync: HostSync, func: Any, args: tuple, kwargs: dict) -> Any:
        if sync.kind not in ("scalar read", "host read") or func is not _aten._local_scalar_dense.default:
            raise HostSyncError(f"host sync ({sync.kind}: aten.{sync.op}) at {sync.where} has no stand-in value")
        dt = args[0].dtype
        if dt == torch.bool:
            return bool(self.scalar)
        return float(self.scalar) if dt.is_floating_point else int(self.scalar)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """torch's fake process group as the default group of this process, as rank ``rank`` of ``world_size``;
    destroyed on exit. Refused when a process group is already running here."""
    import torch.distributed as dist

    if not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank must be in [0, {world_size}), found {rank}")
    if dist.is_initialized():
        raise RuntimeError("fake_world: this process already has a default process group (backend "
                           f"{dist.get_backend()!r}); run on fake devices in a fresh process (isolated=True)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class FakeRun(NamedTuple):
    """What :func:`run_on_fake_devices` returns: ``fn``'s result and the :class:`DeviceRecorder`."""

    result: Any
    record: DeviceRecorder


def run_on_fake_devices(fn: Callable, *args: Any, world_size: int, rank: int = 0, device_type: str = "cuda",
                        mesh: Mapping[str, int] | None = None, on_host_sync: Union[str, Callable] = "raise",
                        isolated: bool = False, **kwargs: Any) -> FakeRun:
    """Run ``fn(*args, **kwargs)`` (``fn(mesh, *args, **kwargs)`` when ``mesh`` axes are given: an
    :class:`hpfunc.Mesh` of ``device_type`` made before the fake mode starts) as rank ``rank`` of
    ``world_size`` on fake ``device_type`` devices, recording devices and host syncs (see the module).

    ``isolated=True``: in a fresh spawned process (the recorder's lists come back; ``fn``, its
    arguments and result must be picklable). Errors inside ``fn`` are raised here.
    """
    if isolated:
        return _run_isolated(fn, args, kwargs, dict(world_size=world_size, rank=rank, device_type=device_type,
                                                     mesh=dict(mesh) if mesh else None, on_host_sync=on_host_sync))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_world(world_size, rank):
        if mesh:
            from hpfunc.mesh import Mesh

            m = Mesh(dict(mesh), device_type=device_type)
            args = (m, *args)
        recorder = DeviceRecorder(device_type, on_host_sync)
        with FakeTensorMode(allow_non_fake_inputs=True), recorder:
            result = fn(*args, **kwargs)
        return FakeRun(result, recorder)


# The child interpreter: loads the fake CUDA runtime (when given) before anything imports torch, then
# reads (sys.path, fn, args, kwargs, options) from stdin and writes its answer to the file in argv[2].
_BOOT = (
    "import sys, ctypes, pickle\n"
    "if sys.argv[1]:\n"
    "    assert ctypes.CDLL(sys.argv[1]).hpfunc_fake_cuda_on() == 0\n"
    "sys.path[:] = pickle.load(sys.stdin.buffer)\n"
    "from hpfunc.testing.fake_devices import _child_main\n"
    "_child_main(sys.stdin.buffer, sys.argv[2])\n"
)


def _child_main(stdin: Any, answer: str) -> None:
    import pickle

    try:
        fn, args, kwargs, options = pickle.load(stdin)
        run = run_on_fake_devices(fn, *args, **options, **kwargs)
        rec = run.record
        out = ("ok", (run.result, rec.device_type, rec.devices, rec.off_device, rec.host_syncs, rec.host_reads))
    except BaseException as e:  # noqa: BLE001 -- sent to the parent, which raises it
        out = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    with open(answer, "wb") as f:
        pickle.dump(out, f)


def _run_isolated(fn: Callable, args: tuple, kwargs: dict, options: dict) -> FakeRun:
    import pickle
    import subprocess
    import tempfile

    from hpfunc.testing import fake_cuda

    lib = fake_cuda.build() if fake_cuda.needed(options["device_type"]) else ""
    with tempfile.TemporaryDirectory() as tmp:
        answer = os.path.join(tmp, "answer.pickle")
        payload = pickle.dumps(list(sys.path)) + pickle.dumps((fn, args, kwargs, options))
        proc = subprocess.run([sys.executable, "-c", _BOOT, lib, answer], input=payload, capture_output=True)
        if not os.path.exists(answer):
            raise RuntimeError(f"run_on_fake_devices(isolated=True): the child process died (exit code "
                               f"{proc.returncode}) before answering; its stderr:\n"
                               f"{proc.stderr.decode(errors='replace')[-4000:]}")
        with open(answer, "rb") as f:
            status, payload = pickle.load(f)
    if status == "error":
        name, msg, tb = payload
        cls = HostSyncError if name == "HostSyncError" else RuntimeError
        raise cls(f"{msg}\n(in the isolated fake-device process; its traceback:)\n{tb}" if cls is RuntimeError
                  else msg)
    result, device_type, devices, off_device, host_syncs, host_reads = payload
    rec = DeviceRecorder(device_type)
    rec.devices, rec.off_device, rec.host_syncs, rec.host_reads = devices, off_device, host_syncs, host_reads
    return FakeRun(result, rec)
