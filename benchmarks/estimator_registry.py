"""The estimators compared by ``estimator_variance.py``: one :class:`Entry` per table row.

Adding an estimator is one entry: a label, the module and class it comes from, a factory
``make(cls, plate_name, n)`` that builds the method with ``n`` samples (groups), and the rule that
says how many cost evaluations one sample costs (its *evaluation-group size*, see
:mod:`storch.method.groups`): the node's plate has ``n · evals_per_sample`` positions, one cost
evaluation each. The rule is a hint: the benchmark measures the real plate size and chooses the
largest ``n`` whose plate fits the budget.

An entry whose module or class cannot be imported is *missing*: the benchmark prints it, with the
import error, under the tables (never drops it silently).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

__all__ = ["Entry", "ESTIMATORS", "ProblemShape", "load"]


@dataclass(frozen=True)
class ProblemShape:
    """What an evaluation rule may need to know about a problem's stochastic node."""

    name: str  # "bernoulli" or "vae"
    variables: int  # independent discrete variables per datum (4 Bernoullis; L categoricals)
    categories: int  # values per variable (2 for Bernoulli; K)
    support: int  # joint configurations per datum (2^4; K^L)


EvalRule = Union[int, Callable[[ProblemShape], int]]


@dataclass(frozen=True)
class Entry:
    """One row of the table.

    Args:
        label: the row label.
        module: import path of the module that defines the estimator.
        attr: the class (or factory) in ``module``.
        make: ``make(cls, plate_name, n) -> Method`` with ``n`` samples (or groups).
        evals_per_sample: cost evaluations per sample: an int or ``rule(problem_shape) -> int``.
        min_samples: the smallest ``n`` the method accepts (2 for leave-one-out baselines).
        exact: evaluations are fixed (enumeration): ``n`` is ignored, the budget does not apply.
        warmup: backward passes before measuring (stateful baselines, learned control variates).
        problems: the problems the estimator applies to.
        note: shown under the table.
    """

    label: str
    module: str
    attr: str
    make: Callable[[Any, str, int], Any]
    evals_per_sample: EvalRule = 1
    min_samples: int = 1
    exact: bool = False
    warmup: int = 0
    problems: tuple[str, ...] = ("bernoulli", "vae")
    note: str = ""

    def evals(self, shape: ProblemShape) -> int:
        rule = self.evals_per_sample
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


ESTIMATORS: list[Entry] = [
    # ------------------------------------------------------------------ core estimators
    Entry("ScoreFunction", "storch.method.score_function", "ScoreFunction",
          lambda cls, name, n: cls(name, n_samples=n)),
    Entry("ScoreFunction + moving_average", "storch.method.score_function", "ScoreFunction",
          lambda cls, name, n: cls(name, n_samples=n, baseline_factory="moving_average"), warmup=20),
    Entry("ScoreFunction + batch_average (RLOO)", "storch.method.score_function", "ScoreFunction",
          lambda cls, name, n: cls(name, n_samples=n, baseline_factory="batch_average"), min_samples=2),
    Entry("GumbelSoftmax (tau=1)", "storch.method.gumbel", "GumbelSoftmax",
          lambda cls, name, n: cls(name, n_samples=n)),
    Entry("GumbelSoftmax straight-through", "storch.method.gumbel", "GumbelSoftmax",
          lambda cls, name, n: cls(name, n_samples=n, straight_through=True)),
    Entry("Expect (enumeration)", "storch.method.expect", "Expect",
          lambda cls, name, n: cls(name), evals_per_sample=_support, exact=True),
]
