"""CARMS: antithetic REINFORCE over ``n`` mutually antithetic categorical samples.

Dimitriev & Zhou 2021, "CARMS: Categorical-Antithetic-REINFORCE Multi-Sample Gradient Estimator"
(NeurIPS). For logits ``φ`` (``p = softmax φ``), draw ``n ≥ 2`` samples ``b_1..b_n``, each a
``Cat(p)`` sample, that are mutually antithetic, and weight each ordered pair by the ratio of the
independent joint law to the copula's:

    g_φ = 1/(n(n − 1)) Σ_{i≠j} w(b_i, b_j) (f(b_i) − f(b_j)) (e_{b_i} − p)
    w(a, c) = p_a p_c / P(b_i = a, b_j = c)

Why it is unbiased: for a pair, ``E[w (f(b_i) − f(b_j)) (e_{b_i} − p)]`` is the same expectation under
*independent* ``b_i, b_j ~ Cat(p)``, where ``f(b_j)`` is a zero-mean baseline and
``E[f(b_i)(e_{b_i} − p)] = ∇_φ E f``. With several variables (factorised, each with its own
copulas) the weight is that of the variable's own pair; pairs that agree on a variable cancel in
the sum over ``(i, j)`` and ``(j, i)``, so ``w(a, a)`` is never needed (set to 0). Independent
samples give ``w = 1``: leave-one-out REINFORCE.

**The samples: stick breaking** (one of the constructions of the paper's code, the one with a
closed-form joint law). Sort the categories by increasing probability; category ``k`` (in that
order) is chosen by a sample that reaches it with probability ``π_k = p_k / Σ_{m≥k} p_m``
(``logit π_k = φ_k − logsumexp_{m>k} φ_m``). Each stick is a Bernoulli decision drawn for all ``n``
samples from an ARMS copula (`storch.method.arms`), independently across sticks and variables.
Sorting makes every stick but the last a minority decision (``π_k ≤ 1/3``), so two samples go on
past it together with positive probability and every pair ``a ≠ c`` has ``P(a, c) > 0`` (which
unbiasedness needs); the last two categories, where the order does not matter, are taken by
decreasing index, so that with two categories the stick is ARMS's ``b = 1[category 1]``. With
``D_k = P(b_i stops at k, b_j goes on)`` (ARMS's disagreement probability of the copula at
``π_k``) and ``a`` before ``c``:

    P(a, c) = Π_{k<a} (1 − π_k − D_k) · D_a · Π_{a<k<c} (1 − π_k) · π_c
    w(a, c) = Π_{k<a} (1 − π_k)² / (1 − π_k − D_k) · π_a (1 − π_a) / D_a

For ``C = 2`` there is one stick at the minority category and ``w = p (1 − p)/D``: CARMS is ARMS
on the same copula draws. The paper's experiments use two other constructions (inverse CDF with
random category orders, and Gumbel-max with a Monte Carlo estimate of the joint law); the
estimator is the same.

**Evaluations:** ``n`` per draw, whatever the number of variables. In the surrogate the
control-variate term ``(φ − stopgrad φ) · stopgrad(g_φ)`` (summed over variables and categories)
is zero in the forward pass and has gradient ``g_φ``. Unbiased for **first-order** derivatives
only: as for ARSM (`storch.method.arsm`), ``backward(create_graph=True)`` differentiates only the
chain rule through the normalised logits, and second derivatives are not estimated.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributions import Distribution

from storch.extend import CostTensor, StochasticTensor, align_to, layout_of, no_dispatch, node_of, wrap
from storch.method.antithetic import (
    aligned_logits, categorical_logits, check_antithetic_count, check_categorical, check_logit_plates,
    control_variate_term, cost_target, on_every_point, points_first,
)
from storch.method.arms import COPULAS, Copula, check_copula
from storch.method.arsm import as_samples, sample_index
from storch.method.method import Method

__all__ = ["CARMS", "carms_logit_gradient", "carms_samples", "pair_weights"]


def stick_logits(phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The categories by increasing probability, the last two by decreasing index ``(*S, C)``, and
    the logits of their sticks ``logit π_k = φ_k − logsumexp_{m>k} φ_m``, ``(*S, C − 1)``."""
    order = phi.argsort(dim=-1, stable=True)
    order = torch.cat([order[..., :-2], order[..., -2:].sort(-1, descending=True).values], -1)
    s = phi.gather(-1, order)
    tail = s.flip(-1).logcumsumexp(-1).flip(-1)  # logsumexp_{m≥k}
    return order, s[..., :-1] - tail[..., 1:]


