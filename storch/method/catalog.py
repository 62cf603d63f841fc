"""The estimator catalog as data: which estimator is unbiased for which distribution type and order.

The catalog's table (the documentation's estimator overview) states, per estimator, the distribution
types it handles and whether its derivatives of the first order, the second, or every order are
unbiased. This module holds those declarations in the library, one
`storch.method.catalog.CatalogEntry` per way of building an estimator, so that tools
read them instead of a copy: storch's random-graph tester (`storch.testing.fuzz`)
draws, for each node of a random graph, an entry that declares itself unbiased for the node's
distribution and the derivative order checked, and compares the estimate with the exact value. An
estimator is fuzzed from the day it is registered with
`storch.method.catalog.register_estimator`.

An entry declares:

* ``distributions``: the distribution types it handles (a subclass counts; ``Distribution`` means any);
* ``unbiased_orders``: ``0`` for a biased estimator (a relaxation, finite differences), ``1`` for
  unbiased first derivatives only, ``2`` up to the second, `storch.method.catalog.EVERY_ORDER`
  for derivatives of every order;
* ``warmup``: steps to run before an estimate is representative (a baseline or control variate that
  learns between steps); the claim holds at every step, the warm-up only exercises the learned state;
* ``relaxes``: the cost is also evaluated at relaxed (continuous) values of the sample;
* ``joinable``: single-sample nodes of this estimator can join an earlier node's points
  (``joint_with=``, local expectations);
* ``requires``: a condition on the model beyond the distribution type, in words (a multi-sample bound,
  a cost differentiable in the sample); an entry with one is not drawn for arbitrary graphs;
* ``source``: optionally, the code that builds the method (``{name}`` and ``{shape}`` filled in), which
  the tester prints in its reproducers;
* ``make_counted``: optionally, ``make`` with the number of samples (its ``n_samples``, or ``k`` for
  sampling without replacement) given, for tools that build estimators at a budget
  (`storch.method.Auto`); ``None`` for an estimator whose cost has no count (enumeration).
* ``downstream_orders``: the derivative order for which the estimators of every node drawn, directly
  or not, from this node's samples must be unbiased (``GSB`` differentiates their surrogate twice in
  the sample: below a GSB Normal, an estimator unbiased for first derivatives only, such as ARSM, would
  give its scale a wrong gradient; storch refuses to draw one there, with the orders declared here).

Examples:
    >>> from torch.distributions import Bernoulli, Normal
    >>> from storch.method.catalog import unbiased_estimators
    >>> "DisARM" in [e.label for e in unbiased_estimators(Bernoulli, order=1)]
    True
    >>> "DisARM" in [e.label for e in unbiased_estimators(Bernoulli, order=2)]
    False
    >>> [e.label for e in unbiased_estimators(Normal, order=2)][:2]
    ['Reparameterization', 'ScoreFunction']
"""

from __future__ import annotations

from dataclasses import dataclass
import inspect
import re
from typing import Callable, Optional

from torch.distributions import Bernoulli, Categorical, Distribution, Normal, OneHotCategorical

from storch.method.arm import ARM, DisARM
from storch.method.arms import ARMS, ARMSMultiSample
from storch.method.arsm import ARSM
from storch.method.carms import CARMS
from storch.method.coupled_categorical import CoupledCategorical, CoupledCategoricalIW
from storch.method.double_control_variate import DoubleControlVariate
from storch.method.expect import Expect
from storch.method.gapped_straight_through import GappedStraightThrough
from storch.method.gsb import GSB
from storch.method.gumbel import GumbelSoftmax
from storch.method.gumbel_sparse import GumbelEntmax, GumbelSparseMax
from storch.method.infer import Infer
from storch.method.local_expectation import LocalExpectation
from storch.method.mapo import MAPO
from storch.method.method import Method
from storch.method.mvd import MVD
from storch.method.rao_blackwell import RaoBlackwellSF
from storch.method.relax import LAX, REBAR, RELAX
from storch.method.reparameterization import Reparameterization
from storch.method.score_function import ScoreFunction
from storch.method.score_function_wor import ScoreFunctionWOR
from storch.method.spsa import SPSA
from storch.method.straight_through import GumbelRao, ReinMax, StraightThrough
from storch.method.unordered_set import UnorderedSetEstimator, UnorderedSetGumbelSoftmax
from storch.method.vimco import VIMCO
from storch.sampling.importance import ImportanceSampling

