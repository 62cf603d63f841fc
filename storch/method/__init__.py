"""Gradient-estimation methods (``storch.method``); see :class:`storch.method.Method`.

One family per module: pathwise (:mod:`~storch.method.reparameterization`), score function and
baselines (:mod:`~storch.method.score_function`, :mod:`~storch.method.baseline`), enumeration
(:mod:`~storch.method.expect`), relaxations (:mod:`~storch.method.gumbel`,
:mod:`~storch.method.straight_through`), antithetic pairs (:mod:`~storch.method.arm`),
measure-valued derivatives (:mod:`~storch.method.mvd`), finite differences
(:mod:`~storch.method.spsa`), learned control variates (:mod:`~storch.method.relax`), local expectations (:mod:`~storch.method.local_expectation`),
generalized stochastic backpropagation (:mod:`~storch.method.gsb`, cumulants in
:mod:`~storch.method.cumulants`), sampling without replacement (:mod:`~storch.method.score_function_wor`, :mod:`~storch.method.unordered_set`), Rao-Blackwellisation
(:mod:`~storch.method.rao_blackwell`), memory-augmented policy optimization (:mod:`~storch.method.mapo`) and multi-sample bounds (:mod:`~storch.method.vimco`).
"""

from storch.method import baseline, critic, cumulants
from storch.method.arm import ARM, DisARM
from storch.method.critic import Critic, QCritic
from storch.method.expect import Expect
from storch.method.gsb import GSB, GeneralizedStochasticBackprop
from storch.method.gumbel import GumbelSoftmax
from storch.method.infer import Infer
from storch.method.local_expectation import IndeCateR, LocalExpectation
from storch.method.mapo import MAPO
from storch.method.method import Method, log_prob
from storch.method.mvd import MVD
from storch.method.rao_blackwell import RaoBlackwellSF
from storch.method.relax import LAX, REBAR, RELAX
from storch.method.reparameterization import Reparameterization
from storch.method.score_function import ScoreFunction
from storch.method.score_function_wor import ScoreFunctionWOR
from storch.method.spsa import SPSA
from storch.method.straight_through import GumbelRao, ReinMax, StraightThrough
from storch.method.unordered_set import UnorderedSetEstimator, UnorderedSetGumbelSoftmax
from storch.method.vimco import VIMCO, iwae_bound

__all__ = [
    "Method", "Reparameterization", "ScoreFunction", "Expect", "Infer", "GumbelSoftmax", "baseline",
    "log_prob", "ARM", "DisARM", "MVD", "SPSA", "LocalExpectation", "IndeCateR", "StraightThrough",
    "GumbelRao", "ReinMax", "VIMCO", "iwae_bound", "ScoreFunctionWOR", "RaoBlackwellSF",
    "LAX", "RELAX", "REBAR", "UnorderedSetEstimator", "UnorderedSetGumbelSoftmax",
    "GSB", "GeneralizedStochasticBackprop", "cumulants",
    "critic", "Critic", "QCritic",
    "MAPO",
]
