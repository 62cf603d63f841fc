"""Reparameterization (pathwise derivative). Kingma & Welling 2014; Rezende et al. 2014.

    ∇θ E_{p_θ}[f(x)] = E_ε[∇θ f(g_θ(ε))],   x = g_θ(ε) = ``rsample``

Components: n i.i.d. ``rsample`` draws, weight ``1/n``, no gradient function, no control variate.
"""

from __future__ import annotations

from torch.distributions import Distribution

from storch.method.method import DEFAULT_N_SAMPLES, Method
from storch.sampling.method import SamplingMethod

__all__ = ["Reparameterization"]


class Reparameterization(Method):
    """Pathwise gradients through ``rsample``.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> mu = torch.tensor(1.0, requires_grad=True)
        >>> x = Reparameterization("x", n_samples=4)(Normal(mu, 1.0))
        >>> x.shape, x.plates[0].name
        (torch.Size([4]), 'x')
    """

    reparameterized = True

    def __init__(
        self, plate_name: str, sampling_method: SamplingMethod | None = None, n_samples: int = DEFAULT_N_SAMPLES
    ) -> None:
        super().__init__(plate_name, sampling_method, n_samples)

    def check_distribution(self, distr: Distribution) -> None:
        if not distr.has_rsample:
            raise ValueError(
                f"Reparameterization({self.plate_name!r}): {type(distr).__name__} has no rsample (no "
                "reparameterization exists for it). Use ScoreFunction, Expect, Infer, or GumbelSoftmax "
                "for a relaxed discrete variable."
            )
