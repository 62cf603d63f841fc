"""Local expectation gradients (IndeCateR) for factorised discrete variables.

For ``x = (x_1, …, x_D)`` with independent coordinates ``x_d ~ p_d`` taking ``K`` values,

    ∇θ E[f(x)] = E_x[∇θ f(x)] + Σ_d E_{x≠d}[ Σ_k ∇θ p_d(k) · f(x≠d, x_d = k) ]

(Titsias & Lázaro-Gredilla 2015, "Local expectation gradients for black box variational inference";
``seeds/004_…`` eqs. 16–17; De Smet et al. 2023, "Differentiable sampling of categorical distributions
using the CatLog-derivative trick" (IndeCateR)). Each coordinate's sum over its values is exact, given
one sample of the others. Since ``Σ_k ∇p_d(k) = 0``, the value ``k = x_d`` (the sample itself) needs no
evaluation of its own: ``Σ_k ∇p_d(k) f(x≠d, k) = Σ_{k≠x_d} ∇p_d(k) (f(x≠d, k) − f(x))``.

Points. Each of the ``n`` samples is a group of ``M = 1 + D·(K−1)`` points: the sample ``x`` itself
(plate weight ``1/n``) and, at position ``1 + d·(K−1) + j``, ``x`` with coordinate ``d`` set to the
``j``-th of its ``K − 1`` other values, in the order of :attr:`Coordinates.values` (weight 0). ``D``
counts the independent variables in the distribution's non-plate batch dimensions. The cost is
evaluated at all ``n·M`` points in one vectorised pass (:mod:`storch.method.groups`).

Chains: one evaluation plate for all the nodes. A local-expectation node whose distribution's newest
plate is the evaluation plate of another local-expectation node (``z₂ ~ p(z₂ | z₁)``, both sampled with
:class:`LocalExpectation`, ``n_samples=1`` for the downstream one) does not add a plate of its own, which
would make the cost's points the *product* ``M₁·M₂``. It extends the upstream plate instead: each
group gets ``D₂(K₂−1)`` more points, so a chain of nodes costs the *sum* ``1 + Σ_s D_s(K_s−1)`` per
sample. On the extended plate (named after the newest node), point ``m`` of a group is

* for ``m < M₁`` (the upstream points): ``z₁`` as at that point, and ``z₂`` drawn once from
  ``p(z₂ | z₁)`` at that point. The draws of one group share their uniforms (inverse CDF, common random
  numbers), so ``z₂`` changes only where ``z₁``'s change moves its distribution;
* for ``m ≥ M₁``: ``z₁`` as sampled and ``z₂``'s own one-coordinate changes of its point-0 draw.

Tensors computed from ``z₁`` alone are re-indexed to the extended plate where they meet ``z₂``
(an :class:`~storch.plate.AncestralPlate` step: ``z₁``'s values at the points ``m ≥ M₁`` are its
sample). A node computed from any step of a chain extends its newest step (branches ``z₁ → z₂``,
``z₁ → z₃`` share one plate); a *sibling*, whose distribution does not come from the chain, joins it
with ``joint_with=`` (its one draw per group is then the same at every upstream point). Nodes of other
methods drawn from a chain's points come before the chain in the surrogate recursion
(:attr:`~storch.plate.Plate.surrogate_order`), so their scores are part of the cost ``C`` below. A node
joins only if its distribution's other plates are older than the chain's first step.
``LocalExpectation(..., joint=False)`` keeps the nested form: a plate of its own, the cost at the
product of the points.

Surrogate. Node ``s`` of a chain (its changes at positions ``[M_{s−1}, M_s)`` of a group, ``M₀ = 1``)
contributes, per group,

    T_s = Σ_d Σ_j (q_dj − stopgrad q_dj) · □(½ Σ_{d'≠d} log p_{s,d'}(x_{s,d'})) · (C_s[m_dj] − C_s[0])

with ``q_dj = p_{s,d}(j-th value ≠ x_{s,d})`` at point 0, ``m_dj = M_{s−1} + d·(K−1) + j``, and
``C_s[m] = f[m] · □(Σ_{t>s} log p_t(z_t[m]))`` the cost at point ``m`` times the scores of the chain's
later nodes drawn there. The group's term ``Σ_s T_s`` is spread over its points; its forward value is
0, so the estimate of ``E f`` is the mean of ``f`` at the samples.

What is unbiased. First derivatives, for every parameter: ``T_s``'s derivative is node ``s``'s local
expectation given the upstream sample (each changed value's downstream nodes drawn once at that value,
an unbiased estimate of the expectation over them), and the pathwise part is ``f`` at the samples.
Second derivatives: within a node, ``∇p_d ∇C`` gives the mixed terms and the box, whose expectation
over the other coordinates is a score-function estimate, the cross terms
``∇p_d(k) ∇p_{d'}(k')ᵀ f(…, k, …, k')`` between coordinates, half from each. Across nodes ``s < t``,
``∇θ_s ∇θ_t E f = E[Σ_{z_s} ∇p_s(z_s) ∇θ_t E[f | z_s]]`` comes from ``T_s`` alone: its cost carries the
scores of the later nodes drawn at each point, so ``∇C_s`` is a single-sample estimate of
``∇θ_t E[f | z_s]``; ``T_t`` carries no upstream box, which would count that term twice. Third and
higher derivatives are biased (three-coordinate terms are missing). The nested form is unbiased for the
same orders: its inner estimate is the downstream node's own surrogate at every point.

The values a coordinate can take and their probabilities are registered per distribution type
(:func:`register_coordinates`); setting a coordinate to a value is then the same for every type.
"""

