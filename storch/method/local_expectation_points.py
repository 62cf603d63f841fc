"""The coordinates of factorised discrete distributions, and the evaluation points of local expectations.

A factorised Bernoulli or categorical distribution has ``D`` independent variables (its non-plate
batch dimensions), each taking one of ``K`` values.
`storch.method.local_expectation_points.Coordinates` says, per distribution type,
what the values are and how probable each is;
`storch.method.local_expectation_points.local_expectation_points` lays out, for each
sample, the sample itself and its ``D·(K−1)`` one-coordinate changes (every value but the sample's
own, variable by variable), the points at which `storch.method.local_expectation`
evaluates the
cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, OneHotCategorical

from storch.extend import TypeRegistry
from storch.method.groups import group_weights
from storch.registries import COORDINATES, register_coordinates

__all__ = [
    "Coordinates", "register_coordinates", "coordinates_for", "require_coordinates", "variable_shape",
    "variable_counts", "value_index", "other_values", "one_coordinate_changes", "local_expectation_group_size",
    "local_expectation_points", "local_expectation_weights",
]


@dataclass(frozen=True)
class Coordinates:
    """What a factorised discrete distribution's coordinates look like, per distribution type.

    Attributes:
        values: ``distribution -> (K, *event_shape)``, the ``K`` values one coordinate can take
            (e.g. ``[0, 1]`` for a Bernoulli, the rows of the identity for a one-hot categorical).
        probs: ``distribution -> (*batch_shape, K)``, ``P(x_d = values[k])`` per coordinate,
            differentiable in the distribution's parameters.
        index: ``samples -> (...)``, the index ``k`` of each coordinate's value in ``values``
            (``samples`` of shape ``(..., *event_shape)``); ``None``: found by comparing with ``values``.
    """

    values: Callable[[Distribution], torch.Tensor]
    probs: Callable[[Distribution], torch.Tensor]
    index: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


_COORDINATES: TypeRegistry[Coordinates] = COORDINATES  # made in storch.registries, filled here


def coordinates_for(distr: Distribution) -> Optional[Coordinates]:
    """The `storch.method.local_expectation_points.Coordinates` registered for ``type(distr)`` or its
    most specific base class, else ``None``.

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


_COORDINATES.register_default(Bernoulli)(
    Coordinates(values=lambda d: torch.tensor([0.0, 1.0], dtype=d.probs.dtype, device=d.probs.device),
                probs=_bernoulli_probs, index=lambda x: x.long())
)
_COORDINATES.register_default(Categorical)(
    Coordinates(values=lambda d: torch.arange(d.probs.shape[-1], device=d.probs.device), probs=lambda d: d.probs,
                index=lambda x: x.long())
)
_COORDINATES.register_default(OneHotCategorical)(
    Coordinates(
        values=lambda d: torch.eye(d.probs.shape[-1], dtype=d.probs.dtype, device=d.probs.device),
        probs=lambda d: d.probs,
        index=lambda x: x.argmax(-1),
    )
)


def require_coordinates(distr: Distribution, who: str) -> Coordinates:
    coordinates = coordinates_for(distr)
    if coordinates is None:
        raise ValueError(
            f"{who}: no coordinates are registered for {type(distr).__name__}; local expectations "
            f"support factorised Bernoulli, Categorical and OneHotCategorical variables "
            f"(register others with storch.method.local_expectation.register_coordinates)."
        )
    return coordinates


def variable_shape(distr: Distribution, n_plate_dims: int) -> tuple[int, ...]:
    return tuple(distr.batch_shape)[n_plate_dims:]


def variable_counts(distr: Distribution, n_plate_dims: int, who: str) -> tuple[int, int]:
    """``(D, K)``: the number of independent variables and of values of each."""
    coordinates = require_coordinates(distr, who)
    return math.prod(variable_shape(distr, n_plate_dims)), coordinates.values(distr).shape[0]


def local_expectation_group_size(distr: Distribution, n_plate_dims: int = 0) -> int:
    """``M = 1 + D·(K−1)`` evaluation points per sample of ``distr``: the sample and its changes.

    ``D`` is the number of independent variables in the batch dimensions after the first
    ``n_plate_dims`` (those belong to plates), ``K`` the number of values of each. A node chained to
    an upstream local-expectation node adds ``D·(K−1)`` points to the upstream group instead.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli, OneHotCategorical
        >>> local_expectation_group_size(OneHotCategorical(logits=torch.zeros(5, 2, 3)), n_plate_dims=1)
        5
        >>> local_expectation_group_size(Bernoulli(logits=torch.zeros(200)))   # 200 bits: 1 + 200
        201
    """
    n_vars, k = variable_counts(distr, n_plate_dims, "local_expectation_group_size")
    return 1 + n_vars * (k - 1)


