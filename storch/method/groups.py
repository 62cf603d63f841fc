"""Evaluation groups: estimators that evaluate the cost at several points per sample.

ARM, DisARM, measure-valued derivatives, local expectations and REBAR need the cost at more points
than the samples themselves (antithetic pairs, the positive and negative parts of a measure, every
value of one variable with the others fixed, relaxed inputs). Such a method draws ``n`` *groups* of
``M`` evaluation points and lays them out along its own plate, group-major: point ``m`` of group
``j`` sits at position ``j·M + m`` of a plate of size ``n·M``. The user's model evaluates the cost at
every point in one vectorised pass, exactly as for ordinary samples.

The plate weight of each point says how it counts in the estimate of the expected cost. The weights
of a group sum to ``1/n`` (e.g. ``1/n`` on the one sample drawn from ``p`` and ``0`` on the extra
points, or ``1/(2n)`` on each of two antithetic samples), so that reducing the plate gives an
unbiased estimate of the expectation.

Inside `estimator` the method views the cost per group with
`split_groups` (the plate of ``n·M`` becomes a plate of ``n`` groups, and ``M`` the first event
dimension), computes one term per group with ordinary storch arithmetic, and hands it back per point
with `spread_groups`. A term spread over a group counts once per group, since the group's
weights sum to ``1/n``.

Examples:
    >>> import torch, storch
    >>> from storch.plate import Plate, layout_of_plates
    >>> plate = Plate("z", 6)                             # n = 3 groups of M = 2 points
    >>> cost = storch.Tensor(torch.arange(6.0), [plate])
    >>> per_group = split_groups(cost, plate, 2)
    >>> per_group.plates[0].size, tuple(per_group.shape)
    (3, (3, 2))
    >>> difference = per_group[..., 1] - per_group[..., 0]
    >>> spread_groups(difference, cost, plate, 2).plain().tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from storch.extend import (
    Plate,
    StochasticTensor,
    Tensor,
    align_to,
    is_tracing,
    layout_of,
    layout_of_plates,
    merge_layouts,
    no_dispatch,
    node_of,
    wrap,
    wrap_new,
)

__all__ = ["group_weights", "flatten_groups", "split_groups", "spread_groups", "group_plate", "GroupRecords"]


def group_weights(n_groups: int, point_weights: torch.Tensor | list[float]) -> torch.Tensor:
    """Plate weights for ``n_groups`` groups whose points weigh ``point_weights`` (summing to 1).

    The vector is made once per ``(n_groups, point weights, default dtype)`` and shared by every
    later call (a method asks for the same weights at every step): callers must not write into it.

    Examples:
        >>> group_weights(2, [1.0, 0.0, 0.0]).tolist()
        [0.5, 0.0, 0.0, 0.5, 0.0, 0.0]
    """
    values = point_weights.tolist() if isinstance(point_weights, torch.Tensor) else list(point_weights)
    # checked on the Python numbers: no host read of a tensor (a traced step, storch.compile_step)
    if not all(isinstance(v, (int, float)) for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ValueError(f"group_weights: point weights must be a vector summing to 1, got {values}.")
    dtype = torch.get_default_dtype()
    if is_tracing():  # storch.compile_step's trace records the vector it makes as a constant of its own
        return (torch.tensor(values, dtype=dtype) / n_groups).repeat(n_groups)
    key = (n_groups, tuple(values), dtype)
    w = _GROUP_WEIGHTS.get(key)
    if w is None:
        with torch.inference_mode(False):  # made in inference mode it could not be saved for a backward later
            w = (torch.tensor(values, dtype=dtype) / n_groups).repeat(n_groups)
        if len(_GROUP_WEIGHTS) >= _MAX_GROUP_WEIGHTS:
            _GROUP_WEIGHTS.clear()
        _GROUP_WEIGHTS[key] = w
    return w


# the weight vectors group_weights made, by (n_groups, point weights, dtype): small, bounded
_GROUP_WEIGHTS: dict[tuple, torch.Tensor] = {}
_MAX_GROUP_WEIGHTS = 256


def flatten_groups(points: torch.Tensor) -> torch.Tensor:
    """``(n, M, *rest)`` evaluation points to the plate layout ``(n·M, *rest)``."""
    return points.reshape((points.shape[0] * points.shape[1],) + tuple(points.shape[2:]))


def group_plate(plate: Plate, group_size: int) -> Plate:
    """The independent plate of the ``plate.size // group_size`` groups of ``plate``."""
    if plate.size % group_size:
        raise ValueError(
            f"Plate {plate.name!r} of size {plate.size} does not hold whole groups of {group_size} points."
        )
    return Plate(plate.name, plate.size // group_size)


def _plate_first(t: Tensor, plate: Plate) -> tuple[torch.Tensor, int]:
    layout = layout_of(t)
    i = layout.index(plate)
    with no_dispatch():
        x = t.view_as(t)
        if i:
            x = x.movedim(i, 0)
    return x, i


def split_groups(t: torch.Tensor, plate: Plate, group_size: int) -> Tensor:
    """View ``t`` per group: the plate of ``n·M`` points becomes a plate of ``n`` groups and ``M``
    the first event dimension (after all plates). Other plates are kept."""
    layout = layout_of(t)
    if plate not in layout.plates:
        raise ValueError(f"split_groups: the tensor has no plate {plate.name!r}; its plates are {list(layout.names)}.")
    groups = group_plate(plate, group_size)
    x, _ = _plate_first(t, plate)  # type: ignore[arg-type]
    rest = [p for p in layout.plates if p is not plate]
    with no_dispatch():
        x = x.reshape((groups.size, group_size) + tuple(x.shape[1:]))
        x = x.movedim(1, len(rest) + 1)
    return wrap_new(x, layout_of_plates([groups] + rest))


def spread_groups(term: torch.Tensor, like: Tensor, plate: Plate, group_size: int) -> Tensor:
    """Give each point of a group its group's value of ``term``, laid out like ``like``.

    ``term`` holds one value per group (a storch tensor with the group plate of
    `split_groups`, or without it for a term shared by all groups) and per value of
    ``like``'s other plates; it may lack some of them, and must have no event dimensions.
    """
    groups = group_plate(plate, group_size)
    like_layout = layout_of(like)
    rest = [p for p in like_layout.plates if p is not plate]
    target = layout_of_plates([groups] + rest)
    term_layout = layout_of(term)
    if term.dim() != len(term_layout.sizes):
        raise ValueError(
            f"spread_groups: the per-group term must have no event dimensions, got shape {tuple(term.shape)} "
            f"with plates {list(term_layout.names)}; sum them first."
        )
    union = merge_layouts([term_layout, target])
    if len(union.plates) != len(target.plates):
        extra = [p.name for p in union.plates if p not in target.plates]
        raise ValueError(f"spread_groups: the term carries plates {extra} that the cost does not have.")
    with no_dispatch():
        x = align_to(term, target, expand=True) if isinstance(term, Tensor) else term.expand(target.sizes)
        x = x.unsqueeze(1).expand((groups.size, group_size) + tuple(x.shape[1:]))
        x = x.reshape((groups.size * group_size,) + tuple(x.shape[2:]))
        i = like_layout.index(plate)
        if i:
            x = x.movedim(0, i)
    return wrap(x, like_layout)


def _forget(records: dict[int, tuple[weakref.ref, Any]], key: int, ref: weakref.ref) -> None:
    """Drop the record of samples that were freed (unless the key was taken by newer samples)."""
    entry = records.get(key)
    if entry is not None and entry[0] is ref:
        del records[key]


class GroupRecords:
    """What a method decided when it drew a node's evaluation groups, kept for its estimator.

    A method that lays out evaluation groups often needs more than the points themselves to build
    its estimate: the layout of a group (MVD), the sign vectors (SPSA), the uniforms (ARM). It
    decides them in ``proposal_dist``, which returns the plain samples, and reads them back in the
    weighting function or ``estimator``, which see the node's `storch.tensor.StochasticTensor`.
    The record is keyed by the samples tensor (weakly, by identity: it lives as long as the node)
    and found again through ``node_of(tensor).samples``.

    Args:
        method: the method's name for errors, e.g. ``"MVD"``.
        what: what is recorded, for errors, e.g. ``"evaluation layout"``.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> records = GroupRecords("MyMethod", "evaluation layout")
        >>> x = storch.method.ScoreFunction("x", n_samples=2)(Normal(torch.zeros(()), 1.0))
        >>> records.of(x)
        Traceback (most recent call last):
        ...
        RuntimeError: MyMethod('x'): no evaluation layout recorded for these samples; MyMethod nodes must be sampled by the MyMethod method itself.
        >>> records.keep(node_of(x).samples, "2 groups of 1 point")
        >>> records.of(x)
        '2 groups of 1 point'
    """

    def __init__(self, method: str, what: str) -> None:
        self.method, self.what = method, what
        self._records: dict[int, tuple[weakref.ref, Any]] = {}  # id(samples) -> (weak samples, record)

    def __getstate__(self) -> dict:
        # records belong to the nodes of the current forward pass; a copy (deepcopy, pickle) starts empty
        return {"method": self.method, "what": self.what}

    def __setstate__(self, state: dict) -> None:
        self.method, self.what = state["method"], state["what"]
        self._records = {}

    def keep(self, samples: torch.Tensor, record: Any) -> None:
        """Remember ``record`` for the node whose proposal returned ``samples`` (until they are freed)."""
        forget = functools.partial(_forget, self._records, id(samples))
        self._records[id(samples)] = (weakref.ref(samples, forget), record)

    def of(self, tensor: StochasticTensor) -> Any:
        """The record kept for the node of ``tensor``; an error if its samples were drawn elsewhere."""
        samples = node_of(tensor).samples
        entry = self._records.get(id(samples))
        record = entry[1] if entry is not None and entry[0]() is samples else None
        if record is None:
            raise RuntimeError(
                f"{self.method}({tensor.name!r}): no {self.what} recorded for these samples; {self.method} nodes "
                f"must be sampled by the {self.method} method itself."
            )
        return record
