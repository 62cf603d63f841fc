"""The Dirac (point mass) distribution ``δ_a``: every sample equals ``a``.

Generalized stochastic backpropagation treats a deterministic value as a distribution whose only
non-zero cumulant is ``κ₁ = a``; its estimator is then plain backpropagation (``seeds/004_…``, §4).
"""

from __future__ import annotations

import torch
from torch.distributions import Distribution, constraints

__all__ = ["Dirac"]


class Dirac(Distribution):
    """Point mass at ``value`` (batch shape ``value.shape``, no event dimensions).

    ``sample`` returns ``value`` detached, ``rsample`` returns it with its graph; ``log_prob`` is
    ``0`` at ``value`` and ``−inf`` elsewhere. Mean ``value``, variance ``0``.

    Args:
        value: the location ``a`` of the point mass.

    Examples:
        >>> import torch
        >>> d = Dirac(torch.tensor([1.0, -2.0]))
        >>> d.sample((3,)).shape, d.log_prob(torch.tensor([1.0, 0.0])).tolist()
        (torch.Size([3, 2]), [0.0, -inf])
    """

    arg_constraints = {"value": constraints.real}
    support = constraints.real
    has_rsample = True

    def __init__(self, value: torch.Tensor, validate_args: bool | None = None) -> None:
        self.value = torch.as_tensor(value, dtype=torch.get_default_dtype()) if not torch.is_tensor(value) else value
        super().__init__(batch_shape=self.value.shape, validate_args=validate_args)

    def expand(self, batch_shape: torch.Size, _instance: "Dirac | None" = None) -> "Dirac":
        new = self._get_checked_instance(Dirac, _instance)
        new.value = self.value.expand(batch_shape)
        super(Dirac, new).__init__(torch.Size(batch_shape), validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> torch.Tensor:
        return self.value

    @property
    def mode(self) -> torch.Tensor:
        return self.value

    @property
    def variance(self) -> torch.Tensor:
        return torch.zeros_like(self.value)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        return self.value.expand(self._extended_shape(sample_shape))

    def sample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        with torch.no_grad():
            return self.rsample(sample_shape).clone()

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        zero = torch.zeros((), dtype=self.value.dtype, device=self.value.device)
        return torch.where(value == self.value, zero, zero - float("inf"))

    def entropy(self) -> torch.Tensor:
        return torch.zeros_like(self.value)
