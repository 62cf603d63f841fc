"""Sampling without replacement: Gumbel-top-k and stochastic beam search (Kool, van Hoof & Welling 2019).

Perturb every log-probability with an independent standard Gumbel, ``G(s) = log p(s) + Gumbel``, and
keep the ``k`` largest: the ``k`` values are a sample without replacement (Gumbel-top-k). Let ``κ``
be the ``(k+1)``-th largest perturbed value. Then ``s`` is in the set with probability
``q_κ(s) = P(G(s) > κ) = 1 − exp(−exp(log p(s) − κ))`` given ``κ``, and

    Σ_{s ∈ S} p(s) / q_κ(s) · f(s)                  is unbiased for E_p[f]   (priority sampling).

When the support has at most ``k`` elements the set is the whole support, ``κ = −∞`` and the weights
are ``p(s)``: the estimate is exact.

Over a product space (several categorical variables, or a sequence decoded step by step) the set is
drawn by *stochastic beam search*: the perturbed value of a prefix is the maximum of the perturbed
values of its completions, so the children of a prefix with perturbed value ``T`` get Gumbels
conditioned on their maximum being ``T``; keeping the ``k`` best of the ``k·V`` extensions at every
step gives an exact Gumbel-top-k sample of prefixes at every step, hence of full sequences. The
``(k+1)``-th largest perturbed value over *all* prefixes of length ``t`` is
``κ_t = max(κ_{t−1}, (k+1)-th largest candidate)``, since the best descendant of a pruned prefix has
the pruned prefix's value. A sequence step with several variables per beam (batch dimensions that
are not plates) is one token whose value is the tuple of the variables' values: the search adds
the variables one at a time, which keeps an exact Gumbel-top-k sample of the (finer) prefixes after
each, so the step yields ``k`` distinct extensions with the step's ``κ`` and the joint
log-probability (summed over the variables and steps).

Extension points (for estimators built on this proposal, e.g. the unordered set estimator):

* `storch.sampling.swor.SequenceSampler` — the base class:
  `storch.sampling.swor.SequenceSampler.draw` (a set in one call),
  `storch.sampling.swor.SequenceSampler.extend` (extend the previous step of a sequence), and
  `storch.sampling.swor.SequenceSampler.weights`; `storch.sampling.swor.gumbel_top_k_step` is one
  step of stochastic beam search on plain tensors (returns parent indices, tokens,
  log-probabilities, perturbed values and ``κ``).

* `storch.sampling.swor.WORState` — the sampled set of one step: ``log_prob`` (log-probability of
  each sampled element or prefix, summed over variables/steps, differentiable), ``perturbed`` (its
  perturbed log-probability), ``kappa`` (the ``(k+1)``-th largest perturbed value, ``−∞`` when the
  support is covered), ``tokens``, ``parent_index``, ``finished``. Beam dimension first, then the
  batch (plate) dimensions of the distribution.
* `storch.sampling.swor.SampleWithoutReplacement.weights` — the plate weight of each element from
  a `storch.sampling.swor.WORState`; override it to weight the set differently.
* `storch.sampling.swor.SampleWithoutReplacement.state_of` — the
  `storch.sampling.swor.WORState` behind a sampled tensor's plate.
* `storch.sampling.swor.log_inclusion_probability` — ``log q_κ(s)``;
  `storch.sampling.swor.wor_support` and `storch.sampling.swor.register_wor_support` — the
  registry of distributions with an enumerable support.
* `storch.sampling.swor.log1mexp` (the manual's ``loglmexp``) and
  `storch.sampling.swor.cond_gumbel_sample` — the numerics.
* `storch.sampling.swor.SumAndSampleRest` (the manual's constructor:
  `storch.sampling.swor.SumAndSample`) — sum the most probable values exactly and sample the rest,
  i.i.d. or without replacement (the proposal of `storch.method.RaoBlackwellSF`).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.distributions import Bernoulli, Categorical, Distribution, OneHotCategorical

from storch.extend import (
    Plate,
    TypeRegistry,
    layout_of,
    log_prob_of_own_samples,
    no_dispatch,
    node_of,
    wrap_new,
)
from storch.distributions.one_hot import one_hot
from storch.registries import WOR_SUPPORTS, register_wor_support
from storch.sampling.method import SamplingMethod, check_count

if TYPE_CHECKING:  # pragma: no cover
    from storch.extend import StochasticTensor

__all__ = [
    "SequenceSampler", "SampleWithoutReplacement", "WORState", "WORSupport", "register_wor_support", "wor_support",
    "log_inclusion_probability", "gumbel_top_k_step", "log1mexp", "loglmexp", "cond_gumbel_sample",
    "SumAndSampleRest", "SumAndSample",
]


# ----------------------------------------------------------------------- support registry
@dataclass
class WORSupport:
    """The finite support of a distribution, as a sampling-without-replacement proposal needs it.

    Attributes:
        log_probs: ``(*batch_shape, V)`` log-probabilities of the ``V`` values (differentiable).
        values: maps value indices ``(...)`` (a ``LongTensor``) to samples ``(..., *event_shape)``.
    """

    log_probs: torch.Tensor
    values: Callable[[torch.Tensor], torch.Tensor]


_SupportFn = Callable[[Distribution], WORSupport]

_SUPPORTS: TypeRegistry[_SupportFn] = WOR_SUPPORTS  # made in storch.registries, filled here


def wor_support(distr: Distribution) -> WORSupport:
    """The registered `storch.sampling.swor.WORSupport` of ``distr`` (the most specific registered base
    class)."""
    fn = _SUPPORTS.lookup(distr)
    if fn is not None:
        return fn(distr)
    raise TypeError(
        f"Sampling without replacement needs a distribution with a finite, enumerable support; "
        f"{type(distr).__name__} has no registered support (registered: "
        f"{sorted(c.__name__ for c in _SUPPORTS)}). Register one with "
        "storch.sampling.swor.register_wor_support, or use ScoreFunction for other distributions."
    )


@_SUPPORTS.register_default(Categorical)
def _categorical_support(d: Categorical) -> WORSupport:
    return WORSupport(d.logits, lambda idx: idx)


@_SUPPORTS.register_default(OneHotCategorical)
def _one_hot_support(d: OneHotCategorical) -> WORSupport:
    logits = d.logits
    size = logits.shape[-1]
    return WORSupport(logits, lambda idx: one_hot(idx, size, logits.dtype))


@_SUPPORTS.register_default(Bernoulli)
def _bernoulli_support(d: Bernoulli) -> WORSupport:
    logits = d.logits
    log_probs = torch.stack([-F.softplus(logits), -F.softplus(-logits)], -1)  # values 0, 1
    return WORSupport(log_probs, lambda idx: idx.to(logits.dtype))


# ----------------------------------------------------------------------- Gumbel-top-k math
def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(a))`` for ``a ≤ 0``, accurate for every ``a`` (Mächler 2012; appendix A of
    Kool, van Hoof & Welling 2020, JMLR 21).

    ``log(−expm1(a))`` for ``a > −log 2`` and ``log1p(−exp(a))`` below, so neither ``1 − exp(a)``
    near ``0`` (``a → 0⁻``) nor ``exp(a)`` near ``0`` (``a → −∞``) loses precision. ``a = 0`` gives
    ``−∞``; ``a > 0`` (where ``1 − exp(a) < 0``) gives NaN. The manual spells it ``loglmexp``.

    Examples:
        >>> import torch
        >>> x = torch.tensor([-1e-10, -0.5, -1.0, -50.0, 0.0])
        >>> [float(f"{v:.6g}") for v in log1mexp(x).tolist()]
        [-23.0259, -0.932752, -0.458675, -1.92875e-22, -inf]
    """
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


