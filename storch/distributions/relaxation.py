"""Continuous relaxations of discrete distributions (Gumbel-softmax / Concrete), by distribution type.

Supporting a new discrete distribution means registering one `Relaxation` here, in the
manner of ``torch.distributions.kl.register_kl``; estimators never branch on distribution types.

Math (Jang et al. 2017; Maddison et al. 2017). For a categorical with probabilities ``p`` and
Gumbel noise ``G``, ``z = log p + G`` has ``argmax z ~ Cat(p)``; the relaxed sample is
``softmax(z / τ)``. For a Bernoulli with logit ``φ`` and ``u ~ U(0, 1)``,
``z = φ + log u − log(1 − u)`` has ``1[z > 0] ~ Bernoulli(σ(φ))``; the relaxed sample is ``σ(z / τ)``.

REBAR and RELAX (Tucker et al. 2017; Grathwohl et al. 2018) couple the discrete sample ``b = H(z)``
with its relaxation: they need the noise ``z`` itself and a second draw ``z̃ ~ p(z | b)`` conditioned
on the outcome. A `GumbelCoupling` holds these pieces for one distribution type (in
`Relaxation.coupling`); [`conditional_gumbel_rsample`][storch.distributions.relaxation.conditional_gumbel_rsample] is
the relaxed conditional sample
``σ_τ(z̃)``. The conditional formulas (Tucker et al. 2017, appendix) are stated in
[`conditional_gumbel_rsample`][storch.distributions.relaxation.conditional_gumbel_rsample].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.distributions import (
    Bernoulli,
    Distribution,
    OneHotCategorical,
    RelaxedBernoulli,
    RelaxedOneHotCategorical,
    TransformedDistribution,
)
from torch.distributions.relaxed_bernoulli import LogitRelaxedBernoulli
from torch.distributions.transforms import SigmoidTransform

from storch.distributions.one_hot import one_hot
from storch.registries import RELAXATIONS, register_relaxation
from storch.registry import TypeRegistry, independent_base

__all__ = [
    "Relaxation", "GumbelCoupling", "register_relaxation", "relaxation_for", "conditional_gumbel_rsample",
    "continuous_log_prob",
]


@dataclass(frozen=True)
class GumbelCoupling:
    """The noise behind a relaxation: ``z`` with ``b = H(z)``, and ``z̃ ~ p(z | b)`` (REBAR, RELAX).

    Every function works on the distribution's logits and is reparameterised in them (gradients
    flow from ``z``, ``z̃`` and ``σ_τ(z)`` back to the logits and to ``τ``).

    Attributes:
        logits: ``distribution -> logits`` that the noise perturbs (for categoricals normalised
            log-probabilities, as ``OneHotCategorical.logits`` are).
        perturb: ``(logits, n) -> z``, ``n`` draws of shape ``(n, *logits.shape)``.
        threshold: ``z -> b = H(z)``, the discrete sample (same shape and dtype as ``z``).
        conditional: ``(logits, b) -> z̃ ~ p(z | b)``, one draw per element of ``b`` (``b`` may have
            leading sample dimensions that ``logits`` lacks; every draw gets its own noise).
        soft: ``(z, τ) -> σ_τ(z)``, the relaxed sample.
    """

    logits: Callable[[Distribution], torch.Tensor]
    perturb: Callable[[torch.Tensor, int], torch.Tensor]
    threshold: Callable[[torch.Tensor], torch.Tensor]
    conditional: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    soft: Callable[[torch.Tensor, "torch.Tensor | float"], torch.Tensor]


@dataclass(frozen=True)
class Relaxation:
    """How to relax one discrete distribution type.

    Attributes:
        relaxed: ``(distribution, temperature) -> distribution`` with ``rsample``.
        hard: maps a relaxed sample to the discrete sample it rounds to (for straight-through).
        coupling: the noise model and its conditional samples, for REBAR and RELAX (``None``: the
            type has a relaxation but no coupling).
        log_prob: ``(distribution, value) -> log p(value)`` extended to relaxed values (see
            [`continuous_log_prob`][storch.distributions.relaxation.continuous_log_prob]; ``None``: the
            type has none, and relaxed samples of it cannot be scored).
    """

    relaxed: Callable[[Distribution, torch.Tensor], Distribution]
    hard: Callable[[torch.Tensor], torch.Tensor]
    coupling: Optional[GumbelCoupling] = None
    log_prob: Optional[Callable[[Distribution, torch.Tensor], torch.Tensor]] = None


_RELAXATIONS: TypeRegistry[Relaxation] = RELAXATIONS  # made in storch.registries, filled here


def relaxation_for(distr: Distribution) -> Relaxation | None:
    """The relaxation registered for ``type(distr)`` or its most specific base class, else ``None``."""
    return _RELAXATIONS.lookup(distr)


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    return one_hot(x.argmax(-1), x.shape[-1], x.dtype)


def _uniform(shape: torch.Size | tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``U(0, 1)`` draws kept strictly inside ``(0, 1)``."""
    finfo = torch.finfo(like.dtype)
    u = torch.rand(shape, dtype=like.dtype, device=like.device)
    return u.clamp(finfo.tiny, 1.0 - finfo.eps)


