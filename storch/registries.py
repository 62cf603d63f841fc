"""The registries of distribution-specific math, and the public ``register_*`` function of each.

Every registry is a `storch.registry.TypeRegistry` made here, in a low layer that
imports only `storch.registry` and torch, so that
`storch.extend` can offer every ``register_*`` function without importing an
estimator. The modules that read a registry (estimators, samplers, relaxations) import it from here
and fill it with their built-in entries when they are imported, through
`storch.registry.TypeRegistry.register_default`: an entry a user
registered for the same type before that module was imported is kept. ``import storch`` imports all
of those modules, so every registry holds its built-in entries once ``storch`` is imported.

* ``RELAXATIONS`` (`storch.registries.register_relaxation`), filled by
  ``storch.distributions.relaxation``;
* ``MEASURE_VALUED`` (`storch.registries.register_measure_valued`), by
  ``storch.distributions.measure_valued``;
* ``CUMULANTS`` (`storch.registries.register_cumulants`), by
  ``storch.method.cumulants``;
* ``GSB_REPRESENTATIONS`` (`storch.registries.register_representation`) and
  ``GSB_RULES`` (`storch.registries.register_gsb_rule`), by ``storch.method.gsb``;
* ``COORDINATES`` (`storch.registries.register_coordinates`), by
  ``storch.method.local_expectation_points``;
* ``ONE_HOT_VIEWS`` (`storch.registries.register_one_hot_view`), by
  ``storch.method.straight_through``;
* ``SPSA_WRAPPERS`` (`storch.registries.register_spsa_wrapper`), by
  ``storch.method.spsa``;
* ``CRITIC_INPUTS`` (`storch.registries.register_critic_inputs`), by
  ``storch.method.critic``;
* ``WOR_SUPPORTS`` (`storch.registries.register_wor_support`), by
  ``storch.sampling.swor``;
* ``RELAXED_WOR_VALUES`` (`storch.registries.register_relaxed_wor_value`),
  by ``storch.sampling.unordered_set``.

The types of the registered values are defined by the modules that read them; they are imported
here for annotations only (``TYPE_CHECKING``), never when the program runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributions import Distribution

from storch.registry import TypeRegistry

if TYPE_CHECKING:  # pragma: no cover  (annotations only: these modules import this one)
    from storch.distributions.measure_valued import MeasureValuedDecomposition
    from storch.distributions.relaxation import Relaxation
    from storch.method.critic import InputFunction
    from storch.method.cumulants import CumulantFn
    from storch.method.gsb import GSBRule, Representation
    from storch.method.local_expectation_points import Coordinates
    from storch.method.straight_through import OneHotView
    from storch.sampling.swor import WORSupport

__all__ = [
    "COORDINATES", "CRITIC_INPUTS", "CUMULANTS", "GSB_REPRESENTATIONS", "GSB_RULES", "MEASURE_VALUED",
    "ONE_HOT_VIEWS", "RELAXATIONS", "RELAXED_WOR_VALUES", "SPSA_WRAPPERS", "WOR_SUPPORTS", "RelaxedValueFn",
    "SPSAWrapper", "SupportFn", "register_coordinates", "register_critic_inputs", "register_cumulants",
    "register_gsb_rule", "register_measure_valued", "register_one_hot_view", "register_relaxation",
    "register_relaxed_wor_value", "register_representation", "register_spsa_wrapper", "register_wor_support",
]

#: ``distribution -> WORSupport``: how sampling without replacement enumerates a support
SupportFn = Callable[[Distribution], "WORSupport"]
#: ``relaxed one-hot vector over the support -> relaxed sample``
RelaxedValueFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SPSAWrapper:
    """A distribution that keeps its parameters in another one, as SPSA sees it.

    Attributes:
        inner: ``wrapper -> the distribution holding the parameters``.
        rebuild: ``(wrapper, perturbed inner) -> perturbed wrapper``.
    """

    inner: Callable[[Distribution], Distribution]
    rebuild: Callable[[Distribution, Distribution], Distribution]


# --------------------------------------------------------------------------- the registries
RELAXATIONS: TypeRegistry[Relaxation] = TypeRegistry(
    "relaxation", register_with="storch.distributions.relaxation.register_relaxation"
)
MEASURE_VALUED: TypeRegistry[MeasureValuedDecomposition] = TypeRegistry(
    "measure-valued decomposition", register_with="storch.distributions.measure_valued.register_measure_valued",
    reinterpreted_refused=(
        "MVD differentiates each parameter coordinate of the batch dimensions of the node's "
        "distribution, which an Independent moves into its event."
    ),
)
CUMULANTS: TypeRegistry[CumulantFn] = TypeRegistry(
    "cumulants", register_with="storch.method.cumulants.register_cumulants"
)
GSB_REPRESENTATIONS: TypeRegistry[Representation] = TypeRegistry(
    "GSB representation", register_with="storch.method.gsb.register_representation"
)
GSB_RULES: TypeRegistry[GSBRule] = TypeRegistry(
    "GSB rule", register_with="storch.method.gsb.register_gsb_rule",
    reinterpreted_refused=(
        "GSB's discrete rules (local expectations, finite differences) change one coordinate at a time, "
        "and take the coordinates from the batch dimensions of the node's distribution, which an "
        "Independent moves into its event."
    ),
)
COORDINATES: TypeRegistry[Coordinates] = TypeRegistry(
    "local-expectation coordinates", register_with="storch.method.local_expectation_points.register_coordinates",
    reinterpreted_refused=(
        "local expectations change one coordinate at a time, and take the coordinates from the batch "
        "dimensions of the node's distribution, which an Independent moves into its event."
    ),
)
ONE_HOT_VIEWS: TypeRegistry[OneHotView] = TypeRegistry(
    "one-hot view", register_with="storch.method.straight_through.register_one_hot_view"
)
SPSA_WRAPPERS: TypeRegistry[SPSAWrapper] = TypeRegistry(
    "SPSA wrapper", register_with="storch.method.spsa.register_spsa_wrapper"
)
CRITIC_INPUTS: TypeRegistry[InputFunction] = TypeRegistry(
    "critic inputs", register_with="storch.method.critic.register_critic_inputs"
)
WOR_SUPPORTS: TypeRegistry[SupportFn] = TypeRegistry(
    "WOR support", register_with="storch.sampling.swor.register_wor_support"
)
RELAXED_WOR_VALUES: TypeRegistry[RelaxedValueFn] = TypeRegistry(
    "relaxed WOR value", register_with="storch.sampling.unordered_set.register_relaxed_wor_value"
)


# --------------------------------------------------------------------------- register functions
def register_relaxation(dist_type: type, relaxation: Relaxation, *, replace: bool = False) -> None:
    """Register the Gumbel-softmax relaxation of ``dist_type`` (and its subclasses).

    Args:
        dist_type: the distribution type.
        relaxation: its `Relaxation` (``storch.distributions.relaxation``).
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    RELAXATIONS.register(dist_type, replace=replace)(relaxation)


