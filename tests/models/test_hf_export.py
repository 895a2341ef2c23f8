"""Hugging Face exports keep the function or refuse: transformers' Qwen3-MoE has no expert-selection bias
(it drops ``mlp.gate.e_score_correction_bias``), so an MoE whose bias is nonzero is refused by
``save_pretrained`` and ``hpfunc convert`` unless ``drop`` (knowingly) or ``keep`` (for hpfunc's readers)
is given; a dense model and an MoE without bias load in transformers with hpfunc's logits (1e-4). The
4-rank export is tested in tests/checkpoint/test_checkpoint_hf.py. ``hpfunc convert`` of a trainer
checkpoint needs no ``--config``; the top-level CLI's usage errors exit 2."""

from __future__ import annotations

import pathlib

import pytest
import torch
import yaml

import hpfunc
from hpfunc import checkpoint
from hpfunc.cli import main
from hpfunc.models import preset, qwen3
from hpfunc.models.qwen3.hf import ExpertBiasError, expert_bias_effect

transformers = pytest.importorskip("transformers")
TOL = 1e-4
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _biased(cfg):
    params = qwen3.init(hpfunc.random.key(4), cfg)
    params["layers"][1]["moe"]["expert_bias"] = torch.arange(cfg.num_experts, dtype=torch.float32) / 4 - 1
    return params


def _unbiased(params):
    return hpfunc.tree.map_with_path(lambda p, t: torch.zeros_like(t) if p.endswith("expert_bias") else t, params)


