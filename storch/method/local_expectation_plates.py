"""Evaluation plates of local-expectation nodes, shared along chains.

A local-expectation node lays out ``n`` groups of points on its plate
([`LocalExpectationPlate`][storch.method.local_expectation_plates.LocalExpectationPlate]):
the sample and its one-coordinate changes. A node computed from another local-expectation node (or
joined to it with ``joint_with``) extends that plate's groups with its own changes instead of adding a
plate ([`extended_points`][storch.method.local_expectation_plates.extended_points]), so a chain costs the sum of its
nodes' points, not their product; the
math of the estimator on such a plate is in [`storch.method.local_expectation`][storch.method.local_expectation]. This
module decides
whether a node joins ([`chain_to_extend`][storch.method.local_expectation_plates.chain_to_extend]), draws the points,
moves a joined node's distribution
to its plate ([`move_to_plate`][storch.method.local_expectation_plates.move_to_plate]) and refuses, before allocating,
points that would not fit
([`check_fits`][storch.method.local_expectation_plates.check_fits]).
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.distributions import Distribution

from storch.extend import (
    AncestralPlate,
    Plate,
    StochasticTensor,
    Tensor,
    align_to,
    copy_distribution,
    layout_of,
    layout_of_plates,
    merge_layouts,
    no_dispatch,
    restore_lazy_plates,
    with_nested,
    wrap,
)
from storch.method.groups import flatten_groups
from storch.method.local_expectation_points import (
    Coordinates,
    local_expectation_points,
    one_coordinate_changes,
    require_coordinates,
    variable_counts,
    variable_shape,
)

if TYPE_CHECKING:  # pragma: no cover
    from storch.method.local_expectation import LocalExpectation

__all__ = [
    "PointGroup", "LocalExpectationPlate", "LocalExpectationMemoryError", "chain_to_extend", "explicit_chain",
    "own_points", "extended_points", "move_to_plate", "check_fits", "probs_at_upstream",
]


@dataclass(frozen=True, eq=False)
class PointGroup:
    """How one node's points sit in the groups of its plate.

    ``start``: where the node's own changes begin (the points before are the upstream step's, or the
    sample alone for the first node of a chain). For a node whose distribution was computed from the
    chain: ``drawn_from``, that distribution as it was when the node was drawn (on the chain step it
    carried; the node's own distribution object is then moved to the node's plate, see
    [`move_to_plate`][storch.method.local_expectation_plates.move_to_plate]), and ``source``, the position among that
    step's points of each upstream
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
    comes where its first step does (`surrogate_order`): after the nodes drawn from its points.
    """

    __slots__ = ("_extended_by",)
    renames_its_chain = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._extended_by: Optional[weakref.ref] = None

    @property
    def group(self) -> PointGroup:
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


def move_to_plate(distr: Distribution, plate: LocalExpectationPlate) -> None:
    """Re-index, in place, the parameters of a joined node's distribution from the chain step they
    carry to the node's own plate, so that the distribution and its samples have the same plates:
    ``q.log_prob(z)`` then lines up (torch.distributions compares the raw shapes of the value and
    the batch before storch could align them) and ``q.batch_shape`` starts with the plate's size.

    Cached lazy parameters (``probs`` of a ``Bernoulli(logits=…)``) are re-indexed alike, and the batch
    shape moves for every distribution in ``distr``: also for one without tensors of its own
    (``OneHotCategorical`` keeps its parameters in the ``Categorical`` it wraps).
    """
    restore_lazy_plates(distr)  # cached plain parameters get their plates back first
    moved = False
    for dist in with_nested(distr):
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
    if moved:  # the chain step leads every batch: also that of a wrapper (OneHotCategorical, Independent)
        for dist in with_nested(distr):
            dist._batch_shape = torch.Size((plate.size,) + tuple(dist._batch_shape)[1:])


def explicit_chain(who: str, joint_with: Optional[StochasticTensor], method: "LocalExpectation") -> Optional[LocalExpectationPlate]:
    """The evaluation plate of ``joint_with`` (a local-expectation node), checked."""
    if joint_with is None:
        return None
    plates = joint_with.plates if isinstance(joint_with, Tensor) else []
    plate = plates[0] if plates else None
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


def check_fits(who: str, points: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
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


def chain_to_extend(
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


def probs_at_upstream(distr: Distribution, group: PointGroup, coordinates: Coordinates, n_parents: int) -> torch.Tensor:
    """The node's probabilities at the upstream points: ``(n, U, *P, D, K)``, or ``(1, 1, *P, D, K)``
    for a distribution that does not vary over them."""
    if group.drawn_from is None:
        probs = coordinates.probs(distr)
        return probs.reshape((1, 1) + tuple(probs.shape[:n_parents]) + (group.n_vars, group.k))
    probs = coordinates.probs(group.drawn_from)  # on the chain step it carried
    if group.source is not None:
        probs = probs.index_select(0, group.source)
    return probs.reshape((group.n_groups, group.start) + tuple(probs.shape[1: 1 + n_parents]) + (group.n_vars, group.k))


def _probs_of(distr: Distribution, who: str) -> torch.Tensor:
    """The coordinates' probabilities, read through the registry (so also for an ``Independent``,
    which has no ``probs`` of its own)."""
    return require_coordinates(distr, who).probs(distr)


def own_points(distr: Distribution, plates: Sequence[Plate], n: int, who: str):
    """A plate of its own: ``n`` groups of the sample and its changes; ``(samples, group, other plates,
    parent index)`` as [`extended_points`][storch.method.local_expectation_plates.extended_points]."""
    n_vars, k = variable_counts(distr, len(plates), who)
    size = 1 + n_vars * (k - 1)
    shape = (n * size,) + tuple(distr.batch_shape) + tuple(distr.event_shape)
    nested = [p for p in plates if isinstance(p, LocalExpectationPlate)]
    probs = _probs_of(distr, who)
    check_fits(who, size, shape, probs.dtype, probs.device, nested)
    samples = flatten_groups(local_expectation_points(distr, n, len(plates)))
    return samples, PointGroup(n, size, 1, n_vars, k), tuple(plates), None


def extended_points(distr: Distribution, plates: Sequence[Plate], tip: "LocalExpectationPlate",
                    carried: Optional["LocalExpectationPlate"], who: str):
    """Extend the groups of ``tip``: a draw at each of its points (inverse CDF with one uniform per
    group and variable, shared by the points), then the changes of the draw at point 0.

    Returns the samples ``(n·M, *other plates, *batch, *event)``, their
    [`PointGroup`][storch.method.local_expectation_plates.PointGroup], the plates
    of the samples besides the new one, and the new plate's ``parent_index``.
    """
    coordinates = require_coordinates(distr, who)
    values = coordinates.values(distr)
    n, upstream = tip.group.n_groups, tip.group.size
    n_vars, k = variable_counts(distr, len(plates), who)
    size = upstream + n_vars * (k - 1)
    first = 0 if carried is None else 1
    other = tuple(distr.batch_shape)[first: len(plates)]
    event = tuple(distr.event_shape)
    probs = _probs_of(distr, who)
    check_fits(who, size, (n * size,) + other + (n_vars,) + event, probs.dtype, probs.device, [])
    source = None if carried is None else _index_between(tip, carried)
    drawn_from = None if carried is None else copy_distribution(distr)  # before it moves to the new plate
    group = PointGroup(n, size, upstream, n_vars, k, drawn_from=drawn_from, source=source)
    probs = probs_at_upstream(distr, group, coordinates, len(plates) - first)
    u = torch.rand((n, 1) + other + (n_vars, 1), dtype=probs.dtype, device=probs.device)
    index = (probs.cumsum(-1)[..., :-1] <= u).sum(-1)  # inverse CDF: P(index = k) = probs[k]
    drawn = values[index.expand((n, upstream) + other + (n_vars,))]  # (n, upstream points, *other, D, *event)
    changed = one_coordinate_changes(drawn[:, 0], values, len(other), coordinates)  # (n, D·(K−1), *other, D, *event)
    samples = torch.cat([drawn, changed], 1)
    samples = samples.reshape((n * size,) + other + variable_shape(distr, len(plates)) + event)
    parent_index = _extension_index(n, upstream, size, samples.device)
    return samples, group, tuple(p for p in plates if p is not carried), parent_index
