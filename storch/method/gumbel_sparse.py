"""Sparse Gumbel relaxations (biased): Gumbel-sparsemax and Gumbel-1.5-entmax.

As Gumbel-softmax (`storch.method.gumbel.GumbelSoftmax`), the discrete sample of a categorical
with log-probabilities ``log p`` is replaced by a relaxed, reparameterised sample at temperature ``τ``, but the
perturbed scores ``z = log p + G`` (``G`` i.i.d. standard Gumbel, so ``argmax z ~ Cat(p)``) are mapped onto the
simplex by a sparse projection instead of ``softmax``:

    GumbelSparseMax:  y = sparsemax(z / τ) = argmin_{y ∈ Δ} ‖y − z/τ‖²                (Martins & Astudillo 2016)
    GumbelEntmax:     y = 1.5-entmax(z / τ) = argmax_{y ∈ Δ} ⟨y, z/τ⟩ + H^T_{1.5}(y)    (Peters et al. 2019)

``sparsemax(s)_k = [s_k − η]₊`` and ``1.5-entmax(s)_k = [s_k/2 − η]₊²``, with the threshold ``η`` that makes the
entries sum to 1 (found by sorting). Both keep the order of the scores, so the relaxed sample's largest entry is
the class ``argmax z`` that the discrete sample takes; unlike softmax they give exact zeros, and the relaxed
sample *is* that one-hot vector whenever the two largest scores are more than ``τ`` (sparsemax) or ``2τ``
(1.5-entmax) apart. The gradient is pathwise through the projection (its exact Jacobian): on the support of
``y`` sparsemax's is ``I − 11ᵀ/|S|``; outside, and on one-hot samples, it is zero. The gradient is biased;
the bias vanishes as ``τ → 0`` while the variance grows, as for Gumbel-softmax (measured in
`storch.method.gumbel_sparse.GumbelSparseMax`). With ``straight_through`` the forward value
is the discrete sample ``onehot(argmax z)`` and the backward pass uses the relaxed one.

Distributions are seen as categoricals through their registered one-hot view
(`storch.method.straight_through.register_one_hot_view`: ``OneHotCategorical``;
``Bernoulli`` as the two classes ``(1 − x, x)``, where sparsemax of the Gumbel-perturbed pair is the hard
sigmoid ``clamp((φ + L)/(2τ) + ½, 0, 1)`` of the logistic-perturbed logit). Components: n i.i.d. relaxed draws,
weight ``1/n``, no gradient function, no control variate. The temperature follows
``τ_t = max(τ_min, τ_0 · exp(−r · t))`` after ``t`` backward passes, as for Gumbel-softmax.

The projections come from the ``entmax`` package (Peters & Niculae, MIT; storch's ``entmax`` extra,
``pip install "storch[entmax]"``): sort-based forward passes with exact closed-form backward passes
(``sparsemax``, ``entmax15``). It is imported when a projection is first used, so ``import storch`` works
without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch
from torch.distributions import Distribution

from storch.distributions.one_hot import one_hot
from storch.method.gumbel import GumbelSoftmax
from storch.method.method import DEFAULT_N_SAMPLES
from storch.sampling.method import SamplingMethod
from storch.method.straight_through import hard_forward, one_hot_view_for, require_one_hot_view

__all__ = ["GumbelSparseMax", "GumbelEntmax", "sparsemax", "entmax15", "gumbel_perturb"]


#: the error of GumbelSparseMax / GumbelEntmax without the ``entmax`` package
ENTMAX_MISSING = 'GumbelSparseMax and GumbelEntmax need the entmax package: pip install "storch[entmax]"'


def _entmax() -> ModuleType:
    try:
        return importlib.import_module("entmax")
    except ImportError as error:
        raise ImportError(ENTMAX_MISSING) from error


def sparsemax(scores: torch.Tensor) -> torch.Tensor:
    """``sparsemax`` over the last dimension: the Euclidean projection of ``scores`` onto the simplex.

    Examples:
        >>> import torch
        >>> [round(v, 4) for v in sparsemax(torch.tensor([1.0, 0.8, -1.0])).tolist()]
        [0.6, 0.4, 0.0]
        >>> sparsemax(torch.tensor([3.0, 1.0, 0.0])).tolist()    # a gap above 1: one-hot
        [1.0, 0.0, 0.0]
    """
    return _entmax().sparsemax(scores, dim=-1)


def entmax15(scores: torch.Tensor) -> torch.Tensor:
    """``1.5-entmax`` over the last dimension: ``[s/2 − η]₊²`` with ``η`` such that the entries sum to 1.

    Examples:
        >>> import torch
        >>> y = entmax15(torch.tensor([1.0, 0.8, -1.0]))
        >>> [round(v, 4) for v in y.tolist()]
        [0.5705, 0.4295, 0.0]
        >>> entmax15(torch.tensor([3.0, 1.0, 0.0])).tolist()     # a gap above 2: one-hot
        [1.0, 0.0, 0.0]
    """
    return _entmax().entmax15(scores, dim=-1)


def gumbel_perturb(logits: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` Gumbel-perturbed copies ``logits + G`` of shape ``(n, *logits.shape)``, differentiable in ``logits``.

    The argmax over the last dimension of each copy is a sample of ``Cat(softmax(logits))``.
    """
    finfo = torch.finfo(logits.dtype)
    u = torch.rand((n,) + tuple(logits.shape), dtype=logits.dtype, device=logits.device)
    return logits - torch.log(-torch.log(u.clamp(finfo.tiny, 1.0 - finfo.eps)))