def register_measure_valued(
    dist_type: type, decomposition: MeasureValuedDecomposition, *, replace: bool = False
) -> None:
    """Register the measure-valued derivatives of ``dist_type`` (and its subclasses).

    Args:
        dist_type: the distribution type.
        decomposition: its `MeasureValuedDecomposition` (``storch.distributions.measure_valued``).
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    MEASURE_VALUED.register(dist_type, replace=replace)(decomposition)


def register_cumulants(dist_type: type, *, replace: bool = False) -> Callable[[CumulantFn], CumulantFn]:
    """Decorator registering the cumulants of ``dist_type`` (and of its subclasses).

    The function takes ``(distribution, order)`` and returns ``order`` cumulants, each broadcastable
    to the shape of one sample (``batch_shape + event_shape``), or ``None`` where a cumulant is
    identically zero (so that its derivative need not be computed).

    Args:
        dist_type: the distribution type.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.

    Examples:
        >>> import torch
        >>> from torch.distributions import Uniform
        >>> from storch.method.cumulants import cumulants
        >>> @register_cumulants(Uniform)   # κ₁ = (a+b)/2, κ₂ = (b−a)²/12, odd ones above 1 vanish
        ... def _uniform(d, order):
        ...     width = d.high - d.low
        ...     known = {1: (d.low + d.high) / 2, 2: width**2 / 12, 4: -width**4 / 120}
        ...     return [known.get(n) for n in range(1, order + 1)]
        >>> [k.item() for k in cumulants(Uniform(0.0, 1.0), 2)]
        [0.5, 0.0833333358168602]
        >>> _ = CUMULANTS.unregister(Uniform)
    """
    return CUMULANTS.register(dist_type, replace=replace)


def register_representation(dist_type: type, representation: Representation, *, replace: bool = False) -> None:
    """Let GSB sample ``dist_type`` through another distribution (e.g. Beta through two gammas).

    Args:
        dist_type: the distribution type (and its subclasses).
        representation: its `storch.method.gsb.Representation`.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    GSB_REPRESENTATIONS.register(dist_type, replace=replace)(representation)


