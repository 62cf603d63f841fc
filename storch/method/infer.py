"""Infer: reparameterize when the distribution allows it, else the score function with a baseline.

The choice is made per call, and the returned node is handled by exactly one of the two estimators,
so no gradient is counted twice.
"""

from __future__ import annotations

from typing import Any

from torch.distributions import Distribution

from storch.method.baseline import BaselineFactory
from storch.method.method import (
    DEFAULT_N_SAMPLES,
    Method,
    check_floating_parameters,
    proposal_arguments,
)
from storch.method.reparameterization import Reparameterization
from storch.method.score_function import ScoreFunction
from storch.sampling.method import SamplingMethod
from storch.extend import StochasticTensor

__all__ = ["Infer"]

_DEFAULT = "default"


class Infer(Method):
    """Pathwise gradients for ``rsample``-able distributions, score function otherwise.

    Args:
        plate_name: node / plate name.
        sampling_method: the proposal (default: i.i.d. samples).
        n_samples: the number of samples.
        baseline_factory: baseline of the score-function branch; by default ``"batch_average"``
            with two or more samples and ``"moving_average"`` with one.
        distribution_type: Storchastic's argument (its ``Infer(plate_name, distribution_type,
            sampling_method, n_samples)``, also taken positionally in that order): the distribution
            class the node will be called with; storch then checks each call against it. The choice
            of estimator is still made per call. Storchastic chose Gumbel-softmax (biased) for
            `Bernoulli` and `OneHotCategorical`; storch chooses the score function with a baseline
            (unbiased) for every distribution without ``rsample``.

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
        distribution_type: type[Distribution] | None = None,
    ) -> None:
        if _is_distribution_type(sampling_method):  # Storchastic's order: (name, type, sampling_method, n)
            distribution_type, sampling_method, n_samples, baseline_factory = _storchastic_arguments(
                sampling_method, n_samples, baseline_factory
            )
        if distribution_type is not None and not _is_distribution_type(distribution_type):
            raise TypeError(
                f"Infer({plate_name!r}): distribution_type must be a torch.distributions.Distribution "
                f"subclass (e.g. Normal), got {distribution_type!r}."
            )
        self.distribution_type = distribution_type
        sampling_method, n_samples = proposal_arguments(f"Infer({plate_name!r})", sampling_method, n_samples)
        super().__init__(plate_name, sampling_method, n_samples)
        if baseline_factory == _DEFAULT:
            baseline_factory = "batch_average" if self.n_samples >= 2 else "moving_average"
        self.reparameterization = Reparameterization(plate_name, sampling_method, n_samples)
        self.score_function = ScoreFunction(plate_name, sampling_method, n_samples, baseline_factory)

    def forward(self, distr: Distribution) -> StochasticTensor:
        if isinstance(distr, Distribution):  # named Infer here, not the method it delegates to
            check_floating_parameters(distr, type(self).__name__, self.plate_name)
            expected = self.distribution_type
            if expected is not None and not isinstance(distr, expected):
                raise TypeError(
                    f"Infer({self.plate_name!r}) was built for {expected.__name__} distributions "
                    f"(distribution_type), but was called with a {type(distr).__name__}. Pass the "
                    "distribution it was built for, or leave distribution_type out: Infer chooses its "
                    "estimator per call."
                )
        return self.delegate_for(distr)(distr)

    def delegate_for(self, distr: Distribution) -> Method:
        """The method that draws a node of ``distr``: reparameterization where it has ``rsample``, else
        the score function."""
        if isinstance(distr, Distribution) and distr.has_rsample:
            return self.reparameterization
        return self.score_function


def _is_distribution_type(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, Distribution)


def _storchastic_arguments(
    distribution_type: type[Distribution], second: Any, third: Any
) -> tuple[type[Distribution], Any, Any, Any]:
    """Storchastic's ``Infer(name, distribution_type, sampling_method, n_samples)``: the values found
    in storch's slots ``(sampling_method, n_samples, baseline_factory)`` moved to where they belong.

    ``second`` (storch's ``n_samples`` slot) is Storchastic's ``sampling_method`` (an ``int`` there
    is a count, as everywhere); ``third`` (storch's ``baseline_factory`` slot) is Storchastic's
    ``n_samples`` when it is a count, else a baseline given by keyword.
    """
    sampling_method = None if second is DEFAULT_N_SAMPLES else second
    if isinstance(third, int) and not isinstance(third, bool):
        return distribution_type, sampling_method, third, _DEFAULT
    return distribution_type, sampling_method, DEFAULT_N_SAMPLES, third