class _GumbelProjection(GumbelSoftmax):
    """Gumbel-softmax with another map onto the simplex: relaxed samples ``project((log p + G)/τ)`` of a
    node with a one-hot view. The arguments, the temperature schedule and its state are Gumbel-softmax's;
    a subclass sets ``project`` (``staticmethod(sparsemax)``, ``staticmethod(entmax15)``)."""

    project: Callable[[torch.Tensor], torch.Tensor]

    def check_distribution(self, distr: Distribution) -> None:
        require_one_hot_view(distr, f"{type(self).__name__}({self.plate_name!r}) cannot relax a {type(distr).__name__}")
        _entmax()  # a missing package is an error now, not at the first backward pass

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        view = one_hot_view_for(distr)
        scores = gumbel_perturb(view.logits(distr), amt_samples)
        relaxed = self.project(scores / self.temperature)
        if self.straight_through:
            hard = one_hot(scores.detach().argmax(-1), scores.shape[-1], scores.dtype)
            relaxed = hard_forward(hard, relaxed)
        return view.to_sample(relaxed)


class GumbelSparseMax(_GumbelProjection):
    """Gumbel-sparsemax: relaxed samples ``sparsemax((log p + G)/τ)`` of ``OneHotCategorical`` or ``Bernoulli`` nodes.

    Sparse, and exactly one-hot when the two largest perturbed scores are more than ``τ`` apart. Same
    arguments and temperature schedule as `storch.method.gumbel.GumbelSoftmax`.

    Measured bias (the problems of ``tests/test_gumbel_sparse.py``, which checks these with 2·10⁵ samples;
    here 10⁶ samples; the norm of the mean gradient minus the exact one, Monte Carlo error about 0.002 for the
    Bernoullis and 0.01 for the categorical at ``τ = 0.1``; in brackets Gumbel-softmax, measured the same way).
    Three Bernoullis ``φ = (0.3, −0.5, 1.0)``, ``f = Σ (x − t)²``, ``t = (0.49, 0.499, 0.8)`` (exact gradient
    norm 0.118): 0.057 at ``τ = 2`` (0.074), 0.019 at ``τ = 0.5`` (0.044), 0.004 at ``τ = 0.1`` (0.012). A
    four-class categorical, ``f = (vᵀz)²`` (``tests/problems.py``, exact norm 1.65): 0.75 (1.39), 0.22 (0.67),
    0.06 (0.14). The relaxed expected cost of the categorical (exact 2.526) is 1.66 (0.77), 2.23 (1.71),
    2.46 (2.33), and 2.51 (2.48) at ``τ = 0.02``. The bias is lower than Gumbel-softmax's at the same ``τ``,
    the variance higher: the total variance of a one-sample gradient of the categorical is 4.5 (0.19), 31
    (4.9), 188 (45) and 923 (246) at ``τ = 2, 0.5, 0.1, 0.02`` (10⁵ estimates). As ``τ → 0`` a sample's
    gradient is zero unless the two largest perturbed scores are within ``τ``, where it is of order ``1/τ``.

    Args:
        plate_name: node / plate name.
        sampling_method: proposal (default: Monte Carlo with ``n_samples``).
        n_samples: number of samples.
        straight_through: discrete forward value, relaxed gradient.
        initial_temperature: ``τ_0``.
        min_temperature: ``τ_min``.
        annealing_rate: ``r`` in ``τ_t = max(τ_min, τ_0 exp(−r t))``; 0 keeps the temperature fixed.

    Examples:
        >>> import torch
        >>> from torch.distributions import OneHotCategorical
        >>> _ = torch.manual_seed(0)
        >>> z = GumbelSparseMax("z", n_samples=3, initial_temperature=0.1)(OneHotCategorical(logits=torch.zeros(4)))
        >>> z.shape, bool(torch.allclose(z.plain().sum(-1), torch.ones(3))), bool((z.plain() == 0).any())
        (torch.Size([3, 4]), True, True)
    """

    project = staticmethod(sparsemax)


