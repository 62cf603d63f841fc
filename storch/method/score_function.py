"""Score function (REINFORCE, likelihood ratio). Williams 1992; RLOO: Kool et al. 2019.

    ∇θ E_{p_θ}[f(x)] = E[(f(x) − b) ∇θ log p_θ(x)]

Components: n i.i.d. samples (no gradient through them), weight ``1/n``, gradient function
``l(x) = log p(x)`` (summed over event and non-plate batch dimensions), control variate ``a = b``, a
baseline (`storch.method.baseline`).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from storch.method.baseline import BaselineFactory, UpdatesItsBaseline, make_baseline
from storch.method.method import DEFAULT_N_SAMPLES, Method, log_prob, proposal_arguments
from storch.sampling.method import SamplingMethod
from storch.extend import CostTensor, PlateLayout, StochasticNode, StochasticTensor, stacked_log_prob

__all__ = ["ScoreFunction"]


class ScoreFunction(UpdatesItsBaseline, Method):
    """The score-function estimator, with an optional baseline.

    Args:
        plate_name: node / plate name.
        sampling_method: proposal (default: Monte Carlo with ``n_samples``).
        n_samples: number of samples.
        baseline_factory: ``None`` or ``"none"`` (no baseline, the default), ``"moving_average"``,
            ``"batch_average"`` (leave-one-out, needs ``n_samples >= 2``), ``"critic"`` (a learned
            value function of the node's non-descendants), ``"q_critic"`` (a learned Q-function with
            its exact expectation correction, discrete nodes; `storch.method.critic`), a
            `storch.method.baseline.Baseline`, or a zero-argument callable
            returning one.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> p = torch.tensor(0.3, requires_grad=True)
        >>> x = ScoreFunction("x", n_samples=100, baseline_factory="batch_average")(Bernoulli(p))
        >>> storch.add_cost(x, "f")
        >>> _ = storch.backward()
        >>> p.grad is not None
        True
    """

    def __init__(
        self,
        plate_name: str,
        sampling_method: SamplingMethod | None = None,
        n_samples: int = DEFAULT_N_SAMPLES,
        baseline_factory: BaselineFactory = None,
    ) -> None:
        sampling_method, n_samples = proposal_arguments(
            f"{type(self).__name__}({plate_name!r})", sampling_method, n_samples
        )
        super().__init__(plate_name, sampling_method, n_samples)
        self.baseline = make_baseline(baseline_factory)
        if self.baseline is not None and sampling_method is None:
            self.baseline.check_samples(n_samples, plate_name)

    def gradient_function(self, tensor: StochasticTensor) -> Optional[torch.Tensor]:
        return log_prob(tensor)

    def control_variate(self, tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        if self.baseline is None:
            return None
        return self.baseline.compute_baseline(tensor, cost)

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``l = log p(x)`` and ``(1 − □(l)) · b``, plus the baseline's correction term if it has one."""
        l, cv = super().estimator(tensor, cost)  # noqa: E741
        if l is not None and self.baseline is not None:
            correction = self.baseline.correction(tensor, cost)
            if correction is not None:
                cv = correction if cv is None else cv + correction
        return l, cv

    def vectorises_chain(self, plates: PlateLayout) -> bool:
        """A chain of this method's nodes is formed at once (`storch._chain_terms`) unless a subclass
        changes the estimator or reads the triples, or the baseline cannot give every step's baseline
        at once (a critic, a baseline with a correction)."""
        return _keeps_estimator(type(self)) and (self.baseline is None or self.baseline.vectorises_chain(plates))

    def chain_gradient_functions(
        self, nodes: Sequence[StochasticNode], plates: PlateLayout
    ) -> Optional[torch.Tensor]:
        """``log p_t(x_t)`` of every step from the steps' parameters stacked, where the distributions allow
        it (`storch._stacked_log_prob.stacked_log_prob`): the same values as `gradient_function` per step."""
        return stacked_log_prob(nodes, plates) if len(nodes) > 1 else None

    def chain_control_variates(
        self, names: Sequence[str], to_go: torch.Tensor, plates: PlateLayout
    ) -> Optional[torch.Tensor]:
        """The baselines of the chain's steps (``None`` without a baseline)."""
        return None if self.baseline is None else self.baseline.chain_baselines(names, to_go, plates)


#: what `ScoreFunction.vectorises_chain` requires a subclass to leave as it is
_ESTIMATOR_PARTS = ("gradient_function", "control_variate", "estimator", "update_parameters")


@functools.lru_cache(maxsize=64)
def _keeps_estimator(cls: type) -> bool:
    """Whether ``cls`` leaves `_ESTIMATOR_PARTS` as `ScoreFunction` has them (looked up once per class)."""
    return all(getattr(cls, name) is getattr(ScoreFunction, name) for name in _ESTIMATOR_PARTS)
