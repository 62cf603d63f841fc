"""``storch.compile_step``: a training step traced once into a graph of torch operations, then replayed.

In eager mode storch aligns plates, wraps results and builds the surrogate loss in Python, on every
operation of every step: on a small model that is a fixed cost of a few hundred microseconds per
step (``docs/benchmarks.md``). None of that work depends on the values in the tensors, only on
their shapes and on the structure of the step. So a step can be run once under
``torch.fx.experimental.proxy_tensor.make_fx``, which records every operation the step performs at
the level of ``torch.ops.aten``: the model, the sampling, storch's surrogate loss *and* the backward
pass of ``storch.backward()``. Later calls replay that graph: no storch Python, no plate
bookkeeping, no autograd graph to build, only the recorded tensor operations. The graph can also be
handed to ``torch.compile`` (``backend="inductor"``).

Semantics (see [`compile_step`][storch.compiled_step.compile_step] for the API):

* **The first call is an eager step** (the trace runs the step for real): its values, gradients,
  warnings and errors are those of eager mode. A step in which a module builds state at its first use
  (a critic's network, sized by its first input: `storch._tracing.EagerStepNeeded`) runs eagerly,
  without a trace, and the next call is traced. Each later call with arguments of the same shapes
  replays the graph: the same operations, random draws included, so with ``backend="eager"`` a
  compiled training run follows the eager run for the same seed, up to float rounding where the
  trace records an operation in decomposed form (``tests/test_compiled_step.py``).
* **Gradients**: ``.grad`` of the given modules' parameters ends as the eager step leaves it (the
  incoming ``.grad`` is an input of the graph, so a step that does not zero it accumulates).
  Buffers are inputs too: updates in place (running statistics, a moving average, an annealed
  temperature, an optimizer's moments) reach the module's buffers on every call, and so do updates
  in place of parameters (the control-variate step of RELAX, REBAR and LAX, made by the method's own
  optimizer within ``storch.backward``).
* **State protocol of a module**: a module (a storch method) whose state changes from step to step
  keeps it in buffers and parameters that it updates in place with tensor operations, reading no
  value on the host. A module may define ``prepare_compiled_step() -> tuple``: it is called before
  every call of the compiled step, builds what the module builds lazily (an optimizer), so that the
  trace finds it, and returns further Python settings that a trace bakes in (hashable; an
  optimizer's learning rate), which join the module's attributes below.
* **Checks are kept.** ``torch.distributions`` argument validation and ``F.one_hot``'s range check
  are assertions in the graph on the CPU (off the CPU, outputs read after the step), and storch's
  check that the surrogate loss is finite is read after each replay (one host read per step, as in
  eager mode): a failure raises the error eager mode raises (``ValueError`` naming the parameter
  and the constraint; [`storch.exceptions.NonFiniteCostError`][storch.exceptions.NonFiniteCostError] naming the costs)
  and the
  step's gradients are not applied, nor its updates of parameters and buffers (a replay that fails
  its checks leaves them as they were before it).
* **What cannot be replayed is refused**, with
[`storch.exceptions.CompileStepError`][storch.exceptions.CompileStepError] naming
  it, instead of being baked in silently: a value read on the host during the step (an ``if`` on a
  tensor, ``.item()``, an optimizer that reads its step count), an estimator that keeps state
  between steps outside tensors it updates in place (see
  `storch.method.Method.keeps_state_between_steps`), a tensor that requires grad but is not
  a parameter of the given modules, a storch tensor in the arguments or the result, costs left
  registered without ``storch.backward()``, a step that changes its modules' Python settings or
  updates in place a tensor that is not a buffer or parameter of a given module (or one of its
  arguments). After tracing, the graph is replayed once from the state before the trace and must
  reproduce the traced step (its results, parameters, buffers and the random generator's state).
* A new trace is made when the shapes, dtypes or devices of the arguments or of the modules'
  state change (a buffer made by the first step: two traces), when a non-tensor argument changes
  value (it is part of the graph), or when a module's Python setting changes (``training``, numbers
  and strings kept as attributes, what ``prepare_compiled_step`` returns). Python
  values read from elsewhere (globals, closures) are baked in by the trace.

Not available from a replayed step: ``StochasticTensor.param_grads`` and the plates of the step's
tensors (they live during the trace only), ``print_costs``, and higher-order gradients kept on
``.grad`` (``create_graph=True`` works inside the step; the ``.grad`` it leaves is plain).
"""

from __future__ import annotations

import operator
import os
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from storch import _tracing
from storch.distributions.one_hot import one_hot
from storch.exceptions import CompileStepError
from storch.inference import non_finite_error, registered_costs, reset
from storch.tensor import Tensor as StorchTensor
from storch.tensor import plain

__all__ = ["compile_step", "CompiledStep"]

#: traces of one step beyond which a warning says that its arguments keep changing
MAX_TRACES = 8

_TENSOR = object()  # marks where a tensor goes in a step's result
_SETTING_TYPES = (bool, int, float, str, type(None))
# devices whose checks are assertions in the graph (raising where eager mode does); elsewhere an
# assertion is asynchronous and ends the process, so the check is an output read after the step
_ASSERTED_DEVICES = frozenset({"cpu"})
# prefixes of the recorded checks' messages: the kind of error eager mode raises
_VALIDATION = "[storch.compile_step: ValueError] "
_INDEX = "[storch.compile_step: RuntimeError] "
_REPLAY_NOTE = " (checked in a replay of storch.compile_step; the step's gradients were not applied)."
_TORCH_DIR = os.path.dirname(torch.__file__)
_STORCH_DIR = os.path.dirname(os.path.abspath(__file__))


