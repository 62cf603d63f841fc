"""What a replay cannot reproduce, refused by name with `storch.exceptions.CompileStepError`.

Each refusal runs when a step is traced: on its arguments and result, on the cost registry around
the trace, on the host reads of tensor values (`HostReads`, and those that stop ``make_fx``), and on
the traced graph (tensors that require grad captured as constants, updates in place of constants or
of the step's arguments).
"""

from __future__ import annotations

import operator
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from storch._compile.passes import is_mutation, is_view, written_arguments
from storch.exceptions import CompileStepError
from storch.inference import registered_costs
from storch.tensor import Tensor as StorchTensor

__all__ = [
    "COSTS_AFTER", "COSTS_BEFORE", "HostReads", "host_read_error", "is_host_read", "refuse_captured_grad_tensors",
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


_FIX = (
    "A traced step is replayed as a fixed graph: a value that leaves torch during the trace (to "
    "Python, numpy, an environment) and comes back is baked in, and every replay would reuse it. "
    "Compute with tensor operations instead (torch.where, torch.clamp), move the read out of the "
    "step, or run the step eagerly (a rollout that steps a numpy environment stays eager)."
)


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
        f"tensor, .item(), bool(), int() or float(). {_FIX}"
    )


#: the methods of ``torch.Tensor`` that hand a tensor's values to Python, by what the refusal calls them
_HOST_READS: dict[Any, str] = {
    torch.Tensor.numpy: ".numpy()", torch.Tensor.tolist: ".tolist()", torch.Tensor.item: ".item()",
    torch.Tensor.__array__: "a conversion to numpy: np.asarray, np.array, a numpy function",
    torch.Tensor.__dlpack__: "a DLPack export: np.from_dlpack",
    torch.Tensor.__bool__: "bool(): an `if` on a tensor, `and`, `or`, `not`, an assert",
    torch.Tensor.__int__: "int()", torch.Tensor.__float__: "float()", torch.Tensor.__complex__: "complex()",
    torch.Tensor.__index__: "a use as an index or a count: range(), a list index, operator.index",
    torch.Tensor.__repr__: "printing: print, repr, str", torch.Tensor.__format__: "formatting: an f-string",
}

#: printing and formatting: allowed where torch formats a value for its own error message
_PRINTING = frozenset({torch.Tensor.__repr__, torch.Tensor.__format__})
_DISPLAY_FILES = tuple(os.path.join(_TORCH_DIR, name) for name in ("_tensor.py", "_tensor_str.py", "overrides.py"))
_STORCH_TENSOR_FILE = os.path.join(_STORCH_DIR, "tensor.py")


def _printed_by_torch() -> bool:
    """Whether the tensor being printed is printed by torch's own code (the value in the message of
    an error that torch raises, e.g. a failed ``torch.distributions`` validation), not by the step."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_COMPILE_DIR) or name.startswith(_DISPLAY_FILES) or name == _STORCH_TENSOR_FILE):
            return name.startswith(_TORCH_DIR)
        frame = frame.f_back
    return False


#: the functions that make a tensor from data; from numpy data the tensor is a constant of the graph
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor})


def _holds_numpy(data: Any) -> bool:
    """Whether ``data`` is or holds (in nested lists and tuples) a numpy array or numpy scalar."""
    numpy = sys.modules.get("numpy")
    if numpy is None:  # nothing made by numpy can exist
        return False
    pending = [data]
    while pending:
        item = pending.pop()
        if isinstance(item, (numpy.ndarray, numpy.generic)):
            return True
        if isinstance(item, (list, tuple)):
            pending.extend(item)
    return False


def _data_argument(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The data that ``func`` (one of `_FROM_DATA`) makes a tensor from."""
    position = 1 if func is torch.Tensor.new_tensor else 0
    if len(args) > position:
        return args[position]
    return kwargs.get("data", kwargs.get("obj"))


def _step_frames() -> list[traceback.FrameSummary]:
    """The frames of the running step outside torch and storch, outermost first (the step's own
    lines, then the code it calls: numpy, an environment)."""
    frames = traceback.extract_stack()
    starts = [i for i, f in enumerate(frames) if f.filename.startswith(_COMPILE_DIR) and f.name == "traced"]
    frames = frames[starts[-1] + 1:] if starts else frames
    return [f for f in frames if not f.filename.startswith((_TORCH_DIR, _STORCH_DIR))]


_LIBRARY_DIRS = tuple(sorted({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}))


def _where() -> str:
    """Where the step did it: the innermost line outside torch and storch and, when that line is in
    an installed package (numpy, an environment), the innermost line of the user's own code."""
    frames = _step_frames()
    if not frames:
        return ""
    where = f" at {_frame_text(frames[-1])}"
    own = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS)]
    if own and own[-1] is not frames[-1]:
        where += f", called from {_frame_text(own[-1])}"
    return where


class HostReads(TorchFunctionMode):
    """Refuse, while a step is traced, what takes a tensor's values out of torch or brings numpy
    data in: ``.numpy()``, ``.tolist()``, ``.item()``, numpy conversion, ``bool()``, ``int()``,
    ``float()``, use as an index, printing and formatting, and tensors made from numpy data.

    ``make_fx`` records torch operations only: a value read on the host and fed back (an action
    handed to a numpy environment, whose reward comes back as a number) would be a constant of the
    graph, and each replay would reuse the trace's values. The refusal names the line that did it
    (and the line of the step that called it). Storch's own checks read values under
    ``storch._compile.checks.DeferredChecks``, which this mode does not see.
    """

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        what = _HOST_READS.get(func)
        if what is not None and not (func in _PRINTING and _printed_by_torch()):
            raise CompileStepError(f"storch.compile_step: the step reads a tensor's value on the host{_where()}"
                                   f" -- {what}. {_FIX}")
        if func in _FROM_DATA and _holds_numpy(_data_argument(func, args, kwargs)):
            raise CompileStepError(
                f"storch.compile_step: the step makes a tensor from numpy data{_where()}; the trace "
                f"bakes those values into the graph. {_FIX} Data that does not change between steps: make "
                "the tensor once, outside the step, or pass it as an argument."
            )
        return func(*args, **kwargs)


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
