"""Coupled categorical estimators: DisARM for categorical variables through stick-breaking.

Dong, Mnih & Tucker 2021, "Coupled Gradient Estimators for Discrete Latent Variables" (NeurIPS).

**Stick-breaking coding.** Order the ``C`` categories ``c_0, …, c_{C−1}`` (see `ORDERINGS`). With
``p = softmax(θ)``, a categorical sample is the first ``k`` whose binary decision ``b_k`` says *stop*:

    b_k ~ Bernoulli(π_k),   π_k = p_{c_k} / Σ_{j≥k} p_{c_j},   k = 0 … C−2   (independent)
    z = c_K,  K = min{k : b_k = 1}  (K = C − 1 if none stops)

with stick-breaking logits ``φ_k = logit π_k = θ_{c_k} − logsumexp_{j>k} θ_{c_j}``.

**The coupling.** One uniform per decision, ``u_k ~ U(0, 1)``; the pair ``z`` (from ``b_k = 1[u_k < π_k]``)
and ``z̃`` (from ``b̃_k = 1[1 − u_k < π_k]``), stopping at positions ``K`` and ``K̃``, are both
samples of ``Cat(p)`` (DisARM's antithetic pair, decision by decision). Let ``m = min(K, K̃)``,
``M = max(K, K̃)``, ``S`` the sample that stops first and ``L`` the other.

**Stick-breaking DisARM** (`storch.method.coupled_categorical.CoupledCategorical`).
``f(z)`` is a function of the independent ``b``, so DisARM on all ``C − 1`` decisions is unbiased
for ``∂E f/∂φ``. Integrating out, given the pair, the decisions that a sample never reads (the
paper's Rao-Blackwellisation) leaves, with ``Δ = ½ (f(L) − f(S))`` and ``π_k = σ(φ_k)``:

    g_φ_m = −Δ σ(|φ_m|)
    g_φ_k = Δ (1[k = M] − π_k)      for m < k ≤ M     (decisions only L reaches)
    g_φ_k = 0                        otherwise, and everywhere when K = K̃

**Importance-weighted** (`storch.method.coupled_categorical.CoupledCategoricalIW`,
the paper's derivation of DisARM). For any coupling ``q(z, z̃)`` of two ``Cat(p)`` samples,

    g_θ = ½ w(z, z̃) (f(z) − f(z̃)) (∇ log q(z) − ∇ log q(z̃)),    w = q(z) q(z̃) / q(z, z̃)

is unbiased when ``q(z, z̃) > 0`` for all ``z ≠ z̃`` (the weight turns the coupled pair into an
independent one; the term vanishes when ``z = z̃``). For the stick-breaking coupling,
``w = σ(|φ_m|) Π_{k<m} (1 − π_k)² / (1 − 2π_k)``, and the support condition is ``π_k < ½`` for
``k < C − 2``: ascending order (least probable first) guarantees it, and is the one used.

Both give ``∂E f/∂φ``; ``∂φ/∂θ`` is applied exactly (`logit_gradient`), and the surrogate term is
``(θ − stopgrad θ) · stopgrad(g_θ)``, summed over the variables: linear in the normalised logits
``θ``, zero in the forward pass. Each pair is an evaluation group (`storch.method.groups`) of two
points with weight ``1/(2n)`` each: **2 cost evaluations per pair**. With ``C = 2`` both estimators are
DisARM on ``Bernoulli(logits = θ_{c_0} − θ_{c_1})`` (the same uniforms give the same pair).
Variables of a factorised node (any batch shape) get independent pairs; the argument of DisARM
per coordinate carries over. Unbiased for **first-order** derivatives only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.distributions import Distribution, OneHotCategorical

from storch.extend import (
    CostTensor, StochasticTensor, align_to, layout_of, layout_of_plates, no_dispatch, node_of, wrap,
)
from storch.method.antithetic import (
    aligned_logits, categorical_logits, check_categorical, check_logit_plates, control_variate_term, cost_target,
    on_every_point, points_first,
)
from storch.method.groups import GroupRecords, flatten_groups, group_plate, group_weights
from storch.method.method import Method

__all__ = [
    "CoupledCategorical", "CoupledCategoricalIW", "ORDERINGS", "Pair", "stick_breaking_logits",
    "stick_breaking_pairs", "disarm_stick_gradient", "importance_weighted_stick_gradient", "logit_gradient",
]


# ------------------------------------------------------------------------------ the coding
#: how the categories are ordered along the stick, by name: ``(logits) -> order``, ``order[..., k]``
#: the category at position ``k``
ORDERINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "given": lambda theta: torch.arange(theta.shape[-1], device=theta.device).expand(theta.shape),
    "descending": lambda theta: torch.argsort(theta, dim=-1, descending=True, stable=True),
    "ascending": lambda theta: torch.argsort(theta, dim=-1, stable=True),
}


def stick_breaking_logits(sorted_theta: torch.Tensor) -> torch.Tensor:
    """``φ_k = θ_k − logsumexp_{j>k} θ_j``, ``k = 0 … C−2``, for logits in stick order.

    Examples:
        >>> torch.sigmoid(stick_breaking_logits(torch.tensor([0.5, 0.25, 0.25]).log()))
        tensor([0.5000, 0.5000])
    """
    tails = torch.logcumsumexp(sorted_theta.flip(-1), -1).flip(-1)  # logsumexp_{j≥k}
    return sorted_theta[..., :-1] - tails[..., 1:]


def _stop_position(stops: torch.Tensor) -> torch.Tensor:
    """The first ``k`` with ``stops[..., k]``, or ``C − 1`` (the size of the last dimension)."""
    return (stops.cumsum(-1) == 0).sum(-1)


def stick_breaking_pairs(phi: torch.Tensor, n: int) -> torch.Tensor:
    """``(n, 2, *phi.shape[:-1])`` stop positions of ``n`` antithetic pairs (``u`` and ``1 − u``).

    Examples:
        >>> pairs = stick_breaking_pairs(torch.zeros(3), 4000)      # π = ½ at every decision
        >>> pairs.shape, bool((pairs[:, 0] != pairs[:, 1]).all())   # a pair always disagrees
        (torch.Size([4000, 2]), True)
    """
    u = torch.rand((n,) + tuple(phi.shape), dtype=phi.dtype, device=phi.device)
    pi = torch.sigmoid(phi)
    return torch.stack([_stop_position(u < pi), _stop_position(1 - u < pi)], 1)


# ------------------------------------------------------------------------------ the estimates
class Pair(NamedTuple):
    """The costs and stop positions of the two points of each pair, laid out alike: ``f`` with a
    trailing dimension of size 1, the positions without it."""

    f: torch.Tensor
    f_tilde: torch.Tensor
    k: torch.Tensor
    k_tilde: torch.Tensor


def _half_difference(pair: Pair) -> torch.Tensor:
    """``Δ = ½ (f(L) − f(S))``, zero where both samples stop at the same position."""
    order = (pair.k_tilde > pair.k).to(pair.f.dtype) - (pair.k > pair.k_tilde).to(pair.f.dtype)
    return 0.5 * (pair.f_tilde - pair.f) * order.unsqueeze(-1)


def disarm_stick_gradient(pair: Pair, phi: torch.Tensor) -> torch.Tensor:
    """Stick-breaking DisARM, Rao-Blackwellised: ``g_φ`` over the ``C − 1`` decisions (module docs).

    Examples:
        >>> pair = Pair(torch.tensor([[3.0]]), torch.tensor([[1.0]]), torch.tensor([0]), torch.tensor([2]))
        >>> disarm_stick_gradient(pair, torch.zeros(1, 2))           # Δ = −1, π = ½
        tensor([[0.5000, 0.5000]])
    """
    k = torch.arange(phi.shape[-1], device=phi.device)
    short = torch.minimum(pair.k, pair.k_tilde).unsqueeze(-1)
    long = torch.maximum(pair.k, pair.k_tilde).unsqueeze(-1)
    at_split = -(k == short).to(phi.dtype) * torch.sigmoid(phi.abs())
    only_long = ((k == long).to(phi.dtype) - torch.sigmoid(phi)) * ((k > short) & (k <= long)).to(phi.dtype)
    return _half_difference(pair) * (at_split + only_long)


def _score(k: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``∂ log q(z)/∂φ`` of the sample stopping at ``k``: ``1[j = k] − π_j 1[j ≤ k]``."""
    j = torch.arange(phi.shape[-1], device=phi.device)
    k = k.unsqueeze(-1)
    return (j == k).to(phi.dtype) - torch.sigmoid(phi) * (j <= k).to(phi.dtype)