from __future__ import annotations

import copy
import math
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, OneHotCategorical

from storch.method.groups import flatten_groups, group_plate, group_weights, split_groups, spread_groups
from storch.method.method import Method
from storch.extend import (
    AncestralPlate,
    CostTensor,
    Plate,
    StochasticTensor,
    Tensor,
    TypeRegistry,
    align_to,
    distribution_layout,
    get_distr_parameters,
    layout_of,
    layout_of_plates,
    log_prob_of_own_samples,
    magic_box,
    merge_layouts,
    new_node,
    no_dispatch,
    node_of,
    note_sampled,
    reraise_cuda_dimension_error,
    restore_lazy_plates,
    wrap,
    wrap_new,
)

__all__ = [
    "LocalExpectation", "IndeCateR", "Coordinates", "register_coordinates", "coordinates_for",
    "local_expectation_points", "local_expectation_group_size", "local_expectation_weights",
    "local_expectation_term", "LocalExpectationPlate", "LocalExpectationMemoryError",
]


# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Coordinates:
    """What a factorised discrete distribution's coordinates look like, per distribution type.

    Attributes:
        values: ``distribution -> (K, *event_shape)``, the ``K`` values one coordinate can take
            (e.g. ``[0, 1]`` for a Bernoulli, the rows of the identity for a one-hot categorical).
        probs: ``distribution -> (*batch_shape, K)``, ``P(x_d = values[k])`` per coordinate,
            differentiable in the distribution's parameters.
        index: ``samples -> (...)``, the index ``k`` of each coordinate's value in ``values``
            (``samples`` of shape ``(..., *event_shape)``); ``None``: found by comparing with ``values``.
    """

    values: Callable[[Distribution], torch.Tensor]
    probs: Callable[[Distribution], torch.Tensor]
    index: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


_COORDINATES: TypeRegistry[Coordinates] = TypeRegistry(
    "local-expectation coordinates", register_with="storch.method.local_expectation.register_coordinates"
)


def register_coordinates(dist_type: type, coordinates: Coordinates, *, replace: bool = False) -> None:
    """Register how the coordinates of ``dist_type`` (and its subclasses) take their values.

    Args:
        dist_type: the distribution type.
        coordinates: its :class:`Coordinates`.
        replace: allow replacing an entry ``dist_type`` already has (e.g. a built-in one); without
            it a second registration raises :class:`storch.registry.DuplicateRegistrationError`.
    """
    _COORDINATES.register(dist_type, replace=replace)(coordinates)


def coordinates_for(distr: Distribution) -> Optional[Coordinates]:
    """The :class:`Coordinates` registered for ``type(distr)`` or its most specific base class, else ``None``.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> coordinates_for(Bernoulli(torch.tensor([0.25]))).probs(Bernoulli(torch.tensor([0.25]))).tolist()
        [[0.75, 0.25]]
    """
    return _COORDINATES.lookup(distr)


def _bernoulli_probs(d: Bernoulli) -> torch.Tensor:
    p = d.probs
    return torch.stack([1 - p, p], -1)


_COORDINATES.register(Bernoulli)(
    Coordinates(values=lambda d: torch.tensor([0.0, 1.0], dtype=d.probs.dtype, device=d.probs.device),
                probs=_bernoulli_probs, index=lambda x: x.long())
)
_COORDINATES.register(Categorical)(
    Coordinates(values=lambda d: torch.arange(d.probs.shape[-1], device=d.probs.device), probs=lambda d: d.probs,
                index=lambda x: x.long())
)
_COORDINATES.register(OneHotCategorical)(
    Coordinates(
        values=lambda d: torch.eye(d.probs.shape[-1], dtype=d.probs.dtype, device=d.probs.device),
        probs=lambda d: d.probs,
        index=lambda x: x.argmax(-1),
    )
)


def _require_coordinates(distr: Distribution, who: str) -> Coordinates:
    coordinates = coordinates_for(distr)
    if coordinates is None:
        hint = ""
        if type(distr).__name__ == "Independent":
            hint = (
                " Pass the base distribution instead (its batch dimensions are the independent "
                "coordinates), e.g. Bernoulli(logits) rather than Independent(Bernoulli(logits), 1)."
            )
        raise ValueError(
            f"{who}: no coordinates are registered for {type(distr).__name__}; local expectations "
            f"support factorised Bernoulli, Categorical and OneHotCategorical variables "
            f"(register others with storch.method.local_expectation.register_coordinates).{hint}"
        )
    return coordinates


