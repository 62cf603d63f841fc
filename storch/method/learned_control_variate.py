"""Control variates trained on the variance of the gradient estimate (Grathwohl et al. 2018, §3.3).

An estimator with a learned control variate ``c_φ`` gives, for every ``φ``, an unbiased estimate
``ĝ_φ`` of the gradient with respect to the parameters ``θ`` of a node's distribution. Since
``E[ĝ_φ]`` does not depend on ``φ``,

    ∇_φ Var(ĝ_φ) = ∇_φ E‖ĝ_φ‖² = E[∇_φ ‖ĝ_φ‖²],

so ``∇_φ ‖ĝ_φ‖²``, differentiated through the same sample, is an unbiased estimate of the gradient
of the variance. `LearnedControlVariate` takes one step on it per `storch.backward`:

1. ``ĝ = ∂/∂θ Σ_x w(x) term(x)``, the derivative of the node's own surrogate terms (every plate
   reduced with its weight, so minibatch means and sample weights are included) with respect to
   the distribution's parameter tensors ``θ`` (`LearnedControlVariate.variance_parameters`),
   recomputed with ``create_graph=True`` on the graph that the backward pass retained;
2. ``φ.grad ← ∇_φ Σ_nodes ‖ĝ‖²``;
3. the method's own optimizer steps, and ``φ.grad`` is set to ``None``, so that an optimizer over
   ``model.parameters()`` that also holds ``φ`` leaves ``φ`` alone.

The surrogate uses ``φ`` through *snapshots*, fresh leaf copies made at each forward pass
(`LearnedControlVariate.snapshot`), so the main backward pass never writes into ``φ.grad``
(whose surrogate gradient means nothing; also with ``storch.backward(update_parameters=False)``),
and the in-place optimizer step leaves the graph valid for higher-order derivatives after
``storch.backward(create_graph=True)``.

The draws that the estimator needs besides the samples (relaxed samples with their graph) are kept
per node from the proposal to the estimator; see `LearnedControlVariate.keep_draw`.

Data-parallel training (`storch.distributed`): with a process group of more than one rank,
step 3 first averages ``φ.grad`` across the ranks (one all-reduce per step; a rank where a
parameter got no gradient contributes zeros), and the first training step broadcasts ``φ`` from
rank 0, so that every replica holds the same ``φ`` and optimizer state. ``sync=False`` trains
``φ`` on each rank alone (the replicas then drift apart).

Checkpoints: `LearnedControlVariate.state_dict` holds ``φ`` and, under the key
``_extra_state``, the state of the method's own optimizer (made lazily at the first step), so
``load_state_dict`` into a freshly built method resumes training exactly.

State protocol (`storch.compile_step`): every tensor the variance step changes is a
parameter or a buffer of the method, updated in place. ``φ`` are parameters; the optimizer's state
tensors (Adam's moments and step count, SGD's momentum) are non-persistent buffers named
``_optimizer_state_<i>_<key>`` (``i`` the parameter's position in the optimizer), made by its first
step; ``Σ‖ĝ‖²`` of the last step is the buffer behind `LearnedControlVariate.last_squared_gradient_norm`.
Before each step the optimizer is bound to the tensors that fill these slots (by parameter name), so a
traced step records its update on the graph's inputs and every replay carries it out. The optimizer
must read nothing on the host: the default is Adam with ``fused=True`` (its step count stays a tensor),
SGD reads nothing either, and any optimizer built with ``fused=True`` or ``capturable=True`` qualifies;
others are refused by a compiled step with a message naming the optimizer (eager steps take any).
"""

from __future__ import annotations

import copy
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from storch import distributed
from storch.exceptions import CompileStepError
from storch.method.method import Method
from storch.reductions import reduce_plates
from storch.extend import StepState, StochasticTensor, Tensor, is_tracing, layout_of, node_of, plain

__all__ = [
    "LearnedControlVariate", "Draw", "OptimizerFactory", "default_optimizer", "replay_refusal", "hyperparameters",
    "optimizer_parameter_names", "bind_optimizer", "adopt_optimizer_state", "drop_optimizer_state", "step_optimizer",
    "sum_event_dims",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

#: prefix of the buffers that hold the method's optimizer state
_STATE_PREFIX = "_optimizer_state_"
#: the buffer of ``Σ_nodes ‖ĝ‖²`` of the last variance step
_NORM_BUFFER = "_last_squared_gradient_norm"
#: devices with fused Adam kernels (``torch.optim.Adam(fused=True)``)
_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})
_SIMPLE_TYPES = (bool, int, float, str, type(None))