def importance_weighted_stick_gradient(pair: Pair, phi: torch.Tensor) -> torch.Tensor:
    """``½ w (f(z) − f(z̃)) (∇_φ log q(z) − ∇_φ log q(z̃))`` for the stick-breaking coupling.

    Examples:
        >>> pair = Pair(torch.tensor([[3.0]]), torch.tensor([[1.0]]), torch.tensor([0]), torch.tensor([2]))
        >>> importance_weighted_stick_gradient(pair, torch.zeros(1, 2))   # m = 0: w = σ(0)
        tensor([[0.5000, 0.2500]])
    """
    j = torch.arange(phi.shape[-1], device=phi.device)
    short = torch.minimum(pair.k, pair.k_tilde).unsqueeze(-1)
    both_go_on = 2 * F.logsigmoid(-phi) - torch.log(torch.tanh(-phi / 2).clamp_min(torch.finfo(phi.dtype).tiny))
    log_w = torch.where(j < short, both_go_on, 0.0).sum(-1, keepdim=True)
    split = torch.where(j == short, F.logsigmoid(phi.abs()), 0.0).sum(-1, keepdim=True)
    disagree = (pair.k != pair.k_tilde).unsqueeze(-1)
    w = torch.where(disagree, torch.exp(log_w + split), 0.0)  # K = K̃: no term (and no weight to read)
    return 0.5 * w * (pair.f - pair.f_tilde) * (_score(pair.k, phi) - _score(pair.k_tilde, phi))