def _transformers_logits(path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _max_diff(params, cfg, theirs) -> float:
    return (qwen3.apply(params, TOKENS, cfg) - theirs).abs().max().item()


@pytest.mark.parametrize("name", ["qwen3-dense-tiny", "qwen3-moe-tiny"])
def test_dense_and_unbiased_moe_load_in_transformers_with_our_logits(tmp_path, name):
    cfg = preset(name)
    params = qwen3.init(hpfunc.random.key(5), cfg)
    qwen3.save_pretrained(params, cfg, tmp_path)  # a zero bias is no reason to refuse
    assert _max_diff(params, cfg, _transformers_logits(tmp_path)) <= TOL


def test_save_pretrained_refuses_a_nonzero_expert_bias_then_drops_or_keeps_it_when_told(tmp_path):
    cfg = preset("qwen3-moe-tiny")
    params = _biased(cfg)
    effect = expert_bias_effect(params, cfg)
    assert effect.max_abs_logit_change > 1e-2 and effect.top1_agreement < 1
    with pytest.raises(ExpertBiasError) as info:
        qwen3.save_pretrained(params, cfg, tmp_path / "refused")
    msg = str(info.value)
    assert "transformers' Qwen3-MoE has no such bias" in msg and "'model.layers.1.mlp.gate.e_score_correction_bias'" in msg
    assert "expert_bias='drop'" in msg and "expert_bias='keep'" in msg
    assert f"logits change by up to {effect.max_abs_logit_change:.3g}" in msg  # the measured change, quoted
    assert not (tmp_path / "refused").exists()

    qwen3.save_pretrained(params, cfg, tmp_path / "drop", expert_bias="drop")
    theirs = _transformers_logits(tmp_path / "drop")
    assert _max_diff(_unbiased(params), cfg, theirs) <= TOL  # the function written is the unbiased one
    assert _max_diff(params, cfg, theirs) > 1e-2  # ... which is not the trained one

    qwen3.save_pretrained(params, cfg, tmp_path / "keep", expert_bias="keep")
    back = qwen3.from_pretrained(tmp_path / "keep")[1]
    assert all(torch.equal(a, b) for a, b in zip(hpfunc.tree.leaves(back), hpfunc.tree.leaves(params)))
    with pytest.raises(ValueError, match="expert_bias must be one of 'refuse', 'keep', 'drop', found 'ignore'"):
        qwen3.save_pretrained(params, cfg, tmp_path / "x", expert_bias="ignore")


# -- hpfunc convert of a trainer checkpoint -------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run of the trainer on a tiny MoE (expert bias on, as by default), checkpointed."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "train"))
    from _train_helpers import TINY, write_corpus

    from hpfunc.train.cli import main as train_main

    d = tmp_path_factory.mktemp("run")
    write_corpus(d / "corpus")
    cfg = dict(TINY, data={**TINY["data"], "paths": [str(d / "corpus" / "*.py")]},
               train={**TINY["train"], "steps": 3, "eval_every": 0},
               output={**TINY["output"], "dir": str(d / "out"), "progress": "none", "sample_tokens": 0},
               checkpoint={"every": 3, "async_save": False})
    (d / "run.yaml").write_text(yaml.safe_dump(cfg))
    train_main([str(d / "run.yaml")])
    ckpt = checkpoint.latest(d / "out" / "checkpoints")
    assert ckpt is not None
    return d, pathlib.Path(ckpt)


def _checkpoint_params(ckpt: pathlib.Path, cfg):
    """The parameters of a checkpoint, read with torch.distributed.checkpoint alone (its keys are paths)."""
    import torch.distributed.checkpoint as dcp

    keys = checkpoint.info(ckpt)["keys"]
    sd = {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"])) for k, v in keys.items()
          if k.startswith("params.")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    return hpfunc.tree.map_with_path(lambda p, s: sd["params." + p], qwen3.model.param_shapes(cfg),
                                     is_leaf=lambda x: isinstance(x, torch.Size))


def test_convert_reads_the_model_from_a_trainer_checkpoint_and_refuses_its_bias(trained, capsys):
    d, ckpt = trained
    from hpfunc.models.qwen3.convert import checkpoint_model_config

    cfg = checkpoint_model_config(ckpt)
    assert cfg is not None and cfg.hidden_size == 32 and cfg.num_experts == 4
    params = _checkpoint_params(ckpt, cfg)
    assert any(t.ne(0).any() for p, t in hpfunc.tree.leaves_with_paths(params) if p.endswith("expert_bias"))

    with pytest.raises(SystemExit) as info:
        main(["convert", str(ckpt), str(d / "hf"), "--to", "hf"])  # no --config
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("convert:") == 1 and err.startswith("hpfunc convert: refusing to export an MoE")  # said once
    assert "top-1 prediction unchanged on" in err  # the measured change of the logits
    assert "--expert-bias drop" in err and "--expert-bias keep" in err and not (d / "hf").exists()

    main(["convert", str(ckpt), str(d / "hf"), "--to", "hf", "--expert-bias", "drop"])
    assert "dcp -> hf" in capsys.readouterr().out
    assert _max_diff(_unbiased(params), cfg, _transformers_logits(d / "hf")) <= TOL

    main(["convert", str(ckpt), str(d / "keep"), "--to", "hf", "--expert-bias", "keep"])
    back = qwen3.from_pretrained(d / "keep")[1]
    assert all(torch.equal(a, b) for a, b in zip(hpfunc.tree.leaves(back), hpfunc.tree.leaves(params)))


def test_convert_of_a_checkpoint_without_its_model_says_so_once(tmp_path, capsys):
    cfg = preset("qwen3-dense-tiny")
    params = qwen3.init(hpfunc.random.key(0), cfg)
    checkpoint.save(tmp_path / "ckpt", {"params": params}, step=0)
    with pytest.raises(SystemExit) as info:
        main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("convert:") == 1 and "does not say which model it holds" in err and "pass --config" in err
    main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--config", "qwen3-dense-tiny"])
    assert _max_diff(params, cfg, _transformers_logits(tmp_path / "hf")) <= TOL


# -- the top-level command -------------------------------------------------------------------------------------

def test_the_command_line_version_and_usage_errors(capsys):
    main(["--version"])
    assert capsys.readouterr().out.strip() == f"hpfunc {hpfunc.__version__} (torch {torch.__version__})"
    for argv in ([], ["bogus"], ["train"], ["launch"], ["convert"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
        err = capsys.readouterr().err
        assert "error:" in err and "usage:" in err, (argv, err)


def test_the_trainer_checkpoint_has_named_keys_read_by_torch_alone(trained, tmp_path):
    import re
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "checkpoint"))
    from test_checkpoint_keys import read_with_torch_only

    _, ckpt = trained
    got = read_with_torch_only(ckpt, tmp_path)
    tensors = {k for k, v in checkpoint.info(ckpt)["keys"].items() if v["kind"] == "tensor"}
    assert set(got) == tensors and "params.layers.0.attn.wq" in got
    assert all(re.fullmatch(r"(params|opt_state|step|data_step)(\.\w+)*", k) for k in got), sorted(got)[:5]
    assert any(k.startswith("opt_state.") and ".mu." in k for k in got)
    # the parameters hpfunc's own reader (convert --expert-bias keep) gives are these: see the convert test
