"""``storch.storch``: the module under which the Storchastic manual documents its utilities (§10.5).

Storchastic kept ``cat``, ``gather``, ``reduce_plates``, ``variance`` and friends in a module
``storch/storch.py`` and re-exported them at the top level. storch defines them in
`storch.ops`, `storch.reductions`, `storch.plate` and
`storch.distributions.relaxation`; this module only re-exports those functions (the same
objects as ``storch.cat``, ``storch.reduce_plates``, ...), so code written against the manual's
paths, e.g. ``storch.storch.reduce_plates(x, "z")``, runs unchanged.

Examples:
    >>> import storch
    >>> storch.storch.reduce_plates is storch.reduce_plates and storch.storch.cat is storch.cat
    True
"""

from __future__ import annotations

from storch.distributions.relaxation import conditional_gumbel_rsample
from storch.ops import cat, expand_as, gather, grad
from storch.plate import order_plates
from storch.reductions import logsumexp, mean, reduce_plates, sum, variance  # noqa: A004

__all__ = [
    "cat", "conditional_gumbel_rsample", "expand_as", "gather", "grad", "logsumexp", "mean",
    "order_plates", "reduce_plates", "sum", "variance",
]