def logit_gradient(g_phi: torch.Tensor, sorted_theta: torch.Tensor) -> torch.Tensor:
    """``Σ_k g_φ_k ∂φ_k/∂θ`` in stick order: ``∂φ_k/∂θ_j = 1[j = k] − 1[j > k] p_j / Σ_{i>k} p_i``.

    Examples:
        >>> logit_gradient(torch.tensor([1.0, 0.0]), torch.zeros(3))    # Σ_j = 0: a shift changes nothing
        tensor([ 1.0000, -0.5000, -0.5000])
    """
    c = sorted_theta.shape[-1]
    tails = torch.logcumsumexp(sorted_theta.flip(-1), -1).flip(-1)[..., 1:]  # logsumexp_{j>k}, k < C − 1
    later = torch.ones(c - 1, c, dtype=torch.bool, device=sorted_theta.device).triu(1)  # j > k
    share = torch.where(later, sorted_theta.unsqueeze(-2) - tails.unsqueeze(-1), -torch.inf).exp()  # (…, C−1, C)
    padded = F.pad(g_phi, (0, 1))
    return padded - (g_phi.unsqueeze(-1) * share).sum(-2)


# ------------------------------------------------------------------------------ the methods
class _Draw(NamedTuple):
    """What the estimator needs besides the samples: the stop positions and the order."""

    positions: torch.Tensor  # (n, 2, *parameter plates, *batch)
    order: torch.Tensor  # (*parameter plates, *batch, C)