def _draw_shape(logits: torch.Tensor, hard: torch.Tensor) -> torch.Size:
    return torch.broadcast_shapes(tuple(logits.shape), tuple(hard.shape))


# ------------------------------------------------------------------ categorical: Gumbel noise
def _categorical_perturb(logits: torch.Tensor, n: int) -> torch.Tensor:
    u = _uniform((n,) + tuple(logits.shape), logits)
    return logits - torch.log(-torch.log(u))


def _categorical_conditional(logits: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    # z̃_b = −log(−log v_b);  z̃_k = −log(−log v_k / p_k − log v_b), written with logaddexp in log p_k
    v = _uniform(_draw_shape(logits, hard), logits)
    log_neg_log_v = torch.log(-torch.log(v))
    log_neg_log_vb = (log_neg_log_v * hard).sum(-1, keepdim=True)
    z_top = -log_neg_log_vb
    z_other = -torch.logaddexp(log_neg_log_v - logits, log_neg_log_vb)
    return torch.where(hard > 0.5, z_top, z_other)


# ------------------------------------------------------------------ Bernoulli: logistic noise
def _bernoulli_perturb(logits: torch.Tensor, n: int) -> torch.Tensor:
    u = _uniform((n,) + tuple(logits.shape), logits)
    return logits + torch.log(u) - torch.log1p(-u)


def _bernoulli_conditional(logits: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    # z̃ = φ + log u' − log(1 − u'),  u' = (1 − p) + v p if b = 1 and u' = v (1 − p) if b = 0,
    # written in log σ(±φ) so that large |φ| keeps its gradient
    v = _uniform(_draw_shape(logits, hard), logits)
    log_v, log1m_v = torch.log(v), torch.log1p(-v)
    log_p, log1m_p = F.logsigmoid(logits), F.logsigmoid(-logits)
    one = logits - log_p - log1m_v + torch.logaddexp(log1m_p, log_v + log_p)  # log u' − log(1 − u') + φ
    zero = log_v + log_p - torch.logaddexp(log1m_v, log_v + log_p)
    return torch.where(hard > 0.5, one, zero)


_CATEGORICAL_COUPLING = GumbelCoupling(
    logits=lambda d: d.logits,
    perturb=_categorical_perturb,
    threshold=_one_hot_argmax,
    conditional=_categorical_conditional,
    soft=lambda z, tau: torch.softmax(z / tau, dim=-1),
)
_BERNOULLI_COUPLING = GumbelCoupling(
    logits=lambda d: d.logits,
    perturb=_bernoulli_perturb,
    threshold=lambda z: (z > 0).to(z.dtype),
    conditional=_bernoulli_conditional,
    soft=lambda z, tau: torch.sigmoid(z / tau),
)


def _relaxed_bernoulli(d: Distribution, tau: torch.Tensor) -> RelaxedBernoulli:
    """``RelaxedBernoulli(tau, logits=d.logits)``, not validated again: ``d``'s parameters were (or
    were not, by the user's choice) when ``d`` was built. (``RelaxedBernoulli`` does not pass
    ``validate_args`` to its base, and validation reads values, which do not exist on ``meta``.)"""
    relaxed = RelaxedBernoulli.__new__(RelaxedBernoulli)
    base = LogitRelaxedBernoulli(tau, logits=d.logits, validate_args=False)
    TransformedDistribution.__init__(relaxed, base, SigmoidTransform(), validate_args=False)
    return relaxed


def _bernoulli_log_prob(d: Distribution, z: torch.Tensor) -> torch.Tensor:
    """``z·log p + (1 − z)·log(1 − p) = z·φ − softplus(φ)`` with ``φ`` the logit (stable in ``φ``)."""
    logits = d.logits
    return z * logits - F.softplus(logits)


def _one_hot_log_prob(d: Distribution, z: torch.Tensor) -> torch.Tensor:
    """``Σ_k z_k log p_k``; a class of probability 0 (``log p_k = −∞``) adds 0 where ``z_k = 0``."""
    log_p = d.logits  # normalised log-probabilities
    return (z * log_p.masked_fill(z == 0, 0.0)).sum(-1)


_RELAXATIONS.register_default(OneHotCategorical)(
    Relaxation(
        relaxed=lambda d, tau: RelaxedOneHotCategorical(tau, logits=d.logits, validate_args=False),
        hard=_one_hot_argmax,
        coupling=_CATEGORICAL_COUPLING,
        log_prob=_one_hot_log_prob,
    )
)
_RELAXATIONS.register_default(Bernoulli)(
    Relaxation(
        relaxed=_relaxed_bernoulli,
        hard=lambda x: (x > 0.5).to(x.dtype),
        coupling=_BERNOULLI_COUPLING,
        log_prob=_bernoulli_log_prob,
    )
)


def continuous_log_prob(d: Distribution, value: torch.Tensor) -> torch.Tensor:
    """``log p(value)`` of a discrete distribution, extended to the relaxed values between its support's.

    The relaxations score a relaxed sample with the discrete log-probability's formula written as a
    function that is linear in the sample (Maddison et al. 2017, "The Concrete Distribution"; Jang et
    al. 2017, "Categorical Reparameterization with Gumbel-Softmax"; the cost ``f(σ_λ(z))`` of REBAR,
    Tucker et al. 2017, and RELAX, Grathwohl et al. 2018, evaluates an ELBO's ``log q`` this way):

        Bernoulli:          log p(z) = z·log p + (1 − z)·log(1 − p)
        OneHotCategorical:  log p(z) = Σ_k z_k log p_k

    At a discrete value it is ``d.log_prob(value)``; it is differentiable in the value and in the
    parameters. An ``Independent`` sums its base's over the reinterpreted dimensions.

    Raises:
        TypeError: if no relaxation with a ``log_prob`` is registered for the distribution's type.

    Examples:
        >>> import torch
        >>> from torch.distributions import Bernoulli
        >>> q = Bernoulli(probs=torch.tensor([0.2, 0.6]))
        >>> continuous_log_prob(q, torch.tensor([0.5, 1.0])).tolist() == [
        ...     (0.5 * torch.tensor(0.2).log() + 0.5 * torch.tensor(0.8).log()).item(), torch.tensor(0.6).log().item()]
        True
    """
    base, n = independent_base(d)
    relaxation = _RELAXATIONS.lookup(base)
    if relaxation is None or relaxation.log_prob is None:
        raise TypeError(
            f"{type(base).__name__} has no continuous extension of its log-probability registered "
            "(storch.distributions.relaxation.register_relaxation(..., Relaxation(..., log_prob=...)))."
        )
    log_p = relaxation.log_prob(base, value)
    return log_p.sum(tuple(range(-n, 0))) if n else log_p


def conditional_gumbel_rsample(
    hard_sample: torch.Tensor, probs: torch.Tensor, bernoulli: bool, temperature: torch.Tensor | float
) -> torch.Tensor:
    """Relaxed sample ``σ_τ(z̃)`` with ``z̃ ~ p(z | b)``, the Gumbel noise conditioned on outcome ``b``.

    Categorical (``hard_sample`` one-hot over the last dim, ``probs`` normalised): draw
    ``v_k ~ U(0, 1)``; ``z̃_b = −log(−log v_b)`` and ``z̃_k = −log(−log v_k / p_k − log v_b)`` for
    ``k ≠ b``; return ``softmax(z̃ / τ)``. Bernoulli (``hard_sample`` in {0, 1}, ``probs = σ(φ)``):
    draw ``v ~ U(0, 1)``, set ``u' = (1 − p) + v p`` if ``b = 1`` else ``u' = v (1 − p)``,
    ``z̃ = φ + log(u' / (1 − u'))``; return ``σ(z̃ / τ)``. Both are reparameterised in ``probs``.
    ``hard_sample`` may have leading sample dimensions that ``probs`` lacks; every element gets its
    own noise. Estimators that own the distribution use its `GumbelCoupling` instead, which
    works on the logits.

    Examples:
        >>> import torch
        >>> b = torch.tensor([[0., 1., 0.]])
        >>> z = conditional_gumbel_rsample(b, torch.tensor([[0.2, 0.5, 0.3]]), False, 0.1)
        >>> bool(z.argmax(-1) == 1)
        True
    """
    tiny = torch.finfo(probs.dtype).tiny
    coupling = _BERNOULLI_COUPLING if bernoulli else _CATEGORICAL_COUPLING
    if bernoulli:
        p = probs.clamp(tiny, 1 - torch.finfo(probs.dtype).eps)
        logits = torch.log(p) - torch.log1p(-p)
    else:
        logits = torch.log(probs.clamp_min(tiny))
    return coupling.soft(coupling.conditional(logits, hard_sample), temperature)


class AnnealedTemperature:
    """Mixin for an ``nn.Module`` whose relaxation temperature anneals once per backward pass.

    ``τ_t = max(τ_min, τ_0 · exp(−r · t))`` after ``t`` calls of `anneal`. State protocol: the step
    count ``t`` (``annealing_steps``, an ``int64`` buffer, not saved as a buffer) and ``temperature``
    (a saved buffer) are updated in place by tensor operations, with no value read back on the
    host, so that [`storch.compile_step`][storch.compile_step] records the update in the traced step and
    every replay carries it out (as `storch.method.baseline.MovingAverageBaseline` does with its
    averages). ``τ_t`` is computed in ``float64`` where the device has it. The step count is read on
    the host only by `steps` and by ``state_dict`` (key ``_extra_state``), so a loaded
    ``state_dict`` resumes the schedule where it was.
    """

    temperature: torch.Tensor
    annealing_steps: torch.Tensor

    def init_temperature(self, owner: str, initial: float, minimum: float, rate: float) -> None:
        """Set the schedule; ``owner`` names the method in errors (e.g. ``"GumbelSoftmax('z')"``)."""
        if initial <= 0 or minimum <= 0:
            raise ValueError(
                f"{owner}: temperatures must be positive, got initial_temperature={initial}, "
                f"min_temperature={minimum}."
            )
        self.initial_temperature = float(initial)
        self.min_temperature = float(minimum)
        self.annealing_rate = float(rate)
        self.register_buffer("temperature", torch.tensor(float(initial)))  # type: ignore[attr-defined]
        steps = torch.zeros((), dtype=torch.long)
        self.register_buffer("annealing_steps", steps, persistent=False)  # type: ignore[attr-defined]

    @property
    def steps(self) -> int:
        """``t``, the number of annealing steps so far (read on the host: for display and checkpoints)."""
        return int(self.annealing_steps)

    def anneal(self, steps: Optional[int] = None) -> None:
        """Advance the schedule by one step (or set it to ``steps``) and update ``temperature`` in place.

        At ``annealing_rate = 0`` the schedule is constant and a step changes nothing (no count either).
        """
        with torch.no_grad():
            if steps is not None:
                self.annealing_steps.fill_(int(steps))
            elif self.annealing_rate == 0:
                return
            else:
                self.annealing_steps.add_(1)
            self.temperature.copy_(self._scheduled_temperature())

    def _scheduled_temperature(self) -> torch.Tensor:
        """``max(τ_min, τ_0 · exp(−r · t))`` from the ``annealing_steps`` buffer, as a tensor."""
        wide = torch.float32 if self.temperature.device.type == "mps" else torch.float64
        t = self.annealing_steps.to(wide)
        return (t * -self.annealing_rate).exp().mul(self.initial_temperature).clamp(min=self.min_temperature)

    def get_extra_state(self) -> dict:
        """The annealing step count (the temperature itself is a buffer), for ``state_dict``."""
        return {"steps": self.steps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle, also a method pickled when the step count was a Python attribute."""
        old_steps = state.pop("steps", None)
        super().__setstate__(state)  # type: ignore[misc]
        if "annealing_steps" not in self._buffers:  # type: ignore[attr-defined]
            steps = torch.zeros((), dtype=torch.long, device=self.temperature.device)
            self.register_buffer("annealing_steps", steps, persistent=False)  # type: ignore[attr-defined]
            self.anneal(int(old_steps or 0))

    def set_extra_state(self, state: Any) -> None:
        """Restore the step count saved by `get_extra_state`, so annealing resumes where it was."""
        if not isinstance(state, dict) or "steps" not in state:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the '_extra_state' entry must be a dict with key "
                f"'steps' (written by get_extra_state), got {type(state).__name__}."
            )
        self.anneal(state["steps"])