def register_gsb_rule(dist_type: type, rule: GSBRule, *, replace: bool = False) -> None:
    """Use ``rule`` for ``dist_type`` and its subclasses (overrides the cumulant rule).

    Args:
        dist_type: the distribution type.
        rule: the `storch.method.gsb.GSBRule`.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    GSB_RULES.register(dist_type, replace=replace)(rule)


def register_coordinates(dist_type: type, coordinates: Coordinates, *, replace: bool = False) -> None:
    """Register how the coordinates of ``dist_type`` (and its subclasses) take their values.

    Args:
        dist_type: the distribution type.
        coordinates: its `storch.method.local_expectation_points.Coordinates`.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    COORDINATES.register(dist_type, replace=replace)(coordinates)


def register_one_hot_view(dist_type: type, view: OneHotView, *, replace: bool = False) -> None:
    """Register the one-hot view of ``dist_type`` (and of its subclasses).

    Args:
        dist_type: the distribution type.
        view: its `storch.method.straight_through.OneHotView`.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    ONE_HOT_VIEWS.register(dist_type, replace=replace)(view)


def register_spsa_wrapper(
    dist_type: type,
    inner: Callable[[Distribution], Distribution],
    rebuild: Callable[[Distribution, Distribution], Distribution],
    *,
    replace: bool = False,
) -> None:
    """Let SPSA perturb a distribution that keeps its parameters in another distribution.

    Args:
        dist_type: the wrapper type (and its subclasses).
        inner: ``wrapper -> the distribution holding the parameters``.
        rebuild: ``(wrapper, perturbed inner) -> perturbed wrapper``.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    SPSA_WRAPPERS.register(dist_type, replace=replace)(SPSAWrapper(inner, rebuild))


def register_critic_inputs(dist_type: type, inputs: InputFunction, *, replace: bool = False) -> None:
    """Register which tensors of a ``dist_type`` distribution a critic reads (default: its parameters).

    ``inputs(distribution)`` returns tensors that carry (a subset of) the distribution's plates, with
    any trailing shape; they are flattened per plate element and concatenated. They must be
    functions of the distribution only, so of the node's non-descendants.

    Args:
        dist_type: the distribution type.
        inputs: ``distribution -> tensors``.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    CRITIC_INPUTS.register(dist_type, replace=replace)(inputs)


def register_wor_support(dist_type: type, *, replace: bool = False) -> Callable[[SupportFn], SupportFn]:
    """Register how to enumerate the support of ``dist_type`` (a decorator, like ``register_kl``).

    The decorated function takes the distribution and returns a `storch.sampling.swor.WORSupport`.

    Args:
        dist_type: the distribution type.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    return WOR_SUPPORTS.register(dist_type, replace=replace)


def register_relaxed_wor_value(
    dist_type: type, *, replace: bool = False
) -> Callable[[RelaxedValueFn], RelaxedValueFn]:
    """Decorator registering how a relaxed one-hot vector over the support of ``dist_type`` (as
    enumerated by `storch.sampling.swor.wor_support`) becomes a relaxed sample of
    that
    distribution.

    Args:
        dist_type: the distribution type.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises
            `storch.registry.DuplicateRegistrationError`.
    """
    return RELAXED_WOR_VALUES.register(dist_type, replace=replace)
