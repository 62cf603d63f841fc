"""Distributions that ``torch.distributions`` lacks (used by storch's estimators)."""

from storch.distributions.dirac import Dirac

__all__ = ["Dirac"]
