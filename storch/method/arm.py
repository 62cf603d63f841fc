"""ARM and DisARM: antithetic estimators for Bernoulli logits.

ARM (Yin & Zhou 2019, "ARM: Augment-REINFORCE-Merge Gradient for Stochastic Binary Networks"). For
logits ``φ`` and one uniform vector ``u ~ U(0, 1)``:

    g_φ = [f(b̃) − f(b)] ⊙ (u − ½),    b = 1[u < σ(φ)],  b̃ = 1[u > σ(−φ)] = 1[1 − u < σ(φ)]

DisARM (Dong, Mnih & Tucker 2020, "DisARM: An Antithetic Gradient Estimator for Binary Latent
Variables") integrates ``u`` out given the pair (a Rao-Blackwellisation of ARM, never of higher variance):

    g_φᵢ = ½ (f(b) − f(b̃)) (−1)^{b̃ᵢ} 1[bᵢ ≠ b̃ᵢ] σ(|φᵢ|)

Both ``b`` and ``b̃`` are samples of ``Bernoulli(σ(φ))`` (antithetic: they share ``u``). Each ``u``
gives an evaluation group (`storch.method.groups`) of the two points ``[b, b̃]``, each with
weight ``1/(2n)``, so the forward value averages the cost over both. No gradient function; the
control-variate term ``(φ − stopgrad φ) · stopgrad(g_φ)`` (summed over the coordinates) is zero in
the forward pass and has gradient ``g_φ``. Gradients reaching the cost by other paths flow through
both points with their weights.

Parameterisation: the estimate is of ``∂ E f / ∂φ`` for the logits ``φ``. A Bernoulli built from
``probs`` is accepted: ``φ = logit(probs)`` is computed differentiably (``torch``'s
``probs_to_logits``), so the gradient reaches ``probs`` by the chain rule, ``g_φ / (p (1 − p))``
(unbiased as well; probabilities within float epsilon of 0 or 1 are clamped there).

Unbiased for first-order derivatives only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from typing import Callable, Optional

import torch
from torch.distributions import Bernoulli, Distribution
from torch.distributions.utils import probs_to_logits

from storch.method.antithetic import (
    aligned_logits, check_bernoulli, check_logit_plates, control_variate_term, cost_target, on_every_point,
    points_first,
)
from storch.method.groups import GroupRecords, flatten_groups, group_plate, group_weights
from storch.method.method import Method
from storch.extend import (
    CostTensor, StochasticTensor, align_to, layout_of, layout_of_plates, no_dispatch, node_of, wrap, wrap_new,
)

__all__ = ["ARM", "DisARM", "bernoulli_logits"]

#: lays out plain per-group values ``(n, *parameter plates, *C)`` like the estimator's other inputs
PerGroup = Callable[[torch.Tensor], torch.Tensor]


def _as_laid_out(values: torch.Tensor) -> torch.Tensor:
    """Per-group values that are laid out for the cost already (`_AntitheticBernoulli._laid_out_term`)."""
    return values


def bernoulli_logits(d: Bernoulli) -> torch.Tensor:
    """The logits of ``d``: as given, or ``logit(probs)`` computed from the given ``probs``.

    The lazily cached attribute ``d.logits`` is not used: torch caches it on first use, possibly
    while storch dispatch is disabled, without the plates of the parameters.

    Examples:
        >>> import torch
        >>> bernoulli_logits(Bernoulli(probs=torch.tensor([0.5, 0.75]))).tolist()
        [0.0, 1.0986123085021973]
    """
    given = d.__dict__.get("_param")
    if given is not None and given is d.__dict__.get("logits"):
        return given
    return probs_to_logits(d.probs, is_binary=True)


class _AntitheticBernoulli(Method, ABC):
    """Shared sampling of ARM and DisARM: per uniform vector ``u``, the group ``[b, b̃]``."""

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name, None, n_samples)

    def check_distribution(self, distr: Distribution) -> None:
        check_bernoulli(f"{type(self).__name__}({self.plate_name!r})", distr)

    def _record(self, samples: torch.Tensor, u: torch.Tensor) -> None:
        """Keep what the estimator needs besides the samples (nothing by default)."""

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        phi = bernoulli_logits(distr).detach()  # type: ignore[arg-type]
        u = torch.rand((amt_samples,) + tuple(phi.shape), dtype=phi.dtype, device=phi.device)
        b = (u < torch.sigmoid(phi)).to(phi.dtype)
        b_tilde = (u > torch.sigmoid(-phi)).to(phi.dtype)
        samples = flatten_groups(torch.stack([b, b_tilde], 1))
        self._record(samples, u)
        return samples

    def weighting_function(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        return group_weights(amt_samples // 2, [0.5, 0.5])

    @abstractmethod
    def _gradient(
        self,
        tensor: StochasticTensor,
        f_b: torch.Tensor,
        f_b_tilde: torch.Tensor,
        phi: torch.Tensor,
        per_group: PerGroup,
    ) -> torch.Tensor:
        """The per-variable gradient estimate ``g_φ`` (ARM, DisARM), on plain values laid out alike:
        ``f_b``, ``f_b_tilde`` the costs at ``b`` and ``b̃``, ``phi`` the detached logits, and
        ``per_group(values)`` lays out plain ``(n, *parameter plates, *C)`` values (one per group,
        as recorded at sampling) the same way."""

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(φ − stopgrad φ) · stopgrad(g_φ)``, summed over the coordinates, for each point of a group.

        Computed on plain values: everything is laid out for the cost's plates with the node's plate
        replaced by its ``n`` groups (``[groups, *other plates of the cost, *C]``); the term is then
        given to both points of each group. When the logits and the node carry exactly the cost's
        other plates, in its order (a model with one node per step and its data plates), the plain
        values are laid out already and no alignment is made.
        """
        plate, cost_layout = tensor.plate, layout_of(cost)
        phi = bernoulli_logits(tensor.distribution)  # type: ignore[arg-type]
        rest = tuple(p for p in cost_layout.plates if p is not plate)
        if layout_of(phi).plates == rest and node_of(tensor).layout.plates[1:] == rest and not plate.size % 2:
            return None, self._laid_out_term(tensor, cost, phi)
        return None, self._aligned_term(tensor, cost, phi)

    def _laid_out_term(self, tensor: StochasticTensor, cost: CostTensor, phi: torch.Tensor) -> torch.Tensor:
        """The term when the plain logits, recorded values and cost (node's plate first) line up as they are."""
        plate, cost_layout = tensor.plate, layout_of(cost)
        i = cost_layout.position(plate)
        with no_dispatch():
            n_event = phi.dim() - len(cost_layout.sizes) + 1
            c = points_first(cost, i)
            c = c.reshape((plate.size // 2, 2) + tuple(c.shape[1:]) + (1,) * n_event)
            detached = phi.detach()
            f_b, f_b_tilde = c.unbind(1)
            g = self._gradient(tensor, f_b, f_b_tilde, detached, _as_laid_out)
            term = on_every_point(control_variate_term(phi, g, n_event, detached), None, plate, 2, i)
        return wrap_new(term, cost_layout)

    def _aligned_term(self, tensor: StochasticTensor, cost: CostTensor, phi: torch.Tensor) -> torch.Tensor:
        """The term in general: logits and recorded values aligned for the cost's plates."""
        plate, cost_layout = tensor.plate, layout_of(cost)
        node_plates = node_of(tensor).layout.plates[1:]  # the parameters' plates
        groups = group_plate(plate, 2)
        target = cost_target(groups, plate, cost)
        phi_layout = check_logit_plates(f"{type(self).__name__}({self.plate_name!r})", phi, cost, target)
        i = cost_layout.position(plate)
        with no_dispatch():
            phi, n_event = aligned_logits(phi, phi_layout, target)
            c = points_first(cost, i)
            c = c.reshape((groups.size, 2) + tuple(c.shape[1:]) + (1,) * n_event)
            node_layout = layout_of_plates((groups,) + node_plates)

            def per_group(values: torch.Tensor) -> torch.Tensor:
                return align_to(wrap(values, node_layout), target)

            g = self._gradient(tensor, c[:, 0], c[:, 1], phi.detach(), per_group)
            term = on_every_point(control_variate_term(phi, g, n_event), target, plate, 2, i)
        return wrap_new(term, cost_layout)

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}"


class ARM(_AntitheticBernoulli):
    """Augment-REINFORCE-Merge for ``Bernoulli`` nodes: ``g_φ = [f(b̃) − f(b)](u − ½)``.

    The plate holds ``2 · n_samples`` points, the antithetic pair ``[b, b̃]`` of each uniform draw
    ``u`` (2 cost evaluations per ``u``, each weighted ``1/(2n)``). Unbiased for the first-order
    gradient with respect to the logits (or, by the chain rule, ``probs``); not for higher orders.

    Args:
        plate_name: node / plate name.
        n_samples: the number of uniform draws ``u`` (evaluation groups).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> _ = torch.manual_seed(0)
        >>> phi = torch.tensor([0.3, -0.5], requires_grad=True)
        >>> b = ARM("b", n_samples=2000)(Bernoulli(logits=phi))
        >>> b.shape                                   # [b, b̃] for each of 2000 draws
        torch.Size([4000, 2])
        >>> storch.add_cost(((b - 0.4) ** 2).sum(-1), "f")
        >>> _ = storch.backward()
        >>> exact = 0.2 * torch.sigmoid(phi) * torch.sigmoid(-phi)   # ∂/∂φ [0.16 + 0.2 σ(φ)]
        >>> phi.grad.shape, bool(torch.allclose(phi.grad, exact, atol=0.005))
        (torch.Size([2]), True)
    """

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name, n_samples)
        self._noise = GroupRecords("ARM", "uniforms")  # samples -> u

    def _record(self, samples: torch.Tensor, u: torch.Tensor) -> None:
        self._noise.keep(samples, u)

    def _gradient(
        self,
        tensor: StochasticTensor,
        f_b: torch.Tensor,
        f_b_tilde: torch.Tensor,
        phi: torch.Tensor,
        per_group: PerGroup,
    ) -> torch.Tensor:
        return (f_b_tilde - f_b) * (per_group(self._noise.of(tensor)) - 0.5)


