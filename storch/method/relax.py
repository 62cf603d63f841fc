"""LAX, RELAX and REBAR: score functions with learned, reparameterised control variates.

Tucker et al. 2017, "REBAR: Low-variance, unbiased gradient estimates for discrete latent variable
models"; Grathwohl et al. 2018, "Backpropagation through the Void" (LAX, RELAX).

For a discrete node ``b = H(z)`` with reparameterised noise ``z`` (Gumbel / logistic perturbed
logits, `storch.distributions.relaxation`), ``z̃ ~ p(z | b)`` and any control variate ``c``:

    ĝ = [f(b) − c(z̃)] ∇log p(b) + ∇c(z) − ∇c(z̃)                                    (RELAX)

is unbiased for ``∇E[f(b)]``. REBAR takes ``c(z) = η f(σ_λ(z))``, the cost at the relaxed sample
``σ_λ(z)`` (softmax / sigmoid at temperature ``λ``); RELAX a network ``c_φ(σ_λ(z))``, optionally plus
the REBAR term. For a continuous reparameterisable node ``z`` (LAX),

    ĝ = [f(z) − c(z)] ∇log p(z) + ∇c(z).

``η``, ``λ`` and ``φ`` minimise the variance ``‖ĝ‖²``, a step per ``storch.backward()``
(`storch.method.learned_control_variate`).

Surrogate components: ``l = log p(b)`` and the control-variate term
``(1 − □(l)) c(z̃) + c(z) − stopgrad c(z)`` (LAX: ``(1 − □(l)) c(stopgrad z) + c(z) − stopgrad c(z)``),
whose forward value is 0, so that the surrogate's value stays the Monte Carlo estimate of ``E f``.
REBAR lays out ``n`` groups of evaluation points ``[b, σ_λ(z), σ_λ(z̃)]`` along its plate with
weights ``[1/n, 0, 0]`` (`storch.method.groups`).

Derivatives of every order are unbiased. With ``□(l) = p_θ'(b)/p_θ(b)`` read as a function of the
parameter ``θ'`` at which the surrogate is differentiated (samples drawn at ``θ``), the expected
surrogate is ``E_θ'[f − c(z̃)] + E_θ'[c(z)] = E_θ'[f]`` for every ``θ'``, because ``z̃`` is
reparameterised *given b* (so ``z̃_θ' ~ p_θ'(z | b)``) and ``z`` unconditionally. This needs ``c``
(for REBAR: the cost as a function of the relaxed input) to be smooth enough for the order asked:
a ReLU network has no useful pathwise second derivative. LAX keeps ``c`` at the fixed sample in the
score term for the same reason (``c`` at the reparameterised point there would bias second
derivatives by ``−E[∇log p ∇cᵀ + ∇c ∇log pᵀ]``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import nn
from torch.distributions import Distribution

from storch.method.groups import flatten_groups, group_plate, group_weights, spread_groups, split_groups
from storch.method.learned_control_variate import Draw, LearnedControlVariate, OptimizerFactory
from storch.method.method import log_prob
from storch.distributions.relaxation import GumbelCoupling, relaxation_for
from storch.extend import (
    CostTensor,
    Plate,
    StochasticTensor,
    Tensor,
    get_distr_parameters,
    layout_of,
    layout_of_plates,
    log_prob_of_own_samples,
    magic_box,
    no_dispatch,
    wrap,
    wrap_new,
)

__all__ = ["LAX", "RELAX", "REBAR", "ControlVariateNetwork", "RelaxedCostTerm", "RebarTerm"]


def _coupling_for(method: str, plate_name: str, distr: Distribution) -> GumbelCoupling:
    relaxation = relaxation_for(distr)
    coupling = relaxation.coupling if relaxation is not None else None
    if coupling is None:
        hint = " Use OneHotCategorical instead of Categorical." if type(distr).__name__ == "Categorical" else ""
        cont = " For a continuous distribution with rsample use LAX." if distr.has_rsample else ""
        raise ValueError(
            f"{method}({plate_name!r}) needs the Gumbel coupling of {type(distr).__name__} (its noise z, "
            "b = H(z) and z̃ ~ p(z | b)); one is registered for OneHotCategorical and Bernoulli "
            f"(storch.distributions.relaxation.register_relaxation).{hint}{cont}"
        )
    return coupling


def _n_samples_hint(method: str, given: object) -> str:
    """A hint for ``RELAX("z", 8)``: the manual's count in the control variate's slot."""
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        return f" The number of samples is the third argument: {method}('z', c_phi, n_samples={given!r})."
    return ""


def _control_variate_term(l: torch.Tensor, c_z: torch.Tensor, c_zt: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """``(1 − □(l)) c(z̃) + [c(z) − c(z̃)] − stopgrad[c(z) − c(z̃)]``: forward value 0, gradient
    ``−c(z̃) ∇l + ∇c(z) − ∇c(z̃)``."""
    difference = c_z - c_zt
    return (1.0 - magic_box(l)) * c_zt + (difference - difference.detach())


class ControlVariateNetwork(nn.Module):
    """The default control variate ``c_φ`` built from ``in_dim`` (the manual's ``RELAX("z", in_dim=…)``).

    A two-layer perceptron, ``Linear(D, hidden) → tanh → Linear(hidden, 1)``, applied to the last
    ``len(in_dim)`` dimensions of its input (flattened into ``D = prod(in_dim)``), returning one
    value per remaining element. As in Storchastic 0.3.7 (50 hidden units), but with ``tanh``
    instead of ``ReLU``: the estimators differentiate ``c_φ`` at reparameterised points, and a
    smooth ``c_φ`` keeps their higher-order derivatives unbiased too.

    On a storch tensor, ``in_dim`` is matched against one sample's dimensions (those right of the
    plates), never against a plate. A sample with fewer dimensions than ``in_dim`` gets size-1
    dimensions when the missing leading entries of ``in_dim`` are 1: a scalar node (a
    ``Bernoulli(p)`` with ``batch_shape ()``) takes ``in_dim=1`` and the network sees each sample as
    a vector of length 1, for any number of samples.

    Args:
        in_dim: the size of the last dimension of the input (an ``int``), or the sizes of its last
            dimensions (a sequence), e.g. ``(2, 10)`` for two one-hot variables of 10 values, or
            ``1`` for a scalar node.
        hidden: the number of hidden units.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> c_phi, x = ControlVariateNetwork((2, 3)), torch.rand(5, 2, 3)
        >>> c_phi(x).shape, bool(torch.allclose(c_phi(x), c_phi.net(x.reshape(5, 6)).squeeze(-1)))  # D = 6
        (torch.Size([5]), True)
    """

    def __init__(self, in_dim: Union[int, Sequence[int]], hidden: int = 50) -> None:
        super().__init__()
        dims = (in_dim,) if not isinstance(in_dim, Sequence) else tuple(in_dim)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"ControlVariateNetwork: in_dim must be a positive int or a sequence of them, got {in_dim!r}.")
        self.in_dim = dims
        self.net = nn.Sequential(nn.Linear(math.prod(dims), hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fit_input(x)
        k = len(self.in_dim)
        if k > 1:
            x = x.reshape(tuple(x.shape[: x.dim() - k]) + (-1,))
        return self.net(x).squeeze(-1)

    def fit_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with one sample's dimensions ending in ``in_dim`` (size-1 dimensions added if needed).

        Args:
            x: the input, a storch tensor (its plates are left alone) or a plain tensor (all its
                dimensions are one sample's).

        Returns:
            ``x``, or a view of it with the missing size-1 dimensions of ``in_dim`` after its plates.

        Raises:
            ValueError: if one sample of ``x`` (its dimensions right of the plates) neither ends in
                ``in_dim`` nor equals ``in_dim`` without some of its leading 1s; the message names
                the plates, the shapes and the ``in_dim`` to give.
        """
        n_plates = len(layout_of(x).sizes)
        sample = tuple(x.shape[n_plates:])
        k = len(self.in_dim)
        if len(sample) >= k and sample[len(sample) - k:] == self.in_dim:
            return x
        missing = k - len(sample)
        if missing > 0 and all(d == 1 for d in self.in_dim[:missing]) and self.in_dim[missing:] == sample:
            return x.reshape(tuple(x.shape[:n_plates]) + self.in_dim)
        raise ValueError(self._shape_error(x, sample))

    def _shape_error(self, x: torch.Tensor, sample: tuple[int, ...]) -> str:
        plates = list(layout_of(x).names)
        where = f"after its plates {plates}" if plates else "(a plain tensor: all its dimensions)"
        suggestion = sample if sample else 1
        return (
            f"ControlVariateNetwork(in_dim={self.in_dim}): expected an input ending in dimensions "
            f"{self.in_dim} (one sample's), but the input of shape {tuple(x.shape)} has sample shape {sample} {where}. "
            f"Give in_dim as the node's sample shape (batch_shape + event_shape), here in_dim={suggestion!r}; "
            "a scalar node takes in_dim=1."
        )