class GumbelEntmax(_GumbelProjection):
    """Gumbel-1.5-entmax: relaxed samples ``1.5-entmax((log p + G)/τ)`` of ``OneHotCategorical`` or ``Bernoulli``
    nodes.

    Between Gumbel-softmax and Gumbel-sparsemax: sparse, exactly one-hot when the two largest perturbed
    scores are more than ``2τ`` apart, and smoother than sparsemax near the boundary of its support. Same
    arguments and temperature schedule as `storch.method.gumbel.GumbelSoftmax`.

    Measured bias (``tests/test_gumbel_sparse.py``, 10⁶ samples, the problems of
    `storch.method.gumbel_sparse.GumbelSparseMax`): Bernoullis 0.066 at ``τ = 2``, 0.029 at
    ``τ = 0.5``, 0.006 at ``τ = 0.1`` (Gumbel-softmax 0.074, 0.044, 0.012); categorical 1.10, 0.35 and 0.08
    (1.39, 0.67, 0.14); relaxed expected cost 1.27, 2.07, 2.42, and 2.50 at ``τ = 0.02`` (exact 2.526);
    total variance of a one-sample categorical gradient 1.3, 14, 94 and 500 at ``τ = 2, 0.5, 0.1, 0.02``
    (Gumbel-softmax 0.19, 4.9, 45, 246; Gumbel-sparsemax 4.5, 31, 188, 923).

    Other ``α``: ``alpha`` selects ``α``-entmax, ``argmax_{y ∈ Δ} ⟨y, z/τ⟩ + H^T_α(y)``, which is softmax at
    ``α → 1``, ``1.5``-entmax at ``1.5`` and sparsemax at ``2``; ``α`` other than ``1.5`` and ``2`` is
    computed by bisection (``entmax.entmax_bisect``, exact backward pass). With ``adaptive=True``, ``α`` is
    learned: ``α = 1 + softplus(ρ)`` (always above 1) for an ``nn.Parameter`` ``ρ`` (``self.alpha``) of
    the method, started at ``α = alpha``; ``storch.backward()`` gives it its pathwise gradient, and an
    optimizer over the model's parameters updates it when the method is part of the model (or pass
    ``method.parameters()``). Storchastic 0.3.7 took the same keywords; its adaptive ``α`` started at
    ``1 + softplus(alpha − 1)`` (1.97 for ``alpha=1.5``) rather than at ``alpha``. (Learned ``α``: Correia,
    Niculae & Martins 2019, "Adaptively sparse transformers"; the gradient in ``α`` is entmax's.)

    Args:
        plate_name: node / plate name.
        sampling_method: proposal (default: Monte Carlo with ``n_samples``).
        n_samples: number of samples.
        straight_through: discrete forward value, relaxed gradient.
        initial_temperature: ``τ_0``.
        min_temperature: ``τ_min``.
        annealing_rate: ``r`` in ``τ_t = max(τ_min, τ_0 exp(−r t))``; 0 keeps the temperature fixed.
        alpha: ``α > 1`` of ``α``-entmax (default 1.5); with ``adaptive``, its initial value.
        adaptive: learn ``α`` (a parameter of the method) instead of keeping it fixed.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> x = GumbelEntmax("x", n_samples=5, straight_through=True)(Bernoulli(logits=torch.zeros(2)))
        >>> x.shape, set(x.plain().unique().tolist()) <= {0.0, 1.0}
        (torch.Size([5, 2]), True)
        >>> learned = GumbelEntmax("y", n_samples=2, alpha=1.3, adaptive=True)
        >>> round(learned.entmax_alpha().item(), 4), [name for name, _ in learned.named_parameters()]
        (1.3, ['alpha'])
    """

    def __init__(
        self,
        plate_name: str,
        sampling_method: SamplingMethod | None = None,
        n_samples: int = DEFAULT_N_SAMPLES,
        straight_through: bool = False,
        initial_temperature: float = 1.0,
        min_temperature: float = 1e-4,
        annealing_rate: float = 0.0,
        *,
        alpha: float = 1.5,
        adaptive: bool = False,
    ) -> None:
        super().__init__(
            plate_name, sampling_method, n_samples, straight_through, initial_temperature, min_temperature,
            annealing_rate,
        )
        alpha = float(alpha)
        if not alpha > 1.0:
            raise ValueError(
                f"GumbelEntmax({plate_name!r}): alpha must be above 1, got alpha={alpha} (alpha = 1 is "
                "softmax: use GumbelSoftmax)."
            )
        self.adaptive = bool(adaptive)
        if self.adaptive:  # α = 1 + softplus(ρ), ρ = softplus⁻¹(alpha − 1) = log(expm1(alpha − 1))
            rho = torch.tensor(alpha - 1.0, dtype=torch.float64).expm1().log()
            self.alpha: torch.Tensor | float = torch.nn.Parameter(rho.to(torch.get_default_dtype()))
        else:
            self.alpha = alpha

    def entmax_alpha(self) -> torch.Tensor | float:
        """``α`` of the projection: the fixed ``alpha``, or ``1 + softplus(ρ)`` when it is learned."""
        if self.adaptive:
            return 1.0 + torch.nn.functional.softplus(self.alpha)  # type: ignore[arg-type]
        return self.alpha

    def project(self, scores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``α``-entmax of ``scores`` over the last dimension (see the class docstring)."""
        if not self.adaptive and self.alpha == 1.5:
            return entmax15(scores)
        if not self.adaptive and self.alpha == 2.0:
            return sparsemax(scores)
        alpha = self.entmax_alpha()
        if isinstance(alpha, torch.Tensor):
            alpha = alpha.to(scores.dtype)
        return _entmax().entmax_bisect(scores, alpha, dim=-1)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if not self.adaptive and self.alpha == 1.5:
            return extra
        if self.adaptive:
            alpha = f"adaptive=True, alpha={float(self.entmax_alpha().detach()):.4g}"
        else:
            alpha = f"alpha={self.alpha}"
        return f"{extra}, {alpha}" if extra else alpha
