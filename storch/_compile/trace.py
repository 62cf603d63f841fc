"""Tracing a step: one real step run under ``make_fx``, recorded as a graph of aten operations.

The traced closure puts the graph's inputs into the modules' parameter and buffer slots
(`swapped`), runs the step under `DeferredChecks`, and returns a `StepOutputs`: the one structure
that the graph returns and that `storch.compiled_step.CompiledStep` reads after a replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from storch import _tracing
from storch._compile.checks import Check, DeferredChecks, all_ok
from storch._compile.inputs import Inputs, Slots
from storch._compile.refusals import (
    COSTS_AFTER,
    HostReads,
    host_read_error,
    is_host_read,
    refuse_registered_costs,
    result_tensors,
)
from storch.exceptions import CompileStepError
from storch.inference import reset

__all__ = ["StepOutputs", "TraceRecord", "swapped", "trace_step"]


class StepOutputs(NamedTuple):
    """What the traced graph returns, each replay alike."""

    #: the tensors of the step's result, in the order of its leaves
    result: list[torch.Tensor]
    #: ``.grad`` of the trainable parameters that have one after the step (`TraceRecord.grad_positions`)
    grads: list[torch.Tensor]
    #: the booleans of the checks read after the step (`TraceRecord.deferred`)
    checks: list[torch.Tensor]
    #: per ``storch.backward``: its surrogate loss and its costs' values
    losses: list[torch.Tensor]
    costs: list[list[torch.Tensor]]
    #: every check holds and every loss is finite: the one value read on the host per step
    ok: torch.Tensor

    def counts(self) -> tuple[int, int, int, tuple[int, ...]]:
        """How many tensors each field holds (``costs``: per ``storch.backward``), for `from_flat`."""
        return len(self.result), len(self.grads), len(self.checks), tuple(len(c) for c in self.costs)

    @classmethod
    def from_flat(cls, flat: Sequence[torch.Tensor], counts: tuple[int, int, int, tuple[int, ...]]) -> StepOutputs:
        """The outputs from their leaves in pytree order (each field in turn, ``ok`` last), as the
        graph's flat ``forward`` returns them; ``counts`` from the traced step's `counts`."""
        n_result, n_grads, n_checks, n_costs = counts
        i = n_result + n_grads + n_checks
        n_losses = len(n_costs)
        costs, j = [], i + n_losses
        for n in n_costs:
            costs.append(list(flat[j:j + n]))
            j += n
        return cls(list(flat[:n_result]), list(flat[n_result:n_result + n_grads]),
                   list(flat[n_result + n_grads:i]), list(flat[i:i + n_losses]), costs, flat[j])


@dataclass
class TraceRecord:
    """What the trace learns about the step besides its graph."""

    out_spec: Any = None  # pytree spec of the step's result
    out_constants: list = field(default_factory=list)  # its leaves, tensors replaced by `TENSOR`
    grad_positions: list[int] = field(default_factory=list)  # trainable parameters with a .grad after it
    deferred: list[Check] = field(default_factory=list)  # the checks of `StepOutputs.checks`
    asserted: dict[str, Check] = field(default_factory=dict)  # assertions in the graph, by message
    cost_names: list[list[tuple[str, list[str]]]] = field(default_factory=list)  # per backward: (name, plates)
    outputs: StepOutputs | None = None  # the traced step's own outputs


TENSOR = object()  # marks where a tensor goes in a step's result


class swapped:
    """Put the graph's placeholder tensors into the modules' parameter and buffer slots, and back."""

    def __init__(self, slots: list[tuple], values: list[torch.Tensor], kinds: list[str]) -> None:
        self.entries = [(owner, kind, name, value) for owner_slots, value, kind in zip(slots, values, kinds)
                        for owner, name in owner_slots]
        self.saved: list[tuple] = []

    def __enter__(self) -> None:
        for owner, kind, name, value in self.entries:
            table = getattr(owner, kind)
            self.saved.append((table, name, table[name]))
            table[name] = value

    def __exit__(self, *exc: object) -> None:
        for table, name, value in reversed(self.saved):
            table[name] = value
        self.saved.clear()


def _graph_inputs(inputs: Inputs) -> Inputs:
    """Copies of the inputs for ``make_fx``: parameters as fresh leaves, incoming ``.grad`` cloned."""
    return Inputs(
        trainable=[p.detach().requires_grad_() for p in inputs.trainable],
        incoming_grads=[g.clone() for g in inputs.incoming_grads],
        frozen=[p.detach() for p in inputs.frozen],
        buffers=inputs.buffers,
        arguments=inputs.arguments,
    )


def trace_step(
    step: Callable[..., Any], leaves: list, spec: Any, params: Slots, buffers: Slots,
    inputs: Inputs, asserted_devices: frozenset,
) -> tuple[torch.fx.GraphModule, TraceRecord, bool]:
    """Run ``step`` once under ``make_fx`` (a real step) on ``inputs``.

    Returns the graph, the `TraceRecord`, and whether the graph writes into the incoming ``.grad``.
    Raises `storch._tracing.EagerStepNeeded` when a module must build state eagerly first, and
    `storch.exceptions.CompileStepError` for a host read.
    """
    from torch.fx.experimental.proxy_tensor import (
        make_fx,  # imported on first use (slow)
    )

    trainable = [(slots, p) for slots, p in params if p.requires_grad]
    frozen = [(slots, p) for slots, p in params if not p.requires_grad]
    had_grad = [i for i, (_, p) in enumerate(trainable) if p.grad is not None]
    slots = [s for s, _ in trainable] + [s for s, _ in frozen] + [s for s, _ in buffers]
    kinds = ["_parameters"] * (len(trainable) + len(frozen)) + ["_buffers"] * len(buffers)
    is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    state, record = _tracing.TraceState(), TraceRecord()

    def traced(trainable_values: list, incoming_grads: list, frozen_values: list, buffer_values: list,
               arguments: list) -> StepOutputs:
        for i, grad in zip(had_grad, incoming_grads):  # accumulation, or zero_grad in the step, is traced
            trainable_values[i].grad = grad
        values = iter(arguments)
        args, kwargs = pytree.tree_unflatten([next(values) if t else leaf for leaf, t in zip(leaves, is_tensor)], spec)
        checks = DeferredChecks(asserted_devices)
        with swapped(slots, trainable_values + frozen_values + buffer_values, kinds), checks, HostReads():
            result = step(*args, **kwargs)
        refuse_registered_costs(COSTS_AFTER)
        record.outputs = _outputs(result, trainable_values, checks, state, record)
        return record.outputs

    graph_inputs = _graph_inputs(inputs)
    grad_versions = [g._version for g in graph_inputs.incoming_grads]
    token = _tracing.start(state)
    try:
        graph = make_fx(traced, tracing_mode="real")(*graph_inputs.as_args())
    except RuntimeError as error:
        if is_host_read(error) and not isinstance(error, CompileStepError):
            raise host_read_error(error) from error
        raise
    finally:
        _tracing.stop(token)
        reset()
    writes_grads = any(g._version != v for g, v in zip(graph_inputs.incoming_grads, grad_versions))
    return graph, record, writes_grads


def _outputs(result: Any, trainable: list[torch.Tensor], checks: DeferredChecks, state: _tracing.TraceState,
             record: TraceRecord) -> StepOutputs:
    """The traced step's `StepOutputs`; what reading them needs goes to ``record``."""
    out_leaves, record.out_spec = pytree.tree_flatten(result)
    record.out_constants = [TENSOR if isinstance(v, torch.Tensor) else v for v in out_leaves]
    grads = [p.grad for p in trainable]
    record.grad_positions = [i for i, g in enumerate(grads) if g is not None]
    record.deferred = [check for _, check in checks.deferred]
    record.asserted = checks.asserted
    record.cost_names = [[(name, plates) for name, _, plates in named] for _, named in state.losses]
    flags = [valid for valid, _ in checks.deferred]
    losses = [loss for loss, _ in state.losses]
    return StepOutputs(
        result=result_tensors(out_leaves),
        grads=[g for g in grads if g is not None],
        checks=flags,
        losses=losses,
        costs=[[values for _, values, _ in named] for _, named in state.losses],
        ok=all_ok(flags, losses, trainable),
    )
