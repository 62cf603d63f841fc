"""Whether storch code runs inside the trace of `storch.compile_step`, and what the trace
collects.

While a step is traced, storch keeps every check that reads a value on the host out of the traced
graph and hands it to `storch.compiled_step` instead, which runs it on each replay:

* `storch.backward` notes its surrogate loss and costs here (`TraceState.note_loss`)
  instead of reading the loss on the host; the compiled step checks that they are finite;
* ``torch.distributions`` argument validation and ``F.one_hot``'s range check are kept by the
  compiled step itself (`storch._compile.checks`): assertions in the graph on the CPU, booleans read
  after the step elsewhere;
* code that would choose a faster branch by reading a tensor on the host (the zero-weight test of
  `storch.reductions.reduce_plate`, the device-copy cache of plate weights) takes the general branch
  when `storch._tracing.active`;
* code that must build state at its first use (a critic's network) raises
  `storch._tracing.EagerStepNeeded`: that call runs eagerly, and the next one is traced.

Kept per context (thread, asyncio task) like the cost registry, so an eager step on another thread
is not affected by a trace on this one.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["EagerStepNeeded", "TraceState", "active", "current"]


class EagerStepNeeded(Exception):
    """Raised within the trace of a step, before anything is applied, by storch code that must build
    state at its first use from values it sees only then (a critic's network, sized by its first input).

    A module built inside a trace would enter the graph as constants, not as the module's parameters.
    `storch.compile_step` catches it, puts back the random generators and buffers as they
    were before the trace, and runs that call as an eager step (which builds the state); the next call is
    traced with the new state as inputs. Raise it before the step registers anything that outlives it.
    """


@dataclass
class TraceState:
    """What one trace of a step collects for the checks after each replay."""

    #: ``(surrogate loss, [(cost name, cost values, plate names)])`` per ``storch.backward``
    losses: list[tuple[torch.Tensor, list[tuple[str, torch.Tensor, list[str]]]]] = field(default_factory=list)

    def note_loss(self, loss: torch.Tensor, costs: list[tuple[str, torch.Tensor, list[str]]]) -> None:
        self.losses.append((loss, costs))


_STATE: ContextVar[Optional[TraceState]] = ContextVar("storch_trace", default=None)


def current() -> Optional[TraceState]:
    """The state of the trace running in this context, or ``None`` when storch runs eagerly."""
    return _STATE.get()


def active() -> bool:
    """True while `storch.compile_step` traces a step in this context."""
    return _STATE.get() is not None


def start(state: TraceState):
    """Begin tracing in this context; returns the token for `stop`."""
    return _STATE.set(state)


def stop(token) -> None:
    _STATE.reset(token)

