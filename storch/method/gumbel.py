"""Gumbel-softmax / Concrete relaxation (biased). Jang et al. 2017; Maddison et al. 2017.

The discrete sample is replaced by a relaxed, reparameterised sample at temperature ``τ``
(``softmax((log p + G)/τ)`` for categoricals, ``σ((φ + logistic noise)/τ)`` for Bernoullis). With
``straight_through`` the forward value is the discrete sample and the backward pass uses the
relaxed one (Bengio et al. 2013). The gradient is biased; the bias vanishes as ``τ → 0`` while the
variance grows. Relaxations are registered per distribution type in
`storch.distributions.relaxation`.

Components: n i.i.d. relaxed ``rsample`` draws, weight ``1/n``, no gradient function, no control
variate. The temperature follows ``τ_t = max(τ_min, τ_0 · exp(−r · t))`` after ``t`` backward passes;
``t`` and ``τ_t`` are buffers updated in place by tensor operations (`AnnealedTemperature`), so a
step replayed by [`storch.compile_step`][storch.compile_step] anneals exactly as an eager one.
"""

from __future__ import annotations


import torch
from torch.distributions import Distribution

from storch.method.method import DEFAULT_N_SAMPLES, Method
from storch.distributions.relaxation import AnnealedTemperature, relaxation_for
from storch.sampling.method import SamplingMethod
from storch.extend import StepState, rsample_gumbel_softmax

__all__ = ["GumbelSoftmax", "BufferedTemperature"]


#: The schedule of `GumbelSoftmax` (the same class as `storch.distributions.relaxation.AnnealedTemperature`,
#: whose buffers `storch.compile_step` replays).
BufferedTemperature = AnnealedTemperature


class GumbelSoftmax(AnnealedTemperature, Method):
    """Relaxed (optionally straight-through) samples of ``OneHotCategorical`` or ``Bernoulli`` nodes.

    Args:
        plate_name: node / plate name.
        sampling_method: proposal (default: Monte Carlo with ``n_samples``).
        n_samples: number of samples.
        straight_through: discrete forward value, relaxed gradient.
        initial_temperature: ``τ_0``.
        min_temperature: ``τ_min``.
        annealing_rate: ``r`` in ``τ_t = max(τ_min, τ_0 exp(−r t))``; 0 keeps the temperature fixed.

    Examples:
        >>> import torch
        >>> from torch.distributions import OneHotCategorical
        >>> z = GumbelSoftmax("z", n_samples=3, initial_temperature=0.5)(OneHotCategorical(logits=torch.zeros(4)))
        >>> z.shape, bool(torch.allclose(z._tensor.sum(-1), torch.ones(3)))
        (torch.Size([3, 4]), True)
    """

    reparameterized = True

    def __init__(
        self,
        plate_name: str,
        sampling_method: SamplingMethod | None = None,
        n_samples: int = DEFAULT_N_SAMPLES,
        straight_through: bool = False,
        initial_temperature: float = 1.0,
        min_temperature: float = 1e-4,
        annealing_rate: float = 0.0,
    ) -> None:
        super().__init__(plate_name, sampling_method, n_samples)
        self.init_temperature(
            f"{type(self).__name__}({plate_name!r})", initial_temperature, min_temperature, annealing_rate
        )
        self.straight_through = straight_through

    @property
    def relaxes_samples(self) -> bool:  # type: ignore[override]
        """Relaxed samples, unless ``straight_through`` (then the forward value is the discrete sample)."""
        return not self.straight_through

    def check_distribution(self, distr: Distribution) -> None:
        if relaxation_for(distr) is None:
            hint = " Use OneHotCategorical instead of Categorical." if type(distr).__name__ == "Categorical" else ""
            raise ValueError(
                f"GumbelSoftmax({self.plate_name!r}) has no relaxation for {type(distr).__name__}; "
                f"it supports OneHotCategorical and Bernoulli.{hint}"
            )

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        return rsample_gumbel_softmax(distr, amt_samples, self.temperature, self.straight_through)

    def update_parameters(self, result_triples) -> None:
        super().update_parameters(result_triples)
        self.anneal()

    #: the temperature schedule keeps no state outside its buffers, which `anneal` updates in place within
    #: the step (a compiled step replays that)
    step_state = StepState.IN_PLACE
