"""Sampling methods: the *proposal* component of a gradient estimator.

A `storch.sampling.method.SamplingMethod` turns a distribution into a set of samples (the node's
plate) and, through
`storch.sampling.method.SamplingMethod.weighting_function`, gives each sample its
weight in the surrogate loss
(``1/n`` for Monte Carlo, ``p(x)`` for enumeration, importance weights for other proposals).

Samples are plain tensors with the new sample dimension first, followed by the plates of the
distribution's parameters, its remaining batch dimensions and its event dimensions. The calling
`storch.method.Method` wraps them into a `storch.StochasticTensor`.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributions import Distribution

from storch.extend import DeclaresStepState, Plate, StepState

if TYPE_CHECKING:  # pragma: no cover
    from storch.extend import StochasticTensor
    from storch.method.method import Method

__all__ = ["SamplingMethod", "MonteCarlo", "check_count"]

SampleFn = Callable[[Distribution, Sequence[Plate], int], torch.Tensor]
WeightFn = Callable[["StochasticTensor", Plate], Optional[torch.Tensor]]


def describe_argument(value: Any) -> str:
    """``value`` for an error message: a short one-line repr and its type, e.g. ``2.5 (float)``."""
    if isinstance(value, nn.Module):
        text = f"a {type(value).__name__} module"
    else:
        text = " ".join(repr(value).split())
        if len(text) > 60:
            text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def check_count(value: Any, name: str, owner: str, minimum: int = 1) -> int:
    """``value`` as a Python ``int`` of at least ``minimum``, for sample counts and the like.

    Every method and sampler checks its counts (``n_samples``, ``k``, ``budget``, ...) here, so a
    count is never silently truncated (``int(2.5) == 2``). Integers and integer-like values
    (``operator.index``: NumPy integers, 0-dim integer tensors) are accepted; floats (also ``2.0``),
    ``bool``, strings and ``None`` are a `TypeError`, too small values a `ValueError`.
    Both name ``owner`` (e.g. ``"ScoreFunction('z')"``) and the argument.

    Examples:
        >>> check_count(3, "n_samples", "ScoreFunction('z')")
        3
        >>> check_count(2.5, "n_samples", "ScoreFunction('z')")
        Traceback (most recent call last):
        ...
        TypeError: ScoreFunction('z'): n_samples must be a positive int, got 2.5 (float).
    """
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool") or (
        isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim() != 0)
    ):
        raise TypeError(f"{owner}: {name} must be {kind}, got {describe_argument(value)}.")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be {kind}, got {describe_argument(value)}.") from None
    if count < minimum:
        raise ValueError(f"{owner}: {name} must be at least {minimum}, got {count}.")
    return count


class SamplingMethod(nn.Module, DeclaresStepState, ABC):
    """Base class of proposals. Subclasses implement `storch.sampling.method.SamplingMethod.sample`.

    Hooks:
        * `storch.sampling.method.SamplingMethod.sample` — draw the sample set;
        * `storch.sampling.method.SamplingMethod.weighting_function` — weight of each sample
        (``None``: uniform ``1/n``);
        * `storch.sampling.method.SamplingMethod.delegate` — the estimator that owns this proposal (set by
          `storch.method.Method`); plain Monte Carlo draws and weights come from its
          ``proposal_dist`` and ``weighting_function`` (e.g. ``rsample`` instead of ``sample``), so
          estimators and proposals combine freely;
        * `storch.sampling.method.SamplingMethod.set_mc_sample`,
        `storch.sampling.method.SamplingMethod.set_mc_weighting_function` — replace those
        two functions
          explicitly (the manual's hooks; they take precedence over the delegate);
        * `storch.sampling.method.SamplingMethod.update_parameters` — called once after every
        `storch.backward`;
        * `storch.sampling.method.SamplingMethod.reset` — forget any state.

    Examples:
        A proposal that always draws the most probable value of a Bernoulli (a deterministic,
        biased proposal, for illustration), used by the score function:

        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> class Mode(SamplingMethod):
        ...     def sample(self, distr, plates, requires_grad):
        ...         return (distr.probs > 0.5).to(distr.probs.dtype).unsqueeze(0)   # (1, *batch)
        >>> probs = torch.tensor([0.2, 0.9])
        >>> x = storch.method.ScoreFunction("x", sampling_method=Mode("x"))(Bernoulli(probs))
        >>> x.plain().tolist(), x.plates[0].weight.item()
        ([[0.0, 1.0]], 1.0)
        >>> storch.reset()
    """

    #: the number of samples drawn, where it is fixed in advance (subclasses set it; 1 otherwise,
    #: e.g. for enumeration, whose number depends on the distribution)
    n_samples: int = 1
    #: what the proposal keeps between steps (see `storch.state`): nothing. A subclass that
    #: overrides `storch.sampling.method.SamplingMethod.update_parameters` declares its
    #: own ``step_state`` in the same class body, or counts as keeping ``HOST`` state
    step_state = StepState.NONE
    state_hooks = ("update_parameters",)

    def __init__(self, plate_name: str) -> None:
        super().__init__()
        self.plate_name = plate_name
        self.mc_sample: SampleFn | None = None
        self.mc_weighting_function: WeightFn | None = None
        self.set_delegate(None)

    @property
    def delegate(self) -> Optional["Method"]:
        """The estimator whose ``proposal_dist`` and ``weighting_function`` define plain Monte Carlo
        draws and weights (``None``: ``sample``/``rsample`` and uniform weights)."""
        return self.__dict__.get("_delegate")

    def set_delegate(self, method: Optional["Method"]) -> "SamplingMethod":
        """Make ``method`` the `storch.sampling.method.SamplingMethod.delegate` of this proposal (done by
        ``Method.__init__``).

        The estimator is held as a plain reference, not registered as a submodule: the estimator
        owns its proposal, so registering it back would make the module tree a cycle.
        """
        self.__dict__["_delegate"] = method
        return self

    def forward(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        return self.sample(distr, plates, requires_grad)

    @abstractmethod
    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        """Draw the sample set: a plain tensor ``(n, *distr.batch_shape, *distr.event_shape)``.

        Args:
            distr: the distribution (called with storch dispatch disabled: parameters are plain).
            plates: the plates of the distribution's parameters (the leading batch dimensions).
            requires_grad: whether the estimator needs pathwise (reparameterised) samples.
        """

    def weighting_function(self, tensor: "StochasticTensor", plate: Plate) -> Optional[torch.Tensor]:
        """Weight of each sample in ``tensor``'s plate, or ``None`` for i.i.d. samples (``1/n``).

        A returned tensor is either a scalar, a vector over the plate, or a storch tensor whose
        plates include ``plate``.
        """
        if self.mc_weighting_function is not None:
            return self.mc_weighting_function(tensor, plate)
        if self.delegate is not None:
            return self.delegate.weighting_function(tensor.distribution, plate.size)
        return None

    def set_mc_sample(self, new_sample_func: SampleFn) -> "SamplingMethod":
        """Replace how Monte Carlo samples are drawn: ``fn(distr, plates, amt_samples) -> samples``."""
        self.mc_sample = new_sample_func
        return self

    def set_mc_weighting_function(self, new_weighting_func: WeightFn) -> "SamplingMethod":
        """Replace how Monte Carlo samples are weighted: ``fn(tensor, plate) -> weights | None``."""
        self.mc_weighting_function = new_weighting_func
        return self

    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        """Called after each `storch.backward` with ``(node, cost, contribution)`` triples."""

    def reset(self) -> None:
        """Forget any state kept between samples."""


class MonteCarlo(SamplingMethod):
    """``n`` independent samples, each with weight ``1/n``.

    Examples:
        >>> import torch
        >>> from torch.distributions import Normal
        >>> d = Normal(torch.zeros(3), 1.0)
        >>> _ = torch.manual_seed(0); x = MonteCarlo("z", 4).sample(d, (), False)
        >>> _ = torch.manual_seed(0); x.shape, torch.equal(x, d.sample((4,)))   # 4 plain draws of d
        (torch.Size([4, 3]), True)
    """

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name)
        self.n_samples = check_count(n_samples, "n_samples", f"{type(self).__name__}({plate_name!r})")

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        if self.mc_sample is not None:
            return self.mc_sample(distr, plates, self.n_samples)
        if self.delegate is not None:
            return self.delegate.proposal_dist(distr, self.n_samples)
        if requires_grad:
            return distr.rsample((self.n_samples,))
        return distr.sample((self.n_samples,))
