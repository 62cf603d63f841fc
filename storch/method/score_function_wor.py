"""REINFORCE without replacement (Kool, van Hoof & Welling 2019, ICML; Kool et al. 2019/2020).

Sample a set ``S`` of ``k`` distinct values (or sequences) by Gumbel-top-k / stochastic beam search
(`storch.sampling.swor.SampleWithoutReplacement`), with ``κ`` the
``(k+1)``-th largest perturbed
log-probability and ``q_κ(s) = 1 − exp(−exp(log p(s) − κ))``:

    unbiased (``biased=False``):  ∇ E_p[f] ≈ Σ_{s∈S} p(s)/q_κ(s) · f(s) ∇log p(s)
    normalised (``biased=True``): ∇ E_p[f] ≈ Σ_{s∈S} p(s)/(q_κ(s) W) · (f(s) − B) ∇log p(s),
                                  W = Σ_{s∈S} p(s)/q_κ(s),  B = Σ_{s∈S} p(s)/(q_κ(s) W) · f(s)

Components: proposal Gumbel-top-k; weight ``p(s)/q_κ(s)`` (detached; divided by ``W`` when biased);
gradient function ``log p(s)``; control variate ``B`` (the built-in baseline, biased variant only).
The unbiased variant is unbiased for derivatives of every order (the weights are importance weights
that do not depend on the parameters being differentiated); the normalised one is consistent (its
bias vanishes as ``k`` grows, and it is exact once ``k`` covers the support) and has lower variance.

Baselines (``baseline_factory``). A baseline ``b`` that does not depend on the sample set ``S``
keeps the unbiased variant unbiased:

    Σ_{s∈S} p(s)/q_κ(s) · (f(s) − b) ∇log p(s),   E_S[Σ_{s∈S} p(s)/q_κ(s) ∇log p(s)] = ∇Σ_s p(s) = 0,

so ``"moving_average"`` (the average of earlier steps' costs) applies, and so does any
`storch.method.baseline.Baseline` computed from neither the sampled
sequences nor their prefixes (e.g. from the data). The leave-one-out ``"batch_average"`` is computed
from the other elements of ``S``, which depend on ``s`` (they are drawn without it): refused, as the
normalised variant has its built-in baseline ``B`` and
`storch.method.UnorderedSetEstimator` an unbiased leave-one-out
baseline for sets without replacement. With the i.i.d. proposal
`storch.sampling.decoding.MCDecoder` the estimator is the plain
score function over ``k`` independent sequences, and ``"batch_average"`` is unbiased too (Kool et al.
2019, "Buy 4 REINFORCE samples, get a baseline for free!"). A critic of the node's distribution
parameters is refused for both: at a decoding step they are computed from the earlier tokens of the
same sequence, and the gradient function is the log-probability of the whole prefix.

Sequences. Call the same method object once per decoding step. At step ``t`` the distribution is
built from tensors that carry the plate of step ``t − 1`` (same name); the method extends the ``k``
prefixes by stochastic beam search (the ``k`` best of the ``k·V`` extensions) and returns the tokens
of step ``t`` with a new plate of the same name (an `storch.plate.AncestralPlate`).
Tensors
of earlier steps (tokens, recurrent states) are re-indexed along the beams' ancestry whenever they
meet tensors of later steps. A finished prefix (last token ``eos``) continues with ``eos`` with
probability 1. Step ``t``'s weights and gradient function use the log-probability of the whole
prefix ``log p(x_{≤t}) = Σ_{s≤t} log p(x_s | x_{<s})`` and step ``t``'s ``κ``; a cost registered at
step ``t`` (carrying step ``t``'s plate) is estimated with those prefixes, which are a sample
without replacement of prefixes of length ``t``. With
`storch.sampling.decoding.MCDecoder`
as the proposal the same method is the plain score function over i.i.d. sequences.

Several variables per step. When step ``t``'s distribution has batch dimensions beyond its plates
(e.g. batch shape ``(k, 2)``: two categorical variables per beam), they are one token whose value
is the tuple of the variables' values, with ``log p(x_t | x_{<t})`` the sum over the variables.
The ``k`` beams are ``k`` distinct (prefix, tuple) sequences, drawn by stochastic beam search that
adds the variables one at a time (an exact Gumbel-top-k sample over the product space, without
enumerating it), and the weights use the whole step's ``κ``: the estimator is unbiased as for one
variable per step. ``eos`` is refused for such steps (they have no single token to compare with
it). Storchastic 0.3.7 (``IterDecoding.decode``) also decodes the variables of such a step
jointly, by stochastic beam search over them one after the other (row-major, as here), not as
independent beams per variable; it compared each variable with ``eos`` separately, which storch
refuses.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributions import Distribution

from storch.method.baseline import Baseline, BaselineFactory, UpdatesItsBaseline, make_baseline
from storch.method.critic import Critic
from storch.method.method import Method, check_floating_parameters
from storch.extend import (
    AncestralPlate,
    CostTensor,
    PlateLayout,
    StochasticTensor,
    align_to,
    distribution_layout,
    layout_of,
    layout_of_plates,
    new_node,
    no_dispatch,
    reduce_plate,
    wrap,
)
from storch.sampling.method import check_count
from storch.sampling.swor import SampleWithoutReplacement, SequenceSampler, WORState, wor_support

__all__ = ["ScoreFunctionWOR"]


def _to_layout(t: torch.Tensor, plates, layout: PlateLayout) -> torch.Tensor:
    """Plain ``t`` with leading ``plates`` laid out (expanded) as ``layout``."""
    if not layout.plates:
        return t
    return align_to(wrap(t, layout_of_plates(tuple(plates))), layout, expand=True)


def _baseline_refusal(baseline: Baseline, sampler: SequenceSampler, biased: bool) -> Optional[str]:
    """Why ``baseline`` would bias (or has no place in) the estimator, or ``None`` if it applies."""
    name = type(baseline).__name__
    if biased:
        return (
            "biased=True normalises the weights and subtracts its built-in baseline (the weighted mean "
            "cost of the same samples), so it takes no other. Pass baseline_factory with biased=False "
            "(the unbiased estimator, which accepts 'moving_average'), or with "
            "sampling_method=MCDecoder(...) (i.i.d. sequences, which also accept 'batch_average')"
        )
    if baseline.needs_correction:
        return (
            f"the {name} baseline depends on the node's own sample and corrects for it with an "
            "expectation over this step's token, but the gradient function of a sequence step is the "
            "log-probability of the whole prefix, which that correction does not cover. Use "
            "'moving_average'"
        )
    if isinstance(baseline, Critic):
        return (
            f"the {name} baseline is a function of the node's distribution parameters, which at a "
            "decoding step are computed from the earlier tokens of the same sequence, while the gradient "
            "function is the log-probability of the whole prefix: a baseline that depends on those "
            "tokens biases the estimate. Use 'moving_average', or a Baseline computed from neither the "
            "sampled sequences nor their prefixes (e.g. from the data)"
        )
    if baseline.uses_other_samples and not sampler.independent_samples:
        return (
            f"the {name} baseline (leave-one-out) averages the costs of the other samples, but "
            f"{type(sampler).__name__} draws the k samples without replacement, so the others depend on "
            "each sample and the baseline would bias the unbiased estimator. Use "
            "baseline_factory='moving_average' (it does not depend on the current samples), biased=True "
            "(normalised weights with a built-in baseline; consistent), UnorderedSetEstimator (unbiased, "
            "with a built-in leave-one-out baseline for sets without replacement), or "
            "sampling_method=MCDecoder(...) for i.i.d. sequences, where 'batch_average' applies"
        )
    return None


def _to_beams(t: torch.Tensor, src: PlateLayout, parents: PlateLayout, beam_dim: int) -> torch.Tensor:
    """A tensor of the previous step (layout ``src``) laid out as ``parents``, beam dimension first."""
    return align_to(wrap(t, src), parents, expand=True).movedim(beam_dim, 0)


class ScoreFunctionWOR(UpdatesItsBaseline, Method):
    """The score function with samples without replacement and importance weights ``p(s)/q_κ(s)``.

    Args:
        plate_name: node / plate name.
        k: the number of distinct samples (beam size for sequences).
        biased: normalise the weights by their sum and subtract the built-in baseline (consistent,
            lower variance); ``False`` (default) keeps the unbiased, unnormalised weights.
        eos: the end-of-sequence value index, for sequences decoded step by step.
        use_baseline: subtract the built-in baseline ``B`` (Storchastic's keyword). Only the
            normalised estimator has one: ``None`` (default) means ``biased``; ``False`` with
            ``biased=True`` keeps the normalised weights without ``B``; ``True`` with
            ``biased=False`` is refused, since ``B`` is computed from the same samples and would bias
            the unbiased estimator (for an unbiased estimator with a built-in baseline use
            `storch.method.UnorderedSetEstimator`). Note that Storchastic's
            default was ``biased=True``; storch's is ``False``.
        sampling_method: a `storch.sampling.swor.SequenceSampler` to use
            instead of the
            default `storch.method.score_function_wor.SampleWithoutReplacement` (a
            subclass, or
            `storch.sampling.decoding.MCDecoder` for i.i.d. sequences).
        baseline_factory: a baseline ``b``, as for `storch.method.ScoreFunction`:
            ``None`` (default), ``"moving_average"``, ``"batch_average"``, a
            `storch.method.baseline.Baseline` or a zero-argument
            callable returning one; the gradient becomes ``Σ_S w(s) (f(s) − b) ∇log p(s)``. Only
            baselines that keep the estimator unbiased are accepted (see the module docstring):
            with ``biased=False``, ``"moving_average"`` and baselines independent of the sampled
            sequences; with ``MCDecoder`` also ``"batch_average"`` (leave-one-out, ``k ≥ 2``).
            Refused with ``biased=True`` (it has its built-in baseline) and, for sets without
            replacement, ``"batch_average"``; ``"critic"`` and ``"q_critic"`` always (with the
            reason).

    The ``distribution`` of a sequence step's node has the previous step's beams as batch
    dimension; the step's own log-probabilities are in ``sampling_method.state_of(tensor)``. A step
    may hold several variables per beam (batch dimensions that are not plates): they are sampled
    jointly, as one token (see the module docstring); ``eos`` then is refused.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> theta = torch.zeros(5, requires_grad=True)
        >>> z = ScoreFunctionWOR("z", k=3)(OneHotCategorical(logits=theta))
        >>> z.shape, int(z.plain().sum(0).max())     # 3 distinct one-hot values
        (torch.Size([3, 5]), 1)
        >>> storch.add_cost((z * torch.arange(5.0)).sum(-1), "f")
        >>> _ = storch.backward()
        >>> theta.grad.shape
        torch.Size([5])

        A sequence of three tokens from {0, 1, 2} and EOS = 3, decoded with a beam of 4:

        >>> emb = torch.randn(4, 4, requires_grad=True)
        >>> method = ScoreFunctionWOR("seq", k=4, eos=3)
        >>> x = method(OneHotCategorical(logits=emb[0]))
        >>> tokens = [x]
        >>> for t in range(2):
        ...     x = method(OneHotCategorical(logits=x @ emb))   # logits from the previous token
        ...     tokens.append(x)
        >>> seq = torch.stack(tokens, -2)          # earlier steps re-indexed to the last beams
        >>> seq.plates[0] is x.plates[0], tuple(seq.shape)
        (True, (4, 3, 4))
        >>> storch.add_cost((seq.argmax(-1) == 1).float().sum(-1), "ones")
        >>> _ = storch.backward()

        A policy with a reward at the end: i.i.d. sequences with the leave-one-out baseline, or
        the unbiased estimator without replacement with a moving average.

        >>> from storch.sampling import MCDecoder
        >>> iid = ScoreFunctionWOR("seq", k=4, sampling_method=MCDecoder("seq", 4),
        ...                        baseline_factory="batch_average")
        >>> wor = ScoreFunctionWOR("seq", k=4, baseline_factory="moving_average")
        >>> ScoreFunctionWOR("seq", k=4, baseline_factory="batch_average")
        Traceback (most recent call last):
        ...
        ValueError: ScoreFunctionWOR('seq'): baseline_factory='batch_average' does not apply: ... (leave-one-out) ...
    """

    def __init__(
        self,
        plate_name: str,
        k: int,
        biased: bool = False,
        eos: Optional[int] = None,
        sampling_method: Optional[SequenceSampler] = None,
        use_baseline: Optional[bool] = None,
        baseline_factory: BaselineFactory = None,
    ) -> None:
        k = check_count(k, "k", f"{type(self).__name__}({plate_name!r})")
        if use_baseline and not biased:
            raise ValueError(
                f"{type(self).__name__}({plate_name!r}): use_baseline=True needs biased=True. The built-in "
                "baseline is computed from the same k samples, so subtracting it from the unbiased "
                "(unnormalised) estimator would bias it. Pass biased=True (Storchastic's default) for the "
                "normalised estimator with its baseline, or use UnorderedSetEstimator for an unbiased "
                "estimator with a built-in baseline."
            )
        if sampling_method is None:
            sampling_method = SampleWithoutReplacement(plate_name, k, normalize=biased, eos=eos)
        elif not isinstance(sampling_method, SequenceSampler):
            raise TypeError(
                f"ScoreFunctionWOR({plate_name!r}): sampling_method must be a SequenceSampler (e.g. "
                f"SampleWithoutReplacement or MCDecoder), "
                f"got {type(sampling_method).__name__}."
            )
        super().__init__(plate_name, sampling_method)
        self.k = k
        self.biased = bool(biased)
        self.use_baseline = self.biased if use_baseline is None else bool(use_baseline)
        self.baseline = self._make_baseline(baseline_factory)

    def _make_baseline(self, factory: BaselineFactory) -> Optional[Baseline]:
        """The baseline of ``baseline_factory``, refused (with the reason) where it would bias the estimate."""
        baseline = make_baseline(factory)
        if baseline is None:
            return None
        sampler: SequenceSampler = self.sampling_method  # type: ignore[assignment]
        reason = _baseline_refusal(baseline, sampler, self.biased)
        if reason is not None:
            given = repr(factory) if isinstance(factory, str) else type(baseline).__name__
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): baseline_factory={given} does not apply: {reason}."
            )
        if baseline.uses_other_samples:
            baseline.check_samples(self.k, self.plate_name)
        return baseline

    def check_distribution(self, distr: Distribution) -> None:
        wor_support(distr)  # raises a clear error for distributions without a finite support

    # ------------------------------------------------------------------ sampling
    def forward(self, distr: Distribution) -> StochasticTensor:
        if not isinstance(distr, Distribution):
            return super().forward(distr)  # raises the common error
        check_floating_parameters(distr, type(self).__name__, self.plate_name)
        self.check_distribution(distr)
        parents = distribution_layout(distr)
        sampler: SequenceSampler = self.sampling_method  # type: ignore[assignment]
        if self.plate_name in parents.names:
            return self._next_step(distr, parents)
        with no_dispatch():
            samples, state = sampler.draw(distr, len(parents.plates))
        self._check_samples(distr, samples, parents.sizes)
        plate = AncestralPlate(self.plate_name, samples.shape[0], parents=parents.plates, info=state)
        return self._make_node(distr, samples, plate, parents.plates)

    def _next_step(self, distr: Distribution, parents: PlateLayout) -> StochasticTensor:
        """Extend the sequences of the previous step (the plate named like this node in ``distr``)."""
        beam_dim = parents.names.index(self.plate_name)
        ancestor = parents.plates[beam_dim]
        if not (isinstance(ancestor, AncestralPlate) and isinstance(ancestor.info, WORState)):
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): the distribution's parameters already carry "
                f"a plate named {self.plate_name!r} that is not an earlier step of a sequence sampled "
                "without replacement. Give this node another name."
            )
        others = tuple(p for p in parents.plates if p is not ancestor)
        support = wor_support(distr)
        if tuple(support.log_probs.shape[: len(parents.sizes)]) != parents.sizes:
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): the distribution of a sequence step has batch "
                f"shape {tuple(distr.batch_shape)}, which does not start with the sizes {parents.sizes} of "
                f"its plates {list(parents.names)}. Build its parameters from tensors that carry the "
                "previous step's plate (and let storch broadcast them) instead of reshaping them by hand."
            )
        parent = ancestor.info
        parent_layout = ancestor.node.layout if ancestor.node is not None else layout_of_plates((ancestor,))
        missing = [p.name for p in parent_layout.plates[1:] if p.name not in parents.names]
        if missing:
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): the previous step depends on plates "
                f"{missing}, which the distribution of this step has lost (were they reduced?). Keep "
                "them on the tensors the decoder uses."
            )
        others_layout = layout_of_plates(others)
        with no_dispatch():
            aligned = WORState(
                log_prob=_to_beams(parent.log_prob, parent_layout, parents, beam_dim),
                perturbed=_to_beams(parent.perturbed, parent_layout, parents, beam_dim),
                kappa=_to_layout(parent.kappa, parent_layout.plates[1:], others_layout),
                tokens=parent.tokens,
                finished=(
                    None if parent.finished is None
                    else _to_beams(parent.finished, parent_layout, parents, beam_dim)
                ),
                alive=None if parent.alive is None else _to_beams(parent.alive, parent_layout, parents, beam_dim),
            )
            samples, state = self.sampling_method.extend(distr, aligned, beam_dim)  # type: ignore[attr-defined]
        plate = AncestralPlate(
            self.plate_name, samples.shape[0], parents=parents.plates, ancestor=ancestor,
            parent_index=state.parent_index, index_plates=others, info=state,
        )
        return self._make_node(distr, samples, plate, others)

    def _make_node(
        self, distr: Distribution, samples: torch.Tensor, plate: AncestralPlate, others: tuple
    ) -> StochasticTensor:
        tensor = new_node(self, distr, samples, plate, others)
        weight = self.sampling_method.weighting_function(tensor, plate)
        if weight is not None:
            plate.weight = weight
        return tensor

    # ------------------------------------------------------------------ estimator
    def gradient_function(self, tensor: StochasticTensor) -> Optional[torch.Tensor]:
        """``log p(s)``: of the whole value (all variables), or of the prefix up to this step."""
        state: WORState = self.sampling_method.state_of(tensor)  # type: ignore[attr-defined]
        return wrap(state.log_prob, layout_of(tensor))

    def control_variate(self, tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        """The ``baseline_factory``'s baseline, or the built-in ``B = Σ_S w̄(s) f(s)`` (normalised
        weights, biased variant only)."""
        if self.baseline is not None:
            return self.baseline.compute_baseline(tensor, cost)
        if not self.use_baseline:
            return None
        return reduce_plate(cost.detach(), tensor.plate, detach_weights=True)

    def extra_repr(self) -> str:
        extra = "" if self.use_baseline == self.biased else f", use_baseline={self.use_baseline}"
        return f"plate_name={self.plate_name!r}, k={self.k}, biased={self.biased}{extra}"