def _var_shape(distr: Distribution, n_plate_dims: int) -> tuple[int, ...]:
    return tuple(distr.batch_shape)[n_plate_dims:]


def _counts(distr: Distribution, n_plate_dims: int, who: str) -> tuple[int, int]:
    """``(D, K)``: the number of independent variables and of values of each."""
    coordinates = _require_coordinates(distr, who)
    return math.prod(_var_shape(distr, n_plate_dims)), coordinates.values(distr).shape[0]


def local_expectation_group_size(distr: Distribution, n_plate_dims: int = 0) -> int:
    """``M = 1 + D·(K−1)`` evaluation points per sample of ``distr``: the sample and its changes.

    ``D`` is the number of independent variables in the batch dimensions after the first
    ``n_plate_dims`` (those belong to plates), ``K`` the number of values of each. A node chained to
    an upstream local-expectation node adds ``D·(K−1)`` points to the upstream group instead.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli, OneHotCategorical
        >>> local_expectation_group_size(OneHotCategorical(logits=torch.zeros(5, 2, 3)), n_plate_dims=1)
        5
        >>> local_expectation_group_size(Bernoulli(logits=torch.zeros(200)))   # 200 bits: 1 + 200
        201
    """
    n_vars, k = _counts(distr, n_plate_dims, "local_expectation_group_size")
    return 1 + n_vars * (k - 1)


def _value_index(x: torch.Tensor, values: torch.Tensor, coordinates: Coordinates) -> torch.Tensor:
    """The index ``k`` of each coordinate's value in ``values`` (``(K, *event)``): ``x`` of shape
    ``(..., *event)`` gives ``(...)``."""
    if coordinates.index is not None:
        return coordinates.index(x)
    n_event = values.dim() - 1
    match = x.unsqueeze(x.dim() - n_event) == values.to(x.dtype)  # (..., K, *event)
    if n_event:
        match = match.flatten(-n_event).all(-1)
    return match.to(torch.uint8).argmax(-1)


def _other_values(index: torch.Tensor, k: int) -> torch.Tensor:
    """``(..., K−1)``: the indices of the values other than ``index``, in increasing order."""
    j = torch.arange(k - 1, device=index.device)
    return j + (j >= index.unsqueeze(-1)).to(j.dtype)


def _changes(x: torch.Tensor, values: torch.Tensor, n_between: int, coordinates: Coordinates) -> torch.Tensor:
    """The one-coordinate changes of samples ``x`` of shape ``(G, *P, D, *event)``, with ``n_between``
    dimensions ``P`` (plates) between the groups ``G`` and the variables ``D``.

    Returns ``(G, D·(K−1), *P, D, *event)``: change ``d·(K−1) + j`` is ``x`` with variable ``d`` set
    to the ``j``-th of its other values.
    """
    k = values.shape[0]
    n_event = values.dim() - 1
    n_vars = x.shape[1 + n_between]
    others = values[_other_values(_value_index(x, values, coordinates), k)].to(x.dtype)  # (G, *P, D, K−1, *event)
    # (G, D, K−1, *P, 1, *event): the new value of variable d, to be placed at d' = d
    order = [0, 1 + n_between, 2 + n_between] + list(range(1, 1 + n_between))
    order += list(range(3 + n_between, 3 + n_between + n_event))
    new = others.permute(order).unsqueeze(3 + n_between)
    which = torch.eye(n_vars, dtype=torch.bool, device=x.device)
    which = which.reshape((1, n_vars, 1) + (1,) * n_between + (n_vars,) + (1,) * n_event)
    changed = torch.where(which, new, x[:, None, None])
    return changed.reshape((x.shape[0], n_vars * (k - 1)) + tuple(x.shape[1:]))


def local_expectation_points(distr: Distribution, n_samples: int, n_plate_dims: int = 0) -> torch.Tensor:
    """``n`` samples of ``distr`` and their one-coordinate changes: ``(n, 1 + D·(K−1), *batch, *event)``.

    Point 0 of group ``j`` is the sample ``x_j``; point ``1 + d·(K−1) + i`` is ``x_j`` with coordinate
    ``d`` (in row-major order over the non-plate batch dimensions) set to the ``i``-th value other than
    its own. Call it on plain tensors (storch dispatch disabled), as proposals are.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> points = local_expectation_points(Bernoulli(torch.tensor([1.0, 0.0])), 1)
        >>> points[0].tolist()   # the sample, then coordinate 0 flipped, then coordinate 1 flipped
        [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    """
    coordinates = _require_coordinates(distr, "local_expectation_points")
    values = coordinates.values(distr)  # (K, *event)
    batch, event = tuple(distr.batch_shape), tuple(distr.event_shape)
    plate_shape, n_vars = batch[:n_plate_dims], math.prod(batch[n_plate_dims:])
    x = distr.sample((n_samples,))
    flat = x.reshape((n_samples,) + plate_shape + (n_vars,) + event)
    changed = _changes(flat, values, len(plate_shape), coordinates).reshape((n_samples, -1) + batch + event)
    return torch.cat([x.unsqueeze(1), changed], 1)


