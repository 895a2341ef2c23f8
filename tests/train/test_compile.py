"""Regional compilation (``hpfunc.regions``, ``train.compile``): Qwen3's layers compiled with
``torch.compile`` train exactly as eager (losses rtol 1e-5) on one process, under fsdp and under
fsdp x tp on a gloo rank pool, send the same bytes (the FSDP re-gathers in the backward included), and
compile once: the graph counts (the regions' counting backend and dynamo's own counter) do not move
after the first step. The suite compiles with ``aot_eager`` (AOTAutograd traces forward and backward;
inductor's C++ code generation takes minutes on 2 cores); bench/model_step.py measures inductor."""

from __future__ import annotations

import pytest
import torch
from _compile_helpers import LR, GraphCount, compiled_vs_eager  # noqa: F401  (GraphCount: by import path)
from _train_helpers import write_corpus
from torch._dynamo.utils import counters

import hpfunc
from hpfunc.models import qwen3
from hpfunc.models.qwen3 import model as qwen3_model
from hpfunc.regions import Regions
from hpfunc.testing import assert_trees_close


def _layer_case(attention_bias: bool, moe: bool, shared: bool = False):
    extra = {"shared_expert_intermediate_size": 32} if shared else {}
    cfg = qwen3.preset("qwen3-moe-tiny" if moe else "qwen3-dense-tiny", attention_bias=attention_bias, **extra)
    params = qwen3.init(hpfunc.random.key(1), cfg)
    layer = params["layers"][0]
    if attention_bias:  # non-zero biases, so that where the output bias is added matters
        g = torch.Generator().manual_seed(2)
        layer["attn"] = {k: (torch.randn(v.shape, generator=g) if k.startswith("b") else v)
                         for k, v in layer["attn"].items()}
    return cfg, layer


@pytest.mark.parametrize("case", ["whole", "seams", "seams_bias", "moe", "moe_shared"])
def test_compiled_layer_equals_the_eager_layer(case, monkeypatch):
    """Forward and gradients of one decoder layer, compiled (one region; four around the tensor-parallel
    seams, under a bound tp axis whose seams scale here, so that a seam skipped or applied twice changes
    the value; the attention half of an MoE layer and its router, the routed experts eager) against eager."""
    import contextlib

    from hpfunc import layout

    cfg, layer = _layer_case(case == "seams_bias", case.startswith("moe"), case == "moe_shared")
    bound = contextlib.nullcontext
    if case.startswith("seams"):
        monkeypatch.setattr(layout, "gather_sequence", lambda x: x * 1.5)
        monkeypatch.setattr(layout, "reduce_partial", lambda y: y * 0.5)
        bound = lambda: layout.tensor_parallel("tp")  # noqa: E731
    h = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    cos, sin = qwen3_model.rope_for(h, torch.arange(8), cfg)
    regions = Regions("aot_eager")

    def run(**kw):
        leaves = hpfunc.tree.leaves(layer)
        xs = [x.detach().requires_grad_() for x in [h, *leaves]]
        lay = hpfunc.tree.unflatten(hpfunc.tree.structure(layer), xs[1:])
        with bound():
            y, _ = qwen3_model.decoder_layer(lay, xs[0], cos, sin, cfg, **kw)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return y.detach(), [x.grad for x in xs]

    (ye, ge), (yc, gc) = run(), run(regions=regions)
    torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-6)
    assert_trees_close(gc, ge, rtol=1e-5, atol=1e-6, what=case)
    moe = {"qwen3.attention_block": 1, "moe.router": 1, **({"moe.shared": 1} if case == "moe_shared" else {})}
    want = {"qwen3.layer": 1} if case == "whole" else moe if case.startswith("moe") else {
        "qwen3.attention_in": 1, "qwen3.attention": 1, "qwen3.residual_norm": 1, "qwen3.mlp": 1}
    assert regions.compilations == want


