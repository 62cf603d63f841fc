"""Sampling methods (``storch.sampling``): the proposal component of an estimator.

`storch.sampling.seq` gives the manual's module path to classes defined in
`storch.sampling.swor`, `storch.sampling.decoding` and
`storch.plate`;
`storch.sampling.unordered_set` is both the manual's path and the home of unordered
sets.
"""

from storch.sampling.decoding import MCDecoder
from storch.sampling.expect import Enumerate
from storch.sampling.importance import ImportanceSampling
from storch.sampling.method import MonteCarlo, SamplingMethod
from storch.sampling.swor import SampleWithoutReplacement, SequenceSampler
from storch.sampling.unordered_set import GumbelSoftmaxWOR, UnorderedSet
from storch.sampling import seq, unordered_set  # the manual's module paths

__all__ = [
    "SamplingMethod", "MonteCarlo", "Enumerate", "ImportanceSampling", "SampleWithoutReplacement",
    "SequenceSampler", "MCDecoder", "UnorderedSet", "GumbelSoftmaxWOR",
]
