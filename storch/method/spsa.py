"""SPSA: simultaneous-perturbation finite differences of the distribution's parameters (biased).

Spall 1992, "Multivariate stochastic approximation using a simultaneous perturbation gradient
approximation". With ``F(θ) = E_{p_θ}[f]``, all parameters are perturbed at once by ``±cΔ`` with
Rademacher signs ``Δ ∈ {−1, +1}^k``:

    ĝ_i = (f(x⁺) − f(x⁻)) / (2 c Δ_i),    x^± ~ p_{θ ± cΔ}

``E[ĝ] = ∇F(θ) + O(c²)``: the finite difference of a smooth ``F`` has a bias of order ``c²`` (third
derivatives of ``F``; ``F c²/6`` for ``F = e^θ``), and the cross terms ``∂_j F Δ_j / Δ_i`` vanish in
expectation. Smaller ``c`` gives less bias but more variance, unless the two samples are coupled.

*Parameterisation.* The perturbed coordinates ``θ`` are the distribution's constructor parameters that
require grad, mapped to unconstrained space with ``torch.distributions.biject_to`` of their constraint
(``log σ`` for a scale, ``log λ`` for a rate, identity for a location), and logits for the
``probs``/``logits`` families (a distribution built from ``probs`` is perturbed in
``logit(probs)``, resp. ``log probs`` for categoricals). Perturbed parameters therefore stay valid, and
``c`` is a relative step for positive parameters. Parameters with discrete constraints (e.g. a
Binomial's ``total_count``) are never perturbed. The perturbed distribution is rebuilt with the same
type; wrappers (``OneHotCategorical``, ``Independent``) are registered in this module
(`storch.method.spsa.register_spsa_wrapper`), so any distribution whose parameters are stored
under their
constructor names works.

*Common random numbers.* The real sample and the two perturbed samples are drawn from the same state
of the random generator. Samplers that transform a fixed set of uniforms or normals (Normal,
Exponential, Bernoulli, Categorical, …) then give exactly coupled samples (``x⁺ − x⁻ = O(c)``); for
rejection samplers (Poisson, Gamma) the coupling is partial.

Components: an evaluation group per draw of ``Δ`` (`storch.method.groups`): ``[x, x⁺, x⁻]`` with
weights ``[1/n, 0, 0]``: the forward value is the plain Monte Carlo estimate of ``E f`` (unbiased), and
the gradient ``ĝ`` (averaged over the ``n`` groups) enters through ``(θ − stopgrad θ) · stopgrad(ĝ)``,
reaching the given parameters by the chain rule through the unconstrained map. First order only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributions import Distribution, Independent, OneHotCategorical, biject_to, constraints
from torch.distributions.transforms import identity_transform
from torch.distributions.utils import probs_to_logits

from storch.method.groups import GroupRecords, flatten_groups, group_plate, group_weights, split_groups, spread_groups
from storch.method.method import Method
from storch.extend import (
    CostTensor,
    Plate,
    StepState,
    StochasticTensor,
    TypeRegistry,
    layout_of,
    layout_of_plates,
    wrap,
)
from storch.registries import SPSA_WRAPPERS, SPSAWrapper, register_spsa_wrapper

__all__ = ["SPSA", "register_spsa_wrapper", "perturbable_parameters"]


# ----------------------------------------------------------------------- parameterisation
_Wrapper = SPSAWrapper
_WRAPPERS: TypeRegistry[SPSAWrapper] = SPSA_WRAPPERS  # made in storch.registries, filled here


def _wrapper_for(d: Distribution) -> _Wrapper | None:
    return _WRAPPERS.lookup(d)


_WRAPPERS.register_default(OneHotCategorical)(
    _Wrapper(
        inner=lambda d: d._categorical,
        rebuild=lambda d, cat: type(d)(logits=cat.__dict__["logits"], validate_args=False),
    )
)
_WRAPPERS.register_default(Independent)(
    _Wrapper(
        inner=lambda d: d.base_dist,
        rebuild=lambda d, base: Independent(base, d.reinterpreted_batch_ndims, validate_args=False),
    )
)


@dataclass(frozen=True)
class _Coordinate:
    """One perturbed constructor parameter: ``name`` given, rebuilt as ``target`` from ``u``."""

    name: str
    target: str
    to_unconstrained: Callable[[torch.Tensor], torch.Tensor]
    from_unconstrained: Callable[[torch.Tensor], torch.Tensor]


def _leaf(d: Distribution) -> Distribution:
    wrapper = _wrapper_for(d)
    return d if wrapper is None else _leaf(wrapper.inner(d))


def _given(d: Distribution) -> dict[str, torch.Tensor]:
    """The tensors ``d`` was built with, by constructor argument name.

    Of the ``probs`` / ``logits`` pair only the given one (``d._param``) counts: torch caches the
    other lazily.
    """
    accepted = inspect.signature(type(d).__init__).parameters
    given = {}
    for name in d.arg_constraints:
        value = d.__dict__.get(name)
        if name not in accepted or not isinstance(value, torch.Tensor):
            continue
        if name in ("probs", "logits") and "_param" in d.__dict__ and value is not d.__dict__["_param"]:
            continue
        given[name] = value
    return given


def _coordinate(d: Distribution, name: str) -> _Coordinate:
    constraint = d.arg_constraints[name]
    if name == "probs" and "_param" in d.__dict__:
        binary = constraint is not constraints.simplex
        return _Coordinate(name, "logits", lambda p: probs_to_logits(p, is_binary=binary), lambda u: u)
    try:
        transform = biject_to(constraint)
    except NotImplementedError:  # dependent constraints (e.g. Uniform's bounds): perturb directly
        transform = identity_transform
    return _Coordinate(name, name, transform.inv, transform)


def perturbable_parameters(d: Distribution) -> list[str]:
    """Constructor parameters of ``d`` that SPSA perturbs: given, requiring grad, not discrete.

    Examples:
        >>> import torch
        >>> from torch.distributions import Normal, Bernoulli
        >>> loc = torch.zeros(2, requires_grad=True)
        >>> perturbable_parameters(Normal(loc, 1.0))
        ['loc']
        >>> perturbable_parameters(Bernoulli(probs=torch.full((2,), 0.3, requires_grad=True)))
        ['probs']
    """
    leaf = _leaf(d)
    return [
        name
        for name, value in _given(leaf).items()
        if value.requires_grad and not leaf.arg_constraints[name].is_discrete
    ]


def _rebuild(d: Distribution, kwargs: dict[str, torch.Tensor]) -> Distribution:
    wrapper = _wrapper_for(d)
    if wrapper is None:
        return type(d)(**kwargs, validate_args=False)
    return wrapper.rebuild(d, _rebuild(wrapper.inner(d), kwargs))


# ---------------------------------------------------------------------------------- random state
def _rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


@dataclass(frozen=True)
class _Record:
    coordinates: tuple[_Coordinate, ...]
    signs: tuple[torch.Tensor, ...]  # Δ per coordinate, (n, *unconstrained shape)

    @property
    def group_size(self) -> int:
        return 3 if self.coordinates else 1


class SPSA(Method):
    """Simultaneous-perturbation stochastic approximation of the gradient (biased, ``O(c²)``).

    For each draw of Rademacher signs ``Δ`` the node's plate holds the group ``[x, x⁺, x⁻]``: a sample of
    the distribution itself (weight ``1/n``, for the estimate of the cost) and samples of the
    distributions with all perturbable parameters moved to ``θ ± cΔ`` in unconstrained space (weight
    0), drawn with common random numbers: 3 cost evaluations per draw. The gradient estimate is
    ``ĝ = (f(x⁺) − f(x⁻)) Δ / (2c)``. Works for any distribution whose constructor parameters can be
    read back (see the module docstring for the parameterisation).

    Biased: ``E ĝ − ∇E f = O(c²)`` (measured in ``tests/test_spsa.py``). First order only.

    Args:
        plate_name: node / plate name.
        n_samples: the number of perturbation draws (evaluation groups).
        c: the perturbation size in unconstrained parameter space.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> _ = torch.manual_seed(0)
        >>> mu = torch.tensor([0.5, -1.0], requires_grad=True)
        >>> x = SPSA("x", n_samples=10000, c=0.05)(Normal(mu, 1.0))
        >>> x.shape                            # [x, x⁺, x⁻] per draw
        torch.Size([30000, 2])
        >>> storch.add_cost((x**2).sum(-1), "f")         # ∂/∂μ E f = 2μ
        >>> _ = storch.backward()
        >>> mu.grad.shape, bool(torch.allclose(mu.grad, 2 * mu.detach(), atol=0.15))
        (torch.Size([2]), True)
    """

    #: SPSA keeps no state of its own, but it reads and resets the random generator's state on the host
    #: within each step, which a replayed graph does not do
    step_state = StepState.host(
        "it reads the random generator's state on the host and sets it back twice in each step, so that x, x⁺ "
        "and x⁻ are drawn from the same random numbers (common random numbers), and a replayed graph neither "
        "reads nor sets that state"
    )

    def __init__(self, plate_name: str, n_samples: int = 1, c: float = 0.1) -> None:
        super().__init__(plate_name, None, n_samples)
        if not c > 0:
            raise ValueError(f"SPSA({plate_name!r}): the perturbation size c must be positive, got {c}.")
        self.c = float(c)
        self._records = GroupRecords("SPSA", "perturbations")  # samples -> _Record
        self.sampling_method.set_mc_weighting_function(self._weights)

    def check_distribution(self, distr: Distribution) -> None:
        leaf = _leaf(distr)
        if not _given(leaf):
            raise ValueError(
                f"SPSA({self.plate_name!r}) cannot read the parameters of {type(distr).__name__} "
                "back from the distribution (none of its arg_constraints is stored under its "
                "constructor name), so it cannot rebuild it perturbed. Register how with "
                "storch.method.spsa.register_spsa_wrapper, or use another method for this node."
            )

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        leaf = _leaf(distr)
        given = _given(leaf)
        names = perturbable_parameters(distr)
        if not names:
            samples = distr.sample((amt_samples,))
            self._records.keep(samples, _Record((), ()))
            return samples
        coords = tuple(_coordinate(leaf, name) for name in names)
        kwargs_plus = {k: v for k, v in given.items() if k not in names}
        kwargs_minus = dict(kwargs_plus)
        signs = []
        for coord in coords:
            u = coord.to_unconstrained(given[coord.name].detach())
            delta = torch.randint(0, 2, (amt_samples,) + tuple(u.shape), device=u.device).to(u.dtype) * 2 - 1
            signs.append(delta)
            kwargs_plus[coord.target] = coord.from_unconstrained(u + self.c * delta)
            kwargs_minus[coord.target] = coord.from_unconstrained(u - self.c * delta)
        distr_plus, distr_minus = _rebuild(distr, kwargs_plus), _rebuild(distr, kwargs_minus)
        device = given[names[0]].device
        state = _rng_state(device)
        # common random numbers: x, x⁺ and x⁻ all start from the same generator state
        x = distr.sample((amt_samples,))
        _set_rng_state(device, state)
        x_plus = distr_plus.sample()
        _set_rng_state(device, state)
        x_minus = distr_minus.sample()
        samples = flatten_groups(torch.stack([x, x_plus.to(x.dtype), x_minus.to(x.dtype)], 1))
        self._records.keep(samples, _Record(coords, tuple(signs)))
        return samples

    def _weights(self, tensor: StochasticTensor, plate: Plate) -> Optional[torch.Tensor]:
        m = self._records.of(tensor).group_size
        if m == 1:
            return None
        return group_weights(plate.size // m, [1.0, 0.0, 0.0])

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        record = self._records.of(tensor)
        if not record.coordinates:
            return None, None
        plate = tensor.plate
        per_group = split_groups(cost.detach(), plate, 3)
        difference = (per_group[..., 1] - per_group[..., 2]) / (2.0 * self.c)
        groups = group_plate(plate, 3)
        given = _given(_leaf(tensor.distribution))
        term: torch.Tensor | None = None
        for coord, delta in zip(record.coordinates, record.signs):
            u = coord.to_unconstrained(given[coord.name])
            delta = wrap(delta, layout_of_plates((groups,) + layout_of(u).plates))
            contribution = (u - u.detach()) * (difference * delta)  # 1/Δ = Δ for Rademacher signs
            event = contribution.dim() - len(layout_of(contribution).sizes)
            if event:
                contribution = contribution.sum(tuple(range(-event, 0)))
            term = contribution if term is None else term + contribution
        assert term is not None  # record.coordinates is not empty
        return None, spread_groups(term, cost, plate, 3)

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}, c={self.c}"
