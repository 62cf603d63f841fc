"""Gradient-estimation methods (``storch.method``); see `storch.method.Method`.

One family per module: pathwise (`storch.method.reparameterization`), score function and
baselines (`storch.method.score_function`, `storch.method.baseline`), enumeration
(`storch.method.expect`), relaxations (`storch.method.gumbel`, `storch.method.gumbel_sparse`,
`storch.method.straight_through`), antithetic pairs (`storch.method.arm`),
measure-valued derivatives (`storch.method.mvd`), finite differences
(`storch.method.spsa`), learned control variates (`storch.method.relax`), local expectations
(`storch.method.local_expectation`),
generalized stochastic backpropagation (`storch.method.gsb`, cumulants in
`storch.method.cumulants`), sampling without replacement
(`storch.method.score_function_wor`, `storch.method.unordered_set`),
Rao-Blackwellisation
(`storch.method.rao_blackwell`), memory-augmented policy optimization (`storch.method.mapo`)
and multi-sample bounds (`storch.method.vimco`). `storch.method.auto.Auto` chooses among the
catalog's estimators (`storch.method.catalog`) by their measured efficiency.
"""

from storch.method import baseline, critic, cumulants
from storch.method.arm import ARM, DisARM
from storch.method.arms import ARMS, ARMSMultiSample
from storch.method.arsm import ARSM
from storch.method.auto import Auto
from storch.method.carms import CARMS
from storch.method.coupled_categorical import CoupledCategorical, CoupledCategoricalIW
from storch.method.double_control_variate import DoubleControlVariate
from storch.method.critic import Critic, QCritic
from storch.method.expect import Expect
from storch.method.gapped_straight_through import GappedStraightThrough
from storch.method.gsb import GSB, GeneralizedStochasticBackprop
from storch.method.gumbel import GumbelSoftmax
from storch.method.gumbel_sparse import GumbelEntmax, GumbelSparseMax
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
    "GumbelSparseMax", "GumbelEntmax",
    "ARMS", "ARMSMultiSample", "DoubleControlVariate", "GappedStraightThrough",
    "CoupledCategorical", "CoupledCategoricalIW", "ARSM", "CARMS",
    "Auto",
]
