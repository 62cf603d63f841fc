"""Straight-through estimators (biased): a hard sample forward, a surrogate Jacobian backward.

Every estimator here returns the discrete one-hot sample ``D ~ Cat(π)``, ``π = softmax(θ)``, in the
forward pass and ``D + g − stopgrad(g)`` for some differentiable ``g(θ)``, so that the gradient of
``f(D)`` is ``(∂g/∂θ)ᵀ ∇f(D)``: the cost's gradient at the discrete sample, pushed back through ``g``.

* `storch.method.straight_through.StraightThrough` (Bengio et al. 2013, "Estimating or propagating
  gradients through stochastic neurons"): ``g = π``. Exact for costs linear in the one-hot sample.
* `storch.method.straight_through.GumbelRao` (Paulus et al. 2021, "Rao-Blackwellizing the
  straight-through Gumbel-softmax gradient estimator"): ``g = (1/K) Σ_k softmax(z̃_k/τ)`` with
  ``z̃_k ~ p(z | D)`` the Gumbel perturbations conditioned on the sample
  (`storch.conditional_gumbel_rsample`). It has the mean of straight-through Gumbel-softmax at the
  same ``τ`` and a lower variance.
* `storch.method.straight_through.ReinMax` (Liu et al. 2023, "Bridging discrete and backpropagation:
  straight-through and beyond"): ``π₁ = (D + softmax(θ/τ))/2``,
  ``π₁ ← softmax(stopgrad(log π₁ − θ) + θ)``, ``g = 2π₁ − π/2``: Heun's (trapezoid) rule where
  straight-through uses Euler's, so at ``τ = 1`` it is unbiased for costs quadratic in the one-hot
  sample.

Bernoulli variables are handled as two-class categoricals over ``(1 − x, x)`` with logits
``(log σ(−φ), log σ(φ))``; the one-hot view of each distribution type is registered with
`storch.method.straight_through.register_one_hot_view`. Only first derivatives are defined
(none of these is unbiased).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.distributions import Bernoulli, Distribution, OneHotCategorical

from storch.method.method import DEFAULT_N_SAMPLES, Method
from storch.distributions.one_hot import one_hot
from storch.distributions.relaxation import conditional_gumbel_rsample
from storch.extend import TypeRegistry
from storch.registries import ONE_HOT_VIEWS, register_one_hot_view
from storch.sampling.method import SamplingMethod, check_count

__all__ = [
    "StraightThrough", "GumbelRao", "ReinMax", "OneHotView", "register_one_hot_view", "one_hot_view_for",
    "straight_through", "gumbel_rao", "reinmax", "sample_one_hot", "hard_forward", "require_one_hot_view",
    "StraightThroughFamily",
]


# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class OneHotView:
    """A discrete distribution seen as a categorical over its last dimension.

    Attributes:
        logits: ``distribution -> (*batch_shape, C)`` normalised log-probabilities of the classes,
            differentiable in the distribution's parameters.
        to_sample: maps a one-hot tensor ``(..., C)`` (or its straight-through version) to the
            distribution's sample space.
    """

    logits: Callable[[Distribution], torch.Tensor]
    to_sample: Callable[[torch.Tensor], torch.Tensor]


_VIEWS: TypeRegistry[OneHotView] = ONE_HOT_VIEWS  # made in storch.registries, filled here


def one_hot_view_for(distr: Distribution) -> Optional[OneHotView]:
    """The `storch.method.straight_through.OneHotView` registered for ``type(distr)`` or its most
    specific base class, else ``None``.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> one_hot_view_for(Bernoulli(logits=torch.tensor([0.0]))).logits(Bernoulli(logits=torch.tensor([0.0]))).exp()
        tensor([[0.5000, 0.5000]])
    """
    return _VIEWS.lookup(distr)


def _bernoulli_logits(d: Bernoulli) -> torch.Tensor:
    logit = d.logits
    return torch.stack([F.logsigmoid(-logit), F.logsigmoid(logit)], -1)


_VIEWS.register_default(Bernoulli)(OneHotView(logits=_bernoulli_logits, to_sample=lambda y: y[..., 1]))
_VIEWS.register_default(OneHotCategorical)(OneHotView(logits=lambda d: d.logits, to_sample=lambda y: y))


def require_one_hot_view(distr: Distribution, refusal: str) -> OneHotView:
    """The one-hot view of ``distr``; else a ``ValueError`` that starts with ``refusal`` and names the
    supported distributions and how to register others."""
    view = one_hot_view_for(distr)
    if view is None:
        hint = " Use OneHotCategorical instead of Categorical." if type(distr).__name__ == "Categorical" else ""
        raise ValueError(
            f"{refusal}; it supports OneHotCategorical and Bernoulli (register others "
            f"with storch.method.straight_through.register_one_hot_view).{hint}"
        )
    return view


# --------------------------------------------------------------------------- functions
def hard_forward(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """``hard + soft − stopgrad(soft)``: the value of ``hard``, the gradient of ``soft``.

    Examples:
        >>> import torch
        >>> soft = torch.tensor([0.2, 0.8], requires_grad=True)
        >>> hard_forward(torch.tensor([0.0, 1.0]), soft).tolist()
        [0.0, 1.0]
    """
    return hard + (soft - soft.detach())


def sample_one_hot(logits: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` one-hot samples ``(n, *logits.shape)`` of the categorical with these logits."""
    index = torch.distributions.Categorical(logits=logits.detach(), validate_args=False).sample((n,))
    return one_hot(index, logits.shape[-1], logits.dtype)