def local_expectation_weights(n_samples: int, group_size: int) -> torch.Tensor:
    """Plate weights of the points: ``1/n`` on each sample, 0 on the changed points.

    Examples:
        >>> local_expectation_weights(2, 3).tolist()
        [0.5, 0.0, 0.0, 0.5, 0.0, 0.0]
    """
    return group_weights(n_samples, [1.0] + [0.0] * (group_size - 1))


# --------------------------------------------------------------------------- the evaluation plate
@dataclass(frozen=True, eq=False)
class _Group:
    """How one node's points sit in the groups of its plate.

    ``start``: where the node's own changes begin (the points before are the upstream step's, or the
    sample alone for the first node of a chain). For a node whose distribution was computed from the
    chain: ``drawn_from``, that distribution as it was when the node was drawn (on the chain step it
    carried; the node's own distribution object is then moved to the node's plate, see
    :func:`_move_to_plate`), and ``source``, the position among that step's points of each upstream
    point (``None`` when it carried the upstream step itself).
    """

    n_groups: int
    size: int
    start: int
    n_vars: int
    k: int
    drawn_from: Optional[Distribution] = None
    source: Optional[torch.Tensor] = None


class LocalExpectationPlate(AncestralPlate):
    """The evaluation plate of a local-expectation node: ``n`` groups of ``M`` points.

    The plate of the first node of a chain has no ancestor; a node joined to the chain extends the
    groups of its newest step (see the module docstring) with a new step named after itself; tensors
    of earlier steps are re-indexed to it where they meet (point ``m`` of a group takes the upstream
    point ``m`` for ``m < M_upstream``, the sample otherwise). In the surrogate every step of a chain
    comes where its first step does (:attr:`surrogate_order`): after the nodes drawn from its points.
    """

    __slots__ = ("_extended_by",)
    renames_its_chain = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._extended_by: Optional[weakref.ref] = None

    @property
    def group(self) -> _Group:
        return self.info  # type: ignore[return-value]

    @property
    def root(self) -> "LocalExpectationPlate":
        step = self
        while isinstance(step.ancestor, LocalExpectationPlate):
            step = step.ancestor
        return step

    @property
    def surrogate_order(self) -> int:
        return self.root.order

    def tip(self) -> "LocalExpectationPlate":
        """The newest step of this plate's chain (the one a new node extends)."""
        step = self
        while step._extended_by is not None:
            newer = step._extended_by()
            if newer is None:
                break
            step = newer
        return step

    def chain(self) -> list["LocalExpectationPlate"]:
        """The steps of the chain up to this one, first node first."""
        out: list[LocalExpectationPlate] = []
        step: Optional[AncestralPlate] = self
        while isinstance(step, LocalExpectationPlate):
            out.append(step)
            step = step.ancestor
        return out[::-1]


def _extension_index(n_groups: int, upstream: int, size: int, device: torch.device) -> torch.Tensor:
    """``parent_index`` of an extended plate: point ``m`` of group ``j`` comes from upstream point
    ``j·upstream + m`` for ``m < upstream`` and from the group's sample ``j·upstream`` otherwise."""
    m = torch.arange(size, device=device)
    within = torch.where(m < upstream, m, torch.zeros_like(m))
    return (torch.arange(n_groups, device=device)[:, None] * upstream + within).reshape(-1)


def _index_between(newer: LocalExpectationPlate, older: LocalExpectationPlate) -> Optional[torch.Tensor]:
    """For each point of ``newer``, its position among the points of its earlier step ``older``
    (``None`` when they are the same step)."""
    index = None
    step = newer
    while step is not older:
        parent = step.parent_index
        index = parent if index is None else parent[index]  # type: ignore[index]
        step = step.ancestor  # type: ignore[assignment]
    return index


def _move_to_plate(distr: Distribution, plate: LocalExpectationPlate) -> None:
    """Re-index, in place, the parameters of a joined node's distribution from the chain step they
    carry to the node's own plate, so that the distribution and its samples have the same plates:
    ``q.log_prob(z)`` then lines up (torch.distributions compares the raw shapes of the value and
    the batch before storch could align them) and ``q.batch_shape`` starts with the plate's size.

    Cached lazy parameters (``probs`` of a ``Bernoulli(logits=…)``) are re-indexed alike.
    """
    restore_lazy_plates(distr)  # cached plain parameters get their plates back first
    for dist in _with_nested(distr):
        moved = False
        for name, value in list(dist.__dict__.items()):
            if not isinstance(value, Tensor):
                continue
            layout = layout_of(value)
            if not any(isinstance(p, AncestralPlate) and p.chain_name == plate.chain_name for p in layout.plates):
                continue
            union = merge_layouts([layout, layout_of_plates((plate,))])
            with no_dispatch():
                aligned = align_to(value, union)
            dist.__dict__[name] = wrap(aligned, union)
            moved = True
        if moved:
            dist._batch_shape = torch.Size((plate.size,) + tuple(dist._batch_shape)[1:])


