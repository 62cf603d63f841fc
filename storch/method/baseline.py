"""Baselines: control variates ``a(x)`` for score-function estimators.

A baseline that does not depend on the sample it multiplies keeps the estimator unbiased, for
derivatives of every order, through the term ``(1 − □(l(x))) · a(x)`` (Storchastic §3.5).

* `storch.method.baseline.MovingAverageBaseline` — ``b ← β b + (1 − β) mean(f)``, updated *after*
  each backward pass, so the value used for a batch never depends on that batch (Williams 1992).
* `storch.method.baseline.BatchAverageBaseline` (the manual's ``BatchAverage``) — leave-one-out:
  ``b_j = Σ_{m≠j} f_m / (n − 1)``, needs ``n ≥ 2`` (Mnih & Rezende 2016; Kool et al. 2019, "Buy 4
  REINFORCE samples, get a baseline for free!").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from storch import distributed
from storch.reductions import reduce_plates
from storch.reductions import sum as plate_sum
from storch.extend import (
    CostTensor, DeclaresStepState, PlateLayout, StepState, StochasticTensor, layout_of, no_dispatch, plain,
    wrap_new,
)

__all__ = [
    "Baseline", "MovingAverageBaseline", "BatchAverageBaseline", "BatchAverage", "make_baseline", "BaselineFactory",
    "UpdatesItsBaseline",
]


class Baseline(nn.Module, DeclaresStepState, ABC):
    """A control variate for the score function, computed per registered cost."""

    #: whether the baseline depends on the node's own sample, so that a method using it must add
    #: `storch.method.baseline.Baseline.correction` to stay unbiased (methods that cannot refuse such a
    # baseline when built)
    needs_correction: bool = False
    #: whether the baseline of a sample is computed from the *other* samples of its plate (leave-one-out):
    #: unbiased only when the samples are independent, so proposals that draw dependent samples
    #: (sampling without replacement) refuse it
    uses_other_samples: bool = False
    #: what the baseline keeps between steps (see `storch.state`): nothing. A subclass that
    #: overrides `storch.method.baseline.Baseline.update` declares its own ``step_state`` in the
    #: same class body, or counts as keeping ``HOST`` state
    step_state = StepState.NONE
    state_hooks = ("update",)

    @abstractmethod
    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        """The baseline for ``cost_node`` (the downstream cost estimate, one value per sample)."""

    def check_samples(self, n_samples: int, plate_name: str) -> None:
        """Raise if this baseline cannot work with ``n_samples`` samples."""

    def update(self) -> None:
        """Called once after each backward pass."""

    def vectorises_chain(self, plates: PlateLayout) -> bool:
        """Whether `storch.method.baseline.Baseline.chain_baselines` gives the
        baselines of every step of a single-sample chain at once, for costs that carry ``plates``
        besides the chain: ``False`` here (each step's baseline is computed on its own)."""
        return False

    def chain_baselines(self, names: Sequence[str], to_go: torch.Tensor, plates: PlateLayout) -> torch.Tensor:
        """The baselines of the steps of a chain, oldest first, from the detached reward to go
        ``to_go`` (plain, ``(T, *sizes of plates)``), as a plain tensor that broadcasts against it;
        ``names[s]``: the cost name of step ``s`` (as ``compute_baseline``'s ``cost_node.name``).
        Only called where `storch.method.baseline.Baseline.vectorises_chain` is true."""
        raise TypeError(
            f"{type(self).__name__} computes each step's baseline on its own (its vectorises_chain is "
            "False): call compute_baseline for each step instead of chain_baselines."
        )

    def correction(self, tensor: StochasticTensor, cost_node: CostTensor) -> Optional[torch.Tensor]:
        """An extra surrogate term beside ``(1 − □(l)) · b``, of forward value 0; ``None`` (default): none.

        A baseline that depends on the node's own sample ``x`` (a Q-function critic,
        `storch.method.critic.QCritic`) is biased by ``E[b(x) ∇log p(x)] = ∇E_p[b]``;
        its
        correction ``E_p[b] − stopgrad(E_p[b])`` adds that gradient back. Methods that use baselines
        add it to their control-variate term, after
        `storch.method.baseline.Baseline.compute_baseline`.
        """
        return None


class MovingAverageBaseline(Baseline):
    """Exponential moving average of the cost, one per registered cost name.

    After each backward pass ``b ← β b + (1 − β) m``, with ``m`` the batch mean of the cost (every
    plate reduced with its weight); the value used for a batch never depends on that batch.

    **Data-parallel training** (``torch.distributed`` with more than one rank): with ``sync=True``
    (the default) the baseline is *global*: ``m`` is the mean of the ranks' batch means (one
    all-reduce of a scalar per cost name and step,
    `storch.distributed.all_reduce_mean_`),
    so every rank holds the same average, equal to the one a single process would track over the
    whole minibatch (ranks with equal shard sizes), and a checkpoint written by rank 0 holds it all.
    With ``sync=False`` it is *per rank*: each rank averages its own shard's costs (no
    communication; the replicas' baselines differ). Both keep the estimator unbiased; the global one
    is the default because the run then does not depend on the number of ranks, and its cost is
    negligible next to DDP's gradient all-reduce. Every rank must register the same cost names.
    In a single process ``sync`` changes nothing.

    ``state_dict()`` holds the averages (key ``_extra_state``), so a checkpoint resumes exactly.

    Each cost name's average lives in a buffer (made on first use, not saved as a buffer: the
    averages are the extra state) and is updated in place, so `storch.compile_step` traces
    the update with the step and every replay carries it out.

    Args:
        exponential_decay: ``β`` in ``[0, 1)``.
        sync: average the batch means across ranks before each update (see above).

    Examples:
        >>> b = MovingAverageBaseline(exponential_decay=0.9)
        >>> b.exponential_decay, b.sync
        (0.9, True)
    """

    #: class default, also for baselines pickled before the attribute existed
    sync: bool = True
    #: the averages are buffers updated in place within the step: a compiled step replays that
    step_state = StepState.IN_PLACE

    def __init__(self, exponential_decay: float = 0.95, sync: bool = True) -> None:
        super().__init__()
        if not 0.0 <= exponential_decay < 1.0:
            raise ValueError(f"exponential_decay must be in [0, 1), got {exponential_decay}.")
        self.exponential_decay = exponential_decay
        self.sync = bool(sync)
        self._slots: dict[str, int] = {}  # cost name -> index of its buffers
        self._pending: dict[str, torch.Tensor] = {}

    def _buffers_of(self, name: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The average of cost ``name`` (0 until the first update) and whether it has had one."""
        index = self._slots.get(name)
        if index is None:
            index = self._slots[name] = len(self._slots)
            self.register_buffer(f"average_{index}", like.new_zeros(()), persistent=False)
            self.register_buffer(f"updated_{index}", torch.zeros((), dtype=torch.bool, device=like.device),
                                 persistent=False)
        buffers = self._buffers  # read directly: nn.Module.__getattr__ costs a µs per decision of a rollout
        return buffers[f"average_{index}"], buffers[f"updated_{index}"]

    @property
    def averages(self) -> dict[str, torch.Tensor]:
        """The average of each cost name updated at least once (reads the flags on the host; on the
        ``meta`` device, which holds no values, every average)."""
        found = {}
        for name, index in self._slots.items():
            updated = getattr(self, f"updated_{index}")
            if updated.is_meta or bool(updated):
                found[name] = getattr(self, f"average_{index}")
        return found

    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        name = cost_node.name
        mean = _weighted_mean(cost_node)
        self._pending[name] = mean
        average, _ = self._buffers_of(name, mean)
        return average.clone()  # the buffer is updated in place after the backward pass

    def vectorises_chain(self, plates: PlateLayout) -> bool:
        """True for costs whose plates are all uniformly weighted (their mean is the plain mean), unless
        a subclass computes its baselines or corrections otherwise."""
        cls = type(self)
        own = cls.compute_baseline is MovingAverageBaseline.compute_baseline and cls.correction is Baseline.correction
        return own and all(p.has_uniform_weight for p in plates.plates)

    def chain_baselines(self, names: Sequence[str], to_go: torch.Tensor, plates: PlateLayout) -> torch.Tensor:
        """The averages of the steps' cost names, stacked (oldest step first); each step's mean reward
        to go is noted for the update, as
        `storch.method.baseline.MovingAverageBaseline.compute_baseline` notes it
        (where two steps share a name, the older one's, the one the step-by-step recursion reaches
        last)."""
        with no_dispatch():
            means = to_go.mean(tuple(range(1, to_go.dim()))) if to_go.dim() > 1 else to_go
            for name, mean in zip(reversed(names), reversed(means.unbind(0))):
                self._pending[name] = mean
            averages = torch.stack([self._buffers_of(name, means)[0] for name in names])
            return averages.reshape(averages.shape + (1,) * (to_go.dim() - 1))

    def update(self) -> None:
        """Fold the costs of the last step into the averages; a NaN or infinite mean is skipped.

        (`storch.backward` refuses non-finite costs before this runs; the guard also covers
        a surrogate differentiated by hand.) No value is read back, so this never syncs a GPU.
        With ``sync`` under ``torch.distributed``, the means are first averaged across the ranks
        (sorted by cost name, one collective per device and dtype).
        """
        beta = self.exponential_decay
        if self.sync and distributed.syncing() and self._pending:
            names = sorted(self._pending)
            means = [self._pending[name].detach().clone() for name in names]
            distributed.all_reduce_mean_(means)
            self._pending = dict(zip(names, means))
        groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for name, mean in self._pending.items():
            average, updated = self._buffers_of(name, mean)
            groups.setdefault((average.dtype, average.device), []).append((average, updated, mean))
        for members in groups.values():
            _fold(members, beta)
        self._pending.clear()

    def get_extra_state(self) -> dict:
        """The averages (copies), for ``state_dict`` (key ``_extra_state``)."""
        return {"averages": {name: value.detach().clone() for name, value in self.averages.items()}}

    def set_extra_state(self, state: Any) -> None:
        """Restore the averages saved by
        `storch.method.baseline.MovingAverageBaseline.get_extra_state` (``load_state_dict`` calls
        it)."""
        if not isinstance(state, dict) or not isinstance(state.get("averages"), dict):
            raise ValueError(
                "MovingAverageBaseline.load_state_dict: the '_extra_state' entry must be a dict with a dict "
                f"'averages' (written by get_extra_state), got {type(state).__name__}."
            )
        for name, value in state["averages"].items():
            value = torch.as_tensor(value).detach()
            average, updated = self._buffers_of(str(name), value)
            with torch.no_grad():
                average.copy_(value)
                updated.fill_(True)
        self._pending.clear()

    def __setstate__(self, state: dict) -> None:
        """Unpickle, also a baseline pickled before the averages became buffers (a dict then)."""
        old = state.pop("averages", None)
        super().__setstate__(state)
        if not hasattr(self, "_slots"):
            self._slots = {}
        if old:
            self.set_extra_state({"averages": old})

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """``.to(device)``, ``.double()``, ...: the averages (buffers) and the pending means follow."""
        super()._apply(fn, recurse)
        self._pending = {name: fn(value) for name, value in self._pending.items()}
        return self

    def extra_repr(self) -> str:
        sync = "" if self.sync else ", sync=False"
        return f"exponential_decay={self.exponential_decay}{sync}"


def _fold(members: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], beta: float) -> None:
    """``b ← β b + (1 − β) m`` (the first update: ``b ← m``; a non-finite ``m`` is skipped) for each
    ``(average, updated, m)`` of one dtype and device, in place. Several averages (one per decision of
    a rollout) are updated together: stacked, folded, and copied back in one call per list."""
    if len(members) == 1:
        (average, updated, mean), = members
    else:
        averages, flags = [m[0] for m in members], [m[1] for m in members]
        average, updated = torch.stack(averages), torch.stack(flags)
        mean = torch.stack([m[2].detach() for m in members])
    mean = mean.detach().to(average.dtype)
    finite = torch.isfinite(mean)
    first = torch.where(finite, mean, torch.zeros_like(mean))
    later = torch.where(finite, beta * average + (1 - beta) * mean, average)
    folded = torch.where(updated, later, first)
    if len(members) == 1:
        average.copy_(folded)
        updated.fill_(True)
    else:
        torch._foreach_copy_(averages, list(folded.unbind(0)))
        torch._foreach_copy_(flags, [torch.ones((), dtype=torch.bool, device=updated.device)] * len(flags))


def _weighted_mean(cost: CostTensor) -> torch.Tensor:
    """The detached mean of ``cost`` over its plates, each weighted by its plate weights (a plain
    0-dim tensor). With uniform weights only (plain Monte Carlo and minibatches, the common case) it
    is the plain mean of the values, one operation."""
    if all(p.has_uniform_weight for p in layout_of(cost).plates):
        with no_dispatch():
            return cost.detach().mean()
    mean = reduce_plates(cost.detach())
    while layout_of(mean).plates:  # reducing a chain's step leaves the step it extended
        mean = reduce_plates(mean)
    return plain(mean)


class BatchAverageBaseline(Baseline):
    """Leave-one-out average of the other samples' costs (RLOO); needs at least two samples.

    Examples:
        >>> BatchAverageBaseline().check_samples(1, "z")
        Traceback (most recent call last):
        ...
        ValueError: The batch_average baseline of node 'z' averages the other samples' costs and needs at least 2 samples; got n_samples=1. Use n_samples >= 2, or baseline_factory='moving_average'.
    """

    uses_other_samples = True

    def check_samples(self, n_samples: int, plate_name: str) -> None:
        if n_samples < 2:
            raise ValueError(
                f"The batch_average baseline of node {plate_name!r} averages the other samples' costs "
                f"and needs at least 2 samples; got n_samples={n_samples}. Use n_samples >= 2, or "
                "baseline_factory='moving_average'."
            )

    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        n = tensor.n
        self.check_samples(n, tensor.name)
        plate, layout = tensor.plate, layout_of(cost_node)
        if not any(p is plate for p in layout.plates):
            costs = cost_node.detach()
            return (plate_sum(costs, plate) - costs) / (n - 1)
        i = layout.position(plate)
        with no_dispatch():  # the same arithmetic on the plain values (the sum keeps the plate's dimension)
            costs = cost_node.detach()
            loo = (costs.sum(i, keepdim=True) - costs) / (n - 1)
        return wrap_new(loo, layout)


class UpdatesItsBaseline(DeclaresStepState):
    """Mixin for methods with an optional ``self.baseline`` (a `storch.method.baseline.Baseline`
    or ``None``): the baseline is updated after each backward pass, and is a part of the method's state
    (`storch.state`). List it before the ``Method`` base."""

    baseline: Optional[Baseline]
    #: the mixin keeps nothing itself: the baseline's state counts as a part
    step_state = StepState.NONE
    state_hooks = ("update_parameters",)

    def update_parameters(self, result_triples) -> None:
        super().update_parameters(result_triples)  # type: ignore[misc]
        if self.baseline is not None:
            self.baseline.update()

    def state_parts(self) -> dict[str, Any]:
        """The method's parts (its proposal) and the baseline (``None`` entries are skipped)."""
        return {**super().state_parts(), "baseline": getattr(self, "baseline", None)}


#: The manual's name for `storch.method.baseline.BatchAverageBaseline` (its tutorial calls the
# leave-one-out baseline
#: ``storch.method.baseline.BatchAverage``); the same class, e.g.
#: ``ScoreFunction("z", 8, baseline_factory=BatchAverage)``.
BatchAverage = BatchAverageBaseline

BaselineFactory = Union[None, str, Baseline, Callable[[], Baseline]]


def _critic() -> Baseline:
    from storch.method.critic import Critic  # imported here: storch.method.critic builds on this module

    return Critic()


def _q_critic() -> Baseline:
    from storch.method.critic import QCritic

    return QCritic()


_BY_NAME: dict[str, Callable[[], Baseline]] = {
    "moving_average": MovingAverageBaseline,
    "batch_average": BatchAverageBaseline,
    "critic": _critic,  # a learned value function of the node's non-descendants (storch.method.critic)
    "q_critic": _q_critic,  # a learned Q-function with its exact expectation correction
}


def make_baseline(factory: BaselineFactory) -> Baseline | None:
    """Build a baseline from ``None``/``"none"``, a name, a `storch.method.baseline.Baseline`, or a
    zero-argument factory."""
    if factory is None or (isinstance(factory, str) and factory.lower() == "none"):
        return None
    if isinstance(factory, str):
        if factory not in _BY_NAME:
            raise ValueError(
                f"Unknown baseline {factory!r}; choose one of None, 'none', "
                f"{', '.join(repr(k) for k in _BY_NAME)}, a Baseline, or a callable returning one."
            )
        return _BY_NAME[factory]()
    if isinstance(factory, Baseline):
        return factory
    if callable(factory):
        baseline = factory()
        if not isinstance(baseline, Baseline):
            raise TypeError(f"baseline_factory returned {type(baseline).__name__}, not a storch Baseline.")
        return baseline
    raise TypeError(f"baseline_factory must be None, a string, a Baseline or a callable, got {factory!r}.")
