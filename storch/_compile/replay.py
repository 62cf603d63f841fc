"""Replaying a traced graph: the replay function, the state it may change, and the check that it
reproduces the traced step.

The replay runs the simplified graph's own ``forward``, the Python code torch generates for a
`torch.fx.GraphModule`, under ``torch.no_grad()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from storch._compile.checks import CheckFailed, failed_assertions
from storch._compile.inputs import Inputs
from storch._compile.refusals import updated_arguments_error
from storch._compile.trace import StepOutputs
from storch.exceptions import CompileStepError
from storch.inference import reset

__all__ = ["GraphReplay", "Snapshot", "check_replay", "eager_error", "replay_module", "rng_states", "run_graph", "set_rng_states"]

Replay = Callable[..., StepOutputs]  # called as replay(*Inputs.as_args())


def rng_states() -> list[torch.Tensor]:
    """The states of the default random number generators (CPU, and CUDA devices once used)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


@dataclass
class Snapshot:
    """What a step may change: the random generators, copies of the parameters and buffers (which
    it may update in place), the ``.grad`` of the trainable parameters, and the versions of its arguments."""

    rng: list[torch.Tensor]
    trainable: list[torch.Tensor]
    frozen: list[torch.Tensor]
    buffers: list[torch.Tensor]
    grads: list[tuple[torch.Tensor | None, torch.Tensor | None]]  # each .grad and a copy of its values
    versions: list[int]

    @classmethod
    def take(cls, inputs: Inputs) -> Snapshot:
        with torch.no_grad():
            return cls(
                rng=rng_states(),
                trainable=[p.detach().clone() for p in inputs.trainable],
                frozen=[p.detach().clone() for p in inputs.frozen],
                buffers=[b.clone() for b in inputs.buffers],
                grads=[(p.grad, None if p.grad is None else p.grad.clone()) for p in inputs.trainable],
                versions=[t._version for t in inputs.arguments],
            )

    def restore(self, inputs: Inputs) -> None:
        """Put back the random generators, parameters, buffers and ``.grad`` of ``inputs`` as they were."""
        set_rng_states(self.rng)
        with torch.no_grad():
            for tensor, value in zip(inputs.state(), self.trainable + self.frozen + self.buffers):
                if not torch.equal(tensor, value):
                    tensor.copy_(value)
            for p, (grad, values) in zip(inputs.trainable, self.grads):
                if grad is not None and not torch.equal(grad, values):
                    grad.copy_(values)
                p.grad = grad


def run_graph(replay: Replay, inputs: Inputs, asserted: dict) -> StepOutputs:
    """One replay: the graph without autograd; a failed assertion raises `CheckFailed`."""
    with torch.no_grad(), failed_assertions(asserted):
        return replay(*inputs.as_args())


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a is b or a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device.type == "cpu" or not a.is_floating_point():
        return bool(torch.equal(a, b)) or bool(a.is_floating_point() and torch.allclose(a, b, 0, 0, equal_nan=True))
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True))  # atomics may reorder sums


def _some(indices: list[int], shown: int = 4) -> str:
    text = ", ".join(map(str, indices[:shown]))
    return text + (f" and {len(indices) - shown} more" if len(indices) > shown else "")


def _differing(a: list, b: list) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y)]


def check_replay(replay: Replay, before: Snapshot, inputs: Inputs, traced: StepOutputs, asserted: dict) -> None:
    """Replay the new graph from the state before the trace and require the traced step's results.

    A step that depends on something the graph does not record (it sets the random generator's
    state for common random numbers; it mutates its own inputs) would be replayed
    differently from eager mode, silently; this finds it once, when the step is traced.
    """
    changed = [t for t, v in zip(inputs.arguments, before.versions) if t._version != v]
    if changed:
        raise updated_arguments_error(changed)
    after = rng_states()
    set_rng_states(before.rng)
    replay_inputs = Inputs(  # the copies taken before the trace: the replay may update them
        trainable=before.trainable, incoming_grads=[g.clone() for g in inputs.incoming_grads],
        frozen=before.frozen, buffers=before.buffers, arguments=inputs.arguments,
    )
    try:
        replayed = run_graph(replay, replay_inputs, asserted)
        replay_rng = rng_states()
    except CheckFailed as failed:
        raise CompileStepError(f"storch.compile_step: the replay of the traced step fails its check "
                               f"({failed.check.message}) that the traced step passed. Run this step eagerly.") from None
    finally:
        set_rng_states(after)
    n_params = len(inputs.trainable) + len(inputs.frozen)
    state = _differing([t.detach() for t in inputs.state()], replay_inputs.state())
    differences = [f"{what} {_some(indices)}" for what, indices in (
        ("outputs", _differing(pytree.tree_leaves(traced), pytree.tree_leaves(replayed))),
        ("parameters", [i for i in state if i < n_params]),
        ("buffers", [i - n_params for i in state if i >= n_params]),
    ) if indices]
    if len(replay_rng) != len(after) or not all(torch.equal(a, b) for a, b in zip(replay_rng, after)):
        differences.append("the state of the random number generator after the step")
    if differences:
        raise CompileStepError(
            "storch.compile_step: replaying the traced graph does not reproduce the traced step "
            f"({', '.join(differences)} differ). The step depends on something the graph does not "
            "record: it sets or reads the random generator's state (for common random numbers, say), "
            "or reads Python state that changes while it runs. Run this step eagerly."
        )


