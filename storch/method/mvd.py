"""Measure-valued derivatives (MVD). Mohamed, Rosca, Figurnov & Mnih 2020 (JMLR), §6; Pflug 1989.

    ∂_{θ_d} E_p[f(x)] = c_θ (E_{x_d ~ p⁺} f(x) − E_{x_d ~ p⁻} f(x)),   x_{≠d} ~ p

The derivative of the density with respect to each parameter coordinate is a scaled difference of
two probability laws (`storch.distributions.measure_valued` holds them per distribution type). The
estimator needs no derivative of ``f`` and no score: for each sample ``x ~ p`` it evaluates the cost
at extra points where one coordinate ``d`` is redrawn from ``p⁺`` or ``p⁻`` and the others stay at
``x``.

Components (an evaluation group per sample, `storch.method.groups`): the group holds the real
sample ``x`` (weight ``1/n``, so the forward value is the usual Monte Carlo estimate of ``E f``) and,
for every parameter that requires grad and every coordinate ``d``, that parameter's points (weight
``0``). No gradient function; the control-variate term is ``Σ_θ (θ − stopgrad θ) · stopgrad(ĝ_θ)``,
zero in the forward pass, whose gradient is the MVD estimate ``ĝ_θ``. Gradients that reach the cost
by other paths (the cost's own parameters, nodes downstream) flow through the real sample as usual.

Unbiased for first-order derivatives; higher-order derivatives of the MVD term are not estimated
(``backward(create_graph=True)`` differentiates only the chain rule through ``θ``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributions import Distribution

from storch.extend import (
    CostTensor,
    Plate,
    PlateLayout,
    StochasticTensor,
    Tensor,
    align_to,
    distribution_layout,
    layout_of,
    layout_of_plates,
    no_dispatch,
    node_of,
    wrap,
)
from storch.method.groups import GroupRecords, flatten_groups, group_weights, split_groups, spread_groups
from storch.distributions.measure_valued import MeasureValuedDecomposition, measure_valued_for, registered_types
from storch.method.method import Method

__all__ = ["MVD"]


@dataclass(frozen=True)
class _Plan:
    """How one node's evaluation group is laid out: the real sample, then a block per parameter."""

    blocks: tuple[tuple[str, int], ...]  # (parameter name, points per coordinate J), in order
    coordinates: tuple[int, ...]  # the coordinate shape C

    @property
    def n_coordinates(self) -> int:
        return math.prod(self.coordinates)

    @property
    def group_size(self) -> int:
        return 1 + sum(j for _, j in self.blocks) * self.n_coordinates


def _coordinate_points(x: torch.Tensor, values: torch.Tensor, n_plates: int, coord_ndim: int) -> torch.Tensor:
    """Points with one coordinate replaced: ``(n, J·D, *plates, *C, *event)`` from ``x``
    ``(n, *plates, *C, *event)`` and the replacement values ``(n, J, *plates, *C, *event)``.
    Point ``j·D + d`` equals ``x`` except at coordinate ``d`` (row-major over ``C``)."""
    n, j = values.shape[:2]
    plates = tuple(x.shape[1 : 1 + n_plates])
    coords = tuple(x.shape[1 + n_plates : 1 + n_plates + coord_ndim])
    event = tuple(x.shape[1 + n_plates + coord_ndim :])
    d = math.prod(coords)
    x_flat = x.reshape((n, 1, 1) + plates + (d,) + event)
    v_flat = values.reshape((n, j, 1) + plates + (d,) + event)
    eye = torch.eye(d, dtype=torch.bool, device=x.device)
    mask = eye.reshape((1, 1, d) + (1,) * len(plates) + (d,) + (1,) * len(event))
    points = torch.where(mask, v_flat, x_flat)
    return points.reshape((n, j * d) + plates + coords + event)


def _aligned(t: torch.Tensor, layout: PlateLayout) -> torch.Tensor:
    """A detached plain view of ``t`` with one leading dimension per plate of ``layout``."""
    with no_dispatch():
        if isinstance(t, Tensor) and layout_of(t).sizes:
            return align_to(t, layout).detach()
        return t.detach()[(None,) * len(layout.sizes)]