def compile_step(
    step: Callable[..., Any],
    *modules: nn.Module,
    backend: Union[str, Callable] = "eager",
    **compile_options: Any,
) -> "CompiledStep":
    """Trace the training ``step`` once and replay it as a graph of torch operations.

    Args:
        step: the step as written for eager mode: it samples, registers costs with
            [`storch.add_cost`][storch.add_cost] and calls [`storch.backward`][storch.backward] (its arguments:
            tensors, and
            hashable values that become part of the graph; its result: plain tensors, ``None``,
            numbers or strings, in any nesting of tuples, lists and dicts).
        *modules: the modules whose parameters ``step`` trains (and whose buffers it may update),
            including any estimator or baseline that has parameters of its own. Parameters are
            inputs of the graph; ``.grad`` ends as the eager step would leave it.
        backend: ``"eager"`` (default) runs the recorded operations (simplified: no renaming views,
            no repeated computations) from a generated Python function; any other value is
            given to ``torch.compile(graph, backend=...)`` (e.g. ``"inductor"``, which fuses them;
            its random numbers differ from eager mode's unless
            ``torch._inductor.config.fallback_random = True``). Note that torch's first
            ``torch.compile`` in a process turns off ``torch.distributions``' default argument
            validation for the whole process (``validate_args=True`` still validates).
        **compile_options: further keywords for ``torch.compile`` (``mode``, ``dynamic``, ...).

    Returns:
        A [`CompiledStep`][storch.compiled_step.CompiledStep]: call it as you would call ``step``.

    Raises:
        CompileStepError: (on the call that traces) what the step does that a replay cannot
            reproduce, and where.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> encoder = torch.nn.Linear(4, 3)
        >>> def step(x):
        ...     x = storch.denote_independent(x, 0, "data")
        ...     z = storch.method.ScoreFunction("z", n_samples=2, baseline_factory="batch_average")(
        ...         Bernoulli(logits=encoder(x)))
        ...     storch.add_cost((z - 0.5).pow(2).sum(-1), "f")
        ...     return storch.backward()
        >>> fast_step = storch.compile_step(step, encoder)
        >>> optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
        >>> x = torch.ones(5, 4)
        >>> for _ in range(3):
        ...     optimizer.zero_grad()
        ...     loss = fast_step(x)     # the first call traces (an eager step), the others replay
        ...     optimizer.step()
        >>> fast_step.traces, type(loss).__name__
        (1, 'Tensor')

        ``.grad`` is an input of the graph: without ``zero_grad`` (or with ``set_to_none=False``) a
        call sees existing gradients and accumulates into them, as eager mode does, in a graph of its
        own (a second trace).
    """
    if not callable(step):
        raise TypeError(f"storch.compile_step: step must be callable, got {type(step).__name__}.")
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"storch.compile_step: after the step come the nn.Modules it trains, got "
                f"{type(module).__name__}. Pass other options by keyword (backend=...)."
            )
    if backend != "eager":
        # torch.compile checks the backend and its options here, not after a first (eager) step;
        # and its first use patches torch for the process (among others it turns off
        # torch.distributions' default argument validation), which a trace must see from the start
        torch.compile(_unused, backend=backend, **compile_options)
    return CompiledStep(step, modules, backend, compile_options)


def _unused(x: Any) -> Any:  # pragma: no cover - only handed to torch.compile, never called
    return x


@dataclass
class _Trace:
    """One traced graph and how to read its outputs."""

    run: Callable[..., Any]
    out_spec: Any  # pytree spec of the step's result
    out_constants: list  # the result's leaves, each tensor replaced by _TENSOR
    n_out_tensors: int
    grad_positions: list[int]  # which trainable parameters have a gradient after the step
    check_messages: list[str]  # validations read after the step (off the CPU)
    writes_grads: bool  # the graph writes into the incoming .grad in place: replays get copies
    written_state: list[int]  # parameters and buffers (in _Inputs.state() order) updated in place
    cost_names: list[list[tuple[str, list[str]]]]  # per storch.backward: (cost name, plate names)


@dataclass
class _Inputs:
    """The graph's inputs, in its order: the modules' state, the incoming ``.grad``, the arguments."""

    trainable: list[torch.Tensor]
    incoming_grads: list[torch.Tensor]
    frozen: list[torch.Tensor]
    buffers: list[torch.Tensor]
    arguments: list[torch.Tensor]

    def as_args(self) -> tuple[list, ...]:
        return self.trainable, self.incoming_grads, self.frozen, self.buffers, self.arguments

    def state(self) -> list[torch.Tensor]:
        """The modules' tensors a step may update in place: parameters, then buffers."""
        return self.trainable + self.frozen + self.buffers

    def placeholder_kinds(self) -> list[tuple[str, int]]:
        """``(kind, index)`` of each graph input, in the graph's order; kind ``"state"`` indexes `state`."""
        n_trainable, n_frozen = len(self.trainable), len(self.frozen)
        return ([("state", i) for i in range(n_trainable)] + [("grad", i) for i in range(len(self.incoming_grads))]
                + [("state", n_trainable + i) for i in range(n_frozen + len(self.buffers))]
                + [("argument", i) for i in range(len(self.arguments))])


