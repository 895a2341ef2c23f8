"""The rank pool (errors, hangs, restart), spmd, and the launch CLI over torch.distributed.run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hpfunc.launch import spmd, torchrun_args
from hpfunc.testing import RankPool, RankTimeout

pytestmark = pytest.mark.multirank


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _raise_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("only rank 1")
    return "fine"


def _hang_on_rank0():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(1))  # rank 0 never joins
    return True


def test_pool_runs_errors_and_restarts():
    with RankPool(2, timeout=20) as pool:
        assert pool.run(_rank) == [0, 1]
        assert pool.run(lambda a, b=0: a + b, 2, b=3) == [5, 5]  # closures travel by cloudpickle
        with pytest.raises(KeyError, match="only rank 1") as info:
            pool.run(_raise_on_rank1)
        assert "raised on rank 1" in "".join(getattr(info.value, "__notes__", []))
        with pytest.raises(RankTimeout, match="did not finish on ranks"):
            pool.run(_hang_on_rank0, timeout=5)
        assert pool.run(_rank) == [0, 1], "the pool must restart after a hang"
        assert pool.restarts == 1 and "ranks [1] hung" in pool.last_restart_reason, (
            pool.restarts, pool.last_restart_reason)


def test_spmd_returns_rank0_or_all(pool2):
    assert spmd(_rank, 2, pool=pool2) == 0
    assert spmd(_rank, 2, pool=pool2, return_all=True) == [0, 1]
    with pytest.raises(ValueError, match="pool of 2"):
        spmd(_rank, 4, pool=pool2)


def test_torchrun_args():
    assert torchrun_args(["--nproc", "4", "train.py", "--lr", "3"]) == [
        "--standalone", "--nproc-per-node", "4", "train.py", "--lr", "3"]
    assert torchrun_args(["--nproc=2", "--master-port", "1234", "s.py"]) == [
        "--nproc-per-node", "2", "--master-port", "1234", "s.py"]
    with pytest.raises(SystemExit, match="missing the script"):
        torchrun_args(["--nproc", "2"])


@pytest.mark.slow
def test_hpfunc_launch_runs_a_script_on_two_ranks(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import torch, hpfunc
        from hpfunc import P
        mesh = hpfunc.Mesh({"dp": 2})
        x = hpfunc.shard(torch.arange(8.0).reshape(4, 2), mesh, P("dp"))
        s = hpfunc.shard_map(lambda v: hpfunc.lax.psum(v.sum(), "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())(x)
        print(f"rank {mesh.axis_index('dp')} {hpfunc.typeof(x)} total={s.to_local().item():.0f}", flush=True)
        import os
        # one string, one write: the ranks share the launcher's stdout, and an unbuffered print of several
        # arguments writes them one by one, so two ranks' words could interleave within a line
        print(f"malloc {os.environ.get('MALLOC_MMAP_THRESHOLD_')} {os.environ.get('MALLOC_TRIM_THRESHOLD_')}", flush=True)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "hpfunc.launch", "--nproc", "2", str(script)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 0 f32[4@dp,2] total=28" in out.stdout and "rank 1 f32[4@dp,2] total=28" in out.stdout
    # the ranks' host allocator thresholds (hpfunc.host_memory), unless the environment set its own
    want = "malloc 268435456 268435456" if "MALLOC_MMAP_THRESHOLD_" not in env and "MALLOC_TRIM_THRESHOLD_" not in env \
        and env.get("HPFUNC_HOST_MALLOC", "hpfunc") == "hpfunc" else "malloc"
    assert out.stdout.count(want) == 2, out.stdout
