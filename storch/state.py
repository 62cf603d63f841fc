"""What an estimator carries from one training step to the next, and how it is updated.

`storch.compile_step` traces a step once and replays the recorded tensor
operations. Whether that is faithful depends on the state an estimator keeps between steps, which
each estimator class declares as its class attribute ``step_state`` (a `storch.state.StepState`):

* ``StepState.NONE`` — nothing the estimator computes survives the step (plain Monte Carlo, a
  leave-one-out baseline, bounds noted during a step and cleared after it);
* ``StepState.IN_PLACE`` — its state lives in buffers and parameters that the step updates in place
  with tensor operations, reading no value on the host (a moving average, an annealed temperature, a
  control variate or critic trained by its own optimizer): a replay carries the update out;
* ``StepState.host(reason)`` — Python-side state, or decisions taken on the host from its state (the
  size of a plate, a growing memory, the random generator's state): a replay would freeze them at the
  traced step, so `storch.compile_step` refuses the estimator, quoting ``reason``.

An estimator made of parts (a `storch.method.Method` with its proposal and
baseline) lists them in `storch.state.DeclaresStepState.state_parts`;
`storch.state.step_state_of` combines the declarations and
`storch.state.check_replayable` is the one check the compiled step runs.

**Undeclared updates.** A class body that overrides an update hook (``update_parameters`` of a
method or proposal, ``update`` of a baseline) without declaring ``step_state`` in the same body
counts as ``HOST``: an unknown update is never replayed as if it did nothing. This is decided once,
when the class is created (``DeclaresStepState.__init_subclass__``). A class body that declares
nothing else gets the most restrictive state of its bases.

Examples:
    >>> import torch
    >>> from storch.method import ScoreFunction
    >>> class Counting(ScoreFunction):            # a Python counter: HOST, undeclared
    ...     def update_parameters(self, result_triples):
    ...         super().update_parameters(result_triples)
    >>> Counting.step_state.kind, Counting.step_state.declared
    (<StateKind.HOST: 2>, False)
    >>> class Decaying(ScoreFunction):            # a buffer updated in place: replayable
    ...     step_state = StepState.IN_PLACE
    ...     def update_parameters(self, result_triples):
    ...         super().update_parameters(result_triples)
    >>> step_state_of(Decaying("z", n_samples=2)).kind
    <StateKind.IN_PLACE: 1>
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from storch.exceptions import CompileStepError

__all__ = ["DeclaresStepState", "StateKind", "StepState", "check_replayable", "step_state_of"]


class StateKind(enum.IntEnum):
    """How an estimator's state crosses a step, ordered from the least to the most restrictive."""

    #: nothing survives the step
    NONE = 0
    #: buffers and parameters updated in place by tensor operations within the step (replayable)
    IN_PLACE = 1
    #: Python-side state or host decisions (not replayable)
    HOST = 2


@dataclass(frozen=True)
class StepState:
    """The declaration of what an estimator keeps between steps: ``StepState.NONE``,
    ``StepState.IN_PLACE`` or ``StepState.host(reason)``.

    Attributes:
        kind: the `storch.state.StateKind`.
        reason: for ``HOST``, what the host keeps or decides, as a clause that completes "keeps state
            between steps that a replay cannot follow: …" (empty otherwise).
        declared: ``False`` for the ``HOST`` state assumed for a class that overrides an update hook
            without declaring ``step_state``.
    """

    kind: StateKind
    reason: str = ""
    declared: bool = True

    NONE: ClassVar[StepState]
    IN_PLACE: ClassVar[StepState]

    def __post_init__(self) -> None:
        if self.kind is StateKind.HOST and not self.reason.strip():
            raise ValueError("StepState.host(reason): say what the host keeps or decides (the refusal quotes it).")
        if self.kind is not StateKind.HOST and self.reason:
            raise ValueError(f"StepState: only HOST state has a reason, got {self.kind.name} with {self.reason!r}.")

    @classmethod
    def host(cls, reason: str) -> StepState:
        """Python-side state or host decisions, described by ``reason``: ``compile_step`` refuses it."""
        return cls(StateKind.HOST, reason)

    @property
    def replayable(self) -> bool:
        """Whether a compiled step replays the state's updates faithfully (``NONE`` or ``IN_PLACE``)."""
        return self.kind is not StateKind.HOST

    def __repr__(self) -> str:
        if self.kind is StateKind.HOST:
            return f"StepState.host({self.reason!r})" + ("" if self.declared else " (undeclared)")
        return f"StepState.{self.kind.name}"


StepState.NONE = StepState(StateKind.NONE)
StepState.IN_PLACE = StepState(StateKind.IN_PLACE)


def combine(states: Iterable[StepState]) -> StepState:
    """The most restrictive of ``states`` (``NONE`` for none); the reasons of ``HOST`` states joined."""
    states = list(states)
    hosts = [s for s in states if s.kind is StateKind.HOST]
    if hosts:
        reasons = list(dict.fromkeys(s.reason for s in hosts))
        return StepState(StateKind.HOST, "; ".join(reasons), declared=all(s.declared for s in hosts))
    return StepState.IN_PLACE if any(s.kind is StateKind.IN_PLACE for s in states) else StepState.NONE