class CompiledStep:
    """A step traced by [`compile_step`][storch.compiled_step.compile_step]; call it with the step's arguments.

    Attributes:
        traces: the number of graphs traced so far (one per combination of argument shapes).
    """

    def __init__(
        self, step: Callable[..., Any], modules: Iterable[nn.Module], backend: Any, compile_options: dict
    ) -> None:
        self.step = step
        self.modules = tuple(modules)
        self.backend = backend
        self.compile_options = compile_options
        self._cache: dict[Any, _Trace] = {}
        self._warned = False

    @property
    def traces(self) -> int:
        return len(self._cache)

    def graph(self, *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        """The traced graph for these arguments (traced, i.e. run as a step, if it is not yet)."""
        key = self._key(*self._flat_args(args, kwargs), *self._state())
        if key not in self._cache:
            self(*args, **kwargs)
        run = self._cache[key].run
        return getattr(run, "graph_module", None) or getattr(run, "_orig_mod", run)

    def clear(self) -> None:
        """Forget the traced graphs (after changing the step or the modules' structure)."""
        self._cache.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = self._flat_args(args, kwargs)
        params, buffers = self._state()
        key = self._key(leaves, spec, params, buffers)
        inputs = _Inputs(
            trainable=[p for _, p in params if p.requires_grad],
            incoming_grads=[p.grad for _, p in params if p.requires_grad and p.grad is not None],
            frozen=[p for _, p in params if not p.requires_grad],
            buffers=[b for _, b in buffers],
            arguments=[leaf for leaf in leaves if isinstance(leaf, torch.Tensor)],
        )
        trace = self._cache.get(key)
        if trace is None:
            _refuse_registered_costs(_COSTS_BEFORE)
            before = self._settings()
            traced = self._trace(leaves, spec, params, buffers, inputs)
            if traced is None:  # a module builds state at its first use: this call runs eagerly
                return self._eager_step(leaves, spec)
            trace, flat = traced
            self._refuse_changed_settings(before)
            self._cache[key] = trace
            self._warn_if_retracing()
        else:
            if trace.writes_grads:  # a step that fails its checks must leave .grad as it was
                inputs.incoming_grads = [g.clone() for g in inputs.incoming_grads]
            return self._replay(trace, inputs)
        return self._finish(trace, flat, inputs.trainable)

    def _eager_step(self, leaves: list, spec: Any) -> Any:
        """Run the step eagerly (nothing is traced): for a step in which a module builds its state."""
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        result = self.step(*args, **kwargs)
        _refuse_registered_costs(_COSTS_AFTER)
        _result_tensors(pytree.tree_leaves(result))  # no storch tensor in the result, as for a trace
        return result

    def _replay(self, trace: _Trace, inputs: _Inputs) -> Any:
        """Run the graph; a replay that fails its checks restores the parameters and buffers it updated."""
        state = inputs.state()
        saved = [(state[i], state[i].detach().clone()) for i in trace.written_state]
        try:
            with torch.no_grad(), _validation_errors():
                flat = trace.run(*inputs.as_args())
            return self._finish(trace, flat, inputs.trainable)
        except BaseException:
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)
            raise

    def _warn_if_retracing(self) -> None:
        if len(self._cache) > MAX_TRACES and not self._warned:
            self._warned = True
            warnings.warn(
                f"storch.compile_step traced {len(self._cache)} graphs for one step: the shapes of its "
                "arguments, the values of its non-tensor arguments or its modules' Python settings keep "
                "changing. Each new combination is traced (an eager step) and kept.",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ inputs
    def _flat_args(self, args: tuple, kwargs: dict) -> tuple[list, Any]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, StorchTensor):
                raise CompileStepError(
                    "storch.compile_step: an argument is a storch tensor (plates "
                    f"{leaf.plate_names}); its plates belong to another step. Pass plain tensors and "
                    "make storch tensors inside the step (storch.denote_independent, a method)."
                )
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                raise CompileStepError(
                    f"storch.compile_step: an argument of shape {tuple(leaf.shape)} requires grad; a "
                    "compiled step computes gradients for the parameters of the modules given to "
                    "compile_step only. Register it as a parameter of one of them, or detach it."
                )
        return leaves, spec

    def _state(self) -> tuple[list[tuple[tuple, torch.Tensor]], list[tuple[tuple, torch.Tensor]]]:
        """The modules' parameters and buffers, each once, with every slot it fills."""
        found: dict[str, dict[int, tuple[list, torch.Tensor]]] = {"_parameters": {}, "_buffers": {}}
        for module in self.modules:
            for owner in module.modules():
                for kind, table in found.items():
                    for name, value in getattr(owner, kind).items():
                        if value is not None:
                            table.setdefault(id(value), ([], value))[0].append((owner, name))
        return (
            [(tuple(slots), value) for slots, value in found["_parameters"].values()],
            [(tuple(slots), value) for slots, value in found["_buffers"].values()],
        )

    def _key(self, leaves: list, spec: Any, params: list, buffers: list) -> tuple:
        def tensor_key(t: Optional[torch.Tensor]) -> Optional[tuple]:
            return None if t is None else (tuple(t.shape), t.dtype, t.device, t.requires_grad)

        leaf_keys = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                leaf_keys.append(tensor_key(leaf))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise CompileStepError(
                        f"storch.compile_step: a non-tensor argument of type {type(leaf).__name__} is "
                        "not hashable; non-tensor arguments are part of the traced graph (a new value "
                        "is a new trace), so they must be hashable values (numbers, strings, tuples)."
                    ) from None
                leaf_keys.append((type(leaf), leaf))
        return (
            spec,
            tuple(leaf_keys),
            tuple((len(slots), tensor_key(p), tensor_key(p.grad)) for slots, p in params),
            tuple((len(slots), tensor_key(b)) for slots, b in buffers),
            torch.is_grad_enabled(),
            torch.distributions.Distribution._validate_args,
            torch.get_default_dtype(),
            self._settings(),
        )

    def _refuse_changed_settings(self, before: tuple) -> None:
        """A step that changes its modules' Python settings would change them only when traced."""
        after = self._settings()
        if after == before:
            return
        owners = [owner for module in self.modules for owner in module.modules()]
        for owner, old, new in zip(owners, before, after):
            if old != new:
                changed = sorted(set(old) ^ set(new))
                names = sorted({name for name, _ in changed})
                raise CompileStepError(
                    f"storch.compile_step: the step changes the Python settings {names} of its module "
                    f"{type(owner).__name__} ({[c for c in changed if c in set(old)]} -> "
                    f"{[c for c in changed if c in set(new)]}); a replay runs no Python, so they would stay "
                    "as the trace left them. Keep values that change between steps in tensors (buffers) or "
                    "pass them as arguments of the step."
                )

    def _settings(self) -> tuple:
        """The modules' Python settings a trace bakes in: ``training`` (``.eval()`` changes dropout and
        batch norm), every attribute that holds a number, a string or ``None`` (a temperature, a
        number of samples, a KL weight kept on the model), and what a module's
        ``prepare_compiled_step()`` returns (called first: it may build the module's lazy state)."""
        settings = []
        for module in self.modules:
            for owner in module.modules():
                prepare = getattr(owner, "prepare_compiled_step", None)
                extra = tuple(prepare()) if callable(prepare) else ()
                settings.append(tuple((k, v) for k, v in vars(owner).items() if type(v) in _SETTING_TYPES) + extra)
        return tuple(settings)

    # ------------------------------------------------------------------ tracing
    def _trace(
        self, leaves: list, spec: Any, params: list, buffers: list, inputs: _Inputs
    ) -> Optional[tuple[_Trace, list]]:
        """Run the step once under ``make_fx`` (a real step), check that its graph replays it, and
        return the graph with the step's outputs; ``None`` when a module asked for an eager step
        (`storch._tracing.EagerStepNeeded`: the random generators and the state are put back first)."""
        from torch.fx.experimental.proxy_tensor import make_fx  # imported on first use (slow)

        trainable = [(slots, p) for slots, p in params if p.requires_grad]
        frozen = [(slots, p) for slots, p in params if not p.requires_grad]
        had_grad = [i for i, (_, p) in enumerate(trainable) if p.grad is not None]
        slots = [s for s, _ in trainable] + [s for s, _ in frozen] + [s for s, _ in buffers]
        kinds = ["_parameters"] * (len(trainable) + len(frozen)) + ["_buffers"] * len(buffers)
        is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        state = _tracing.TraceState()
        info: dict[str, Any] = {}

        def traced(
            trainable_values: list, incoming_grads: list, frozen_values: list, buffer_values: list, arguments: list
        ) -> list:
            for i, grad in zip(had_grad, incoming_grads):  # accumulation, or zero_grad in the step, is traced
                trainable_values[i].grad = grad
            values = iter(arguments)
            args, kwargs = pytree.tree_unflatten([next(values) if t else leaf for leaf, t in zip(leaves, is_tensor)], spec)
            # graphs handed to torch.compile get their checks as outputs: a compiler may drop assertions
            asserted = _ASSERTED_DEVICES if self.backend == "eager" else frozenset()
            with _swapped(slots, trainable_values + frozen_values + buffer_values, kinds), \
                    _DeferredChecks(state, asserted):
                result = self.step(*args, **kwargs)
            _refuse_registered_costs(_COSTS_AFTER)
            out_leaves, info["out_spec"] = pytree.tree_flatten(result)
            info["out_constants"] = [_TENSOR if isinstance(v, torch.Tensor) else v for v in out_leaves]
            grads = [p.grad for p in trainable_values]
            info["grad_positions"] = [i for i, g in enumerate(grads) if g is not None]
            checks = [valid for valid, _ in state.checks]
            losses = [loss for loss, _ in state.losses]
            costs = [values for _, named in state.losses for _, values, _ in named]
            flat = _result_tensors(out_leaves) + [g for g in grads if g is not None] + checks + losses + costs
            flat.append(_all_ok(checks, losses, trainable_values))
            info["flat"] = flat
            return flat

        graph_inputs = _Inputs(
            trainable=[p.detach().requires_grad_() for p in inputs.trainable],
            incoming_grads=[g.clone() for g in inputs.incoming_grads],
            frozen=[p.detach() for p in inputs.frozen],
            buffers=inputs.buffers,
            arguments=inputs.arguments,
        )
        before = _Snapshot.take(inputs)
        grad_versions = [g._version for g in graph_inputs.incoming_grads]
        token = _tracing.start(state)
        try:
            graph = make_fx(traced, tracing_mode="real")(*graph_inputs.as_args())
        except _tracing.EagerStepNeeded:
            before.restore(inputs)
            return None
        except CompileStepError:  # a refusal by name, from within the step
            raise
        except RuntimeError as error:
            if "get value out of a tracing tensor" in str(error) or "data-dependent" in str(error):
                raise CompileStepError(_host_read_message(error)) from error
            raise
        finally:
            _tracing.stop(token)
            reset()
        _refuse_captured_grad_tensors(graph)
        _refuse_updated_constants(graph)
        written = _written_inputs(graph, inputs.placeholder_kinds())
        _refuse_updated_arguments(written, inputs)
        replay = replay_function(graph)  # simplifies the graph in place
        _check_replay(replay, before, inputs, info["flat"])
        if self.backend == "eager":
            run = replay
        else:
            run = torch.compile(graph, backend=self.backend, **self.compile_options)
        trace = _Trace(
            run=run,
            out_spec=info["out_spec"],
            out_constants=info["out_constants"],
            n_out_tensors=sum(v is _TENSOR for v in info["out_constants"]),
            grad_positions=info["grad_positions"],
            check_messages=[message for _, message in state.checks],
            writes_grads=any(g._version != v for g, v in zip(graph_inputs.incoming_grads, grad_versions)),
            written_state=sorted(i for kind, i in written if kind == "state"),
            cost_names=[[(name, plates) for name, _, plates in named] for _, named in state.losses],
        )
        return trace, info["flat"]

    # ------------------------------------------------------------------ results
    def _finish(self, trace: _Trace, flat: list, trainable: list[torch.Tensor]) -> Any:
        n_grads = len(trace.grad_positions)
        n_checks = len(trace.check_messages)
        n_losses = len(trace.cost_names)
        i = trace.n_out_tensors
        out_tensors, grads = flat[:i], flat[i:i + n_grads]
        i += n_grads
        checks, losses = flat[i:i + n_checks], flat[i + n_checks:i + n_checks + n_losses]
        costs = flat[i + n_checks + n_losses:-1]
        if not bool(flat[-1]):  # one host read per step, as eager storch.backward's finite check
            _raise_failed_check(trace, checks, losses, costs)
        final = dict(zip(trace.grad_positions, grads))
        for position, p in enumerate(trainable):  # what the traced step left in .grad, incoming included
            p.grad = final.get(position)
        values = iter(out_tensors)
        leaves = [next(values) if v is _TENSOR else v for v in trace.out_constants]
        return pytree.tree_unflatten(leaves, trace.out_spec)