def _copy_distribution(d: Distribution) -> Distribution:
    """A copy of ``d`` and of the distributions nested in it that shares their tensors."""
    c = copy.copy(d)
    for name, value in c.__dict__.items():
        if isinstance(value, Distribution):
            c.__dict__[name] = _copy_distribution(value)
    return c


def _with_nested(d: Distribution) -> list[Distribution]:
    found = [d]
    for value in d.__dict__.values():
        if isinstance(value, Distribution):
            found.extend(_with_nested(value))
    return found


def _explicit_chain(who: str, joint_with: Optional[StochasticTensor], method: "LocalExpectation") -> Optional[LocalExpectationPlate]:
    """The evaluation plate of ``joint_with`` (a local-expectation node), checked."""
    if joint_with is None:
        return None
    plate = getattr(joint_with, "plates", [None])[0] if isinstance(joint_with, Tensor) else None
    if not isinstance(plate, LocalExpectationPlate) or plate.node is None:
        raise TypeError(
            f"{who}: joint_with must be the samples of a LocalExpectation node of this step (their plate is "
            f"extended), got {type(joint_with).__name__}"
            + (f" with plates {joint_with.plate_names}" if isinstance(joint_with, Tensor) else "") + "."
        )
    if not method.joint or method.n_samples != 1:
        raise ValueError(
            f"{who}: joint_with needs joint=True and n_samples=1 (one draw per upstream sample), got "
            f"joint={method.joint}, n_samples={method.n_samples}."
        )
    return plate


class LocalExpectationMemoryError(MemoryError):
    """The evaluation points of a local-expectation node would not fit in memory."""


#: the fraction of the free memory the samples of the points may take (the cost's evaluation at
#: every point, activations and gradients, takes many times the samples themselves)
_SAMPLES_MEMORY_FRACTION = 0.25
#: samples smaller than this are not checked
_ALWAYS_FITS = 2**28


def _free_memory(device: torch.device) -> Optional[int]:
    """Free bytes on ``device`` (``None`` where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def _check_fits(who: str, points: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                nested: Sequence[Plate]) -> None:
    """Refuse, before allocating, samples of ``shape`` that would take more than a quarter of the free memory."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _ALWAYS_FITS or torch.compiler.is_compiling():
        return  # no system call for the common case, nor inside a torch.compile trace
    free = _free_memory(device)
    if free is None or nbytes <= _SAMPLES_MEMORY_FRACTION * free:
        return
    why = (
        f" They multiply with the points of the plates {[p.name for p in nested]} that its distribution carries "
        "(nested local expectations): sample the nodes with LocalExpectation(..., joint=True) and "
        "n_samples=1 downstream, so that a chain costs the sum of its points, not their product."
        if nested else " Use fewer samples, a smaller minibatch, or an estimator with fewer cost evaluations."
    )
    raise LocalExpectationMemoryError(
        f"{who}: {points} evaluation points per sample, samples of shape {tuple(shape)} "
        f"({nbytes / 2**30:.1f} GiB) against {free / 2**30:.1f} GiB free on {device}; evaluating the cost at "
        f"every point takes many times more.{why}"
    )


def _chain_to_extend(
    method: "LocalExpectation", parents: Sequence[Plate], explicit: Optional[LocalExpectationPlate]
) -> tuple[Optional[LocalExpectationPlate], Optional[LocalExpectationPlate]]:
    """``(tip, carried)``: the newest step of the chain this node joins and the step of it that the
    distribution carries (``None`` for a node joined by ``joint_with``); ``(None, None)`` for a plate
    of its own.

    A node joins a chain whose step is its distribution's newest plate, or the chain of ``joint_with``,
    when it draws one sample per upstream sample and its distribution's other plates are all older
    than the chain's first step (they must still be there when the chain's term is computed, which
    comes after every node drawn from the chain's points).
    """
    if not method.joint or method.n_samples != 1:
        return None, None
    carried: Optional[LocalExpectationPlate] = None
    if parents and isinstance(parents[0], LocalExpectationPlate) and parents[0].node is not None:
        carried = parents[0]
    if carried is None and explicit is None:
        return None, None
    if explicit is not None and carried is not None and explicit.root is not carried.root:
        raise ValueError(
            f"{type(method).__name__}({method.plate_name!r}): joint_with names the chain of "
            f"{explicit.root.name!r}, but the distribution is computed from the chain of {carried.root.name!r}; "
            "a node joins the chain its distribution comes from."
        )
    tip = (carried if carried is not None else explicit).tip()  # type: ignore[union-attr]
    root_order = tip.root.order
    others = [p for p in parents if p is not carried]
    if any(p.order >= root_order for p in others):
        if explicit is not None:
            late = [p.name for p in others if p.order >= root_order]
            raise ValueError(
                f"{type(method).__name__}({method.plate_name!r}): cannot join the points of {tip.root.name!r}: "
                f"the distribution also carries the plates {late}, drawn after that chain began. Sample this node "
                "with joint_with=None (its own plate) or draw those plates before the chain."
            )
        return None, None
    return tip, carried


