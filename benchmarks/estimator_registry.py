"""The estimators compared by ``estimator_variance.py``: one :class:`Entry` per table row.

Adding an estimator is one entry: a label, the module and class it comes from, a factory
``make(cls, plate_name, n, problem_shape)`` that builds the method with ``n`` samples (groups), and the rule that
says how many cost evaluations one sample costs (its *evaluation-group size*, see
:mod:`storch.method.groups`): the node's plate has ``n · evals_per_sample`` positions, one cost
evaluation each. The rule is a hint: the benchmark measures the real plate size and chooses the
largest ``n`` whose plate fits the budget.

An entry whose module or class cannot be imported is *missing*: the benchmark prints it, with the
import error, under the tables (never drops it silently).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

__all__ = ["Entry", "ESTIMATORS", "ProblemShape", "load"]


@dataclass(frozen=True)
class ProblemShape:
    """What an evaluation rule may need to know about a problem's stochastic node."""

    name: str  # "bernoulli" or "vae"
    variables: int  # independent discrete variables per datum (4 Bernoullis; L categoricals)
    categories: int  # values per variable (2 for Bernoulli; K)
    support: int  # joint configurations per datum (2^4; K^L)
    sample_shape: tuple[int, ...] = ()  # the node's non-plate sample dimensions: (4,) on the toy, (L, K) on the VAE


EvalRule = Union[int, Callable[[ProblemShape], int]]


@dataclass(frozen=True)
class Entry:
    """One row of the table.

    Args:
        label: the row label.
        module: import path of the module that defines the estimator.
        attr: the class (or factory) in ``module``.
        make: ``make(cls, plate_name, n, problem_shape) -> Method`` with ``n`` samples (or groups).
        evals_per_sample: cost evaluations per sample: an int or ``rule(problem_shape) -> int``.
        min_samples: the smallest ``n`` the method accepts (2 for leave-one-out baselines).
        max_samples: the largest ``n`` (e.g. the support size for sampling without replacement).
        exact: evaluations are fixed (enumeration): ``n`` is ignored, the budget does not apply.
        warmup: backward passes before measuring (stateful baselines, learned control variates).
        joint: sample the node as one categorical over its joint support (for methods that handle
            one discrete variable per node); the same distribution, so the same exact gradient.
        memory_per_sample: ``size -> units`` of memory per datum and replicate, in cost evaluations
            (default: the plate size); bounds how many replicates go into one backward pass.
        problems: the problems the estimator applies to; on the others its row says ``n/a`` and
            ``scope``.
        note: shown with the tables.
    """

    label: str
    module: str
    attr: str
    make: Callable[[Any, str, int, ProblemShape], Any]
    evals_per_sample: EvalRule = 1
    min_samples: int = 1
    max_samples: Optional[EvalRule] = None
    exact: bool = False
    warmup: int = 0
    joint: bool = False
    memory_per_sample: Optional[Callable[[int], int]] = None
    problems: tuple[str, ...] = ("bernoulli", "vae")
    scope: str = ""
    note: str = ""

    def evals(self, shape: ProblemShape) -> int:
        rule = self.evals_per_sample
        return rule(shape) if callable(rule) else int(rule)

    def most_samples(self, shape: ProblemShape) -> Optional[int]:
        rule = self.max_samples
        if rule is None:
            return None
        return rule(shape) if callable(rule) else int(rule)

    @property
    def source(self) -> str:
        return f"{self.module}.{self.attr}"


def load(entry: Entry) -> tuple[Optional[Any], Optional[str]]:
    """``(class, None)`` if the entry's estimator is importable, else ``(None, reason)``."""
    try:
        module = importlib.import_module(entry.module)
    except Exception as e:  # noqa: BLE001 -- any import failure means "not available yet"
        return None, f"{type(e).__name__}: {e}"
    if not hasattr(module, entry.attr):
        return None, f"{entry.module} has no attribute {entry.attr!r}"
    return getattr(module, entry.attr), None


def _support(shape: ProblemShape) -> int:
    return shape.support


def _quadratic(size: int) -> int:
    """The leave-one-out ratios of the unordered set estimator take memory ~ k² per datum (or more)."""
    return 4 * size * size


def _score_function() -> Any:
    from storch.method.score_function import ScoreFunction

    return ScoreFunction


class _ControlVariateNet(torch.nn.Module):
    """``c_φ`` for RELAX: the sample's non-plate dimensions flattened, 32 tanh units, one output."""

    def __init__(self, shape: ProblemShape, hidden: int = 32) -> None:
        super().__init__()
        self.event_dims = len(shape.sample_shape)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(math.prod(shape.sample_shape), hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[: x.dim() - self.event_dims] + (-1,)))


def _tempered(p: Any) -> Any:
    """The proposal ``r ∝ p^(1/2)``: the same distribution type with halved logits."""
    return type(p)(logits=p.logits / 2)


