"""Generalized stochastic backpropagation (GSB): cumulants times expected pure derivatives of the cost.

Paper: Echraibi, Flocon Cholet, Gosselin & Vaton, "Generalized stochastic backpropagation" (NeurIPS 2020
workshop "Beyond Backpropagation"; ``seeds/004_…``, theorem 1 and sections 3–5). Written with
cumulants ``κ_n`` (the Taylor coefficients of the log characteristic function,
``log φ(ω) = Σ_n κ_n (iω)^n / n!``; `storch.method.cumulants`), the theorem reads, for a
factorised ``z`` with parameters θ and a cost ``f`` differentiable in ``z``,

    ∇θ E f(z) = Σ_j Σ_{n≥1} (∇θ κ_n(θ)_j / n!) · E[∂ⁿf/∂z_jⁿ (z)]

(pure derivatives per coordinate ``j``). `storch.method.gsb.GSB` truncates the series at ``order = N``. Its
surrogate term for one node (a control-variate term with forward value 0, no gradient function) is

    Σ_j Σ_{n=1..N} ((κ_n(θ)_j − stopgrad κ_n(θ)_j) / n!) · stopgrad(∂ⁿS/∂z_jⁿ)

with ``S`` the downstream estimate of the cost (`storch.inference` hands it to the method per
sample). The samples are drawn without any pathwise gradient into θ (``sample()``, detached) and made a
leaf that autograd differentiates ``S`` with respect to; no score term is used. Gradients that reach θ
by other paths (a cost that depends on θ directly, e.g. ``log q(z; θ)``) flow as usual.

Dispatch by distribution type (registry `storch.method.gsb.register_gsb_rule`; representations
`storch.method.gsb.register_representation`; cumulants
`storch.method.cumulants.register_cumulants`):

====================================  =============================================  ================  ===========================
distribution                          rule                                           exact?            cost evaluations / sample
====================================  =============================================  ================  ===========================
``Normal``                            cumulants ``μ, σ²`` (eq. 14)                    at order ≥ 2      1 + min(N, 2) VJPs
``Dirac`` (`storch.distributions`)  ``κ₁ = a``: plain backpropagation            at order ≥ 1
1 + 1 VJP
``Gamma``, ``Chi2``, ``Exponential``  ``κ_n = k (n−1)!/βⁿ`` (eq. 19)                  truncated         1 + N VJPs
``Laplace``                           ``κ₁ = μ``, ``κ_{2m} = 2(2m−1)! b^{2m}`` (eq. 18) truncated         1 + N VJPs
``Independent`` of the above          those of the base distribution                 as the base       as the base
``Beta(α, β)``                        gammas ``ζ₁ ~ Γ(α,1)``, ``ζ₂ ~ Γ(β,1)``,         truncated         1 + N VJPs (D = 2 per Beta)
                                      ``z = ζ₁/(ζ₁+ζ₂)`` (eq. 20)
``Dirichlet(α)``                      gammas ``ζ_k ~ Γ(α_k,1)``, ``z = ζ/Σζ`` (eq. 21)  truncated         1 + N VJPs (D = K per Dirichlet)
``Bernoulli``, ``Categorical``,       discrete rule (eqs. 16–17) =                   exact (unbiased)  1 + D·(K−1) points, no VJP
``OneHotCategorical``                 `storch.method.local_expectation.LocalExpectation`
``Poisson(λ)``                        ``κ_n = λ`` on integers: ``∇λ E f =             exact (unbiased)  1 + D points, no VJP
                                      E[f(z + e_j) − f(z)]`` (finite difference,
                                      `storch.distributions.measure_valued`)
====================================  =============================================  ================  ===========================

"exact" means the surrogate's first derivative is unbiased; "truncated" means a bias from the terms
above ``N`` that vanishes when the cost's pure derivatives of order > N do (a polynomial of degree ≤ N)
and otherwise shrinks with ``N`` when the series converges (e.g. Gamma with ``f = exp(−εz)`` and
``ε/β < 1``; the measured biases are in ``tests/test_gsb.py``).

Cost. The continuous rule evaluates the cost once per sample and then runs ``N`` vector-Jacobian
products of the downstream graph per node (``D`` = coordinates per sample): one plain VJP for
``∂S/∂z`` and, for ``n ≥ 2``, one VJP batched over the ``D`` one-hot coordinate vectors
(``is_grads_batched``, broadcast over the plates, `storch.method.derivatives`). Because the graph
of the order-``n`` derivative is itself batched, an exact order ``n`` costs ``D^{n−1}`` copies of the
graph; orders with ``D^{n−1} > max_exact_batch`` (default 256: all orders for ``D = 1``, order 2 up to
``D = 256``, order 3 up to ``D = 16``, order 8 up to ``D = 2``) use unbiased random-sign probes instead
(one plain VJP each, extra variance from mixed partials), so a node never costs more than ``N`` VJPs of
at most ``max_exact_batch`` times one VJP. Orders above the last non-zero cumulant (Normal above 2, Dirac
above 1) are not computed.

Higher orders and nested nodes. The GSB term is first order in θ: ``backward(create_graph=True)``
differentiates only ``κ_n(θ)`` again (second derivatives are biased). When another stochastic node ``y``
depends on ``z``, ``S`` holds ``y``'s surrogate, and ``∂ⁿS/∂z_jⁿ`` is the ``n``-th derivative of ``y``'s
estimate of ``E_y f`` with respect to ``z``: it is unbiased for every ``n`` when ``y``'s method gives
unbiased derivatives of all orders (Reparameterization, ScoreFunction, Expect; up to ``n = 2`` for
LocalExpectation), but only for ``n = 1`` when ``y`` is itself a GSB or another first-order method
(MVD, ARM). Such a ``y`` below a continuous GSB node of order ≥ 2 is therefore refused where it is
drawn (`storch.method.method.Method.order_needed_below`, with the orders the catalog declares).

Plates. Costs of different samples of the node, and of different elements of its parents' plates, must
not depend on each other's samples (true for costs built from storch operations). A cost plate the node
lacks (a minibatch shared by one posterior sample) is weighted by its plate weights, normalised, so that
the term counts once when that plate is reduced.

Examples:
    >>> import torch, storch
    >>> from torch.distributions import Gamma
    >>> _ = torch.manual_seed(0)
    >>> k, rate = torch.tensor(3.0, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    >>> z = GSB("z", n_samples=10000, order=2)(Gamma(k, rate))
    >>> storch.add_cost((z - 1.0) ** 2, "f")     # quadratic: order 2 is exact
    >>> _ = storch.backward()
    >>> # E f = k/β² + (k/β − 1)²: ∂/∂k = 1/β² + 2(k/β − 1)/β = 0.75, ∂/∂β = −2k/β³ − 2(k/β − 1)k/β² = −1.5
    >>> k.grad.shape, bool(torch.allclose(torch.stack([k.grad, rate.grad]), torch.tensor([0.75, -1.5]), atol=0.05))
    (torch.Size([]), True)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.distributions import (
    Bernoulli,
    Beta,
    Categorical,
    Dirichlet,
    Distribution,
    Gamma,
    OneHotCategorical,
    Poisson,
)

from storch.extend import (
    AmbiguousLookupError,
    CostTensor,
    Plate,
    PlateLayout,
    StochasticNode,
    StochasticTensor,
    Tensor,
    TypeRegistry,
    align_to,
    ambiguity_message,
    layout_of,
    no_dispatch,
    node_of,
    plain,
    plate_weight,
    wrap_new,
)
from storch.method.cumulants import cumulant_terms, cumulants_registered, supported_distributions
from storch.method.derivatives import NoDifferentiablePath, pure_derivatives
from storch.method.groups import GroupRecords, flatten_groups
from storch.method.local_expectation import (
    local_expectation_points,
    local_expectation_term,
    local_expectation_weights,
)
from storch.method.method import Method
from storch.reductions import sum as plate_sum
from storch.registries import GSB_REPRESENTATIONS, GSB_RULES, register_gsb_rule, register_representation
from storch.sampling.method import check_count

__all__ = [
    "GSB", "GeneralizedStochasticBackprop", "GSBRule", "Representation", "register_gsb_rule",
    "register_representation", "representation_for", "gsb_rule_for", "gsb_supported",
]


# --------------------------------------------------------------------------- representations
@dataclass(frozen=True)
class Representation:
    """``z = transform(ζ)`` with ``ζ`` drawn from a distribution that has registered cumulants.

    Attributes:
        latent: ``distribution -> distribution of ζ``, differentiable in the parameters; its batch
            shape starts with the distribution's batch shape (the plates come first).
        transform: ``ζ -> z`` on samples ``(n, *latent.batch_shape, *latent.event_shape)``,
            differentiable (GSB differentiates the cost through it).
    """

    latent: Callable[[Distribution], Distribution]
    transform: Callable[[torch.Tensor], torch.Tensor]


_REPRESENTATIONS: TypeRegistry[Representation] = GSB_REPRESENTATIONS  # made in storch.registries, filled here


def representation_for(distr: Distribution) -> Optional[Representation]:
    """The `storch.method.gsb.Representation` registered for ``type(distr)`` or a base class, else
    ``None``.

    Examples:
        >>> import torch
        >>> from torch.distributions import Beta
        >>> rep = representation_for(Beta(torch.tensor(2.0), torch.tensor(3.0)))
        >>> rep.latent(Beta(torch.tensor(2.0), torch.tensor(3.0))).concentration.tolist()
        [2.0, 3.0]
        >>> rep.transform(torch.tensor([[1.0, 3.0]])).tolist()
        [0.25]
    """
    return _REPRESENTATIONS.lookup(distr)


def _beta_latent(d: Beta) -> Gamma:  # eq. 20: z = ζ₁ / (ζ₁ + ζ₂), ζ₁ ~ Γ(α, 1), ζ₂ ~ Γ(β, 1)
    alpha = torch.stack([d.concentration1, d.concentration0], -1)
    return Gamma(alpha, torch.ones_like(alpha))


def _dirichlet_latent(d: Dirichlet) -> Distribution:  # eq. 21: z = ζ / Σ_k ζ_k, ζ_k ~ Γ(α_k, 1)
    alpha = d.concentration
    return Gamma(alpha, torch.ones_like(alpha))


_REPRESENTATIONS.register_default(Beta)(Representation(_beta_latent, lambda zeta: zeta[..., 0] / zeta.sum(-1)))
_REPRESENTATIONS.register_default(Dirichlet)(Representation(_dirichlet_latent, lambda zeta: zeta / zeta.sum(-1, keepdim=True)))


# --------------------------------------------------------------------------- rules
class GSBRule(ABC):
    """How `storch.method.gsb.GSB` samples a distribution family and builds its surrogate term."""

    @abstractmethod
    def sample(self, method: "GSB", distr: Distribution, plates: Sequence[Plate], n: int) -> torch.Tensor:
        """The node's points ``(N, *batch_shape, *event_shape)`` (plain, storch dispatch disabled)."""

    def weights(self, method: "GSB", tensor: StochasticTensor, plate: Plate) -> Optional[torch.Tensor]:
        """Plate weights (``None``: uniform ``1/N``)."""
        return None

    @abstractmethod
    def term(self, method: "GSB", tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        """The control-variate term (forward value 0) whose gradient is the estimate."""

    def derivatives(self, method: "GSB") -> int:
        """How many derivatives in the sample the term takes of the downstream estimate ``S`` (the
        estimators of the nodes drawn from these samples must be unbiased to that order); ``0``."""
        return 0


_RULES: TypeRegistry[GSBRule] = GSB_RULES  # made in storch.registries, filled here


def _drop_grad(t: torch.Tensor) -> None:
    t.grad = None  # the hidden leaf's gradient is never used: do not keep it


class _CumulantRule(GSBRule):
    """Continuous distributions: cumulants times expected pure derivatives, truncated at the order.

    The samples are a differentiable function of a hidden leaf (the latent draw); the leaf is kept
    in `leaves`, keyed by the samples, for the pure derivatives in `term`.
    """

    def __init__(self) -> None:
        self.leaves = GroupRecords("GSB", "differentiable leaf (GSB's continuous rule)")

    def derivatives(self, method: "GSB") -> int:
        return method.order  # the pure derivatives of S up to the truncation order

    def sample(self, method: "GSB", distr: Distribution, plates: Sequence[Plate], n: int) -> torch.Tensor:
        rep = representation_for(distr)
        latent = rep.latent(distr) if rep is not None else distr
        leaf = latent.sample((n,)).detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(_drop_grad)
        with torch.enable_grad():
            z = rep.transform(leaf) if rep is not None else leaf.view_as(leaf)
        self.leaves.keep(z, leaf)
        return z

    def term(self, method: "GSB", tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        node = node_of(tensor)
        leaf = self.leaves.of(tensor)
        node_layout: PlateLayout = node.layout
        distr = tensor.distribution
        rep = representation_for(distr)
        with no_dispatch():
            latent = rep.latent(distr) if rep is not None else distr
            kappas = cumulant_terms(latent, method.order)
        top = max((n for n, k in enumerate(kappas, 1) if k is not None), default=0)
        if top == 0:
            return None
        u = _foreign_plate_weights(cost, node_layout)
        try:
            derivs = pure_derivatives(
                plain(cost), leaf, top, len(node_layout.sizes), u, max_exact_batch=method.max_exact_batch
            )
        except NoDifferentiablePath:
            raise ValueError(
                f"GSB({tensor.name!r}): the cost {cost.name!r} does not depend differentiably on the samples "
                f"of plate {tensor.name!r} (GSB needs ∂ⁿf/∂zⁿ). Use LocalExpectation or ScoreFunction for "
                "this node, or make the cost differentiable in it (no detach, argmax, indexing by it)."
            ) from None
        with no_dispatch():
            total = None
            for n in range(1, top + 1):
                k = kappas[n - 1]
                if k is None:
                    continue
                piece = (k - k.detach()) * (derivs[n - 1] / math.factorial(n))
                total = piece if total is None else total + piece
            assert total is not None
            n_lead = len(node_layout.sizes)
            if total.dim() > n_lead:
                total = total.sum(tuple(range(n_lead, total.dim())))
        term = wrap_new(total, node_layout)
        missing = [p for p in node_layout.plates if p.name not in layout_of(cost).names]
        if missing:  # the cost already summed over these plates of the node
            term = plate_sum(term, missing)
        return term


def _foreign_plate_weights(cost: CostTensor, node_layout: PlateLayout) -> Optional[torch.Tensor]:
    """Grad-outputs over the cost: the normalised weights of the cost's plates the node lacks."""
    extra = [p for p in layout_of(cost).plates if p.name not in node_layout.names]
    if not extra:
        return None
    u: float | torch.Tensor = 1.0
    for plate in extra:
        w = plate_weight(plate, detach=True)
        if w is None or (not isinstance(w, Tensor) and torch.as_tensor(w).dim() == 0):
            u = u * (1.0 / plate.size)
        else:
            u = u * (w / plate_sum(w, [plate]))
    with no_dispatch():
        c = plain(cost)
        if isinstance(u, Tensor):
            return align_to(u, layout_of(cost), expand=True).detach().to(c.dtype)
        return torch.full_like(c, float(u))


class _LocalExpectationRule(GSBRule):
    """Bernoulli / categorical: the discrete rule of eqs. 16–17, i.e. local expectations."""

    def sample(self, method: "GSB", distr: Distribution, plates: Sequence[Plate], n: int) -> torch.Tensor:
        return flatten_groups(local_expectation_points(distr, n, len(plates)))

    def weights(self, method: "GSB", tensor: StochasticTensor, plate: Plate) -> Optional[torch.Tensor]:
        n = method.n_samples
        return local_expectation_weights(n, plate.size // n).to(tensor.device)

    def term(self, method: "GSB", tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        return local_expectation_term(tensor, cost)


class _FiniteDifferenceRule(GSBRule):
    """Poisson: ``∇λ_j E f = E[f(z + e_j) − f(z)]``, by the measure-valued decomposition (MVD)."""

    def _mvd(self, method: "GSB") -> Method:
        from storch.method.mvd import MVD

        if method._finite_difference is None:
            method._finite_difference = [MVD(method.plate_name, method.n_samples)]
        return method._finite_difference[0]

    def sample(self, method: "GSB", distr: Distribution, plates: Sequence[Plate], n: int) -> torch.Tensor:
        return self._mvd(method).proposal_dist(distr, n)

    def weights(self, method: "GSB", tensor: StochasticTensor, plate: Plate) -> Optional[torch.Tensor]:
        return self._mvd(method).sampling_method.weighting_function(tensor, plate)

    def term(self, method: "GSB", tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        return self._mvd(method).estimator(tensor, cost)[1]


_CUMULANT_RULE = _CumulantRule()


def leaf_of(tensor: StochasticTensor) -> torch.Tensor:
    """The hidden leaf of a node sampled by GSB's continuous rule: the detached latent draw whose
    samples are a differentiable function of it, by which the cost is differentiated."""
    return _CUMULANT_RULE.leaves.of(tensor)
_RULES.register_default(Bernoulli, Categorical, OneHotCategorical)(_LocalExpectationRule())
_RULES.register_default(Poisson)(_FiniteDifferenceRule())


def gsb_supported() -> list[str]:
    """Names of the distribution types GSB handles (rules, representations, cumulants)."""
    names = {t.__name__ for t in _RULES} | {t.__name__ for t in _REPRESENTATIONS} | set(supported_distributions())
    return sorted(names)


def gsb_rule_for(distr: Distribution, who: str = "GSB") -> GSBRule:
    """The rule GSB uses for ``distr``; a ``ValueError`` listing the supported types if none.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli, Laplace
        >>> type(gsb_rule_for(Bernoulli(torch.tensor(0.3)))).__name__
        '_LocalExpectationRule'
        >>> type(gsb_rule_for(Laplace(0.0, 1.0))).__name__
        '_CumulantRule'
    """
    # the most specific of the registered rule and representation; a rule wins at the same type
    rule = _RULES.match(distr)
    rep = _REPRESENTATIONS.match(distr)
    if rule is not None and rep is not None:
        (rule_type, found_rule), rep_type = rule, rep[0]
        if rep_type in rule_type.__mro__:
            return found_rule
        if rule_type not in rep_type.__mro__:
            raise AmbiguousLookupError(
                ambiguity_message(
                    "GSB rule and representation", type(distr), [rule_type, rep_type],
                    "storch.method.gsb.register_gsb_rule or register_representation",
                )
            )
        return _CUMULANT_RULE
    if rule is not None:
        return rule[1]
    if rep is not None:
        return _CUMULANT_RULE
    if cumulants_registered(distr):
        return _CUMULANT_RULE
    raise ValueError(
        f"{who} cannot handle {type(distr).__name__}: supported distributions are {', '.join(gsb_supported())}. "
        "Register cumulants (storch.method.cumulants.register_cumulants), a representation "
        "(storch.method.gsb.register_representation) or a rule (register_gsb_rule), or use ScoreFunction."
    )


# --------------------------------------------------------------------------- the method
class GSB(Method):
    """Generalized stochastic backpropagation, truncated at ``order`` (Echraibi et al. 2020, ``seeds/004_…``).

    ``∇θ E f(z) ≈ Σ_j Σ_{n=1..N} (∇θ κ_n(θ)_j / n!) · E[∂ⁿf/∂z_jⁿ]`` for continuous factorised
    distributions (cumulants `storch.method.cumulants`; Beta and Dirichlet through their
    gamma
    representation); the discrete rule for Bernoulli / categorical (local expectations) and Poisson
    (finite differences). See the module docstring for the table of distributions, exactness and cost.
    First-order gradients only (the term is built with ``stopgrad(∂ⁿf)``).

    Args:
        plate_name: node / plate name.
        n_samples: the number of samples ``n`` (discrete rules lay out ``n`` evaluation groups).
        order: the truncation order ``N ≥ 1`` (continuous distributions).
        max_exact_batch: orders ``n`` with ``D^{n−1}`` above this are estimated by random-sign probes
            (unbiased, more variance) instead of exact batched VJPs (`storch.method.derivatives`).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Laplace
        >>> mu = torch.tensor([0.2, -0.3], requires_grad=True)
        >>> b = torch.tensor([0.5, 1.0], requires_grad=True)
        >>> z = GSB("z", n_samples=50, order=4)(Laplace(mu, b))
        >>> storch.add_cost(((z - 0.49) ** 2).sum(-1), "c")   # ∇μ = 2(μ − 0.49), ∇b = 4b: exact at order 2
        >>> _ = storch.backward()
        >>> torch.allclose(b.grad, 4 * b.detach())
        True
    """

    #: a node's rule keeps its hidden leaf (or its evaluation points) for the samples it drew, which a
    #: step of a single-sample chain would replace by a view without the step it extends
    extends_chains = False

    def __init__(self, plate_name: str, n_samples: int = 1, order: int = 2, max_exact_batch: int = 256) -> None:
        if isinstance(order, bool) or not isinstance(order, int) or order < 1:
            raise ValueError(
                f"GSB({plate_name!r}): order must be an integer ≥ 1 (the truncation order of the cumulant "
                f"series), got {order!r}."
            )
        super().__init__(plate_name, None, n_samples)
        self.order = order
        self.max_exact_batch = check_count(max_exact_batch, "max_exact_batch", f"GSB({plate_name!r})")
        self._finite_difference: Optional[list[Method]] = None  # the Poisson rule's MVD, made on demand
        self.sampling_method.set_mc_sample(self._sample)
        self.sampling_method.set_mc_weighting_function(self._weights)

    def check_distribution(self, distr: Distribution) -> None:
        gsb_rule_for(distr, f"GSB({self.plate_name!r})")

    def order_needed_below(self, node: StochasticNode) -> int:
        """The continuous rules differentiate the downstream estimate up to ``order`` times in the
        sample; the discrete and Poisson rules evaluate it at other points only."""
        return gsb_rule_for(node.distribution).derivatives(self)

    def _sample(self, distr: Distribution, plates: Sequence[Plate], n: int) -> torch.Tensor:
        return gsb_rule_for(distr).sample(self, distr, plates, n)

    def _weights(self, tensor: StochasticTensor, plate: Plate) -> Optional[torch.Tensor]:
        return gsb_rule_for(tensor.distribution).weights(self, tensor, plate)

    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[None, Optional[torch.Tensor]]:
        return None, gsb_rule_for(tensor.distribution).term(self, tensor, cost)

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}, order={self.order}"


#: the paper's name
GeneralizedStochasticBackprop = GSB