class DisARM(_AntitheticBernoulli):
    """DisARM for ``Bernoulli`` nodes: ``g_φᵢ = ½ (f(b) − f(b̃)) (−1)^{b̃ᵢ} 1[bᵢ ≠ b̃ᵢ] σ(|φᵢ|)``.

    The same antithetic pairs as `storch.method.arm.ARM` (2 cost evaluations per draw, each weighted
    ``1/(2n)``), with the uniform integrated out given the pair: the variance is never larger than
    ARM's. Unbiased for the first-order gradient with respect to the logits (or ``probs``); not for
    higher orders.

    Args:
        plate_name: node / plate name.
        n_samples: the number of antithetic pairs (evaluation groups).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> _ = torch.manual_seed(0)
        >>> phi = torch.tensor([0.3, -0.5], requires_grad=True)
        >>> b = DisARM("b", n_samples=2000)(Bernoulli(logits=phi))
        >>> storch.add_cost(((b - 0.4) ** 2).sum(-1), "f")
        >>> _ = storch.backward()
        >>> exact = 0.2 * torch.sigmoid(phi) * torch.sigmoid(-phi)   # ∂/∂φ [0.16 + 0.2 σ(φ)]
        >>> phi.grad.shape, bool(torch.allclose(phi.grad, exact, atol=0.005))
        (torch.Size([2]), True)
    """

    def _gradient(
        self,
        tensor: StochasticTensor,
        f_b: torch.Tensor,
        f_b_tilde: torch.Tensor,
        phi: torch.Tensor,
        per_group: PerGroup,
    ) -> torch.Tensor:
        samples = node_of(tensor).samples
        pairs = samples.reshape((samples.shape[0] // 2, 2) + tuple(samples.shape[1:]))
        b, b_tilde = pairs[:, 0], pairs[:, 1]
        sign_disagree = (1.0 - 2.0 * b_tilde) * (b != b_tilde).to(samples.dtype)  # (−1)^{b̃} 1[b ≠ b̃]
        return 0.5 * (f_b - f_b_tilde) * per_group(sign_disagree) * torch.sigmoid(phi.abs())
