"""Values keyed by distribution type, found along the class hierarchy.

Distribution-specific math (relaxations, cumulants, measure-valued decompositions, one-hot views,
supports for sampling without replacement, …) lives in registries keyed by distribution type, in
the manner of ``torch.distributions.kl.register_kl``: a value registered for a type also serves its
subclasses, and the most specific registered base class wins (``Chi2`` finds ``Gamma``'s entry
unless it has its own). Every registry is a [`TypeRegistry`][storch.registry.TypeRegistry] and is filled one way, by
[`TypeRegistry.register`][storch.registry.TypeRegistry.register]; the public ``register_*`` functions of the modules
(e.g.
[`storch.distributions.relaxation.register_relaxation`][storch.distributions.relaxation.register_relaxation]) are thin
wrappers around it.

Two things that would otherwise go unnoticed are errors:

* a type registered twice in one registry
([`DuplicateRegistrationError`][storch.registry.DuplicateRegistrationError]), unless the
  second registration says ``replace=True``, so that overriding a built-in entry is deliberate;
* a type that inherits from two or more registered types of which none is more specific than the
  others (multiple inheritance; [`AmbiguousLookupError`][storch.registry.AmbiguousLookupError]), whose fix is to
  register the type
  itself.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, Optional, Sequence, TypeVar

__all__ = ["TypeRegistry", "AmbiguousLookupError", "DuplicateRegistrationError", "ambiguity_message"]

V = TypeVar("V")


class AmbiguousLookupError(LookupError):
    """A type inherits from several registered types and none of them is more specific than the others.

    Raised by [`TypeRegistry.lookup`][storch.registry.TypeRegistry.lookup]; the message names the registry, the type,
    the candidates
    and the fix (register the type itself).
    """


class DuplicateRegistrationError(ValueError):
    """A type registered a second time in one [`TypeRegistry`][storch.registry.TypeRegistry] without
    ``replace=True``."""


def _name(cls: type) -> str:
    return cls.__qualname__


def _describe(value: object) -> str:
    """A short name of a registered value for messages: a function's name, else a short repr."""
    name = getattr(value, "__qualname__", None)
    if isinstance(name, str):
        return name
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def ambiguity_message(registry: str, cls: type, candidates: Sequence[type], register_with: str) -> str:
    """The message of [`AmbiguousLookupError`][storch.registry.AmbiguousLookupError] (shared with lookups that combine
    registries)."""
    listed = ", ".join(f"{_name(c)} ({c.__module__})" for c in candidates)
    return (
        f"The {registry} registry cannot choose an entry for {_name(cls)}: it inherits from "
        f"{len(candidates)} registered types and none is a subclass of the others: {listed}. "
        f"Register an entry for {_name(cls)} itself (with {register_with}) to say which applies."
    )


