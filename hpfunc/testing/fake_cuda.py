"""A shape-only CUDA runtime for a CPU build of torch, so that fake CUDA tensors run whole training steps.

Under ``FakeTensorMode`` a tensor on ``"cuda"`` has a shape, a dtype and a device but no data, and
every aten op runs on it. Two pieces of torch's C++ outside the ops still ask the CUDA runtime,
which a CPU build does not have:

* the **device guard** that many Python bindings install before they dispatch (``x[0]``,
  ``x[:, 1:] = v``, ``int(x)``, ``x.contiguous()``, ``x.copy_(y)``) and that autograd reads when it
  records a CUDA input (``InputMetadata``: there a missing guard aborts the process);
* the **CUDA hooks** (``at::detail::getCUDAHooks().isBuilt()``), through which the autograd engine
  finds the accelerator whose streams it synchronizes gradients on: without them every backward
  pass through a CUDA tensor stops with ``Cannot access accelerator device when none is available``.

This module compiles (once per torch version, with the system C++ compiler, about 2-15 s; cached
under ``$HPFUNC_CACHE`` or ``~/.cache/hpfunc``) a small library with a CUDA device guard that keeps
no state (device 0, the default stream, events that are done at once) and CUDA hooks that say only
"built". Loaded into a process **before torch is imported** (the hooks are looked up once, at their
first use), it lets the unchanged torch code of a CUDA build run on fake CUDA tensors: Python
indexing, autograd with its stream bookkeeping, DTensor. It computes nothing and allocates nothing;
``torch.cuda.is_available()`` stays False. :func:`hpfunc.testing.fake_devices.run_on_fake_devices`
(``isolated=True``) loads it into its fresh process; a process that has imported torch cannot load it
(:func:`preload` refuses).

Loading it by hand (what the isolated run does; the child must not import torch first)::

    path = hpfunc.testing.fake_cuda.build()            # here: compiles once, imports torch
    # in a fresh interpreter, before ``import torch``:
    ctypes.CDLL(path).hpfunc_fake_cuda_on()
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["SOURCE", "build", "needed", "FakeCudaBuildError"]

SOURCE = r"""
// Shape-only CUDA runtime pieces for a CPU build of torch (hpfunc.testing.fake_cuda).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace at {
namespace {
// Says "built" only: the autograd engine then treats CUDA as the accelerator whose streams it syncs.
struct FakeCudaHooks final : CUDAHooksInterface {
  explicit FakeCudaHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};
}  // namespace
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks);
}  // namespace at

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;
constexpr DeviceType kCuda = DeviceType::CUDA;

// A device guard with no state: every device is current, every stream is the default one.
struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kCuda; }
  Device exchangeDevice(Device) const override { return Device(kCuda, 0); }
  Device getDevice() const override { return Device(kCuda, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const noexcept override {
    return Stream(Stream::DEFAULT, Device(kCuda, d.index() < 0 ? 0 : d.index()));
  }
  Stream getNewStream(Device d, int) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const noexcept override { return getStream(s.device()); }
  DeviceIndex deviceCount() const noexcept override { return 64; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
};
const FakeCudaGuard fake_cuda_guard;
}  // namespace

// 0: the fake guard is in place; 1: a real CUDA guard is registered (a CUDA build): left alone.
extern "C" int hpfunc_fake_cuda_on() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(kCuda)];
  const c10::impl::DeviceGuardImplInterface* cur = slot.load();
  if (cur == &fake_cuda_guard) return 0;
  if (cur != nullptr) return 1;
  slot.store(&fake_cuda_guard);
  return 0;
}
"""


class FakeCudaBuildError(RuntimeError):
    """The fake CUDA library could not be compiled (no C++ compiler, or no torch headers)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("HPFUNC_CACHE") or Path.home() / ".cache" / "hpfunc") / "fake_cuda"


def needed(device_type: str) -> bool:
    """Whether fake ``device_type`` tensors need this runtime: ``"cuda"`` on a torch built without CUDA.

    >>> needed("cpu")
    False
    """
    import torch

    return device_type == "cuda" and not torch.backends.cuda.is_built()


def build() -> str:
    """Compile the library once for this torch (cached) and return its path. Imports torch (for its
    headers and libraries); load the result in another, fresh process (:func:`preload`)."""
    import torch

    tdir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(f"{SOURCE}|{torch.__version__}|{tdir}|{abi}".encode()).hexdigest()[:16]
    out = _cache_dir() / f"fake_cuda_{key}.so"
    if out.exists():
        return str(out)
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise FakeCudaBuildError("hpfunc.testing.fake_cuda: no C++ compiler found (looked for $CXX, g++, c++); "
                                 "fake CUDA training steps need one to build their shape-only CUDA runtime once")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "fake_cuda.cpp"
        src.write_text(SOURCE)
        so = Path(tmp) / out.name
        cmd = [cxx, "-O1", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
               f"-I{tdir / 'include'}", str(src), f"-L{tdir / 'lib'}", "-lc10", "-ltorch_cpu",
               f"-Wl,-rpath,{tdir / 'lib'}", "-o", str(so)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FakeCudaBuildError(f"hpfunc.testing.fake_cuda: compiling the fake CUDA runtime failed "
                                     f"({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        os.replace(so, out)  # atomic: concurrent builders each write their own temporary file
    return str(out)

