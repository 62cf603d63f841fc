"""VIMCO: score-function gradients of multi-sample bounds, with leave-one-out baselines.

Mnih & Rezende 2016, "Variational inference for Monte Carlo objectives". For ``K`` samples
``z_k ~ q`` and the multi-sample (IWAE) bound ``L = log (1/K) Σ_k w_k``, ``w_k = p(x, z_k)/q(z_k | x)``,

    ∇ E[L] = E[ Σ_k (L − L_{−k}) ∇ log q(z_k) + Σ_k (w_k / Σ_j w_j) ∇ log w_k ]

with ``L_{−k} = log (1/K)(Σ_{j≠k} w_j + ŵ_{−k})`` and ``ŵ_{−k} = exp(mean_{j≠k} log w_j)``: each
sample's learning signal is the bound minus the bound with that sample replaced by the geometric
mean of the others. ``L_{−k}`` does not depend on ``z_k``, so the baseline adds no bias.

How it fits the surrogate. ``L`` is a function of all ``K`` samples jointly, not a mean of per-sample
costs, so `storch.method.vimco.iwae_bound` registers the cost ``−L`` *repeated on every sample* of the
node's plate
(its plate mean is ``−L``, and the node stays on the cost's path). `storch.method.vimco.VIMCO` then
differentiates
the joint sample: its gradient function is the joint log-probability ``Σ_k log q(z_k)`` (the same
for every sample), so that ``Σ_k (1/K) □(Σ_j log q(z_j)) S_k`` is the DiCE surrogate of the
``K``-tuple, and its control-variate term is ``K (1 − □(log q(z_k))) · (−L_{−k})`` per sample. The
first derivative is the VIMCO estimator above; every order is unbiased (DiCE of the joint sample
plus a zero-mean term, since ``L_{−k}`` is detached and free of ``z_k``). No core change is needed.

Plain IWAE with reparameterization: sample the node with a reparameterized method
(`storch.method.Reparameterization`) and call the same
`storch.method.vimco.iwae_bound`; the gradient is
then pathwise through ``L``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from storch.inference import add_cost
from storch.method.method import JointBoundRecords, Method, log_prob
from storch.extend import (
    CostTensor,
    Plate,
    StochasticTensor,
    Tensor,
    layout_of,
    magic_box,
    no_dispatch,
    wrap_new,
)
from storch.reductions import reduce_plates
from storch.reductions import sum as plate_sum
from storch.sampling.method import check_count

__all__ = ["VIMCO", "iwae_bound", "leave_one_out_bounds"]


def leave_one_out_bounds(log_w: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``L_{−k} = log (1/K)(Σ_{j≠k} w_j + exp(mean_{j≠k} log w_j))`` for every ``k`` along ``dim``.

    Plain tensors; ``K ≥ 2``.

    Examples:
        >>> import torch
        >>> log_w = torch.log(torch.tensor([1.0, 4.0, 16.0]))
        >>> leave_one_out_bounds(log_w).exp()     # k = 0: (8 + 4 + 16)/3; k = 2: (1 + 4 + 2)/3
        tensor([9.3333, 7.0000, 2.3333])
    """
    k = log_w.shape[dim]
    if k < 2:
        raise ValueError(f"leave_one_out_bounds needs at least 2 samples along dim {dim}, got {k}.")
    x = log_w.movedim(dim, 0)
    others_mean = (x.sum(0, keepdim=True) - x) / (k - 1)  # mean_{j≠k} log w_j, per k
    replaced = x.unsqueeze(0).expand((k,) + tuple(x.shape))  # [k, j]: log w_j
    eye = torch.eye(k, dtype=torch.bool, device=x.device).reshape((k, k) + (1,) * (x.dim() - 1))
    replaced = torch.where(eye, others_mean.unsqueeze(1), replaced)  # [k, k] ← mean_{j≠k} log w_j
    return (torch.logsumexp(replaced, 1) - math.log(k)).movedim(0, dim)


@dataclass
class _Bound:
    plate: Plate
    baseline: Tensor  # −L_{−k}, detached, in the units of the registered cost −L


