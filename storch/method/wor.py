"""REINFORCE without replacement (Kool, van Hoof & Welling 2019, ICML; Kool et al. 2019/2020).

Sample a set ``S`` of ``k`` distinct values (or sequences) by Gumbel-top-k / stochastic beam search
(:class:`storch.sampling.swor.SampleWithoutReplacement`), with ``κ`` the ``(k+1)``-th largest perturbed
log-probability and ``q_κ(s) = 1 − exp(−exp(log p(s) − κ))``:

    unbiased (``biased=False``):  ∇ E_p[f] ≈ Σ_{s∈S} p(s)/q_κ(s) · f(s) ∇log p(s)
    normalised (``biased=True``): ∇ E_p[f] ≈ Σ_{s∈S} p(s)/(q_κ(s) W) · (f(s) − B) ∇log p(s),
                                  W = Σ_{s∈S} p(s)/q_κ(s),  B = Σ_{s∈S} p(s)/(q_κ(s) W) · f(s)

Components: proposal Gumbel-top-k; weight ``p(s)/q_κ(s)`` (detached; divided by ``W`` when biased);
gradient function ``log p(s)``; control variate ``B`` (the built-in baseline, biased variant only).
The unbiased variant is unbiased for derivatives of every order (the weights are importance weights
that do not depend on the parameters being differentiated); the normalised one is consistent (its
bias vanishes as ``k`` grows, and it is exact once ``k`` covers the support) and has lower variance.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributions import Distribution

from storch.method.method import Method
from storch.plate import AncestralPlate, layout_of_plates
from storch.reduce import reduce_plate
from storch.sampling.swor import SampleWithoutReplacement, WORState, wor_support
from storch.tensor import CostTensor, StochasticNode, StochasticTensor, Tensor, _alias, _Disable, wrap_new
from storch.util import distribution_layout

__all__ = ["ScoreFunctionWOR"]


class ScoreFunctionWOR(Method):
    """The score function with samples without replacement and importance weights ``p(s)/q_κ(s)``.

    Args:
        plate_name: node / plate name.
        k: the number of distinct samples (beam size for sequences).
        biased: normalise the weights by their sum and subtract the built-in baseline (consistent,
            lower variance); ``False`` (default) keeps the unbiased, unnormalised weights.
        eos: the end-of-sequence value index, for sequences decoded step by step.
        sampling_method: a :class:`SampleWithoutReplacement` (or subclass) to use instead of the
            default one.

    Example:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> theta = torch.zeros(5, requires_grad=True)
        >>> z = ScoreFunctionWOR("z", k=3)(OneHotCategorical(logits=theta))
        >>> z.shape, int(z._tensor.sum(0).max())     # 3 distinct one-hot values
        (torch.Size([3, 5]), 1)
        >>> storch.add_cost((z * torch.arange(5.0)).sum(-1), "f")
        >>> _ = storch.backward()
        >>> theta.grad.shape
        torch.Size([5])
    """

    def __init__(
        self,
        plate_name: str,
        k: int,
        biased: bool = False,
        eos: Optional[int] = None,
        sampling_method: Optional[SampleWithoutReplacement] = None,
    ) -> None:
        if sampling_method is None:
            sampling_method = SampleWithoutReplacement(plate_name, k, normalize=biased, eos=eos)
        elif not isinstance(sampling_method, SampleWithoutReplacement):
            raise TypeError(
                f"ScoreFunctionWOR({plate_name!r}): sampling_method must be a SampleWithoutReplacement, "
                f"got {type(sampling_method).__name__}."
            )
        super().__init__(plate_name, sampling_method)
        self.k = int(k)
        self.biased = bool(biased)

    def check_distribution(self, distr: Distribution) -> None:
        wor_support(distr)  # raises a clear error for distributions without a finite support

    # ------------------------------------------------------------------ sampling
    def forward(self, distr: Distribution) -> StochasticTensor:
        if not isinstance(distr, Distribution):
            return super().forward(distr)  # raises the common error
        self.check_distribution(distr)
        parents = distribution_layout(distr)
        sampler: SampleWithoutReplacement = self.sampling_method  # type: ignore[assignment]
        if self.plate_name in parents.names:
            raise NotImplementedError("sequences: not yet")
        with _Disable():
            samples, state = sampler.draw(distr, len(parents.plates))
        self._check_samples(distr, samples, parents.sizes)
        plate = AncestralPlate(self.plate_name, samples.shape[0], parents=parents.plates, info=state)
        return self._make_node(distr, samples, plate, parents.plates)

    def _make_node(self, distr: Distribution, samples: torch.Tensor, plate: AncestralPlate, others: tuple) -> StochasticTensor:
        layout = layout_of_plates((plate,) + tuple(others))
        node = StochasticNode(self.plate_name, self, distr, samples, layout, plate)
        plate.node = node
        tensor = StochasticTensor._from_node(_alias(samples), node)
        plate.weight = self.sampling_method.weighting_function(tensor, plate)
        return tensor

    # ------------------------------------------------------------------ estimator
    def gradient_function(self, tensor: StochasticTensor) -> Optional[torch.Tensor]:
        """``log p(s)``: of the whole value (all variables), or of the prefix up to this step."""
        state: WORState = self.sampling_method.state_of(tensor)  # type: ignore[attr-defined]
        return wrap_new(_alias(state.log_prob), tensor._layout)

    def control_variate(self, tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        """The built-in baseline ``B = Σ_S w̄(s) f(s)`` (normalised weights), biased variant only."""
        if not self.biased:
            return None
        return reduce_plate(cost.detach(), tensor.plate, detach_weights=True)

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, k={self.k}, biased={self.biased}"