# ---------------------------------------------------------------------- helpers of the trace
class _swapped:
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

    def __exit__(self, *exc: Any) -> None:
        for table, name, value in reversed(self.saved):
            table[name] = value
        self.saved.clear()


class _DeferredChecks(TorchFunctionMode):
    """Keep the checks of ``torch.distributions`` and ``F.one_hot`` in the graph without a host read.

    Argument validation computes a boolean tensor and branches on it (``if not
    torch._is_all_true(valid): raise``); ``F.one_hot`` reads the range of its indices on the host.
    In the trace the check is decided on the real value (the traced call is a real step, and raises
    torch's error as eager mode does) and recorded for the replays: on the CPU as an assertion in
    the graph, which raises where eager mode would; on other devices as an output that
    [`CompiledStep`][storch.compiled_step.CompiledStep] reads once per step (an assertion there would be asynchronous
    and end the
    process). ``F.one_hot`` with ``num_classes`` given is computed by comparison with
    ``arange(num_classes)`` (the same result for indices in range).
    """

    def __init__(self, state: _tracing.TraceState, asserted_devices: frozenset) -> None:
        super().__init__()
        self.state = state
        self.asserted_devices = asserted_devices

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._is_all_true:
            self._check(plain(func(*args, **kwargs)), _VALIDATION + _validation_message(sys._getframe(1)))
            return True
        if func is F.one_hot:
            index = args[0]
            n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            if isinstance(n, int) and n >= 0:
                self._check(plain(((index >= 0) & (index < n)).all()),
                            _INDEX + f"F.one_hot: every class index must lie in [0, {n}) (num_classes={n})")
                return one_hot(index, n, torch.long)
        return func(*args, **kwargs)

    def _check(self, valid: torch.Tensor, marked_message: str) -> None:
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        with disable_proxy_modes_tracing():
            holds = bool(valid)
        if not holds:
            raise _check_error(marked_message)
        if valid.device.type in self.asserted_devices:
            torch._assert_async(valid, marked_message)
        else:
            self.state.note_check(valid, marked_message)


