"""The sharding-rule language: einsum-like dimension names per tensor, with reductions and whole
dimensions marked (JAX's ``custom_partitioning`` ``sharding_rule`` / Shardy, made explicit).

A rule names every dimension of every tensor argument (in the order of the op's schema) and of every
tensor result::

    "i j, j k -> i k | sum j"          a matmul: j contracted (summed) by the op
    "... s h -> ... s h | whole h"     an op that needs all of h on one rank (a norm over h)
    "b s h -> b s | max h"             a reduction over h (max)
    "... e -> ... e"                   an elementwise op; ``...`` stands for any leading dimensions

Each name is a *factor*. What a factor may do when an input is sharded along it on one mesh axis:

* **pass-through** (unmarked, appears in a result): every tensor holding it is sharded along it, the
  others replicated; each rank computes its block. The result is sharded the same way.
* **reduced** (``| sum j`` / ``mean`` / ``max`` / ``min``): every input holding it is sharded along it;
  each rank's result is a partial value (``Partial(sum)``...), completed by the collective DTensor
  chooses when the value is next used (an all-reduce, or a reduce-scatter into a sharded layout).
  A reduced factor may not appear in a result.
* **whole** (``| whole h``): never sharded; an input sharded along it is gathered first.
* ``1``: a size-1 dimension (``keepdim``), never sharded.

An unmarked factor that appears in no result is taken at its word, as Shardy does: each rank computes
from its block and the result is called replicated. That is right only when the op (or its ``impl``)
completes the reduction itself; a forgotten ``sum`` gives wrong values, which the property tests catch
(``tests/ops``). ``parse`` refuses what is malformed, naming the rule and the token:

    >>> r = parse("i j, j k -> i k | sum j")
    >>> r.operands, r.results, r.reduced
    ((('i', 'j'), ('j', 'k')), (('i', 'k'),), {'j': 'sum'})
    >>> parse("i j -> i | sum i")
    Traceback (most recent call last):
    ...
    hpfunc.ops.rule.RuleError: rule 'i j -> i | sum i': dimension 'i' is marked sum but appears in result 0; a reduced dimension must not appear in any result (drop it from the results, or unmark it)
"""

from __future__ import annotations

import re
from typing import Sequence

import attrs

__all__ = ["Rule", "RuleError", "parse", "REDUCTIONS"]

