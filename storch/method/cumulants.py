"""Cumulants of distributions, by distribution type (the coefficients of generalized stochastic backprop).

The cumulants ``κ_n`` are the Taylor coefficients of the log characteristic function (the cumulant
generating function), ``log φ(ω) = log E[e^{iωz}] = Σ_{n≥1} κ_n (iω)^n / n!``. For a factorised
distribution with parameters θ, theorem 1 of Echraibi, Flocon Cholet, Gosselin & Vaton, "Generalized
stochastic backpropagation" (NeurIPS 2020 workshop; ``seeds/004_…``) reads, per coordinate,

    ∇θ E f(z) = Σ_{n≥1} (∇θ κ_n(θ) / n!) · E[∂ⁿf/∂zⁿ (z)]

`storch.method.gsb` truncates it at an order ``N``. Registered here (each ``κ_n`` has the shape of
one sample and is differentiable in the parameters; ``None`` marks a cumulant that is identically 0):

=================================  ================================================  ===================
distribution                       cumulants                                         series terminates
=================================  ================================================  ===================
``Normal(μ, σ)``                   ``κ₁ = μ``, ``κ₂ = σ²``, higher 0 (eq. 14)         at 2
``Gamma(k, rate β)`` (``Chi2``)    ``κ_n = k (n−1)! / βⁿ`` (eq. 19)                   no
``Exponential(rate λ)``            ``κ_n = (n−1)! / λⁿ`` (Gamma with ``k = 1``)       no
``Laplace(μ, b)``                  ``κ₁ = μ``, ``κ_{2m} = 2 (2m−1)! b^{2m}``, odd 0    no
                                   (eq. 18)
``Dirac(a)``                       ``κ₁ = a``, higher 0 (plain backpropagation)       at 1
``Independent(base, r)``           those of ``base``                                  as ``base``
=================================  ================================================  ===================

Register a new family with `storch.method.cumulants.register_cumulants`, in the manner of
``torch.distributions.kl.register_kl``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.distributions import Distribution, Exponential, Gamma, Independent, Laplace, Normal

from storch.distributions.dirac import Dirac
from storch.extend import TypeRegistry
from storch.registries import CUMULANTS, register_cumulants
from storch.sampling.method import check_count

__all__ = ["register_cumulants", "cumulants", "cumulant_terms", "cumulants_registered", "supported_distributions"]

#: ``(distribution, order) -> [κ_1, …, κ_order]``, ``None`` for cumulants that are identically 0
CumulantFn = Callable[[Distribution, int], list[Optional[torch.Tensor]]]

_CUMULANTS: TypeRegistry[CumulantFn] = CUMULANTS  # made in storch.registries, filled here


def _lookup(distr: Distribution) -> Optional[CumulantFn]:
    return _CUMULANTS.lookup(distr)


def cumulants_registered(distr: Distribution) -> bool:
    """Whether cumulants are registered for ``type(distr)`` or a base class."""
    return _lookup(distr) is not None


def supported_distributions() -> list[str]:
    """Names of the distribution types with registered cumulants."""
    return sorted(t.__name__ for t in _CUMULANTS)


def cumulant_terms(distr: Distribution, order: int) -> list[Optional[torch.Tensor]]:
    """``[κ_1, …, κ_order]`` with ``None`` for identically-zero cumulants (see
    `storch.method.cumulants.cumulants`)."""
    order = check_count(order, "the order", "cumulants")
    fn = _lookup(distr)
    if fn is None:
        raise ValueError(
            f"No cumulants are registered for {type(distr).__name__}; supported: "
            f"{', '.join(supported_distributions())}. Register them with "
            "storch.method.cumulants.register_cumulants."
        )
    terms = list(fn(distr, order))
    if len(terms) != order:
        raise RuntimeError(f"The cumulants of {type(distr).__name__} returned {len(terms)} terms for order {order}.")
    return terms


def cumulants(distr: Distribution, order: int) -> list[torch.Tensor]:
    """The first ``order`` cumulants ``κ_1..κ_order`` of ``distr``, each shaped like one sample.

    Differentiable in the distribution's parameters.

    Examples:
        >>> import torch
        >>> from torch.distributions import Gamma
        >>> [k.item() for k in cumulants(Gamma(torch.tensor(3.0), torch.tensor(2.0)), 3)]   # k (n−1)!/βⁿ
        [1.5, 0.75, 0.75]
    """
    shape = tuple(distr.batch_shape) + tuple(distr.event_shape)
    terms = cumulant_terms(distr, order)
    like = next((t for t in terms if t is not None), None)
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    device = like.device if like is not None else None
    out = []
    for t in terms:
        if t is None:
            t = torch.zeros(shape, dtype=dtype, device=device)
        out.append(t.expand(torch.broadcast_shapes(t.shape, shape)))
    return out


# --------------------------------------------------------------------------- registered families
@_CUMULANTS.register_default(Normal)
def _normal(d: Normal, order: int) -> list[Optional[torch.Tensor]]:
    known = {1: d.loc, 2: d.scale**2}
    return [known.get(n) for n in range(1, order + 1)]


@_CUMULANTS.register_default(Gamma)
def _gamma(d: Gamma, order: int) -> list[Optional[torch.Tensor]]:
    scale = 1.0 / d.rate
    return [d.concentration * math.factorial(n - 1) * scale**n for n in range(1, order + 1)]


@_CUMULANTS.register_default(Exponential)
def _exponential(d: Exponential, order: int) -> list[Optional[torch.Tensor]]:
    scale = 1.0 / d.rate
    return [math.factorial(n - 1) * scale**n for n in range(1, order + 1)]


@_CUMULANTS.register_default(Laplace)
def _laplace(d: Laplace, order: int) -> list[Optional[torch.Tensor]]:
    def kappa(n: int) -> Optional[torch.Tensor]:
        if n == 1:
            return d.loc
        if n % 2:
            return None
        return 2.0 * math.factorial(n - 1) * d.scale**n

    return [kappa(n) for n in range(1, order + 1)]


@_CUMULANTS.register_default(Dirac)
def _dirac(d: Dirac, order: int) -> list[Optional[torch.Tensor]]:
    return [d.value] + [None] * (order - 1)


@_CUMULANTS.register_default(Independent)
def _independent(d: Independent, order: int) -> list[Optional[torch.Tensor]]:
    return cumulant_terms(d.base_dist, order)
