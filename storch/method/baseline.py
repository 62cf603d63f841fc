"""Baselines: control variates ``a(x)`` for score-function estimators.

A baseline that does not depend on the sample it multiplies keeps the estimator unbiased, for
derivatives of every order, through the term ``(1 − □(l(x))) · a(x)`` (Storchastic §3.5).

* :class:`MovingAverageBaseline` — ``b ← β b + (1 − β) mean(f)``, updated *after* each backward
  pass, so the value used for a batch never depends on that batch (Williams 1992).
* :class:`BatchAverageBaseline` — leave-one-out: ``b_j = Σ_{m≠j} f_m / (n − 1)``, needs ``n ≥ 2``
  (Mnih & Rezende 2016; Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Union

import torch
from torch import nn

from storch.reduce import reduce_plates
from storch.reduce import sum as plate_sum
from storch.tensor import CostTensor, StochasticTensor, plain

__all__ = ["Baseline", "MovingAverageBaseline", "BatchAverageBaseline", "make_baseline", "BaselineFactory"]


class Baseline(nn.Module, ABC):
    """A control variate for the score function, computed per registered cost."""

    @abstractmethod
    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        """The baseline for ``cost_node`` (the downstream cost estimate, one value per sample)."""

    def check_samples(self, n_samples: int, plate_name: str) -> None:
        """Raise if this baseline cannot work with ``n_samples`` samples."""

    def update(self) -> None:
        """Called once after each backward pass."""


class MovingAverageBaseline(Baseline):
    """Exponential moving average of the cost, one per registered cost name.

    Example:
        >>> b = MovingAverageBaseline(exponential_decay=0.9)
        >>> b.exponential_decay
        0.9
    """

    def __init__(self, exponential_decay: float = 0.95) -> None:
        super().__init__()
        if not 0.0 <= exponential_decay < 1.0:
            raise ValueError(f"exponential_decay must be in [0, 1), got {exponential_decay}.")
        self.exponential_decay = exponential_decay
        self.averages: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        name = cost_node.name
        mean = plain(reduce_plates(cost_node.detach()))
        self._pending[name] = mean
        return self.averages.get(name, mean.new_zeros(()))

    def update(self) -> None:
        """Fold the costs of the last step into the averages; a NaN or infinite mean is skipped.

        (:func:`storch.backward` refuses non-finite costs before this runs; the guard also covers
        a surrogate differentiated by hand.) No value is read back, so this never syncs a GPU.
        """
        beta = self.exponential_decay
        for name, mean in self._pending.items():
            old = self.averages.get(name)
            finite = torch.isfinite(mean)
            if old is None:
                self.averages[name] = torch.where(finite, mean, torch.zeros_like(mean))
            else:
                self.averages[name] = torch.where(finite, beta * old + (1 - beta) * mean, old)
        self._pending.clear()


class BatchAverageBaseline(Baseline):
    """Leave-one-out average of the other samples' costs (RLOO); needs at least two samples.

    Examples:
        >>> BatchAverageBaseline().check_samples(1, "z")
        Traceback (most recent call last):
        ...
        ValueError: The batch_average baseline of node 'z' averages the other samples' costs and needs at least 2 samples; got n_samples=1. Use n_samples >= 2, or baseline_factory='moving_average'.
    """

    def check_samples(self, n_samples: int, plate_name: str) -> None:
        if n_samples < 2:
            raise ValueError(
                f"The batch_average baseline of node {plate_name!r} averages the other samples' costs "
                f"and needs at least 2 samples; got n_samples={n_samples}. Use n_samples >= 2, or "
                "baseline_factory='moving_average'."
            )

    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        n = tensor.n
        self.check_samples(n, tensor.name)
        costs = cost_node.detach()
        return (plate_sum(costs, tensor.plate) - costs) / (n - 1)


BaselineFactory = Union[None, str, Baseline, Callable[[], Baseline]]
_BY_NAME: dict[str, Callable[[], Baseline]] = {
    "moving_average": MovingAverageBaseline,
    "batch_average": BatchAverageBaseline,
}


def make_baseline(factory: BaselineFactory) -> Baseline | None:
    """Build a baseline from ``None``/``"none"``, a name, a :class:`Baseline`, or a zero-argument factory."""
    if factory is None or (isinstance(factory, str) and factory.lower() == "none"):
        return None
    if isinstance(factory, str):
        if factory not in _BY_NAME:
            raise ValueError(
                f"Unknown baseline {factory!r}; choose one of None, 'none', "
                f"{', '.join(repr(k) for k in _BY_NAME)}, a Baseline, or a callable returning one."
            )
        return _BY_NAME[factory]()
    if isinstance(factory, Baseline):
        return factory
    if callable(factory):
        baseline = factory()
        if not isinstance(baseline, Baseline):
            raise TypeError(f"baseline_factory returned {type(baseline).__name__}, not a storch Baseline.")
        return baseline
    raise TypeError(f"baseline_factory must be None, a string, a Baseline or a callable, got {factory!r}.")
