"""Sampling methods: the *proposal* component of a gradient estimator.

A :class:`SamplingMethod` turns a distribution into a set of samples (the node's plate) and, through
:meth:`SamplingMethod.weighting_function`, gives each sample its weight in the surrogate loss
(``1/n`` for Monte Carlo, ``p(x)`` for enumeration, importance weights for other proposals).

Samples are plain tensors with the new sample dimension first, followed by the plates of the
distribution's parameters, its remaining batch dimensions and its event dimensions. The calling
:class:`storch.method.Method` wraps them into a :class:`storch.StochasticTensor`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributions import Distribution

from storch.plate import Plate

if TYPE_CHECKING:  # pragma: no cover
    from storch.tensor import StochasticTensor

__all__ = ["SamplingMethod", "MonteCarlo"]

SampleFn = Callable[[Distribution, Sequence[Plate], int], torch.Tensor]
WeightFn = Callable[["StochasticTensor", Plate], Optional[torch.Tensor]]


class SamplingMethod(nn.Module, ABC):
    """Base class of proposals. Subclasses implement :meth:`sample`.

    Hooks:
        * :meth:`sample` — draw the sample set;
        * :meth:`weighting_function` — weight of each sample (``None``: uniform ``1/n``);
        * :meth:`set_mc_sample`, :meth:`set_mc_weighting_function` — let a gradient estimator
          replace how plain Monte Carlo samples are drawn or weighted (e.g. ``rsample`` instead of
          ``sample``), so estimators and proposals combine freely;
        * :meth:`update_parameters` — called once after every :func:`storch.backward`;
        * :meth:`reset` — forget any state.
    """

    def __init__(self, plate_name: str) -> None:
        super().__init__()
        self.plate_name = plate_name
        self.mc_sample: SampleFn | None = None
        self.mc_weighting_function: WeightFn | None = None

    def forward(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        return self.sample(distr, plates, requires_grad)

    @abstractmethod
    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        """Draw the sample set: a plain tensor ``(n, *distr.batch_shape, *distr.event_shape)``.

        Args:
            distr: the distribution (called with storch dispatch disabled: parameters are plain).
            plates: the plates of the distribution's parameters (the leading batch dimensions).
            requires_grad: whether the estimator needs pathwise (reparameterised) samples.
        """

    def weighting_function(self, tensor: "StochasticTensor", plate: Plate) -> Optional[torch.Tensor]:
        """Weight of each sample in ``tensor``'s plate, or ``None`` for i.i.d. samples (``1/n``).

        A returned tensor is either a scalar, a vector over the plate, or a storch tensor whose
        plates include ``plate``.
        """
        if self.mc_weighting_function is not None:
            return self.mc_weighting_function(tensor, plate)
        return None

    def set_mc_sample(self, new_sample_func: SampleFn) -> "SamplingMethod":
        """Replace how Monte Carlo samples are drawn: ``fn(distr, plates, amt_samples) -> samples``."""
        self.mc_sample = new_sample_func
        return self

    def set_mc_weighting_function(self, new_weighting_func: WeightFn) -> "SamplingMethod":
        """Replace how Monte Carlo samples are weighted: ``fn(tensor, plate) -> weights | None``."""
        self.mc_weighting_function = new_weighting_func
        return self

    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        """Called after each :func:`storch.backward` with ``(node, cost, contribution)`` triples."""

    def reset(self) -> None:
        """Forget any state kept between samples."""


class MonteCarlo(SamplingMethod):
    """``n`` independent samples, each with weight ``1/n``.

    Example:
        >>> import torch
        >>> from torch.distributions import Normal
        >>> MonteCarlo("z", 4).sample(Normal(torch.zeros(3), 1.0), (), False).shape
        torch.Size([4, 3])
    """

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name)
        if int(n_samples) < 1:
            raise ValueError(f"MonteCarlo({plate_name!r}): n_samples must be at least 1, got {n_samples}.")
        self.n_samples = int(n_samples)

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        if self.mc_sample is not None:
            return self.mc_sample(distr, plates, self.n_samples)
        if requires_grad:
            return distr.rsample((self.n_samples,))
        return distr.sample((self.n_samples,))