__all__ = [
    "CatalogEntry", "EVERY_ORDER", "register_estimator", "entry", "catalog", "highest_unbiased_order",
    "unbiased_estimators",
]

#: ``unbiased_orders`` of an estimator whose derivatives of every order are unbiased
EVERY_ORDER = 1_000_000

#: ``make(plate_name, event_shape)``: the method for one node whose samples have ``event_shape``
#: beyond their plates (``()`` for one Categorical variable, ``(D,)`` for ``D`` Bernoullis, ...)
MakeMethod = Callable[[str, "tuple[int, ...]"], Method]
#: ``make_counted(plate_name, event_shape, count)``: the same with ``count`` samples
MakeCounted = Callable[[str, "tuple[int, ...]", int], Method]

DISCRETE = (Bernoulli, Categorical, OneHotCategorical)
ANY = (Distribution,)


@dataclass(frozen=True)
class CatalogEntry:
    """One way of building an estimator, and what the catalog declares about it (module docstring)."""

    label: str
    estimator: type
    make: MakeMethod
    distributions: tuple[type, ...]
    unbiased_orders: int
    warmup: int = 0
    relaxes: bool = False
    joinable: bool = False
    requires: str = ""
    source: str = ""
    make_counted: Optional[MakeCounted] = None
    downstream_orders: int = 0

    def handles(self, distribution: type) -> bool:
        """Whether the entry declares ``distribution`` (a type) among those it handles."""
        return any(issubclass(distribution, d) for d in self.distributions)

    def unbiased_for(self, distribution: type, order: int) -> bool:
        """Whether the entry declares unbiased derivatives of ``order`` for ``distribution``."""
        return self.handles(distribution) and order <= self.unbiased_orders


_CATALOG: dict[str, CatalogEntry] = {}


def register_estimator(entry: CatalogEntry) -> CatalogEntry:
    """Add ``entry`` to the catalog (its label must be new); returns it."""
    if not isinstance(entry, CatalogEntry):
        raise TypeError(f"register_estimator: expected a CatalogEntry, got {type(entry).__name__}.")
    if entry.label in _CATALOG:
        raise ValueError(
            f"register_estimator: an entry labelled {entry.label!r} is already registered "
            f"({_CATALOG[entry.label].estimator.__name__}); give the new entry another label."
        )
    if entry.unbiased_orders < 0:
        raise ValueError(f"register_estimator({entry.label!r}): unbiased_orders must be >= 0, got {entry.unbiased_orders}.")
    _CATALOG[entry.label] = entry
    return entry


def entry(label: str) -> CatalogEntry:
    """The entry labelled ``label``."""
    if label not in _CATALOG:
        raise KeyError(f"no catalog entry labelled {label!r}; the labels are {sorted(_CATALOG)}.")
    return _CATALOG[label]


def catalog() -> tuple[CatalogEntry, ...]:
    """Every registered entry, in the order of registration."""
    return tuple(_CATALOG.values())


def highest_unbiased_order(estimator: type) -> int | None:
    """The highest derivative order that some entry of the class ``estimator`` is declared unbiased
    for (`EVERY_ORDER` for every order); ``None`` for a class the catalog does not list (a user's
    estimator, about which it claims nothing).

    Example:
        >>> from storch.method import ARSM, ScoreFunction
        >>> highest_unbiased_order(ARSM), highest_unbiased_order(ScoreFunction) == EVERY_ORDER
        (1, True)
    """
    orders = [e.unbiased_orders for e in _CATALOG.values() if e.estimator is estimator]
    return max(orders) if orders else None


