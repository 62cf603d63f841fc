"""torch's argument validation of a plated value, as storch lines it up.

``Distribution.log_prob`` (and ``cdf``, ``icdf``) first checks its value with
``Distribution._validate_sample``, which compares the raw shapes of the value and of the
distribution's batch from the right, before any operation that storch could align by plates. A
value whose plates differ from the distribution's (the samples of an earlier step of a
local-expectation chain scored by a distribution computed from a newer step, whose plate has more
points; the samples of a node the distribution does not descend from) then fails although each
sample lines up. `storch.tensor.Tensor.size` recognises that caller and answers with
the shape the value has once aligned: the distribution's plates, then the broadcast of one sample
of the value with one batch element of the distribution. Nothing else is relaxed: the event shape
and the per-sample broadcast are checked as torch checks them, and the support check runs on the
value itself.

Values on the plate of a node whose estimator relaxes its samples (Gumbel-softmax, REBAR's relaxed
points) lie between the values of a discrete support; they are refused here with a message that
names the node, the estimator and the fix, instead of torch's dump of the whole tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributions import Distribution

from storch._dispatch import no_dispatch
from storch.exceptions import RelaxedSampleError
from storch.util import distribution_layout

__all__ = ["size_to_validate"]

_T = torch.Tensor
_call_plain = torch._C._disabled_torch_function_impl
#: the code object of torch's check of a value, which ``Tensor.size`` recognises as its caller
VALIDATE_SAMPLE = Distribution._validate_sample.__code__


def _per_sample_fits(value: tuple[int, ...], batch: tuple[int, ...], event: tuple[int, ...]) -> bool:
    """torch's two checks on one sample: the rightmost sizes equal the event shape, and the rest
    broadcasts with the batch."""
    if event and value[len(value) - len(event):] != event:
        return False
    for i, j in zip(reversed(value), reversed(batch + event)):
        if i != j and i != 1 and j != 1:
            return False
    return True


def size_to_validate(value: torch.Tensor, d: Any) -> torch.Size:
    """The size ``Distribution._validate_sample`` of ``d`` should see for the plated ``value``: its
    shape once aligned with ``d``'s plates, or its raw shape where one sample does not fit ``d``'s
    (torch then refuses it with its own message)."""
    raw = _call_plain(_T.size, (), (value,))
    if not isinstance(d, Distribution):
        return raw
    refuse_relaxed(value, d)
    batch, event = tuple(d._batch_shape), tuple(d._event_shape)
    if _per_sample_fits(raw, batch, event):
        return raw  # torch's own check passes on the raw shape (the common case): nothing to align
    n_plates = len(distribution_layout(d).sizes)
    one = tuple(raw[len(value._layout.sizes):])
    if len(batch) < n_plates or not _per_sample_fits(one, batch[n_plates:], event):
        return raw
    return torch.Size(batch[:n_plates] + tuple(torch.broadcast_shapes(one, batch[n_plates:] + event)))


def _relaxing_nodes(value: torch.Tensor) -> list[Any]:
    return [p.node for p in value._layout.plates
            if p.node is not None and getattr(p.node.method, "relaxes_samples", False)]


def refuse_relaxed(value: torch.Tensor, d: Distribution) -> None:
    """Raise `storch.exceptions.RelaxedSampleError` if ``value`` is on the plate
    of a node whose estimator relaxes its samples and lies outside ``d``'s discrete support."""
    for p in value._layout.plates:  # the common case, no node that relaxes: no list made
        if p.node is not None and getattr(p.node.method, "relaxes_samples", False):
            break
    else:
        return
    nodes = _relaxing_nodes(value)
    try:
        support = d.support
    except NotImplementedError:
        return
    if not getattr(support, "is_discrete", False):
        return
    with no_dispatch():
        if bool(support.check(value).all()):
            return
    node = nodes[0]
    method = f"{type(node.method).__name__}({node.name!r})"
    raise RelaxedSampleError(
        f"{type(d).__name__}.log_prob got values on the plate of node {node.name!r}, whose estimator {method} "
        f"relaxes its samples: they lie between the values of the support {support!r}, where log_prob is not "
        f"defined.\nScore the node's samples with {node.name}.log_prob(), the continuous extension of log p "
        "that the relaxation's papers use, or build this distribution with validate_args=False (torch's "
        "formula at the relaxed values: that extension for a Bernoulli, the argmax for a OneHotCategorical)."
    )