class MVD(Method):
    """Measure-valued derivatives: cost differences at coupled points, no score, no ``∂f``.

    Supported distributions (registry `storch.distributions.measure_valued`): ``Normal`` (``loc`` and
    ``scale``), ``Bernoulli`` (probs; a Bernoulli built from logits gets its gradient through
    ``σ(logits)``), ``Categorical`` and ``OneHotCategorical`` (probs, through ``softmax(logits)``),
    ``Poisson`` and ``Exponential`` (``rate``). Only parameters that require grad get points.

    Cost evaluations per sample: ``1 + Σ_θ J_θ · D`` for ``D`` coordinates (the non-plate batch
    elements): ``J = 2`` for the Normal mean, ``1`` for the Normal scale, Bernoulli, Poisson and
    Exponential, ``K − 1`` for a ``K``-way categorical (the real sample supplies the remaining value).
    The node's plate has ``n_samples`` times that many points, grouped per sample.

    Unbiased for first-order derivatives (the registered decompositions are exact); not for
    higher orders.

    Args:
        plate_name: node / plate name.
        n_samples: the number of real samples ``x ~ p`` (evaluation groups).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> _ = torch.manual_seed(0)
        >>> mu = torch.tensor([0.5, -1.0], requires_grad=True)
        >>> x = MVD("x", n_samples=4000)(Normal(mu, 1.0))   # groups of 1 + 2·2 points
        >>> x.shape
        torch.Size([20000, 2])
        >>> storch.add_cost((x**2).sum(-1), "f")         # ∂/∂μ E f = 2μ
        >>> _ = storch.backward()
        >>> mu.grad.shape, bool(torch.allclose(mu.grad, 2 * mu.detach(), atol=0.1))
        (torch.Size([2]), True)
    """

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name, None, n_samples)
        self._plans = GroupRecords("MVD", "evaluation layout")  # samples -> _Plan
        self.sampling_method.set_mc_weighting_function(self._weights)

    def check_distribution(self, distr: Distribution) -> None:
        if measure_valued_for(distr) is None:
            names = ", ".join(t.__name__ for t in registered_types())
            raise ValueError(
                f"MVD({self.plate_name!r}) has no measure-valued decomposition for "
                f"{type(distr).__name__}; registered: {names}. Register one with "
                "storch.distributions.measure_valued.register_measure_valued, or use ScoreFunction / "
                "Reparameterization for this node."
            )

    def _decomposition(self, distr: Distribution) -> MeasureValuedDecomposition:
        decomposition = measure_valued_for(distr)
        assert decomposition is not None  # check_distribution ran in forward
        return decomposition

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        decomposition = self._decomposition(distr)
        n_plates = len(distribution_layout(distr).sizes)
        given = decomposition.parameters(distr)
        params = {name: value.detach() for name, value in given.items()}
        x = distr.sample((amt_samples,))
        coord_ndim = len(distr.batch_shape) - n_plates
        groups = [x.unsqueeze(1)]
        blocks = []
        for name in [name for name, value in given.items() if value.requires_grad]:
            values = decomposition.parts[name].points(params, x)
            groups.append(_coordinate_points(x, values.to(x.dtype), n_plates, coord_ndim))
            blocks.append((name, values.shape[1]))
        samples = flatten_groups(torch.cat(groups, 1))
        self._plans.keep(samples, _Plan(tuple(blocks), tuple(distr.batch_shape[n_plates:])))
        return samples

    def _weights(self, tensor: StochasticTensor, plate: Plate) -> torch.Tensor:
        m = self._plans.of(tensor).group_size
        return group_weights(plate.size // m, [1.0] + [0.0] * (m - 1))

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        plan = self._plans.of(tensor)
        if not plan.blocks:
            return None, None
        plate = tensor.plate
        m = plan.group_size
        distr = tensor.distribution
        decomposition = self._decomposition(distr)
        per_group = split_groups(cost.detach(), plate, m)
        layout = layout_of(per_group)  # the groups, then the cost's other plates
        lead = len(layout.sizes)
        coord_ndim = len(plan.coordinates)
        d = plan.n_coordinates
        with no_dispatch():
            f = per_group.view_as(per_group)
            f_x = f[..., 0][(...,) + (None,) * coord_ndim]
            samples = node_of(tensor).samples
            n = samples.shape[0] // m
            x_real = samples.reshape((n, m) + tuple(samples.shape[1:]))[:, 0]
        node_layout = node_of(tensor).layout
        x_layout = layout_of_plates((layout.plates[0],) + node_layout.plates[1:])
        x = _aligned(wrap(x_real, x_layout), layout)
        params = decomposition.parameters(distr)
        plain_params = {name: _aligned(value, layout) for name, value in params.items()}
        term: torch.Tensor | None = None
        offset = 1
        for name, j in plan.blocks:
            with no_dispatch():
                block = f[..., offset : offset + j * d].reshape(tuple(f.shape[:lead]) + (j,) + plan.coordinates)
                f_points = [block[(slice(None),) * lead + (i,)] for i in range(j)]
                g = decomposition.parts[name].gradient(plain_params, x, f_x, f_points)
                g = g.expand(layout.sizes + tuple(g.shape[lead:]))
            offset += j * d
            theta = params[name]
            contribution = (theta - theta.detach()) * wrap(g, layout)
            event = contribution.dim() - len(layout_of(contribution).sizes)
            if event:
                contribution = contribution.sum(tuple(range(-event, 0)))
            term = contribution if term is None else term + contribution
        assert term is not None  # plan.blocks is not empty
        return None, spread_groups(term, cost, plate, m)

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}"
