"""What a replay cannot reproduce, refused by name with `storch.exceptions.CompileStepError`.

Each refusal runs when a step is traced: on its arguments and result, on the cost registry around
the trace, on the host reads that stop ``make_fx``, and on the traced graph (tensors that require
grad captured as constants, updates in place of constants or of the step's arguments).
"""

from __future__ import annotations

import operator
import os
import traceback
from typing import Any

import torch

from storch._compile.passes import is_mutation, is_view, written_arguments
from storch.exceptions import CompileStepError
from storch.inference import registered_costs
from storch.tensor import Tensor as StorchTensor

__all__ = [
    "COSTS_AFTER", "COSTS_BEFORE", "host_read_error", "is_host_read", "refuse_captured_grad_tensors",
    "refuse_registered_costs", "refuse_updated_arguments", "refuse_updated_constants", "result_tensors",
    "updated_arguments_error", "written_inputs",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_STORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMPILE_DIR = os.path.dirname(os.path.abspath(__file__))

COSTS_BEFORE = (
    "are registered before the step runs (left over from a step that raised before storch.backward()?); "
    "they would enter every replay as constants. Call storch.reset() first."
)
COSTS_AFTER = "were registered by the step, which did not call storch.backward(); end the step with it."


def refuse_registered_costs(reason: str) -> None:
    """Costs in the registry around a trace: from before it (they would be constants of the graph)
    or left by the step (nothing would differentiate them); ``reason`` is `COSTS_BEFORE` or `COSTS_AFTER`."""
    costs = registered_costs()
    if costs:
        raise CompileStepError(f"storch.compile_step: costs {[c.name for c in costs]} {reason}")


def result_tensors(leaves: list) -> list[torch.Tensor]:
    """The tensors among the leaves of a step's result, detached; a storch tensor is refused."""
    tensors = []
    for leaf in leaves:
        if isinstance(leaf, StorchTensor):
            raise CompileStepError(
                f"storch.compile_step: the step returns a storch tensor (plates {leaf.plate_names}); its "
                "plates exist during the trace only. Return plain tensors: the value of "
                "storch.backward(), storch.reduce_plates(t), or t.plain() for the raw values."
            )
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf.detach())
    return tensors


def is_host_read(error: RuntimeError) -> bool:
    """Whether ``make_fx`` stopped at a read of a tensor's value on the host."""
    return "get value out of a tracing tensor" in str(error) or "data-dependent" in str(error)


def _frame_text(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} ({frame.name}): {frame.line}"


def host_read_error(error: RuntimeError) -> CompileStepError:
    """The refusal of a host read, at the user's line (from the traceback of ``make_fx``'s error)."""
    frames = traceback.extract_tb(error.__traceback__)
    outside_torch = [f for f in frames if not f.filename.startswith((_TORCH_DIR, _COMPILE_DIR))]
    user = [f for f in outside_torch if not f.filename.startswith(_STORCH_DIR)]
    where = f" at {_frame_text(user[-1])}" if user else ""
    inner = outside_torch[-1] if outside_torch else None
    if inner is not None and inner.filename.startswith(_STORCH_DIR):
        where += f" (in storch: {_frame_text(inner)})"
    return CompileStepError(
        f"storch.compile_step: the step reads a tensor's value on the host{where}: an `if` on a "
        "tensor, .item(), bool(), float() or .tolist(). A traced step is replayed as a fixed graph, "
        "so it cannot branch on values. Compute with tensor operations instead (torch.where, "
        "torch.clamp), move the read out of the step, or run the step eagerly."
    )


def refuse_captured_grad_tensors(graph: torch.fx.GraphModule) -> None:
    """Refuse tensors that require grad and entered the graph as constants (not as parameters)."""
    for node in graph.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(node.target)(graph)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise CompileStepError(
                f"storch.compile_step: the step uses a tensor of shape {tuple(value.shape)} that requires "
                "grad but is not a parameter of the modules given to compile_step (a tensor captured "
                "from outside, a parameter of another module, or an optimizer step inside the step). "
                "Its gradient would be lost in a replay. Pass the module that owns it to "
                "storch.compile_step(step, *modules), and keep optimizer steps outside the step."
            )


def _written_sources(graph: torch.fx.Graph, sources: dict[torch.fx.Node, Any]) -> list[tuple[Any, torch.fx.Node]]:
    """``(source, mutation node)`` for each update in place of a tensor in ``sources`` (a graph input
    or constant, by node), directly or through a view of it; views of a source join ``sources``."""
    written = []
    for node in graph.nodes:
        if is_mutation(node):
            written.extend((sources[t], node) for t in written_arguments(node)
                           if isinstance(t, torch.fx.Node) and t in sources)
        elif is_view(node) and node.args and node.args[0] in sources:
            sources[node] = sources[node.args[0]]
    return written


def written_inputs(graph: torch.fx.GraphModule, kinds: list[tuple[str, int]]) -> set[tuple[str, int]]:
    """The graph's inputs (``(kind, index)``, one per placeholder in order) that the step updates in
    place, directly or through a view of them."""
    placeholders = graph.graph.find_nodes(op="placeholder")
    return {source for source, _ in _written_sources(graph.graph, dict(zip(placeholders, kinds)))}


def refuse_updated_arguments(written: set[tuple[str, int]], arguments: list[torch.Tensor]) -> None:
    """Refuse a step that updates one of its tensor arguments in place: the caller's data would change
    on every replay."""
    changed = sorted(i for kind, i in written if kind == "argument")
    if changed:
        raise updated_arguments_error([arguments[i] for i in changed])


def updated_arguments_error(changed: list[torch.Tensor]) -> CompileStepError:
    return CompileStepError(
        f"storch.compile_step: the step changes {len(changed)} of its arguments in place (shapes "
        f"{[tuple(t.shape) for t in changed]}; an in-place operation on the data). "
        "Work on a copy (x = x.clone()) or keep such updates outside the compiled step."
    )


def refuse_updated_constants(graph: torch.fx.GraphModule) -> None:
    """Refuse a step that updates in place a tensor it did not get as an input.

    Such a tensor (a plain tensor attribute, a buffer of a module not given to compile_step) enters
    the graph as a constant; the trace has already updated it once, and a replay cannot be checked
    against the state before the trace. Buffers of the given modules are inputs and are fine.
    """
    constants = {node: node.target for node in graph.graph.find_nodes(op="get_attr")}
    for target, node in _written_sources(graph.graph, constants):
        value = operator.attrgetter(target)(graph)
        raise CompileStepError(
            f"storch.compile_step: the step updates in place ({node.target}) a tensor of shape "
            f"{tuple(value.shape)} that is not an input of the step: a plain tensor attribute, or "
            "a buffer of a module not given to compile_step. Register it as a buffer "
            "(module.register_buffer) of a module you pass to storch.compile_step(step, *modules)."
        )
