"""Infer: reparameterize when the distribution allows it, else the score function with a baseline.

The choice is made per call, and the returned node is handled by exactly one of the two estimators,
so no gradient is counted twice.
"""

from __future__ import annotations

from torch.distributions import Distribution

from storch.method.baseline import BaselineFactory
from storch.method.method import DEFAULT_N_SAMPLES, Method, check_floating_parameters, proposal_arguments
from storch.method.reparameterization import Reparameterization
from storch.method.score_function import ScoreFunction
from storch.sampling.method import SamplingMethod
from storch.extend import StochasticTensor

__all__ = ["Infer"]

_DEFAULT = "default"


class Infer(Method):
    """Pathwise gradients for ``rsample``-able distributions, score function otherwise.

    Args:
        baseline_factory: baseline of the score-function branch; by default ``"batch_average"``
            with two or more samples and ``"moving_average"`` with one.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli, Normal
        >>> infer = Infer("z", n_samples=2)
        >>> type(infer(Normal(0.0, 1.0)).method).__name__
        'Reparameterization'
        >>> type(infer(Bernoulli(0.5)).method).__name__
        'ScoreFunction'
    """

    def __init__(
        self,
        plate_name: str,
        sampling_method: SamplingMethod | None = None,
        n_samples: int = DEFAULT_N_SAMPLES,
        baseline_factory: BaselineFactory | str = _DEFAULT,
    ) -> None:
        sampling_method, n_samples = proposal_arguments(f"Infer({plate_name!r})", sampling_method, n_samples)
        super().__init__(plate_name, sampling_method, n_samples)
        if baseline_factory == _DEFAULT:
            baseline_factory = "batch_average" if self.n_samples >= 2 else "moving_average"
        self.reparameterization = Reparameterization(plate_name, sampling_method, n_samples)
        self.score_function = ScoreFunction(plate_name, sampling_method, n_samples, baseline_factory)

    def forward(self, distr: Distribution) -> StochasticTensor:
        if isinstance(distr, Distribution):  # named Infer here, not the method it delegates to
            check_floating_parameters(distr, type(self).__name__, self.plate_name)
        if isinstance(distr, Distribution) and distr.has_rsample:
            return self.reparameterization(distr)
        return self.score_function(distr)
