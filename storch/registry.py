"""Values keyed by distribution type, found along the class hierarchy.

Distribution-specific math (relaxations, cumulants, measure-valued decompositions, one-hot views,
supports for sampling without replacement, …) lives in registries keyed by distribution type, in
the manner of ``torch.distributions.kl.register_kl``: a value registered for a type also serves its
subclasses, and the nearest registered base class wins (``Chi2`` finds ``Gamma``'s entry unless it
has its own).
"""

from __future__ import annotations

from typing import Generic, Optional, TypeVar

__all__ = ["TypeRegistry"]

V = TypeVar("V")


class TypeRegistry(dict, Generic[V]):
    """A ``dict`` from types to values whose :meth:`lookup` also accepts instances and subclasses.

    Examples:
        >>> import torch
        >>> from torch.distributions import Chi2, Gamma, Normal
        >>> shapes = TypeRegistry()
        >>> shapes[Gamma] = "concentration"
        >>> shapes.lookup(Chi2(torch.tensor(3.0)))       # a subclass of Gamma
        'concentration'
        >>> shapes.lookup(Normal) is None
        True
    """

    def lookup(self, obj: object) -> Optional[V]:
        """The value of the nearest registered class of ``obj`` (a type or an instance), else ``None``."""
        cls = obj if isinstance(obj, type) else type(obj)
        for base in cls.__mro__:
            if base in self:
                return self[base]
        return None