def unbiased_estimators(distribution: type, order: int = 1, *, plain_models: bool = True) -> list[CatalogEntry]:
    """The entries declared unbiased for ``distribution`` (a type) at derivative ``order``.

    With ``plain_models`` (the default), entries with a ``requires`` condition are left out.
    """
    return [
        e for e in _CATALOG.values()
        if e.unbiased_for(distribution, order) and not (plain_models and e.requires)
    ]


def _source_entry(label: str, source: str, distributions: tuple[type, ...], orders: int, **kw) -> None:
    """Register a built-in entry given as the code that builds it (``{name}``: the plate name as a
    literal, ``{shape}``: the sample's event shape, ``1`` when it has none)."""
    estimator = _NAMESPACE[source.split("(", 1)[0]]

    def make(name: str, event_shape: tuple[int, ...]) -> Method:
        return eval(source.format(name=repr(name), shape=tuple(event_shape) or 1), dict(_NAMESPACE))  # noqa: S307

    counted = _counted_source(source, estimator)
    make_counted = None
    if counted:
        def make_counted(name: str, event_shape: tuple[int, ...], count: int) -> Method:
            code = counted.format(name=repr(name), shape=tuple(event_shape) or 1, count=int(count))
            return eval(code, dict(_NAMESPACE))  # noqa: S307

    register_estimator(CatalogEntry(label, estimator, make, distributions, orders, source=source,
                                    make_counted=make_counted, **kw))


_COUNT = re.compile(r"\b(n_samples|k)=\d+")


def _counted_source(source: str, estimator: type) -> str:
    """``source`` with its count (the first ``n_samples=`` or ``k=``) as ``{count}``; one added as
    ``n_samples={count}`` when the estimator takes it; ``""`` when the count is not the estimator's own
    (a ``sampling_method`` given) or it has none (enumeration)."""
    if _COUNT.search(source):
        return _COUNT.sub(lambda m: m.group(1) + "={count}", source, count=1)
    if "sampling_method=" in source or "n_samples" not in inspect.signature(estimator).parameters:
        return ""
    return source[:-1] + ", n_samples={count})"


_NAMESPACE: dict[str, object] = {
    cls.__name__: cls
    for cls in (
        ARM, ARMS, ARMSMultiSample, ARSM, CARMS, CoupledCategorical, CoupledCategoricalIW, DisARM,
        DoubleControlVariate, Expect, GappedStraightThrough, GSB, GumbelEntmax, GumbelRao, GumbelSoftmax,
        GumbelSparseMax, ImportanceSampling, Infer, LAX, LocalExpectation, MAPO, MVD, RaoBlackwellSF, REBAR,
        ReinMax, RELAX, Reparameterization, ScoreFunction, ScoreFunctionWOR, SPSA, StraightThrough,
        UnorderedSetEstimator, UnorderedSetGumbelSoftmax, VIMCO,
    )
}

_E = _source_entry
_E("Reparameterization", "Reparameterization({name})", (Normal,), EVERY_ORDER)
_E("ScoreFunction", "ScoreFunction({name})", ANY, EVERY_ORDER)
_E("ScoreFunction(n_samples=3)", "ScoreFunction({name}, n_samples=3)", ANY, EVERY_ORDER)
_E("ScoreFunction + moving_average", "ScoreFunction({name}, baseline_factory='moving_average')", ANY, EVERY_ORDER,
   warmup=3)
_E("ScoreFunction + batch_average", "ScoreFunction({name}, n_samples=3, baseline_factory='batch_average')", ANY,
   EVERY_ORDER)
_E("ScoreFunction + critic", "ScoreFunction({name}, baseline_factory='critic')", ANY, EVERY_ORDER, warmup=3)
_E("ScoreFunction + ImportanceSampling",
   "ScoreFunction({name}, sampling_method=ImportanceSampling({name}, 3, lambda p: type(p)(logits=p.logits / 2)), "
   "baseline_factory='batch_average')", DISCRETE, EVERY_ORDER)