def default_optimizer(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """Adam with learning rate ``lr``, fused where torch has the kernels (floating-point parameters on
    the CPU or a GPU): one kernel per step, and a step count kept as a tensor, so that
    `storch.compile_step` can replay the step."""
    fused = bool(params) and all(p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params)
    return torch.optim.Adam(params, lr=lr, fused=True) if fused else torch.optim.Adam(params, lr=lr)


def replay_refusal(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why a replayed step could not carry out ``optimizer.step()``, or ``None`` when it can.

    SGD reads no state on the host; an optimizer whose groups are all ``fused`` or ``capturable`` keeps
    its step count a tensor. Any other (Adam without either flag reads its step count with ``.item()``)
    is refused rather than guessed.
    """
    if isinstance(optimizer, torch.optim.SGD):
        return None
    if all(group.get("fused") or group.get("capturable") for group in optimizer.param_groups):
        return None
    return (
        f"its optimizer {type(optimizer).__name__} is built with neither fused=True nor capturable=True, so "
        "its step reads its step count on the host (.item()) and a replay could not carry it out. Build it "
        "with fused=True (e.g. optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3, "
        "fused=True)), with capturable=True on a GPU, or use SGD"
    )


def hyperparameters(optimizer: torch.optim.Optimizer) -> tuple:
    """The Python settings of each parameter group (learning rate, betas, ...), hashable."""
    def simple(value: Any) -> bool:
        return type(value) in _SIMPLE_TYPES or (type(value) is tuple and all(type(v) in _SIMPLE_TYPES for v in value))

    return tuple(tuple(sorted((k, v) for k, v in group.items() if k != "params" and simple(v)))
                 for group in optimizer.param_groups)


# ---------------------------------------------------------------------------- optimizer state in buffers
def optimizer_parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[Any]]:
    """Per parameter group of ``optimizer``, the names of its parameters in ``module`` (the tensor
    itself for one that is not ``module``'s): what `bind_optimizer` binds by."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [[names.get(id(p), p) for p in group["params"]] for group in optimizer.param_groups]


def bind_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, names: list[list[Any]]) -> None:
    """Point ``optimizer`` at the tensors in ``module``'s slots: each group's parameters by name
    (``names`` from `optimizer_parameter_names`), each parameter's state tensors at its
    ``_optimizer_state_<i>_<key>`` buffers of ``module`` (other state entries are kept). Eagerly these
    are the module's own tensors; in the trace of a compiled step, the graph's inputs."""
    named = dict(module.named_parameters())
    old = [p for group in optimizer.param_groups for p in group["params"]]
    for group, group_names in zip(optimizer.param_groups, names):
        group["params"] = [named.get(n, p) if isinstance(n, str) else n for n, p in zip(group_names, group["params"])]
    new = [p for group in optimizer.param_groups for p in group["params"]]
    buffers = _state_buffers(module)
    if all(a is b for a, b in zip(old, new)) and not _state_buffers_changed(optimizer, new, buffers):
        return
    state: defaultdict = defaultdict(dict)
    for i, (was, param) in enumerate(zip(old, new)):
        entry = {k: v for k, v in optimizer.state.get(was, {}).items() if not isinstance(v, torch.Tensor)}
        entry.update(buffers.get(i, {}))
        if entry:
            state[param] = entry
    optimizer.state = state


def _state_buffers(module: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    """``module``'s optimizer state buffers, by parameter position and state key."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in module._buffers.items():
        if name.startswith(_STATE_PREFIX) and value is not None:
            index, key = name[len(_STATE_PREFIX):].split("_", 1)
            found.setdefault(int(index), {})[key] = value
    return found


def _state_buffers_changed(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], buffers: dict[int, dict[str, torch.Tensor]]
) -> bool:
    """Whether a state buffer is not the tensor the optimizer holds (moved by ``.to()``, or swapped for
    a graph input by a trace)."""
    for i, entries in buffers.items():
        held = optimizer.state.get(params[i], {}) if i < len(params) else {}
        if any(held.get(key) is not value for key, value in entries.items()):
            return True
    return False


def adopt_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, owner: str) -> None:
    """Make every state tensor of ``optimizer`` a buffer of ``module`` (after a step or a load).

    A tensor the optimizer made (its first step) becomes a new buffer (not saved by ``state_dict``:
    the optimizer's own state dict is). One that replaces an existing buffer is copied into it within a
    trace, so that the graph updates the buffer in place; eagerly it takes the buffer's place.
    """
    tracing = is_tracing()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, param in enumerate(params):
        entry = optimizer.state.get(param, {})
        for key, value in list(entry.items()):
            name = f"{_STATE_PREFIX}{i}_{key}"
            current = module._buffers.get(name)
            if not isinstance(value, torch.Tensor) or current is value:
                continue
            if current is None:
                module.register_buffer(name, value, persistent=False)
            elif not tracing:
                module._buffers[name] = value
            elif (current.shape, current.dtype, current.device) == (value.shape, value.dtype, value.device):
                with torch.no_grad():
                    current.copy_(value)
                entry[key] = current
            else:
                raise CompileStepError(
                    f"storch.compile_step: {owner}'s optimizer replaced its state {key!r} by a tensor of another "
                    f"shape, dtype or device ({tuple(value.shape)}, {value.dtype}, {value.device}); a replay can "
                    "only update it in place."
                )


def drop_optimizer_state(module: nn.Module) -> None:
    """Remove ``module``'s optimizer state buffers."""
    for name in [n for n in module._buffers if n.startswith(_STATE_PREFIX)]:
        del module._buffers[name]


def step_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, owner: str) -> None:
    """``optimizer.step()`` (bound to ``module``'s slots), then its state into ``module``'s buffers.

    Within a trace the step must leave the optimizer's Python values (non-tensor state, settings) as
    they were: a replay runs no Python.
    """
    settings = _python_state(optimizer) if is_tracing() else None
    optimizer.step()
    if settings is not None and _python_state(optimizer) != settings:
        raise CompileStepError(
            f"storch.compile_step: {owner}'s optimizer {type(optimizer).__name__} changes Python values in its "
            "state or settings when it steps (a counter, a schedule); a replay runs no Python, so they would stay "
            "as the trace left them. Use an optimizer that keeps its state in tensors."
        )
    adopt_optimizer_state(module, optimizer, owner)


def _python_state(optimizer: torch.optim.Optimizer) -> tuple:
    """The optimizer's non-tensor state entries and hyperparameters (a trace must leave them unchanged)."""
    entries = tuple(sorted((i, str(k), repr(v)) for i, (_, st) in enumerate(optimizer.state.items())
                           for k, v in st.items() if not isinstance(v, torch.Tensor)))
    return entries, hyperparameters(optimizer)


@dataclass
class Draw:
    """What a proposal drew for one node besides its samples.

    Attributes:
        theta: the distribution's parameter tensors whose gradient estimate ``ĝ`` the control
            variate is trained on (the very tensor objects the draws were computed from).
        values: named plain tensors ``(n, *batch_shape, *event_shape)``, e.g. relaxed samples.
    """

    theta: tuple[torch.Tensor, ...]
    values: dict[str, torch.Tensor] = field(default_factory=dict)


def sum_event_dims(t: torch.Tensor, what: str) -> torch.Tensor:
    """Sum ``t`` over its non-plate dimensions (a control variate's value per sample)."""
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{what} returned a plain torch.Tensor of shape {tuple(t.shape)}; it must keep the plates of "
            "its input (use torch operations on the input, e.g. nn.Linear, not .detach().numpy())."
        )
    n = len(layout_of(t).sizes)
    if t.dim() > n:
        t = t.sum(tuple(range(n, t.dim())))
    return t


class LearnedControlVariate(Method):
    """Base class of estimators whose control-variate parameters ``φ`` minimise ``‖ĝ‖²``.

    ``φ`` is every parameter of the method (its submodules included) that requires grad.
    Subclasses draw in `proposal_dist`, call `keep_draw`, and read the draw back in
    `estimator` with `draw_of`.

    Args:
        plate_name: node / plate name.
        n_samples: number of Monte Carlo samples (or groups of evaluation points).
        optimizer_factory: ``params -> torch.optim.Optimizer`` for ``φ``, called once at the first
            training step, e.g. ``lambda params: torch.optim.Adam(params, lr=1e-3)``; ``None``: Adam
            with learning rate ``lr``.
        lr: learning rate of the default optimizer.
        train_control_variate: take a variance step after every ``storch.backward()``; ``False``
            keeps ``φ`` fixed (``φ.grad`` is still cleared after each backward).
        sync: under ``torch.distributed`` with more than one rank, average ``φ.grad`` across the
            ranks before each optimizer step and broadcast ``φ`` from rank 0 at the first one, so
            that the replicas stay identical (`storch.distributed`); ``False``: each rank
            trains its own ``φ``. No effect in a single process.
    """

    needs_graph_after_backward = True
    #: class defaults, also for methods pickled before these attributes existed
    sync: bool = True
    _broadcast_done: bool = False

    def __init__(
        self,
        plate_name: str,
        n_samples: int = 1,
        optimizer_factory: Optional[OptimizerFactory] = None,
        lr: float = 1e-3,
        train_control_variate: bool = True,
        sync: bool = True,
    ) -> None:
        super().__init__(plate_name, None, n_samples)
        self.optimizer_factory = optimizer_factory
        self.lr = float(lr)
        self.train_control_variate = bool(train_control_variate)
        self.sync = bool(sync)
        self._broadcast_done = False
        self.needs_graph_after_backward = self.train_control_variate
        self._optimizer: Optional[torch.optim.Optimizer] = None
        #: per parameter group, the names of its parameters (or the tensor, for one not of the method)
        self._optimizer_names: list[list[Union[str, torch.Tensor]]] = []
        self._draws: dict[int, tuple[weakref.ref, Draw]] = {}
        self._snapshots: list[tuple[torch.Tensor, weakref.ref]] = []

    @property
    def last_squared_gradient_norm(self) -> Optional[torch.Tensor]:
        """``Σ_nodes ‖ĝ‖²`` of the last training step (a scalar buffer, updated in place), for monitoring;
        ``None`` before the first."""
        return self._buffers.get(_NORM_BUFFER)

    # ------------------------------------------------------------------ draws
    def keep_draw(self, samples: torch.Tensor, draw: Draw) -> None:
        """Remember ``draw`` for the node whose proposal returned ``samples`` (until they are freed).

        ``draw`` must not hold ``samples`` itself: the entry would keep its own key alive (and with
        it the draws' graphs) for ever.
        """
        if any(value is samples for value in draw.values.values()):
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): a Draw must not hold the samples tensor itself "
                "(it would never be freed); read the samples back from the node (node_of(tensor).samples)."
            )
        if is_tracing():
            self._refuse_unreplayable_training()
        key = id(samples)
        self._draws[key] = (weakref.ref(samples), draw)
        weakref.finalize(samples, self._draws.pop, key, None)

    def draw_of(self, tensor: StochasticTensor) -> Draw:
        """The `Draw` kept for the node of ``tensor``."""
        samples = node_of(tensor).samples
        entry = self._draws.get(id(samples))
        if entry is None or entry[0]() is not samples:
            raise RuntimeError(
                f"{type(self).__name__}({self.plate_name!r}): node {tensor.name!r} was not sampled by this "
                "method's own proposal, so its relaxed draws are missing. Sample it by calling the method "
                "on the distribution, with its default Monte Carlo proposal."
            )
        return entry[1]

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the per-node draws and snapshots of the current step.

        They belong to the graph of one forward pass (relaxed samples and parameter snapshots with
        their autograd history, weak references), which a copy cannot use, and non-leaf tensors
        cannot be deep-copied. The control variate, its parameters and the optimizer state are kept.
        """
        state = super().__getstate__()
        state["_draws"] = {}
        state["_snapshots"] = []
        return state

    # -------------------------------------------------------------- snapshots
    def snapshot(self, param: torch.Tensor) -> torch.Tensor:
        """A fresh leaf copy of the control-variate parameter ``param`` for the surrogate.

        The variance step collects the gradient of the snapshots into ``param``; the main backward
        pass writes only into the snapshot's ``.grad``.
        """
        copy = param.detach().clone().requires_grad_(param.requires_grad)
        if param.requires_grad:
            if len(self._snapshots) > 256:
                self._prune_snapshots()
            self._snapshots.append((param, weakref.ref(copy)))
        return copy

    def _prune_snapshots(self) -> None:
        self._snapshots = [(p, ref) for p, ref in self._snapshots if ref() is not None]

    def evaluate(self, network: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``network(x)`` on snapshots of its parameters, summed over its non-plate dimensions."""
        params = {name: self.snapshot(p) for name, p in network.named_parameters()}
        out = torch.func.functional_call(network, params, (x,))
        return sum_event_dims(out, f"{type(self).__name__}({self.plate_name!r}).control_variate")

    # --------------------------------------------------------------- training
    def variance_parameters(self, tensor: StochasticTensor) -> list[torch.Tensor]:
        """The tensors ``θ`` whose gradient estimate ``ĝ`` has its squared norm minimised."""
        return [t for t in self.draw_of(tensor).theta if t.requires_grad]

    def control_variate_parameters(self) -> list[nn.Parameter]:
        """``φ``: the method's parameters that require grad."""
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of ``φ`` (made at first use from ``optimizer_factory``; default:
        `default_optimizer`), bound to the tensors that now fill the method's parameter and
        state slots (see the module's state protocol)."""
        if self._optimizer is None:
            named = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
            if self.optimizer_factory is None:
                optimizer = default_optimizer(params, self.lr)
            else:
                optimizer = self.optimizer_factory(params)
            self._optimizer_names = optimizer_parameter_names(self, optimizer)
            self._optimizer = optimizer
        bind_optimizer(self, self._optimizer, self._optimizer_names)
        return self._optimizer

    def _drop_optimizer(self) -> None:
        """Forget the optimizer and its state buffers (built afresh at the next training step)."""
        self._optimizer = None
        self._optimizer_names = []
        drop_optimizer_state(self)

    def prepare_compiled_step(self) -> tuple:
        """Called by `storch.compile_step` before each call: build the optimizer (outside
        the trace) and return its hyperparameters, which the trace bakes in (a new learning rate is a new
        trace)."""
        if not self.train_control_variate or not self.control_variate_parameters():
            return ()
        optimizer = self.optimizer
        return (("optimizer", type(optimizer).__name__, hyperparameters(optimizer)),)

    def _owner(self) -> str:
        return f"{type(self).__name__}({self.plate_name!r})"

    def _refuse_unreplayable_training(self) -> None:
        """In the trace of a compiled step, before anything is applied: refuse a variance step that a
        replay could not carry out (an optimizer that reads on the host, gradients averaged across ranks)."""
        if not self.train_control_variate or not self.control_variate_parameters():
            return
        reason = replay_refusal(self.optimizer)
        if reason is None and self.sync and distributed.syncing():
            reason = "it averages its control-variate gradients across ranks (collectives are not traced)"
        if reason is not None:
            raise CompileStepError(
                f"storch.compile_step: {self._owner()} trains its control variate within the step, and {reason}. "
                "Run this step eagerly, or pass train_control_variate=False."
            )

    def squared_gradient_norm(self, result_triples: Sequence[tuple[Any, ...]]) -> Optional[torch.Tensor]:
        """``Σ_nodes ‖ĝ‖²`` with its graph, from the ``(tensor, cost, term)`` triples of a backward."""
        nodes: dict[int, tuple[StochasticTensor, list[torch.Tensor]]] = {}
        for tensor, _, term in result_triples:
            nodes.setdefault(id(node_of(tensor)), (tensor, []))[1].append(term)
        total_sq: Optional[torch.Tensor] = None
        for tensor, terms in nodes.values():
            theta = self.variance_parameters(tensor)
            surrogate = sum(plain(reduce_plates(term)) for term in terms)
            if not theta or not isinstance(surrogate, torch.Tensor) or not surrogate.requires_grad:
                continue
            grads = torch.autograd.grad(surrogate, theta, create_graph=True, allow_unused=True)
            for g in grads:
                if g is not None:
                    sq = plain(g).pow(2).sum()
                    total_sq = sq if total_sq is None else total_sq + sq
        return total_sq

    #: the variance step changes only tensors of the method, in place (``φ``, the optimizer's state buffers,
    #: the last norm; see the module's state protocol), so a compiled step replays it (an optimizer that
    #: reads on the host is refused by name in the trace)
    step_state = StepState.IN_PLACE

    def update_parameters(self, result_triples: Sequence[tuple[Any, ...]]) -> None:
        super().update_parameters(result_triples)
        params = self.control_variate_parameters()
        try:
            if self.train_control_variate and params:
                self._variance_step(result_triples, params)
        finally:
            for p in params:
                p.grad = None
            # this step's snapshots are spent: the next variance step differentiates only with
            # respect to its own (a finished step may linger until the cyclic collector runs)
            self._snapshots = []

    def _variance_step(self, result_triples: Sequence[tuple[Any, ...]], params: list[nn.Parameter]) -> None:
        for p in params:
            p.grad = None
        self._local_variance_gradients(result_triples, params)
        if self.sync and distributed.syncing():
            # every rank gets here once per backward, whatever its local gradients, so the
            # collectives match; a parameter without gradient on every rank stays None everywhere
            distributed.synchronise_replicas_(params, first=not self._broadcast_done)
            self._broadcast_done = True
        if all(p.grad is None for p in params):
            return
        self._optimizer_step()

    def _optimizer_step(self) -> None:
        """``optimizer.step()`` on the tensors in the method's slots; its state then lives in buffers."""
        step_optimizer(self, self.optimizer, self._owner())

    def _local_variance_gradients(self, result_triples: Sequence[tuple[Any, ...]], params: list[nn.Parameter]) -> None:
        """``φ.grad ← ∇_φ Σ_nodes ‖ĝ‖²`` from this process's own samples (left ``None`` where none)."""
        loss = self.squared_gradient_norm(result_triples)
        if loss is None:
            return
        self._note_norm(loss.detach())
        if not loss.requires_grad:
            return
        self._prune_snapshots()
        live = [(p, snap) for p, ref in self._snapshots if (snap := ref()) is not None]
        if not live:
            return
        # keep the graph: after backward(create_graph=True) the caller may still differentiate it
        grads = torch.autograd.grad(loss, [snap for _, snap in live], allow_unused=True, retain_graph=True)
        for (param, _), g in zip(live, grads):
            if g is not None:
                param.grad = g.detach() if param.grad is None else param.grad + g.detach()

    def _note_norm(self, value: torch.Tensor) -> None:
        """Keep ``Σ‖ĝ‖²`` in its buffer (in place once it exists)."""
        current = self._buffers.get(_NORM_BUFFER)
        if current is None or (current.dtype, current.device) != (value.dtype, value.device):
            self.register_buffer(_NORM_BUFFER, value.clone(), persistent=False)
        else:
            with torch.no_grad():
                current.copy_(value)

    # ------------------------------------------------------------- checkpoints
    def get_extra_state(self) -> dict:
        """The state of the method's own optimizer (``None`` before its first step), for ``state_dict``.

        Stored under the key ``_extra_state`` of `state_dict`; a deep copy, so that a
        state dict kept in memory does not change with later steps.
        """
        opt = None if self._optimizer is None else copy.deepcopy(self._optimizer.state_dict())
        return {"optimizer": opt}

    def set_extra_state(self, state: Any) -> None:
        """Restore the optimizer state saved by `get_extra_state` (``load_state_dict`` calls it).

        The optimizer is built with ``optimizer_factory`` if it does not exist yet; its state tensors
        follow the device and dtype of ``φ`` (``torch.optim.Optimizer.load_state_dict``).
        """
        if not isinstance(state, dict) or "optimizer" not in state:
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}).load_state_dict: the '_extra_state' entry must be "
                f"a dict with key 'optimizer' (written by get_extra_state), got {type(state).__name__}."
            )
        if state["optimizer"] is None:
            self._drop_optimizer()  # built afresh at the next training step
        else:
            optimizer = self.optimizer
            optimizer.load_state_dict(state["optimizer"])
            adopt_optimizer_state(self, optimizer, self._owner())

    def __setstate__(self, state: dict) -> None:
        """Unpickle, also a method pickled before its optimizer state lived in buffers."""
        state.pop("last_squared_gradient_norm", None)
        super().__setstate__(state)
        if "_optimizer_names" not in self.__dict__:
            self._optimizer_names = []
            if self._optimizer is not None:
                self._optimizer_names = optimizer_parameter_names(self, self._optimizer)
                adopt_optimizer_state(self, self._optimizer, self._owner())

    def extra_repr(self) -> str:
        sync = "" if self.sync else ", sync=False"
        return f"{super().extra_repr()}, train_control_variate={self.train_control_variate}{sync}"

