"""The supported-operator list: the ops Qwen3-class models use, and the input placements with which the
global view (torch ops on DTensors) runs them and matches one device.

Each :class:`OpCase` is one row: an op as hpfunc's models call it, on small inputs. :func:`probe` runs
it on a 1-D mesh for every layout of its inputs (each input replicated or split along one of its
dimensions), forward and backward, and compares the output and the input gradients with the same call
on one device (fp32, rtol = atol = 1e-5). A layout is *supported* when it runs and matches; it *fails*
when DTensor raises (no sharding strategy, or one it cannot apply); a layout that runs but differs is
*wrong* (none today: the table would show it). :func:`render` writes the table; the test suite checks
that ``docs/operators.md`` is what this module writes now, and a property test re-runs sampled supported
layouts on 1-D and 2-D meshes with other values.

Regenerate the page (2 gloo ranks, about half a minute)::

    python -m hpfunc.ops.coverage --write docs/operators.md

    >>> [c.name for c in CASES][:3]
    ['linear', 'matmul', 'embedding']
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any, Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

__all__ = ["OpCase", "CASES", "probe", "run_layout", "render", "main"]


@attrs.frozen
class OpCase:
    """One row. ``make(gen, k)`` builds the global inputs (``k`` scales the leading dimension: other
    shapes in the property test); ``fn`` is the call; ``tied``: groups of inputs laid out alike (attention's
    q, k, v), which keeps the enumeration small; ``differentiable``: the inputs that get gradients."""

    name: str
    call: str
    make: Callable[[torch.Generator, int], list]
    fn: Callable[..., torch.Tensor]
    differentiable: tuple[int, ...]
    tied: tuple[tuple[int, ...], ...] = ()


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).float()


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from hpfunc.models.layers import rms_norm

    return rms_norm(x, w, 1e-6)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from hpfunc.models.rope import apply_rope

    return apply_rope(x, cos, sin)


def _topk(x: torch.Tensor) -> torch.Tensor:
    return torch.topk(x, 2, dim=-1).values


def _scatter_add(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.zeros(src.shape[0], 8, dtype=src.dtype, device=src.device).scatter_add(1, idx, src) \
        if not _is_dtensor(src) else _dtensor_zeros_like_rows(src, 8).scatter_add(1, idx, src)


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _dtensor_zeros_like_rows(src: Any, cols: int) -> Any:
    from torch.distributed.tensor import Replicate, zeros

    return zeros(src.shape[0], cols, device_mesh=src.device_mesh, placements=[Replicate()] * src.device_mesh.ndim)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x, w, offs=offs)


CASES: tuple[OpCase, ...] = (
    OpCase("linear", "F.linear(x [t, h], w [f, h])",
           lambda g, k: [_randn(g, 4 * k, 6), _randn(g, 8, 6)], F.linear, (0, 1)),
    OpCase("matmul", "torch.bmm(a [b, m, k], b [b, k, n])",
           lambda g, k: [_randn(g, 2 * k, 4, 6), _randn(g, 2 * k, 6, 4)], torch.bmm, (0, 1)),
    OpCase("embedding", "F.embedding(ids [b, s], w [v, h])",
           lambda g, k: [torch.randint(0, 10, (2 * k, 4), generator=g), _randn(g, 10, 6)], F.embedding, (1,)),
    OpCase("rms_norm", "models.layers.rms_norm(x [b, s, h], w [h])",
           lambda g, k: [_randn(g, 2 * k, 4, 6), 1 + _randn(g, 6)], _rms_norm, (0, 1)),
    OpCase("rope", "models.rope.apply_rope(x [b, n, s, d], cos [s, d], sin [s, d])",
           lambda g, k: [_randn(g, 2 * k, 2, 4, 6), _randn(g, 4, 6), _randn(g, 4, 6)], _rope, (0,)),
    OpCase("sdpa", "F.scaled_dot_product_attention(q, k, v [b, n, s, d], is_causal=True)",
           lambda g, k: [_randn(g, 2 * k, 2, 4, 6) for _ in range(3)],
           lambda q, kk, v: F.scaled_dot_product_attention(q, kk, v, is_causal=True), (0, 1, 2), ((0, 1, 2),)),
    OpCase("softmax", "torch.softmax(x [t, v], -1)",
           lambda g, k: [_randn(g, 4 * k, 6)], lambda x: torch.softmax(x, -1), (0,)),
    OpCase("cross_entropy", "F.cross_entropy(logits [t, v], targets [t])",
           lambda g, k: [_randn(g, 4 * k, 10), torch.randint(0, 10, (4 * k,), generator=g)], F.cross_entropy, (0,)),
    OpCase("grouped_mm", "F.grouped_mm(x [t, h], w [e, h, f], offs=[e])",
           lambda g, k: [_randn(g, 4 * k, 8), _randn(g, 2, 8, 8), torch.tensor([2 * k, 4 * k], dtype=torch.int32)],
           _grouped_mm, (0, 1)),
    OpCase("topk", "torch.topk(x [t, e], 2, dim=-1).values",
           lambda g, k: [_randn(g, 4 * k, 8)], _topk, (0,)),
    OpCase("gather", "torch.gather(x [t, e], 1, idx [t, 2])",
           lambda g, k: [_randn(g, 4 * k, 8), torch.randint(0, 8, (4 * k, 2), generator=g)],
           lambda x, i: torch.gather(x, 1, i), (0,)),
    OpCase("scatter_add", "zeros(t, 8).scatter_add(1, idx [t, 2], src [t, 2])",
           lambda g, k: [_randn(g, 4 * k, 2), torch.randint(0, 8, (4 * k, 2), generator=g)], _scatter_add, (0,)),
    OpCase("silu_mul", "F.silu(a) * b (elementwise, [t, f])",
           lambda g, k: [_randn(g, 4 * k, 6), _randn(g, 4 * k, 6)], lambda a, b: F.silu(a) * b, (0, 1)),
    OpCase("sum", "x.sum(-1) ([t, h])", lambda g, k: [_randn(g, 4 * k, 6)], lambda x: x.sum(-1), (0,)),
    OpCase("mean", "x.mean() ([t, h])", lambda g, k: [_randn(g, 4 * k, 6)], lambda x: x.mean(), (0,)),
    OpCase("amax", "x.amax(-1) ([t, h])", lambda g, k: [_randn(g, 4 * k, 6)], lambda x: x.amax(-1), (0,)),
)


def _options(case: OpCase, inputs: Sequence[torch.Tensor]) -> list[tuple]:
    """Every layout of the inputs on one mesh axis: per input ``None`` (replicated) or a dimension."""
    groups: list[tuple[int, ...]] = list(case.tied)
    tied = {i for gr in groups for i in gr}
    groups += [(i,) for i in range(len(inputs)) if i not in tied]
    per_group = [[None] + list(range(inputs[gr[0]].ndim)) for gr in groups]
    out = []
    for choice in itertools.product(*per_group):
        layout: list = [None] * len(inputs)
        for gr, c in zip(groups, choice):
            for i in gr:
                layout[i] = c
        out.append(tuple(layout))
    return out


def _closeness(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(((a - b).abs() / (1e-5 + 1e-5 * b.abs())).max()) if b.numel() else 0.0


def run_layout(case: OpCase, mesh: Any, layouts: Sequence[Sequence], seed: int, k: int = 1) -> tuple[str, str]:
    """Run ``case`` on DTensors laid out by ``layouts[m][i]`` (mesh axis ``m``, input ``i``: a dimension or
    None) against one device. Returns ``("ok", output placements)``, ``("wrong", detail)`` or
    ``("error", the exception's type and first line)``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    xs = case.make(g, k)
    ref_in = [x.clone().requires_grad_(i in case.differentiable) for i, x in enumerate(xs)]
    ref = case.fn(*ref_in)
    c = _randn(g, *ref.shape)
    (ref * c).sum().backward()
    try:
        dts = []
        for i, x in enumerate(xs):
            pl = [Replicate() if lay[i] is None else Shard(lay[i]) for lay in layouts]
            d = distribute_tensor(x, mesh.device_mesh, pl)
            dts.append(d.requires_grad_() if i in case.differentiable else d)
        out = case.fn(*dts)
        full = out.full_tensor()
        (full * c).sum().backward()
    except Exception as e:  # DTensor's refusal is the finding
        return "error", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
    worst = max([_closeness(full.detach(), ref.detach())] +
                [_closeness(dts[i].grad.full_tensor(), ref_in[i].grad) for i in case.differentiable])
    if worst > 1.0:
        return "wrong", f"off by {worst:.3g} x tolerance"
    return "ok", ",".join(_short(p) for p in out.placements)


def _short(p: Any) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return str(p)


def _layout_str(layout: Sequence) -> str:
    return "(" + ", ".join("R" if d is None else f"S{d}" for d in layout) + ")"


def probe(cases: Sequence[OpCase] = CASES, world: int = 2) -> list[dict]:
    """Every case under every layout on a 1-D mesh of ``world`` ranks (run inside the ranks: SPMD), with
    hpfunc's shipped registry loaded."""
    import hpfunc
    from hpfunc.ops.yaml_registry import load_registry, shipped_registry

    load_registry(shipped_registry())
    mesh = hpfunc.Mesh({"x": world})
    rows = []
    for case in cases:
        g = torch.Generator().manual_seed(0)
        inputs = case.make(g, 1)
        ok, failed, wrong = [], [], []
        for layout in _options(case, inputs):
            status, detail = run_layout(case, mesh, [layout], seed=1)
            entry = (layout, detail)
            {"ok": ok, "error": failed, "wrong": wrong}[status].append(entry)
        rows.append({"name": case.name, "call": case.call, "ok": ok, "error": failed, "wrong": wrong})
    return rows


HEADER = """# Supported operators (the global view)

Generated by `python -m hpfunc.ops.coverage --write docs/operators.md` (torch {torch}); the test suite
checks that this page is what the module writes now (`tests/ops/test_operators_doc.py`). Do not edit it
by hand.

Each row is an op as hpfunc's Qwen3-class models call it. Every layout of its inputs on a 1-D mesh of 2
ranks (each input replicated `R` or split along dimension d, `Sd`; attention's q, k, v alike) ran as
DTensors, forward and backward, and was compared with one device (output and input gradients, fp32,
rtol = atol = 1e-5), with hpfunc's shipped registry loaded (`hpfunc/ops/registry.yaml`). **Supported**:
the layouts that run and match, with the output's placement (`R` after a layout the op cannot keep means
DTensor gathered the inputs first; `P(sum)`: a partial sum DTensor completes on use). **Fails**: the
layouts DTensor refuses. A layout that ran but differed would be listed as **wrong** (none is). Integer
inputs (ids, indices, offsets) get no gradient. `tests/ops/test_operators_doc.py` re-runs sampled
supported layouts on 1-D and 2-D meshes (2 and 4 ranks, each mesh axis one supported layout) with other
values and shapes.

What was outside torch's coverage, and what hpfunc does about it:

* `sdpa`: on CPU, `F.scaled_dot_product_attention` runs `aten._scaled_dot_product_flash_attention_for_cpu`
  (and its backward), which torch 2.13's DTensor has no sharding strategy for: every layout failed.
  hpfunc's shipped registry gives both a rule (batch and heads split; sequences and head dimension
  whole), so the row above holds with it loaded.
* `grouped_mm`: fails for every layout in fp32 on CPU: DTensor's sharding propagation runs the op's meta
  function, which accepts only bf16 in torch 2.13, before any rule is consulted. hpfunc's MoE runs its
  experts in the local view (plain blocks inside `shard_map`/`parallelize`, never DTensors) and takes
  the padded `bmm` (row `matmul`) where `grouped_mm` is unsupported.

| op | call | supported layouts (inputs -> output) | fails |
|---|---|---|---|
"""

FOOTER = """
## Registering a rule

An op outside this table, or a layout it refuses, gets a rule (`docs/operators.md` is about torch's own
coverage; hpfunc's registry adds to it):

```text
import hpfunc.ops
hpfunc.ops.register(torch.ops.mylib.fused_mm, rule="i k, k n -> i n | sum k")      # the contraction marked
hpfunc.ops.register(torch.ops.mylib.row_softmax, rule="... j -> ... j", impl=row_softmax_on_blocks)
hpfunc.ops.load_registry("examples/ops/registry.yaml")                              # the same, from YAML
```

The rule language, `impl`, the YAML format and `hpfunc.dfunction` are described in `docs/ops.md`.
"""


def render(rows: Sequence[dict]) -> str:
    """The markdown page for :func:`probe`'s rows."""
    lines = []
    for r in rows:
        ok = ", ".join(f"{_layout_str(lay)}->{out}" for lay, out in r["ok"]) or "none"
        failed = ", ".join(_layout_str(lay) for lay, _ in r["error"]) or "-"
        if r["wrong"]:
            failed += "; **wrong**: " + ", ".join(_layout_str(lay) for lay, _ in r["wrong"])
        lines.append(f"| `{r['name']}` | `{r['call']}` | {ok} | {failed} |")
    version = torch.__version__.split("+")[0]
    return HEADER.format(torch=version) + "\n".join(lines) + "\n" + FOOTER


def generate(world: int = 2) -> str:
    """Start ``world`` gloo ranks, probe every case, return the page."""
    from hpfunc.testing import RankPool

    with RankPool(world) as pool:
        return render(pool.run(probe, CASES, world)[0])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpfunc.ops.coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write the page there (default: print it)")
    args = parser.parse_args(argv)
    page = generate()
    if args.write:
        with open(args.write, "w") as f:
            f.write(page)
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
