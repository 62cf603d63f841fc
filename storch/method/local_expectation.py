"""Local expectation gradients (IndeCateR) for factorised discrete variables.

For ``x = (x_1, …, x_D)`` with independent coordinates ``x_d ~ p_d`` taking ``K`` values,

    ∇θ E[f(x)] = E_x[∇θ f(x)] + Σ_d E_{x≠d}[ Σ_k ∇θ p_d(k) · f(x≠d, x_d = k) ]

(Titsias & Lázaro-Gredilla 2015, "Local expectation gradients for black box variational inference";
``seeds/004_…`` eqs. 16–17, where ``Σ_k ∇p_d(k) = 0`` turns ``Σ_k ∇p_d(k) f(k)`` into differences with
a reference value; De Smet et al. 2023, "Differentiable sampling of categorical distributions using
the CatLog-derivative trick" (IndeCateR)). Each coordinate's sum over its values is exact, given one
sample of the others.

Layout (:mod:`storch.method.groups`): each of the ``n`` samples is a group of ``M = 1 + D·K`` points,
the sample ``x`` itself (weight ``1/n``) and ``x`` with coordinate ``d`` set to value ``k`` at position
``1 + d·K + k`` (weight 0). ``D`` counts the independent variables in the distribution's non-plate
batch dimensions. The cost is evaluated at all ``n·M`` points in one vectorised pass.

Surrogate term of a group (forward value 0, so the node's estimate of ``E f`` is the mean of ``f`` at
the samples):

    Σ_d Σ_k (p_d(k) − stopgrad p_d(k)) · □(½ Σ_{d'≠d} log p_{d'}(x_{d'})) · S(x≠d, x_d = k)

with ``S`` the downstream cost (not detached). Its first derivative is the estimator above. Its second
derivative is also unbiased: ``∇p_d ∇S`` gives the mixed terms, and the magic box, whose expectation
over the other coordinates is a score-function estimate of how they move ``f(x≠d, k)``, gives the
cross terms ``∇p_d(k) ∇p_{d'}(k')ᵀ f(…, k, …, k')`` between coordinates, each half from ``d`` and half
from ``d'``. Third and higher derivatives are biased (three-coordinate terms are missing).

The values a coordinate can take and their probabilities are registered per distribution type
(:func:`register_coordinates`); setting a coordinate to a value is then the same for every type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, OneHotCategorical

from storch.method.groups import flatten_groups, group_plate, group_weights, split_groups, spread_groups
from storch.method.method import Method
from storch.extend import (
    CostTensor,
    StochasticTensor,
    Tensor,
    TypeRegistry,
    layout_of,
    layout_of_plates,
    log_prob_of_own_samples,
    magic_box,
    no_dispatch,
    wrap_new,
)

__all__ = [
    "LocalExpectation", "IndeCateR", "Coordinates", "register_coordinates", "coordinates_for",
    "local_expectation_points", "local_expectation_group_size", "local_expectation_weights",
    "local_expectation_term",
]


# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Coordinates:
    """What a factorised discrete distribution's coordinates look like, per distribution type.

    Attributes:
        values: ``distribution -> (K, *event_shape)``, the ``K`` values one coordinate can take
            (e.g. ``[0, 1]`` for a Bernoulli, the rows of the identity for a one-hot categorical).
        probs: ``distribution -> (*batch_shape, K)``, ``P(x_d = values[k])`` per coordinate,
            differentiable in the distribution's parameters.
    """

    values: Callable[[Distribution], torch.Tensor]
    probs: Callable[[Distribution], torch.Tensor]


_COORDINATES: TypeRegistry[Coordinates] = TypeRegistry(
    "local-expectation coordinates", register_with="storch.method.local_expectation.register_coordinates"
)


def register_coordinates(dist_type: type, coordinates: Coordinates, *, replace: bool = False) -> None:
    """Register how the coordinates of ``dist_type`` (and its subclasses) take their values.

    Args:
        dist_type: the distribution type.
        coordinates: its :class:`Coordinates`.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises :class:`storch.registry.DuplicateRegistrationError`.
    """
    _COORDINATES.register(dist_type, replace=replace)(coordinates)


def coordinates_for(distr: Distribution) -> Optional[Coordinates]:
    """The :class:`Coordinates` registered for ``type(distr)`` or its most specific base class, else ``None``.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> coordinates_for(Bernoulli(torch.tensor([0.25]))).probs(Bernoulli(torch.tensor([0.25]))).tolist()
        [[0.75, 0.25]]
    """
    return _COORDINATES.lookup(distr)


def _bernoulli_probs(d: Bernoulli) -> torch.Tensor:
    p = d.probs
    return torch.stack([1 - p, p], -1)


_COORDINATES.register(Bernoulli)(
    Coordinates(values=lambda d: torch.tensor([0.0, 1.0], dtype=d.probs.dtype, device=d.probs.device),
                probs=_bernoulli_probs)
)
_COORDINATES.register(Categorical)(
    Coordinates(values=lambda d: torch.arange(d.probs.shape[-1], device=d.probs.device), probs=lambda d: d.probs)
)
_COORDINATES.register(OneHotCategorical)(
    Coordinates(
        values=lambda d: torch.eye(d.probs.shape[-1], dtype=d.probs.dtype, device=d.probs.device),
        probs=lambda d: d.probs,
    )
)


def _require_coordinates(distr: Distribution, who: str) -> Coordinates:
    coordinates = coordinates_for(distr)
    if coordinates is None:
        hint = ""
        if type(distr).__name__ == "Independent":
            hint = (
                " Pass the base distribution instead (its batch dimensions are the independent "
                "coordinates), e.g. Bernoulli(logits) rather than Independent(Bernoulli(logits), 1)."
            )
        raise ValueError(
            f"{who}: no coordinates are registered for {type(distr).__name__}; local expectations "
            f"support factorised Bernoulli, Categorical and OneHotCategorical variables "
            f"(register others with storch.method.local_expectation.register_coordinates).{hint}"
        )
    return coordinates


def _var_shape(distr: Distribution, n_plate_dims: int) -> tuple[int, ...]:
    return tuple(distr.batch_shape)[n_plate_dims:]


def local_expectation_group_size(distr: Distribution, n_plate_dims: int = 0) -> int:
    """``M = 1 + D·K`` evaluation points per sample of ``distr``.

    ``D`` is the number of independent variables in the batch dimensions after the first
    ``n_plate_dims`` (those belong to plates), ``K`` the number of values of each.

    Examples:
        >>> import torch
        >>> from torch.distributions import OneHotCategorical
        >>> local_expectation_group_size(OneHotCategorical(logits=torch.zeros(5, 2, 3)), n_plate_dims=1)
        7
    """
    coordinates = _require_coordinates(distr, "local_expectation_group_size")
    k = coordinates.values(distr).shape[0]
    return 1 + math.prod(_var_shape(distr, n_plate_dims)) * k


def local_expectation_points(distr: Distribution, n_samples: int, n_plate_dims: int = 0) -> torch.Tensor:
    """``n`` samples of ``distr`` and their one-coordinate changes: ``(n, 1 + D·K, *batch, *event)``.

    Point 0 of group ``j`` is the sample ``x_j``; point ``1 + d·K + k`` is ``x_j`` with coordinate ``d``
    (in row-major order over the non-plate batch dimensions) set to value ``k``. Call it on plain
    tensors (storch dispatch disabled), as proposals are.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> points = local_expectation_points(Bernoulli(torch.tensor([1.0, 0.0])), 1)
        >>> points[0].tolist()   # the sample, then coordinate 0 set to 0 and 1, coordinate 1 set to 0 and 1
        [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]]
    """
    coordinates = _require_coordinates(distr, "local_expectation_points")
    values = coordinates.values(distr)  # (K, *event)
    k = values.shape[0]
    batch = tuple(distr.batch_shape)
    event = tuple(distr.event_shape)
    plate_shape, var_shape = batch[:n_plate_dims], batch[n_plate_dims:]
    n_vars = math.prod(var_shape)
    x = distr.sample((n_samples,))
    flat = x.reshape((n_samples,) + plate_shape + (n_vars,) + event)
    n_p, n_e = len(plate_shape), len(event)
    # changed[j, d, k, ..., d', ...] = values[k] if d' == d else x_j[..., d', ...]
    base = flat[:, None, None]
    which = torch.eye(n_vars, dtype=torch.bool, device=x.device)
    which = which.reshape((1, n_vars, 1) + (1,) * n_p + (n_vars,) + (1,) * n_e)
    vals = values.reshape((1, 1, k) + (1,) * n_p + (1,) + event).to(x.dtype)
    changed = torch.where(which, vals, base)
    changed = changed.reshape((n_samples, n_vars * k) + batch + event)
    return torch.cat([x.unsqueeze(1), changed], 1)


def local_expectation_weights(n_samples: int, group_size: int) -> torch.Tensor:
    """Plate weights of the points: ``1/n`` on each sample, 0 on the changed points.

    Examples:
        >>> local_expectation_weights(2, 3).tolist()
        [0.5, 0.0, 0.0, 0.5, 0.0, 0.0]
    """
    return group_weights(n_samples, [1.0] + [0.0] * (group_size - 1))


def local_expectation_term(tensor: StochasticTensor, cost: torch.Tensor) -> Tensor:
    """The surrogate term, per point, of a node sampled with :func:`local_expectation_points`.

    ``Σ_d Σ_k (p_d(k) − stopgrad p_d(k)) · □(½ Σ_{d'≠d} log p_{d'}(x_{d'})) · cost(x≠d, x_d = k)``
    per group, spread over the group's points (so it counts once per group). Its forward value is 0;
    its first and second derivatives are the local-expectation estimates (see the module docstring).

    Args:
        tensor: the node (its plate holds ``n`` groups of ``1 + D·K`` points, sample first).
        cost: the downstream cost, one value per point (and per value of other plates).
    """
    plate = tensor.plate
    distr = tensor.distribution
    parents = tuple(layout_of(tensor).plates[1:])
    coordinates = _require_coordinates(distr, "local_expectation_term")
    with no_dispatch():
        k = coordinates.values(distr).shape[0]
        n_vars = math.prod(_var_shape(distr, len(parents)))
        group_size = 1 + n_vars * k
        groups = group_plate(plate, group_size)
        probs = coordinates.probs(distr)
        probs = probs.reshape(probs.shape[: len(parents)] + (n_vars, k))
        samples = tensor.view_as(tensor)
        real = samples.reshape((groups.size, group_size) + tuple(samples.shape[1:]))[:, 0]
        log_p = log_prob_of_own_samples(distr, real)
        log_p = log_p.reshape(log_p.shape[: 1 + len(parents)] + (n_vars,))
        others = log_p.sum(-1, keepdim=True) - log_p  # Σ_{d' ≠ d} log p_{d'}(x_{d'})
        box = magic_box(0.5 * others).unsqueeze(-1)
    probs = wrap_new(probs, layout_of_plates(parents))
    box = wrap_new(box, layout_of_plates((groups,) + parents))
    per_group = split_groups(cost, plate, group_size)
    changed = torch.unflatten(per_group[..., 1:], -1, (n_vars, k))
    term = ((probs - probs.detach()) * box * changed).sum(-1).sum(-1)
    return spread_groups(term, cost, plate, group_size)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- method
class LocalExpectation(Method):
    """Local expectation gradients (IndeCateR) for factorised Bernoulli and categorical nodes.

    ``∇θ E f = E[∇θ f(x)] + Σ_d E_{x≠d}[Σ_k ∇θ p_d(k) f(x≠d, x_d = k)]``, exact in each coordinate
    given a sample of the others (Titsias & Lázaro-Gredilla 2015; De Smet et al. 2023). Unbiased for
    first and second derivatives (not third). Costs ``n·(1 + D·K)`` evaluations: the node's plate
    holds, for each of the ``n`` samples, the sample and its ``D·K`` one-coordinate changes; the
    estimate of ``E f`` uses the samples only (the other points have weight 0).

    Args:
        plate_name: node / plate name.
        n_samples: the number of samples ``n`` (the plate has ``n·(1 + D·K)`` points).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> logits = torch.tensor([0.3, -0.5], requires_grad=True)
        >>> x = LocalExpectation("x", n_samples=2)(Bernoulli(logits=logits))
        >>> x.shape                                  # 2 samples × (1 + 2 variables × 2 values)
        torch.Size([10, 2])
        >>> storch.add_cost((x[..., 0] - 2 * x[..., 1]) ** 2, "f")
        >>> _ = storch.backward()
        >>> logits.grad is not None
        True
    """

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name, None, n_samples)
        self.sampling_method.set_mc_sample(self._sample)
        self.sampling_method.set_mc_weighting_function(self._weights)

    def check_distribution(self, distr: Distribution) -> None:
        _require_coordinates(distr, f"{type(self).__name__}({self.plate_name!r})")

    def _sample(self, distr: Distribution, plates, n: int) -> torch.Tensor:
        return flatten_groups(local_expectation_points(distr, n, len(plates)))

    def _weights(self, tensor: StochasticTensor, plate) -> torch.Tensor:
        n = self.n_samples
        return local_expectation_weights(n, plate.size // n).to(tensor.device)

    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[None, Tensor]:
        return None, local_expectation_term(tensor, cost)


#: De Smet et al. 2023 call the categorical case IndeCateR; it is the same estimator.
IndeCateR = LocalExpectation
