"""Importance sampling: draw the samples of a node from a proposal ``r`` instead of its distribution ``p``.

    E_p[f(x)] = E_{x ~ r}[ p(x)/r(x) · f(x) ]

Components (Storchastic, §3, the "importance sampling" row): ``n`` i.i.d. samples of ``r``, weight
``w(x) = p(x) / (n r(x))``, **detached**, and gradient function ``l(x) = log p(x)`` (the score of the
*target*, which `storch.method.ScoreFunction` supplies). For every order ``k`` and
every ``g``,
``E_r[Σ_x w(x) ∇ᵏ(□(log p(x)) g(x))] = Σ_x p(x) ∇ᵏ(□(log p(x)) g(x)) = ∇ᵏ E_p[g]``, so derivatives
of every order are unbiased (also with a baseline that does not depend on the sample it multiplies,
such as ``batch_average`` or ``moving_average``). ``r`` must cover the support of ``p`` where
``f ≠ 0``: values that ``r`` never proposes are missed, a bias this method cannot see.

``r`` may depend on parameters (e.g. a tempered copy of ``p``); no gradient flows through it, since
the weights are detached and the samples are drawn with ``sample``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch
from torch.distributions import Distribution

from storch.extend import Plate, layout_of, log_prob_of_own_samples, node_of, wrap_new
from storch.sampling.method import SamplingMethod, check_count

if TYPE_CHECKING:  # pragma: no cover
    from storch.extend import StochasticTensor

__all__ = ["ImportanceSampling"]

Proposal = Union[Distribution, Callable[[Distribution], Distribution]]


def _sum_to(t: torch.Tensor, n_dims: int) -> torch.Tensor:
    """Sum ``t`` over its dimensions after the first ``n_dims`` (event and non-plate batch dims)."""
    extra = tuple(range(n_dims, t.dim()))
    return t.sum(extra) if extra else t


class ImportanceSampling(SamplingMethod):
    """``n`` samples of a proposal ``r``, weighted by ``p(x) / (n r(x))`` (detached).

    Use it as the proposal of a score-function estimator, which supplies the gradient function
    ``log p(x)``: ``ScoreFunction("z", sampling_method=ImportanceSampling("z", 8, r))``.

    Args:
        plate_name: the name of the node's plate (the same as the method's).
        n_samples: the number of samples ``n``.
        proposal: the proposal ``r``: a distribution, or a function that maps the node's
            distribution ``p`` to one (called with storch dispatch off, so it sees plain tensors;
            e.g. ``lambda p: OneHotCategorical(logits=p.logits / 2)``). Its batch shape must
            broadcast to that of ``p`` and its event shape must equal that of ``p``.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> from storch.method import ScoreFunction
        >>> _ = torch.manual_seed(0)
        >>> theta = torch.zeros(3, requires_grad=True)          # p uniform
        >>> r = OneHotCategorical(probs=torch.tensor([0.5, 0.25, 0.25]))
        >>> z = ScoreFunction("z", sampling_method=ImportanceSampling("z", 1000, r))(
        ...     OneHotCategorical(logits=theta))
        >>> w = z.plate.weight.plain()    # one weight p(x)/(n r(x)) per sample
        >>> w.shape, bool(torch.allclose(w, (1 / 3) / (1000 * r.probs[z.plain().argmax(-1)])))
        (torch.Size([1000]), True)
        >>> storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0])).sum(-1), "f")
        >>> _ = storch.backward()   # exact: ∂/∂θ Σ_k π_k v_k = π (v − πᵀv) = [−1/3, 0, 1/3]
        >>> theta.grad.shape, bool(torch.allclose(theta.grad, torch.tensor([-1 / 3, 0.0, 1 / 3]), atol=0.1))
        (torch.Size([3]), True)
    """

    def __init__(self, plate_name: str, n_samples: int, proposal: Proposal) -> None:
        super().__init__(plate_name)
        n_samples = check_count(n_samples, "n_samples", f"ImportanceSampling({plate_name!r})")
        if not (isinstance(proposal, Distribution) or callable(proposal)):
            raise TypeError(
                f"ImportanceSampling({plate_name!r}): the proposal must be a torch Distribution or a "
                f"function from the node's distribution to one, got {type(proposal).__name__}."
            )
        self.n_samples = n_samples
        self.proposal = proposal
        # the log-weights of the samples just drawn, until the method asks for them (same call)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _proposal_for(self, distr: Distribution) -> Distribution:
        r = self.proposal if isinstance(self.proposal, Distribution) else self.proposal(distr)
        if not isinstance(r, Distribution):
            raise TypeError(
                f"ImportanceSampling({self.plate_name!r}): the proposal function returned "
                f"{type(r).__name__}, not a torch Distribution."
            )
        if tuple(r.event_shape) != tuple(distr.event_shape):
            raise ValueError(
                f"ImportanceSampling({self.plate_name!r}): the proposal {type(r).__name__} has event "
                f"shape {tuple(r.event_shape)}, the target {type(distr).__name__} has "
                f"{tuple(distr.event_shape)}; they must be equal (e.g. use OneHotCategorical for both)."
            )
        if tuple(r.batch_shape) != tuple(distr.batch_shape):
            try:
                r = r.expand(distr.batch_shape)
            except (RuntimeError, ValueError, NotImplementedError) as e:
                raise ValueError(
                    f"ImportanceSampling({self.plate_name!r}): the proposal's batch shape "
                    f"{tuple(r.batch_shape)} does not broadcast to the target's batch shape "
                    f"{tuple(distr.batch_shape)} (plates included): {e}"
                ) from e
        return r

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        if requires_grad:
            raise ValueError(
                f"ImportanceSampling({self.plate_name!r}) draws samples of the proposal, which carry no "
                "pathwise gradient of the target; use it with a score-function estimator, e.g. "
                f"ScoreFunction({self.plate_name!r}, sampling_method=ImportanceSampling(...))."
            )
        r = self._proposal_for(distr)
        with torch.no_grad():
            samples = r.sample((self.n_samples,))
            n_dims = 1 + len(plates)  # the new plate and the parents' plates; sum the rest
            log_p = _sum_to(log_prob_of_own_samples(distr, samples), n_dims).detach()
            log_r = _sum_to(r.log_prob(samples), n_dims)
        if log_p.device.type != "meta" and bool(torch.isneginf(log_p).any()):  # meta: no values to check
            raise ValueError(
                f"ImportanceSampling({self.plate_name!r}): the proposal drew a value that has "
                f"probability 0 under the target {type(distr).__name__}; its score log p(x) is "
                "-inf. Use a proposal whose support lies inside the target's."
            )
        self._pending = (samples, log_p - log_r - torch.log(torch.tensor(float(self.n_samples), dtype=log_p.dtype, device=log_p.device)))
        return samples

    def weighting_function(self, tensor: "StochasticTensor", plate: Plate) -> Optional[torch.Tensor]:
        """The detached importance weights ``p(x) / (n r(x))``, one per sample and per parent plate."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not node_of(tensor).samples:
            raise RuntimeError(
                f"ImportanceSampling({self.plate_name!r}): weights are computed right after sampling; "
                "call the method on a distribution instead of using the sampling method directly."
            )
        return wrap_new(pending[1].exp(), layout_of(tensor))

    def reset(self) -> None:
        self._pending = None

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}"