#: The manual's spelling of `storch.sampling.swor.log1mexp` (``storch.sampling.swor.loglmexp``): the same
# function.
loglmexp = log1mexp


def log_inclusion_probability(log_p: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """``log q_κ(s) = log(1 − exp(−exp(log p(s) − κ)))``: the log-probability that ``s`` is sampled.

    ``κ = −∞`` gives ``0`` (the set holds the whole support).

    Examples:
        >>> import torch
        >>> log_inclusion_probability(torch.tensor([0.0, -1.0]), torch.tensor(float("-inf"))).exp().tolist()
        [1.0, 1.0]
        >>> round(log_inclusion_probability(torch.tensor(-1.0), torch.tensor(0.0)).exp().item(), 4)
        0.3078
    """
    a = log_p - kappa
    return torch.where(a < -30.0, a, log1mexp(-torch.exp(a.clamp(max=30.0))))


def _gumbel_like(t: torch.Tensor) -> torch.Tensor:
    return -torch.empty_like(t).exponential_().log()


def _conditional_gumbel(parent: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Shift the Gumbels ``free`` (``(..., V)``) so that their maximum is ``parent`` (``(..., 1)``).

    Kool et al. 2019, eq. 23 in its numerically stable form; impossible children (``−∞``) and the
    children of dead beams stay ``−∞``. The maximum becomes ``parent`` exactly (by selection, so
    that the gradient there is finite: the formula's ``log1mexp(0) = −∞`` would give NaN).
    """
    z = free.max(-1, keepdim=True).values
    alive = (z > -math.inf) & (parent > -math.inf)
    z_safe = torch.where(alive, z, torch.zeros_like(z))
    t_safe = torch.where(alive, parent, torch.zeros_like(parent))
    gap = free - z_safe
    top = gap >= 0.0
    v = t_safe - free + log1mexp(torch.where(top, torch.full_like(gap, -1.0), gap.clamp(max=0.0)))
    shifted = t_safe - v.clamp(min=0.0) - torch.log1p(torch.exp(-v.abs()))
    shifted = torch.where(top, t_safe, shifted)
    return torch.where(alive & (free > -math.inf), shifted, torch.full_like(shifted, -math.inf))


def cond_gumbel_sample(all_joint_log_probs: torch.Tensor, perturbed_log_probs: torch.Tensor | float) -> torch.Tensor:
    """Gumbel-perturbed log-probabilities conditioned on their maximum (the manual's helper).

    Draws ``G_v = all_joint_log_probs[..., v] + Gumbel(0, 1)`` independently and shifts them so that
    ``max_v G_v`` equals ``perturbed_log_probs`` (Kool, van Hoof & Welling 2019, eq. 23, in its
    numerically stable form): the perturbed values of the children of a prefix in stochastic
    beam search, given the prefix's perturbed value. Reparameterised (differentiable in both
    arguments); ``−∞`` log-probabilities stay ``−∞``.

    Args:
        all_joint_log_probs: ``(..., V)`` log-probabilities of the ``V`` options.
        perturbed_log_probs: ``(...)`` the required maximum (a scalar broadcasts; ``0.0`` at the
            root of a beam search).

    Returns:
        ``(..., V)`` conditioned perturbed log-probabilities.

    Examples:
        >>> import torch
        >>> log_p = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]))
        >>> g = cond_gumbel_sample(log_p, torch.tensor([-1.0, 2.0]))
        >>> g.max(-1).values.tolist()
        [-1.0, 2.0]
    """
    lp = all_joint_log_probs
    top = torch.as_tensor(perturbed_log_probs, dtype=lp.dtype, device=lp.device)
    return _conditional_gumbel(top.unsqueeze(-1), lp + _gumbel_like(lp))


def gumbel_top_k_step(
    parent_log_p: torch.Tensor,
    parent_perturbed: Optional[torch.Tensor],
    extension_log_p: torch.Tensor,
    k: int,
    kappa: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of stochastic beam search on plain, detached tensors.

    Args:
        parent_log_p: ``(n, *B)`` log-probabilities of the current prefixes (``−∞``: dead beam).
        parent_perturbed: ``(n, *B)`` their perturbed values, or ``None`` at the root (``n = 1``).
        extension_log_p: ``(n, *B, V)`` log-probability of each extension given its prefix.
        k: beam size.
        kappa: ``(*B)`` the previous step's ``κ`` (``−∞`` at the root).

    Returns:
        ``(parent_index, token, log_p, perturbed, kappa)``: the ``min(k, n·V)`` best extensions
            (beam dimension first, best first) and the new ``κ``.
    """
    n, size = extension_log_p.shape[0], extension_log_p.shape[-1]
    cand_log_p = parent_log_p.unsqueeze(-1) + extension_log_p
    free = cand_log_p + _gumbel_like(cand_log_p)
    cand = free if parent_perturbed is None else _conditional_gumbel(parent_perturbed.unsqueeze(-1), free)
    m = n * size
    flat = cand.movedim(0, -2).reshape(cand.shape[1:-1] + (m,))  # index = parent · V + token
    flat_log_p = cand_log_p.movedim(0, -2).reshape(flat.shape)
    n_new = min(k, m)
    top, idx = flat.topk(min(k + 1, m), dim=-1)
    if m > k:
        kappa = torch.maximum(kappa, top[..., k])
    chosen = idx[..., :n_new]
    log_p = flat_log_p.gather(-1, chosen).movedim(-1, 0)
    parent_index, token = (chosen // size).movedim(-1, 0), (chosen % size).movedim(-1, 0)
    return parent_index, token, log_p, top[..., :n_new].movedim(-1, 0), kappa


# ----------------------------------------------------------------------- the sampled set
@dataclass
class WORState:
    """A sample without replacement (one step of a sequence, or a whole set of joint values).

    Beam dimension first, then the batch dimensions ``B`` (the plates of the distribution's
    parameters, the ancestor's plate excluded).

    Attributes:
        log_prob: ``(n, *B)`` log-probability of each element / prefix (summed over variables and
            steps), differentiable; ``0`` on dead beams.
        perturbed: ``(n, *B)`` its perturbed log-probability (detached; ``−∞`` on dead beams).
        kappa: ``(*B)`` the ``(k+1)``-th largest perturbed value (``−∞`` when the set is the support).
        tokens: ``(n, *B, *var_shape)`` value indices (for sequences: this step's token, one index
            per variable of the step).
        parent_index: ``(n, *B)`` the beam of the previous step each element extends (``None`` for
            a set drawn in one call).
        finished: ``(n, *B)`` whether the sequence has emitted the end-of-sequence token.
        alive: ``(n, *B)`` whether the element has positive probability.
    """

    log_prob: torch.Tensor
    perturbed: torch.Tensor
    kappa: torch.Tensor
    tokens: torch.Tensor
    parent_index: Optional[torch.Tensor] = None
    finished: Optional[torch.Tensor] = None
    alive: Optional[torch.Tensor] = None


class SequenceSampler(SamplingMethod):
    """Base class of proposals that draw sets of values and extend them step by step (sequences).

    Subclasses implement `storch.sampling.swor.SequenceSampler.draw` (the set of one call),
    `storch.sampling.swor.SequenceSampler.extend` (extend the set of the
    previous step of a sequence) and `storch.sampling.swor.SequenceSampler.weights`.
    `storch.method.score_function_wor.ScoreFunctionWOR`
    calls them; each step's `storch.sampling.swor.WORState` lives on its plate (``plate.info``).

    Args:
        plate_name: the plate of the sampled set.
        k: the number of samples (beams).
        eos: the end-of-sequence value index: a finished sequence continues with ``eos`` with
            probability 1. ``None``: sequences have a fixed length.
    """

    #: whether the ``k`` samples are drawn independently (i.i.d. sequences, ``MCDecoder``): then a
    #: baseline may average the other samples' costs (leave-one-out). ``False`` for sets drawn
    #: without replacement, whose elements depend on each other.
    independent_samples: bool = False

    def __init__(self, plate_name: str, k: int, eos: Optional[int] = None) -> None:
        super().__init__(plate_name)
        self.k = check_count(k, "k", f"{type(self).__name__}({plate_name!r})")
        self.eos = eos
        self._pending: Optional[WORState] = None

    @property
    def n_samples(self) -> int:
        return self.k

    @abstractmethod
    def draw(self, distr: Distribution, n_plates: int) -> tuple[torch.Tensor, WORState]:
        """The set of one call: samples ``(n, *batch_shape, *event_shape)`` and their state.

        ``distr``'s first ``n_plates`` batch dimensions are plates, the others independent
        variables sampled jointly.
        """

    @abstractmethod
    def extend(self, distr: Distribution, parent: WORState, beam_dim: int) -> tuple[torch.Tensor, WORState]:
        """Extend the previous step's set by one token.

        Args:
            distr: the distribution of the next token given each prefix; its batch dimensions are
                the plates of its parameters (the previous step's plate at ``beam_dim``), then the
                step's variables ``var_shape`` (none for one variable per beam; several are one
                token whose value is the tuple of theirs).
            parent: the previous step's `storch.sampling.swor.WORState`, laid out as ``distr``'s other
                plates
                (beam dimension first).
            beam_dim: the position of the previous step's plate among ``distr``'s batch dimensions.

        Returns:
            the samples ``(n', *other plates, *var_shape, *event_shape)`` and the step's
                `storch.sampling.swor.WORState` (``log_prob`` is that of the whole prefix, the step's
                variables summed, differentiable; ``parent_index`` is ``(n', *other plates)``).
        """

    @abstractmethod
    def weights(self, state: WORState) -> Optional[torch.Tensor]:
        """The plate weight of each element ``(n, *B)`` (detached), or ``None`` for ``1/n``."""

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        if requires_grad:
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}) draws discrete samples without a "
                "pathwise gradient; use it with a score-function estimator (ScoreFunctionWOR)."
            )
        samples, self._pending = self.draw(distr, len(plates))
        return samples

    def state_of(self, tensor: "StochasticTensor") -> WORState:
        """The `storch.sampling.swor.WORState` behind ``tensor``'s plate."""
        info = tensor.plate.info
        if not isinstance(info, WORState):
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): no sampled set is recorded on plate "
                f"{tensor.plate.name!r}; sample it with storch.method.score_function_wor.ScoreFunctionWOR."
            )
        return info

    def weighting_function(self, tensor: "StochasticTensor", plate: Plate) -> Optional[torch.Tensor]:
        state = plate.info
        if not isinstance(state, WORState):  # drawn through the generic Method.forward
            state, self._pending = self._pending, None
        if state is None:
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): weighting_function called without a "
                "preceding sample."
            )
        with no_dispatch():
            w = self.weights(state)
        return None if w is None else wrap_new(w, layout_of(tensor))

    def reset(self) -> None:
        self._pending = None

    def _check_eos_variables(self, var_shape: tuple, batch_shape: tuple, step: str) -> None:
        """Refuse ``eos`` on a node or step with several variables (it has no single token)."""
        if self.eos is None or not var_shape:
            return
        raise ValueError(
            f"{type(self).__name__}({self.plate_name!r}): eos={self.eos} marks a sequence finished when its "
            "token is eos, so with eos a step needs one categorical variable per beam (and plate "
            f"combination), but {step} has batch shape {batch_shape}, of which {var_shape} are not plates: "
            f"{math.prod(var_shape)} variables per beam, with no single token to compare with eos. Decode "
            "one variable per step (one call of the method per variable), or drop eos (fixed-length "
            "sequences: several variables per step are then sampled jointly, as one token)."
        )

    def _extension_log_probs(
        self, distr: Distribution, parent: WORState, beam_dim: int
    ) -> tuple[WORSupport, torch.Tensor, torch.Tensor]:
        """The support, the differentiable next-token log-probabilities ``(n, *B, *var_shape, V)``
        and their detached version with finished prefixes forced onto ``eos`` (probability 1).

        ``var_shape`` are the step's variables (batch dimensions of ``distr`` that are not plates);
        ``eos`` is refused when there are several.
        """
        support = wor_support(distr)
        lp = support.log_probs.movedim(beam_dim, 0)
        var_shape = tuple(lp.shape[parent.log_prob.dim() : -1])
        self._check_eos_variables(var_shape, tuple(distr.batch_shape), "this sequence step")
        ext = lp.detach()
        if parent.finished is not None and self.eos is not None:
            on_eos = torch.full((lp.shape[-1],), -math.inf, dtype=ext.dtype, device=ext.device)
            on_eos[self.eos] = 0.0
            ext = torch.where(parent.finished.unsqueeze(-1), on_eos, ext)
        return support, lp, ext

    def _extend_prefixes(
        self, lp: torch.Tensor, parent: WORState, parent_index: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The differentiable prefix log-probability and the finished flags of the extensions.

        Args:
            lp: ``(n, *B, *var_shape, V)`` the step's differentiable log-probabilities.
            parent: the previous step's state (``(n, *B)``).
            parent_index: ``(n', *B)`` the previous beam each extension extends.
            token: ``(n', *B, *var_shape)`` the step's value indices, one per variable.

        Returns:
            ``(n', *B)``: the prefix log-probability (the step's variables summed) and ``finished``.
        """
        token_lp = _take_beams(lp, parent_index).gather(-1, token.unsqueeze(-1)).squeeze(-1)
        if token_lp.dim() > parent_index.dim():  # several variables per step: their joint log-probability
            token_lp = token_lp.sum(tuple(range(parent_index.dim(), token_lp.dim())))
        if self.eos is not None and token.dim() == parent_index.dim():
            done = token == self.eos
        else:
            done = torch.zeros_like(parent_index, dtype=torch.bool)
        if parent.finished is not None:
            was_done = _take_beams(parent.finished, parent_index)
            token_lp = torch.where(was_done, torch.zeros_like(token_lp), token_lp)  # EOS after EOS: log 1
            done = done | was_done
        return _take_beams(parent.log_prob, parent_index) + token_lp, done

    def _finished(self, tokens: torch.Tensor, var_shape: tuple) -> Optional[torch.Tensor]:
        if self.eos is None or var_shape:
            return None
        return tokens == self.eos

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, k={self.k}, eos={self.eos}"


class SampleWithoutReplacement(SequenceSampler):
    """Gumbel-top-k sampling without replacement (stochastic beam search over several variables).

    Draws ``min(k, |support|)`` distinct joint values of a discrete distribution per combination of
    the parameters' plates and weights each by ``p(s)/q_κ(s)`` (Kool, van Hoof & Welling 2019,
    ICML). Several independent variables (non-plate batch dimensions) are sampled jointly: the set
    holds distinct *joint* configurations, drawn by stochastic beam search over the variables.
    Called step by step on a sequence
    (`storch.method.score_function_wor.ScoreFunctionWOR`) it runs
    stochastic beam search over prefixes.

    Args:
        plate_name: the plate of the sampled set.
        k: the number of distinct samples (the beam size).
        normalize: divide the weights by their sum ``W = Σ_S p(s)/q_κ(s)`` (consistent, biased).
        eos: the end-of-sequence value index, for sequences decoded step by step.
        biased_iw: the manual's (Storchastic's) keyword for ``normalize``.

    Examples:
        >>> import torch
        >>> from torch.distributions import Categorical
        >>> swor = SampleWithoutReplacement("z", k=3)
        >>> s = swor.sample(Categorical(logits=torch.zeros(5)), (), False)
        >>> s.shape, len(set(s.tolist()))
        (torch.Size([3]), 3)
    """

    def __init__(
        self, plate_name: str, k: int, normalize: bool = False, eos: Optional[int] = None, *,
        biased_iw: Optional[bool] = None,
    ) -> None:
        super().__init__(plate_name, k, eos)
        if biased_iw is not None:
            if normalize and not biased_iw:
                raise ValueError(
                    f"{type(self).__name__}({plate_name!r}): normalize=True and biased_iw=False disagree; "
                    "biased_iw is the manual's name for normalize, give one of them."
                )
            normalize = biased_iw
        self.normalize = bool(normalize)

    def draw(self, distr: Distribution, n_plates: int) -> tuple[torch.Tensor, WORState]:
        """A set of ``min(k, V^D)`` distinct joint values of ``distr`` per plate combination.

        Args:
            distr: the distribution; its first ``n_plates`` batch dimensions are plates, the other
                ``D`` batch dimensions independent variables sampled jointly.
            n_plates: the number of plate dimensions.

        Returns:
            the samples ``(n, *batch_shape, *event_shape)`` and the `storch.sampling.swor.WORState`.
        """
        support = wor_support(distr)
        log_probs = support.log_probs
        plate_shape = tuple(log_probs.shape[:n_plates])
        var_shape = tuple(log_probs.shape[n_plates:-1])
        self._check_eos_variables(var_shape, tuple(distr.batch_shape), "the node")
        size = log_probs.shape[-1]
        lp = log_probs.reshape(plate_shape + (-1, size))  # (*P, D, V)
        lp_detached = lp.detach()
        n_vars = lp.shape[-2]
        beam_log_p = lp_detached.new_zeros((1,) + plate_shape)
        perturbed: Optional[torch.Tensor] = None
        kappa = lp_detached.new_full(plate_shape, -math.inf)
        tokens = torch.zeros((1,) + plate_shape + (0,), dtype=torch.long, device=lp.device)
        for d in range(n_vars):
            ext = lp_detached[..., d, :].unsqueeze(0).expand((beam_log_p.shape[0],) + plate_shape + (size,))
            parent, token, beam_log_p, perturbed, kappa = gumbel_top_k_step(beam_log_p, perturbed, ext, self.k, kappa)
            tokens = torch.cat([_take_beams(tokens, parent), token.unsqueeze(-1)], -1)
        alive = beam_log_p > -math.inf
        # the differentiable log-probability of each joint value
        lp_exp = lp.unsqueeze(0).expand((tokens.shape[0],) + tuple(lp.shape))
        log_prob = lp_exp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).sum(-1)
        log_prob = torch.where(alive, log_prob, torch.zeros_like(log_prob))
        tokens = tokens.reshape(tokens.shape[: 1 + n_plates] + var_shape)
        finished = self._finished(tokens, var_shape)
        state = WORState(log_prob, perturbed, kappa, tokens, finished=finished, alive=alive)  # type: ignore[arg-type]
        return support.values(tokens), state

    def extend(self, distr: Distribution, parent: WORState, beam_dim: int) -> tuple[torch.Tensor, WORState]:
        """One step of stochastic beam search: the ``min(k, n·V^D)`` best of the ``n·V^D`` extensions.

        A step with ``D > 1`` variables per beam (batch dimensions of ``distr`` that are not
        plates) extends each prefix by the *joint* value of its variables, one token of ``V^D``
        values: the variables are added one at a time (row-major), each a step of stochastic beam
        search over the finer prefixes, which keeps an exact Gumbel-top-k sample of the prefixes at
        every variable, hence ``k`` distinct (prefix, joint value) extensions; ``κ`` and the
        prefix log-probability (the variables' log-probabilities summed) are those of the whole
        step. ``eos`` is refused with several variables.
        """
        support, lp, ext = self._extension_log_probs(distr, parent, beam_dim)
        n_batch = parent.log_prob.dim()  # beam + plate dimensions
        var_shape = tuple(lp.shape[n_batch:-1])
        if math.prod(var_shape) == 0:
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): the sequence step has batch shape "
                f"{tuple(distr.batch_shape)}, of which {var_shape} are not plates: no variable to sample. "
                "Remove the empty dimension."
            )
        ext = ext.reshape(tuple(ext.shape[:n_batch]) + (-1, ext.shape[-1]))  # (n, *B, D, V)
        alive = parent.alive if parent.alive is not None else parent.perturbed > -math.inf
        beam_log_p = torch.where(alive, parent.log_prob.detach(), torch.full_like(parent.perturbed, -math.inf))
        perturbed, kappa = parent.perturbed, parent.kappa
        parent_index: Optional[torch.Tensor] = None  # the previous step's beam of each current beam
        tokens = torch.zeros(tuple(ext.shape[:n_batch]) + (0,), dtype=torch.long, device=ext.device)
        for d in range(ext.shape[-2]):
            var_ext = ext[..., d, :] if parent_index is None else _take_beams(ext[..., d, :], parent_index)
            chosen, token, beam_log_p, perturbed, kappa = gumbel_top_k_step(
                beam_log_p, perturbed, var_ext, self.k, kappa
            )
            parent_index = chosen if parent_index is None else _take_beams(parent_index, chosen)
            tokens = torch.cat([_take_beams(tokens, chosen), token.unsqueeze(-1)], -1)
        assert parent_index is not None  # at least one variable
        token = tokens.reshape(tuple(tokens.shape[:n_batch]) + var_shape)
        log_prob, done = self._extend_prefixes(lp, parent, parent_index, token)
        alive = beam_log_p > -math.inf
        log_prob = torch.where(alive, log_prob, torch.zeros_like(log_prob))
        state = WORState(log_prob, perturbed, kappa, token, parent_index, done, alive)
        return support.values(token), state

    def weights(self, state: WORState) -> torch.Tensor:
        """The plate weight of each element: ``p(s)/q_κ(s)`` (divided by its sum if ``normalize``).

        Detached; ``0`` for elements of probability ``0``. ``(n, *B)``.
        """
        log_p = state.log_prob.detach()
        log_w = log_p - log_inclusion_probability(log_p, state.kappa.unsqueeze(0))
        alive = state.alive if state.alive is not None else state.perturbed > -math.inf
        w = torch.where(alive, log_w.exp(), torch.zeros_like(log_w))
        if self.normalize:
            w = w / w.sum(0, keepdim=True)
        return w

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalize={self.normalize}"


# ----------------------------------------------------------------------- sum and sample
def check_single_variable(owner: str, distr: Distribution, n_plates: int) -> None:
    """Raise unless ``distr`` is one discrete variable with enumerable support per plate element."""
    name = owner.split("(")[0]
    if not distr.has_enumerate_support:
        raise ValueError(
            f"{owner}: {type(distr).__name__} has no enumerable support. {name} sums over the "
            "most probable values of one discrete variable (Categorical, OneHotCategorical, Bernoulli, "
            "...); use ScoreFunction or Reparameterization for other distributions."
        )
    extra = tuple(distr.batch_shape)[n_plates:]
    if extra:
        raise ValueError(
            f"{owner}: {type(distr).__name__} has batch shape {tuple(distr.batch_shape)}, of which "
            f"{extra} are not plates: that is {extra} variables in one node. {name} handles "
            "one variable per plate element. Make independent elements a plate "
            "(storch.denote_independent(logits, dim, 'name')), sample each variable as its own node, "
            "or use ScoreFunction / Expect for the joint."
        )


class SumAndSampleRest(SamplingMethod):
    """The ``k − 1`` most probable values, then ``n_sampled`` samples of the remaining values.

    The proposal of `storch.method.RaoBlackwellSF` (Liu et al. 2019). With ``C`` the
    summed
    values and ``q = p(C)``,

        E_p[f] = Σ_{x ∈ C} p(x) f(x) + (1 − q) · E_{x ~ p(· | x ∉ C)}[f(x)],

    so the samples are weighted (detached) ``p(x)`` on ``C`` and, for i.i.d. samples of the rest,
    ``(1 − q)/n_sampled``. With ``without_replacement`` the ``n_sampled`` values of the rest are
    distinct, drawn by Gumbel-top-k, and weighted ``p(x)/q_κ(x)`` (priority sampling, Kool, van
    Hoof & Welling 2019; `storch.sampling.swor.log_inclusion_probability`): also
    unbiased, and exact when they
    are all the remaining values. One discrete variable with enumerable support per element of
    the distribution's plates.

    Args:
        plate_name: the node's plate.
        k: the number of values summed plus one (the plate holds ``k − 1 + n_sampled`` points).
        n_sampled: the number of samples drawn from the values outside the summed set.
        without_replacement: draw them distinct (at most the number of remaining values).

    Examples:
        >>> import torch
        >>> from torch.distributions import Categorical
        >>> SumAndSampleRest("z", 3).sample(Categorical(probs=torch.tensor([0.1, 0.5, 0.3, 0.1])), (), False)[:2]
        tensor([1, 2])
    """

    #: the class named in errors (this proposal is normally built by RaoBlackwellSF)
    _owner_name = "RaoBlackwellSF"

    def __init__(self, plate_name: str, k: int, n_sampled: int = 1, without_replacement: bool = False) -> None:
        super().__init__(plate_name)
        owner = f"{type(self).__name__}({plate_name!r})"
        self.k = check_count(k, "k", owner)
        self.n_sampled = check_count(n_sampled, "n_sampled", owner)
        self.without_replacement = bool(without_replacement)
        self.n_samples = self.k - 1 + self.n_sampled
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _too_few_values(self, n_values: int) -> str:
        """The advice when ``distr`` has fewer values than this proposal needs."""
        return f"use k <= {n_values}, or Expect to sum over all of them"

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        owner = f"{self._owner_name}({self.plate_name!r})"
        check_single_variable(owner, distr, len(plates))
        event = tuple(distr.event_shape)
        m = self.n_sampled
        with torch.no_grad():
            support = distr.enumerate_support(expand=False)  # (K, 1, ..., 1, *event)
            n_values = support.shape[0]
            n_rest = n_values - (self.k - 1)
            if n_rest < 1 or (self.without_replacement and m > n_rest):
                needs = f"{self.k - 1} + {m} distinct" if self.without_replacement else f"more than {self.k - 1}"
                raise ValueError(
                    f"{owner}: it sums the {self.k - 1} most probable values and samples the rest, which "
                    f"needs {needs} values, but {type(distr).__name__} has only {n_values} values; "
                    f"{self._too_few_values(n_values)}."
                )
            values = support.reshape((n_values,) + event)
            log_p = log_prob_of_own_samples(distr, support).detach()  # (K, *plates)
            log_p = log_p.movedim(0, -1)  # (*plates, K)
            summed = log_p.topk(self.k - 1, dim=-1).indices  # (*plates, k - 1)
            rest = log_p.scatter(-1, summed, float("-inf"))
            if self.without_replacement:
                sampled, log_w_rest = _distinct_from_rest(rest, m, n_rest)
            else:
                log_rest_mass = rest.logsumexp(-1)  # log(1 − q)
                # no mass left outside C (values of probability 0): draw any value; its weight is 0
                rest = torch.where(torch.isneginf(log_rest_mass).unsqueeze(-1), torch.zeros_like(rest), rest)
                sampled = Categorical(logits=rest, validate_args=False).sample((m,)).movedim(0, -1)  # (*plates, m)
                log_m = torch.log(torch.tensor(float(m), dtype=log_p.dtype, device=log_p.device))
                log_w_rest = (log_rest_mass - log_m).unsqueeze(-1).expand(sampled.shape)
            index = torch.cat([summed, sampled], -1)
            log_w = torch.cat([log_p.gather(-1, summed), log_w_rest], -1)
            index = index.movedim(-1, 0)  # (k − 1 + m, *plates)
            samples = values[index]
        self._pending = (samples, log_w.movedim(-1, 0).exp())
        return samples

    def weighting_function(self, tensor: "StochasticTensor", plate: Plate) -> Optional[torch.Tensor]:
        """``p(x)`` on the summed values and ``(1 − q)/n_sampled`` (i.i.d.) or ``p(x)/q_κ(x)``
        (without replacement) on the samples, detached."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not node_of(tensor).samples:
            raise RuntimeError(
                f"{self._owner_name}({self.plate_name!r}): weights are computed right after sampling; call "
                "the method on a distribution instead of using its sampling method directly."
            )
        return wrap_new(pending[1], layout_of(tensor))

    def reset(self) -> None:
        self._pending = None

    def extra_repr(self) -> str:
        wor = ", without_replacement=True" if self.without_replacement else ""
        return f"plate_name={self.plate_name!r}, k={self.k}, n_sampled={self.n_sampled}{wor}"


def _distinct_from_rest(rest: torch.Tensor, m: int, n_rest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``m`` distinct values of the unnormalised log-weights ``rest`` (``(*B, K)``, ``−∞`` on the
    summed values) by Gumbel-top-k, and their log-weights ``log p(x) − log q_κ(x)`` (``−∞`` for
    values of weight 0); ``κ`` is the ``(m+1)``-th largest perturbed value, ``−∞`` when the ``m``
    values are all ``n_rest`` remaining ones (the weights are then ``p(x)``: exact)."""
    perturbed = rest + _gumbel_like(rest)
    top = perturbed.topk(min(m + 1, n_rest), dim=-1)
    chosen = top.indices[..., :m]
    if m < n_rest:
        kappa = top.values[..., m]
    else:
        kappa = torch.full(rest.shape[:-1], -math.inf, dtype=rest.dtype, device=rest.device)
    log_p = rest.gather(-1, chosen)
    finite = torch.isfinite(log_p)
    safe = torch.where(finite, log_p, torch.zeros_like(log_p))
    log_w = safe - log_inclusion_probability(safe, kappa.unsqueeze(-1))
    return chosen, torch.where(finite, log_w, torch.full_like(log_w, -math.inf))


class SumAndSample(SumAndSampleRest):
    """The manual's ``SumAndSample``: sum the ``sum_size`` most probable values exactly and sample
    ``sample_size`` of the others, weighted so that the estimate is unbiased.

    Storchastic 0.3.7's constructor for `storch.sampling.swor.SumAndSampleRest` (the same
    proposal, with
    ``k = sum_size + 1`` and ``n_sampled = sample_size``): one discrete variable with enumerable
    support per element of the distribution's plates. Use it as the proposal of a score-function
    estimator, ``ScoreFunction("z", sampling_method=SumAndSample("z", 2, 3))``, or use
    `storch.method.RaoBlackwellSF`, which builds it.

    Args:
        plate_name: the node's plate.
        sum_size: how many of the most probable values are summed (at least 1).
        sample_size: how many values outside them are sampled (at least 1).
        without_replacement: draw the samples distinct (Gumbel-top-k, weights ``p(x)/q_κ(x)``)
            instead of i.i.d. (weights ``(1 − p(summed))/sample_size``).
        eos: must be ``None``: sequences are decoded by
            `storch.method.score_function_wor.ScoreFunctionWOR`
            and `storch.method.UnorderedSetEstimator`, not by this proposal.

    Examples:
        >>> import torch
        >>> from torch.distributions import Categorical
        >>> s = SumAndSample("z", 2, 2, without_replacement=True)
        >>> x = s.sample(Categorical(probs=torch.tensor([0.1, 0.5, 0.3, 0.1])), (), False)
        >>> x[:2].tolist(), sorted(x[2:].tolist()), s.sum_size, s.sample_size
        ([1, 2], [0, 3], 2, 2)
    """

    _owner_name = "SumAndSample"

    def __init__(
        self,
        plate_name: str,
        sum_size: int,
        sample_size: int = 1,
        without_replacement: bool = False,
        eos: Optional[int] = None,
    ) -> None:
        owner = f"SumAndSample({plate_name!r})"
        sum_size = check_count(sum_size, "sum_size", owner)
        sample_size = check_count(sample_size, "sample_size", owner)
        if eos is not None:
            raise ValueError(
                f"{owner}: eos={eos!r} is for sequences, which this proposal does not decode (it sums and "
                "samples one variable per plate element). Decode sequences with "
                "storch.method.score_function_wor.ScoreFunctionWOR or storch.method.UnorderedSetEstimator."
            )
        super().__init__(plate_name, sum_size + 1, sample_size, without_replacement)

    @property
    def sum_size(self) -> int:
        """The number of values summed exactly (``k − 1``)."""
        return self.k - 1

    @property
    def sample_size(self) -> int:
        """The number of values sampled outside them (``n_sampled``)."""
        return self.n_sampled

    def _too_few_values(self, n_values: int) -> str:
        limit = n_values - (self.sample_size if self.without_replacement else 1)
        return f"use sum_size <= {limit}, or Expect to sum over all of them"

    def extra_repr(self) -> str:
        wor = ", without_replacement=True" if self.without_replacement else ""
        return f"plate_name={self.plate_name!r}, sum_size={self.sum_size}, sample_size={self.sample_size}{wor}"


def _take_beams(t: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` (``(n, *B, *rest)``) selected per batch element by ``parent`` (``(n', *B)``)."""
    idx = parent.reshape(tuple(parent.shape) + (1,) * (t.dim() - parent.dim()))
    return torch.take_along_dim(t, idx, 0)
