"""The log-probabilities of a chain's samples in one call, from its steps' parameters stacked.

A single-sample chain (`storch.plate.ChainPlate`) of ``T`` decisions has one distribution per step,
all of one kind and shape in the usual rollout (``Categorical(logits=policy(h_t))``). The surrogate
needs ``log p_t(x_t)`` of every step; computed step by step that is ``T`` calls of
``Distribution.log_prob``, each a handful of operations and autograd nodes. Where the distributions
are of a kind whose log-probability is elementwise over the batch (`STACKED_PARAMETERS`, also
inside `Independent`), the parameters of the ``T`` steps are concatenated along the step dimension
and the log-probability is computed once, by the distribution class's own ``log_prob`` on a
distribution that holds the stacked parameters: the same arithmetic on the same numbers, with a fixed
number of operations for the whole chain. The values and gradients are those of the steps one by one;
a `Categorical`'s (a gather) to the bit, others up to the last bit that torch's vectorised kernels
may round differently for another number of elements.

`stacked_log_prob` answers ``None`` wherever it does not apply (another kind of distribution, a
parameter not stored as the kind's natural one, a log-probability the model computed itself and the
surrogate reuses, parameters laid out over other plates, shapes that differ between steps), and the
caller computes the steps one by one.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, Independent, Normal

from storch.plate import Plate, PlateLayout
from storch.tensor import StochasticNode, layout_of

__all__ = ["STACKED_PARAMETERS", "stacked_log_prob"]

#: the distributions whose ``log_prob`` reads only these attributes and is elementwise over the batch
#: dimensions: their log-probabilities of many steps are those of the steps' parameters concatenated
STACKED_PARAMETERS: dict[type, tuple[str, ...]] = {
    Categorical: ("logits",),  # the normalised logits that the constructor stores
    Bernoulli: ("logits",),
    Normal: ("loc", "scale"),
}

#: the event dimensions each parameter has beyond the batch dimensions
_PARAMETER_EVENT_DIMS: dict[type, int] = {Categorical: 1, Bernoulli: 0, Normal: 0}


def stacked_log_prob(nodes: Sequence[StochasticNode], plates: PlateLayout) -> torch.Tensor | None:
    """``log p_t(x_t)`` of the chain steps ``nodes`` (oldest first), plain, ``(T, *plate sizes, ...)``.

    Every node must have been drawn as a step of one chain whose other plates are exactly ``plates``
    (in that order). Call with storch's dispatch disabled. ``None`` where the log-probabilities must be
    computed step by step (see the module docstring).
    """
    kind = None
    stacked: dict[str, list[torch.Tensor]] = {}
    samples = []
    sizes = plates.sizes
    reinterpreted = None  # the dimensions `Independent` wrappers sum, the same at every step
    for node in nodes:
        if node.own_log_prob is not None or node.parents != plates.plates:
            return None  # the surrogate reuses the model's own log-probability, or other plates
        distribution, previous = node.drawn_distribution()
        distribution, sums = _unwrapped(distribution)
        if reinterpreted is None:
            reinterpreted = sums
        elif sums != reinterpreted:
            return None
        if kind is None:
            kind = type(distribution)
            names = STACKED_PARAMETERS.get(kind)
            if names is None:
                return None
            stacked = {name: [] for name in names}
        elif type(distribution) is not kind:
            return None
        for name in names:
            value = _stepped_parameter(distribution, name, previous, plates)
            if value is None:
                return None
            stacked[name].append(value)
        samples.append(node.samples)
    first = {name: values[0].shape for name, values in stacked.items()}
    for name, values in stacked.items():
        if any(v.shape != first[name] for v in values):
            return None
    if any(s.shape != samples[0].shape for s in samples) or samples[0].shape[: 1 + len(sizes)] != (1, *sizes):
        return None
    parameters = {name: torch.cat(values, 0) for name, values in stacked.items()}
    log_p = _with_parameters(kind, parameters).log_prob(torch.cat(samples, 0))
    return _sum_rightmost(log_p, reinterpreted)


def _unwrapped(distribution: Distribution) -> tuple[Distribution, tuple[int, ...]]:
    """The distribution inside `Independent` wrappers, and the rightmost dimensions each wrapper sums
    (innermost first)."""
    sums: tuple[int, ...] = ()
    while type(distribution) is Independent:
        sums = (distribution.reinterpreted_batch_ndims,) + sums
        distribution = distribution.base_dist
    return distribution, sums


def _sum_rightmost(value: torch.Tensor, sums: tuple[int, ...]) -> torch.Tensor:
    """The log-probability summed as the `Independent` wrappers sum it, innermost first: each a reshape
    and one sum, so the additions come in the same order and give the same last bits."""
    for n in sums:
        if n:
            value = value.reshape(value.shape[:-n] + (-1,)).sum(-1)
    return value


def _stepped_parameter(
    distribution: Distribution, name: str, previous: Plate | None, plates: PlateLayout
) -> torch.Tensor | None:
    """The parameter ``name`` of one step's distribution with a size-1 step dimension first, then the
    dimensions of ``plates``; ``None`` if it is not stored, or carries other plates or other sizes."""
    value = distribution.__dict__.get(name)
    if not isinstance(value, torch.Tensor):
        return None  # not stored (a lazily computed parameter) or a number
    layout_plates = layout_of(value).plates
    if layout_plates == plates.plates:  # drawn without the previous step (the first step, or a copy)
        value = value.unsqueeze(0)
    elif previous is not None and layout_plates[:1] == (previous,) and layout_plates[1:] == plates.plates:
        pass  # the previous step's size-1 dimension stands where the step's goes
    else:
        return None
    if value.shape[: 1 + len(plates.sizes)] != (1, *plates.sizes):
        return None
    return value


def _with_parameters(kind: type, parameters: dict[str, torch.Tensor]) -> Distribution:
    """A ``kind`` distribution holding ``parameters`` as they are (no constructor: `Categorical`'s would
    normalise the logits again, which changes their last bits), validation off."""
    distribution = kind.__new__(kind)
    distribution.__dict__.update(parameters)
    first = next(iter(parameters.values()))
    event = _PARAMETER_EVENT_DIMS[kind]
    batch = torch.broadcast_shapes(*(p.shape[: p.dim() - event] for p in parameters.values()))
    distribution._batch_shape = batch
    distribution._event_shape = torch.Size()
    distribution._validate_args = False
    if kind is Categorical:
        distribution._num_events = first.shape[-1]
    return distribution
