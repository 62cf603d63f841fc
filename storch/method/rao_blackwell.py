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

from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.distributions import Categorical, Distribution

from storch.method.method import Method, log_prob
from storch.plate import Plate
from storch.sampling.method import SamplingMethod, check_count
from storch.tensor import StochasticTensor, wrap_new
from storch.util import log_prob_of_own_samples

if TYPE_CHECKING:  # pragma: no cover
    from storch.tensor import CostTensor

__all__ = ["RaoBlackwellSF", "SumAndSampleRest"]


def _check_single_variable(owner: str, distr: Distribution, n_plates: int) -> None:
    if not distr.has_enumerate_support:
        raise ValueError(
            f"{owner}: {type(distr).__name__} has no enumerable support. RaoBlackwellSF sums over the "
            "most probable values of one discrete variable (Categorical, OneHotCategorical, Bernoulli, "
            "...); use ScoreFunction or Reparameterization for other distributions."
        )
    extra = tuple(distr.batch_shape)[n_plates:]
    if extra:
        raise ValueError(
            f"{owner}: {type(distr).__name__} has batch shape {tuple(distr.batch_shape)}, of which "
            f"{extra} are not plates: that is {extra} variables in one node. RaoBlackwellSF handles "
            "one variable per plate element. Make independent elements a plate "
            "(storch.denote_independent(logits, dim, 'name')), sample each variable as its own node, "
            "or use ScoreFunction / Expect for the joint."
        )


class SumAndSampleRest(SamplingMethod):
    """The proposal of :class:`RaoBlackwellSF`: the ``k − 1`` most probable values, then ``n_sampled``
    samples of the remaining values; weights ``p(x)`` and ``(1 − p(C))/n_sampled`` (detached).

    Args:
        plate_name: the node's plate.
        k: the number of values summed plus one (the plate holds ``k − 1 + n_sampled`` points).
        n_sampled: the number of i.i.d. samples drawn from the values outside the summed set.

    Examples:
        >>> import torch
        >>> from torch.distributions import Categorical
        >>> SumAndSampleRest("z", 3).sample(Categorical(probs=torch.tensor([0.1, 0.5, 0.3, 0.1])), (), False)[:2]
        tensor([1, 2])
    """

    def __init__(self, plate_name: str, k: int, n_sampled: int = 1) -> None:
        super().__init__(plate_name)
        owner = f"{type(self).__name__}({plate_name!r})"
        self.k = check_count(k, "k", owner)
        self.n_sampled = check_count(n_sampled, "n_sampled", owner)
        self.n_samples = self.k - 1 + self.n_sampled
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        owner = f"RaoBlackwellSF({self.plate_name!r})"
        _check_single_variable(owner, distr, len(plates))
        event = tuple(distr.event_shape)
        with torch.no_grad():
            support = distr.enumerate_support(expand=False)  # (K, 1, ..., 1, *event)
            n_values = support.shape[0]
            if self.k > n_values:
                raise ValueError(
                    f"{owner}: k={self.k} sums {self.k - 1} values and samples from the rest, but "
                    f"{type(distr).__name__} has only {n_values} values; use k <= {n_values}, or "
                    "Expect to sum over all of them."
                )
            values = support.reshape((n_values,) + event)
            log_p = log_prob_of_own_samples(distr, support).detach()  # (K, *plates)
            log_p = log_p.movedim(0, -1)  # (*plates, K)
            summed = log_p.topk(self.k - 1, dim=-1).indices  # (*plates, k - 1)
            rest = log_p.scatter(-1, summed, float("-inf"))
            log_rest_mass = rest.logsumexp(-1)  # log(1 − q)
            # no mass left outside C (values of probability 0): draw any value; its weight is 0
            rest = torch.where(torch.isneginf(log_rest_mass).unsqueeze(-1), torch.zeros_like(rest), rest)
            sampled = Categorical(logits=rest, validate_args=False).sample((self.n_sampled,)).movedim(0, -1)  # (*plates, m)
            index = torch.cat([summed, sampled], -1)
            log_w = torch.cat(
                [
                    log_p.gather(-1, summed),
                    (log_rest_mass - torch.log(torch.tensor(float(self.n_sampled), dtype=log_p.dtype, device=log_p.device)))
                    .unsqueeze(-1)
                    .expand(sampled.shape),
                ],
                -1,
            )
            index = index.movedim(-1, 0)  # (k − 1 + m, *plates)
            samples = values[index]
        self._pending = (samples, log_w.movedim(-1, 0).exp())
        return samples

    def weighting_function(self, tensor: StochasticTensor, plate: Plate) -> Optional[torch.Tensor]:
        """``p(x)`` on the summed values and ``(1 − q)/n_sampled`` on the samples (detached)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not tensor._node.samples:
            raise RuntimeError(
                f"RaoBlackwellSF({self.plate_name!r}): weights are computed right after sampling; call "
                "the method on a distribution instead of using its sampling method directly."
            )
        return wrap_new(pending[1], tensor._layout)

    def reset(self) -> None:
        self._pending = None

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, k={self.k}, n_sampled={self.n_sampled}"


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

    Example:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> theta = torch.tensor([2.0, 0.0, -1.0, 0.5], requires_grad=True)
        >>> z = RaoBlackwellSF("z", k=3)(OneHotCategorical(logits=theta))
        >>> z._tensor[:2].argmax(-1).tolist()   # the two most probable values, summed exactly
        [0, 3]
        >>> storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum(-1), "f")
        >>> _ = storch.backward(); theta.grad.shape
        torch.Size([4])
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
