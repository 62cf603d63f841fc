"""Sampling methods (``storch.sampling``): the proposal component of an estimator."""

from storch.sampling.expect import Enumerate
from storch.sampling.method import MonteCarlo, SamplingMethod

__all__ = ["SamplingMethod", "MonteCarlo", "Enumerate"]