class VIMCO(JointBoundRecords, Method):
    """Score-function estimator of multi-sample bounds with VIMCO's leave-one-out baselines.

    Use it with `storch.method.vimco.iwae_bound`, which registers the bound as a cost and gives this
    method the
    per-sample log-weights. Unbiased for derivatives of every order; ``K`` cost evaluations (one per
    sample, the bound computed once from them). Other costs downstream of the node are handled as by
    the score function with a leave-one-out baseline, per sample.

    Args:
        plate_name: node / plate name.
        n_samples: ``K ≥ 2``, the samples inside the bound.
        baseline: use the leave-one-out baselines (``False``: the plain score function of the joint
            sample, for comparison).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli, Normal
        >>> phi = torch.zeros(2, requires_grad=True)                      # q(z) encoder logits
        >>> z = VIMCO("z", n_samples=4)(Bernoulli(logits=phi))
        >>> log_w = (Bernoulli(logits=torch.zeros(2)).log_prob(z).sum(-1)
        ...          + Normal(z.sum(-1), 1.0).log_prob(torch.tensor(1.5))
        ...          - Bernoulli(logits=phi).log_prob(z).sum(-1))
        >>> bound = iwae_bound(log_w, z)                 # registers −bound as the cost "iwae_bound"
        >>> estimate = storch.backward()                 # = −bound
        >>> bool(torch.isclose(estimate, -bound)), phi.grad.shape
        (True, torch.Size([2]))
    """

    def __init__(self, plate_name: str, n_samples: int = 2, baseline: bool = True) -> None:
        n_samples = check_count(n_samples, "n_samples", f"VIMCO({plate_name!r})")
        if baseline and n_samples < 2:
            raise ValueError(
                f"VIMCO({plate_name!r}): the leave-one-out baselines need n_samples >= 2, got {n_samples}."
            )
        super().__init__(plate_name, None, n_samples)
        self.baseline = bool(baseline)
        self._bounds: dict[str, _Bound] = {}

    def on_joint_bound(self, cost_name: str, plate: Plate, log_w: Tensor, later: Sequence[Plate] = ()) -> None:
        self.register_bound(cost_name, plate, log_w, later)

    def register_bound(self, cost_name: str, plate: Plate, log_w: Tensor, later: Sequence[Plate] = ()) -> None:
        """Remember the leave-one-out baselines of the bound registered as cost ``cost_name``.

        Called by `storch.method.vimco.iwae_bound`. ``later`` are the plates of reparameterized nodes
        sampled after
        this one: the cost reaches this node with them reduced, so the baselines are reduced too.
        """
        layout = layout_of(log_w)
        with no_dispatch():
            baseline = -leave_one_out_bounds(log_w.detach().view_as(log_w), layout.index(plate))
        baseline_t = wrap_new(baseline, layout)
        if later:
            baseline_t = reduce_plates(baseline_t, list(later))
        self._bounds[cost_name] = _Bound(plate, baseline_t)

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        log_q = log_prob(tensor)
        bound = self._bounds.get(cost.name)
        if bound is None or bound.plate is not tensor.plate:
            # a per-sample cost: the score function with a leave-one-out (batch average) baseline
            if tensor.n < 2:
                return log_q, None
            detached = cost.detach()
            others = (plate_sum(detached, tensor.plate) - detached) / (tensor.n - 1)
            return log_q, (1.0 - magic_box(log_q)) * others
        joint = plate_sum(log_q, tensor.plate)  # log q of the K-tuple
        if not self.baseline:
            return joint, None
        return joint, tensor.n * (1.0 - magic_box(log_q)) * bound.baseline


    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, baseline={self.baseline}"


def _plate_of(log_w: torch.Tensor, z: Union[StochasticTensor, Plate, str]) -> Plate:
    layout = layout_of(log_w)
    if isinstance(z, StochasticTensor):
        plate = z.plate
        if not any(p is plate for p in layout.plates):
            raise ValueError(
                f"iwae_bound: log_w has plates {list(layout.names)} but not the plate {plate.name!r} of "
                "the node it should average over; compute log_w from that node's samples."
            )
        return plate
    plate = layout.plates[layout.index(z)]
    if plate.node is None:
        raise ValueError(
            f"iwae_bound: plate {plate.name!r} is an independent plate, not the samples of a stochastic node."
        )
    return plate