def _resolve_control_variate(
    owner: str, control_variate: Optional[nn.Module], c_phi: Optional[nn.Module], in_dim: Union[int, Sequence[int], None]
) -> Optional[nn.Module]:
    """The control variate given as ``control_variate``, the manual's ``c_phi``, or built from ``in_dim``."""
    given = [name for name, v in (("control_variate", control_variate), ("c_phi", c_phi), ("in_dim", in_dim)) if v is not None]
    if len(given) > 1:
        raise ValueError(
            f"{owner}: {' and '.join(given)} are all ways to give the control variate (c_phi is the manual's "
            "name for control_variate; in_dim builds the default network); give one."
        )
    if in_dim is not None:
        return ControlVariateNetwork(in_dim)
    if c_phi is not None and not isinstance(c_phi, nn.Module):
        raise TypeError(
            f"{owner}: c_phi must be an nn.Module (its parameters are trained), got {type(c_phi).__name__}; "
            "wrap a plain function in an nn.Module, or give in_dim=... for the default network."
        )
    return c_phi if c_phi is not None else control_variate


class RELAX(LearnedControlVariate):
    """RELAX for ``Bernoulli`` and ``OneHotCategorical`` nodes, with a learned control variate.

    ``ĝ = [f(b) − c(z̃)] ∇log p(b) + ∇c(z) − ∇c(z̃)`` with ``c(z) = c_φ(σ_λ(z)) [+ η f(σ_λ(z))]``.
    Unbiased whatever ``c``, for derivatives of every order when ``c`` is smooth enough (see the
    module docstring).

    The parameters ``φ`` (the network's), the temperature ``λ = exp(log_temperature)`` and, with
    ``rebar``, ``η`` are trained to minimise ``‖ĝ‖²``, where ``ĝ`` is the gradient estimate with
    respect to the distribution's ``logits`` tensor (for ``OneHotCategorical``, the normalised logits
    torch stores), one optimizer step per ``storch.backward()``. These parameters belong to the
    method: after each backward their ``.grad`` is ``None``, so an optimizer over
    ``model.parameters()`` does not step them even when the method lives in the model. Freeze one
    with ``requires_grad_(False)`` (e.g. ``method.log_temperature``).

    Args:
        plate_name: node / plate name.
        control_variate: ``c_φ``, an ``nn.Module`` applied to the relaxed sample ``σ_λ(z)`` (a storch
            tensor ``(n, *batch_shape, *event_shape)`` with the node's plates) that returns one value
            per sample (extra dimensions are summed); ``None`` for REBAR alone.
        c_phi: the manual's (Storchastic's) keyword for ``control_variate``.
        in_dim: build the default control variate, a
            [`ControlVariateNetwork`][storch.method.relax.ControlVariateNetwork] over the last
            dimensions of the relaxed sample: ``in_dim`` is their size(s), e.g. ``batch_shape`` for
            Bernoulli variables (``1`` for a scalar node) or ``(*batch_shape, n_values)`` for
            one-hot ones (the manual's ``RELAX("z", in_dim=…)``). Plates never count.
        n_samples: number of samples ``n``.
        rebar: add the REBAR term ``η f(σ_λ(z))``: the cost is also evaluated at ``σ_λ(z)`` and
            ``σ_λ(z̃)`` (the plate holds ``3n`` points, in groups ``[b, σ_λ(z), σ_λ(z̃)]`` with weights
            ``[1/n, 0, 0]``; the model must accept relaxed values in place of discrete ones).
        initial_temperature: ``λ`` at the start.
        initial_eta: ``η`` at the start (with ``rebar``).
        optimizer_factory: ``params -> optimizer`` for the control-variate parameters, e.g.
            ``lambda params: torch.optim.Adam(params, lr=1e-3)``; default Adam with ``lr``.
        lr: learning rate of the default optimizer.
        train_control_variate: ``False`` keeps the control variate fixed.
        sync: under ``torch.distributed``, average the control-variate gradients across ranks
            before each step so that every replica holds the same ``φ``, ``λ``, ``η``
            ([`storch.distributed`][storch.distributed]); ``False`` trains them on each rank alone.

    Notes:
        * With ``rebar``, parameters that the cost reaches at the relaxed points other than through
          the distribution (e.g. a decoder) receive the zero-mean extra term
          ``η (∇f(σ_λ(z)) − ∇f(σ_λ(z̃)))``: unbiased, but more variance for them.
        * The estimator runs once per registered cost downstream of the node, so with ``k`` such
          costs the network's term enters ``k`` times (it learns a ``1/k`` share); the REBAR term
          uses each cost's own values.
        * The method is an ``nn.Module``: move it with ``.to(device)`` together with the model.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> logits = torch.zeros(3, requires_grad=True)
        >>> method = RELAX("b", control_variate=torch.nn.Linear(3, 1), n_samples=4,
        ...                optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-2))
        >>> b = method(Bernoulli(logits=logits))
        >>> storch.add_cost(((b - 0.4) ** 2).sum(-1), "f")
        >>> _ = storch.backward()
        >>> logits.grad.shape, method.network.weight.grad is None   # φ stepped by its own optimizer
        (torch.Size([3]), True)
    """

    def __init__(
        self,
        plate_name: str,
        control_variate: Optional[nn.Module] = None,
        n_samples: int = 1,
        rebar: bool = False,
        initial_temperature: float = 0.5,
        initial_eta: float = 1.0,
        optimizer_factory: Optional[OptimizerFactory] = None,
        lr: float = 1e-3,
        train_control_variate: bool = True,
        sync: bool = True,
        *,
        c_phi: Optional[nn.Module] = None,
        in_dim: Union[int, Sequence[int], None] = None,
    ) -> None:
        super().__init__(plate_name, n_samples, optimizer_factory, lr, train_control_variate, sync)
        control_variate = _resolve_control_variate(f"{type(self).__name__}({plate_name!r})", control_variate, c_phi, in_dim)
        if control_variate is None and not rebar:
            raise ValueError(
                f"{type(self).__name__}({plate_name!r}) needs a control variate: give an nn.Module "
                "control_variate=c_phi (applied to the relaxed sample), in_dim=... for the default "
                "network, or rebar=True, or both."
            )
        if control_variate is not None and not isinstance(control_variate, nn.Module):
            raise TypeError(
                f"{type(self).__name__}({plate_name!r}): the second argument, control_variate, must be an "
                f"nn.Module (its parameters are trained), got {type(control_variate).__name__}."
                f"{_n_samples_hint(type(self).__name__, control_variate)}"
            )
        if initial_temperature <= 0:
            raise ValueError(f"{type(self).__name__}({plate_name!r}): initial_temperature must be positive.")
        self.network = control_variate
        #: how the cost at the relaxed points enters ``c``: `REBAR_TERM` or `NO_RELAXED_COST`
        self.relaxed_cost: RelaxedCostTerm = REBAR_TERM if rebar else NO_RELAXED_COST
        self.log_temperature = nn.Parameter(torch.tensor(math.log(initial_temperature)))
        self.eta = nn.Parameter(torch.tensor(float(initial_eta))) if rebar else None

    @property
    def rebar(self) -> bool:
        """Whether ``c`` has the REBAR term ``η f(σ_λ(z))`` (the ``rebar`` argument)."""
        return self.relaxed_cost is REBAR_TERM

    @property
    def relaxes_samples(self) -> bool:  # type: ignore[override]
        """With the REBAR term, two of each sample's three points are relaxed (``σ_λ(z)``, ``σ_λ(z̃)``)."""
        return self.rebar

    @property
    def temperature(self) -> torch.Tensor:
        """``λ = exp(log_temperature)``."""
        return self.log_temperature.exp()

    @property
    def group_size(self) -> int:
        """Evaluation points per sample: 3 with the REBAR term, else 1."""
        return self.relaxed_cost.group_size

    # -------------------------------------------------------------- proposal
    def check_distribution(self, distr: Distribution) -> None:
        _coupling_for(type(self).__name__, self.plate_name, distr)

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        coupling = _coupling_for(type(self).__name__, self.plate_name, distr)
        logits = coupling.logits(distr)
        z = coupling.perturb(logits, amt_samples)
        hard = coupling.threshold(z.detach())
        z_cond = coupling.conditional(logits, hard)
        lam = self.snapshot(self.log_temperature).exp()
        relaxed, relaxed_cond = coupling.soft(z, lam), coupling.soft(z_cond, lam)
        samples = self.relaxed_cost.points(hard, relaxed, relaxed_cond)
        values = {"relaxed": relaxed, "conditional": relaxed_cond}
        if samples is not hard:  # else the samples are ``hard`` itself, read back from the node
            values["hard"] = hard
        self.keep_draw(samples, Draw((logits,), values))
        return samples

    def weighting_function(self, distr: Distribution, amt_samples: int) -> Optional[torch.Tensor]:
        return self.relaxed_cost.weights(amt_samples)

    # ------------------------------------------------------------- estimator
    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[torch.Tensor, torch.Tensor]:
        draw = self.draw_of(tensor)
        plate, m = tensor.plate, self.group_size
        if m == 1:
            layout = layout_of(tensor)
            l = log_prob(tensor)  # noqa: E741
        else:
            others = [p for p in layout_of(tensor).plates if p is not plate]
            layout = layout_of_plates([group_plate(plate, m)] + others)
            with no_dispatch():
                lp = log_prob_of_own_samples(tensor.distribution, draw.values["hard"])
                if lp.dim() > len(layout.sizes):
                    lp = lp.sum(tuple(range(len(layout.sizes), lp.dim())))
            l = wrap_new(lp, layout)  # noqa: E741
        c_z: torch.Tensor = 0.0  # type: ignore[assignment]
        c_zt: torch.Tensor = 0.0  # type: ignore[assignment]
        if self.network is not None:
            c_z = self.evaluate(self.network, wrap(draw.values["relaxed"], layout))
            c_zt = self.evaluate(self.network, wrap(draw.values["conditional"], layout))
        c_z, c_zt = self.relaxed_cost.add_to(self, c_z, c_zt, cost, plate)
        cv = _control_variate_term(l, c_z, c_zt)
        if m == 1:
            return l, cv
        return spread_groups(l, cost, plate, m), spread_groups(cv, cost, plate, m)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rebar={self.rebar}"