def carms_samples(phi: torch.Tensor, n: int, copula: Copula) -> torch.Tensor:
    """``n`` mutually antithetic category indices ``(n, *S)`` for logits ``(*S, C)``.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> b = carms_samples(torch.tensor([0.0, 1.0, -1.0]).expand(20000, 3), 4, COPULAS["dirichlet"])
        >>> b.shape
        torch.Size([4, 20000])
        >>> frequency = torch.bincount(b.flatten(), minlength=3) / b.numel()
        >>> bool(torch.allclose(frequency, torch.tensor([0.0, 1.0, -1.0]).softmax(-1), atol=0.01))
        True
    """
    order, sticks = stick_logits(phi)
    stop = copula.uniforms(sticks, n) < torch.sigmoid(sticks)  # (n, *S, C − 1)
    stop = torch.cat([stop, torch.ones_like(stop[..., :1])], -1).to(phi.dtype)
    rank = stop.argmax(-1, keepdim=True)  # the first stick where the sample stops
    return order.expand(rank.shape[:-1] + order.shape[-1:]).gather(-1, rank).squeeze(-1)


def pair_weights(phi: torch.Tensor, n: int, copula: Copula) -> tuple[torch.Tensor, torch.Tensor]:
    """``w(a, c) = ρ[min(rank a, rank c)]`` for ``a ≠ c``: the rank of each category ``(*S, C)`` and
    ``ρ`` ``(*S, C)`` (its last entry unused, 0).

    Examples:
        >>> phi = torch.tensor([0.4, -0.7])                 # C = 2: ARMS's p (1 − p)/D
        >>> rank, rho = pair_weights(phi, 3, COPULAS["dirichlet"])
        >>> p = torch.sigmoid(phi[1] - phi[0])
        >>> bool(torch.isclose(rho[0], p * (1 - p) / COPULAS["dirichlet"].disagreement(phi[1] - phi[0], 3)))
        True
    """
    order, sticks = stick_logits(phi)
    d = copula.disagreement(sticks, n)
    both_go_on = torch.sigmoid(-sticks) - d
    log_pass = 2 * F.logsigmoid(-sticks) - both_go_on.clamp_min(0).log()  # −inf or +inf at impossible pairs
    before = torch.cat([torch.zeros_like(log_pass[..., :1]), log_pass[..., :-1].cumsum(-1)], -1)
    log_rho = before + F.logsigmoid(sticks) + F.logsigmoid(-sticks) - d.log()
    rho = torch.where(torch.isfinite(log_rho), log_rho.exp(), torch.zeros_like(log_rho))
    rho = torch.cat([rho, torch.zeros_like(rho[..., :1])], -1)
    return order.argsort(-1), rho


def _lead(t: torch.Tensor, dims: int) -> torch.Tensor:
    """``t`` with leading dimensions of size 1 up to ``dims`` dimensions."""
    return t.reshape((1,) * (dims - t.dim()) + tuple(t.shape))


def carms_logit_gradient(costs: torch.Tensor, index: torch.Tensor, phi: torch.Tensor, copula: Copula) -> torch.Tensor:
    """``g_φ = 1/(n(n−1)) Σ_{i≠j} w(b_i, b_j)(f_i − f_j)(e_{b_i} − p)``, plain tensors, samples first.

    Args:
        costs: ``f(b_i)``, ``(n, ..., 1)``, broadcastable against ``index`` with a category dimension.
        index: the samples' category indices ``(n, ...)``.
        phi: the (detached) logits ``(..., C)``, broadcastable against one sample.
        copula: the copula that drew the samples.

    Examples:
        >>> b = torch.tensor([1, 0])                        # C = 2, p = ½: ARMS's antithetic pair
        >>> carms_logit_gradient(torch.tensor([[3.0], [1.0]]), b, torch.zeros(2), COPULAS["dirichlet"])
        tensor([-0.5000,  0.5000])
    """
    n = index.shape[0]
    rank, rho = pair_weights(phi, n, copula)
    r = torch.take_along_dim(_lead(rank, index.dim() + 1), index.unsqueeze(-1), -1)  # (n, ..., 1)
    low = torch.minimum(r.unsqueeze(1), r.unsqueeze(0))
    w = torch.take_along_dim(_lead(rho, low.dim()), low, -1)  # (n, n, ..., 1)
    w = w * (r.unsqueeze(1) != r.unsqueeze(0))
    a = (w * (costs.unsqueeze(1) - costs.unsqueeze(0))).sum(1)  # Σ_j w_ij (f_i − f_j)
    score = F.one_hot(index, phi.shape[-1]).to(phi.dtype) - torch.softmax(phi, -1)
    return (a * score).sum(0) / (n * (n - 1))