def test_the_count_sees_a_recompilation():
    """The deliberate bug the zero-recompilation checks must catch: a sequence length that changes every
    step recompiles every region every step (the counting backend and dynamo's counter agree: three
    regions, the embedding, the layer shared by both layers, the head and loss); the same length every
    step compiles once."""
    cfg = qwen3.preset("qwen3-dense-tiny")
    params = qwen3.init(hpfunc.random.key(0), cfg)
    grad = hpfunc.value_and_grad(lambda p, b, r: qwen3.loss(p, b, cfg, regions=r)[0])
    for seqs, want in (((8, 8, 8), [1, 1, 1]), ((6, 7, 8), [1, 2, 3])):
        regions, start, seen, graphs = Regions("eager"), counters["stats"]["unique_graphs"], [], []
        for s in seqs:
            grad(params, {"tokens": torch.zeros(2, s, dtype=torch.long)}, regions)
            seen.append(regions.compilations)
            graphs.append(counters["stats"]["unique_graphs"] - start)
        assert seen == [{"qwen3.embed": k, "qwen3.layer": k, "qwen3.head_loss": k} for k in want]
        assert graphs == [3 * k for k in want]


def test_lowered_compile_runs_the_same_step():
    """``train_step.lower(state).compile("aot_eager")`` on a one-rank mesh against the eager step, 3 steps
    from the same state on the same batches: equal losses (rtol 1e-5) and parameters after every step;
    the regions (embedding, the layer shared by both layers, head and loss) compile in the first step
    and never again; ``print`` says it is compiled; the eager program is untouched (no regions bound)."""
    from hpfunc import optim
    from hpfunc.train.step import init_train_state, make_train_step
    from hpfunc.transforms import plans

    cfg = qwen3.preset("qwen3-dense-tiny")
    tx = optim.adamw(LR)
    train_step = hpfunc.parallelize(make_train_step(cfg, tx, loss_fn=qwen3.parallel_plan.loss),
                                    hpfunc.Mesh({"fsdp": 1}), plans.fsdp("fsdp"))
    params = train_step.shard_params(qwen3.init(hpfunc.random.key(0), cfg))
    state = train_step.init_state(lambda p: init_train_state(p, tx), params)
    lowered = train_step.lower(state)
    program = lowered.compile("aot_eager")
    assert lowered.compile(False) is lowered and lowered.regions is None and program.regions is not None
    assert "compiled regions (aot_eager)" in repr(program) and "compiled" not in repr(lowered)
    g = torch.Generator().manual_seed(0)
    eager_state, counts = state, []
    for _ in range(3):
        batch = {"tokens": torch.randint(0, cfg.vocab_size, (2, 8), generator=g)}
        eager_state, me = train_step(eager_state, batch)
        state, mc = program(state, batch)
        torch.testing.assert_close(mc["loss"].full_tensor(), me["loss"].full_tensor(), rtol=1e-5, atol=0)
        assert_trees_close(state.params, eager_state.params, rtol=1e-5, atol=1e-7, what="params")
        counts.append(program.regions.compilations)
    assert counts == [{"qwen3.embed": 1, "qwen3.layer": 1, "qwen3.head_loss": 1}] * 3


def test_compile_requests():
    from hpfunc.layout import PlanError
    from hpfunc.transforms import plans

    step = hpfunc.parallelize(lambda s, b: (s, {}), hpfunc.Mesh({"fsdp": 1}), plans.fsdp("fsdp"))
    with pytest.raises(ValueError, match=r"ParallelizedStep.compile: expected true, false or one of \('inductor', "
                                         r"'aot_eager', 'eager'\), found 'inductr'"):
        step.compile("inductr")
    assert step.compile(False) is step and step.compile("eager").regions.backend == "eager"
    assert hpfunc.parallelize(lambda s, b: (s, {}), hpfunc.Mesh({"fsdp": 1}), plans.fsdp("fsdp"),
                              compile=True).regions.backend == "inductor"


def _raw(tmp_path, compile, tag):
    if not (tmp_path / "corpus").exists():
        write_corpus(tmp_path / "corpus")
    return {"seed": 0, "model": {"preset": "qwen3-dense-tiny"},
            "optimizer": {"name": "adamw", "lr": LR}, "schedule": {"name": "constant", "warmup_steps": 0},
            "data": {"source": "text", "paths": [str(tmp_path / "corpus" / "*.py")], "val_fraction": 0.1},
            "train": {"steps": 20, "batch_size": 4, "seq_len": 16, "log_every": 1, "eval_every": 0,
                      "eval_batches": 0, "num_threads": 1, "compile": compile},
            "output": {"dir": str(tmp_path / tag), "progress": "none", "plot": False, "sample_tokens": 0},
            "callbacks": ["_compile_helpers:GraphCount"]}