class RelaxedCostTerm:
    """How [`RELAX`][storch.method.relax.RELAX] uses the cost at the relaxed points in its control variate ``c``.

    This one does not: one evaluation point per sample (the discrete ``b``), uniform weights, and
    ``c`` left as the network made it. [`RebarTerm`][storch.method.relax.RebarTerm] adds REBAR's ``η f(σ_λ(z))``.
    Stateless:
    the method keeps the parameters (``η``); one instance of each is shared.
    """

    #: evaluation points per sample
    group_size = 1

    def points(self, hard: torch.Tensor, relaxed: torch.Tensor, relaxed_cond: torch.Tensor) -> torch.Tensor:
        """The samples the cost is evaluated at, ``(group_size · n, *batch, *event)``."""
        return hard

    def weights(self, amt_samples: int) -> Optional[torch.Tensor]:
        """The weight of each point, or ``None`` for ``1/n``."""
        return None

    def add_to(
        self, method: "RELAX", c_z: torch.Tensor, c_zt: torch.Tensor, cost: CostTensor, plate: Plate
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``c(z)`` and ``c(z̃)`` with this term's share of the cost added."""
        return c_z, c_zt


class RebarTerm(RelaxedCostTerm):
    """REBAR's term ``η f(σ_λ(z))`` (Tucker et al. 2017): the cost is evaluated at ``3n`` points,
    ``n`` groups ``[b, σ_λ(z), σ_λ(z̃)]`` weighted ``[1/n, 0, 0]``, and ``η f`` at the two relaxed
    points is added to ``c(z)`` and ``c(z̃)``."""

    group_size = 3

    def points(self, hard: torch.Tensor, relaxed: torch.Tensor, relaxed_cond: torch.Tensor) -> torch.Tensor:
        return flatten_groups(torch.stack([hard, relaxed, relaxed_cond], 1))

    def weights(self, amt_samples: int) -> Optional[torch.Tensor]:
        return group_weights(amt_samples // 3, [1.0, 0.0, 0.0])

    def add_to(
        self, method: "RELAX", c_z: torch.Tensor, c_zt: torch.Tensor, cost: CostTensor, plate: Plate
    ) -> tuple[torch.Tensor, torch.Tensor]:
        per_group = split_groups(cost, plate, 3)
        eta = method.snapshot(method.eta)  # type: ignore[arg-type]  # a Parameter with this term
        return c_z + eta * _point(per_group, 1), c_zt + eta * _point(per_group, 2)


#: the shared instances (the terms are stateless)
NO_RELAXED_COST = RelaxedCostTerm()
REBAR_TERM = RebarTerm()


def _point(per_group: Tensor, index: int) -> Tensor:
    """Point ``index`` of every group of a `split_groups` view (its first event dimension)."""
    layout = layout_of(per_group)
    with no_dispatch():
        x = per_group.select(len(layout.sizes), index)
    return wrap(x, layout)


class REBAR(RELAX):
    """REBAR: RELAX with ``c(z) = η f(σ_λ(z))``, for ``Bernoulli`` and ``OneHotCategorical`` nodes.

    The cost is evaluated at ``3n`` points: ``n`` groups ``[b, σ_λ(z), σ_λ(z̃)]`` along the node's
    plate, weighted ``[1/n, 0, 0]`` (so the model must accept relaxed values in place of discrete
    ones). ``η`` and the temperature ``λ`` are trained to minimise ``‖ĝ‖²`` (the gradient estimate
    with respect to the distribution's logits), one step per ``storch.backward()``; see
    [`RELAX`][storch.method.relax.RELAX] for the optimizer and for what happens to their ``.grad``. Unbiased, for
    derivatives of every order when the cost is smooth in the relaxed input.

    Args:
        plate_name: node / plate name.
        n_samples: number of discrete samples ``n``.
        initial_temperature: ``λ`` at the start.
        initial_eta: ``η`` at the start.
        optimizer_factory: ``params -> optimizer`` for ``η`` and ``log λ``; default Adam with ``lr``.
        lr: learning rate of the default optimizer.
        train_control_variate: ``False`` keeps ``η`` and ``λ`` fixed.
        sync: under ``torch.distributed``, average the gradients of ``η`` and ``λ`` across ranks
            before each step (the replicas stay identical); ``False``: each rank alone.
        c_phi: an extra learned control variate ``c_φ`` (an ``nn.Module``), added to the REBAR term
            as Storchastic's ``REBAR(c_phi=…)`` does: the same as
            ``RELAX(plate_name, control_variate=c_phi, rebar=True)``.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> logits = torch.zeros(4, requires_grad=True)
        >>> z = REBAR("z", n_samples=2)(OneHotCategorical(logits=logits))
        >>> z.shape, z.plates[0].weight._tensor.tolist()  # groups [b, σ(z), σ(z̃)]
        (torch.Size([6, 4]), [0.5, 0.0, 0.0, 0.5, 0.0, 0.0])
        >>> storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum(-1), "f")
        >>> estimate = storch.backward()                   # the mean of f over the two discrete samples
    """

    def __init__(
        self,
        plate_name: str,
        n_samples: int = 1,
        initial_temperature: float = 0.5,
        initial_eta: float = 1.0,
        optimizer_factory: Optional[OptimizerFactory] = None,
        lr: float = 1e-3,
        train_control_variate: bool = True,
        sync: bool = True,
        *,
        c_phi: Optional[nn.Module] = None,
    ) -> None:
        super().__init__(
            plate_name, None, n_samples, True, initial_temperature, initial_eta, optimizer_factory, lr,
            train_control_variate, sync, c_phi=c_phi,
        )

    def extra_repr(self) -> str:
        return LearnedControlVariate.extra_repr(self)


class LAX(LearnedControlVariate):
    """LAX for continuous distributions with ``rsample``: ``ĝ = [f(z) − c_φ(z)] ∇log p(z) + ∇c_φ(z)``.

    ``f`` is treated as a black box (the samples carry no pathwise gradient, so ``f`` may be
    non-differentiable); ``c_φ`` is evaluated at the reparameterised sample for ``∇c`` and at the
    fixed sample in the score term. Unbiased, for derivatives of every order when ``c_φ`` is smooth
    enough. ``φ`` is trained to minimise ``‖ĝ‖²``, with ``ĝ`` the gradient
    estimate with respect to the distribution's parameter tensors (e.g. ``loc`` and ``scale``), one
    step per ``storch.backward()``; see [`RELAX`][storch.method.relax.RELAX] for the optimizer and ``.grad`` handling.

    Args:
        plate_name: node / plate name.
        control_variate: ``c_φ``, an ``nn.Module`` applied to the sample (a storch tensor
            ``(n, *batch_shape, *event_shape)``) returning one value per sample (extra dimensions
            are summed).
        n_samples: number of samples.
        optimizer_factory: ``params -> optimizer`` for ``φ``; default Adam with ``lr``.
        lr: learning rate of the default optimizer.
        train_control_variate: ``False`` keeps ``φ`` fixed.
        sync: under ``torch.distributed``, average ``φ``'s gradients across ranks before each step
            (the replicas stay identical); ``False``: each rank alone.
        c_phi: the manual's (Storchastic's) keyword for ``control_variate``.
        in_dim: build the default control variate, a
            [`ControlVariateNetwork`][storch.method.relax.ControlVariateNetwork] over the last
            dimensions of the sample (``in_dim`` their size(s), e.g. ``event_shape`` or
            ``batch_shape``; ``1`` for a scalar node), as the manual's ``LAX("z", in_dim=…)``.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> _ = torch.manual_seed(0)
        >>> mu = torch.tensor([0.5, -1.0], requires_grad=True)
        >>> z = LAX("z", control_variate=torch.nn.Linear(2, 1), n_samples=10000)(Normal(mu, 1.0))
        >>> storch.add_cost((z > 0).float().sum(-1), "steps")   # not differentiable in z
        >>> _ = storch.backward()
        >>> exact = Normal(0.0, 1.0).log_prob(mu.detach()).exp()   # ∂/∂μ P(z > 0) = N(μ; 0, 1)
        >>> mu.grad.shape, bool(torch.allclose(mu.grad, exact, atol=0.05))
        (torch.Size([2]), True)
    """

    def __init__(
        self,
        plate_name: str,
        control_variate: Optional[nn.Module] = None,
        n_samples: int = 1,
        optimizer_factory: Optional[OptimizerFactory] = None,
        lr: float = 1e-3,
        train_control_variate: bool = True,
        sync: bool = True,
        *,
        c_phi: Optional[nn.Module] = None,
        in_dim: Union[int, Sequence[int], None] = None,
    ) -> None:
        super().__init__(plate_name, n_samples, optimizer_factory, lr, train_control_variate, sync)
        control_variate = _resolve_control_variate(f"LAX({plate_name!r})", control_variate, c_phi, in_dim)
        if control_variate is None:
            raise ValueError(
                f"LAX({plate_name!r}) needs a control variate: give an nn.Module control_variate=c_phi "
                "(applied to the sample), or in_dim=... for the default network."
            )
        if not isinstance(control_variate, nn.Module):
            raise TypeError(
                f"LAX({plate_name!r}): the second argument, control_variate, must be an nn.Module (its "
                f"parameters are trained), got {type(control_variate).__name__}."
                f"{_n_samples_hint('LAX', control_variate)}"
            )
        self.network = control_variate

    def check_distribution(self, distr: Distribution) -> None:
        if not distr.has_rsample:
            hint = (
                " Use RELAX or REBAR for Bernoulli and OneHotCategorical."
                if relaxation_for(distr) is not None or type(distr).__name__ == "Categorical"
                else ""
            )
            raise ValueError(
                f"LAX({self.plate_name!r}) needs a reparameterisable distribution (rsample); "
                f"{type(distr).__name__} has none.{hint}"
            )

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        theta = tuple(get_distr_parameters(distr).values())
        z = distr.rsample((amt_samples,))
        samples = z.detach()
        self.keep_draw(samples, Draw(theta, {"z": z}))
        return samples

    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = wrap(self.draw_of(tensor).values["z"], layout_of(tensor))
        l = log_prob(tensor)  # noqa: E741
        c_fixed = self.evaluate(self.network, tensor)  # c at the sample, no pathwise gradient
        c_path = self.evaluate(self.network, z)  # c at the reparameterised sample
        # (1 − □(l)) c(z) + c(z) − stopgrad c(z): forward 0, gradient −c(z) ∇l + ∇c(z)
        return l, (1.0 - magic_box(l)) * c_fixed + (c_path - c_path.detach())
