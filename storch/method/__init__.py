"""Gradient-estimation methods (``storch.method``); see :class:`storch.method.Method`."""

from storch.method import baseline
from storch.method.expect import Expect
from storch.method.gumbel import GumbelSoftmax
from storch.method.infer import Infer
from storch.method.method import Method, log_prob
from storch.method.reparameterization import Reparameterization
from storch.method.score_function import ScoreFunction

__all__ = [
    "Method", "Reparameterization", "ScoreFunction", "Expect", "Infer", "GumbelSoftmax", "baseline",
    "log_prob",
]
