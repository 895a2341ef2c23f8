"""The host allocator of the ranks hpfunc starts: glibc malloc's two thresholds, raised.

glibc's ``malloc`` hands memory back to the operating system in two ways: a block larger than
``M_MMAP_THRESHOLD`` is mapped on its own and unmapped when freed, and when the free space at the top
of the heap grows past ``M_TRIM_THRESHOLD`` the heap is shrunk. Both thresholds adapt to the largest
block freed so far, up to 32 MiB. Every page handed back is page-faulted in (and zeroed) again when it
is next allocated. A training step frees and allocates the same large tensors every step (each
microbatch's gradients, the activations, an optimizer's temporaries), so where those land at the top of
the heap the allocator returns and refetches them step after step. Measured on hpfunc's pipelined
Qwen3 step (``bench/pipeline.py``'s model at hidden 512, 2 pipeline ranks, 1f1b, 8 microbatches):
4,000-14,000 page faults a step per rank (mostly in the first backwards of a step), 12 with both
thresholds at 256 MiB, and the step's CPU time 9% lower (median of 6 steps, 4 runs alternating the two
settings); torch's twin in the same processes faulted in some steps too and gained 4%. The tiny main
job does not change (its tensors are small enough for glibc's adaptation). A tensor above 32 MiB (a
large embedding's gradient) is mapped and unmapped every step whatever the heap looks like (a 48 MiB
one: 12,289 faults a step); with the thresholds raised glibc keeps it when it can grow its heap in
place, which depends on the process's address layout, and blocks above 256 MiB are mapped each time. A
caching allocator (jemalloc or tcmalloc through ``LD_PRELOAD``) avoids all of that.

So the ranks that ``hpfunc launch``, ``hpfunc train``, :func:`hpfunc.launch.spmd` and
:class:`hpfunc.testing.RankPool` start get ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` of
256 MiB in their environment (glibc reads them when a process starts; other C libraries ignore them):
freed memory up to that size stays in the process for the next step, as a caching allocator keeps it.
Nothing is changed when the environment already sets either variable (set both: setting one turns
glibc's adaptation of the other off, and with it a 128 KiB mmap threshold faults on almost every
tensor), or when ``HPFUNC_HOST_MALLOC=system``. Ranks started by torch's own launcher directly
(``torchrun``) keep the system's defaults unless their environment sets these.

    >>> rank_environment({})["MALLOC_MMAP_THRESHOLD_"]
    '268435456'
    >>> rank_environment({"MALLOC_TRIM_THRESHOLD_": "0"}), rank_environment({"HPFUNC_HOST_MALLOC": "system"})
    ({}, {})
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["THRESHOLD_BYTES", "rank_environment"]

THRESHOLD_BYTES = 256 << 20
_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_SWITCH = "HPFUNC_HOST_MALLOC"


def rank_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to a rank's environment (see the module docstring): both thresholds at
    :data:`THRESHOLD_BYTES`, or nothing when ``environ`` (default ``os.environ``) sets either one or
    ``HPFUNC_HOST_MALLOC`` is ``system``.

    Raises:
        ValueError: ``HPFUNC_HOST_MALLOC`` is set to something other than ``system`` or ``hpfunc``.
    """
    env = os.environ if environ is None else environ
    choice = env.get(_SWITCH, "hpfunc").strip().lower()
    if choice not in ("hpfunc", "system"):
        raise ValueError(f"{_SWITCH}={env[_SWITCH]!r}: expected 'hpfunc' (raise glibc's malloc thresholds in the "
                         f"ranks hpfunc starts, the default) or 'system' (leave the allocator as it is)")
    if choice == "system" or any(v in env for v in _VARIABLES):
        return {}
    return {v: str(THRESHOLD_BYTES) for v in _VARIABLES}