def _undeclared(cls: type, hooks: list[str]) -> StepState:
    """The ``HOST`` state of a class body that overrides ``hooks`` without declaring ``step_state``."""
    names = " and ".join(hooks)
    return StepState(StateKind.HOST, (
        f"{cls.__qualname__} overrides {names} without declaring its step_state in the same class body, so "
        "what the update changes is unknown. If it changes only buffers and parameters, in place with tensor "
        "operations, declare `step_state = StepState.IN_PLACE` in that class body (`from storch.extend import "
        "StepState`); `StepState.NONE` if nothing outlives the step; otherwise "
        "`StepState.host('what the host keeps or decides')`"
    ), declared=False)


class DeclaresStepState:
    """Mixin of the estimator base classes (`storch.method.Method`,
    `storch.sampling.SamplingMethod`,
    `storch.method.baseline.Baseline` and the mixins that update
    state): the class attribute ``step_state`` and the check of undeclared updates.
    """

    #: what this class keeps between steps, apart from its parts (see the module)
    step_state: ClassVar[StepState] = StepState.NONE
    #: the methods called after each step; overriding one requires declaring ``step_state``
    state_hooks: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Settle ``cls.step_state`` once: the declaration of the class body; else ``HOST`` if the body
        overrides an update hook; else the most restrictive state of the bases."""
        super().__init_subclass__(**kwargs)
        if "step_state" in vars(cls):
            if not isinstance(cls.step_state, StepState):
                raise TypeError(
                    f"{cls.__qualname__}.step_state must be a storch.extend.StepState (StepState.NONE, "
                    f"StepState.IN_PLACE or StepState.host(reason)), got {cls.step_state!r}."
                )
            return
        overridden = [hook for hook in cls.state_hooks if hook in vars(cls)]
        if overridden:
            cls.step_state = _undeclared(cls, overridden)
        else:
            cls.step_state = combine(b.step_state for b in cls.__bases__ if issubclass(b, DeclaresStepState))

    def state_parts(self) -> dict[str, Any]:
        """The objects whose state is part of this one's, by attribute name (``None`` entries are
        skipped): a method's ``sampling_method``, its ``baseline``. None by default."""
        return {}

    @property
    def keeps_state_between_steps(self) -> bool:
        """Whether this object or one of its parts keeps ``HOST`` state (compatibility name for
        ``not step_state_of(self).replayable``; `storch.compile_step` refuses it)."""
        return not step_state_of(self).replayable


def _own_state(obj: Any) -> StepState:
    state = getattr(type(obj), "step_state", None)
    if isinstance(state, StepState):
        return state
    return StepState(StateKind.HOST, (
        f"{type(obj).__qualname__} declares no step_state (it is not a storch Method, SamplingMethod or "
        "Baseline); subclass one of them, or give the class a `step_state` (a storch.extend.StepState)"
    ), declared=False)


def _parts(obj: Any) -> list[tuple[str, Any]]:
    parts = obj.state_parts() if isinstance(obj, DeclaresStepState) else {}
    return [(name, part) for name, part in parts.items() if part is not None]


def _first_host(obj: Any, path: str = "") -> tuple[str, Any, StepState] | None:
    """``(path, object, state)`` of the first ``HOST`` declaration in ``obj`` and its parts (depth first,
    ``obj`` itself first; ``path`` is ``""`` for ``obj``, ``"baseline"``, ``"sampling_method.x"``…)."""
    own = _own_state(obj)
    if own.kind is StateKind.HOST:
        return path, obj, own
    for name, part in _parts(obj):
        found = _first_host(part, f"{path}.{name}" if path else name)
        if found is not None:
            return found
    return None


def step_state_of(obj: Any) -> StepState:
    """The state ``obj`` keeps between steps: its class's ``step_state`` combined with those of its
    `storch.state.DeclaresStepState.state_parts`, recursively."""
    return combine([_own_state(obj), *(step_state_of(part) for _, part in _parts(obj))])


def _label(obj: Any) -> str:
    plate = getattr(obj, "plate_name", None)
    return f"{type(obj).__name__}({plate!r})" if isinstance(plate, str) else type(obj).__name__


def check_replayable(obj: Any, label: str | None = None) -> None:
    """Raise `storch.exceptions.CompileStepError` if ``obj`` or one of its parts keeps
    ``HOST`` state, naming the estimator (``label``, by default ``Class('plate')``), the part and the reason.

    `storch.compile_step` calls it for every method of a traced step.
    """
    found = _first_host(obj)
    if found is None:
        return
    path, part, state = found
    where = f", in its part `{path}` ({type(part).__name__})" if path else ""
    raise CompileStepError(
        f"storch.compile_step: {label or _label(obj)} keeps state between steps that a replay cannot follow"
        f"{where}: {state.reason}. A compiled step replays the traced tensor operations only, so that state "
        "would stay as the traced step left it. Run this step eagerly."
    )