def straight_through(logits: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    """``D + π − stopgrad(π)`` with ``π = softmax(logits)``: forward ``D``, backward through ``π``.

    Examples:
        >>> import torch
        >>> theta = torch.zeros(3, requires_grad=True)
        >>> y = straight_through(theta, torch.tensor([0., 1., 0.]))
        >>> y.tolist()
        [0.0, 1.0, 0.0]
        >>> torch.autograd.grad(y[1], theta)[0]     # ∂π₁/∂θ at π = 1/3
        tensor([-0.1111,  0.2222, -0.1111])
    """
    return hard_forward(hard, logits.softmax(-1))


def gumbel_rao(
    logits: torch.Tensor, hard: torch.Tensor, temperature: float | torch.Tensor = 1.0, n_relaxed: int = 10
) -> torch.Tensor:
    """``D + s̄ − stopgrad(s̄)``, ``s̄ = (1/K) Σ_k softmax(z̃_k/τ)``, ``z̃_k ~ p(z | D)``.

    ``z = θ + G`` are the Gumbel perturbations whose argmax is ``D``. Each of the ``K = n_relaxed``
    conditional draws is differentiated as the unconditional sample is, ``∂z̃/∂θ = I`` (the noise
    ``G = z̃ − θ`` held fixed), so that ``E[∂s̄/∂θ | D] = E[∂ softmax(z/τ)/∂θ | D]``: the conditional
    expectation of the straight-through Gumbel-softmax Jacobian. (Differentiating through the
    conditional sampler's own reparameterisation, as REBAR does, has another expectation.)

    Examples:
        >>> import torch
        >>> theta = torch.zeros(3, requires_grad=True)
        >>> y = gumbel_rao(theta, torch.tensor([0., 0., 1.]), temperature=0.5, n_relaxed=4)
        >>> y.tolist(), y.requires_grad
        ([0.0, 0.0, 1.0], True)
    """
    hard_k = hard.expand((n_relaxed,) + tuple(hard.shape))
    probs = logits.detach().softmax(-1).expand_as(hard_k)  # one noise draw per element
    relaxed = conditional_gumbel_rsample(hard_k, probs, False, temperature)
    # log softmax(z̃/τ) is z̃/τ up to a constant, which softmax ignores: differentiate as z = θ + G
    log_relaxed = relaxed.clamp_min(torch.finfo(relaxed.dtype).tiny).log()
    soft = (log_relaxed + (logits - logits.detach()) / temperature).softmax(-1).mean(0)
    return hard_forward(hard, soft)


def reinmax(logits: torch.Tensor, hard: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """ReinMax: ``D + π₂ − stopgrad(π₂)`` (Liu et al. 2023).

    ``π₀ = softmax(θ)``, ``π₁ = (D + softmax(θ/τ))/2``, ``π₁ ← softmax(stopgrad(log π₁ − θ) + θ)``,
    ``π₂ = 2π₁ − π₀/2``.

    Examples:
        >>> import torch
        >>> theta = torch.zeros(2, requires_grad=True)
        >>> y = reinmax(theta, torch.tensor([1., 0.]))
        >>> y.tolist()
        [1.0, 0.0]
        >>> torch.autograd.grad(y[0], theta)[0]   # 2·J(π₁) − J(π₀)/2 with π₁ = (3/4, 1/4)
        tensor([ 0.2500, -0.2500])
    """
    pi0 = logits.softmax(-1)
    pi1 = (hard + (logits / temperature).softmax(-1)) / 2
    pi1 = ((pi1.log() - logits).detach() + logits).softmax(-1)
    pi2 = 2 * pi1 - pi0 / 2
    return hard_forward(hard, pi2)


# --------------------------------------------------------------------------- methods
class StraightThroughFamily(Method, ABC):
    """Shared sampling: hard one-hot samples of the distribution's one-hot view, a method-specific
    backward pass, then back to the distribution's sample space."""

    reparameterized = True

    def check_distribution(self, distr: Distribution) -> None:
        require_one_hot_view(
            distr,
            f"{type(self).__name__}({self.plate_name!r}) needs one-hot samples and has no one-hot view of "
            f"{type(distr).__name__}",
        )

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        view = one_hot_view_for(distr)
        logits = view.logits(distr)  # type: ignore[union-attr]
        hard = sample_one_hot(logits, amt_samples)
        return view.to_sample(self.backward_pass(logits, hard))  # type: ignore[union-attr]

    @abstractmethod
    def backward_pass(self, logits: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
        """The sample whose forward value is ``hard`` and whose gradient is the family member's."""


def check_temperature(name: str, temperature: float) -> float:
    """``temperature`` as a float, refused unless it is a positive number; ``name`` names the method."""
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)) or not temperature > 0:
        raise ValueError(f"{name}: the temperature must be positive (a number), got {temperature!r}.")
    return float(temperature)


class StraightThrough(StraightThroughFamily):
    """Straight-through: forward the one-hot sample ``D``, backward through ``π``: ``D + π − stopgrad(π)``.

    Bengio et al. 2013. Biased; exact (every single estimate) for costs linear in the one-hot sample.
    Measured bias ``‖E ĝ − ∇E f‖`` on the problems of ``tests/test_straight_through.py`` (2·10⁵
    samples, Monte Carlo error ≤ 0.004): 0.113 on three Bernoullis with a quadratic cost (exact
    gradient norm 0.351), 1.33 on a four-class categorical with a quadratic cost (exact norm 1.65),
    0.158 with a cubic cost (exact norm 0.868); total variance per sample 0.25 and 2.4 on the first
    two. One cost evaluation per sample; first derivatives only.

    Args:
        plate_name: node / plate name.
        sampling_method: proposal (default: Monte Carlo with ``n_samples``).
        n_samples: number of samples.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> theta = torch.zeros(3, requires_grad=True)
        >>> z = StraightThrough("z", n_samples=4)(OneHotCategorical(logits=theta))
        >>> bool(((z.plain() == 0) | (z.plain() == 1)).all())
        True
        >>> storch.add_cost((z * torch.tensor([1., 2., 3.])).sum(-1), "f")
        >>> _ = storch.backward()
        >>> theta.grad            # exact for a linear cost: ∂/∂θ Σ_k π_k v_k at π = 1/3
        tensor([-0.3333,  0.0000,  0.3333])
    """

    def __init__(
        self, plate_name: str, sampling_method: SamplingMethod | None = None, n_samples: int = DEFAULT_N_SAMPLES
    ) -> None:
        super().__init__(plate_name, sampling_method, n_samples)

    def backward_pass(self, logits: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
        return straight_through(logits, hard)


class GumbelRao(StraightThroughFamily):
    """Gumbel-Rao: straight-through Gumbel-softmax, Rao-Blackwellised over the noise given ``D``.

    Paulus et al. 2021. The backward pass averages ``n_relaxed`` relaxed samples ``softmax(z̃/τ)``
    with ``z̃ ~ p(z | D)``, so its expectation equals that of
    ``GumbelSoftmax(straight_through=True)`` at the same ``τ`` (same bias) with a lower variance.
    Measured on the problems of ``tests/test_straight_through.py`` at τ = 0.5, K = 10: bias 0.083
    (three Bernoullis, quadratic cost) and 0.56 (categorical, quadratic cost), as for ST
    Gumbel-softmax (0.082, 0.56); total variance per sample 0.24 against 0.42 for ST Gumbel-softmax
    and 8.6 against 15.5. With K = 1 it is ST Gumbel-softmax. One cost evaluation per sample; first
    derivatives only.

    Args:
        plate_name: node / plate name.
        sampling_method: proposal (default: Monte Carlo with ``n_samples``).
        n_samples: number of samples.
        temperature: ``τ`` of the relaxed samples.
        n_relaxed: ``K``, the conditional relaxed samples averaged per sample (no extra cost
            evaluations).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> _ = torch.manual_seed(0)
        >>> phi = torch.zeros(2, requires_grad=True)
        >>> b = GumbelRao("b", n_samples=10000, temperature=0.5)(Bernoulli(logits=phi))
        >>> storch.add_cost(((b - 0.3) ** 2).sum(-1), "f")
        >>> _ = storch.backward()
        >>> # exact: ∂/∂φ [0.09 + 0.4 σ(φ)] = 0.1; the mean estimate is 0.086, ST Gumbel-softmax's bias
        >>> phi.grad.shape, bool(torch.allclose(phi.grad, torch.full((2,), 0.086), atol=0.01))
        (torch.Size([2]), True)
    """

    def __init__(
        self,
        plate_name: str,
        sampling_method: SamplingMethod | None = None,
        n_samples: int = DEFAULT_N_SAMPLES,
        temperature: float = 1.0,
        n_relaxed: int = 10,
    ) -> None:
        super().__init__(plate_name, sampling_method, n_samples)
        self.temperature = check_temperature(f"GumbelRao({plate_name!r})", temperature)
        self.n_relaxed = check_count(n_relaxed, "n_relaxed", f"GumbelRao({plate_name!r})")

    def backward_pass(self, logits: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
        return gumbel_rao(logits, hard, self.temperature, self.n_relaxed)


class ReinMax(StraightThroughFamily):
    """ReinMax: a second-order accurate straight-through backward pass.

    Liu et al. 2023: ``π₁ = (D + softmax(θ/τ))/2``, ``π₁ ← softmax(stopgrad(log π₁ − θ) + θ)``,
    ``π₂ = 2π₁ − π/2``, output ``D + π₂ − stopgrad(π₂)``. At ``τ = 1`` it is unbiased for costs
    linear or quadratic in the one-hot sample (tested), biased otherwise. Measured bias on the
    problems of ``tests/test_straight_through.py`` (2·10⁵ samples): 0.001 and 0.003 on the quadratic
    Bernoulli and categorical costs (within Monte Carlo error; straight-through: 0.113 and 1.33);
    at τ = 2, 0.046 and 0.47; on the cubic categorical cost 0.82, *worse* than straight-through's
    0.16. Its variance is higher than straight-through's (0.34 vs 0.25 and 14.2 vs 2.4 per sample).
    One cost evaluation per sample; first derivatives only.

    Args:
        plate_name: node / plate name.
        sampling_method: proposal (default: Monte Carlo with ``n_samples``).
        n_samples: number of samples.
        temperature: ``τ`` (1 gives the second-order accuracy above).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> _ = torch.manual_seed(0)
        >>> theta = torch.zeros(3, requires_grad=True)
        >>> z = ReinMax("z", n_samples=10000)(OneHotCategorical(logits=theta))
        >>> storch.add_cost((z * torch.tensor([1., 2., 3.])).sum(-1) ** 2, "f")
        >>> _ = storch.backward()
        >>> exact = torch.tensor([1., 4., 9.]) / 3 - 14 / 9   # ∂/∂θ Σ_k π_k v_k² at π = 1/3: unbiased
        >>> theta.grad.shape, bool(torch.allclose(theta.grad, exact, atol=0.05))
        (torch.Size([3]), True)
    """

    def __init__(
        self,
        plate_name: str,
        sampling_method: SamplingMethod | None = None,
        n_samples: int = DEFAULT_N_SAMPLES,
        temperature: float = 1.0,
    ) -> None:
        super().__init__(plate_name, sampling_method, n_samples)
        self.temperature = check_temperature(f"ReinMax({plate_name!r})", temperature)

    def backward_pass(self, logits: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
        return reinmax(logits, hard, self.temperature)
