"""Critics for credit assignment: learned value functions and Q-functions of a node's non-descendants.

Weber, Heess, Buesing, Silver 2019, "Credit Assignment Techniques in Stochastic Computation Graphs"
(AISTATS, arXiv:1901.01761). For a stochastic node ``x ~ q_θ(x | ŝ)`` whose distribution is computed
from ``ŝ``, a set of *non-descendants* of ``x`` (everything its distribution was conditioned on), and
``S`` the cost downstream of ``x`` (storch credits each node only with the costs it is an ancestor
of), the paper's estimators of ``∇θ E[S]`` are

    ĝ_V = (S − V(ŝ)) ∇θ log q_θ(x | ŝ)                                           (value critic)
    ĝ_Q = (S − Q(ŝ, x)) ∇θ log q_θ(x | ŝ) + ∇θ E_{x'~q_θ(·|ŝ)}[Q(ŝ, x')]          (Q critic)

**Why the value critic is unbiased.** ``V`` is a function of ``ŝ`` alone, so
``E_{x~q(·|ŝ)}[V(ŝ) ∇log q(x|ŝ)] = V(ŝ) ∇Σ_x q(x|ŝ) = V(ŝ) ∇1 = 0``: any function of
non-descendants is a valid baseline (the paper's central observation). `storch.method.critic.Critic` feeds
``V``
the node's *distribution parameters* (and optionally the samples of its ancestor nodes): they are
computed before ``x`` is drawn, from non-descendants of ``x`` only, never from ``x`` or anything
downstream of it. Its input and output are detached, so ``V`` is a constant of the surrogate: the
control-variate term ``(1 − □(log q(x))) · V`` has expectation 0 at *every* parameter value, and
derivatives of every order stay unbiased. ``V`` is trained after each backward pass on the squared
error ``(V(ŝ) − S)²`` (``S`` the detached downstream estimate), so the value used in a step never
depends on that step's samples. At its optimum ``V(ŝ) = E[S | ŝ]``, the expected downstream cost.

**Why the Q critic is unbiased.** ``Q(ŝ, x)`` depends on the sample, so ``E[Q ∇log q] = ∇E_q[Q]``
(``Q`` fixed) is not zero; the second term adds exactly that back. `storch.method.critic.QCritic` computes
it in
closed form for factorised discrete nodes (``Bernoulli``, ``Categorical``, ``OneHotCategorical``):
``Q(ŝ, x) = Σ_d Q_d(ŝ, x_d)`` is additive over the node's ``D`` independent variables, so
``E_q[Q] = Σ_d Σ_k q_d(k) Q_d(ŝ, k)`` by enumerating the ``K`` values of each variable (``D·K``
terms; exact, no sampling). Surrogate components: control variate ``a(x) = Q(ŝ, x)`` (detached) and
the correction ``E_q[Q] − stopgrad(E_q[Q])`` (forward value 0) with ``Q`` detached and ``q_θ`` not.
With ``□`` read as ``q_θ'(x)/q_θ(x)``, the expected extra surrogate is
``(E_θ[Q] − E_θ'[Q]) + (E_θ'[Q] − E_θ[Q]) = 0`` for every ``θ'``, so every derivative is unbiased.

Both are `storch.method.baseline.Baseline` objects: ``ScoreFunction("z",
baseline_factory="critic")`` or ``baseline_factory="q_critic"``, or an instance
(``baseline_factory=Critic(lr=3e-3)``), also through `storch.method.Infer`. One network per
registered cost name (built at first use, when the input size is known): with several costs
downstream of a node, each gets its own ``V_c`` and the control variates add up to
``Σ_c V_c(ŝ) ≈ E[Σ_c S_c | ŝ]``. Each critic has its own optimizer, which steps once per
``storch.backward()``; its parameters never receive a gradient from the surrogate. With
``shared=True`` one network serves every cost: the critic of an episode's decisions (one method
called at every step, a cost per reward, each decision's cost to go as its target), fed each
decision's observation, is one ``V(s)`` trained by one optimizer step per ``storch.backward()`` on
all the decisions' squared errors. A chain step's distribution is a copy without the step it
extended, with the original's attributes (an observation set on it is read with that step's plate
dropped), and inputs computed at earlier steps of the node's chain are non-descendants: their
size-1 chain dimensions are dropped.

Training targets are normalised: the critic predicts ``μ + σ · net(ŝ)``, with ``μ``, ``σ`` running
averages (decay ``β``) of the mean and standard deviation of the targets seen in *earlier* steps.

State protocol (`storch.compile_step`): each cost's head holds its network's parameters,
the target statistics (buffers ``first_moment``, ``second_moment``, ``updates``), the last training loss
(buffer ``last_loss``) and its optimizer's state (buffers ``_optimizer_state_<i>_<key>``, as in
`storch.method.learned_control_variate`); ``update`` changes them in place with tensor operations
only (a non-finite target is skipped by ``torch.where``, not by a branch), and the optimizer is bound
to the tensors in the head's slots before each step, so a replayed step trains the critic as an eager
one does. A head is built at the first step that uses its cost, which a compiled step runs eagerly
(`storch._tracing.EagerStepNeeded`); the next call is traced. The default optimizer is
`storch.method.learned_control_variate.default_optimizer` (fused Adam); one that reads on the host is
refused by a compiled step with its name.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.distributions import Bernoulli, Categorical, Distribution, OneHotCategorical

from storch import distributed
from storch.exceptions import CompileStepError
from storch.method.baseline import Baseline
from storch.method.learned_control_variate import (
    adopt_optimizer_state,
    bind_optimizer,
    default_optimizer,
    drop_optimizer_state,
    hyperparameters,
    optimizer_parameter_names,
    replay_refusal,
    step_optimizer,
)
from storch.method.local_expectation import coordinates_for
from storch.extend import (
    ChainPlate,
    CostTensor,
    PlateLayout,
    StepState,
    StochasticNode,
    StochasticTensor,
    TypeRegistry,
    get_distr_parameters,
    EagerStepNeeded,
    is_tracing,
    layout_of,
    layout_of_plates,
    node_of,
    plain,
    restore_lazy_plates,
    wrap,
    wrap_new,
)
from storch.reductions import reduce_plates
from storch.registries import CRITIC_INPUTS, register_critic_inputs

__all__ = [
    "SHARED", "Critic", "QCritic", "NetworkFactory", "OptimizerFactory", "InputFunction", "register_critic_inputs",
    "critic_inputs", "mlp",
]

#: ``(in_features, out_features) -> nn.Module`` mapping ``(..., in_features)`` to ``(..., out_features)``
NetworkFactory = Callable[[int, int], nn.Module]
#: ``params -> torch.optim.Optimizer``
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
#: ``distribution -> tensors`` the critic reads (functions of the distribution only, never of its samples)
InputFunction = Callable[[Distribution], Sequence[torch.Tensor]]


# --------------------------------------------------------------------------- inputs
_INPUTS: TypeRegistry[InputFunction] = CRITIC_INPUTS  # made in storch.registries, filled here


@_INPUTS.register_default(Bernoulli, Categorical, OneHotCategorical)
def _probs(d: Distribution) -> Sequence[torch.Tensor]:
    return [d.probs]


def critic_inputs(distr: Distribution) -> list[torch.Tensor]:
    """The tensors a critic reads from ``distr``: the registered ones, else its parameters by name.

    Without a registered entry these are the distribution's parameter tensors
    (`storch.util.get_distr_parameters`, sorted by name; ``logits`` is left out when
    ``probs`` is there, as both describe the same thing).

    Examples:
        >>> import torch
        >>> from torch.distributions import Normal
        >>> [t.tolist() for t in critic_inputs(Normal(torch.tensor([1.0]), torch.tensor([2.0])))]
        [[1.0], [2.0]]
    """
    restore_lazy_plates(distr)
    fn = _INPUTS.lookup(distr)
    if fn is not None:
        return list(fn(distr))
    params = get_distr_parameters(distr, filter_requires_grad=False)
    if "probs" in params:
        params.pop("logits", None)
    return [params[name] for name in sorted(params)]


def _previous_chain_step(node: StochasticNode) -> Optional[StochasticNode]:
    """The node of the chain step that ``node`` extended, if ``node`` is a step of a single-sample chain."""
    plate = node.plate
    if isinstance(plate, ChainPlate) and plate.ancestor is not None:
        return plate.ancestor.node
    return None


def _earlier_chain_step(plate: Any, node: Optional[StochasticNode]) -> bool:
    """Whether ``plate`` is an earlier step of ``node``'s single-sample chain: a tensor that carries it
    was computed before ``node`` was drawn (a non-descendant: the observation the step's distribution
    was computed from), and its size-1 dimension can be dropped."""
    own = None if node is None else node.plate
    return (isinstance(plate, ChainPlate) and isinstance(own, ChainPlate) and plate is not own
            and own.descends_from(plate))


def _aligned(t: torch.Tensor, layout: PlateLayout, what: str, node: Optional[StochasticNode] = None) -> torch.Tensor:
    """``t`` as a plain tensor ``(*layout.sizes, *rest)``: its plates permuted into ``layout``'s
    order, missing ones broadcast, the plates of earlier steps of ``node``'s chain dropped (size 1);
    autograd history is kept."""
    data = plain(t)
    src = layout_of(t)
    if src is layout:
        return data
    plates = list(src.plates)
    for i in reversed(range(len(plates))):
        if _earlier_chain_step(plates[i], node):
            data = data.select(i, 0)
            del plates[i]
    k = len(plates)
    targets = []
    for plate in plates:
        index = next((i for i, p in enumerate(layout.plates) if p is plate), None)
        if index is None:
            index = next((i for i, p in enumerate(layout.plates) if p == plate), None)
        if index is None:
            raise ValueError(
                f"{what} carries the plate {plate.name!r}, which the node's distribution does not; a "
                "critic may only read values of the node's non-descendants that share its plates."
            )
        targets.append(index)
    rest = tuple(data.shape[k:])
    order = sorted(range(k), key=lambda j: targets[j])
    data = data.permute(*order, *range(k, data.dim()))
    shape = [1] * len(layout.plates)
    for j in order:
        shape[targets[j]] = data.shape[order.index(j)]
    return data.reshape(tuple(shape) + rest).expand(tuple(layout.sizes) + rest)


def mlp(in_features: int, out_features: int, hidden: int = 64, depth: int = 2) -> nn.Sequential:
    """The default critic network: ``depth`` hidden layers of ``hidden`` tanh units.

    Examples:
        >>> mlp(3, 1, hidden=8)
        Sequential(
          (0): Linear(in_features=3, out_features=8, bias=True)
          (1): Tanh()
          (2): Linear(in_features=8, out_features=8, bias=True)
          (3): Tanh()
          (4): Linear(in_features=8, out_features=1, bias=True)
        )
    """
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.Tanh()]
        width = hidden
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- per-cost heads
#: the name of the one network of a shared critic (``Critic(shared=True)``), in place of a cost name
SHARED = "(all costs)"


class _Head(nn.Module):
    """The network of one registered cost, with the running statistics of its targets."""

    def __init__(self, network: nn.Module, in_features: int, out_features: int) -> None:
        super().__init__()
        self.network = network
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("first_moment", torch.zeros(()))
        self.register_buffer("second_moment", torch.ones(()))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    @property
    def offset(self) -> torch.Tensor:
        """``μ``: the running mean of the targets (0 before the first update)."""
        return self.first_moment

    @property
    def scale(self) -> torch.Tensor:
        """``σ``: the running standard deviation of the targets (1 before the first update)."""
        var = self.second_moment - self.first_moment**2
        floor = 1e-6 * (1.0 + self.first_moment.abs())
        return var.clamp_min(0.0).sqrt().clamp_min(floor)


def _key(name: str) -> str:
    """A module name for the cost ``name`` (injective: ``%`` and ``.`` are percent-escaped)."""
    return "cost:" + name.replace("%", "%25").replace(".", "%2E")


@dataclass
class _Pending:
    """What one (node, cost) contributed in a step: the critic's loss with its graph, and the
    weighted mean of the target and its square (for the running statistics)."""

    plate: weakref.ref
    plate_name: str
    name: str
    loss: Optional[torch.Tensor]
    mean: torch.Tensor
    mean_square: torch.Tensor
    corrected: bool = True


class Critic(Baseline):
    """A learned value function ``V(ŝ)`` of the node's non-descendants, used as its baseline.

    ``ĝ = (S − V(ŝ)) ∇log q(x | ŝ)``; ``V`` is trained after each ``storch.backward()`` on
    ``(V(ŝ) − S)²``, the squared error against the detached downstream cost ``S`` (every plate
    reduced with its weight), by its own optimizer. See the module docstring for the math and why
    it is unbiased for any ``V``, trained or not (Weber et al. 2019).

    The input ``ŝ`` is wired from the graph: the node's distribution parameters
    (`storch.method.critic.critic_inputs`: ``probs`` for Bernoulli and categorical nodes, the
    parameter tensors
    otherwise), flattened per element of the node's parent plates, and with ``include_ancestors``
    also the samples of the stochastic nodes whose plates the distribution carries (its ancestors:
    also non-descendants); for a step of a single-sample chain (`storch.plate.ChainPlate`)
    that is the previous step's sample, not the earlier steps' (give the critic a state that
    summarises them). All of it is detached; the node's own sample is never an input.

    Args:
        network_factory: ``(in_features, out_features) -> nn.Module``, called once per cost name at
            the first step (when the input size is known); default `storch.method.critic.mlp` with ``hidden``
            units.
        hidden: hidden units of the default network.
        optimizer_factory: ``params -> optimizer``; default Adam with learning rate ``lr``.
        lr: learning rate of the default optimizer.
        train_critic: ``False`` freezes the critic (networks and target statistics); an untrained
            critic is unbiased too.
        decay: ``β`` of the running mean and standard deviation that normalise the targets.
        include_ancestors: also feed the samples of the node's ancestor nodes.
        inputs: ``distribution -> tensors`` replacing `storch.method.critic.critic_inputs` (it sees the
            distribution only, so it cannot reach the node's sample).
        sync: under ``torch.distributed`` with several ranks, average the critic's gradients and
            target statistics across ranks and broadcast a new network from rank 0, so that the
            replicas stay identical (`storch.distributed`). The networks are built lazily, so
            DDP never sees them.
        shared: one network for every cost (``V(ŝ)`` of whatever the inputs are, e.g. the
            observation of each decision of an episode), trained by one optimizer step per
            ``storch.backward()`` on the sum of all the costs' squared errors, with one running
            mean and standard deviation of all targets; its cost name is `SHARED`. Default: one
            network per cost name.

    Attributes:
        last_losses: cost name → the critic's last training loss (normalised squared error).

    ``state_dict()`` holds the networks, the target statistics and (key ``_extra_state``) the input
    sizes and optimizer states, so ``load_state_dict`` into a freshly built critic resumes exactly.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> from storch.method import ScoreFunction
        >>> theta = torch.tensor([0.3, -0.2], requires_grad=True)
        >>> method = ScoreFunction("z", n_samples=1, baseline_factory="critic")
        >>> z = method(Bernoulli(logits=theta))
        >>> storch.add_cost((z - 0.5).pow(2).sum(-1), "f")
        >>> _ = storch.backward()
        >>> type(method.baseline).__name__, sorted(method.baseline.last_losses)
        ('Critic', ['f'])
    """

    def __init__(
        self,
        network_factory: Optional[NetworkFactory] = None,
        hidden: int = 64,
        optimizer_factory: Optional[OptimizerFactory] = None,
        lr: float = 1e-2,
        train_critic: bool = True,
        decay: float = 0.95,
        include_ancestors: bool = False,
        inputs: Optional[InputFunction] = None,
        sync: bool = True,
        shared: bool = False,
    ) -> None:
        super().__init__()
        if network_factory is not None and not callable(network_factory):
            raise TypeError(
                f"{type(self).__name__}: network_factory must be a callable (in_features, out_features) -> "
                f"nn.Module, got {type(network_factory).__name__}."
            )
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"{type(self).__name__}: decay must be in [0, 1), got {decay}.")
        if int(hidden) < 1:
            raise ValueError(f"{type(self).__name__}: hidden must be a positive number of units, got {hidden}.")
        self.network_factory = network_factory
        self.hidden = int(hidden)
        self.optimizer_factory = optimizer_factory
        self.lr = float(lr)
        self.train_critic = bool(train_critic)
        self.decay = float(decay)
        self.include_ancestors = bool(include_ancestors)
        self.inputs = inputs
        self.sync = bool(sync)
        self.shared = bool(shared)
        self.heads = nn.ModuleDict()
        self._names: dict[str, str] = {}  # cost name -> module key
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._optimizer_names: dict[str, list[list[Any]]] = {}  # cost name -> its optimizer's parameter names
        self._broadcast: set[str] = set()
        self._pending: dict[tuple[str, int], _Pending] = {}

    @property
    def last_losses(self) -> dict[str, torch.Tensor]:
        """Cost name → the critic's last training loss (normalised squared error; a buffer of its head,
        updated in place)."""
        found = {}
        for name, key in self._names.items():
            loss = self.heads[key]._buffers.get("last_loss")
            if loss is not None:
                found[name] = loss
        return found

    #: the networks, their optimizers' state and the target statistics are parameters and buffers of the
    #: heads, updated in place within the step (see the module's state protocol): a compiled step replays
    #: the critic's training
    step_state = StepState.IN_PLACE

    def prepare_compiled_step(self) -> tuple:
        """Called by `storch.compile_step` before each call: the optimizers'
        hyperparameters, which a trace bakes in."""
        if not self.train_critic:
            return ()
        return tuple((name, type(opt).__name__, hyperparameters(self.optimizer(name)))
                     for name, opt in sorted(self._optimizers.items()))

    def _refuse_unreplayable_training(self, name: str) -> None:
        """In the trace of a compiled step, before anything is applied: refuse training that a replay
        could not carry out (an optimizer that reads on the host, statistics averaged across ranks)."""
        if not self.train_critic or self.head(name) is None:
            return
        reason = replay_refusal(self.optimizer(name))
        if reason is None and self.sync and distributed.syncing():
            reason = "it averages its gradients and statistics across ranks (collectives are not traced)"
        if reason is not None:
            raise CompileStepError(
                f"storch.compile_step: the {type(self).__name__} of cost {name!r} trains within the step, and "
                f"{reason}. Run this step eagerly, or pass train_critic=False."
            )

    # ------------------------------------------------------------------ inputs
    def input_features(self, tensor: StochasticTensor) -> tuple[torch.Tensor, PlateLayout]:
        """``ŝ`` for the node of ``tensor``: a detached plain tensor ``(*parent plate sizes, F)`` and
        the node's parent layout (its plates without its own)."""
        node = node_of(tensor)
        layout = node.parent_layout
        distr = node.distribution
        if self.inputs is not None:
            restore_lazy_plates(distr)
            values = list(self.inputs(distr))
        else:
            values = critic_inputs(distr)
        what = f"{type(self).__name__} of node {node.name!r}"
        named = [(f"input {i} of the {what}", v) for i, v in enumerate(values)]
        if self.include_ancestors:
            for plate in layout.plates:
                if plate.node is not None:
                    ancestor = wrap(plate.node.samples, plate.node.layout)
                    named.append((f"the sample of ancestor {plate.name!r} of the {what}", ancestor))
            previous = _previous_chain_step(node)
            if previous is not None:  # its plate is the node's own now: its one sample, without it
                ancestor = wrap(previous.samples.select(0, 0), layout_of_plates(previous.parents))
                named.append((f"the sample of ancestor {previous.name!r} of the {what}", ancestor))
        if not named:
            raise ValueError(
                f"The {what} has no input: its distribution {type(distr).__name__} has no parameter "
                "tensors. Pass inputs=lambda distribution: [...] (functions of the distribution only)."
            )
        parts = []
        dtype = None
        for label, value in named:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{label} is a {type(value).__name__}, not a tensor.")
            data = _aligned(value, layout, label, node).detach()
            if dtype is None and data.is_floating_point():
                dtype = data.dtype
            parts.append(data.reshape(tuple(layout.sizes) + (-1,)))
        dtype = dtype or torch.get_default_dtype()
        features = torch.cat([p.to(dtype) for p in parts], -1)
        return features, layout

    # ------------------------------------------------------------------ heads
    def out_features(self, tensor: StochasticTensor) -> int:
        """Outputs of a network per parent-plate element (1 for a value critic)."""
        return 1

    def _make_head(self, name: str, key: str, in_features: int, out_features: int) -> _Head:
        factory = self.network_factory
        if factory is None:
            network = mlp(in_features, out_features, self.hidden)
        else:
            network = factory(in_features, out_features)
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"{type(self).__name__}: network_factory({in_features}, {out_features}) returned "
                f"{type(network).__name__}, not an nn.Module."
            )
        head = _Head(network, in_features, out_features)
        self.heads[key] = head
        self._names[name] = key
        return head

    def head(self, name: str) -> Optional[_Head]:
        """The network (with its target statistics) of cost ``name``, or ``None`` before its first use."""
        key = self._names.get(name)
        return None if key is None else self.heads[key]  # type: ignore[return-value]

    def _head_for(self, tensor: StochasticTensor, name: str, features: torch.Tensor) -> _Head:
        in_features = features.shape[-1]
        out_features = self.out_features(tensor)
        head = self.head(name)
        if head is None and is_tracing():  # a network made in a trace would be a constant of it
            self._forget_step()
            raise EagerStepNeeded(f"the {type(self).__name__} builds its network for cost {name!r}")
        if head is None:
            head = self._make_head(name, _key(name), in_features, out_features)
            head.to(device=features.device, dtype=features.dtype if features.is_floating_point() else None)
        elif (head.in_features, head.out_features) != (in_features, out_features):
            raise ValueError(
                f"The {type(self).__name__} of node {tensor.name!r} was built for cost {name!r} with "
                f"{head.in_features} inputs and {head.out_features} outputs per element of its parent plates, "
                f"but this step gives {in_features} inputs and {out_features} outputs (the distribution's "
                "shape changed). Keep the node's shape fixed, or use one method (and critic) per shape."
            )
        return head

    def optimizer(self, name: str) -> torch.optim.Optimizer:
        """The optimizer of cost ``name``'s network (made at first use), bound to the tensors in its head's
        slots (parameters, ``_optimizer_state_*`` buffers)."""
        opt = self._optimizers.get(name)
        head = self.head(name)
        if head is None:
            raise KeyError(f"{type(self).__name__}: no network for cost {name!r} yet.")
        if opt is None:
            params = [p for p in head.parameters() if p.requires_grad]
            if self.optimizer_factory is None:
                opt = default_optimizer(params, self.lr)
            else:
                opt = self.optimizer_factory(params)
            self._optimizers[name] = opt
            self._optimizer_names[name] = optimizer_parameter_names(head, opt)
        bind_optimizer(head, opt, self._optimizer_names[name])
        return opt

    def _evaluate(self, head: _Head, features: torch.Tensor, tensor: StochasticTensor) -> torch.Tensor:
        """The network's normalised output ``(*parent sizes, out_features)``, with its graph when training."""
        param = next(iter(head.parameters()), None)
        if param is not None and param.dtype != features.dtype and features.is_floating_point():
            features = features.to(param.dtype)
        with torch.set_grad_enabled(self.train_critic and torch.is_grad_enabled()):
            out = head.network(features)
        expected = tuple(features.shape[:-1]) + (head.out_features,)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"The {type(self).__name__} network of node {tensor.name!r} returned {got} for an input of shape "
                f"{tuple(features.shape)}; it must map (..., {head.in_features}) to (..., {head.out_features})."
            )
        return plain(out)

    # ------------------------------------------------------------------ baseline
    def network_name(self, cost_name: str) -> str:
        """The name under which the network of cost ``cost_name`` is kept: the cost's own name, or
        `SHARED` for a shared critic."""
        return SHARED if self.shared else cost_name

    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        features, layout = self.input_features(tensor)
        name = self.network_name(cost_node.name)
        head = self._head_for(tensor, name, features)
        if is_tracing():
            self._refuse_unreplayable_training(name)
        out = self._evaluate(head, features, tensor)[..., 0]
        self._remember(tensor, cost_node, head, wrap(out, layout) if layout.plates else out)
        prediction = (head.offset + head.scale * out).detach()
        return wrap_new(prediction, layout) if layout.plates else prediction

    def _remember(
        self, tensor: StochasticTensor, cost_node: CostTensor, head: _Head, normalised: torch.Tensor
    ) -> _Pending:
        """Keep this step's training loss ``Σ w (net − (S − μ)/σ)²`` and target statistics."""
        self._prune()
        plate = node_of(tensor).plate
        target = cost_node.detach()
        mean = plain(reduce_plates(target)).detach()
        mean_square = plain(reduce_plates(target * target)).detach()
        loss = None
        if isinstance(normalised, torch.Tensor) and normalised.requires_grad:
            standardised = (target - head.offset) / head.scale
            loss = plain(reduce_plates((normalised - standardised) ** 2))
        entry = _Pending(weakref.ref(plate), tensor.name, cost_node.name, loss, mean, mean_square)
        self._pending[(cost_node.name, id(plate))] = entry
        return entry

    def _forget_step(self) -> None:
        """Drop what this step noted (a trace that stops for an eager step leaves nothing behind)."""
        self._pending = {}

    def _prune(self) -> None:
        """Forget what nodes that no longer exist contributed (steps that never reached ``update``)."""
        dead = [k for k, p in self._pending.items() if p.plate() is None]
        for k in dead:
            del self._pending[k]

    # ------------------------------------------------------------------ training
    def update(self) -> None:
        """One optimizer step per cost name on this step's squared errors, then the target statistics
        (nothing with ``train_critic=False``)."""
        pending, self._pending = list(self._pending.values()), {}
        self._check_pending(pending)
        if not self.train_critic:
            return
        by_name: dict[str, list[_Pending]] = {}
        for entry in pending:
            by_name.setdefault(self.network_name(entry.name), []).append(entry)
        syncing = self.sync and distributed.syncing()
        for name in sorted(by_name):  # the same order on every rank
            entries = by_name[name]
            head = self.head(name)
            if head is None:
                continue
            losses = [e.loss for e in entries if e.loss is not None]
            params = [p for p in head.parameters() if p.requires_grad]
            if params and (losses or syncing):
                self._step(name, head, params, losses, syncing)
            self._update_statistics(head, entries, syncing)

    def _check_pending(self, pending: list[_Pending]) -> None:
        """Hook for subclasses: raise if this step's use of the critic was incomplete."""

    def _step(
        self, name: str, head: _Head, params: list[nn.Parameter], losses: list[torch.Tensor], syncing: bool
    ) -> None:
        for p in params:
            p.grad = None
        if losses:
            loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
            _note_loss(head, loss.detach())
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = g
        try:
            if syncing:
                distributed.synchronise_replicas_(params, first=name not in self._broadcast)
                self._broadcast.add(name)
            if any(p.grad is not None for p in params):
                step_optimizer(head, self.optimizer(name), f"the {type(self).__name__} of cost {name!r}")
        finally:
            for p in params:
                p.grad = None

    def _update_statistics(self, head: _Head, entries: list[_Pending], syncing: bool) -> None:
        """``μ ← m`` and ``E[S²] ← m₂`` at the first update, ``μ ← β μ + (1 − β) m`` after; a step whose
        target mean ``m`` or mean square ``m₂`` is not finite is skipped. Tensor operations only (no
        value read on the host), in place on the head's buffers."""
        with torch.no_grad():
            mean = torch.stack([e.mean.to(head.first_moment) for e in entries]).mean()
            mean_square = torch.stack([e.mean_square.to(head.first_moment) for e in entries]).mean()
            if syncing:
                mean, mean_square = distributed.all_reduce_mean_([mean.clone(), mean_square.clone()])
            finite = torch.isfinite(mean) & torch.isfinite(mean_square)
            first = head.updates == 0
            beta = self.decay
            for moment, value in ((head.first_moment, mean), (head.second_moment, mean_square)):
                averaged = moment * beta + (1 - beta) * value
                moment.copy_(torch.where(finite, torch.where(first, value, averaged), moment))
            head.updates.add_(finite.to(head.updates.dtype))

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> dict:
        """The networks' sizes and dtypes and the optimizers' states (copies), for ``state_dict``."""
        heads = {}
        for name, key in self._names.items():
            head = self.heads[key]
            param = next(iter(head.parameters()), None)
            dtype = str(param.dtype).replace("torch.", "") if param is not None else None
            heads[name] = {
                "key": key, "in_features": head.in_features, "out_features": head.out_features, "dtype": dtype,
            }
        optimizers = {name: copy.deepcopy(self.optimizer(name).state_dict()) for name in self._optimizers}
        return {"heads": heads, "optimizers": optimizers}

    def set_extra_state(self, state: Any) -> None:
        """Rebuild the networks saved by `storch.method.critic.Critic.get_extra_state` (their
        weights load next) and the
        optimizers' states."""
        valid = isinstance(state, dict) and all(isinstance(state.get(k), dict) for k in ("heads", "optimizers"))
        if not valid:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the '_extra_state' entry must be a dict with dicts "
                f"'heads' and 'optimizers' (written by get_extra_state), got {type(state).__name__}."
            )
        for name, spec in state["heads"].items():
            head = self.head(name)
            if head is None:
                head = self._make_head(name, spec["key"], int(spec["in_features"]), int(spec["out_features"]))
                if spec.get("dtype"):
                    head.to(dtype=getattr(torch, spec["dtype"]))
            elif (head.in_features, head.out_features) != (spec["in_features"], spec["out_features"]):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: the network of cost {name!r} has "
                    f"{head.in_features} inputs and {head.out_features} outputs, the checkpoint "
                    f"{spec['in_features']} and {spec['out_features']}."
                )
        self._optimizers, self._optimizer_names = {}, {}
        for key in self._names.values():
            drop_optimizer_state(self.heads[key])
        for name, opt_state in state["optimizers"].items():
            optimizer = self.optimizer(name)
            optimizer.load_state_dict(opt_state)
            adopt_optimizer_state(self.heads[self._names[name]], optimizer, f"the {type(self).__name__} of {name!r}")
        self._pending = {}

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the current step's pending losses (graphs, weak references)."""
        state = super().__getstate__()
        state["_pending"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickle, also a critic pickled before its losses and optimizer state lived in buffers."""
        old_losses = state.pop("last_losses", None) or {}
        super().__setstate__(state)
        if "_optimizer_names" not in self.__dict__:
            self._optimizer_names = {}
            for name, opt in self._optimizers.items():
                head = self.heads[self._names[name]]
                self._optimizer_names[name] = optimizer_parameter_names(head, opt)
                adopt_optimizer_state(head, opt, f"the {type(self).__name__} of {name!r}")
            for name, loss in old_losses.items():
                _note_loss(self.heads[self._names[name]], loss)

    def extra_repr(self) -> str:
        parts = [f"lr={self.lr}"] if self.optimizer_factory is None else []
        if not self.train_critic:
            parts.append("train_critic=False")
        if self.include_ancestors:
            parts.append("include_ancestors=True")
        if not self.sync:
            parts.append("sync=False")
        if self.shared:
            parts.append("shared=True")
        return ", ".join(parts)


class QCritic(Critic):
    """A learned Q-function ``Q(ŝ, x)`` with its exact expectation correction, for discrete nodes.

    ``ĝ = (S − Q(ŝ, x)) ∇log q(x | ŝ) + ∇ E_{x'~q}[Q(ŝ, x')]``, unbiased for any ``Q`` (see the
    module docstring, and Weber et al. 2019 on critics that condition on the node's value). ``Q`` is
    additive over the node's independent variables, ``Q(ŝ, x) = μ + σ Σ_d net(ŝ)[d, x_d]``: the
    network maps ``ŝ`` (the node's distribution parameters, as for `storch.method.critic.Critic`) to one
    value per
    variable ``d`` and value ``k`` of the node, and ``E_q[Q] = μ + σ Σ_d Σ_k q_d(k) net(ŝ)[d, k]`` is
    exact. It is trained on ``(Q(ŝ, x) − S)²`` after each backward pass.

    Supports the distributions with registered coordinates
    (`storch.method.local_expectation.register_coordinates`:
    ``Bernoulli``, ``Categorical``,
    ``OneHotCategorical``, each with any batch shape). The correction is added by
    `storch.method.ScoreFunction` (and `storch.method.Infer`)
    through
    `storch.method.critic.QCritic.correction` (``needs_correction = True``); a method that cannot apply
    it refuses the
    baseline when it is built (`storch.method.MAPO`), and one that uses the baseline's value
    without it gets an error after the backward pass, since its gradient would be biased.

    Takes the arguments of `storch.method.critic.Critic`.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> from storch.method import ScoreFunction
        >>> theta = torch.zeros(3, requires_grad=True)
        >>> z = ScoreFunction("z", n_samples=2, baseline_factory="q_critic")(OneHotCategorical(logits=theta))
        >>> storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0])).sum(-1), "f")
        >>> _ = storch.backward()
        >>> z.method.baseline.head("f").out_features   # one value per category
        3
    """

    needs_correction = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._expectations: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _coordinates(self, tensor: StochasticTensor):
        distr = tensor.distribution
        coordinates = coordinates_for(distr)
        if coordinates is None:
            hint = ""
            if type(distr).__name__ == "Independent":
                hint = " Pass the base distribution (e.g. Bernoulli(logits)) instead of Independent(...)."
            raise ValueError(
                f"QCritic of node {tensor.name!r}: its distribution {type(distr).__name__} has no enumerable "
                "factorised support registered, so E_q[Q] cannot be computed exactly. Supported: Bernoulli, "
                "Categorical, OneHotCategorical (register others with "
                f"storch.method.local_expectation.register_coordinates), or use baseline_factory='critic'.{hint}"
            )
        return coordinates

    def _var_shape(self, tensor: StochasticTensor) -> tuple[int, ...]:
        n_parent = len(node_of(tensor).layout.plates) - 1
        return tuple(tensor.distribution.batch_shape)[n_parent:]

    def out_features(self, tensor: StochasticTensor) -> int:
        coordinates = self._coordinates(tensor)
        k = coordinates.values(tensor.distribution).shape[0]
        return math.prod(self._var_shape(tensor)) * k

    def compute_baseline(self, tensor: StochasticTensor, cost_node: CostTensor) -> torch.Tensor:
        node = node_of(tensor)
        coordinates = self._coordinates(tensor)
        features, layout = self.input_features(tensor)
        name = self.network_name(cost_node.name)
        head = self._head_for(tensor, name, features)
        if is_tracing():
            self._refuse_unreplayable_training(name)
        values = coordinates.values(node.distribution)  # (K, *event)
        k = values.shape[0]
        var_shape = self._var_shape(tensor)
        out = self._evaluate(head, features, tensor).reshape(tuple(layout.sizes) + var_shape + (k,))
        # which value each variable of each sample took: (n, *parents, *var, K)
        samples = node.samples
        n_event = values.dim() - 1
        match = samples.unsqueeze(samples.dim() - n_event) == values.to(samples.dtype)
        if n_event:
            match = match.all(tuple(range(-n_event, 0)))
        match = match.to(out.dtype)
        var_dims = tuple(range(-len(var_shape) - 1, 0))
        chosen = (match * out.unsqueeze(0)).sum(var_dims)  # (n, *parents), normalised Q(ŝ, x)
        self._remember(tensor, cost_node, head, wrap(chosen, node.layout)).corrected = False
        self._expectations[(cost_node.name, id(node.plate))] = (out.detach(), head.scale.detach())
        prediction = (head.offset + head.scale * chosen).detach()
        return wrap_new(prediction, node.layout)

    def correction(self, tensor: StochasticTensor, cost_node: CostTensor) -> Optional[torch.Tensor]:
        """``E_q[Q] − stopgrad(E_q[Q])`` with ``Q`` detached: gradient ``∇ E_q[Q]``, value 0."""
        node = node_of(tensor)
        entry = self._expectations.pop((cost_node.name, id(node.plate)), None)
        if entry is None:
            raise RuntimeError(
                f"QCritic.correction for node {tensor.name!r} and cost {cost_node.name!r} was called before "
                "compute_baseline; call compute_baseline first (ScoreFunction does)."
            )
        out, scale = entry
        pending = self._pending.get((cost_node.name, id(node.plate)))
        if pending is not None:
            pending.corrected = True
        layout = node.parent_layout
        coordinates = self._coordinates(tensor)
        restore_lazy_plates(node.distribution)
        probs = _aligned(coordinates.probs(node.distribution), layout, f"the probabilities of node {tensor.name!r}")
        probs = probs.reshape(out.shape).to(out.dtype)
        var_dims = tuple(range(len(layout.plates), out.dim()))
        expectation = scale * (probs * out).sum(var_dims)  # σ Σ_d Σ_k q_d(k) net[d, k]; μ has no gradient
        term = expectation - expectation.detach()
        return wrap_new(term, layout) if layout.plates else term

    def _forget_step(self) -> None:
        super()._forget_step()
        self._expectations = {}

    def _check_pending(self, pending: list[_Pending]) -> None:
        self._expectations = {}
        uncorrected = sorted({e.plate_name for e in pending if not e.corrected})
        if uncorrected:
            raise RuntimeError(
                f"QCritic of node(s) {', '.join(repr(n) for n in uncorrected)}: the method used Q(ŝ, x) as a "
                "baseline without its expectation correction ∇E_q[Q] (Baseline.correction), so that "
                "gradient was biased. Use the Q critic with ScoreFunction or Infer, or add "
                "baseline.correction(tensor, cost) to your method's control-variate term; "
                "baseline_factory='critic' needs no correction."
            )

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_expectations"] = {}
        return state


def _note_loss(head: _Head, loss: torch.Tensor) -> None:
    """Keep the last training loss in the head's ``last_loss`` buffer (made at the first, then in place)."""
    current = head._buffers.get("last_loss")
    if current is None or (current.dtype, current.device) != (loss.dtype, loss.device):
        head.register_buffer("last_loss", loss.detach().clone(), persistent=False)
    else:
        with torch.no_grad():
            current.copy_(loss)
