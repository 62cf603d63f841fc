"""Local expectation gradients (IndeCateR) for factorised discrete variables.

For ``x = (x_1, …, x_D)`` with independent coordinates ``x_d ~ p_d`` taking ``K`` values,

    ∇θ E[f(x)] = E_x[∇θ f(x)] + Σ_d E_{x≠d}[ Σ_k ∇θ p_d(k) · f(x≠d, x_d = k) ]

(Titsias & Lázaro-Gredilla 2015, "Local expectation gradients for black box variational inference";
``seeds/004_…`` eqs. 16–17; De Smet et al. 2023, "Differentiable sampling of categorical distributions
using the CatLog-derivative trick" (IndeCateR)). Each coordinate's sum over its values is exact, given
one sample of the others. Since ``Σ_k ∇p_d(k) = 0``, the value ``k = x_d`` (the sample itself) needs no
evaluation of its own: ``Σ_k ∇p_d(k) f(x≠d, k) = Σ_{k≠x_d} ∇p_d(k) (f(x≠d, k) − f(x))``.

Points. Each of the ``n`` samples is a group of ``M = 1 + D·(K−1)`` points: the sample ``x`` itself
(plate weight ``1/n``) and, at position ``1 + d·(K−1) + j``, ``x`` with coordinate ``d`` set to the
``j``-th of its ``K − 1`` other values, in the order of `Coordinates.values` (weight 0). ``D``
counts the independent variables in the distribution's non-plate batch dimensions. The cost is
evaluated at all ``n·M`` points in one vectorised pass (`storch.method.groups`).

Chains: one evaluation plate for all the nodes. A local-expectation node whose distribution's newest
plate is the evaluation plate of another local-expectation node (``z₂ ~ p(z₂ | z₁)``, both sampled with
`storch.method.local_expectation.LocalExpectation`, ``n_samples=1`` for the downstream one) does
not add a plate of its own, which
would make the cost's points the *product* ``M₁·M₂``. It extends the upstream plate instead: each
group gets ``D₂(K₂−1)`` more points, so a chain of nodes costs the *sum* ``1 + Σ_s D_s(K_s−1)`` per
sample. On the extended plate (named after the newest node), point ``m`` of a group is

* for ``m < M₁`` (the upstream points): ``z₁`` as at that point, and ``z₂`` drawn once from
  ``p(z₂ | z₁)`` at that point. The draws of one group share their uniforms (inverse CDF, common random
  numbers), so ``z₂`` changes only where ``z₁``'s change moves its distribution;
* for ``m ≥ M₁``: ``z₁`` as sampled and ``z₂``'s own one-coordinate changes of its point-0 draw.

Tensors computed from ``z₁`` alone are re-indexed to the extended plate where they meet ``z₂``
(an `storch.plate.AncestralPlate` step: ``z₁``'s values at the points ``m ≥ M₁`` are its
sample). A node computed from any step of a chain extends its newest step (branches ``z₁ → z₂``,
``z₁ → z₃`` share one plate); a *sibling*, whose distribution does not come from the chain, joins it
with ``joint_with=`` (its one draw per group is then the same at every upstream point). Nodes of other
methods drawn from a chain's points come before the chain in the surrogate recursion
(`storch.plate.Plate.surrogate_order`), so their scores are part of the cost ``C`` below. A node
joins only if its distribution's other plates are older than the chain's first step.
``LocalExpectation(..., joint=False)`` keeps the nested form: a plate of its own, the cost at the
product of the points.

Surrogate. Node ``s`` of a chain (its changes at positions ``[M_{s−1}, M_s)`` of a group, ``M₀ = 1``)
contributes, per group,

    T_s = Σ_d Σ_j (q_dj − stopgrad q_dj) · □(½ Σ_{d'≠d} log p_{s,d'}(x_{s,d'})) · (C_s[m_dj] − C_s[0])

with ``q_dj = p_{s,d}(j-th value ≠ x_{s,d})`` at point 0, ``m_dj = M_{s−1} + d·(K−1) + j``, and
``C_s[m] = f[m] · □(Σ_{t>s} log p_t(z_t[m]))`` the cost at point ``m`` times the scores of the chain's
later nodes drawn there. The group's term ``Σ_s T_s`` is spread over its points; its forward value is
0, so the estimate of ``E f`` is the mean of ``f`` at the samples.

What is unbiased. First derivatives, for every parameter: ``T_s``'s derivative is node ``s``'s local
expectation given the upstream sample (each changed value's downstream nodes drawn once at that value,
an unbiased estimate of the expectation over them), and the pathwise part is ``f`` at the samples.
Second derivatives: within a node, ``∇p_d ∇C`` gives the mixed terms and the box, whose expectation
over the other coordinates is a score-function estimate, the cross terms
``∇p_d(k) ∇p_{d'}(k')ᵀ f(…, k, …, k')`` between coordinates, half from each. Across nodes ``s < t``,
``∇θ_s ∇θ_t E f = E[Σ_{z_s} ∇p_s(z_s) ∇θ_t E[f | z_s]]`` comes from ``T_s`` alone: its cost carries the
scores of the later nodes drawn at each point, so ``∇C_s`` is a single-sample estimate of
``∇θ_t E[f | z_s]``; ``T_t`` carries no upstream box, which would count that term twice. Third and
higher derivatives are biased (three-coordinate terms are missing). The nested form is unbiased for the
same orders: its inner estimate is the downstream node's own surrogate at every point.

The values a coordinate can take and their probabilities are registered per distribution type
(`storch.method.local_expectation.register_coordinates`); setting a coordinate to a value is
then the same for every type.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.distributions import Distribution

from storch.extend import CostTensor, Plate, PlateLayout, StochasticTensor, Tensor
from storch.method.local_expectation_plates import (
    LocalExpectationMemoryError,
    LocalExpectationPlate,
    PointGroup,
    chain_to_extend,
    explicit_chain,
    extended_points,
    move_to_plate,
    own_points,
)
from storch.method.local_expectation_points import (
    Coordinates,
    coordinates_for,
    local_expectation_group_size,
    local_expectation_points,
    local_expectation_weights,
    register_coordinates,
    require_coordinates,
)
from storch.method.local_expectation_term import local_expectation_term
from storch.method.method import Method

__all__ = [
    "LocalExpectation", "IndeCateR", "Coordinates", "register_coordinates", "coordinates_for",
    "local_expectation_points", "local_expectation_group_size", "local_expectation_weights",
    "local_expectation_term", "LocalExpectationPlate", "LocalExpectationMemoryError",
]


class LocalExpectation(Method):
    """Local expectation gradients (IndeCateR) for factorised Bernoulli and categorical nodes.

    ``∇θ E f = E[∇θ f(x)] + Σ_d E_{x≠d}[Σ_k ∇θ p_d(k) f(x≠d, x_d = k)]``, exact in each coordinate
    given a sample of the others (Titsias & Lázaro-Gredilla 2015; De Smet et al. 2023). Unbiased for
    first and second derivatives (not third). Costs ``n·(1 + D·(K−1))`` evaluations: the node's plate
    holds, for each of the ``n`` samples, the sample and its ``D·(K−1)`` one-coordinate changes; the
    estimate of ``E f`` uses the samples only (the other points have weight 0).

    A node whose distribution's newest plate is another local-expectation node's (a chain
    ``z₁ → z₂``) adds its ``D₂(K₂−1)`` changes to that plate's groups instead of a plate of its own, so
    the chain costs the sum of the nodes' points, not their product (module docstring).

    Args:
        plate_name: node / plate name.
        n_samples: the number of samples ``n`` (the plate has ``n·(1 + D·(K−1))`` points). A node
            chained to an upstream one draws one sample per upstream sample and needs ``n_samples=1``
            (with more it is nested).
        joint: extend an upstream local-expectation plate (the default); ``False`` nests the node
            (a plate of its own, the cost at the product of the points).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> logits = torch.tensor([0.3, -0.5], requires_grad=True)
        >>> x = LocalExpectation("x", n_samples=2)(Bernoulli(logits=logits))
        >>> x.shape                                  # 2 samples × (1 + 2 variables × 1 other value)
        torch.Size([6, 2])
        >>> y = LocalExpectation("y")(Bernoulli(logits=x.sum(-1, keepdim=True) - 1.0))
        >>> y.plate_names, y.shape                   # y's one change joins x's groups: 2 × (3 + 1)
        (['y'], torch.Size([8, 1]))
        >>> storch.add_cost((x[..., 0] - 2 * x[..., 1] + y[..., 0]) ** 2, "f")
        >>> _ = storch.backward()
        >>> logits.grad is not None
        True
    """

    def __init__(self, plate_name: str, n_samples: int = 1, *, joint: bool = True) -> None:
        super().__init__(plate_name, None, n_samples)
        self.joint = bool(joint)
        self.sampling_method.set_mc_weighting_function(self._weights)

    def check_distribution(self, distr: Distribution) -> None:
        require_coordinates(distr, f"{type(self).__name__}({self.plate_name!r})")

    def forward(self, distr: Distribution, joint_with: Optional[StochasticTensor] = None) -> StochasticTensor:
        """Sample ``distr``: the sample and its changes, on a plate of its own or extending a chain.

        Args:
            distr: a factorised Bernoulli or categorical distribution.
            joint_with: a local-expectation node of this step whose points this node joins although its
                distribution is not computed from it (a *sibling*: ``z`` next to ``b`` in ``f(b, z)``),
                so that the cost is evaluated at the sum of their points, not the product.
        """
        return self._new_node(distr, lambda d, parents: self._draw_points(d, parents, joint_with))

    def _draw_points(self, distr: Distribution, parents: PlateLayout, joint_with: Optional[StochasticTensor]):
        """The points on a plate of their own, or extending the chain the node joins."""
        who = f"{type(self).__name__}({self.plate_name!r})"
        tip, carried = chain_to_extend(self, parents.plates, explicit_chain(who, joint_with, self))
        if tip is None:
            samples, group, others, index = own_points(distr, parents.plates, self.n_samples, who)
        else:
            samples, group, others, index = extended_points(distr, parents.plates, tip, carried, who)
        created_on = parents.plates if tip is None or carried is not None else parents.plates + (tip,)
        plate = LocalExpectationPlate(
            self.plate_name, samples.shape[0], parents=created_on, ancestor=tip, parent_index=index, info=group,
        )
        if tip is not None:
            tip._extended_by = weakref.ref(plate)
        if carried is not None:
            move_to_plate(distr, plate)
        return samples, plate, others

    def _weights(self, tensor: StochasticTensor, plate: Plate) -> torch.Tensor:
        group: PointGroup = plate.info  # type: ignore[assignment]
        return local_expectation_weights(group.n_groups, group.size).to(tensor.device)

    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[None, Tensor]:
        return None, local_expectation_term(tensor, cost)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.joint else ", joint=False")


#: De Smet et al. 2023 call the categorical case IndeCateR; it is the same estimator.
IndeCateR = LocalExpectation
