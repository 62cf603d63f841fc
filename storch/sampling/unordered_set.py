"""Unordered sets sampled without replacement, and their leave-one-out weights (Kool, van Hoof &
Welling 2020, ICLR, "Estimating gradients for discrete random variables by sampling without
replacement"). This is also the manual's module path (Storchastic's
``storch/sampling/unordered_set.py``) for `storch.sampling.unordered_set.UnorderedSet` and
`storch.sampling.unordered_set.GumbelSoftmaxWOR`.

A Gumbel-top-k sample
(`storch.sampling.swor.SampleWithoutReplacement`) is a set ``S`` of
``k`` distinct values of domain ``D``. Forgetting the order, its probability is

    P^D(S) = ∫₀¹ Π_{s∈S} (1 − u^{a_s}) du,      a_s = p(s) / p(D∖S),   p(D∖S) = 1 − Σ_{s∈S} p(s),

and with the *leave-one-out ratio* ``R(S, s) = P^{D∖{s}}(S∖{s}) / P^D(S)``

    Σ_{s∈S} p(s) R(S, s) f(s)        is unbiased for E_p[f]        (the unordered set estimator).

For ``A ⊂ S`` the set ``S∖A`` over the domain ``D∖A`` has the same complement ``D∖S``, and its
``a_s`` are the same numbers (the renormalisation cancels), so every ``P^{D∖A}(S∖A)`` is the same
integral with the factors of ``A`` left out. The second-order ratio of the built-in baseline is
``R^{D∖{s}}(S, s') = P^{D∖{s,s'}}(S∖{s,s'}) / P^{D∖{s}}(S∖{s})`` (``1`` for ``s' = s``).

Numerics. With ``u = exp(−eˣ)`` the integral is over the real line,

    P^D(S) = ∫ exp(x − eˣ) Π_{s∈S} (1 − exp(−a_s eˣ)) dx,

whose integrand is entire and decays like ``eˣ`` to the left and doubly exponentially to the
right, so the trapezoidal rule on a uniform grid converges geometrically in the step ``h``
(``h = min(0.25, 0.7/√(k+1))`` by default: relative error below 10⁻¹⁰ against exact enumeration,
checked up to ``k = 12``). Everything is computed in log space, in float64, on the fixed grid
``x ∈ [−30, log(k+1) + 3.5]`` (the factors increase with ``x``, so the part left of ``x₀`` is at most
``4e^{x₀}`` times the total: 4·10⁻¹³; the right end cuts ``e^{−(k+1)(e^{3.5} − 4.5)}``), with
``log(1 − exp(−a eˣ))`` evaluated stably for tiny and huge ``a eˣ``; all plates are one batched
computation. Elements of probability 0 (which only occur when the set already holds every value
of positive probability, so ``p(D∖S) = 0``) drop out of the products.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Sequence

import torch
from torch.distributions import Bernoulli, Distribution, OneHotCategorical

from storch.distributions.one_hot import one_hot
from storch.distributions.relaxation import AnnealedTemperature
from storch.extend import Plate, StepState, TypeRegistry
from storch.registries import RELAXED_WOR_VALUES, register_relaxed_wor_value
from storch.sampling.swor import SampleWithoutReplacement, WORState, wor_support

__all__ = [
    "UnorderedSet", "GumbelSoftmaxWOR", "log_complement_mass", "log_set_probability",
    "log_leave_one_out_ratio", "log_leave_two_out_ratio", "unordered_set_log_weights",
    "register_relaxed_wor_value",
]

#: default trapezoid step in x = log(−log u)
DEFAULT_STEP = 0.25
_X_LOW = -30.0


# ----------------------------------------------------------------------- the math
def log_complement_mass(log_p: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``log p(D∖S) = log(1 − Σ_{s∈S} p(s))`` from the log-probabilities of the elements of ``S``.

    ``−∞`` when the set holds (up to rounding) all the probability mass.

    Examples:
        >>> import torch
        >>> round(log_complement_mass(torch.tensor([0.5, 0.25]).log()).exp().item(), 6)
        0.25
    """
    total = torch.logsumexp(log_p.double(), dim)
    full = total >= 0.0
    # log(1 − e^t) for t < 0, accurate near 0 and far below it (both branches kept finite, so that
    # gradients through torch.where stay finite)
    t = torch.where(full, torch.full_like(total, -1.0), total)
    near = t > -0.6931471805599453
    out = torch.where(near, torch.log(-torch.expm1(t.clamp(min=-0.6931471805599453))), torch.log1p(-torch.exp(t.clamp(max=-0.6931471805599453))))
    return torch.where(full, torch.full_like(out, -math.inf), out)


