"""``storch.sampling.unordered_set``: the manual's module for unordered set sampling (§9.4).

Storchastic 0.3.7 defined :class:`UnorderedSet` and :class:`GumbelSoftmaxWOR` in
``storch/sampling/unordered_set.py``; storch defines them in :mod:`storch.sampling.unordered`.
This module re-exports the same classes under the manual's path. Their constructors are
storch's (docs/migrating.md lists what differs from Storchastic's).

Examples:
    >>> import storch.sampling.unordered as unordered
    >>> UnorderedSet is unordered.UnorderedSet and GumbelSoftmaxWOR is unordered.GumbelSoftmaxWOR
    True
"""

from __future__ import annotations

from storch.sampling.unordered import GumbelSoftmaxWOR, UnorderedSet

__all__ = ["UnorderedSet", "GumbelSoftmaxWOR"]