_E("Infer", "Infer({name})", ANY, EVERY_ORDER)
_E("Expect", "Expect({name})", DISCRETE, EVERY_ORDER)
_E("LocalExpectation", "LocalExpectation({name})", DISCRETE, 2, joinable=True)
_E("LocalExpectation(n_samples=2)", "LocalExpectation({name}, n_samples=2)", DISCRETE, 2)
_E("ARM", "ARM({name})", (Bernoulli,), 1)
_E("DisARM", "DisARM({name}, n_samples=2)", (Bernoulli,), 1)
_E("ARMS", "ARMS({name}, n_samples=3)", (Bernoulli,), 1)
_E("ARMSMultiSample", "ARMSMultiSample({name}, n_samples=2)", (Bernoulli,), 1)
_E("ARSM", "ARSM({name})", (Categorical, OneHotCategorical), 1)
_E("CARMS", "CARMS({name}, n_samples=3)", (Categorical, OneHotCategorical), 1)
_E("CoupledCategorical", "CoupledCategorical({name})", (Categorical, OneHotCategorical), 1)
_E("CoupledCategoricalIW", "CoupledCategoricalIW({name})", (Categorical, OneHotCategorical), 1)
_E("MVD", "MVD({name})", DISCRETE + (Normal,), 1)
_E("REBAR", "REBAR({name})", (Bernoulli, OneHotCategorical), EVERY_ORDER, warmup=3, relaxes=True)
_E("RELAX", "RELAX({name}, in_dim={shape})", (Bernoulli, OneHotCategorical), EVERY_ORDER, warmup=3, relaxes=True)
_E("RELAX + REBAR term", "RELAX({name}, in_dim={shape}, rebar=True)", (Bernoulli, OneHotCategorical), EVERY_ORDER,
   warmup=3, relaxes=True)
_E("LAX", "LAX({name}, in_dim={shape})", (Normal,), EVERY_ORDER, warmup=3)
_E("DoubleControlVariate", "DoubleControlVariate({name}, n_samples=3)", (Bernoulli, OneHotCategorical, Normal),
   EVERY_ORDER, warmup=3, requires="a cost differentiable in the sample")
_E("VIMCO", "VIMCO({name}, n_samples=3)", ANY, EVERY_ORDER)
_E("ScoreFunctionWOR", "ScoreFunctionWOR({name}, k=2)", DISCRETE, EVERY_ORDER)
_E("UnorderedSetEstimator", "UnorderedSetEstimator({name}, k=2)", DISCRETE, EVERY_ORDER)
_E("RaoBlackwellSF", "RaoBlackwellSF({name}, k=2)", (Categorical, OneHotCategorical), EVERY_ORDER,
   requires="one categorical variable per plate element")
_E("MAPO", "MAPO({name}, n_samples=2, buffer_size=2)", DISCRETE, EVERY_ORDER, warmup=3)
_E("GSB", "GSB({name}, order=2)", (Normal,) + DISCRETE, 1, downstream_orders=2)
# biased by design: registered so that the catalog is complete, never drawn for an unbiasedness check
_E("GumbelSoftmax", "GumbelSoftmax({name})", (Bernoulli, OneHotCategorical), 0, relaxes=True)
_E("StraightThrough", "StraightThrough({name})", (Bernoulli, OneHotCategorical), 0)
_E("GumbelRao", "GumbelRao({name})", (Bernoulli, OneHotCategorical), 0)
_E("ReinMax", "ReinMax({name})", (Bernoulli, OneHotCategorical), 0)
_E("GappedStraightThrough", "GappedStraightThrough({name})", (Bernoulli, OneHotCategorical), 0)
_E("GumbelSparseMax", "GumbelSparseMax({name})", (OneHotCategorical,), 0, relaxes=True)
_E("GumbelEntmax", "GumbelEntmax({name})", (OneHotCategorical,), 0, relaxes=True)
_E("SPSA", "SPSA({name})", ANY, 0)
_E("ScoreFunctionWOR(biased=True)", "ScoreFunctionWOR({name}, k=2, biased=True)", DISCRETE, 0)
_E("UnorderedSetGumbelSoftmax", "UnorderedSetGumbelSoftmax({name}, k=2)", (OneHotCategorical,), 0, relaxes=True)
del _E