ESTIMATORS: list[Entry] = [
    # ------------------------------------------------------------------ core estimators
    Entry("ScoreFunction", "storch.method.score_function", "ScoreFunction",
          lambda cls, name, n, s: cls(name, n_samples=n)),
    Entry("ScoreFunction + moving_average", "storch.method.score_function", "ScoreFunction",
          lambda cls, name, n, s: cls(name, n_samples=n, baseline_factory="moving_average"), warmup=20),
    Entry("ScoreFunction + batch_average (RLOO)", "storch.method.score_function", "ScoreFunction",
          lambda cls, name, n, s: cls(name, n_samples=n, baseline_factory="batch_average"), min_samples=2),
    Entry("GumbelSoftmax (tau=1)", "storch.method.gumbel", "GumbelSoftmax",
          lambda cls, name, n, s: cls(name, n_samples=n)),
    Entry("GumbelSoftmax straight-through", "storch.method.gumbel", "GumbelSoftmax",
          lambda cls, name, n, s: cls(name, n_samples=n, straight_through=True)),
    Entry("Expect (enumeration)", "storch.method.expect", "Expect",
          lambda cls, name, n, s: cls(name), evals_per_sample=_support, exact=True),
    # ------------------------------------------------------------------ the catalog (issue 3)
    Entry("ImportanceSampling r=p^(1/2) + RLOO", "storch.sampling.importance", "ImportanceSampling",
          lambda cls, name, n, s: _score_function()(
              name, sampling_method=cls(name, n, _tempered), baseline_factory="batch_average"),
          min_samples=2,
          note="ScoreFunction with batch_average whose samples come from the tempered proposal "
               "r ∝ p^(1/2) (logits / 2), weights p/(n r); on the toy (logits 0) r = p"),
    Entry("RaoBlackwellSF (k-1 summed + 1 sampled)", "storch.method.rao_blackwell", "RaoBlackwellSF",
          lambda cls, name, n, s: cls(name, k=min(n, s.support), n_sampled=n - min(n, s.support) + 1),
          joint=True,
          note="handles one discrete variable per node: run on the node seen as one categorical over "
               "its joint support (16 values on the toy, 100 per datum on the VAE); the budget B sums "
               "the B-1 most probable values and samples 1 of the rest"),
    Entry("ScoreFunctionWOR (unbiased)", "storch.method.score_function_wor", "ScoreFunctionWOR",
          lambda cls, name, n, s: cls(name, k=n), max_samples=_support),
    Entry("ScoreFunctionWOR (normalised, biased)", "storch.method.score_function_wor", "ScoreFunctionWOR",
          lambda cls, name, n, s: cls(name, k=n, biased=True), max_samples=_support, min_samples=2),
    Entry("LocalExpectation (= IndeCateR)", "storch.method.local_expectation", "LocalExpectation",
          lambda cls, name, n, s: cls(name, n_samples=n), evals_per_sample=lambda s: 1 + s.variables * s.categories),
    Entry("ARM", "storch.method.arm", "ARM", lambda cls, name, n, s: cls(name, n_samples=n), evals_per_sample=2,
          problems=("bernoulli",), scope="Bernoulli nodes only"),
    Entry("DisARM", "storch.method.arm", "DisARM", lambda cls, name, n, s: cls(name, n_samples=n),
          evals_per_sample=2, problems=("bernoulli",), scope="Bernoulli nodes only"),
    Entry("StraightThrough", "storch.method.straight_through", "StraightThrough",
          lambda cls, name, n, s: cls(name, n_samples=n)),
    Entry("GumbelRao (tau=1, 10 relaxed)", "storch.method.straight_through", "GumbelRao",
          lambda cls, name, n, s: cls(name, n_samples=n)),
    Entry("ReinMax (tau=1)", "storch.method.straight_through", "ReinMax",
          lambda cls, name, n, s: cls(name, n_samples=n)),
    Entry("VIMCO", "storch.method.vimco", "VIMCO",
          lambda cls, name, n, s: cls(name, n_samples=n), min_samples=2, problems=("bernoulli", "vae", "iwae"),
          note="VIMCO is for multi-sample bounds (iwae_bound, problem (c)); on the plain costs of (a) and (b) "
               "it is, by its docstring, the per-sample score function with a leave-one-out baseline"),
    Entry("VIMCO (baseline=False: joint score function)", "storch.method.vimco", "VIMCO",
          lambda cls, name, n, s: cls(name, n_samples=n, baseline=False), problems=("iwae",)),
    Entry("MVD", "storch.method.mvd", "MVD", lambda cls, name, n, s: cls(name, n_samples=n),
          evals_per_sample=lambda s: 1 + s.variables * (s.categories - 1)),
    Entry("SPSA", "storch.method.spsa", "SPSA", lambda cls, name, n, s: cls(name, n_samples=n), evals_per_sample=3),
    Entry("REBAR", "storch.method.relax", "REBAR", lambda cls, name, n, s: cls(name, n_samples=n),
          evals_per_sample=3, warmup=100,
          note="REBAR, RELAX: measured after 100 backward passes (one step of the control variate's "
               "optimiser each, Adam lr 1e-3) on the problem; the control variate keeps training "
               "during the measurement"),
    Entry("RELAX (c_phi MLP)", "storch.method.relax", "RELAX",
          lambda cls, name, n, s: cls(name, control_variate=_ControlVariateNet(s), n_samples=n), warmup=100,
          note="c_phi: an MLP (flattened sample -> 32 tanh -> 1) on the relaxed sample"),
    Entry("RELAX (c_phi MLP + REBAR term)", "storch.method.relax", "RELAX",
          lambda cls, name, n, s: cls(name, control_variate=_ControlVariateNet(s), n_samples=n, rebar=True),
          evals_per_sample=3, warmup=100),
    Entry("LAX", "storch.method.relax", "LAX", lambda cls, name, n, s: cls(name, _ControlVariateNet(s), n_samples=n),
          problems=(), scope="continuous distributions with rsample only (both problems are discrete)"),
    Entry("UnorderedSetEstimator", "storch.method.unordered_set", "UnorderedSetEstimator",
          lambda cls, name, n, s: cls(name, k=n), max_samples=_support, memory_per_sample=_quadratic),
    Entry("UnorderedSetGumbelSoftmax", "storch.method.unordered_set", "UnorderedSetGumbelSoftmax",
          lambda cls, name, n, s: cls(name, k=n), max_samples=_support, joint=True, memory_per_sample=_quadratic,
          note="relaxes one variable per node: run on the node seen as one categorical over its joint "
               "support"),
]