class TypeRegistry(Generic[V]):
    """Values keyed by type; [`lookup`][storch.registry.TypeRegistry.lookup] finds the entry of the most specific
    registered base class.

    A value registered for a type serves its subclasses too. When several registered types are
    bases of the queried one, the most specific wins (the one that is a subclass of all the
    others). With multiple inheritance two registered bases can be equally specific (neither is a
    subclass of the other); [`lookup`][storch.registry.TypeRegistry.lookup] then raises
    [`AmbiguousLookupError`][storch.registry.AmbiguousLookupError] rather than
    picking one by the method resolution order. ``torch.distributions.kl`` warns in that case and
    goes on; storch reports it as an error because the choice changes the gradient estimate without
    any other sign, and the fix, registering the subclass itself, is one line.

    ``in`` (exact registration, not inheritance), ``len`` and iteration (over the registered types,
    in registration order) work as on a ``dict``; entries are added only by
    [`register`][storch.registry.TypeRegistry.register] and
    removed by [`unregister`][storch.registry.TypeRegistry.unregister].

    Args:
        name: what the registry holds, for messages (``"relaxation"``: "the relaxation registry").
        register_with: the function users call to add entries, named in messages (default: this
            registry's [`register`][storch.registry.TypeRegistry.register]).

    Examples:
        >>> import torch
        >>> from torch.distributions import Chi2, Gamma, Normal
        >>> shapes = TypeRegistry("shape")
        >>> @shapes.register(Gamma)
        ... def _gamma_shape(d):
        ...     return d.concentration
        >>> shapes.lookup(Chi2(torch.tensor(3.0)))(Chi2(torch.tensor(3.0)))   # Chi2 is a Gamma
        tensor(1.5000)
        >>> shapes.lookup(Normal) is None
        True
        >>> Gamma in shapes, Chi2 in shapes, len(shapes), [t.__name__ for t in shapes]
        (True, False, 1, ['Gamma'])
    """

    def __init__(self, name: str, *, register_with: Optional[str] = None) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"TypeRegistry: the name must be a non-empty string, got {name!r}.")
        self.name = name
        self.register_with = register_with if register_with is not None else f"the register method of the {name} registry"
        self._entries: dict[type, V] = {}
        # type -> (registered type, value) or None; cleared whenever an entry changes
        self._cache: dict[type, Optional[tuple[type, V]]] = {}

    # ------------------------------------------------------------------ registration
    def register(self, *types: type, replace: bool = False) -> Callable[[V], V]:
        """Register a value for each of ``types`` (and so for their subclasses).

        The one way to fill a registry. It returns a function that records its argument for every
        type and returns it unchanged: use it as a decorator on a function
        (``@registry.register(Bernoulli)``), or call it on any other value
        (``registry.register(Bernoulli)(Coordinates(...))``).

        Args:
            *types: the types to register the value for (at least one).
            replace: allow replacing an existing entry of one of ``types`` (e.g. to override a
                built-in one); without it a second registration raises
                [`DuplicateRegistrationError`][storch.registry.DuplicateRegistrationError] and changes nothing.

        Returns:
            A function ``value -> value`` that registers ``value``.

        Raises:
            TypeError: if ``types`` is empty or holds something other than a type.
            DuplicateRegistrationError: when the value is given, if a type is already registered
                (or given twice) and ``replace`` is false.

        Examples:
            >>> from torch.distributions import Bernoulli, Categorical
            >>> sizes = TypeRegistry("support size")
            >>> sizes.register(Bernoulli)(2)
            2
            >>> sizes.register(Bernoulli)(3)
            Traceback (most recent call last):
            ...
            storch.registry.DuplicateRegistrationError: Bernoulli is already registered in the support size registry (to 2). Pass replace=True to replace its entry.
            >>> sizes.register(Bernoulli, replace=True)(3)
            3
            >>> sizes.lookup(Bernoulli)
            3
        """
        if not types:
            raise TypeError(f"{self.name} registry: register() needs at least one type.")
        for t in types:
            if not isinstance(t, type):
                raise TypeError(f"{self.name} registry: register() takes types, got {t!r}.")

        def record(value: V) -> V:
            if not replace:
                for i, t in enumerate(types):
                    if t in self._entries or t in types[:i]:
                        now = f" (to {_describe(self._entries[t])})" if t in self._entries else " (twice in one call)"
                        raise DuplicateRegistrationError(
                            f"{_name(t)} is already registered in the {self.name} registry{now}. "
                            "Pass replace=True to replace its entry."
                        )
            for t in types:
                self._entries[t] = value
            self._cache.clear()
            return value

        return record

    def unregister(self, cls: type) -> V:
        """Remove the entry registered for ``cls`` itself and return its value.

        Raises:
            KeyError: if ``cls`` has no entry of its own.

        Examples:
            >>> from torch.distributions import Bernoulli
            >>> sizes = TypeRegistry("support size")
            >>> sizes.register(Bernoulli)(2)
            2
            >>> sizes.unregister(Bernoulli), sizes.lookup(Bernoulli)
            (2, None)
        """
        if cls not in self._entries:
            raise KeyError(f"{_name(cls)} has no entry of its own in the {self.name} registry.")
        self._cache.clear()
        return self._entries.pop(cls)

    # ------------------------------------------------------------------ lookup
    def match(self, obj: object) -> Optional[tuple[type, V]]:
        """``(registered type, value)`` of the most specific registered base class of ``obj``, else ``None``.

        ``obj`` is a type or an instance (then its type is used). Like
        [`lookup`][storch.registry.TypeRegistry.lookup], which
        returns the value only.

        Raises:
            AmbiguousLookupError: if two or more registered bases are equally specific.

        Examples:
            >>> from torch.distributions import Chi2, Gamma
            >>> sizes = TypeRegistry("support size")
            >>> sizes.register(Gamma)("unbounded")
            'unbounded'
            >>> sizes.match(Chi2)
            (<class 'torch.distributions.gamma.Gamma'>, 'unbounded')
        """
        cls = obj if isinstance(obj, type) else type(obj)
        try:
            return self._cache[cls]
        except KeyError:
            pass
        mro = cls.__mro__
        candidates = [t for t in mro if t in self._entries]
        if not candidates:
            found = None
        else:
            # the MRO lists subclasses before their bases, so the first candidate is a most specific
            # one; it is the only one unless another candidate is not among its bases
            first = candidates[0]
            bases = first.__mro__
            rivals = [t for t in candidates[1:] if t not in bases]
            # a rival is equally specific unless it is a base of another candidate (then that one is
            # more specific than it, and it is out)
            rivals = [t for t in rivals if not any(o is not t and t in o.__mro__ for o in candidates)]
            if rivals:
                raise AmbiguousLookupError(ambiguity_message(self.name, cls, [first, *rivals], self.register_with))
            found = (first, self._entries[first])
        self._cache[cls] = found
        return found

    def lookup(self, obj: object) -> Optional[V]:
        """The value of the most specific registered base class of ``obj`` (a type or an instance), else ``None``.

        Raises:
            AmbiguousLookupError: if two or more registered bases are equally specific (neither is
                a subclass of the other); register ``obj``'s type itself to settle it.

        Examples:
            >>> sizes = TypeRegistry("support size", register_with="register_size")
            >>> class Coin: pass
            >>> class Die: pass
            >>> class Loaded(Coin, Die): pass
            >>> sizes.register(Coin)(2), sizes.register(Die)(6)
            (2, 6)
            >>> sizes.lookup(Loaded)
            Traceback (most recent call last):
            ...
            storch.registry.AmbiguousLookupError: The support size registry cannot choose an entry for Loaded: it inherits from 2 registered types and none is a subclass of the others: Coin (...), Die (...). Register an entry for Loaded itself (with register_size) to say which applies.
            >>> sizes.register(Loaded)(6)
            6
            >>> sizes.lookup(Loaded())
            6
        """
        found = self.match(obj)
        return None if found is None else found[1]

    # ------------------------------------------------------------------ container protocol
    def __contains__(self, cls: object) -> bool:
        return cls in self._entries

    def __iter__(self) -> Iterator[type]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TypeRegistry({self.name!r}, [{', '.join(_name(t) for t in self._entries)}])"
