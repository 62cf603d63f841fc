"""Sampling methods (``storch.sampling``): the proposal component of an estimator."""

from storch.sampling.decoding import MCDecoder
from storch.sampling.expect import Enumerate
from storch.sampling.importance import ImportanceSampling
from storch.sampling.method import MonteCarlo, SamplingMethod
from storch.sampling.swor import SampleWithoutReplacement, SequenceSampler
from storch.sampling.unordered import GumbelSoftmaxWOR, UnorderedSet

__all__ = [
    "SamplingMethod", "MonteCarlo", "Enumerate", "ImportanceSampling", "SampleWithoutReplacement",
    "SequenceSampler", "MCDecoder", "UnorderedSet", "GumbelSoftmaxWOR",
]
