"""The surrogate term of local expectations, for one node or a chain of nodes on one plate.

Each node of a chain is a *segment* of its plate's groups (`storch.method.local_expectation_term.Segment`);
its term, per group, is
``T_s`` of `storch.method.local_expectation`'s docstring, and the chain's term is
their sum,
spread over the group's points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from storch.extend import (
    AncestralPlate,
    Plate,
    StochasticTensor,
    Tensor,
    layout_of,
    layout_of_plates,
    log_prob_of_own_samples,
    magic_box,
    no_dispatch,
    node_of,
    wrap_new,
)
from storch.method.groups import group_plate, spread_groups, split_groups
from storch.method.local_expectation_plates import LocalExpectationPlate, PointGroup, probs_at_upstream
from storch.method.local_expectation_points import other_values, require_coordinates, value_index, variable_counts

__all__ = ["Segment", "local_expectation_term"]


@dataclass(frozen=True, eq=False)
class Segment:
    """What the term of one node of a chain needs, as plain tensors (shapes with ``P`` the node's
    other plates and ``U`` the upstream points, 1 for the first node): ``log_p`` ``(n, U, *P, D)``, the
    per-variable log-probability of its draws at the upstream points; ``probs`` ``(n, *P, D, K)`` and
    ``index`` ``(n, *P, D)``, its probabilities and the index of each variable's value at point 0."""

    group: PointGroup
    parents: tuple
    log_p: torch.Tensor
    probs: torch.Tensor
    index: torch.Tensor


def _segment(node, group: PointGroup) -> Segment:
    """The `storch.method.local_expectation_term.Segment` of ``node`` (a
    `storch.tensor.StochasticNode`)."""
    distr, samples = node.distribution, node.samples
    parents = tuple(node.layout.plates[1:])
    other = tuple(samples.shape[1: 1 + len(parents)])
    n, d, k, upstream = group.n_groups, group.n_vars, group.k, group.start
    coordinates = require_coordinates(distr, "local_expectation_term")
    own = samples.reshape((n, group.size) + tuple(samples.shape[1:]))[:, :upstream]
    index = value_index(own, coordinates.values(distr), coordinates).reshape((n, upstream) + other + (d,))
    probs = probs_at_upstream(distr, group, coordinates, len(parents)).expand((n, upstream) + other + (d, k))
    if group.drawn_from is None:  # the sample of a first node, or a sibling's one draw per group
        drawn = own.reshape((n * upstream,) + tuple(samples.shape[1:]))
        log_p = log_prob_of_own_samples(distr, drawn).reshape((n, upstream) + other + (d,))
    else:  # at the upstream points: from the probabilities there (no evaluation at the node's own points)
        log_p = probs.gather(-1, index.unsqueeze(-1)).squeeze(-1).log()
    return Segment(group, parents, log_p, probs[:, 0], index[:, 0])


def _segments(tensor: StochasticTensor) -> list[Segment]:
    """The segments of the chain that ends at ``tensor``'s node, first node first."""
    plate = tensor.plate
    with no_dispatch():
        if isinstance(plate, LocalExpectationPlate):
            return [_segment(step.node, step.group) for step in plate.chain()]
        # a plain plate whose points another method laid out (GSB's discrete rule): one node
        node = node_of(tensor)
        n_vars, k = variable_counts(node.distribution, len(node.layout.plates) - 1, "local_expectation_term")
        size = 1 + n_vars * (k - 1)
        return [_segment(node, PointGroup(group_plate(plate, size).size, size, 1, n_vars, k))]


def _later_scores(later: Sequence[Segment], groups: Plate, points: int) -> Optional[Tensor]:
    """``Σ_t log p_t(z_t[m])`` over the chain's later nodes at the first ``points`` points of each
    group, as a storch tensor whose last dimension is the point."""
    total = None
    for segment in later:
        with no_dispatch():
            score = segment.log_p[:, :points].sum(-1).movedim(1, -1)  # (n, *P, points)
        score = wrap_new(score, layout_of_plates((groups,) + segment.parents))
        total = score if total is None else total + score
    return total


def _segment_term(segment: Segment, per_group: Tensor, groups: Plate, later: Sequence[Segment]) -> Tensor:
    """``T_s`` of the module docstring, one value per group (and per value of other plates)."""
    group = segment.group
    layout = layout_of_plates((groups,) + segment.parents)
    with no_dispatch():
        own = segment.log_p[:, 0]  # (n, *P, D) at the sample
        others = own.sum(-1, keepdim=True) - own  # Σ_{d' ≠ d} log p_{d'}(x_{d'})
        box = magic_box(0.5 * others).unsqueeze(-1)  # (n, *P, D, 1)
        index = segment.index
        probs = segment.probs
        q = probs.gather(-1, other_values(index, group.k))  # (n, *P, D, K−1): the other values' probabilities
    q, box = wrap_new(q, layout), wrap_new(box, layout)
    end = group.start + group.n_vars * (group.k - 1)
    costs = per_group[..., :end]
    scores = _later_scores(later, groups, end)
    if scores is not None:
        costs = costs * magic_box(scores)
    changed = torch.unflatten(costs[..., group.start:], -1, (group.n_vars, group.k - 1))
    return ((q - q.detach()) * box * (changed - costs[..., :1].unsqueeze(-1))).sum(-1).sum(-1)


def local_expectation_term(tensor: StochasticTensor, cost: torch.Tensor) -> Tensor:
    """The surrogate term, per point, of a node sampled with
    `storch.method.local_expectation_points`, or of
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
    _check_cost_plates(tensor, cost, segments[-1])
    segments = [segment for segment in segments if _carries_plates_of(cost, segment)]
    groups = group_plate(plate, size)
    per_group = split_groups(cost, plate, size)  # (groups, *rest), the group's points as the last dimension
    total = None
    for s, segment in enumerate(segments):
        term = _segment_term(segment, per_group, groups, segments[s + 1:])
        total = term if total is None else total + term
    return spread_groups(total, cost, plate, size)  # type: ignore[arg-type]


def _carries_plates_of(cost: torch.Tensor, segment: Segment) -> bool:
    """Whether ``cost`` carries every plate of the segment's node besides the chain's.

    storch reads which nodes a cost depends on from its plates: a cost without a plate of an earlier
    node of the chain (a ``joint_with`` sibling's own cost, without the data plate of the node it
    joined) does not depend on that node, and neither on the later nodes drawn from it, so their terms
    and scores are left out of its surrogate (they would be zero: the sibling is drawn once per group).
    """
    plates = layout_of(cost).plates
    return all(p in plates or any(isinstance(u, AncestralPlate) and u.descends_from(p) for u in plates)
               for p in segment.parents)  # a plate carried through a newer step of its single-sample chain


def _check_cost_plates(tensor: StochasticTensor, cost: torch.Tensor, newest: Segment) -> None:
    """Refuse a cost computed from the node's samples with one of their plates reduced: each value of
    those plates needs its own local expectation."""
    if not _carries_plates_of(cost, newest):
        plates = layout_of(cost).plates
        missing = [p.name for p in newest.parents if p not in plates]
        name = getattr(cost, "name", "cost")
        raise ValueError(
            f"{type(node_of(tensor).method).__name__}({tensor.name!r}): the cost {name!r} carries the node's plate "
            f"but not the plates {missing} of its samples; it was reduced over them before storch.add_cost. "
            "Register the cost per value of those plates (storch.add_cost reduces them itself)."
        )
