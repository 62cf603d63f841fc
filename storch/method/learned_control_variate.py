"""Control variates trained on the variance of the gradient estimate (Grathwohl et al. 2018, §3.3).

An estimator with a learned control variate ``c_φ`` gives, for every ``φ``, an unbiased estimate
``ĝ_φ`` of the gradient with respect to the parameters ``θ`` of a node's distribution. Since
``E[ĝ_φ]`` does not depend on ``φ``,

    ∇_φ Var(ĝ_φ) = ∇_φ E‖ĝ_φ‖² = E[∇_φ ‖ĝ_φ‖²],

so ``∇_φ ‖ĝ_φ‖²``, differentiated through the same sample, is an unbiased estimate of the gradient
of the variance. `LearnedControlVariate` takes one step on it per [`storch.backward`][storch.backward]:

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

Data-parallel training ([`storch.distributed`][storch.distributed]): with a process group of more than one rank,
step 3 first averages ``φ.grad`` across the ranks (one all-reduce per step; a rank where a
parameter got no gradient contributes zeros), and the first training step broadcasts ``φ`` from
rank 0, so that every replica holds the same ``φ`` and optimizer state. ``sync=False`` trains
``φ`` on each rank alone (the replicas then drift apart).

Checkpoints: `LearnedControlVariate.state_dict` holds ``φ`` and, under the key
``_extra_state``, the state of the method's own optimizer (made lazily at the first step), so
``load_state_dict`` into a freshly built method resumes training exactly.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from storch import distributed
from storch.method.method import Method
from storch.reductions import reduce_plates
from storch.extend import StochasticTensor, Tensor, layout_of, node_of, plain

__all__ = ["LearnedControlVariate", "Draw", "OptimizerFactory", "sum_event_dims"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


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
            that the replicas stay identical ([`storch.distributed`][storch.distributed]); ``False``: each rank
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
        self._draws: dict[int, tuple[weakref.ref, Draw]] = {}
        self._snapshots: list[tuple[torch.Tensor, weakref.ref]] = []
        #: ``Σ_nodes ‖ĝ‖²`` of the last training step (a detached scalar), for monitoring
        self.last_squared_gradient_norm: Optional[torch.Tensor] = None

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
        """The optimizer of ``φ`` (made at first use from ``optimizer_factory``)."""
        if self._optimizer is None:
            params = self.control_variate_parameters()
            if self.optimizer_factory is None:
                self._optimizer = torch.optim.Adam(params, lr=self.lr)
            else:
                self._optimizer = self.optimizer_factory(params)
        return self._optimizer

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

    @property
    def keeps_state_between_steps(self) -> bool:
        """The control variate is trained after each step (``train_control_variate``)."""
        return super().keeps_state_between_steps or bool(self.train_control_variate)

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
        self.optimizer.step()

    def _local_variance_gradients(self, result_triples: Sequence[tuple[Any, ...]], params: list[nn.Parameter]) -> None:
        """``φ.grad ← ∇_φ Σ_nodes ‖ĝ‖²`` from this process's own samples (left ``None`` where none)."""
        loss = self.squared_gradient_norm(result_triples)
        if loss is None:
            return
        self.last_squared_gradient_norm = loss.detach()
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
            self._optimizer = None  # built afresh at the next training step
        else:
            self.optimizer.load_state_dict(state["optimizer"])

    def extra_repr(self) -> str:
        sync = "" if self.sync else ", sync=False"
        return f"{super().extra_repr()}, train_control_variate={self.train_control_variate}{sync}"