# --------------------------------------------------------------------------- the surrogate term
@dataclass(frozen=True, eq=False)
class _Segment:
    """What the term of one node of a chain needs, as plain tensors (shapes with ``P`` the node's
    other plates and ``U`` the upstream points, 1 for the first node): ``log_p`` ``(n, U, *P, D)``, the
    per-variable log-probability of its draws at the upstream points; ``probs`` ``(n, *P, D, K)`` and
    ``index`` ``(n, *P, D)``, its probabilities and the index of each variable's value at point 0."""

    group: _Group
    parents: tuple
    log_p: torch.Tensor
    probs: torch.Tensor
    index: torch.Tensor


def _probs_at_upstream(distr: Distribution, group: _Group, coordinates: Coordinates, n_parents: int) -> torch.Tensor:
    """The node's probabilities at the upstream points: ``(n, U, *P, D, K)``, or ``(1, 1, *P, D, K)``
    for a distribution that does not vary over them."""
    if group.drawn_from is None:
        probs = coordinates.probs(distr)
        return probs.reshape((1, 1) + tuple(probs.shape[:n_parents]) + (group.n_vars, group.k))
    probs = coordinates.probs(group.drawn_from)  # on the chain step it carried
    if group.source is not None:
        probs = probs.index_select(0, group.source)
    return probs.reshape((group.n_groups, group.start) + tuple(probs.shape[1: 1 + n_parents]) + (group.n_vars, group.k))


def _segment(node, group: _Group) -> _Segment:
    """The :class:`_Segment` of ``node`` (a :class:`~storch.tensor.StochasticNode`)."""
    distr, samples = node.distribution, node.samples
    parents = tuple(node.layout.plates[1:])
    other = tuple(samples.shape[1: 1 + len(parents)])
    n, d, k, upstream = group.n_groups, group.n_vars, group.k, group.start
    coordinates = _require_coordinates(distr, "local_expectation_term")
    own = samples.reshape((n, group.size) + tuple(samples.shape[1:]))[:, :upstream]
    index = _value_index(own, coordinates.values(distr), coordinates).reshape((n, upstream) + other + (d,))
    probs = _probs_at_upstream(distr, group, coordinates, len(parents)).expand((n, upstream) + other + (d, k))
    if group.drawn_from is None:  # the sample of a first node, or a sibling's one draw per group
        drawn = own.reshape((n * upstream,) + tuple(samples.shape[1:]))
        log_p = log_prob_of_own_samples(distr, drawn).reshape((n, upstream) + other + (d,))
    else:  # at the upstream points: from the probabilities there (no evaluation at the node's own points)
        log_p = probs.gather(-1, index.unsqueeze(-1)).squeeze(-1).log()
    return _Segment(group, parents, log_p, probs[:, 0], index[:, 0])


def _segments(tensor: StochasticTensor) -> list[_Segment]:
    """The segments of the chain that ends at ``tensor``'s node, first node first."""
    plate = tensor.plate
    with no_dispatch():
        if isinstance(plate, LocalExpectationPlate):
            return [_segment(step.node, step.group) for step in plate.chain()]
        # a plain plate whose points another method laid out (GSB's discrete rule): one node
        node = node_of(tensor)
        n_vars, k = _counts(node.distribution, len(node.layout.plates) - 1, "local_expectation_term")
        size = 1 + n_vars * (k - 1)
        return [_segment(node, _Group(group_plate(plate, size).size, size, 1, n_vars, k))]


def _later_scores(later: Sequence[_Segment], groups: Plate, points: int) -> Optional[Tensor]:
    """``Σ_t log p_t(z_t[m])`` over the chain's later nodes at the first ``points`` points of each
    group, as a storch tensor whose last dimension is the point."""
    total = None
    for segment in later:
        with no_dispatch():
            score = segment.log_p[:, :points].sum(-1).movedim(1, -1)  # (n, *P, points)
        score = wrap_new(score, layout_of_plates((groups,) + segment.parents))
        total = score if total is None else total + score
    return total