def _check_error(marked_message: str, after: str = "") -> Exception:
    """The exception eager mode raises for a failed check (its message carries a kind marker)."""
    for marker, kind in ((_VALIDATION, ValueError), (_INDEX, RuntimeError)):
        if marked_message.startswith(marker):
            return kind(marked_message[len(marker):] + after)
    return RuntimeError(marked_message + after)


class _validation_errors:
    """Turn a failed check of a replay back into the error eager mode raises (``ValueError`` for
    ``torch.distributions`` validation)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        if isinstance(error, RuntimeError) and str(error).startswith((_VALIDATION, _INDEX)):
            raise _check_error(str(error), _REPLAY_NOTE) from None
        return False


def _validation_message(frame: Any) -> str:
    """The error ``torch.distributions`` would raise, rebuilt from its validating frame's variables."""
    for _ in range(4):
        if frame is None:
            break
        if frame.f_code.co_filename.endswith(os.path.join("distributions", "distribution.py")):
            names = frame.f_locals
            owner = type(names.get("self")).__name__
            value = names.get("value")
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else "?"
            if "constraint" in names and "param" in names:
                return (
                    f"Expected parameter {names['param']} (tensor of shape {shape}) of distribution {owner} "
                    f"to satisfy the constraint {names['constraint']!r}, but found invalid values"
                )
            if "support" in names:
                return (
                    f"Expected value argument (tensor of shape {shape}) to be within the support "
                    f"({names['support']!r}) of the distribution {owner}, but found invalid values"
                )
        frame = frame.f_back
    return "A torch.distributions argument validation failed"


