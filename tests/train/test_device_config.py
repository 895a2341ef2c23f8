"""parallel.device (auto | cpu | cuda) and ``hpfunc launch --nproc gpu`` on this CPU-only machine."""

from __future__ import annotations

import pytest
import torch
import yaml

from _train_helpers import TINY

from hpfunc.launch import UsageError, parse_args
from hpfunc.train.cli import main as train_main
from hpfunc.train.config import ConfigError, config_to_dict, load_config_dict
from hpfunc.train.device import backend_for, resolve_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")


def test_device_key_parses_round_trips_and_names_itself():
    pc = load_config_dict({"parallel": {"device": "cuda"}}).parallel
    assert pc.device == "cuda" and config_to_dict(load_config_dict({"parallel": {"device": "cuda"}}))["parallel"] == {
        "device": "cuda"}
    assert load_config_dict({}).parallel.device == "auto"
    with pytest.raises(ConfigError, match=r"parallel.device: expected one of auto, cpu, cuda .*found string 'gpu'"):
        load_config_dict({"parallel": {"device": "gpu"}})


def test_resolution_on_this_machine_and_with_gpus():
    cfg = lambda d, **mesh: load_config_dict(  # noqa: E731
        {"parallel": {"device": d, **({"mesh": mesh, "plan": ["fsdp"]} if mesh else {})}}).parallel
    assert resolve_device(cfg("auto")) == "cpu" and resolve_device(cfg("cpu")) == "cpu"
    with pytest.raises(ConfigError, match=r"^parallel.device: cuda was asked for but this machine has no CUDA"):
        resolve_device(cfg("cuda"))
    # as a machine with GPUs would answer
    assert resolve_device(cfg("auto"), cuda_count=8) == "cuda" and resolve_device(cfg("cpu"), cuda_count=8) == "cpu"
    assert resolve_device(cfg("cuda", fsdp=4), cuda_count=4) == "cuda"
    with pytest.raises(ConfigError, match="parallel.device: cuda with 8 processes on this machine but it has 4 GPU"):
        resolve_device(cfg("cuda", fsdp=8), cuda_count=4)
    assert (backend_for("cuda"), backend_for("cpu")) == ("nccl", "gloo")


def test_train_with_cuda_on_this_machine_is_a_config_error_before_launch(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    # a 2-process mesh: the error must come before any rank is started (no output folder either)
    path.write_text(yaml.safe_dump(dict(TINY, output={"dir": str(tmp_path / "out")},
                                        parallel={"mesh": {"fsdp": 2}, "plan": ["fsdp"]})))
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--set", "parallel.device=cuda"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config error: parallel.device: cuda was asked for but this machine has no CUDA device" in err
    assert not (tmp_path / "out").exists()


def test_launch_nproc_gpu_without_cuda_is_a_usage_error():
    with pytest.raises(UsageError, match="--nproc gpu: this machine has no CUDA device") as info:
        parse_args(["--nproc", "gpu", "s.py"])
    assert info.value.code == 2
    assert parse_args(["--nproc", "cpu", "s.py"]).torchrun == ["--standalone", "--nproc-per-node", "cpu", "s.py"]


def test_one_process_with_cuda_on_this_machine_is_a_config_error_before_any_file(tmp_path, capsys):
    """No mesh: the single-process trainer runs on parallel.device too, so cuda here is the same error
    (exit 2), from the CLI and from the Trainer, before the output folder is made."""
    from hpfunc.train import Trainer

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(dict(TINY, output={"dir": str(tmp_path / "out")})))
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "--set", "parallel=null", "--set", "parallel.device=cuda"])
    assert info.value.code == 2
    assert "config error: parallel.device: cuda was asked for but this machine has no CUDA device" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^parallel.device: cuda was asked for"):
        Trainer(dict(TINY, output={"dir": str(tmp_path / "out2")}, parallel={"device": "cuda"}), echo=False).run()
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()