def _segment_term(segment: _Segment, per_group: Tensor, groups: Plate, later: Sequence[_Segment]) -> Tensor:
    """``T_s`` of the module docstring, one value per group (and per value of other plates)."""
    group = segment.group
    layout = layout_of_plates((groups,) + segment.parents)
    with no_dispatch():
        own = segment.log_p[:, 0]  # (n, *P, D) at the sample
        others = own.sum(-1, keepdim=True) - own  # Σ_{d' ≠ d} log p_{d'}(x_{d'})
        box = magic_box(0.5 * others).unsqueeze(-1)  # (n, *P, D, 1)
        index = segment.index
        probs = segment.probs
        q = probs.gather(-1, _other_values(index, group.k))  # (n, *P, D, K−1): the other values' probabilities
    q, box = wrap_new(q, layout), wrap_new(box, layout)
    end = group.start + group.n_vars * (group.k - 1)
    costs = per_group[..., :end]
    scores = _later_scores(later, groups, end)
    if scores is not None:
        costs = costs * magic_box(scores)
    changed = torch.unflatten(costs[..., group.start:], -1, (group.n_vars, group.k - 1))
    return ((q - q.detach()) * box * (changed - costs[..., :1].unsqueeze(-1))).sum(-1).sum(-1)


def local_expectation_term(tensor: StochasticTensor, cost: torch.Tensor) -> Tensor:
    """The surrogate term, per point, of a node sampled with :func:`local_expectation_points`, or of
    the chain of local-expectation nodes that ends at ``tensor``'s node.

    ``Σ_s Σ_d Σ_j (q_dj − stopgrad q_dj) · □(½ Σ_{d'≠d} log p_{d'}(x_{d'})) · (C_s[m_dj] − C_s[0])``
    per group (``s`` over the chain's nodes, ``j`` over the values other than the sample's),
    spread over the group's points (so it counts once per group). Its forward value is 0; its first
    and second derivatives are the local-expectation estimates (see the module docstring).

    Args:
        tensor: the node (its plate holds ``n`` groups of points, sample first).
        cost: the downstream cost, one value per point (and per value of other plates).
    """
    segments = _segments(tensor)
    size = segments[-1].group.size
    plate = tensor.plate
    groups = group_plate(plate, size)
    per_group = split_groups(cost, plate, size)  # (groups, *rest), the group's points as the last dimension
    total = None
    for s, segment in enumerate(segments):
        term = _segment_term(segment, per_group, groups, segments[s + 1:])
        total = term if total is None else total + term
    return spread_groups(total, cost, plate, size)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- method