# rule mark -> DTensor's Partial reduce_op
REDUCTIONS = {"sum": "sum", "mean": "avg", "max": "max", "min": "min"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RuleError(ValueError):
    """A sharding rule that is malformed or contradicts the op it is registered for."""


@attrs.frozen
class Rule:
    """A parsed rule. ``operands``/``results``: one tuple of dimension names per tensor (``"..."`` for
    any leading dimensions, ``"1"`` for a size-1 dimension); ``reduced``: factor -> mark; ``whole``:
    the factors never sharded."""

    text: str
    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    reduced: dict[str, str] = attrs.field(factory=dict)
    whole: frozenset[str] = frozenset()

    @property
    def factors(self) -> tuple[str, ...]:
        """Every named dimension, in order of first appearance."""
        seen: dict[str, None] = {}
        for t in self.operands + self.results:
            for d in t:
                if d not in ("...", "1"):
                    seen.setdefault(d)
        return tuple(seen)

    def shardable(self) -> tuple[str, ...]:
        """The factors a mesh axis may shard: every factor except the whole ones."""
        return tuple(f for f in self.factors if f not in self.whole)

    def expand(self, ranks: Sequence[int], what: str = "operand") -> tuple[tuple[str, ...], ...]:
        """The operands' dimension names with ``...`` expanded for tensors of the given ranks (the
        ellipsis dimensions are named ``...0``, ``...1``, ... counted from the left of the ellipsis
        part, so all tensors share them); ``what`` names the tensors in errors."""
        return _expand(self.text, self.operands if what == "operand" else self.results, ranks, what)


def _expand(text: str, dims: tuple[tuple[str, ...], ...], ranks: Sequence[int], what: str) -> tuple:
    if len(dims) != len(ranks):
        raise RuleError(f"rule {text!r} names {len(dims)} {what}(s) but the op has {len(ranks)} tensor {what}(s)")
    out = []
    for i, (names, rank) in enumerate(zip(dims, ranks)):
        if "..." in names:
            k = rank - (len(names) - 1)
            if k < 0:
                raise RuleError(f"rule {text!r}: {what} {i} names {len(names) - 1} dimensions besides '...' but "
                                f"has rank {rank}")
            at = names.index("...")
            out.append(names[:at] + tuple(f"...{k - 1 - j}" for j in range(k)) + names[at + 1:])
        else:
            if len(names) != rank:
                raise RuleError(f"rule {text!r}: {what} {i} is named {' '.join(names) or '(a scalar)'} "
                                f"({len(names)} dimensions) but has rank {rank}")
            out.append(names)
    return tuple(out)


def _tensor(text: str, part: str, where: str) -> tuple[str, ...]:
    names = tuple(part.split())
    for n in names:
        if n not in ("...", "1") and not _NAME.match(n):
            raise RuleError(f"rule {text!r}: {where} has the token {n!r}; expected a dimension name "
                            f"(letters, digits, _), '...' or '1'")
    if names.count("...") > 1:
        raise RuleError(f"rule {text!r}: {where} has '...' twice; at most once per tensor")
    if len(set(n for n in names if n not in ("...", "1"))) != len([n for n in names if n not in ("...", "1")]):
        raise RuleError(f"rule {text!r}: {where} names a dimension twice ({' '.join(names)})")
    return names


def parse(text: str) -> Rule:
    """Parse a rule (see the module docstring); :class:`RuleError` names the rule and what is wrong."""
    if not isinstance(text, str):
        raise RuleError(f"a sharding rule is a string like 'i j, j k -> i k | sum j', found {type(text).__name__}")
    body, *marks = text.split("|")
    if body.count("->") != 1:
        raise RuleError(f"rule {text!r}: expected exactly one '->' between the operands and the results, "
                        f"found {body.count('->')}")
    lhs, rhs = body.split("->")
    operands = tuple(_tensor(text, p, f"operand {i}") for i, p in enumerate(lhs.split(",")))
    results = tuple(_tensor(text, p, f"result {i}") for i, p in enumerate(rhs.split(",")))
    known = {d for t in operands + results for d in t if d not in ("...", "1")}
    reduced: dict[str, str] = {}
    whole: set[str] = set()
    for m in marks:
        words = m.split()
        if not words:
            raise RuleError(f"rule {text!r}: an empty '|' clause; expected e.g. '| sum j' or '| whole h'")
        kind, names = words[0], words[1:]
        if kind not in REDUCTIONS and kind != "whole":
            raise RuleError(f"rule {text!r}: unknown mark {kind!r}; expected one of "
                            f"{', '.join(sorted(REDUCTIONS))} or whole")
        if not names:
            raise RuleError(f"rule {text!r}: the mark {kind!r} names no dimension")
        for n in names:
            if n not in known:
                raise RuleError(f"rule {text!r}: the mark {kind!r} names dimension {n!r}, which no tensor has")
            if n in reduced or n in whole:
                raise RuleError(f"rule {text!r}: dimension {n!r} is marked twice")
            if kind == "whole":
                whole.add(n)
            else:
                for i, r in enumerate(results):
                    if n in r:
                        raise RuleError(f"rule {text!r}: dimension {n!r} is marked {kind} but appears in result "
                                        f"{i}; a reduced dimension must not appear in any result (drop it from "
                                        f"the results, or unmark it)")
                reduced[n] = kind
    for i, r in enumerate(results):
        if "..." in r and not any("..." in o for o in operands):
            raise RuleError(f"rule {text!r}: result {i} has '...' but no operand does")
    return Rule(text=text, operands=operands, results=results, reduced=reduced, whole=frozenset(whole))