def _grid(k: int, step: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # with many small a_s the integrand peaks at log(k + 1) with width about 1/√(k + 1)
    step = min(step, 0.7 / math.sqrt(k + 1.0))
    high = math.log(k + 1.0) + 3.5
    n = math.ceil((high - _X_LOW) / step) + 1
    return torch.linspace(_X_LOW, high, n, dtype=dtype, device=device)


def _log_factors(log_p: torch.Tensor, log_rest: Optional[torch.Tensor], step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``L_s(x) = log(1 − exp(−a_s eˣ))`` on the grid ``(k, *B, G)`` and the log base measure plus
    quadrature weight ``x − eˣ + log h`` ``(G,)``."""
    log_p = log_p.double()
    if log_rest is None:
        log_rest = log_complement_mass(log_p, 0)
    log_rest = log_rest.double()
    # elements of probability 0, and every element when p(D∖S) = 0 (a = ∞), have factor 1
    constant = torch.isneginf(log_p) | torch.isneginf(log_rest).unsqueeze(0)
    x = _grid(log_p.shape[0], step, log_p.dtype, log_p.device)
    log_a = torch.where(constant, torch.zeros_like(log_p), log_p - torch.where(constant, torch.zeros_like(log_p), log_rest))
    z = log_a.unsqueeze(-1) + x  # log(a eˣ)
    # log(1 − e^{−y}), y = eᶻ: log y − y/2 (+ O(y²)) for tiny y, log(−expm1(−y)) otherwise
    small = z < -12.0
    factors = torch.where(
        small, z - 0.5 * torch.exp(z.clamp(max=-12.0)), torch.log(-torch.expm1(-torch.exp(z.clamp(min=-12.0, max=50.0))))
    )
    factors = torch.where(constant.unsqueeze(-1), torch.zeros_like(factors), factors)
    base = x - torch.exp(x) + torch.log(x[1] - x[0])  # on the device: no sync, and shapes only on meta
    return factors, base


def log_set_probability(log_p: torch.Tensor, log_rest: Optional[torch.Tensor] = None, step: float = DEFAULT_STEP) -> torch.Tensor:
    """``log P^D(S)``, the log-probability of the unordered set ``S`` drawn without replacement.

    Args:
        log_p: ``(k, *B)`` log-probabilities of the set's elements (set dimension first).
        log_rest: ``(*B)`` ``log p(D∖S)``; computed from ``log_p`` when ``None``.
        step: the trapezoid step in ``x = log(−log u)``.

    Returns:
        ``(*B)``, in float64.

    Examples:
        >>> import torch
        >>> p = torch.tensor([0.5, 0.3, 0.2])
        >>> # {0, 1}: orders (0, 1) and (1, 0): 0.5·0.3/0.5 + 0.3·0.5/0.7
        >>> round(log_set_probability(p[:2].log()).exp().item(), 8), round(0.5 * 0.3 / 0.5 + 0.3 * 0.5 / 0.7, 8)
        (0.51428571, 0.51428571)
    """
    factors, base = _log_factors(log_p, log_rest, step)
    return torch.logsumexp(base + factors.sum(0), -1)


def log_leave_one_out_ratio(
    log_p: torch.Tensor, log_rest: Optional[torch.Tensor] = None, step: float = DEFAULT_STEP
) -> torch.Tensor:
    """``log R(S, s) = log P^{D∖{s}}(S∖{s}) − log P^D(S)`` for each element ``s``: ``(k, *B)``, float64.

    Examples:
        >>> import torch
        >>> p = torch.tensor([0.5, 0.3, 0.2])
        >>> r = log_leave_one_out_ratio(p[:2].log()).exp()
        >>> # R(S, 0) = P^{D∖0}({1}) / P^D(S) = (0.3 / 0.5) / P^D(S)
        >>> round(r[0].item(), 6), round(0.6 / (0.5 * 0.3 / 0.5 + 0.3 * 0.5 / 0.7), 6)
        (1.166667, 1.166667)
    """
    factors, base = _log_factors(log_p, log_rest, step)
    total = base + factors.sum(0)
    return torch.logsumexp(total - factors, -1) - torch.logsumexp(total, -1)


def log_leave_two_out_ratio(
    log_p: torch.Tensor, log_rest: Optional[torch.Tensor] = None, step: float = DEFAULT_STEP
) -> torch.Tensor:
    """``log R^{D∖{s}}(S, s') = log P^{D∖{s,s'}}(S∖{s,s'}) − log P^{D∖{s}}(S∖{s})``: ``(k, k, *B)``
    indexed ``[s, s']``, float64, with ``0`` on the diagonal (``R^{D∖{s}}(S, s) = 1``).

    Examples:
        >>> import torch
        >>> r2 = log_leave_two_out_ratio(torch.tensor([0.5, 0.3]).log()).exp()
        >>> # R^{D∖0}(S, 1) = P(∅) / P^{D∖0}({1}) = 1 / (0.3/0.5); R^{D∖1}(S, 0) = 1 / (0.5/0.7)
        >>> [[round(v, 6) for v in row] for row in r2.tolist()]
        [[1.0, 1.666667], [1.4, 1.0]]
    """
    factors, base = _log_factors(log_p, log_rest, step)
    total = base + factors.sum(0)
    minus_one = total - factors  # (k, *B, G)
    log_one = torch.logsumexp(minus_one, -1)  # log P^{D∖s}(S∖s)
    k = log_p.shape[0]
    batch = tuple(log_one.shape[1:])
    log_two = log_one.new_zeros((k, k) + batch)  # log P^{D∖{s,s'}}(S∖{s,s'}), symmetric
    if k > 1:
        i, j = torch.triu_indices(k, k, 1, device=log_p.device)
        pairs = torch.logsumexp(minus_one[i] - factors[j], -1)  # (k(k−1)/2, *B)
        log_two[i, j] = pairs
        log_two[j, i] = pairs
    ratio = log_two - log_one.unsqueeze(1)
    eye = torch.eye(k, dtype=torch.bool, device=ratio.device).reshape((k, k) + (1,) * len(batch))
    return torch.where(eye, torch.zeros_like(ratio), ratio)


def unordered_set_log_weights(
    log_p: torch.Tensor, log_rest: Optional[torch.Tensor] = None, step: float = DEFAULT_STEP
) -> torch.Tensor:
    """``log(p(s) R(S, s))``, the log-weights of the unordered set estimator: ``(k, *B)``, in the
    dtype of ``log_p``; ``−∞`` for elements of probability 0.

    Examples:
        >>> import torch
        >>> p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
        >>> # the whole support: weights p(s)
        >>> unordered_set_log_weights(p.log()).exp().tolist()
        [0.5, 0.3, 0.2]
    """
    out = log_p.double() + log_leave_one_out_ratio(log_p, log_rest, step)
    return out.to(log_p.dtype)


def _state_log_p(state: WORState, detach: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of a sampled set (``−∞`` on dead elements) and ``log p(D∖S)``."""
    log_p = state.log_prob.detach() if detach else state.log_prob
    alive = state.alive if state.alive is not None else state.perturbed > -math.inf
    log_p = torch.where(alive, log_p, torch.full_like(log_p, -math.inf))
    log_rest = log_complement_mass(log_p, 0)
    covered = torch.isneginf(state.kappa)  # the set is the whole support
    log_rest = torch.where(covered, torch.full_like(log_rest, -math.inf), log_rest)
    return log_p, log_rest


# ----------------------------------------------------------------------- the sampling method
class UnorderedSet(SampleWithoutReplacement):
    """A Gumbel-top-k set of ``k`` distinct values, weighted by ``p(s) R(S, s)`` (detached).

    With these weights ``Σ_{s∈S} p(s) R(S, s) f(s)`` is unbiased for ``E_p[f]``; with the gradient
    function ``log p(s)`` (`storch.method.UnorderedSetEstimator`) derivatives
    of every
    order are unbiased. Several variables in one node are sampled jointly (distinct joint values,
    by stochastic beam search), and ``p`` is then their joint probability; decoded step by step
    (sequences, through `storch.method.UnorderedSetEstimator`), the set of each
    step is a
    sample of prefixes and ``p`` the prefix probability.

    Args:
        plate_name: the plate of the set.
        k: the number of distinct values (fewer when the support is smaller).
        step: the trapezoid step of the numerical integration (see the module docstring).
        eos: the end-of-sequence value index, for sequences decoded step by step.

    Examples:
        >>> import torch
        >>> from torch.distributions import Categorical
        >>> from storch.method.score_function import ScoreFunction
        >>> theta = torch.tensor([1.0, 0.0, -1.0, 0.5])
        >>> z = ScoreFunction("z", sampling_method=UnorderedSet("z", 2))(Categorical(logits=theta))
        >>> z.n, len(set(z.plain().tolist()))
        (2, 2)
    """

    def __init__(self, plate_name: str, k: int, step: float = DEFAULT_STEP, eos: Optional[int] = None) -> None:
        super().__init__(plate_name, k, normalize=False, eos=eos)
        if isinstance(step, bool) or not isinstance(step, numbers.Real):
            raise TypeError(
                f"{type(self).__name__}({plate_name!r}): the third argument is the integration step (a float in "
                f"(0, 1]), got {step!r} ({type(step).__name__}). Storchastic's comp_leave_two_out, "
                "exact_integration, num_int_points and a are not taken: the integral is computed on a "
                "trapezoid grid of this step (relative error below 1e-10) and leave-two-out ratios on demand."
            )
        if not 0.0 < step <= 1.0:
            raise ValueError(f"UnorderedSet({plate_name!r}): the integration step must be in (0, 1], got {step}.")
        self.step = float(step)

    def weights(self, state: WORState) -> torch.Tensor:
        """``p(s) R(S, s)`` per element (``(n, *B)``, detached; ``0`` on elements of probability 0)."""
        log_p, log_rest = _state_log_p(state)
        return unordered_set_log_weights(log_p, log_rest, self.step).exp()

    def log_baseline_matrix(self, state: WORState) -> torch.Tensor:
        """``log M[s, s']`` of the built-in baseline ``B(s) = Σ_{s'∈S} M[s, s'] f(s')``:
        ``M[s, s'] = p(s') R^{D∖{s}}(S, s')`` and ``M[s, s] = p(s)``. ``(n, n, *B)``, float64."""
        log_p, log_rest = _state_log_p(state)
        return log_p.double().unsqueeze(0) + log_leave_two_out_ratio(log_p, log_rest, self.step)

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, k={self.k}, step={self.step}, eos={self.eos}"


# ----------------------------------------------------------------------- relaxed variant
_RelaxedValueFn = Callable[[torch.Tensor], torch.Tensor]

_RELAXED_VALUES: TypeRegistry[_RelaxedValueFn] = RELAXED_WOR_VALUES  # made in storch.registries, filled here


@_RELAXED_VALUES.register_default(OneHotCategorical)
def _one_hot_relaxed(y: torch.Tensor) -> torch.Tensor:
    return y


@_RELAXED_VALUES.register_default(Bernoulli)
def _bernoulli_relaxed(y: torch.Tensor) -> torch.Tensor:
    return y[..., 1]  # the support is enumerated as (0, 1)


def _relaxed_value_fn(distr: Distribution) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    return _RELAXED_VALUES.lookup(distr)


def _log1m_softmax(u: torch.Tensor) -> torch.Tensor:
    """``log(1 − softmax(u))`` over the last dimension without cancellation: for the largest entry
    (the only one that can exceed 1/2) as ``logsumexp`` of the others minus ``logsumexp`` of all."""
    lse = torch.logsumexp(u, -1, keepdim=True)
    top = u.argmax(-1, keepdim=True)
    others = u.scatter(-1, top, float("-inf"))
    log_rest = torch.logsumexp(others, -1, keepdim=True) - lse  # log(1 − y_top)
    small = torch.log1p(-torch.exp(u - lse).clamp(max=0.5))
    return small.scatter(-1, top, log_rest)


def _joint_fix(log_p: torch.Tensor, plates: Sequence[Plate], k: int) -> str:
    """Why several variables per plate element are refused, and what to use instead."""
    variables = math.prod(log_p.shape[len(plates):-1])
    values = f"{log_p.shape[-1]}^{variables}"
    return (
        f" A set without replacement of these {variables} variables is a set of their joint values "
        f"({values} of them), and its relaxed top-k would need a softmax over all of them. Use "
        f"UnorderedSetEstimator(name, k={k}) for {k} distinct joint values (unbiased), or "
        f"GumbelSoftmax(name, n_samples={k}) for {k} relaxed samples drawn with replacement; make the "
        "variables a plate (storch.denote_independent) only if the cost treats them separately."
    )


class GumbelSoftmaxWOR(AnnealedTemperature, UnorderedSet):
    """Relaxed samples without replacement: the Gumbel-top-k set, with a relaxed sample per element.

    Perturb ``φ = log p + G`` (``G`` i.i.d. standard Gumbel, ``φ`` reparameterised in ``p``); the set
    ``S`` is the ``k`` largest ``φ`` in decreasing order, weighted by ``p(s) R(S, s)`` as in
    `storch.sampling.unordered_set.UnorderedSet` but differentiable in ``p`` (with ``S`` held fixed).
    The ``j``-th relaxed sample is the successive softmax of Xie & Ermon 2019
    (relaxed top-k): ``y_1 = softmax(φ/τ)``, ``y_{j+1} = softmax(w_{j+1}/τ)`` with
    ``w_{j+1} = w_j + log(1 − y_j)``, ``w_1 = φ``; as ``τ → 0``, ``y_j`` tends to the one-hot
    vector of the ``j``-th element of ``S``. With ``straight_through`` the forward value is that
    one-hot vector and the gradient is the relaxed one's.

    Used with a pathwise method (`storch.method.UnorderedSetGumbelSoftmax`)
    it gives
    ``Σ_{s∈S} [∇w(s) f(y_s) + w(s) ∇f(y_s)]``: **biased** (the relaxation, and the jumps of the
    weights where the set changes, which no pathwise derivative sees). Differentiating the weights
    matters: with them detached the ``∇p(s)`` term is lost and the bias does not vanish as ``τ → 0``
    (measured bias norm 0.68 instead of 0.32 at ``k = 2, τ = 0.1`` on the tests' problem). Used with
    a method that does not need pathwise samples it returns the discrete set, like
    `storch.sampling.unordered_set.UnorderedSet`. One discrete variable per plate element
    (OneHotCategorical, Bernoulli).

    Args:
        plate_name: the plate of the set.
        k: the number of distinct values.
        initial_temperature: ``τ_0``.
        min_temperature: ``τ_min``.
        annealing_rate: ``r`` in ``τ_t = max(τ_min, τ_0 exp(−r t))`` after ``t`` backward passes.
        straight_through: discrete forward value, relaxed gradient.
        step: the trapezoid step of the weights' numerical integration.
        eos: the end-of-sequence value index (kept for API compatibility; sequences are not
            relaxed).

    Examples:
        >>> import torch
        >>> from torch.distributions import OneHotCategorical
        >>> theta = torch.tensor([1.0, 0.0, -1.0, 0.5], requires_grad=True)
        >>> y = GumbelSoftmaxWOR("z", 3, initial_temperature=0.5).sample(OneHotCategorical(logits=theta), (), True)
        >>> y.shape, y.requires_grad, bool(torch.allclose(y.sum(-1), torch.ones(3)))
        (torch.Size([3, 4]), True, True)
    """

    def __init__(
        self,
        plate_name: str,
        k: int,
        initial_temperature: float = 1.0,
        min_temperature: float = 1e-4,
        annealing_rate: float = 1e-5,
        straight_through: bool = False,
        step: float = DEFAULT_STEP,
        eos: Optional[int] = None,
    ) -> None:
        super().__init__(plate_name, k, step=step, eos=eos)
        self.init_temperature(
            f"{type(self).__name__}({plate_name!r})", initial_temperature, min_temperature, annealing_rate
        )
        self.straight_through = bool(straight_through)

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        if not requires_grad:
            return super().sample(distr, plates, requires_grad)
        relaxed_value = _relaxed_value_fn(distr)
        support = wor_support(distr)
        log_p = support.log_probs.log_softmax(-1)  # (*B, V), differentiable
        if relaxed_value is None or log_p.dim() != len(plates) + 1:
            what = (
                f"has no relaxed form (registered: {sorted(c.__name__ for c in _RELAXED_VALUES)})"
                if relaxed_value is None
                else f"has {tuple(log_p.shape[len(plates):-1])} variables per plate element"
            )
            raise ValueError(
                f"GumbelSoftmaxWOR({self.plate_name!r}) (the sampler of UnorderedSetGumbelSoftmax): "
                f"{type(distr).__name__} {what}; it relaxes one OneHotCategorical or Bernoulli variable "
                f"per plate element.{_joint_fix(log_p, plates, self.k) if relaxed_value is not None else ''}"
            )
        size = log_p.shape[-1]
        gumbel = -torch.empty_like(log_p).exponential_().log()
        phi = log_p + gumbel
        n = min(self.k, size)
        with torch.no_grad():
            top, index = phi.topk(min(self.k + 1, size), dim=-1)
            kappa = top[..., n] if size > n else torch.full(top.shape[:-1], -math.inf, dtype=top.dtype, device=top.device)
        chosen = index[..., :n]
        tau = self.temperature.to(phi.dtype)
        w = phi
        relaxed = []
        for j in range(n):
            u = w / tau
            y = torch.softmax(u, -1)
            if self.straight_through:
                hard = one_hot(chosen[..., j], size, y.dtype)
                y_out = hard + y - y.detach()
            else:
                y_out = y
            relaxed.append(y_out)
            if j + 1 < n:
                w = w + _log1m_softmax(u)
        samples = relaxed_value(torch.stack(relaxed, 0))
        set_log_p = log_p.gather(-1, chosen).movedim(-1, 0)
        self._pending = WORState(
            log_prob=set_log_p,
            perturbed=top[..., :n].movedim(-1, 0),
            kappa=kappa,
            tokens=chosen.movedim(-1, 0),
            alive=set_log_p.detach() > -math.inf,
        )
        return samples

    def weights(self, state: WORState) -> torch.Tensor:
        """``p(s) R(S, s)``, differentiable in ``p`` for the relaxed samples (the set held fixed)."""
        if not state.log_prob.requires_grad:
            return super().weights(state)
        log_p, log_rest = _state_log_p(state, detach=False)
        return unordered_set_log_weights(log_p, log_rest, self.step).exp()

    def update_parameters(self, result_triples) -> None:
        super().update_parameters(result_triples)
        self.anneal()

    #: the annealed temperature is a buffer that `anneal` updates in place (a compiled step replays that)
    step_state = StepState.IN_PLACE

    def extra_repr(self) -> str:
        return (
            f"plate_name={self.plate_name!r}, k={self.k}, temperature={self.temperature.item():.4g}, "
            f"straight_through={self.straight_through}"
        )