class CARMS(Method):
    """CARMS for ``OneHotCategorical`` and ``Categorical`` nodes: ``n`` mutually antithetic samples
    (stick breaking over ARMS copulas), leave-one-out REINFORCE weighted by ``p_a p_c / P(a, c)``
    (see the module).

    The plate holds the ``n`` samples of one draw, each weighted ``1/n`` (``n`` cost evaluations,
    whatever the number of variables). With two categories it is `storch.method.arms.ARMS`;
    ``copula="independent"`` is leave-one-out REINFORCE. Unbiased for the first-order gradient with
    respect to the logits (or, by the chain rule, ``probs``); not for higher orders.

    Args:
        plate_name: node / plate name.
        n_samples: ``n ≥ 2``, the mutually antithetic samples.
        copula: the copula of each stick: ``"dirichlet"`` (default, the paper's choice), ``"gaussian"``
            or ``"independent"``.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> _ = torch.manual_seed(0)
        >>> theta = torch.tensor([0.2, -0.4, 0.9], requires_grad=True)
        >>> logits = storch.denote_independent(theta.expand(4000, 3), 0, "data")
        >>> z = CARMS("z", n_samples=4)(OneHotCategorical(logits=logits))
        >>> z.shape, z.plate_names
        (torch.Size([4, 4000, 3]), ['z', 'data'])
        >>> values = torch.tensor([1.0, -2.0, 0.5])
        >>> storch.add_cost((z * values).sum(-1) ** 2, "f")
        >>> _ = storch.backward()
        >>> p = theta.softmax(-1)
        >>> exact = p * (values**2 - (p * values**2).sum())
        >>> bool(torch.allclose(theta.grad, exact, atol=0.02))
        True
    """

    def __init__(self, plate_name: str, n_samples: int = 2, copula: str = "dirichlet") -> None:
        owner = f"CARMS({plate_name!r})"
        n_samples = check_antithetic_count(owner, n_samples)
        copula = check_copula(owner, copula)
        super().__init__(plate_name, None, n_samples)
        self.copula = copula

    def check_distribution(self, distr: Distribution) -> None:
        check_categorical(f"CARMS({self.plate_name!r})", distr)

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        phi = categorical_logits(distr).detach()  # type: ignore[arg-type]
        return as_samples(distr, carms_samples(phi, amt_samples, COPULAS[self.copula]), phi)

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(φ − stopgrad φ) · stopgrad(g_φ)``, summed over variables and categories, on every point;
        computed on plain values laid out as ``[plate, *other plates of the cost, ...]``."""
        plate, node, cost_layout = tensor.plate, node_of(tensor), layout_of(cost)
        target = cost_target(plate, plate, cost)
        phi = categorical_logits(tensor.distribution)  # type: ignore[arg-type]
        phi_layout = check_logit_plates(f"CARMS({self.plate_name!r})", phi, cost, target)
        i = cost_layout.position(plate)
        with no_dispatch():
            phi, n_event = aligned_logits(phi, phi_layout, target)
            index = sample_index(tensor.distribution, align_to(wrap(node.samples, node.layout), target))
            c = points_first(cost, i)
            c = c.reshape(tuple(c.shape) + (1,) * n_event)
            g = carms_logit_gradient(c, index, phi.detach(), COPULAS[self.copula])
            term = on_every_point(control_variate_term(phi, g, n_event), target, plate, 1, i)
        return None, wrap(term, cost_layout)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, copula={self.copula!r}"