class _CoupledCategoricalBase(Method, ABC):
    """Shared sampling and surrogate term of the coupled categorical estimators."""

    def __init__(self, plate_name: str, n_samples: int = 1, ordering: str = "descending") -> None:
        super().__init__(plate_name, None, n_samples)
        if not isinstance(ordering, str) or ordering not in ORDERINGS:
            raise ValueError(
                f"{type(self).__name__}({plate_name!r}): ordering must be one of {sorted(ORDERINGS)}, "
                f"got {ordering!r}."
            )
        self.ordering = ordering
        self._draws = GroupRecords(type(self).__name__, "stick-breaking pairs")

    def check_distribution(self, distr: Distribution) -> None:
        check_categorical(f"{type(self).__name__}({self.plate_name!r})", distr)

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        theta = categorical_logits(distr).detach()  # type: ignore[arg-type]
        order = ORDERINGS[self.ordering](theta)
        positions = stick_breaking_pairs(stick_breaking_logits(theta.gather(-1, order)), amt_samples)
        index = order.expand((amt_samples, 2) + tuple(order.shape)).gather(-1, positions.unsqueeze(-1))
        categories = flatten_groups(index.squeeze(-1))
        if isinstance(distr, OneHotCategorical):
            samples = F.one_hot(categories, theta.shape[-1]).to(theta.dtype)
        else:
            samples = categories
        self._draws.keep(samples, _Draw(positions, order))
        return samples

    def weighting_function(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        return group_weights(amt_samples // 2, [0.5, 0.5])

    @abstractmethod
    def _gradient(self, pair: Pair, phi: torch.Tensor) -> torch.Tensor:
        """``g_φ`` over the ``C − 1`` decisions, plain tensors laid out alike."""

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(θ − stopgrad θ) · stopgrad(g_θ)``, summed over the variables, for both points of a pair.

        Computed on plain values laid out as ``[pairs, *other plates of the cost, *batch, C]``.
        """
        plate, cost_layout = tensor.plate, layout_of(cost)
        groups = group_plate(plate, 2)
        target = cost_target(groups, plate, cost)
        theta = categorical_logits(tensor.distribution)  # type: ignore[arg-type]
        theta_layout = check_logit_plates(f"{type(self).__name__}({self.plate_name!r})", theta, cost, target)
        draw: _Draw = self._draws.of(tensor)
        node_plates = node_of(tensor).layout.plates[1:]
        i = cost_layout.position(plate)
        with no_dispatch():
            theta, n_event = aligned_logits(theta, theta_layout, target)  # n_event: *batch, C
            order = align_to(wrap(draw.order, layout_of_plates(node_plates)), target) if node_plates else draw.order
            shape = torch.broadcast_shapes(theta.shape, order.shape)
            sorted_theta = theta.detach().expand(shape).gather(-1, order.expand(shape))
            per_group = layout_of_plates((groups,) + tuple(node_plates))
            k, k_tilde = (align_to(wrap(draw.positions[:, j], per_group), target) for j in (0, 1))
            c = points_first(cost, i)
            c = c.reshape((groups.size, 2) + tuple(c.shape[1:]) + (1,) * n_event)
            pair = Pair(c[:, 0], c[:, 1], k, k_tilde)
            g_phi = self._gradient(pair, stick_breaking_logits(sorted_theta))
            g_sorted = logit_gradient(g_phi, sorted_theta)
            g_theta = torch.zeros_like(g_sorted).scatter(-1, order.expand(g_sorted.shape), g_sorted)
            term = on_every_point(control_variate_term(theta, g_theta, n_event), target, plate, 2, i)
        return None, wrap(term, cost_layout)

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}, ordering={self.ordering!r}"


class CoupledCategorical(_CoupledCategoricalBase):
    """Stick-breaking DisARM for ``Categorical`` / ``OneHotCategorical`` nodes (Dong, Mnih & Tucker 2021).

    Each categorical is coded as ``C − 1`` binary stop/go decisions along an ordering of its
    categories; the pair ``z, z̃`` comes from antithetic uniforms ``u, 1 − u`` on the decisions, and
    the gradient is DisARM's along the decisions, with those a sample never reads integrated out
    (see the module). The plate holds ``2 · n_samples`` points, ``[z, z̃]`` per pair, each weighted
    ``1/(2n)``: 2 cost evaluations per pair. ``C = 2`` is `storch.method.arm.DisARM`.
    Unbiased for the first-order gradient with respect to the logits (or ``probs``); the term is
    linear in the normalised logits, so ``backward(create_graph=True)`` leaves it out of second
    derivatives.

    Args:
        plate_name: node / plate name.
        n_samples: the number of antithetic pairs.
        ordering: the order of the categories along the stick: ``"descending"`` (most probable
            first, the default), ``"ascending"`` or ``"given"`` (index order); chosen per variable
            from the current logits (any fixed rule keeps the estimate unbiased).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> _ = torch.manual_seed(0)
        >>> theta = torch.tensor([0.2, -0.4, 0.9, 0.0], requires_grad=True)
        >>> z = CoupledCategorical("z", n_samples=4000)(OneHotCategorical(logits=theta))
        >>> z.shape                                          # [z, z̃] for each of 4000 pairs
        torch.Size([8000, 4])
        >>> values = torch.tensor([1.0, -2.0, 0.5, 3.0])
        >>> storch.add_cost((z * values).sum(-1) ** 2, "f")
        >>> _ = storch.backward()
        >>> p = theta.detach().softmax(-1)                   # ∂/∂θ Σ_k p_k v_k²
        >>> exact = p * (values**2 - (p * values**2).sum())
        >>> bool(torch.allclose(theta.grad, exact, atol=0.06))
        True
    """

    def _gradient(self, pair: Pair, phi: torch.Tensor) -> torch.Tensor:
        return disarm_stick_gradient(pair, phi)


class CoupledCategoricalIW(_CoupledCategoricalBase):
    """The importance-weighted coupled estimator with the stick-breaking coupling (Dong, Mnih &
    Tucker 2021): ``½ w (f(z) − f(z̃)) (∇ log q(z) − ∇ log q(z̃))``, ``w = q(z) q(z̃)/q(z, z̃)``.

    The same pairs and evaluation groups as
    `storch.method.coupled_categorical.CoupledCategorical` (2 cost evaluations
    per pair); ``C = 2`` is `storch.method.arm.DisARM`. The weight needs ``q(z, z̃) > 0``
    for every two distinct values: both samples must be able to pass every decision but the last,
    ``π_k < ½`` for ``k < C − 2``. Ascending order (least probable first) guarantees it (each
    category is outweighed by the two or more after it, ``π_k ≤ ⅓``), so this estimator always uses
    it; in another order a decision with ``π_k ≥ ½`` is passed by at most one sample, and the pairs
    beyond it are never drawn (biased: measured, and tested). First order only.

    Args:
        plate_name: node / plate name.
        n_samples: the number of antithetic pairs.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Categorical
        >>> theta = torch.tensor([0.2, -0.4, 0.9], requires_grad=True)
        >>> z = CoupledCategoricalIW("z", n_samples=3)(Categorical(logits=theta))
        >>> z.shape, z.plate_names
        (torch.Size([6]), ['z'])
        >>> storch.add_cost(z.float(), "f")
        >>> _ = storch.backward()
        >>> theta.grad.shape
        torch.Size([3])
    """

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name, n_samples, "ascending")

    def _gradient(self, pair: Pair, phi: torch.Tensor) -> torch.Tensor:
        return importance_weighted_stick_gradient(pair, phi)