def eager_error(run_step: Callable[[], Any], inputs: Inputs, rng: list[torch.Tensor]) -> BaseException | None:
    """The error the step raises when run eagerly from the random state ``rng``, or ``None``.

    For a check whose eager message names what the trace does not see (``torch.distributions``
    names the parameter, the distribution and the constraint): the step is run once more, eagerly,
    from the state before the failed replay, and everything it changed is put back.
    """
    after = rng_states()
    set_rng_states(rng)
    snapshot = Snapshot.take(inputs)
    try:
        run_step()
    except Exception as error:  # noqa: BLE001 - any error of the step is eager mode's error
        return error
    else:
        return None
    finally:
        snapshot.restore(inputs)
        set_rng_states(after)
        reset()


def _direct_call(op: torch._ops.OpOverload) -> functools.partial:
    """``op``'s C++ handle under a name of its own (``aten_addmm_default``), which torch's code
    generation binds as a global of the generated ``forward``."""
    handle = functools.partial(op._op)
    handle.__name__ = str(op).replace("aten.", "", 1).replace(".", "_")  # type: ignore[attr-defined]
    handle.__module__ = op.namespace  # the generated code calls it aten_addmm_default
    return handle


class GraphReplay:
    """A replay module's flat ``forward`` called with the `Inputs` lists; its outputs read as `StepOutputs`.

    The module's code is torch's default code generation: the graph's placeholders as positional
    arguments and its outputs as a flat list, without the pytree flattening and unflattening of
    ``make_fx``'s code (about 20 us per step); `StepOutputs.from_flat` reads the list by the counts
    of the traced step.
    """

    __slots__ = ("forward", "counts")

    def __init__(self, module: torch.fx.GraphModule, counts: tuple) -> None:
        self.forward = module.forward
        self.counts = counts

    def __call__(self, trainable: list, incoming_grads: list, frozen: list, buffers: list, arguments: list) -> StepOutputs:
        flat = self.forward(*trainable, *incoming_grads, *frozen, *buffers, *arguments)
        return StepOutputs.from_flat(flat, self.counts)


def replay_module(module: torch.fx.GraphModule, traced: StepOutputs) -> GraphReplay:
    """The replay of ``module`` (whose graph returns ``traced``'s structure): a copy whose ``forward``
    (generated by torch) takes the graph's inputs flat and calls each aten operation through its C++
    handle.

    A call through ``torch.ops.aten.addmm.default`` costs an attribute chain and the Python frame of
    ``OpOverload.__call__``, about 1 us per operation: 6 % of an sbn-linear step of 144 operations
    (``benchmarks/sbn_step.py``; measured 2.45 ms against 2.29 ms with handles). The handles enter
    the generated code as named globals; once it is generated, its globals get the bare handles
    (the partials' own call is another 0.1 us per operation).
    """
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, val_map={}))  # torch's default code: flat in, flat out
    handles: dict[Any, functools.partial] = {}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = handles.setdefault(node.target, _direct_call(node.target))
    replay = torch.fx.GraphModule(module, graph)
    generated_globals = type(replay).forward.__globals__
    for name, value in generated_globals.items():
        if any(value is handle for handle in handles.values()):
            generated_globals[name] = value.func
    return GraphReplay(replay, traced.counts())