def iwae_bound(
    log_w: torch.Tensor, z: Union[StochasticTensor, Plate, str], name: str = "iwae_bound"
) -> Tensor:
    """The multi-sample bound ``L = log (1/K) Σ_k w_k`` over ``z``'s samples, registered as a cost.

    Registers the cost ``−L`` (to minimise) under ``name``, repeated on each of the ``K`` samples so
    that the node stays on its path, and, for a `storch.method.vimco.VIMCO` node, hands the node the
    leave-one-out baselines. With a reparameterized node (``Reparameterization``, or ``Infer`` on a
    distribution with ``rsample``) this is the IWAE bound with pathwise gradients.

    Args:
        log_w: per-sample log-weights ``log p(x, z_k) − log q(z_k | x)``, a storch tensor with
            ``z``'s plate (and e.g. a minibatch plate), one value per plate combination.
        z: the node (its `storch.StochasticTensor`), its plate or its plate name.
        name: the name of the registered cost.

    Returns:
        ``L`` with ``z``'s plate reduced (other plates kept), e.g. for logging.

    Raises:
        ValueError: if ``log_w`` lacks the plate or has event dimensions, or if the node (or a node
            sampled after it on which ``log_w`` depends) uses a per-sample score-function estimator,
            which would credit each sample with only ``1/K`` of the joint bound's score.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> mu = torch.tensor(0.5, requires_grad=True)
        >>> z = storch.method.Reparameterization("z", n_samples=3)(Normal(mu, 1.0))
        >>> log_w = Normal(0.0, 1.0).log_prob(z) + Normal(z, 1.0).log_prob(torch.tensor(2.0)) - Normal(mu, 1.0).log_prob(z)
        >>> bound = iwae_bound(log_w, z)
        >>> bool(torch.isclose(storch.backward(), -bound)), mu.grad is not None
        (True, True)
    """
    layout = layout_of(log_w)
    if not layout.plates:
        raise ValueError("iwae_bound: log_w must be a storch tensor with the plate of the samples to average over.")
    if log_w.dim() != len(layout.sizes):
        raise ValueError(
            f"iwae_bound: log_w has shape {tuple(log_w.shape)} with plates {list(layout.names)}: one "
            "log-weight per plate combination is needed; sum the event dimensions first (e.g. "
            "log_prob(...).sum(-1))."
        )
    plate = _plate_of(log_w, z)
    method = plate.node.method  # type: ignore[union-attr]
    newer = [p for p in layout.plates if p.order > plate.order and p.node is not None]
    for p in newer:
        if not p.node.method.reparameterized:  # type: ignore[union-attr]
            raise ValueError(
                f"iwae_bound over {plate.name!r}: log_w depends on node {p.name!r}, sampled after it with "
                f"{type(p.node.method).__name__}; a per-sample estimator there would be biased for the "  # type: ignore[union-attr]
                "joint bound. Reparameterize it, or sample it inside the bound's node."
            )
    if not (method.handles_joint_bound or method.reparameterized):
        raise ValueError(
            f"iwae_bound: node {plate.name!r} is sampled with {type(method).__name__}, which credits each "
            f"sample with its own cost; the bound is a joint function of all {plate.size} samples. Use "
            f"VIMCO({plate.name!r}, n_samples={plate.size}) or a reparameterized method."
        )
    k = plate.size
    i = layout.index(plate)
    with no_dispatch():
        values = log_w.view_as(log_w)
        kept = torch.logsumexp(values, i, keepdim=True) - math.log(k)
        bound = kept.squeeze(i)
        cost = (-kept).expand_as(values)
    bound_t = wrap_new(bound, layout.without([plate]))
    method.on_joint_bound(name, plate, log_w, newer)
    add_cost(wrap_new(cost, layout), name)
    return bound_t
