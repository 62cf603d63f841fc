"""Continuous relaxations of discrete distributions (Gumbel-softmax / Concrete), by distribution type.

Supporting a new discrete distribution means registering one :class:`Relaxation` here, in the
manner of ``torch.distributions.kl.register_kl``; estimators never branch on distribution types.

Math (Jang et al. 2017; Maddison et al. 2017). For a categorical with probabilities ``p`` and
Gumbel noise ``G``, ``z = log p + G`` has ``argmax z ~ Cat(p)``; the relaxed sample is
``softmax(z / τ)``. For a Bernoulli with logit ``φ`` and ``u ~ U(0, 1)``,
``z = φ + log u − log(1 − u)`` has ``1[z > 0] ~ Bernoulli(σ(φ))``; the relaxed sample is ``σ(z / τ)``.

Conditional samples ``z̃ ~ p(z | b)`` given the discrete outcome ``b`` (REBAR, RELAX) are in
:func:`conditional_gumbel_rsample`; the formulas are in the SPEC appendix and its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributions import (
    Bernoulli,
    Distribution,
    OneHotCategorical,
    RelaxedBernoulli,
    RelaxedOneHotCategorical,
)

__all__ = ["Relaxation", "register_relaxation", "relaxation_for", "conditional_gumbel_rsample"]


@dataclass(frozen=True)
class Relaxation:
    """How to relax one discrete distribution type.

    Attributes:
        relaxed: ``(distribution, temperature) -> distribution`` with ``rsample``.
        hard: maps a relaxed sample to the discrete sample it rounds to (for straight-through).
    """

    relaxed: Callable[[Distribution, torch.Tensor], Distribution]
    hard: Callable[[torch.Tensor], torch.Tensor]


_RELAXATIONS: dict[type, Relaxation] = {}


def register_relaxation(dist_type: type, relaxation: Relaxation) -> None:
    """Register the Gumbel-softmax relaxation of ``dist_type`` (and its subclasses)."""
    _RELAXATIONS[dist_type] = relaxation


def relaxation_for(distr: Distribution) -> Relaxation | None:
    """The relaxation registered for ``type(distr)`` or its nearest base class, else ``None``."""
    for cls in type(distr).__mro__:
        if cls in _RELAXATIONS:
            return _RELAXATIONS[cls]
    return None


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)


register_relaxation(
    OneHotCategorical,
    Relaxation(
        relaxed=lambda d, tau: RelaxedOneHotCategorical(tau, logits=d.logits),
        hard=_one_hot_argmax,
    ),
)
register_relaxation(
    Bernoulli,
    Relaxation(
        relaxed=lambda d, tau: RelaxedBernoulli(tau, logits=d.logits),
        hard=lambda x: (x > 0.5).to(x.dtype),
    ),
)


def conditional_gumbel_rsample(
    hard_sample: torch.Tensor, probs: torch.Tensor, bernoulli: bool, temperature: torch.Tensor | float
) -> torch.Tensor:
    """Relaxed sample ``σ_τ(z̃)`` with ``z̃ ~ p(z | b)``, the Gumbel noise conditioned on outcome ``b``.

    Categorical (``hard_sample`` one-hot over the last dim, ``probs`` normalised): draw
    ``v_k ~ U(0, 1)``; ``z̃_b = −log(−log v_b)`` and ``z̃_k = −log(−log v_k / p_k − log v_b)`` for
    ``k ≠ b``; return ``softmax(z̃ / τ)``. Bernoulli (``hard_sample`` in {0, 1}, ``probs = σ(φ)``):
    draw ``v ~ U(0, 1)``, set ``u' = (1 − p) + v p`` if ``b = 1`` else ``u' = v (1 − p)``,
    ``z̃ = φ + log(u' / (1 − u'))``; return ``σ(z̃ / τ)``. Both are reparameterised in ``probs``.

    Example:
        >>> import torch
        >>> b = torch.tensor([[0., 1., 0.]])
        >>> z = conditional_gumbel_rsample(b, torch.tensor([[0.2, 0.5, 0.3]]), False, 0.1)
        >>> bool(z.argmax(-1) == 1)
        True
    """
    eps = torch.finfo(probs.dtype).tiny
    if bernoulli:
        v = torch.rand_like(probs)
        u = torch.where(hard_sample > 0.5, (1 - probs) + v * probs, v * (1 - probs))
        u = u.clamp(eps, 1 - torch.finfo(probs.dtype).eps)
        logit = torch.log(probs.clamp_min(eps)) - torch.log1p(-probs.clamp(max=1 - 1e-7))
        z = logit + torch.log(u) - torch.log1p(-u)
        return torch.sigmoid(z / temperature)
    v = torch.rand_like(probs).clamp_min(eps)
    log_v = torch.log(v)
    log_vb = (log_v * hard_sample).sum(-1, keepdim=True)
    z_other = -torch.log(-log_v / probs.clamp_min(eps) - log_vb)
    z_top = -torch.log(-log_vb)
    z = torch.where(hard_sample > 0.5, z_top, z_other)
    return torch.softmax(z / temperature, dim=-1)