def value_index(x: torch.Tensor, values: torch.Tensor, coordinates: Coordinates) -> torch.Tensor:
    """The index ``k`` of each coordinate's value in ``values`` (``(K, *event)``): ``x`` of shape
    ``(..., *event)`` gives ``(...)``."""
    if coordinates.index is not None:
        return coordinates.index(x)
    n_event = values.dim() - 1
    match = x.unsqueeze(x.dim() - n_event) == values.to(x.dtype)  # (..., K, *event)
    if n_event:
        match = match.flatten(-n_event).all(-1)
    return match.to(torch.uint8).argmax(-1)


def other_values(index: torch.Tensor, k: int) -> torch.Tensor:
    """``(..., K−1)``: the indices of the values other than ``index``, in increasing order."""
    j = torch.arange(k - 1, device=index.device)
    return j + (j >= index.unsqueeze(-1)).to(j.dtype)


def one_coordinate_changes(x: torch.Tensor, values: torch.Tensor, n_between: int, coordinates: Coordinates) -> torch.Tensor:
    """The one-coordinate changes of samples ``x`` of shape ``(G, *P, D, *event)``, with ``n_between``
    dimensions ``P`` (plates) between the groups ``G`` and the variables ``D``.

    Returns ``(G, D·(K−1), *P, D, *event)``: change ``d·(K−1) + j`` is ``x`` with variable ``d`` set
    to the ``j``-th of its other values.
    """
    k = values.shape[0]
    n_event = values.dim() - 1
    n_vars = x.shape[1 + n_between]
    others = values[other_values(value_index(x, values, coordinates), k)].to(x.dtype)  # (G, *P, D, K−1, *event)
    # (G, D, K−1, *P, 1, *event): the new value of variable d, to be placed at d' = d
    order = [0, 1 + n_between, 2 + n_between] + list(range(1, 1 + n_between))
    order += list(range(3 + n_between, 3 + n_between + n_event))
    new = others.permute(order).unsqueeze(3 + n_between)
    which = torch.eye(n_vars, dtype=torch.bool, device=x.device)
    which = which.reshape((1, n_vars, 1) + (1,) * n_between + (n_vars,) + (1,) * n_event)
    changed = torch.where(which, new, x[:, None, None])
    return changed.reshape((x.shape[0], n_vars * (k - 1)) + tuple(x.shape[1:]))


def local_expectation_points(distr: Distribution, n_samples: int, n_plate_dims: int = 0) -> torch.Tensor:
    """``n`` samples of ``distr`` and their one-coordinate changes: ``(n, 1 + D·(K−1), *batch, *event)``.

    Point 0 of group ``j`` is the sample ``x_j``; point ``1 + d·(K−1) + i`` is ``x_j`` with coordinate
    ``d`` (in row-major order over the non-plate batch dimensions) set to the ``i``-th value other than
    its own. Call it on plain tensors (storch dispatch disabled), as proposals are.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> points = local_expectation_points(Bernoulli(torch.tensor([1.0, 0.0])), 1)
        >>> points[0].tolist()   # the sample, then coordinate 0 flipped, then coordinate 1 flipped
        [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    """
    coordinates = require_coordinates(distr, "local_expectation_points")
    values = coordinates.values(distr)  # (K, *event)
    batch, event = tuple(distr.batch_shape), tuple(distr.event_shape)
    plate_shape, n_vars = batch[:n_plate_dims], math.prod(batch[n_plate_dims:])
    x = distr.sample((n_samples,))
    flat = x.reshape((n_samples,) + plate_shape + (n_vars,) + event)
    changed = one_coordinate_changes(flat, values, len(plate_shape), coordinates).reshape((n_samples, -1) + batch + event)
    return torch.cat([x.unsqueeze(1), changed], 1)


def local_expectation_weights(n_samples: int, group_size: int) -> torch.Tensor:
    """Plate weights of the points: ``1/n`` on each sample, 0 on the changed points.

    Examples:
        >>> local_expectation_weights(2, 3).tolist()
        [0.5, 0.0, 0.0, 0.5, 0.0, 0.0]
    """
    return group_weights(n_samples, [1.0] + [0.0] * (group_size - 1))