class LocalExpectation(Method):
    """Local expectation gradients (IndeCateR) for factorised Bernoulli and categorical nodes.

    ``∇θ E f = E[∇θ f(x)] + Σ_d E_{x≠d}[Σ_k ∇θ p_d(k) f(x≠d, x_d = k)]``, exact in each coordinate
    given a sample of the others (Titsias & Lázaro-Gredilla 2015; De Smet et al. 2023). Unbiased for
    first and second derivatives (not third). Costs ``n·(1 + D·(K−1))`` evaluations: the node's plate
    holds, for each of the ``n`` samples, the sample and its ``D·(K−1)`` one-coordinate changes; the
    estimate of ``E f`` uses the samples only (the other points have weight 0).

    A node whose distribution's newest plate is another local-expectation node's (a chain
    ``z₁ → z₂``) adds its ``D₂(K₂−1)`` changes to that plate's groups instead of a plate of its own, so
    the chain costs the sum of the nodes' points, not their product (module docstring).

    Args:
        plate_name: node / plate name.
        n_samples: the number of samples ``n`` (the plate has ``n·(1 + D·(K−1))`` points). A node
            chained to an upstream one draws one sample per upstream sample and needs ``n_samples=1``
            (with more it is nested).
        joint: extend an upstream local-expectation plate (the default); ``False`` nests the node
            (a plate of its own, the cost at the product of the points).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> logits = torch.tensor([0.3, -0.5], requires_grad=True)
        >>> x = LocalExpectation("x", n_samples=2)(Bernoulli(logits=logits))
        >>> x.shape                                  # 2 samples × (1 + 2 variables × 1 other value)
        torch.Size([6, 2])
        >>> y = LocalExpectation("y")(Bernoulli(logits=x.sum(-1, keepdim=True) - 1.0))
        >>> y.plate_names, y.shape                   # y's one change joins x's groups: 2 × (3 + 1)
        (['y'], torch.Size([8, 1]))
        >>> storch.add_cost((x[..., 0] - 2 * x[..., 1] + y[..., 0]) ** 2, "f")
        >>> _ = storch.backward()
        >>> logits.grad is not None
        True
    """

    def __init__(self, plate_name: str, n_samples: int = 1, *, joint: bool = True) -> None:
        super().__init__(plate_name, None, n_samples)
        self.joint = bool(joint)
        self.sampling_method.set_mc_weighting_function(self._weights)

    def check_distribution(self, distr: Distribution) -> None:
        _require_coordinates(distr, f"{type(self).__name__}({self.plate_name!r})")

    def forward(self, distr: Distribution, joint_with: Optional[StochasticTensor] = None) -> StochasticTensor:
        """Sample ``distr``: the sample and its changes, on a plate of its own or extending a chain.

        Args:
            distr: a factorised Bernoulli or categorical distribution.
            joint_with: a local-expectation node of this step whose points this node joins although its
                distribution is not computed from it (a *sibling*: ``z`` next to ``b`` in ``f(b, z)``),
                so that the cost is evaluated at the sum of their points, not the product.
        """
        if not isinstance(distr, Distribution):
            return super().forward(distr)  # raises the common error
        self.check_distribution(distr)
        parents = distribution_layout(distr)
        if self.plate_name in parents.names:
            return super().forward(distr)  # raises the common error
        who = f"{type(self).__name__}({self.plate_name!r})"
        tip, carried = _chain_to_extend(self, parents.plates, _explicit_chain(who, joint_with, self))
        try:
            with no_dispatch():
                if tip is None:
                    samples, group, others, index = self._draw_group(distr, parents.plates, who)
                else:
                    samples, group, others, index = self._extend_group(distr, parents.plates, tip, carried, who)
        except RuntimeError as error:
            reraise_cuda_dimension_error(error, parents.plates, f"{who} sampling")
            raise
        created_on = parents.plates if tip is None or carried is not None else parents.plates + (tip,)
        plate = LocalExpectationPlate(
            self.plate_name, samples.shape[0], parents=created_on, ancestor=tip, parent_index=index, info=group,
        )
        if tip is not None:
            tip._extended_by = weakref.ref(plate)
        if carried is not None:
            _move_to_plate(distr, plate)
        tensor = new_node(self, distr, samples, plate, others)
        plate.weight = self._plate_weight(tensor, plate)
        restore_lazy_plates(distr)  # parameters computed while sampling with dispatch disabled
        if torch.is_grad_enabled() and get_distr_parameters(distr):
            note_sampled(plate)  # its gradient needs a cost that carries its plate (see storch.backward)
        return tensor

    def _draw_group(self, distr: Distribution, plates: Sequence[Plate], who: str):
        """A plate of its own: ``n`` groups of the sample and its changes."""
        n = self.n_samples
        n_vars, k = _counts(distr, len(plates), who)
        size = 1 + n_vars * (k - 1)
        shape = (n * size,) + tuple(distr.batch_shape) + tuple(distr.event_shape)
        nested = [p for p in plates if isinstance(p, LocalExpectationPlate)]
        _check_fits(who, size, shape, distr.probs.dtype, distr.probs.device, nested)  # type: ignore[attr-defined]
        samples = flatten_groups(local_expectation_points(distr, n, len(plates)))
        return samples, _Group(n, size, 1, n_vars, k), tuple(plates), None

    def _extend_group(self, distr: Distribution, plates: Sequence[Plate], tip: LocalExpectationPlate,
                      carried: Optional[LocalExpectationPlate], who: str):
        """Extend the groups of ``tip``: a draw at each of its points (inverse CDF with one uniform per
        group and variable, shared by the points), then the changes of the draw at point 0."""
        coordinates = _require_coordinates(distr, who)
        values = coordinates.values(distr)
        n, upstream = tip.group.n_groups, tip.group.size
        n_vars, k = _counts(distr, len(plates), who)
        size = upstream + n_vars * (k - 1)
        first = 0 if carried is None else 1
        other = tuple(distr.batch_shape)[first: len(plates)]
        event = tuple(distr.event_shape)
        _check_fits(who, size, (n * size,) + other + (n_vars,) + event, distr.probs.dtype,  # type: ignore[attr-defined]
                    distr.probs.device, [])  # type: ignore[attr-defined]
        source = None if carried is None else _index_between(tip, carried)
        drawn_from = None if carried is None else _copy_distribution(distr)  # before it moves to the new plate
        group = _Group(n, size, upstream, n_vars, k, drawn_from=drawn_from, source=source)
        probs = _probs_at_upstream(distr, group, coordinates, len(plates) - first)
        u = torch.rand((n, 1) + other + (n_vars, 1), dtype=probs.dtype, device=probs.device)
        index = (probs.cumsum(-1)[..., :-1] <= u).sum(-1)  # inverse CDF: P(index = k) = probs[k]
        drawn = values[index.expand((n, upstream) + other + (n_vars,))]  # (n, upstream points, *other, D, *event)
        changed = _changes(drawn[:, 0], values, len(other), coordinates)  # (n, D·(K−1), *other, D, *event)
        samples = torch.cat([drawn, changed], 1)
        samples = samples.reshape((n * size,) + other + _var_shape(distr, len(plates)) + event)
        parent_index = _extension_index(n, upstream, size, samples.device)
        return samples, group, tuple(p for p in plates if p is not carried), parent_index

    def _weights(self, tensor: StochasticTensor, plate: Plate) -> torch.Tensor:
        group: _Group = plate.info  # type: ignore[assignment]
        return local_expectation_weights(group.n_groups, group.size).to(tensor.device)

    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[None, Tensor]:
        return None, local_expectation_term(tensor, cost)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.joint else ", joint=False")


#: De Smet et al. 2023 call the categorical case IndeCateR; it is the same estimator.
IndeCateR = LocalExpectation
