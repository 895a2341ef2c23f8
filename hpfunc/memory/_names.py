"""Which storages carry which ``checkpoint_name``, scoped per transform call (in the layout binding's scopes).

``checkpoint_name`` records the storage of every value it tags in the current :class:`NameScope` and
in every enclosing one, so that code that only sees a tensor later (offload's saved-tensor layer,
the memory recorder) can still find its name, and a transform can check that the names its policy
refers to were tagged inside it. References to storages are weak.

    >>> import torch
    >>> with name_scope() as outer:
    ...     with name_scope() as inner:
    ...         h = torch.ones(3)
    ...         inner.record("hidden", h)
    >>> outer.name_of(h[1:]), sorted(outer.names)
    ('hidden', ['hidden'])
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hpfunc import layout
from hpfunc.memory._storage import local, storage_key

__all__ = ["NameScope", "name_scope", "current_scope"]


class NameScope:
    """Names tagged by ``checkpoint_name`` inside one transform call (forwarded to enclosing scopes)."""

    def __init__(self, parent: "NameScope | None" = None) -> None:
        self.parent = parent
        self.names: set[str] = set()
        self._by_storage: dict[int, tuple[StorageWeakRef, str]] = {}

    def record(self, name: str, t: torch.Tensor) -> None:
        scope: NameScope | None = self
        key = storage_key(t)
        while scope is not None:
            scope.names.add(name)
            scope._by_storage[key] = (StorageWeakRef(local(t).untyped_storage()), name)
            scope = scope.parent

    def name_of(self, t: torch.Tensor) -> str | None:
        return self.name_of_key(storage_key(t))

    def name_of_key(self, key: int) -> str | None:
        """The name of the storage with this key (see ``storage_key``), if it is tagged and alive."""
        scope: NameScope | None = self
        while scope is not None:  # tags made outside this scope (by the caller) count too
            hit = scope._by_storage.get(key)
            if hit is not None and not hit[0].expired():
                return hit[1]
            scope = scope.parent
        return None


def current_scope() -> NameScope | None:
    """The innermost name scope (``None`` outside every one)."""
    return layout.scopes().name_scope


@contextlib.contextmanager
def name_scope() -> Iterator[NameScope]:
    """A new name scope inside the current one, for the ``with`` block (bound in the layout binding's
    scopes: a step's own bindings keep it)."""
    scope = NameScope(current_scope())
    with layout.scoped(name_scope=scope):
        yield scope
