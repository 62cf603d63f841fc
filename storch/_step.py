"""What the current step has recorded: its registered costs and the plates of the nodes it sampled.

Both are kept per context (thread, asyncio task) in a `StepLog`. `storch.backward` reads the costs
and the sampled plates (to warn about nodes whose gradient would silently be zero), and
`storch.reset` forgets them. Only nodes that need a cost to carry their plate are noted (see
`storch.method.Method.forward`); entries are weak, so a step that never reaches ``backward`` keeps
nothing alive.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Callable, Generic, Hashable, NamedTuple, TypeVar

from storch.plate import Plate

__all__ = ["StepLog", "note_sampled", "sampled_plates", "forget_sampled"]

_Item = TypeVar("_Item")


class _Prefix(NamedTuple):
    """What one context sees of a log: the first ``n`` items of the shared list ``items``, and the
    shared index of their keys (key -> position; a key at a position ``>= n`` is not this context's)."""

    items: list | None
    n: int
    index: dict | None


_EMPTY = _Prefix(None, 0, None)


class StepLog(Generic[_Item]):
    """A list kept per context (thread, asyncio task), appended to in O(1).

    A context variable must hold a value that other contexts cannot change: a context copied from
    this one (a thread or task started with ``contextvars.copy_context()``) keeps what it saw. With a
    tuple that means a copy at every append, ``O(T)`` for the ``T``-th: an episode of 10 000
    decisions spent about 25 µs per `storch.add_cost` and 23 µs per node on the copies. Here the
    context holds a prefix of a shared list instead: an append where the list ends at the prefix (one
    context appending, the usual case) extends the list in place; a context whose list was extended
    by another copies its prefix first (copy on write). Each context sees exactly what it appended.

    Args:
        name: the context variable's name.
        key: with it, the log also answers whether it holds an item of a given key (`holds`) in O(1);
            keys must be unique within a context.

    Examples:
        >>> log = StepLog("example", key=str.upper)
        >>> log.append("a"); log.append("b")
        >>> log.items(), len(log), log.holds("B"), log.holds("C")
        (('a', 'b'), 2, True, False)
        >>> log.clear(); log.items()
        ()
    """

    def __init__(self, name: str, key: Callable[[_Item], Hashable] | None = None) -> None:
        self._var: ContextVar[_Prefix] = ContextVar(name, default=_EMPTY)
        self._key = key

    def append(self, item: _Item) -> None:
        items, n, index = self._var.get()
        if items is not None and len(items) == n:
            items.append(item)
            if items[n] is item:  # (else another thread appended to the same list at the same moment)
                if index is not None:
                    index[self._key(item)] = n  # type: ignore[misc]
                self._var.set(_Prefix(items, n + 1, index))
                return
        # the first item, or another context extended the list past what this one sees: copy
        self.replace(([] if items is None else items[:n]) + [item])

    def items(self) -> tuple[_Item, ...]:
        """What this context appended since it was last cleared, oldest first."""
        items, n, _ = self._var.get()
        return () if items is None else tuple(items[:n])

    def holds(self, key: Hashable) -> bool:
        """Whether this context appended an item of ``key`` (a log made with ``key``)."""
        _, n, index = self._var.get()
        return index is not None and index.get(key, n) < n

    def replace(self, items: list[_Item]) -> None:
        """Make ``items`` (a new list, owned by the log from now on) what this context sees."""
        key = self._key
        index = None if key is None else {key(item): i for i, item in enumerate(items)}
        self._var.set(_Prefix(items, len(items), index))

    def clear(self) -> None:
        self._var.set(_EMPTY)

    def __len__(self) -> int:
        return self._var.get().n


_SAMPLED: StepLog[weakref.ref] = StepLog("storch_sampled")
_PRUNE_AT = 64


def note_sampled(plate: Plate) -> None:
    """Remember the plate of a node sampled in this step."""
    n = len(_SAMPLED)
    if n >= _PRUNE_AT and n & (n - 1) == 0:  # at 64, 128, 256, ... entries (amortised O(1) per node):
        # drop the nodes of steps that never reached backward
        _SAMPLED.replace([r for r in _SAMPLED.items() if r() is not None])
    _SAMPLED.append(weakref.ref(plate))


def sampled_plates() -> list[Plate]:
    """The live plates noted since the last `forget_sampled`, oldest first."""
    return [p for p in (r() for r in _SAMPLED.items()) if p is not None]


def forget_sampled() -> None:
    _SAMPLED.clear()
