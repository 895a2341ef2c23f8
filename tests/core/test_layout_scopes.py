"""The one layout binding and its scopes (``hpfunc.layout.Scopes``): a layout bound inside keeps the scopes
in force, the scopes' own context managers bind them and restore them, another thread starts with none;
and the inventory of ``contextvars.ContextVar`` in hpfunc's source (read with ast, nothing imported):
outside ``hpfunc/layout`` and ``hpfunc/saved_tensors.py`` only those docs/parallel.md lists, with why.
(That a scope bound around a parallelized step reaches its body and the function it differentiates:
``tests/parallel/test_parallel_scopes.py``.)
"""

from __future__ import annotations

import ast
import re
import threading

import pytest
import torch

from _source_modules import PACKAGE, ROOT, source_modules
from hpfunc import layout, optim
from hpfunc.optim.base import stream_group_bytes, streamed_kinds
from hpfunc.layout import Binding, Scopes


def test_a_layout_bound_inside_keeps_the_scopes_in_force() -> None:
    events: list = []
    with layout.scoped(pipeline_timeline=events, steps_done=4) as outer:
        with layout.binding(Binding(tp_axis="tp", data_axes=("dp",))):  # as a step binds its layouts
            assert layout.tp_axis() == "tp" and layout.data_axes() == ("dp",)
            assert layout.scopes() is outer.scopes
            with layout.rebind(ep_axis="ep"), layout.binding(Binding(model_paths=("w",))):
                assert layout.bound().ep_axis is None and layout.scopes() is outer.scopes
        assert layout.scopes().pipeline_timeline is events and layout.scopes().steps_done == 4
    assert layout.scopes() == Scopes()


def test_scoped_members_nest_and_restore() -> None:
    with layout.scoped(checkpoint_tag="a", steps_done=1):
        with layout.scoped(checkpoint_tag="b"):
            assert (layout.scopes().checkpoint_tag, layout.scopes().steps_done) == ("b", 1)
            with layout.scoped(checkpoint_tag=None):  # a member set back to its default is unset inside
                assert (layout.scopes().checkpoint_tag, layout.scopes().steps_done) == (None, 1)
        assert layout.scopes().checkpoint_tag == "a"
        with layout.rebind(scopes=None):  # None: the scopes in force stay (never an unset binding)
            assert layout.scopes().steps_done == 1
    assert layout.scopes() == Scopes()
    with pytest.raises(TypeError, match="no_such_member"), layout.scoped(no_such_member=1):
        pass


def test_a_scope_made_before_it_is_entered_adds_to_the_binding_in_force_then() -> None:
    later = layout.scoped(checkpoint_tag="t")  # made outside, entered inside: evolves what is bound at entry
    with layout.scoped(steps_done=5), later:
        assert (layout.scopes().steps_done, layout.scopes().checkpoint_tag) == (5, "t")


def test_an_explicit_scopes_value_is_bound_as_given() -> None:
    with layout.scoped(steps_done=2):
        with layout.binding(Binding(scopes=Scopes(steps_done=9))):
            assert layout.scopes().steps_done == 9
        with layout.binding(Binding(scopes=Scopes())):
            assert layout.scopes().steps_done is None


def test_the_scopes_are_those_of_the_code_running() -> None:
    # another thread starts with an empty context: no scope of this one (as with separate context variables)
    seen = []
    with optim.streaming_state(1 << 10):
        assert stream_group_bytes() == 1 << 10
        t = threading.Thread(target=lambda: seen.append(stream_group_bytes()))
        t.start()
        t.join()
    assert seen == [None] and stream_group_bytes() is None


def test_each_scope_of_the_library_binds_its_member() -> None:
    from hpfunc.memory._names import current_scope, name_scope
    from hpfunc.models.context_attention import trace_ring
    from hpfunc.models.dispatch import trace_exchange
    from hpfunc.train.precision_probe import PrecisionProbe, steps_done
    from hpfunc.transforms.engine.sdc import inject_bit_flip
    from hpfunc.transforms.pipeline import record_timeline
    from hpfunc.transforms.remat import checkpoint_name

    probe = PrecisionProbe(every=4)
    with optim.streaming_state(64, state=False, params=True), inject_bit_flip(rank=1, path="w", bit=3, step=2), \
            record_timeline() as timeline, trace_exchange() as exchange, trace_ring() as ring, \
            name_scope() as names, probe.recording() as losses, steps_done(3):
        s = layout.scopes()
        assert s.state_streaming == layout.StateStreaming(64, False, True)
        assert streamed_kinds() == (False, True)
        assert s.sdc_flip == layout.BitFlip(1, "w", 3, 2)
        assert s.pipeline_timeline is timeline and s.dispatch_trace is exchange and s.ring_trace is ring
        assert s.name_scope is names and current_scope() is names
        assert s.local_losses is losses and s.steps_done == 3 and probe.due(torch.tensor(0))
        y = checkpoint_name(torch.ones(2), "hidden")
        assert names.name_of(y) == "hidden" and layout.scopes().checkpoint_tag is None
    assert layout.scopes() == Scopes()


# The inventory of context variables.

ALLOWED = ("hpfunc/layout/", "hpfunc/saved_tensors.py")


def _context_vars() -> dict[str, list[str]]:
    """``{module path: [variable name, ...]}`` of every ``ContextVar(...)`` call in hpfunc's code."""
    out: dict[str, list[str]] = {}
    for module in source_modules(PACKAGE):
        for node in ast.walk(module.tree):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Call):
                continue
            func = node.value.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "ContextVar":
                continue
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            out.setdefault(module.rel, []).append(ast.unparse(target))
    return out


def _documented() -> set[tuple[str, str]]:
    """The ``(module path, variable)`` rows of docs/parallel.md's table of context variables outside layout."""
    text = (ROOT / "docs" / "parallel.md").read_text()
    section = text.split("### Context variables outside the layout binding", 1)[1].split("\n## ", 1)[0]
    return {(m[0], m[1]) for m in re.findall(r"^\| `(hpfunc/[\w/]+\.py)` `(\w+)` \|", section, flags=re.M)}


def test_context_variables_outside_layout_are_the_documented_ones() -> None:
    found = {(path, name) for path, names in _context_vars().items() for name in names
             if not path.startswith(ALLOWED)}
    documented = _documented()
    assert found == documented, (
        f"context variables outside hpfunc/layout and hpfunc/saved_tensors.py: found {sorted(found)}, "
        f"docs/parallel.md ('Context variables outside the layout binding') lists {sorted(documented)}; a scope "
        f"that a step or a region of it binds belongs in hpfunc.layout.Scopes (bound with layout.scoped, read "
        f"with layout.scopes()); any other needs its row in that table saying why it stays")
    assert len(found) == 4


def test_the_inventory_sees_every_form() -> None:
    tree = ast.parse("import contextvars\nfrom contextvars import ContextVar\n"
                     "A = contextvars.ContextVar('a')\nB: ContextVar[int] = ContextVar('b', default=0)\n"
                     "x = 'ContextVar(\"not code\")'\n")
    names = [ast.unparse(n.target if isinstance(n, ast.AnnAssign) else n.targets[0]) for n in ast.walk(tree)
             if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Call)]
    assert names == ["A", "B"]
