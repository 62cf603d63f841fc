"""ARMS: antithetic REINFORCE over ``n`` mutually antithetic samples of Bernoulli logits.

Dimitriev & Zhou 2021, "ARMS: Antithetic-REINFORCE-Multi-Sample Gradient for Binary Variables"
(ICML). For logits ``φ`` (``p = σ(φ)``), draw ``n ≥ 2`` uniforms ``u_1..u_n`` from a copula (each
``u_i ~ U(0, 1)``, pairwise negatively dependent), one copula per coordinate, and set
``b_i = 1[u_i < p]``: every ``b_i`` is a ``Bernoulli(p)`` sample. Per coordinate ``d``:

    g_φ = c(φ) / (n − 1) · Σ_i (f(b_i) − f̄) (b_i − p),     f̄ = (1/n) Σ_j f(b_j)
    c(φ) = p (1 − p) / P(b_i = 1, b_j = 0)                   (any i ≠ j)

Why it is unbiased: ``b_i − p = ∇_φ log q(b_i)``. With ``f(b) = f(b_{−d}, 0) + Δ_d(b_{−d}) b_d``
and the copulas of different coordinates independent, ``E[f(b_i)(b_{id} − p)] = E[Δ_d] p(1 − p)``
and, for ``j ≠ i``, ``E[f(b_j)(b_{id} − p)] = E[Δ_d] Cov(b_{id}, b_{jd})``. The leave-one-out sum
therefore has mean ``E[Δ_d] (p(1 − p) − Cov) = E[Δ_d] P(b_i = 1, b_j = 0)``, and ``c`` rescales it
to ``∂E f/∂φ_d = E[Δ_d] p(1 − p)``. Independent uniforms give ``c = 1``: leave-one-out REINFORCE.

Copulas (`COPULAS`):

* ``"dirichlet"`` (the paper's default): ``d ~ Dirichlet(1_n)`` (uniform spacings of ``n − 1``
  uniforms), ``w_i = (1 − d_i)^{n−1}`` (uniform: ``d_i ~ Beta(1, n − 1)``); ``u = w`` where
  ``p < ½`` and ``u = 1 − w`` elsewhere, so that at most one sample is in the minority when
  ``min(p, 1 − p) ≤ 2^{1−n}``. With ``m = min(p, 1 − p)``:
  ``P(b_i = 1, b_j = 0) = m − max(0, 2 m^{1/(n−1)} − 1)^{n−1}``.
* ``"gaussian"``: ``u_i = Φ(z_i)``, ``z ~ N(0, Σ)`` with unit variances and correlations
  ``−1/(n−1)`` (``z = √(n/(n−1)) (ε − ε̄)``, ``ε ~ N(0, I)``). With ``h = Φ⁻¹(p)`` and
  ``r = −1/(n−1)``, Plackett's identity gives
  ``P(b_i = 1, b_j = 0) = p(1 − p) + (1/2π) ∫_{asin r}^{0} exp(−h²/(1 + sin t)) dt``
  (Gauss–Legendre quadrature, 48 nodes).
* ``"independent"``: i.i.d. uniforms, ``P(b_i = 1, b_j = 0) = p(1 − p)``: leave-one-out REINFORCE,
  for comparison.

With ``n = 2`` both antithetic copulas give ``u_2 = 1 − u_1`` and ``c = σ(|φ|)``: ARMS is then
DisARM, ``½ (f(b_1) − f(b_2)) (b_1 − b_2) σ(|φ|)``.

Multi-sample bounds (`storch.method.arms.ARMSMultiSample`, the paper's §4). For
``L = log (1/K) Σ_k w(b_k)`` over ``K`` i.i.d. samples, ``∇_φ E L = Σ_k ∇_{φ_k} E L`` (a parameter
copy per sample); for each ``k`` the bound is a function of one Bernoulli vector given the others,
``g_k(b) = L(b_{−k}, b)``, whose gradient ARMS estimates from ``K`` copula samples ``b̃_1..b̃_K``
(shared by all ``k``). The sum over ``k`` is ARMS with the costs ``Σ_k g_k(b̃_j)`` of the copula
samples; ``2K`` evaluations of ``w``. The pathwise part (``w``'s own dependence on ``φ``) flows
through the bound of the i.i.d. samples.

In the surrogate there is no gradient function; the control-variate term
``(φ − stopgrad φ) · stopgrad(g_φ)``, summed over the coordinates, is zero in the forward pass and
has gradient ``g_φ``. Unbiased for **first-order** derivatives only: the term is linear in ``φ``,
so ``storch.backward(create_graph=True)`` gives second derivatives without its contribution
(DisARM's construction has the same limit). The copula's joint distribution of ``b_1..b_n`` is not
a product, so a DiCE-style score of the samples is not available here.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributions import Distribution

from storch.extend import (
    CostTensor, Plate, StochasticTensor, Tensor, align_to, layout_of, no_dispatch, node_of, wrap, wrap_new,
)
from storch.inference import add_cost
from storch.method.antithetic import (
    aligned_logits, check_antithetic_count, check_bernoulli, check_logit_plates, control_variate_term, cost_target,
    on_every_point,
)
from storch.method.arm import bernoulli_logits
from storch.method.method import JointBoundRecords, Method

__all__ = ["ARMS", "ARMSMultiSample", "COPULAS", "Copula", "arms_iwae_bound", "arms_logit_gradient", "check_copula"]


# ------------------------------------------------------------------------------------- copulas
class Copula(ABC):
    """``n`` uniforms per coordinate, and the probability that two of their samples disagree."""

    @abstractmethod
    def uniforms(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        """``(n, *phi.shape)`` uniforms, each ``U(0, 1)``; ``phi`` (the logits) may orient them."""

    @abstractmethod
    def disagreement(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        """``P(b_i = 1, b_j = 0)`` for ``i ≠ j``, ``b = 1[u < σ(φ)]``, per coordinate of ``phi``."""


class DirichletCopula(Copula):
    """``w_i = (1 − d_i)^{n−1}``, ``d ~ Dirichlet(1_n)``; ``u = w`` where ``p < ½``, else ``1 − w``.

    Examples:
        >>> phi = torch.tensor([0.0, 3.0])
        >>> DirichletCopula().disagreement(phi, 2)          # min(p, 1 − p): DisARM's pair
        tensor([0.5000, 0.0474])
    """

    def uniforms(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        v = torch.rand((n - 1,) + tuple(phi.shape), dtype=phi.dtype, device=phi.device)
        edges = torch.cat([torch.zeros_like(v[:1]), v.sort(0).values, torch.ones_like(v[:1])])
        w = (1 - edges.diff(dim=0)) ** (n - 1)
        # w.flip(0): the same law (the samples are exchangeable); with it n = 2 gives DisARM's
        # pair in DisARM's order, (v, 1 − v), on either side of ½
        return torch.where(phi < 0, w.flip(0), 1 - w)

    def disagreement(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        log_m = F.logsigmoid(-phi.abs())  # log min(p, 1 − p)
        both = (1 + 2 * torch.expm1(log_m / (n - 1))).clamp_min(0) ** (n - 1)  # both in the minority
        return log_m.exp() - both


@functools.lru_cache(maxsize=8)
def _legendre(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """48 Gauss–Legendre nodes and weights on ``[−1, 1]``, float64, on ``device`` (copied once)."""
    nodes, weights = np.polynomial.legendre.leggauss(48)
    return torch.from_numpy(nodes).to(device), torch.from_numpy(weights).to(device)


class GaussianCopula(Copula):
    """``u_i = Φ(z_i)``, ``z`` standard normal with correlations ``−1/(n−1)``.

    Examples:
        >>> phi = torch.tensor([0.0, 3.0])
        >>> GaussianCopula().disagreement(phi, 2)           # min(p, 1 − p): DisARM's pair
        tensor([0.5000, 0.0474])
    """

    def uniforms(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        eps = torch.randn((n,) + tuple(phi.shape), dtype=phi.dtype, device=phi.device)
        return torch.special.ndtr((eps - eps.mean(0)) * math.sqrt(n / (n - 1)))

    def disagreement(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        x = phi.abs().double()
        m = torch.sigmoid(-x)  # symmetric in p ↔ 1 − p: take the side where Φ⁻¹ is accurate
        h2 = torch.special.ndtri(m).square().unsqueeze(-1)
        nodes, weights = _legendre(x.device)
        low = math.asin(-1 / (n - 1))
        t = (low / 2) * (1 - nodes)  # the nodes mapped onto [asin r, 0]
        integrand = torch.exp(-h2 / (1 + torch.sin(t)))
        integral = (-low / 2) * (integrand * weights).sum(-1) / (2 * math.pi)
        return (m * (1 - m) + integral).to(phi.dtype)


class IndependentCopula(Copula):
    """I.i.d. uniforms: ARMS is then leave-one-out REINFORCE."""

    def uniforms(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        return torch.rand((n,) + tuple(phi.shape), dtype=phi.dtype, device=phi.device)

    def disagreement(self, phi: torch.Tensor, n: int) -> torch.Tensor:
        return torch.sigmoid(phi) * torch.sigmoid(-phi)


#: the copulas by the name ``ARMS(..., copula=name)`` takes
COPULAS: dict[str, Copula] = {
    "dirichlet": DirichletCopula(),
    "gaussian": GaussianCopula(),
    "independent": IndependentCopula(),
}


def arms_logit_gradient(costs: torch.Tensor, samples: torch.Tensor, phi: torch.Tensor, copula: Copula) -> torch.Tensor:
    """``g_φ = c(φ)/(n − 1) Σ_i (f_i − f̄)(b_i − σ(φ))``, plain tensors, the ``n`` samples first.

    Args:
        costs: ``f(b_i)``, ``(n, ...)``, broadcastable against ``samples``.
        samples: the copula's samples ``b_i``, ``(n, ...)``.
        phi: the (detached) logits, broadcastable against one sample.
        copula: the copula that drew the samples.

    Examples:
        >>> b = torch.tensor([[1.0], [0.0]])                # an antithetic pair, p = σ(0) = ½
        >>> arms_logit_gradient(torch.tensor([[3.0], [1.0]]), b, torch.zeros(1), COPULAS["dirichlet"])
        tensor([0.5000])
    """
    n = samples.shape[0]
    centred = costs - costs.mean(0, keepdim=True)
    loo = (centred * (samples - torch.sigmoid(phi))).sum(0) / (n - 1)
    return loo * (torch.sigmoid(phi) * torch.sigmoid(-phi) / copula.disagreement(phi, n))


def check_copula(owner: str, copula: str) -> str:
    """``copula``, checked to be the name of one of `COPULAS`; ``owner`` names the method."""
    if not isinstance(copula, str) or copula not in COPULAS:
        raise ValueError(f"{owner}: copula must be one of {sorted(COPULAS)}, got {copula!r}.")
    return copula


# ------------------------------------------------------------------------------------- methods
class _ARMSBase(Method, ABC):
    """Sampling checks and the surrogate term shared by ARMS and its multi-sample-bound variant."""

    def __init__(self, plate_name: str, n_samples: int, copula: str) -> None:
        owner = f"{type(self).__name__}({plate_name!r})"
        super().__init__(plate_name, None, check_antithetic_count(owner, n_samples))
        self.copula = check_copula(owner, copula)

    def check_distribution(self, distr: Distribution) -> None:
        check_bernoulli(f"{type(self).__name__}({self.plate_name!r})", distr)

    def _copula_samples(self, phi: torch.Tensor) -> torch.Tensor:
        u = COPULAS[self.copula].uniforms(phi, self.n_samples)
        return (u < torch.sigmoid(phi)).to(phi.dtype)

    @abstractmethod
    def _copula_costs(self, tensor: StochasticTensor, cost: CostTensor) -> torch.Tensor:
        """The costs to pair with the copula's samples: a plain tensor laid out like ``cost``,
        its last ``n_samples`` points along the node's plate."""

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(φ − stopgrad φ) · stopgrad(g_φ)``, summed over the coordinates, on every point.

        Computed on plain values laid out as ``[plate, *other plates of the cost, *coordinates]``.
        """
        plate, node = tensor.plate, node_of(tensor)
        cost_layout = layout_of(cost)
        target = cost_target(plate, plate, cost)
        phi = bernoulli_logits(tensor.distribution)  # type: ignore[arg-type]
        phi_layout = check_logit_plates(f"{type(self).__name__}({self.plate_name!r})", phi, cost, target)
        i, n = cost_layout.position(plate), self.n_samples
        costs = self._copula_costs(tensor, cost)
        with no_dispatch():
            phi, n_event = aligned_logits(phi, phi_layout, target)
            b = align_to(wrap(node.samples, node.layout), target)[-n:]
            c = costs.movedim(i, 0) if i else costs
            c = c[-n:].reshape(tuple(c[-n:].shape) + (1,) * n_event)
            g = arms_logit_gradient(c, b, phi.detach(), COPULAS[self.copula])
            term = on_every_point(control_variate_term(phi, g, n_event), target, plate, 1, i)
        return None, wrap(term, cost_layout)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, copula={self.copula!r}"


class ARMS(_ARMSBase):
    """ARMS for ``Bernoulli`` nodes: ``n`` mutually antithetic samples, leave-one-out REINFORCE
    over them, rescaled by ``c(φ) = p(1 − p)/P(b_i = 1, b_j = 0)`` (see the module).

    The plate holds the ``n`` samples of one copula draw, each weighted ``1/n`` (``n`` cost
    evaluations). ``n = 2`` is `storch.method.arm.DisARM`; ``copula="independent"`` is
    leave-one-out REINFORCE. Unbiased for the first-order gradient with respect to the logits (or,
    by the chain rule, ``probs``); not for higher orders (``backward(create_graph=True)`` leaves
    this node's estimate out of second derivatives).

    Args:
        plate_name: node / plate name.
        n_samples: ``n ≥ 2``, the mutually antithetic samples.
        copula: ``"dirichlet"`` (default, the paper's choice), ``"gaussian"`` or ``"independent"``.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> _ = torch.manual_seed(0)
        >>> phi = torch.tensor([0.3, -0.5], requires_grad=True)
        >>> logits = storch.denote_independent(phi.expand(2000, 2), 0, "data")
        >>> b = ARMS("b", n_samples=4)(Bernoulli(logits=logits))
        >>> b.shape, b.plate_names                    # 4 antithetic samples per data point
        (torch.Size([4, 2000, 2]), ['b', 'data'])
        >>> storch.add_cost(((b - 0.4) ** 2).sum(-1), "f")
        >>> _ = storch.backward()
        >>> exact = 0.2 * torch.sigmoid(phi) * torch.sigmoid(-phi)   # ∂/∂φ [0.16 + 0.2 σ(φ)]
        >>> bool(torch.allclose(phi.grad, exact, atol=0.005))
        True
    """

    def __init__(self, plate_name: str, n_samples: int = 2, copula: str = "dirichlet") -> None:
        super().__init__(plate_name, n_samples, copula)

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        return self._copula_samples(bernoulli_logits(distr).detach())  # type: ignore[arg-type]

    def _copula_costs(self, tensor: StochasticTensor, cost: CostTensor) -> torch.Tensor:
        with no_dispatch():
            return cost.detach()


@dataclass
class _Bound:
    plate: Plate
    costs: Tensor  # per point; on the copula's points Σ_k −L(b_{−k}, b̃_j), detached


class ARMSMultiSample(JointBoundRecords, _ARMSBase):
    """ARMS for multi-sample bounds ``L = log (1/K) Σ_k w(b_k)`` of ``K`` i.i.d. Bernoulli samples.

    The plate holds ``2K`` points: the ``K`` i.i.d. samples ``b_k`` of the bound, then the ``K``
    copula samples ``b̃_j`` (``2K`` evaluations of ``w``, one vectorised pass). Register the bound
    with `storch.method.arms.arms_iwae_bound` (not `iwae_bound`); the gradient
    is then ``Σ_k`` ARMS of ``b ↦ L(b_{−k}, b)`` over the copula samples, plus the pathwise part of
    ``w``. A per-sample cost downstream of the node is averaged over all ``2K`` points and its
    gradient is ARMS over the copula samples. First order only, like `storch.method.arms.ARMS`.

    Args:
        plate_name: node / plate name.
        n_samples: ``K ≥ 2``, the samples inside the bound (and the copula's samples).
        copula: as for `storch.method.arms.ARMS`.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> phi = torch.zeros(2, requires_grad=True)
        >>> z = ARMSMultiSample("z", n_samples=3)(Bernoulli(logits=phi))
        >>> z.shape                                   # 3 i.i.d. samples, then 3 copula samples
        torch.Size([6, 2])
        >>> log_w = 2.0 * z.sum(-1) - Bernoulli(logits=phi).log_prob(z).sum(-1)
        >>> bound = arms_iwae_bound(log_w, z)         # registers −bound as the cost "iwae_bound"
        >>> bool(torch.isclose(storch.backward(), -bound)), phi.grad.shape
        (True, torch.Size([2]))
    """

    def __init__(self, plate_name: str, n_samples: int = 2, copula: str = "dirichlet") -> None:
        super().__init__(plate_name, n_samples, copula)
        self._bounds: dict[str, _Bound] = {}

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        phi = bernoulli_logits(distr).detach()  # type: ignore[arg-type]
        u = torch.rand((amt_samples,) + tuple(phi.shape), dtype=phi.dtype, device=phi.device)
        return torch.cat([(u < torch.sigmoid(phi)).to(phi.dtype), self._copula_samples(phi)])

    def on_joint_bound(self, cost_name: str, plate: Plate, log_w: Tensor, later: Sequence[Plate] = ()) -> None:
        raise ValueError(
            f"iwae_bound over {plate.name!r}: ARMSMultiSample's plate holds the bound's {self.n_samples} "
            f"samples and {self.n_samples} copula samples; register the bound with "
            "storch.method.arms.arms_iwae_bound(log_w, z) instead."
        )

    def register_bound(self, cost_name: str, plate: Plate, costs: Tensor) -> None:
        """Remember the copula samples' costs of the bound registered as ``cost_name``
        (called by `storch.method.arms.arms_iwae_bound`)."""
        self._bounds[cost_name] = _Bound(plate, costs)

    def _copula_costs(self, tensor: StochasticTensor, cost: CostTensor) -> torch.Tensor:
        bound = self._bounds.get(cost.name)
        with no_dispatch():
            if bound is None or bound.plate is not tensor.plate:
                return cost.detach()
            return align_to(bound.costs, layout_of(cost), expand=True)



def _leave_one_in_costs(iid: torch.Tensor, copula: torch.Tensor, k: int) -> torch.Tensor:
    """``H_j = Σ_k −[log (1/K)(Σ_{m≠k} w_m + w̃_j)]``, plain log-weights with the samples first."""
    eye = torch.eye(k, dtype=torch.bool, device=iid.device).reshape((k, k) + (1,) * (iid.dim() - 1))
    others = torch.logsumexp(iid.unsqueeze(0).masked_fill(eye, -math.inf), 1)  # log Σ_{m≠k} w_m
    bounds = torch.logaddexp(others.unsqueeze(1), copula.unsqueeze(0)) - math.log(k)  # [k, j]
    return -bounds.sum(0)


def _check_bound_node(log_w: torch.Tensor, z: StochasticTensor) -> ARMSMultiSample:
    layout = layout_of(log_w)
    if not isinstance(z, StochasticTensor) or not any(p is z.plate for p in layout.plates):
        raise ValueError(
            "arms_iwae_bound: log_w must be a storch tensor with the plate of the node z it averages over "
            f"(its plates: {list(layout.names)}); compute log_w from z's samples."
        )
    if log_w.dim() != len(layout.sizes):
        raise ValueError(
            f"arms_iwae_bound: log_w has shape {tuple(log_w.shape)} with plates {list(layout.names)}: one "
            "log-weight per plate combination is needed; sum the event dimensions first."
        )
    method = z.plate.node.method  # type: ignore[union-attr]
    if not isinstance(method, ARMSMultiSample):
        raise ValueError(
            f"arms_iwae_bound: node {z.plate.name!r} is sampled with {type(method).__name__}; use "
            f"ARMSMultiSample({z.plate.name!r}, n_samples=K) (or iwae_bound with VIMCO)."
        )
    later = [p.name for p in layout.plates if p.order > z.plate.order and p.node is not None]
    if later:
        raise ValueError(
            f"arms_iwae_bound over {z.plate.name!r}: log_w depends on nodes {later} sampled after it; "
            "the bound's log-weights may depend on this node and earlier ones only."
        )
    return method


def arms_iwae_bound(log_w: torch.Tensor, z: StochasticTensor, name: str = "iwae_bound") -> Tensor:
    """The bound ``L = log (1/K) Σ_k w_k`` of an `storch.method.arms.ARMSMultiSample`
    node's ``K`` i.i.d. samples, registered as the cost ``−L`` under ``name``.

    ``log_w`` holds the log-weights of all ``2K`` points of the node's plate; those of the copula
    samples are kept (detached) for the node's estimator. ``−L`` is registered on every point.

    Args:
        log_w: per-point log-weights ``log p(x, b) − log q(b)``, a storch tensor with ``z``'s plate
            (and e.g. a minibatch plate), one value per plate combination.
        z: the node.
        name: the name of the registered cost.

    Returns:
        ``L`` with ``z``'s plate reduced (other plates kept).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> z = ARMSMultiSample("z", n_samples=2)(Bernoulli(logits=torch.zeros(3)))
        >>> log_w = storch.Tensor(torch.log(torch.tensor([1.0, 3.0, 9.0, 9.0])), [z.plate])
        >>> float(arms_iwae_bound(log_w, z).exp())          # (1 + 3)/2: the i.i.d. half only
        2.0
    """
    method = _check_bound_node(log_w, z)
    layout, k = layout_of(log_w), method.n_samples
    i = layout.position(z.plate)
    with no_dispatch():
        values = log_w.view_as(log_w)
        kept = torch.logsumexp(values.narrow(i, 0, k), i, keepdim=True) - math.log(k)
        cost = (-kept).expand_as(values)
        points = values.detach().movedim(i, 0)
        copula_costs = _leave_one_in_costs(points[:k], points[k:], k)
        costs = torch.cat([torch.zeros_like(copula_costs), copula_costs]).movedim(0, i)
    method.register_bound(name, z.plate, wrap_new(costs, layout))
    add_cost(wrap_new(cost, layout), name)
    return wrap_new(kept.squeeze(i), layout.without([z.plate]))
