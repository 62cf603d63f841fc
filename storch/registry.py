"""Values keyed by distribution type, found along the class hierarchy.

Distribution-specific math (relaxations, cumulants, measure-valued decompositions, one-hot views,
supports for sampling without replacement, …) lives in registries keyed by distribution type, in
the manner of ``torch.distributions.kl.register_kl``: a value registered for a type also serves its
subclasses, and the most specific registered base class wins (``Chi2`` finds ``Gamma``'s entry
unless it has its own). Every registry is a `storch.registry.TypeRegistry`, made in
`storch.registries` together with its public ``register_*`` function (e.g.
`storch.registries.register_relaxation`), a thin wrapper around
`storch.registry.TypeRegistry.register`. The modules that use a registry fill
it with their built-in entries when they are imported, by
`storch.registry.TypeRegistry.register_default`, which keeps an entry a
user registered earlier.

Two things that would otherwise go unnoticed are errors:

* a type registered twice in one registry (`storch.registry.DuplicateRegistrationError`), unless the
  second registration says ``replace=True``, so that overriding a built-in entry is deliberate;
* a type that inherits from two or more registered types of which none is more specific than the
  others (multiple inheritance; `storch.registry.AmbiguousLookupError`), whose fix is to register
  the type itself.

``Independent`` distributions find their base distribution's entry. ``Independent(base, 0)`` *is*
``base``, and ``Independent(base, n)`` only regroups ``n`` batch dimensions of ``base`` as event
dimensions: its samples have the same shape and the same law, and storch sums a node's
log-probability over all its non-plate dimensions either way. So a lookup with an ``Independent``
instance (wrapped any number of times) that has no entry of its own (no entry registered for
``Independent`` or a subclass) returns the entry of the innermost base distribution, and the
functions in it are called with that base distribution (see
`storch.registry.TypeRegistry.lookup`). A registry whose users read the batch
dimensions of the distribution as its coordinates (local expectations, measure-valued derivatives)
says so when it is made (``reinterpreted_refused``): there, ``Independent(base, n)`` with ``n > 0``
is refused with `storch.registry.ReinterpretedDimsError`, which gives the
reason and the fix (pass ``base`` itself).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Generic, Iterator, NamedTuple, Optional, Sequence, TypeVar

from torch.distributions import Distribution, Independent

__all__ = [
    "TypeRegistry", "AmbiguousLookupError", "DuplicateRegistrationError", "ReinterpretedDimsError", "Resolution",
    "ambiguity_message", "independent_base",
]

V = TypeVar("V")


class AmbiguousLookupError(LookupError):
    """A type inherits from several registered types and none of them is more specific than the others.

    Raised by `storch.registry.TypeRegistry.lookup`; the message names the registry, the type,
    the candidates
    and the fix (register the type itself).
    """


class DuplicateRegistrationError(ValueError):
    """A type registered a second time in one `storch.registry.TypeRegistry` without
    ``replace=True``."""


class ReinterpretedDimsError(ValueError):
    """``Independent(base, n)`` with ``n > 0`` looked up in a registry whose users cannot take it for ``base``.

    Raised by `storch.registry.TypeRegistry.lookup` of a registry made with
    ``reinterpreted_refused``; the message names the registry, the distribution, the reason and the
    fix (pass the base distribution itself, or register an entry for ``Independent``).
    """


def independent_base(distr: Any) -> tuple[Any, int]:
    """The distribution under all ``Independent`` wrappers of ``distr`` and the number of batch
    dimensions they reinterpret as event dimensions (``(distr, 0)`` for anything else).

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli, Independent
        >>> base = Bernoulli(torch.full((2, 3), 0.5))
        >>> independent_base(Independent(Independent(base, 1), 1)) == (base, 2)
        True
    """
    n = 0
    while isinstance(distr, Independent):
        n += distr.reinterpreted_batch_ndims
        distr = distr.base_dist
    return distr, n


class Resolution(NamedTuple):
    """What `storch.registry.TypeRegistry.resolve` found for a distribution.

    Attributes:
        value: the entry (for an unwrapped ``Independent``, the base's entry, as registered).
        registered: the registered type it was found under.
        distribution: the distribution the entry applies to: the base distribution for an unwrapped
            ``Independent``, else the queried one.
        reinterpreted: the batch dimensions of ``distribution`` that the query reinterprets as event
            dimensions (0 unless an ``Independent`` was unwrapped).
    """

    value: Any
    registered: type
    distribution: Any
    reinterpreted: int


def _to_base(arg: Any) -> Any:
    return independent_base(arg)[0] if isinstance(arg, Independent) else arg


def _on_base(value: Any) -> Any:
    """``value`` with its functions taking the base distribution in place of an ``Independent``.

    Plain functions (also partials and bound methods) are wrapped; a dataclass gets a copy whose
    function (and dataclass) fields are wrapped; anything else is returned as it is, and then sees the
    ``Independent`` itself.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _on_base(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        fn = value

        @functools.wraps(fn)
        def on_base(*args: Any, **kwargs: Any) -> Any:
            return fn(*map(_to_base, args), **{k: _to_base(v) for k, v in kwargs.items()})

        return on_base
    return value


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
    """The message of `storch.registry.AmbiguousLookupError` (shared with lookups that combine
    registries)."""
    listed = ", ".join(f"{_name(c)} ({c.__module__})" for c in candidates)
    return (
        f"The {registry} registry cannot choose an entry for {_name(cls)}: it inherits from "
        f"{len(candidates)} registered types and none is a subclass of the others: {listed}. "
        f"Register an entry for {_name(cls)} itself (with {register_with}) to say which applies."
    )


class TypeRegistry(Generic[V]):
    """Values keyed by type; `storch.registry.TypeRegistry.lookup` finds the entry of the most specific
    registered base class.

    A value registered for a type serves its subclasses too. When several registered types are
    bases of the queried one, the most specific wins (the one that is a subclass of all the
    others). With multiple inheritance two registered bases can be equally specific (neither is a
    subclass of the other); `storch.registry.TypeRegistry.lookup` then raises
    `storch.registry.AmbiguousLookupError` rather than
    picking one by the method resolution order. ``torch.distributions.kl`` warns in that case and
    goes on; storch reports it as an error because the choice changes the gradient estimate without
    any other sign, and the fix, registering the subclass itself, is one line.

    ``in`` (exact registration, not inheritance), ``len`` and iteration (over the registered types,
    in registration order) work as on a ``dict``; entries are added only by
    `storch.registry.TypeRegistry.register` and
    removed by `storch.registry.TypeRegistry.unregister`.

    ``Independent`` distributions without an entry of their own find their base distribution's
    entry (see the module docstring and `storch.registry.TypeRegistry.resolve`).

    Args:
        name: what the registry holds, for messages (``"relaxation"``: "the relaxation registry").
        register_with: the function users call to add entries, named in messages (default: this
            registry's `storch.registry.TypeRegistry.register`).
        reinterpreted_refused: why the users of this registry cannot take ``Independent(base, n)``
            with ``n > 0`` for ``base`` (e.g. they read the batch dimensions as coordinates); such a
            lookup then raises `storch.registry.ReinterpretedDimsError` with
            this reason. ``None`` (the default): it is served by ``base``'s entry.

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

    def __init__(
        self, name: str, *, register_with: Optional[str] = None, reinterpreted_refused: Optional[str] = None
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"TypeRegistry: the name must be a non-empty string, got {name!r}.")
        self.name = name
        self.register_with = register_with if register_with is not None else f"the register method of the {name} registry"
        self.reinterpreted_refused = reinterpreted_refused
        self._entries: dict[type, V] = {}
        # type -> (registered type, value) or None; cleared whenever an entry changes
        self._cache: dict[type, Optional[tuple[type, V]]] = {}
        # registered type -> its value adapted to take base distributions (for unwrapped Independents)
        self._adapted: dict[type, V] = {}

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
                `storch.registry.DuplicateRegistrationError` and changes nothing.

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
        self._check_types("register", types)

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
            self._adapted.clear()
            return value

        return record

    def register_default(self, *types: type) -> Callable[[V], V]:
        """Register a built-in value for each of ``types`` that has no entry of its own yet.

        How a module fills a registry it does not own with its built-in entries, when it is
        imported: an entry already registered for exactly one of ``types`` (a user's, registered
        before that module was imported) is kept, neither replaced nor an error. Otherwise the same
        as `storch.registry.TypeRegistry.register`: a later registration over a default
        entry still needs ``replace=True``.

        Args:
            *types: the types to register the value for (at least one).

        Returns:
            A function ``value -> value`` that registers ``value`` where nothing is registered.

        Raises:
            TypeError: if ``types`` is empty or holds something other than a type.

        Examples:
            >>> from torch.distributions import Bernoulli, Categorical
            >>> sizes = TypeRegistry("support size")
            >>> sizes.register(Bernoulli)(3)   # the user's entry, made first
            3
            >>> sizes.register_default(Bernoulli, Categorical)("finite")
            'finite'
            >>> sizes.lookup(Bernoulli), sizes.lookup(Categorical)
            (3, 'finite')
        """
        self._check_types("register_default", types)

        def record(value: V) -> V:
            missing = [t for t in dict.fromkeys(types) if t not in self._entries]
            if missing:
                self.register(*missing)(value)
            return value

        return record

    def _check_types(self, caller: str, types: Sequence[object]) -> None:
        """Raise ``TypeError`` unless ``types`` is a non-empty sequence of types."""
        if not types:
            raise TypeError(f"{self.name} registry: {caller}() needs at least one type.")
        for t in types:
            if not isinstance(t, type):
                raise TypeError(f"{self.name} registry: {caller}() takes types, got {t!r}.")

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
        self._adapted.clear()
        return self._entries.pop(cls)

    # ------------------------------------------------------------------ lookup
    def match(self, obj: object) -> Optional[tuple[type, V]]:
        """``(registered type, value)`` of the most specific registered base class of ``obj``, else ``None``.

        ``obj`` is a type or an instance (then its type is used; an ``Independent`` instance is
        resolved by `storch.registry.TypeRegistry.resolve`, which may unwrap it). Like
        `storch.registry.TypeRegistry.lookup`, which
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
        if isinstance(obj, Independent):
            found = self.resolve(obj)
            return None if found is None else (found.registered, found.value)
        return self._match_type(obj if isinstance(obj, type) else type(obj))

    def _match_type(self, cls: type) -> Optional[tuple[type, V]]:
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
            ReinterpretedDimsError: see `storch.registry.TypeRegistry.resolve`.

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

    def resolve(self, distr: Any) -> Optional[Resolution]:
        """The entry for the distribution ``distr`` and the distribution it applies to, else ``None``.

        For anything but an ``Independent`` this is `storch.registry.TypeRegistry.match` with
        ``distr`` itself. An ``Independent`` (wrapped any number of times) with an entry of its own
        (registered for ``Independent`` or a subclass) gets that entry. Otherwise it gets the entry of
        its innermost base distribution, adapted so that the functions in it (the entry itself if it
        is a function; the function fields of a dataclass entry) are called with the base
        distribution wherever they are given the ``Independent``; ``distribution`` is the base then.

        Raises:
            ReinterpretedDimsError: for an ``Independent`` that reinterprets ``n > 0`` batch
                dimensions, in a registry made with ``reinterpreted_refused``.
            AmbiguousLookupError: as `storch.registry.TypeRegistry.match`.

        Examples:
            >>> import torch
            >>> from torch.distributions import Bernoulli, Independent
            >>> means = TypeRegistry("mean")
            >>> _ = means.register(Bernoulli)(lambda d: d.probs)
            >>> d = Independent(Bernoulli(torch.tensor([0.25, 0.75])), 1)
            >>> found = means.resolve(d)
            >>> found.registered.__name__, found.reinterpreted, found.value(d).tolist()
            ('Bernoulli', 1, [0.25, 0.75])
            >>> strict = TypeRegistry("coordinate", reinterpreted_refused="it reads the batch dimensions.")
            >>> _ = strict.register(Bernoulli)(lambda d: d.probs)
            >>> strict.lookup(Independent(Bernoulli(torch.tensor([0.2])), 0)) is not None   # n = 0: Bernoulli
            True
            >>> strict.lookup(d)
            Traceback (most recent call last):
            ...
            storch.registry.ReinterpretedDimsError: The coordinate registry serves Independent(Bernoulli, ...) ...
        """
        own = self._match_type(type(distr))
        if not isinstance(distr, Independent) or (own is not None and issubclass(own[0], Independent)):
            return None if own is None else Resolution(own[1], own[0], distr, 0)
        base, n = independent_base(distr)
        found = self._match_type(type(base))
        if found is None:
            # a catch-all entry (e.g. for Distribution) still serves the Independent itself
            return None if own is None else Resolution(own[1], own[0], distr, 0)
        if n > 0 and self.reinterpreted_refused is not None:
            raise ReinterpretedDimsError(self._refusal(distr, base, n))
        registered, value = found
        if registered not in self._adapted:
            self._adapted[registered] = _on_base(value)
        return Resolution(self._adapted[registered], registered, base, n)

    def _refusal(self, distr: Distribution, base: Distribution, n: int) -> str:
        name = type(base).__name__
        return (
            f"The {self.name} registry serves Independent({name}, reinterpreted_batch_ndims={n}) only with "
            f"reinterpreted_batch_ndims=0 (batch shape {tuple(distr.batch_shape)}, event shape "
            f"{tuple(distr.event_shape)}): {self.reinterpreted_refused} Pass the base distribution {name} "
            "itself, whose batch dimensions are independent too and whose samples have the same shape "
            f"(storch sums a node's log-probability over them either way), or register an entry for "
            f"Independent with {self.register_with}."
        )

    # ------------------------------------------------------------------ container protocol
    def __contains__(self, cls: object) -> bool:
        return cls in self._entries

    def __iter__(self) -> Iterator[type]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TypeRegistry({self.name!r}, [{', '.join(_name(t) for t in self._entries)}])"
