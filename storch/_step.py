"""What the current step has sampled: the plates of stochastic nodes that should reach a cost.

Kept per context (thread, asyncio task) like the cost registry. `storch.backward` reads it to
warn about nodes whose gradient would silently be zero, and `storch.reset` forgets it. Only
nodes that need a cost to carry their plate are noted (see `storch.method.Method.forward`);
entries are weak, so a step that never reaches ``backward`` keeps nothing alive.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar

from storch.plate import Plate

__all__ = ["note_sampled", "sampled_plates", "forget_sampled"]

_SAMPLED: ContextVar[tuple[weakref.ref, ...]] = ContextVar("storch_sampled", default=())
_PRUNE_AT = 64


def note_sampled(plate: Plate) -> None:
    """Remember the plate of a node sampled in this step."""
    refs = _SAMPLED.get()
    n = len(refs)
    if n >= _PRUNE_AT and n & (n - 1) == 0:  # at 64, 128, 256, ... entries (amortised O(1) per node):
        refs = tuple(r for r in refs if r() is not None)  # drop nodes of steps that never reached backward
    _SAMPLED.set(refs + (weakref.ref(plate),))


def sampled_plates() -> list[Plate]:
    """The live plates noted since the last `forget_sampled`, oldest first."""
    return [p for p in (r() for r in _SAMPLED.get()) if p is not None]


def forget_sampled() -> None:
    _SAMPLED.set(())
