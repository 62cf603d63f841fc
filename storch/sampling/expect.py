"""Enumeration of a finite support: the proposal of `storch.method.Expect`.

All joint configurations of the distribution's independent (non-plate) batch elements are
enumerated, ``K^D`` of them for ``D`` variables with ``K`` values each, and weighted by their joint
probability ``p(x) = Π_d p(x_d)``, *not* detached, so that ``Σ_x p(x) f(x)`` is the exact
expectation and its gradient the exact gradient.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, OneHotCategorical

from storch.extend import Plate, layout_of, log_prob_of_own_samples, no_dispatch, wrap_new
from storch.sampling.method import SamplingMethod, check_count

if TYPE_CHECKING:  # pragma: no cover
    from storch.extend import StochasticTensor

__all__ = ["Enumerate"]


class Enumerate(SamplingMethod):
    """Enumerate every joint value of a discrete distribution, weighted by its probability.

    Args:
        plate_name: the name of the plate holding the configurations.
        budget: the largest number of configurations allowed; more is an error.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> Enumerate("z").sample(Bernoulli(torch.tensor([0.2, 0.7])), (), False).tolist()
        [[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]
    """

    def __init__(self, plate_name: str, budget: int = 10000) -> None:
        super().__init__(plate_name)
        self.budget = check_count(budget, "budget", f"{type(self).__name__}({plate_name!r})")

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        if not distr.has_enumerate_support:
            raise ValueError(
                f"Enumerate({self.plate_name!r}): {type(distr).__name__} has no finite support to "
                "enumerate; use a sampling estimator such as ScoreFunction or Reparameterization."
            )
        n_plates = len(plates)
        batch = tuple(distr.batch_shape)
        plate_shape, var_shape = batch[:n_plates], batch[n_plates:]
        n_vars = math.prod(var_shape)
        support = distr.enumerate_support(expand=False)  # (K, 1, ..., 1, *event)
        k = support.shape[0]
        if k ** n_vars > self.budget:
            raise ValueError(
                f"Enumerate({self.plate_name!r}): {n_vars} independent variables with {k} values each "
                f"have {k}^{n_vars} = {k ** n_vars} joint configurations, more than the budget of "
                f"{self.budget}. Raise the budget (Expect({self.plate_name!r}, budget=...)) or use a "
                "sampling estimator."
            )
        event = tuple(distr.event_shape)
        values = support.reshape((k,) + event)
        if not var_shape:  # one variable: the support itself
            joint = values
        else:
            grids = torch.cartesian_prod(*[torch.arange(k, device=values.device)] * n_vars)
            grids = grids.reshape(-1, n_vars)
            joint = values[grids].reshape((grids.shape[0],) + var_shape + event)
        shape = (joint.shape[0],) + plate_shape + var_shape + event
        view = joint.reshape((joint.shape[0],) + (1,) * n_plates + var_shape + event)
        return view.expand(shape)

    def weighting_function(self, tensor: "StochasticTensor", plate: Plate) -> Optional[torch.Tensor]:
        """The joint probability ``p(x)`` of each configuration (differentiable)."""
        layout = layout_of(tensor)
        with no_dispatch():
            p = probability_of_value(tensor.distribution, tensor)
            if p is None:
                p = log_prob_of_own_samples(tensor.distribution, tensor).exp()
            n = len(layout.sizes)
            weight = p.flatten(n).prod(-1) if p.dim() > n else p  # joint probability of the variables
        return wrap_new(weight, layout)


def probability_of_value(distr: Distribution, value: torch.Tensor) -> Optional[torch.Tensor]:
    """``p(value)`` read off the ``probs`` of a Bernoulli or (one-hot) categorical, else ``None``.

    ``exp(log_prob)`` is not exact at the edges: torch clamps ``probs`` into ``[eps, 1 − eps]`` before
    taking logarithms, so a value of probability 0 would get weight ``1.2e-7`` (an infinite cost there
    would make the expectation infinite) and the gradient of the clamp at ``p = 0`` or ``1`` is 0
    instead of ``f(1) − f(0)``. Reading ``probs`` gives exact zeros and the exact gradient.
    """
    holder = distr._categorical if isinstance(distr, OneHotCategorical) else distr
    if "probs" not in vars(holder):
        return None  # built from logits: exp(log_prob) is exact (logits of -inf give exactly 0)
    probs = holder.probs
    if isinstance(distr, Bernoulli):
        return torch.where(value == 1, probs, 1 - probs)
    if isinstance(distr, OneHotCategorical):
        return (value * probs).sum(-1)
    if isinstance(distr, Categorical):
        index = value.long().unsqueeze(-1)
        return probs.expand(index.shape[:-1] + probs.shape[-1:]).gather(-1, index).squeeze(-1)
    return None