def _result_tensors(leaves: list) -> list[torch.Tensor]:
    tensors = []
    for leaf in leaves:
        if isinstance(leaf, StorchTensor):
            raise CompileStepError(
                f"storch.compile_step: the step returns a storch tensor (plates {leaf.plate_names}); its "
                "plates exist during the trace only. Return plain tensors: the value of "
                "storch.backward(), storch.reduce_plates(t), or t._tensor for the raw values."
            )
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf.detach())
    return tensors


def _all_ok(checks: list[torch.Tensor], losses: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """One boolean for every check of the step: validations hold and surrogate losses are finite."""
    flags = [c.reshape(()).bool() for c in checks] + [torch.isfinite(loss).reshape(()) for loss in losses]
    if not flags:
        device = params[0].device if params else None
        return torch.ones((), dtype=torch.bool, device=device)
    devices = {f.device for f in flags}
    if len(devices) > 1:
        flags = [f.cpu() for f in flags]
    return torch.stack(flags).all()


def _frame_text(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} ({frame.name}): {frame.line}"


def _host_read_message(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    outside_torch = [f for f in frames if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__]
    user = [f for f in outside_torch if not f.filename.startswith(_STORCH_DIR)]
    where = f" at {_frame_text(user[-1])}" if user else ""
    inner = outside_torch[-1] if outside_torch else None
    if inner is not None and inner.filename.startswith(_STORCH_DIR):
        where += f" (in storch: {_frame_text(inner)})"
    return (
        f"storch.compile_step: the step reads a tensor's value on the host{where}: an `if` on a "
        "tensor, .item(), bool(), float() or .tolist(). A traced step is replayed as a fixed graph, "
        "so it cannot branch on values. Compute with tensor operations instead (torch.where, "
        "torch.clamp), move the read out of the step, or run the step eagerly."
    )


def _refuse_captured_grad_tensors(graph: torch.fx.GraphModule) -> None:
    """Refuse tensors that require grad and entered the graph as constants (not as parameters)."""
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(graph)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise CompileStepError(
                f"storch.compile_step: the step uses a tensor of shape {tuple(value.shape)} that requires "
                "grad but is not a parameter of the modules given to compile_step (a tensor captured "
                "from outside, a parameter of another module, or an optimizer step inside the step). "
                "Its gradient would be lost in a replay. Pass the module that owns it to "
                "storch.compile_step(step, *modules), and keep optimizer steps outside the step."
            )


def _written_arguments(node: torch.fx.Node) -> list[Any]:
    """The arguments an operation writes into (``add_``'s self, ``copy_``'s destination, ``out=``)."""
    schema = node.target._schema
    written: list[Any] = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            written.extend(value if isinstance(value, (list, tuple)) else [value])  # _foreach_add_'s lists
    return written


def _written_inputs(graph: torch.fx.GraphModule, kinds: list[tuple[str, int]]) -> set[tuple[str, int]]:
    """The graph's inputs (``(kind, index)`` from `_Inputs.placeholder_kinds`) that an operation updates
    in place, directly or through a view of them."""
    sources: dict[torch.fx.Node, tuple[str, int]] = {}
    placeholders = iter(kinds)
    written = set()
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            sources[node] = next(placeholders)
        elif node.op != "call_function":
            continue
        elif _is_mutation(node):
            targets = _written_arguments(node)
            written.update(sources[t] for t in targets if isinstance(t, torch.fx.Node) and t in sources)
        elif _is_view(node) and node.args and node.args[0] in sources:
            sources[node] = sources[node.args[0]]
    return written


def _refuse_updated_arguments(written: set[tuple[str, int]], inputs: _Inputs) -> None:
    """Refuse a step that updates one of its tensor arguments in place: the caller's data would change
    on every replay."""
    changed = sorted(i for kind, i in written if kind == "argument")
    if changed:
        raise CompileStepError(
            f"storch.compile_step: the step changes {len(changed)} of its arguments in place (shapes "
            f"{[tuple(inputs.arguments[i].shape) for i in changed]}; an in-place operation on the data). "
            "Work on a copy (x = x.clone()) or keep such updates outside the compiled step."
        )


def _refuse_updated_constants(graph: torch.fx.GraphModule) -> None:
    """Refuse a step that updates in place a tensor it did not get as an input.

    Such a tensor (a plain tensor attribute, a buffer of a module not given to compile_step) enters
    the graph as a constant; the trace has already updated it once, and a replay cannot be checked
    against the state before the trace. Buffers of the given modules are inputs and are fine.
    """
    constant_views: dict[torch.fx.Node, torch.fx.Node] = {}  # node -> the constant it views
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            constant_views[node] = node
        elif node.op != "call_function":
            continue
        elif _is_mutation(node):
            for target in _written_arguments(node):
                if isinstance(target, torch.fx.Node) and target in constant_views:
                    value = operator.attrgetter(constant_views[target].target)(graph)
                    raise CompileStepError(
                        f"storch.compile_step: the step updates in place ({node.target}) a tensor of shape "
                        f"{tuple(value.shape)} that is not an input of the step: a plain tensor attribute, or "
                        "a buffer of a module not given to compile_step. Register it as a buffer "
                        "(module.register_buffer) of a module you pass to storch.compile_step(step, *modules)."
                    )
        elif _is_view(node) and node.args and node.args[0] in constant_views:
            constant_views[node] = constant_views[node.args[0]]


def _raise_failed_check(trace: _Trace, checks: list, losses: list, costs: list) -> None:
    for valid, message in zip(checks, trace.check_messages):
        if not bool(valid.all()):
            raise _check_error(message, _REPLAY_NOTE)
    costs_iter = iter(costs)
    for loss, named in zip(losses, trace.cost_names):
        values = [(name, next(costs_iter), plates) for name, plates in named]
        if not bool(torch.isfinite(loss)):
            raise non_finite_error(loss.item(), values, "storch.compile_step applied none of the step's gradients.")
    raise RuntimeError("storch.compile_step: internal error: a check failed but none of its parts did")


_COSTS_BEFORE = (
    "are registered before the step runs (left over from a step that raised before storch.backward()?); "
    "they would enter every replay as constants. Call storch.reset() first."
)
_COSTS_AFTER = "were registered by the step, which did not call storch.backward(); end the step with it."


def _refuse_registered_costs(reason: str) -> None:
    """Costs in the registry around a trace: from before it (they would be constants of the graph)
    or left by the step (nothing would differentiate them)."""
    costs = registered_costs()
    if costs:
        raise CompileStepError(f"storch.compile_step: costs {[c.name for c in costs]} {reason}")


# ---------------------------------------------------------------------- the replay check
def _rng_states() -> list[torch.Tensor]:
    """The states of the default random number generators (CPU, and CUDA devices once used)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


@dataclass
class _Snapshot:
    """What a step may change, taken before its trace: the random generators, copies of the
    parameters and buffers (which it may update in place), and the versions of its arguments."""

    rng: list[torch.Tensor]
    trainable: list[torch.Tensor]
    frozen: list[torch.Tensor]
    buffers: list[torch.Tensor]
    versions: list[int]

    @classmethod
    def take(cls, inputs: _Inputs) -> "_Snapshot":
        with torch.no_grad():
            return cls(
                rng=_rng_states(),
                trainable=[p.detach().clone() for p in inputs.trainable],
                frozen=[p.detach().clone() for p in inputs.frozen],
                buffers=[b.clone() for b in inputs.buffers],
                versions=[t._version for t in inputs.arguments],
            )

    def restore(self, inputs: _Inputs) -> None:
        """Put back the random generators, parameters and buffers of ``inputs`` as they were."""
        _set_rng_states(self.rng)
        with torch.no_grad():
            for tensor, value in zip(inputs.state(), self.trainable + self.frozen + self.buffers):
                if not torch.equal(tensor, value):
                    tensor.copy_(value)


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


def _check_replay(replay: Callable[..., list], before: _Snapshot, inputs: _Inputs, traced: list) -> None:
    """Replay the new graph from the state before the trace and require the traced step's results.

    A step that depends on something the graph does not record (it sets the random generator's
    state, as SPSA's common random numbers do; it mutates its own inputs) would be replayed
    differently from eager mode, silently; this finds it once, when the step is traced.
    """
    changed = [t for t, v in zip(inputs.arguments, before.versions) if t._version != v]
    if changed:
        raise CompileStepError(
            f"storch.compile_step: the step changes {len(changed)} of its arguments in place "
            f"(shapes {[tuple(t.shape) for t in changed]}; an in-place operation on the data). "
            "Work on a copy (x = x.clone()) or keep such updates outside the compiled step."
        )
    after = _rng_states()
    _set_rng_states(before.rng)
    try:
        replay_inputs = _Inputs(  # the copies taken before the trace: the replay may update them
            trainable=before.trainable,
            incoming_grads=[g.clone() for g in inputs.incoming_grads],
            frozen=before.frozen,
            buffers=before.buffers,
            arguments=inputs.arguments,
        )
        with torch.no_grad(), _validation_errors():
            replayed = replay(*replay_inputs.as_args())
        replay_rng = _rng_states()
    finally:
        _set_rng_states(after)
    outputs = [i for i, (a, b) in enumerate(zip(traced, replayed)) if not _same(a, b)]
    state = [i for i, (a, b) in enumerate(zip(inputs.state(), replay_inputs.state())) if not _same(a.detach(), b)]
    n_params = len(inputs.trainable) + len(inputs.frozen)
    params, buffers = [i for i in state if i < n_params], [i - n_params for i in state if i >= n_params]
    differences = [f"{what} {_some(indices)}" for what, indices in
                   (("outputs", outputs), ("parameters", params), ("buffers", buffers)) if indices]
    if len(replay_rng) != len(after) or not all(torch.equal(a, b) for a, b in zip(replay_rng, after)):
        differences.append("the state of the random number generator after the step")
    if differences:
        raise CompileStepError(
            "storch.compile_step: replaying the traced graph does not reproduce the traced step "
            f"({', '.join(differences)} differ). The step depends on something the graph does not "
            "record: it sets or reads the random generator's state (as SPSA's common random numbers "
            "do), or reads Python state that changes while it runs. Run this step eagerly."
        )


# ---------------------------------------------------------------------- the replay function
_aten = torch.ops.aten
_ALIASES = {_aten.detach.default, _aten.alias.default}  # under no_grad these only rename a tensor
_SAME_SHAPE_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.expand.default}


def _shape_and_stride(node: Any) -> Optional[tuple]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return (tuple(value.shape), value.stride()) if isinstance(value, torch.Tensor) else None


def _is_identity(node: torch.fx.Node) -> bool:
    """A node whose result is its first argument under another name (a replay needs no autograd)."""
    if node.target in _ALIASES:
        return True
    if node.target in _SAME_SHAPE_VIEWS or node.target is _aten.permute.default:
        source = node.args[0]
        if node.target is _aten.permute.default and list(node.args[1]) != list(range(len(node.args[1]))):
            return False
        meta = _shape_and_stride(node)
        return meta is not None and meta == _shape_and_stride(source)
    return False


def _is_profiler_range(node: torch.fx.Node) -> bool:
    """``record_function``'s entry and exit (an optimizer's ``step`` opens one): nothing to replay."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "profiler"


def _is_mutation(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _is_view(node: torch.fx.Node) -> bool:
    """An operation that returns a view of an argument without writing (``view``, ``expand``, ...)."""
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and any(r.alias_info is not None for r in target._schema.returns))


def _written_later(node: torch.fx.Node) -> bool:
    """Whether an update in place reaches ``node``'s result, directly or through views of it."""
    return any(_is_mutation(user) or (_is_view(user) and _written_later(user)) for user in node.users)


def _is_mergeable(node: torch.fx.Node) -> bool:
    """A computation on tensors whose fresh result depends on its arguments only (no mutation, no
    random draw, no view, no factory) and is never updated in place: two of them with the same
    arguments are one."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or _is_mutation(node) or _is_view(node):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or target._schema.name.startswith("aten::_assert"):
        return False
    return bool(node.all_input_nodes) and not _written_later(node)


def _hashable(arg: Any) -> Any:
    if isinstance(arg, (list, tuple)):
        return (type(arg), tuple(_hashable(a) for a in arg))
    if isinstance(arg, torch.fx.Node):
        return ("node", arg)
    return (type(arg), repr(arg))


def _simplify(graph: torch.fx.Graph) -> None:
    """Drop profiler ranges, renaming nodes (``detach``, views to the same shape and strides),
    repeated pure operations (a ``log_prob`` the step and an estimator both compute), and dead code."""
    seen: dict[Any, torch.fx.Node] = {}
    for node in reversed(list(graph.nodes)):  # a profiler range's exit before its entry
        if node.op == "call_function" and _is_profiler_range(node) and not node.users:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _is_identity(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        if _is_mutation(node):
            seen.clear()  # an operation after an update in place may not reuse one from before it
        elif _is_mergeable(node):
            key = (node.target, _hashable(node.args), _hashable(sorted(node.kwargs.items())))
            earlier = seen.get(key)
            if earlier is None:
                seen[key] = node
            else:
                node.replace_all_uses_with(earlier)
                graph.erase_node(node)
    graph.eliminate_dead_code()  # keeps side effects (the validation assertions, in-place updates)


def replay_function(module: torch.fx.GraphModule) -> Callable[..., list]:
    """A plain Python function that runs the operations of the traced graph ``module``.

    The graph is simplified first (`_simplify`); each operation is called through its
    ``OpOverload``'s C++ handle (no Python frame per operation), and each value is deleted after
    its last use, as in the graph module's own code. Called as ``run(trainable, incoming_grads,
    frozen, buffers, arguments)`` (five lists of tensors), under ``torch.no_grad()``.
    """
    graph = module.graph
    _simplify(graph)
    module.recompile()  # its own code follows the simplified graph
    nodes = list(graph.nodes)
    last_use: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for source in node.all_input_nodes:
            last_use[source] = i
    scope: dict[str, Any] = {}

    def constant(value: Any) -> str:
        name = f"_k{len(scope)}"
        scope[name] = value
        return name

    def text(arg: Any) -> str:
        if isinstance(arg, torch.fx.Node):
            return arg.name
        if isinstance(arg, (list, tuple)):
            inner = ", ".join(text(a) for a in arg)
            return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
        if arg is None or type(arg) in (bool, int, str):
            return repr(arg)
        return constant(arg)  # floats (inf, nan), dtypes, devices, memory formats, ...

    inputs = [node.name for node in nodes if node.op == "placeholder"]
    lines = []
    for i, node in enumerate(nodes):
        if node.op == "get_attr":
            lines.append(f"{node.name} = {constant(operator.attrgetter(node.target)(module))}")
        elif node.op == "call_function":
            target = node.target._op if isinstance(node.target, torch._ops.OpOverload) else node.target
            arguments = [text(a) for a in node.args] + [f"{k}={text(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{node.name} = {constant(target)}({', '.join(arguments)})")
        elif node.op == "output":
            lines.append(f"return {text(node.args[0])}")
            continue
        elif node.op != "placeholder":
            raise CompileStepError(f"storch.compile_step: internal error: graph node {node.op} {node.target}")
        dead = [s.name for s in node.all_input_nodes if last_use.get(s) == i and s.op != "placeholder"]
        if dead:
            lines.append(f"del {', '.join(dead)}")
    source = f"def replay({', '.join(inputs)}):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile(source, "<storch.compile_step replay>", "exec"), scope)
    replay = scope["replay"]

    def run(trainable: list, incoming_grads: list, frozen: list, buffers: list, arguments: list) -> list:
        return replay(*trainable, *incoming_grads, *frozen, *buffers, *arguments)

    run.source = source  # type: ignore[attr-defined]
    run.graph_module = module  # type: ignore[attr-defined]
    return run
