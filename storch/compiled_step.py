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

Semantics (see `storch.compiled_step.compile_step` for the API):

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
  eager mode): a failure raises the error eager mode raises (``ValueError`` naming the parameter and
  the constraint; `storch.exceptions.NonFiniteCostError` naming the costs) and the step's gradients
  are not applied, nor its updates of parameters and buffers (a replay that fails its checks leaves
  them as they were before it). The ``ValueError`` of a validation that fails in a replay is torch's
  own: the step is run once more, eagerly, from the state before the replay (and everything it
  changes is put back), so that torch names the parameter and the constraint.
* **What cannot be replayed is refused**, with `storch.exceptions.CompileStepError` naming it,
  instead of being baked in silently: a value read on the host during the step (an ``if`` on a
  tensor, ``.item()``, ``.numpy()``, ``.tolist()``, numpy conversion, printing, an optimizer that
  reads its step count: an action handed to a numpy environment) and a tensor made from numpy data
  (`storch._compile.refusals.HostReads`), an estimator that keeps state
  between steps outside tensors it updates in place (its declared ``step_state`` is
  ``StepState.host(reason)``: see `storch.state`), a tensor that requires grad but is not a
  parameter of the given modules, a storch tensor in the arguments or the result, costs left
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

The implementation lives in ``storch._compile``: ``inputs`` (arguments, state, the key of a trace),
``trace`` (the step under ``make_fx``), ``checks`` (the checks a replay keeps), ``refusals`` (what a
replay cannot reproduce), ``passes`` (the graph simplified with torch's FX passes) and ``replay``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from storch import _tracing
from storch._compile import checks as _checks
from storch._compile.checks import Check, CheckFailed
from storch._compile.inputs import (
    Inputs,
    cache_key,
    flat_arguments,
    module_state,
    refuse_changed_settings,
    settings,
)
from storch._compile.passes import simplify
from storch._compile.refusals import (
    COSTS_AFTER,
    COSTS_BEFORE,
    refuse_captured_grad_tensors,
    refuse_registered_costs,
    refuse_updated_arguments,
    refuse_updated_constants,
    result_tensors,
    written_inputs,
)
from storch._compile.replay import (
    Replay,
    Snapshot,
    check_replay,
    eager_error,
    replay_module,
    rng_states,
    run_graph,
)
from storch._compile.trace import TENSOR, StepOutputs, TraceRecord, trace_step
from storch.inference import non_finite_error

__all__ = ["CompiledStep", "compile_step"]

#: traces of one step beyond which a warning says that its arguments keep changing
MAX_TRACES = 8

_REPLAY_NOTE = " (checked in a replay of storch.compile_step; the step's gradients were not applied)."


def compile_step(
    step: Callable[..., Any],
    *modules: nn.Module,
    backend: str | Callable = "eager",
    **compile_options: Any,
) -> CompiledStep:
    """Trace the training ``step`` once and replay it as a graph of torch operations.

    Args:
        step: the step as written for eager mode: it samples, registers costs with
            `storch.add_cost` and calls `storch.backward` (its arguments:
            tensors, and
            hashable values that become part of the graph; its result: plain tensors, ``None``,
            numbers or strings, in any nesting of tuples, lists and dicts).
        *modules: the modules whose parameters ``step`` trains (and whose buffers it may update),
            including any estimator or baseline that has parameters of its own. Parameters are
            inputs of the graph; ``.grad`` ends as the eager step would leave it.
        backend: ``"eager"`` (default) runs the recorded operations (simplified: no renaming views,
            no repeated computations) through the graph module's own code; any other value is
            given to ``torch.compile(graph, backend=...)`` (e.g. ``"inductor"``, which fuses them;
            its random numbers differ from eager mode's unless
            ``torch._inductor.config.fallback_random = True``). Note that torch's first
            ``torch.compile`` in a process turns off ``torch.distributions``' default argument
            validation for the whole process (``validate_args=True`` still validates).
        **compile_options: further keywords for ``torch.compile`` (``mode``, ``dynamic``, ...).
            On a GPU, ``backend="inductor", mode="reduce-overhead"`` replays the step as CUDA
            graphs (one launch for the whole step); each replay then copies its outputs (the
            ``.grad`` it sets, its result) out of the graphs' memory, which the next replay reuses.

    Returns:
        A `storch.compiled_step.CompiledStep`: call it as you would call ``step``.

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


def uses_cuda_graphs(compile_options: dict) -> bool:
    """Whether ``torch.compile(..., **compile_options)`` runs the graph as CUDA graphs (on a CUDA
    device): the modes ``"reduce-overhead"`` and ``"max-autotune"``, or the inductor option
    ``"triton.cudagraphs"``.

    Examples:
        >>> uses_cuda_graphs({"mode": "reduce-overhead"}), uses_cuda_graphs({})
        (True, False)
    """
    mode = compile_options.get("mode")
    options = compile_options.get("options") or {}
    return mode in ("reduce-overhead", "max-autotune") or bool(options.get("triton.cudagraphs"))


def _unused(x: Any) -> Any:  # pragma: no cover - only handed to torch.compile, never called
    return x


@dataclass
class _Trace:
    """One traced graph, how to run it, and how to read its outputs."""

    run: Replay
    module: torch.fx.GraphModule  # the simplified graph (`CompiledStep.graph`)
    record: TraceRecord
    writes_grads: bool  # the graph writes into the incoming .grad in place: replays get copies
    written_state: list[int]  # parameters and buffers (in Inputs.state() order) updated in place
    reruns_for_message: bool  # a failed check's eager message needs an eager run (rng kept per replay)
    cuda_graphs: bool = False  # run by CUDA graphs: each replay marks a new step, outputs are copied


class CompiledStep:
    """A step traced by `storch.compiled_step.compile_step`; call it with the step's arguments.

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
        """The traced graph for these arguments, as replayed (traced, i.e. run as a step, if it is not yet)."""
        leaves, spec = flat_arguments(args, kwargs)
        key = cache_key(leaves, spec, *module_state(self.modules), settings(self.modules))
        if key not in self._cache:
            self(*args, **kwargs)
        return self._cache[key].module

    def clear(self) -> None:
        """Forget the traced graphs (after changing the step or the modules' structure)."""
        self._cache.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = flat_arguments(args, kwargs)
        params, buffers = module_state(self.modules)
        key = cache_key(leaves, spec, params, buffers, settings(self.modules))
        inputs = Inputs.of(params, buffers, leaves)
        trace = self._cache.get(key)
        if trace is not None:
            return self._replay(trace, inputs, leaves, spec)
        refuse_registered_costs(COSTS_BEFORE)
        before = settings(self.modules)
        traced = self._trace(leaves, spec, params, buffers, inputs)
        if traced is None:  # a module builds state at its first use: this call runs eagerly
            return self._eager_step(leaves, spec)
        trace, outputs = traced
        refuse_changed_settings(self.modules, before, settings(self.modules))
        self._cache[key] = trace
        self._warn_if_retracing()
        return self._finish(trace, outputs, inputs.trainable)

    def _run_eagerly(self, leaves: list, spec: Any) -> Any:
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return self.step(*args, **kwargs)

    def _eager_step(self, leaves: list, spec: Any) -> Any:
        """Run the step eagerly (nothing is traced): for a step in which a module builds its state."""
        result = self._run_eagerly(leaves, spec)
        refuse_registered_costs(COSTS_AFTER)
        result_tensors(pytree.tree_leaves(result))  # no storch tensor in the result, as for a trace
        return result

    def _trace(self, leaves: list, spec: Any, params: list, buffers: list, inputs: Inputs) -> tuple | None:
        """Trace the step (a real step), refuse what a replay cannot reproduce, simplify the graph and
        check that it replays the step; ``None`` when a module asked for an eager step
        (`storch._tracing.EagerStepNeeded`: the random generators and the state are put back first)."""
        before = Snapshot.take(inputs)
        # graphs handed to torch.compile get their checks as outputs: a compiler may drop assertions
        asserted = _checks.ASSERTED_DEVICES if self.backend == "eager" else frozenset()
        try:
            graph, record, writes_grads = trace_step(self.step, leaves, spec, params, buffers, inputs, asserted)
        except _tracing.EagerStepNeeded:
            before.restore(inputs)
            return None
        refuse_captured_grad_tensors(graph)
        refuse_updated_constants(graph)
        written = written_inputs(graph, inputs.placeholder_kinds())
        refuse_updated_arguments(written, inputs.arguments)
        module = simplify(graph)
        replay = replay_module(module, record.outputs)
        check_replay(replay, before, inputs, record.outputs, record.asserted)
        run = replay if self.backend == "eager" else torch.compile(
            module, backend=self.backend, **self.compile_options)
        checks = [*record.deferred, *record.asserted.values()]
        trace = _Trace(
            run=run, module=module, record=record, writes_grads=writes_grads,
            written_state=sorted(i for kind, i in written if kind == "state"),
            reruns_for_message=any(check.rerun_for_message for check in checks),
            cuda_graphs=self.backend != "eager" and uses_cuda_graphs(self.compile_options),
        )
        return trace, record.outputs

    def _replay(self, trace: _Trace, inputs: Inputs, leaves: list, spec: Any) -> Any:
        """Run the graph; a replay that fails its checks puts back the parameters and buffers it
        updated and raises eager mode's error."""
        state = inputs.state()
        saved = [(state[i], state[i].detach().clone()) for i in trace.written_state]
        rng = rng_states() if trace.reruns_for_message else []
        if trace.writes_grads:  # a step that fails its checks must leave .grad as it was
            inputs.incoming_grads = [g.clone() for g in inputs.incoming_grads]
        try:
            if trace.cuda_graphs:  # the outputs of the previous replay are ours (copied): reuse its memory
                torch.compiler.cudagraph_mark_step_begin()
            outputs = run_graph(trace.run, inputs, trace.record.asserted)
            if trace.cuda_graphs:  # the graph's memory is overwritten by the next replay
                outputs = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, outputs)
            return self._finish(trace, outputs, inputs.trainable)
        except BaseException as error:
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)
            if isinstance(error, CheckFailed):
                raise self._check_error(error.check, inputs, leaves, spec, rng) from None
            raise

    def _check_error(self, check: Check, inputs: Inputs, leaves: list, spec: Any, rng: list) -> BaseException:
        """The error of a failed check: eager mode's own, from an eager run, where its message names
        what the trace does not see; otherwise the check's."""
        if check.rerun_for_message and rng:
            error = eager_error(lambda: self._run_eagerly(leaves, spec), inputs, rng)
            if isinstance(error, check.error):
                if hasattr(error, "add_note"):  # Python 3.11
                    error.add_note(_REPLAY_NOTE.strip(" ."))
                return error
        return check.exception(_REPLAY_NOTE)

    def _warn_if_retracing(self) -> None:
        if len(self._cache) > MAX_TRACES and not self._warned:
            self._warned = True
            warnings.warn(
                f"storch.compile_step traced {len(self._cache)} graphs for one step: the shapes of its "
                "arguments, the values of its non-tensor arguments or its modules' Python settings keep "
                "changing. Each new combination is traced (an eager step) and kept.",
                stacklevel=3,
            )

    def _finish(self, trace: _Trace, outputs: StepOutputs, trainable: list[torch.Tensor]) -> Any:
        """Check the step (one host read, as eager ``storch.backward``'s finite check), then set
        ``.grad`` as the traced step left it and rebuild the step's result."""
        record = trace.record
        if not bool(outputs.ok):
            _raise_failed_check(record, outputs)
        final = dict(zip(record.grad_positions, outputs.grads))
        for position, p in enumerate(trainable):  # what the traced step left in .grad, incoming included
            p.grad = final.get(position)
        values = iter(outputs.result)
        leaves = [next(values) if v is TENSOR else v for v in record.out_constants]
        return pytree.tree_unflatten(leaves, record.out_spec)


def _raise_failed_check(record: TraceRecord, outputs: StepOutputs) -> None:
    """Raise for the first check read after the step that fails: `CheckFailed`, or the
    `storch.exceptions.NonFiniteCostError` of a surrogate loss."""
    for valid, check in zip(outputs.checks, record.deferred):
        if not bool(valid.all()):
            raise CheckFailed(check)
    for loss, costs, named in zip(outputs.losses, outputs.costs, record.cost_names):
        if not bool(torch.isfinite(loss)):
            values = [(name, value, plates) for (name, plates), value in zip(named, costs)]
            raise non_finite_error(loss.item(), values, "storch.compile_step applied none of the step's gradients.")
    raise RuntimeError("storch.compile_step: internal error: a check failed but none of its parts did")