def test_trainer_compile_equals_eager_and_compiles_once(tmp_path):
    """``train.compile`` through the trainer, 20 steps on one process: the losses equal eager's (rtol
    1e-5) and dynamo compiled its three graphs (the embedding, the layer region shared by both layers, the
    head and loss) in the first step and none after."""
    from hpfunc.train import Trainer

    runs = {}
    for compile in (False, "aot_eager"):
        trainer = Trainer(_raw(tmp_path, compile, str(compile)), echo=False)
        trainer.run()
        (count,) = [cb for _, cb in trainer.callbacks if isinstance(cb, GraphCount)]
        runs[compile] = ([r["loss"] for r in trainer.metrics if "loss" in r], count.after_step)
    (eager, eager_graphs), (compiled, graphs) = runs[False], runs["aot_eager"]
    assert len(compiled) == len(eager) == 20
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert eager_graphs == [0] * 20
    assert graphs == [3] * 20


@pytest.mark.multirank
@pytest.mark.parametrize("name,size,steps,via", [("fsdp", 2, 4, "lowered"), ("fsdp_tp", 4, 3, "step")],
                         ids=["fsdp2_lowered", "fsdp2_tp2_step"])
def test_compiled_step_on_a_rank_pool(pools, name, size, steps, via):
    """The compiled program (``train_step.lower(state).compile("aot_eager")``; the front door's
    ``parallel_train_step(..., compile="aot_eager")``) against the same step eager, interleaved on the same
    batches: equal losses and parameters (rtol 1e-5), the same collectives with the same bytes every
    step (the backward's FSDP re-gathers of the layers included: the compiled regions' saved parameters
    still go through the step's saved-tensor layer), and no graph compiled after the first step: the
    embedding, the head and loss, and one region per layer without tensor parallelism, four around its
    seams with it."""
    got = pools(size).run(compiled_vs_eager, name, steps, via=via)
    ends = {"qwen3.embed": 1, "qwen3.head_loss": 1}
    want = {"qwen3.layer": 1, **ends} if name == "fsdp" else {
        "qwen3.attention_in": 1, "qwen3.attention": 1, "qwen3.residual_norm": 1, "qwen3.mlp": 1, **ends}
    for r in got:
        assert r["compiled"] == pytest.approx(r["eager"], rel=1e-5)
        assert r["bytes_compiled"] == r["bytes_eager"]
        assert r["regions"] == [want] * steps
        assert r["graphs"] == [len(want)] * steps
        assert r["param_diff"] <= 1e-5 + 0.05 * LR * steps  # Adam near zero gradients: see _parallel_helpers
    assert all(r["eager"] == got[0]["eager"] for r in got)


def test_compile_errors(tmp_path):
    from hpfunc.layout import PlanError, rebind
    from hpfunc.models.qwen3 import parallel_plan
    from hpfunc.train import Trainer
    from hpfunc.train.config import ConfigError

    raw = _raw(tmp_path, "inductr", "bad")
    with pytest.raises(ConfigError, match="train.compile: expected true or false or one of 'inductor', "
                                          "'aot_eager', 'eager', found string 'inductr'"):
        Trainer(raw, echo=False)
    mlp = {**_raw(tmp_path, True, "mlp"), "model": {"name": "_tiny_mlp_lm:SPEC", "preset": "mlp-tiny"}}
    with pytest.raises(ValueError, match="train.compile: the model 'tiny_mlp_lm' declares no compiled regions"):
        Trainer(mlp, echo=False).run()
    cfg = qwen3.preset("qwen3-dense-tiny")
    with rebind(pipeline=object()), pytest.raises(PlanError, match="not passed to the pipeline's stages"):
        parallel_plan.loss({}, {}, cfg, regions=Regions("eager"))
    with pytest.raises(ValueError, match="backend must be one of"):
        Regions("tvm")
    regions = Regions("eager")
    with pytest.raises(TypeError, match="must be a Python function"):
        regions("r", torch.sin, torch.ones(1))
