"""Measure-valued decompositions of distribution derivatives, by distribution type.

Math (Mohamed, Rosca, Figurnov & Mnih 2020, JMLR, §6; Pflug 1989). The derivative of a density
with respect to one parameter coordinate ``θ_d`` is a signed measure, written as a constant times
the difference of two probability laws, ``∂_{θ_d} p = c_θ (p⁺ − p⁻)``, so that

    ∂_{θ_d} E_p[f(x)] = c_θ (E_{x_d ~ p⁺} f(x) − E_{x_d ~ p⁻} f(x))

with the other coordinates ``x_{≠d} ~ p`` (factorised distributions). The decompositions registered
here (each checked numerically in ``tests/test_mvd.py``):

=============================  ==========  ====================================================  ======
distribution                   parameter   ĝ for coordinate d (other coordinates held at x ~ p)   points
=============================  ==========  ====================================================  ======
``Normal(μ, σ)``               ``loc``     ``(f(μ + σW) − f(μ − σW)) / (σ√(2π))``, W Rayleigh       2
``Normal(μ, σ)``               ``scale``   ``(f(μ + σM) − f(x)) / σ``, M double-sided Maxwell        1
``Bernoulli``                  ``probs``   ``f(x_d = 1) − f(x_d = 0)``                               1
``Categorical`` / one-hot      ``probs``   ``f(x_d = k)`` for every category k                       K − 1
``Poisson(λ)``                 ``rate``    ``f(x_d + 1) − f(x)``                                     1
``Exponential(λ)``             ``rate``    ``(f(x) − f(x_d + E′)) / λ``, E′ ~ Exp(λ)                  1
=============================  ==========  ====================================================  ======

*Common random numbers.* Where one part of the decomposition is ``p`` itself (the negative part of the
Normal scale, Poisson and Exponential derivatives; one of the values of a Bernoulli or categorical
coordinate) the real sample ``x`` is reused for it, so it costs no evaluation and the difference is
taken between coupled points: Gamma(2, λ) is drawn as ``x_d + E′``, and the Maxwell variable shares
the sign and the χ²₁ component of ``x``'s own normal noise ``ε = (x_d − μ)/σ``
(``M = sign(ε) √(ε² + χ²₂)``, so ``|M| ≥ |ε|`` on the same side). The two Rayleigh points of the mean
share ``W``: this cancels the part of ``f`` that is even around ``μ`` (for a quadratic
cost only ``4W(μ − t)/√(2π)`` remains), and for the odd part it at most doubles the variance against
independent ``W``s (exactly twice for a linear cost); both are measured in ``tests/test_mvd.py``.

Supporting a new distribution means registering one `MeasureValuedDecomposition` here, in the
manner of ``torch.distributions.kl.register_kl``; `storch.method.mvd.MVD` never branches on
distribution types.

Shapes. A distribution's batch shape is ``(*plates, *C)``: the plates of its parameters (independent
problems, e.g. a minibatch) and the *coordinates* ``C``. Every coordinate ``d`` gets its own points,
with the other coordinates held at the real sample. ``points`` returns, per sample, the values that
coordinate ``d`` takes in the extra points, ``(n, J, *plates, *C, *event)``; ``gradient`` maps the
costs at the real sample and at the points (plain tensors whose leading dimensions broadcast, one
per plate of the cost) to ``ĝ`` with the shape of the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, Exponential, Normal, OneHotCategorical, Poisson

from storch.distributions.one_hot import one_hot
from storch.registries import MEASURE_VALUED, register_measure_valued
from storch.registry import TypeRegistry

__all__ = [
    "MeasureValuedParameter", "MeasureValuedDecomposition", "register_measure_valued", "measure_valued_for",
    "bernoulli_probs", "categorical_probs",
]

Params = Mapping[str, torch.Tensor]
PointsFn = Callable[[Params, torch.Tensor], torch.Tensor]
GradientFn = Callable[[Params, torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class MeasureValuedParameter:
    """The measure-valued derivative with respect to one parameter.

    Attributes:
        points: ``(params, x) -> V``. ``x`` is ``(n, *plates, *C, *event)``, the real samples;
            ``V`` is ``(n, J, *plates, *C, *event)``: ``V[:, j, ..., d, ...]`` is the value that
            coordinate ``d`` takes in the ``j``-th extra point for ``d`` (the other coordinates stay
            at ``x``). ``params`` are plain and detached.
        gradient: ``(params, x, f_x, f_points) -> ĝ``: ``f_x`` is the cost at ``x``
            (``(*lead, 1, …, 1)`` with one trailing 1 per coordinate dimension), ``f_points[j]`` the
            cost at the ``j``-th points (``(*lead, *C)``, coordinate ``d`` changed in entry ``d``);
            ``x`` and ``params`` carry ``lead`` leading dimensions that broadcast against them.
            Returns ``ĝ`` with the parameter's trailing shape, the unbiased estimate of
            ``∂ E f / ∂θ`` (first order).
    """

    points: PointsFn
    gradient: GradientFn


@dataclass(frozen=True)
class MeasureValuedDecomposition:
    """The measure-valued derivatives of one distribution family.

    Attributes:
        parameters: ``distribution -> {name: θ}``, the parameters whose gradients are estimated, as
            differentiable functions of what the user gave (e.g. ``σ(logits)`` for a Bernoulli built
            from logits: the gradient then reaches the logits by the chain rule). Each ``θ`` has
            shape ``(*batch_shape, *extra)``.
        parts: the `MeasureValuedParameter` of each name of ``parameters``.
    """

    parameters: Callable[[Distribution], dict[str, torch.Tensor]]
    parts: Mapping[str, MeasureValuedParameter]


_DECOMPOSITIONS: TypeRegistry[MeasureValuedDecomposition] = MEASURE_VALUED  # made in storch.registries, filled here


def measure_valued_for(distr: Distribution) -> MeasureValuedDecomposition | None:
    """The decomposition registered for ``type(distr)`` or its most specific base class, else ``None``.

    Examples:
        >>> import torch
        >>> from torch.distributions import Normal, Gamma
        >>> sorted(measure_valued_for(Normal(0.0, 1.0)).parts)
        ['loc', 'scale']
        >>> measure_valued_for(Gamma(1.0, 1.0)) is None
        True
    """
    return _DECOMPOSITIONS.lookup(distr)


def registered_types() -> list[type]:
    """The distribution types with a registered decomposition."""
    return list(_DECOMPOSITIONS)


# ----------------------------------------------------------------- parameters the user gave
def _given(d: Distribution, name: str) -> torch.Tensor | None:
    """The ``probs`` / ``logits`` tensor ``d`` was built with, or ``None``.

    torch caches the other one lazily on first use, possibly while storch dispatch was disabled
    (without plates), so only the given one (``d._param``) is trusted.
    """
    value = d.__dict__.get(name)
    return value if value is not None and value is d.__dict__.get("_param") else None


def bernoulli_probs(d: Bernoulli) -> torch.Tensor:
    """``σ(logits)`` or ``probs``, from whichever ``d`` was built with (differentiable)."""
    logits = _given(d, "logits")
    return torch.sigmoid(logits) if logits is not None else d.probs


def categorical_probs(d: Categorical) -> torch.Tensor:
    """``softmax(logits)`` or the normalised ``probs``, from whichever ``d`` was built with."""
    logits = _given(d, "logits")
    return torch.softmax(logits, -1) if logits is not None else d.probs


def _uniform(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    tiny = torch.finfo(like.dtype).tiny
    return torch.rand(tuple(shape), dtype=like.dtype, device=like.device).clamp_min(tiny)


# -------------------------------------------------------------------------------- Normal
def _normal_loc_points(params: Params, x: torch.Tensor) -> torch.Tensor:
    mu, sigma = params["loc"], params["scale"]
    w = torch.sqrt(-2.0 * torch.log(_uniform(x, x.shape)))  # Rayleigh = Weibull(√2, 2); shared by ±
    return torch.stack([mu + sigma * w, mu - sigma * w], 1)


def _normal_loc_gradient(params: Params, x, f_x, f_points) -> torch.Tensor:
    return (f_points[0] - f_points[1]) / (params["scale"] * math.sqrt(2.0 * math.pi))


def _normal_scale_points(params: Params, x: torch.Tensor) -> torch.Tensor:
    mu, sigma = params["loc"], params["scale"]
    eps = (x - mu) / sigma  # the real sample's own noise: the negative part of the decomposition
    chi2_2 = -2.0 * torch.log(_uniform(x, x.shape))
    maxwell = torch.where(eps < 0, -1.0, 1.0).to(x.dtype) * torch.sqrt(eps * eps + chi2_2)  # ±√χ²₃
    return (mu + sigma * maxwell).unsqueeze(1)


def _normal_scale_gradient(params: Params, x, f_x, f_points) -> torch.Tensor:
    return (f_points[0] - f_x) / params["scale"]


_DECOMPOSITIONS.register_default(Normal)(
    MeasureValuedDecomposition(
        parameters=lambda d: {"loc": d.loc, "scale": d.scale},
        parts={
            "loc": MeasureValuedParameter(_normal_loc_points, _normal_loc_gradient),
            "scale": MeasureValuedParameter(_normal_scale_points, _normal_scale_gradient),
        },
    )
)


# ----------------------------------------------------------------------------- Bernoulli
def _bernoulli_points(params: Params, x: torch.Tensor) -> torch.Tensor:
    return (1.0 - x).unsqueeze(1)  # the other value; x itself is the point with x_d unchanged


def _bernoulli_gradient(params: Params, x, f_x, f_points) -> torch.Tensor:
    # f(x_d = 1) − f(x_d = 0) = (2 x_d − 1)(f(x) − f(x with x_d flipped))
    return (2.0 * x - 1.0) * (f_x - f_points[0])


_DECOMPOSITIONS.register_default(Bernoulli)(
    MeasureValuedDecomposition(
        parameters=lambda d: {"probs": bernoulli_probs(d)},
        parts={"probs": MeasureValuedParameter(_bernoulli_points, _bernoulli_gradient)},
    )
)


# --------------------------------------------------------------------------- categorical
def _other_categories(index: torch.Tensor, k: int) -> torch.Tensor:
    """``(n, k − 1, …)``: the categories other than ``index`` in increasing order."""
    j = torch.arange(k - 1, device=index.device).view((1, k - 1) + (1,) * (index.dim() - 1))
    return j + (j >= index.unsqueeze(1)).long()


def _value_per_category(index: torch.Tensor, f_x: torch.Tensor, f_points: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """``ĝ[..., c] = f(x_d = c)``: ``f_x`` where ``c`` is the sampled category, else its point."""
    cats = torch.arange(k, device=index.device)
    index = index.unsqueeze(-1)
    if k == 1:
        return f_x.unsqueeze(-1).expand(torch.broadcast_shapes(f_x.unsqueeze(-1).shape, index.shape))
    others = torch.stack(list(f_points), -1)  # (..., k − 1): the points in increasing category order
    slot = (cats - (cats > index).long()).clamp(max=k - 2)
    shape = torch.broadcast_shapes(others.shape[:-1], slot.shape[:-1], f_x.shape)
    picked = torch.gather(others.expand(shape + (k - 1,)), -1, slot.expand(shape + (k,)))
    return torch.where(cats == index, f_x.unsqueeze(-1), picked)


def _categorical_points(params: Params, x: torch.Tensor) -> torch.Tensor:
    return _other_categories(x, params["probs"].shape[-1])


def _categorical_gradient(params: Params, x, f_x, f_points) -> torch.Tensor:
    return _value_per_category(x, f_x, f_points, params["probs"].shape[-1])


def _one_hot_points(params: Params, x: torch.Tensor) -> torch.Tensor:
    k = params["probs"].shape[-1]
    return one_hot(_other_categories(x.argmax(-1), k), k, x.dtype)


def _one_hot_gradient(params: Params, x, f_x, f_points) -> torch.Tensor:
    return _value_per_category(x.argmax(-1), f_x, f_points, params["probs"].shape[-1])


# ∂ E f / ∂p_k = f(k) for unnormalised p; the chain rule through softmax (or the normalisation of
# probs) subtracts the constant Σ_k p_k f(k).
_DECOMPOSITIONS.register_default(Categorical)(
    MeasureValuedDecomposition(
        parameters=lambda d: {"probs": categorical_probs(d)},
        parts={"probs": MeasureValuedParameter(_categorical_points, _categorical_gradient)},
    )
)
_DECOMPOSITIONS.register_default(OneHotCategorical)(
    MeasureValuedDecomposition(
        parameters=lambda d: {"probs": categorical_probs(d._categorical)},
        parts={"probs": MeasureValuedParameter(_one_hot_points, _one_hot_gradient)},
    )
)


# ------------------------------------------------------------------- Poisson, Exponential
_DECOMPOSITIONS.register_default(Poisson)(
    MeasureValuedDecomposition(
        parameters=lambda d: {"rate": d.rate},
        parts={
            "rate": MeasureValuedParameter(
                points=lambda params, x: (x + 1.0).unsqueeze(1),
                gradient=lambda params, x, f_x, f_points: f_points[0] - f_x,
            )
        },
    )
)


def _exponential_points(params: Params, x: torch.Tensor) -> torch.Tensor:
    extra = -torch.log(_uniform(x, x.shape)) / params["rate"]  # x_d + Exp(λ) ~ Gamma(2, λ)
    return (x + extra).unsqueeze(1)


_DECOMPOSITIONS.register_default(Exponential)(
    MeasureValuedDecomposition(
        parameters=lambda d: {"rate": d.rate},
        parts={
            "rate": MeasureValuedParameter(
                points=_exponential_points,
                gradient=lambda params, x, f_x, f_points: (f_x - f_points[0]) / params["rate"],
            )
        },
    )
)
