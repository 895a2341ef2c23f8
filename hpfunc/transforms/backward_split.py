"""The input/weight split of a backward: ``B`` computes the input gradients and keeps what ``W`` needs;
``W`` then computes only the weight gradients.

A zero-bubble schedule runs the backward of one stage-microbatch in two parts: ``B`` (the gradient
of the stage's inputs, which the previous stage waits for) and ``W`` (the gradient of its
parameters, which nobody waits for). Asking autograd for ``dy/dparams`` from the outputs again in
``W`` re-traverses the whole input-gradient chain: every matmul's ``dx`` is computed twice (a
4-layer MLP costs 11 matmuls for ``B + W`` against 8 for the fused backward).

The split here is the one of Qi et al. (and of torch's ``stage_backward_input`` /
``stage_backward_weight``), in hpfunc's own code. The autograd graph of the stage is walked once
from its outputs:

* ``I``, the *input side*: the nodes from which a stage input is reachable (those ``B`` executes).
  A node outside ``I`` never leads back into it, so every path from an output to a parameter is a
  run of ``I`` nodes followed by a run of nodes outside it.
* the *use sites*: the ``I`` nodes with an edge leaving ``I`` towards a parameter (the matmul whose
  other operand is the weight). ``B`` registers a pre-hook on each and keeps the gradient flowing
  into it (the gradient at the layer's output).
* ``W`` re-runs each use site from the kept gradient towards the parameters only: autograd computes
  just the outputs of a node that lead to an input asked for, so the matmul computes ``dw`` and not
  ``dx`` again, and nothing above the use site runs. Parameters that reach an output without meeting
  ``I`` (stage 0, whose input is data, or an output that does not depend on the input) are taken
  from those outputs, through nodes outside ``I`` only.

Use sites are grouped by the parameters they reach (two sites feeding one ``w.t()`` go together):
``W`` makes one ``torch.autograd.grad`` call per group, so that no call re-enters the input side
through another group's use site. One case is left: a parameter used at two places of which one
feeds the other inside ``I`` (``(x @ w) @ w``); a call from the later site would run into the
earlier one and count its gradient twice. Such a group ("entangled") is computed from the stage
outputs as before (correct, but its input chain is traversed again); :attr:`BackwardState.entangled`
counts the parameters concerned so that a caller can report it.

Gradients equal the fused backward's: every node computes the same values from the same incoming
gradients; only the order in which the contributions of a parameter used at several sites are summed
can differ (rounding).

Example:
    >>> import torch
    >>> from hpfunc.transforms.backward_split import backward_input, backward_weight
    >>> w1, w2 = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> y = torch.tanh(x @ w1) @ w2
    >>> (dx,), state = backward_input([y], [torch.ones_like(y)], [x], [w1, w2])
    >>> dw1, dw2 = backward_weight(state)
    >>> ref = torch.autograd.grad(y, [x, w1, w2], torch.ones_like(y))
    >>> all(torch.allclose(a, b) for a, b in zip((dx, dw1, dw2), ref))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["BackwardState", "backward_input", "backward_weight", "node_of"]


def node_of(t: torch.Tensor) -> Any:
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return torch.autograd.graph.get_gradient_edge(t).node
    return None


def _children(node: Any) -> list[Any]:
    return [n for n, _ in node.next_functions if n is not None]


class _Group:
    """Use sites whose weight-side subgraphs share nodes, and the parameters those reach."""

    __slots__ = ("sites", "params", "grads")

    def __init__(self) -> None:
        self.sites: list[Any] = []
        self.params: set[int] = set()     # indices into BackwardState.params
        self.grads: dict[Any, tuple] = {}  # site -> gradients flowing into it (set by B's pre-hooks)


class BackwardState:
    """What :func:`backward_input` keeps for :func:`backward_weight` (one stage-microbatch).

    ``entangled``: the number of parameters whose gradient ``W`` has to take from the outputs (see the
    module docstring); 0 for layers that use each weight once.
    """

    __slots__ = ("params", "groups", "outside", "outside_params", "fallback", "outputs", "out_grads", "entangled")

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.groups: list[_Group] = []
        self.outside: list[int] = []          # outputs whose node is not on the input side
        self.outside_params: list[int] = []   # params reachable from them (outside the input side)
        self.fallback: list[int] = []         # params of entangled groups
        self.outputs: list[torch.Tensor] = []
        self.out_grads: list[torch.Tensor | None] = []
        self.entangled = 0


def _analyse(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
             params: Sequence[torch.Tensor], state: BackwardState) -> None:
    roots = [node_of(y) for y in outputs]
    # Every node of the graph, and for each the nodes that feed it gradients (reverse edges).
    seen: set[Any] = set()
    order: list[Any] = []
    parents: dict[Any, list[Any]] = {}
    stack = [r for r in roots if r is not None]
    for r in stack:
        parents.setdefault(r, [])
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        for c in _children(n):
            parents.setdefault(c, []).append(n)
            if c not in seen:
                stack.append(c)
    # The input side: nodes from which an input's accumulator is reachable (walk reverse edges up).
    side: set[Any] = set()
    stack = [n for n in (node_of(x) for x in inputs) if n is not None and n in parents]
    while stack:
        n = stack.pop()
        if n in side:
            continue
        side.add(n)
        stack.extend(p for p in parents.get(n, ()) if p not in side)
    # For each parameter: walk up from its accumulator through nodes off the input side; the input
    # side nodes met are its use sites; outputs met off the input side are "outside" roots.
    param_node = {}
    for k, p in enumerate(params):
        n = node_of(p)
        if n is not None and n in parents:
            param_node[k] = n
    root_set = set(roots)
    if not side:
        # No input side (stage 0: its input is data): no use sites, every parameter is reached from the
        # outputs only. One walk up from all parameters finds the outputs they feed (a walk per parameter
        # would cost parameters x nodes).
        walked = set(param_node.values())
        stack = list(walked)
        outside_roots = set()
        while stack:
            n = stack.pop()
            if n in root_set:
                outside_roots.add(n)
            for p in parents.get(n, ()):
                if p not in walked:
                    walked.add(p)
                    stack.append(p)
        state.outside_params = list(param_node)
        state.outside = [j for j, r in enumerate(roots) if r is not None and r in outside_roots]
        return
    site_params: dict[Any, set[int]] = {}
    site_nodes: dict[Any, set[Any]] = {}   # weight-side nodes below each site (for grouping)
    outside_roots: set[Any] = set()
    for k, n0 in param_node.items():
        walked: set[Any] = set()
        stack = [n0]
        sites: set[Any] = set()
        while stack:
            n = stack.pop()
            if n in walked:
                continue
            walked.add(n)
            if n in root_set:
                outside_roots.add(n)
                if k not in state.outside_params:
                    state.outside_params.append(k)
            for p in parents.get(n, ()):
                if p in side:
                    sites.add(p)
                elif p not in walked:
                    stack.append(p)
        for site in sites:
            site_params.setdefault(site, set()).add(k)
            site_nodes.setdefault(site, set()).update(walked)
    state.outside = [j for j, r in enumerate(roots) if r is not None and r in outside_roots]
    # Group sites that share weight-side nodes (union-find over sites).
    leader: dict[Any, Any] = {s: s for s in site_params}

    def find(s: Any) -> Any:
        while leader[s] is not s:
            leader[s] = leader[leader[s]]
            s = leader[s]
        return s

    owner: dict[Any, Any] = {}
    for site, nodes in site_nodes.items():
        for n in nodes:
            other = owner.setdefault(n, site)
            if other is not site:
                a, b = find(other), find(site)
                if a is not b:
                    leader[b] = a
    groups: dict[Any, _Group] = {}
    for site in site_params:
        g = groups.setdefault(find(site), _Group())
        g.sites.append(site)
        g.params |= site_params[site]
    # Entangled: a site of the group reaches another site of the same group through the input side.
    # One pass over the input side in topological order (parents first) carries, as a bit mask, the
    # groups that have a site strictly above each node; a site whose own group is in its mask is
    # entangled. (A walk down from every site would cost sites x nodes.)
    glist = list(groups.values())
    bit = {site: 1 << j for j, g in enumerate(glist) for site in g.sites}
    side_children = {n: [c for c in _children(n) if c in side] for n in side}
    indegree = dict.fromkeys(side, 0)
    for n, cs in side_children.items():
        for c in cs:
            indegree[c] += 1
    above = dict.fromkeys(side, 0)
    ready = [n for n, k in indegree.items() if k == 0]
    tangled = 0
    while ready:
        n = ready.pop()
        mask = above[n]
        b = bit.get(n, 0)
        tangled |= mask & b
        down = mask | b
        for c in side_children[n]:
            above[c] |= down
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    for j, g in enumerate(glist):
        if tangled >> j & 1:
            state.fallback.extend(sorted(g.params))
        else:
            state.groups.append(g)
    state.fallback = sorted(set(state.fallback))
    state.entangled = len(state.fallback)
    # A fallback parameter takes all of its gradient from the outputs (outside roots included).
    fb = set(state.fallback)
    state.outside_params = [k for k in state.outside_params if k not in fb]
    for g in state.groups:
        g.params -= fb


def backward_input(outputs: Sequence[torch.Tensor], out_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], BackwardState]:
    """``B``: the gradients of ``inputs`` (``None`` where unused), and the state ``W`` needs.

    Args:
        outputs: the differentiable outputs of the stage (or the scaled loss).
        out_grads: the gradient of each output (``None``: ones, for a scalar loss).
        inputs: the tensors to differentiate for (the stage's inputs; may be empty).
        params: the parameters whose gradients :func:`backward_weight` will compute.

    The graph is retained (``W`` runs parts of it again); it goes when the caller drops the outputs.
    """
    state = BackwardState()
    state.params = list(params)
    state.outputs = list(outputs)
    state.out_grads = list(out_grads)
    _analyse(outputs, inputs, params, state)
    handles = []

    def keep(g: _Group, site: Any):
        def hook(grad_outputs: tuple) -> None:
            g.grads[site] = tuple(grad_outputs)
        return hook

    for g in state.groups:
        for site in g.sites:
            handles.append(site.register_prehook(keep(g, site)))
    try:
        if inputs and outputs:
            got = torch.autograd.grad(list(outputs), list(inputs), grad_outputs=list(out_grads),
                                      retain_graph=True, allow_unused=True)
        else:
            got = (None,) * len(inputs)
    finally:
        for h in handles:
            h.remove()
    return list(got), state


def backward_weight(state: BackwardState) -> list[torch.Tensor | None]:
    """``W``: the gradient of each parameter given to :func:`backward_input` (``None`` where unused).

    Raises:
        ValueError: called twice on one state (its kept gradients are released by the first call).
    """
    if state.params is None:
        raise ValueError("backward_weight: expected the state of a backward_input whose W has not run; found one "
                         "whose W ran already (its kept gradients are released); run backward_input again for a new W")
    params = state.params
    out: list[torch.Tensor | None] = [None] * len(params)

    def add(ks: Sequence[int], gs: Sequence[torch.Tensor | None]) -> None:
        for k, g in zip(ks, gs):
            if g is not None:
                out[k] = g if out[k] is None else out[k] + g

    if state.fallback:
        ks = state.fallback
        add(ks, torch.autograd.grad(state.outputs, [params[k] for k in ks], grad_outputs=state.out_grads,
                                    retain_graph=True, allow_unused=True))
    for g in state.groups:
        edges, grads = [], []
        for site in g.sites:
            for j, go in enumerate(g.grads.get(site, ())):
                if go is not None:
                    edges.append(GradientEdge(site, j))
                    grads.append(go)
        if edges and g.params:
            ks = sorted(g.params)
            add(ks, torch.autograd.grad(edges, [params[k] for k in ks], grad_outputs=grads,
                                        retain_graph=True, allow_unused=True))
        g.grads.clear()
    if state.outside and state.outside_params:
        ks = state.outside_params
        add(ks, torch.autograd.grad([state.outputs[j] for j in state.outside], [params[k] for k in ks],
                                    grad_outputs=[state.out_grads[j] for j in state.outside],
                                    retain_graph=True, allow_unused=True))
    state.params = None
    state.groups, state.outputs, state.out_grads = [], [], []
    return out
