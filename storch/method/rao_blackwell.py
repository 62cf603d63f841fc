"""Rao-Blackwellized score function: sum the most probable values, sample the rest. Liu et al. 2019,
"Rao-Blackwellized Stochastic Gradients for Discrete Distributions" (ICML).

For one discrete variable with probabilities ``p`` and ``C`` the ``k − 1`` most probable values
(``q = p(C)``),

    E_p[f] = Σ_{x ∈ C} p(x) f(x) + (1 − q) · E_{x ~ p(· | x ∉ C)}[f(x)]

so ``Σ_{x ∈ C} p(x) f(x) + (1 − q)/m · Σ_{j ≤ m} f(x̃_j)`` with ``x̃_j ~ p(· | x ∉ C)`` i.i.d. is
unbiased, and its score-function gradient sums ``∇p`` exactly over ``C``. As Storchastic
components: the plate holds the ``k − 1`` values of ``C`` and ``m`` samples of the remainder, with
detached weights ``p(x)`` on ``C`` and ``(1 − q)/m`` on the samples, gradient function
``l(x) = log p(x)`` and no control variate. Since ``(1 − q) · □(log p(x̃) − log(1 − q)) =
stopgrad(1 − q) · □(log p(x̃))``, this is the same surrogate as differentiating the sum above, and
``E[Σ_x w(x) ∇ⁿ(□(log p(x)) g(x))] = ∇ⁿ E_p[g]`` for every order ``n``: all derivatives are
unbiased. (``C`` depends on the parameters only through a ranking, which is piecewise constant.)

It handles one discrete variable with enumerable support per element of the distribution's plates
(a minibatch plate, the samples of parent nodes): each element gets its own set ``C`` and samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch.distributions import Distribution

from storch.method.method import Method, log_prob
from storch.sampling.method import check_count
from storch.sampling.swor import SumAndSampleRest  # the proposal (defined with the other WOR proposals)
from storch.sampling.swor import check_single_variable as _check_single_variable
from storch.extend import StochasticTensor

if TYPE_CHECKING:  # pragma: no cover
    from storch.extend import CostTensor

__all__ = ["RaoBlackwellSF", "SumAndSampleRest"]


class RaoBlackwellSF(Method):
    """Score function with the ``k − 1`` most probable values summed exactly (Liu et al. 2019).

    Unbiased for derivatives of every order. It costs ``k − 1 + n_sampled`` cost evaluations per
    node and plate element, and never has a larger variance than the score function with
    ``n_sampled`` samples (Liu et al., Theorem 1); the gain is largest when ``p`` is concentrated
    on a few values.

    Args:
        plate_name: node / plate name.
        k: ``k − 1`` values are summed, ``1 ≤ k ≤`` the number of values (``k = 1`` is the plain
            score function).
        n_sampled: samples drawn from the remaining values.

    Handles one discrete variable with enumerable support (Categorical, OneHotCategorical,
    Bernoulli, ...) per element of the distribution's plates; several variables in one node are an
    error.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> _ = torch.manual_seed(0)
        >>> theta = torch.tensor([2.0, 0.0, -1.0, 0.5], requires_grad=True)
        >>> z = RaoBlackwellSF("z", k=3, n_sampled=1000)(OneHotCategorical(logits=theta))
        >>> z.plain()[:2].argmax(-1).tolist()   # the two most probable values, summed exactly
        [0, 3]
        >>> v = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> storch.add_cost((z * v).sum(-1), "f")
        >>> _ = storch.backward()
        >>> pi = theta.detach().softmax(-1)      # exact: ∂/∂θ Σ_k π_k v_k = π (v − πᵀv)
        >>> theta.grad.shape, bool(torch.allclose(theta.grad, pi * (v - pi @ v), atol=0.02))
        (torch.Size([4]), True)
    """

    def __init__(self, plate_name: str, k: int, n_sampled: int = 1) -> None:
        owner = f"RaoBlackwellSF({plate_name!r})"
        k, n_sampled = check_count(k, "k", owner), check_count(n_sampled, "n_sampled", owner)
        super().__init__(plate_name, SumAndSampleRest(plate_name, k, n_sampled))

    def check_distribution(self, distr: Distribution) -> None:
        if not distr.has_enumerate_support:
            _check_single_variable(f"RaoBlackwellSF({self.plate_name!r})", distr, 0)

    def gradient_function(self, tensor: StochasticTensor) -> Optional[torch.Tensor]:
        l = log_prob(tensor)  # noqa: E741
        # values of probability 0 only occur with weight 0; keep their score finite (0 · -inf = nan)
        return torch.where(torch.isneginf(l), torch.zeros_like(l), l)

    def control_variate(self, tensor: StochasticTensor, cost: "CostTensor") -> Optional[torch.Tensor]:
        return None
