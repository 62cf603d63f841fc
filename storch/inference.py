"""Costs, the surrogate loss and ``storch.backward``.

Registered costs live in a `contextvars.ContextVar` (a `storch._step.StepLog`), so each thread
and each asyncio task builds its own graph: a task that inherits its parent's context cannot add
costs to the parent's graph, and the ``T``-th cost of a step is registered in constant time.

The surrogate loss (Storchastic, §3) is built per cost, so that each sampled decision is credited
only with the costs downstream of it. Stochastic nodes are read off the cost's plates and processed
newest first (a reverse topological order):

    S ← f;   for each plate of f, newest first:
        stochastic node i:  S ← Σ_{x ∈ X_i} w_i(x) [□(l_i(x)) S(x) + (1 − □(l_i(x))) a_i(x)]
        independent plate:  S ← Σ_j w_j S_j        (the minibatch mean)

``surrogate = Σ_costs S``. Its forward value is the estimate of the expected total cost and its
derivatives of any order are the gradient estimates.

The nodes of a chain of single-sample nodes (`storch.plate.ChainPlate`: an
episode's decisions, each drawn from the last) share one plate, so a cost carries only the chain's step
it was computed from. Their steps are processed for all costs at once, newest first: the partial
surrogates that reach a step with the same plates are summed (``R_s``, the reward to go) and the step's
term ``□(l_s) R_s + (1 − □(l_s)) a_s`` is formed once. The recursion is linear in ``S``, so the sum is
the costs' separate recursions added up (with baselines that are linear in the cost, the moving average
and leave-one-out ones, to the same values; a critic is trained on ``R_s``), and ``T`` decisions with a
cost after each take ``O(T)`` node terms instead of ``O(T²)``. When the steps of a chain share one
score-function method, the whole chain is formed at once from its stacked log-probabilities and a
cumulative sum (`storch._chain_terms`): the same surrogate, to every order.

An independent plate made again after a node was drawn on an equal one (a minibatch plate made at
every step of a rollout) is reduced after that node, as it would be had it been made once.
"""

from __future__ import annotations

import functools
import heapq
import math
import operator
import warnings
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

from storch import _tracing
from storch._chain_terms import chain_term
from storch._step import StepLog, forget_sampled, sampled_plates
from storch.exceptions import NonFiniteCostError, StaleCostError, UnusedNodeWarning
from storch.plate import MAX_PLATES  # noqa: F401 (re-exported)
from storch.plate import ChainPlate, Plate, PlateClashError, layout_of_plates, merge_layouts, uniform_weight
from storch.reductions import reduce_plate
from storch.state import check_replayable
from storch.tensor import CostTensor, StochasticTensor, Tensor, _Disable, layout_of, plain, wrap_new
from storch.util import _named_parameters, elementwise, magic_box, restore_lazy_plates

if TYPE_CHECKING:  # pragma: no cover  (methods import this module: add_cost, backward)
    from storch.method.method import Method

__all__ = ["add_cost", "backward", "surrogate_loss", "reset", "registered_costs", "MAX_PLATES"]


#: the costs registered in this context, by name too (a `StepLog`: the T-th cost copies nothing, its
#: name is checked in O(1))
_COSTS: StepLog[CostTensor] = StepLog("storch_costs", key=lambda cost: cost.name)


# whether a storch.backward() cleared the registry and no cost was registered (nor reset) since: the
# reason a later backward finds no costs, named in its error
_CONSUMED: ContextVar[bool] = ContextVar("storch_costs_consumed", default=False)
# how many costs were registered under each name that was given more than once (set with _COSTS)
_REPEATS: ContextVar[dict[str, int]] = ContextVar("storch_cost_repeats", default={})


def add_cost(cost: torch.Tensor, name: str | None = None) -> None:
    """Register a cost node (to be minimised) for the next `storch.inference.backward`.

    A cost must hold one value per combination of its plates: no event dimensions. Sum or average
    them first (e.g. ``loss.sum(-1)``).

    Args:
        cost: the cost, a storch tensor (or a plain tensor / number for a deterministic cost).
        name: the cost's name; defaults to ``"cost_<i>"``. A name registered again in the same step
            (Storchastic's ``add_cost(…, "loss")`` in a loop over nodes) adds another cost, as
            Storchastic did: each is its own cost (estimated with the nodes it depends on), registered
            as ``"loss"``, ``"loss#2"``, ``"loss#3"``, … A cost left over from an earlier step that
            raised before ``backward`` (same name or not) holds that step's nodes, which clash with
            this step's nodes of the same names: `storch.inference.backward` refuses
            them with `StaleCostError`. Call `storch.inference.reset` at the start of each
            step: a leftover cost without stochastic nodes cannot be told from one of this step.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([1.0, 3.0]), 0, "data")
        >>> storch.add_cost(x * 2, "double")
        >>> [c.name for c in storch.registered_costs()], storch.surrogate_loss().item()
        (['double'], 4.0)
        >>> storch.add_cost(x * 3, "double")       # the same name again: a second cost
        >>> [c.name for c in storch.registered_costs()], storch.surrogate_loss().item()
        (['double', 'double#2'], 10.0)
        >>> storch.reset()
    """
    if name is None:
        name = f"cost_{len(_COSTS)}"
    try:
        cost = _as_cost_tensor(cost, name)
        _check_cost(cost, name)
    except Exception:
        reset()  # a failed step leaves nothing behind for the next one
        raise
    if _COSTS.holds(name):
        name = _next_name(name)
    layout = layout_of(cost)
    # storch's own object for the cost: a view while gradients flow through it; else a detached tensor on the
    # same values, which does not keep the user's tensor object alive (a view holds its base)
    with _Disable():  # plain reads and views: no trip through storch's dispatch
        flows = cost.requires_grad
        own = cost.view_as(cost) if flows else cost.detach()
    registered = CostTensor._retype_as(own, layout, name)
    if flows and isinstance(cost, Tensor):  # the surrogate multiplies the user's tensor itself: no view in its graph
        registered._source = cost
    _COSTS.append(registered)
    _CONSUMED.set(False)


def _next_name(name: str) -> str:
    """The name of the next cost registered as ``name`` in this step: ``name#2``, ``name#3``, …"""
    repeats = _REPEATS.get()
    k = repeats.get(name, 1) + 1
    while _COSTS.holds(f"{name}#{k}"):  # a name the user chose
        k += 1
    _REPEATS.set({**repeats, name: k})
    return f"{name}#{k}"


def _as_cost_tensor(cost: Any, name: str) -> torch.Tensor:
    if isinstance(cost, torch.Tensor):
        return cost
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        return torch.tensor(float(cost), dtype=torch.get_default_dtype())
    raise TypeError(
        f"storch.add_cost({name!r}): a cost is a tensor (or a Python number for a constant), got "
        f"{type(cost).__name__} {cost!r:.80}. Register one tensor per cost, e.g. "
        "storch.add_cost(loss.sum(-1), 'reconstruction')."
    )


#: the other way a cost loses a node's plates: values that went through code outside torch
OUTSIDE_TORCH_HINT = (
    "If the cost is computed outside torch from a sample's values (a numpy environment stepped with "
    "the action, whose reward comes back as a number or a new tensor), it carries no link to the "
    "sample: wrap that code in storch.deterministic, which hands it plain tensors and gives its "
    "outputs the sample's plates, e.g. obs, reward = storch.deterministic(env_step)(action)."
)


def _check_cost(cost: torch.Tensor, name: str) -> None:
    """Refuse a cost that cannot be registered, with the reason and the fix."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"storch.add_cost: a cost name is a non-empty string, got {name!r}.")
    layout = layout_of(cost)
    if cost.dim() != len(layout.sizes):
        event = tuple(cost.shape[len(layout.sizes):])
        raise ValueError(
            f"Cost {name!r} has shape {tuple(cost.shape)} with plates {list(layout.names)}: it has "
            f"event dimensions {event}, but a cost must hold one value per plate combination. Reduce "
            "them first, e.g. cost.sum(-1) (or storch.nn losses with reduction='sum'). If a dimension "
            "is a minibatch of independent data, make it a plate before the model uses it, "
            "x = storch.denote_independent(x, 0, 'data'): each datum then gets its own baselines, "
            "and storch averages the cost over the plate for you."
            + (" " + OUTSIDE_TORCH_HINT if sampled_plates() else "")
        )
    if not cost.dtype.is_floating_point:
        raise TypeError(f"Cost {name!r} must be a floating point tensor, got {cost.dtype}.")


def registered_costs() -> tuple[CostTensor, ...]:
    """The costs registered in the current context."""
    return _COSTS.items()


def reset() -> None:
    """Forget the registered costs (and the sampled nodes) of the current context.

    `storch.inference.backward` resets on its own, also when it raises. Call ``reset`` at the start
    of a step, or where you catch an error raised between `storch.inference.add_cost` and
    `storch.inference.backward`, so that costs of a failed step do not join the next one.
    """
    _clear_registry()
    _CONSUMED.set(False)


def _clear_registry() -> None:
    """Forget the registered costs and the sampled nodes (what `backward` does when it ends)."""
    _COSTS.clear()
    _REPEATS.set({})
    forget_sampled()


class _Record:
    """Per-backward bookkeeping: node views built once, and what each method saw."""

    def __init__(self) -> None:
        self.nodes: dict[int, StochasticTensor] = {}
        self.triples: dict[int, tuple[Method, list[tuple[Any, ...]]]] = {}

    def node_tensor(self, plate: Plate) -> StochasticTensor:
        key = id(plate)
        if key not in self.nodes:
            self.nodes[key] = plate.node.stochastic_tensor()  # type: ignore[union-attr]
        return self.nodes[key]

    def add(self, method: Method, triple: tuple[Any, ...]) -> None:
        self.triples.setdefault(id(method), (method, []))[1].append(triple)


def _sum_extra_dims(t: torch.Tensor) -> torch.Tensor:
    """Sum a per-sample term over its non-plate dimensions (e.g. per-variable log-probabilities)."""
    n = len(layout_of(t).sizes)
    if t.dim() > n:
        return t.sum(tuple(range(n, t.dim())))
    return t


def _node_step(S: Tensor, plate: Plate, cost_name: str, record: _Record) -> torch.Tensor:
    """One step of the surrogate recursion for the stochastic node that owns ``plate``."""
    term = _node_term(S, plate, cost_name, record)
    if plate.size == 1 and plate.weight is uniform_weight(1):  # one sample of weight 1: its term, unreduced
        layout = term._layout  # type: ignore[attr-defined]
        i = layout.position(plate)
        with _Disable():
            return wrap_new(term.squeeze(i), layout.without_position(i))
    return reduce_plate(term, plate, detach_weights=False)  # type: ignore[arg-type]


def _node_term(S: Tensor, plate: Plate, cost_name: str, record: _Record) -> torch.Tensor:
    """``□(l(x))·S(x) + (1 − □(l(x)))·a(x)`` for the node that owns ``plate``, per sample (before
    the plate is reduced)."""
    node = plate.node
    tensor = record.node_tensor(plate)
    if type(S) is CostTensor:  # the registered cost itself (storch's own view of the user's tensor)
        downstream = S
    else:  # a reduction storch made in this recursion: retyped in place (no view, no autograd node)
        downstream = CostTensor._retype_as(S, S._layout, cost_name)
    l, cv = node.method.estimator(tensor, downstream)  # type: ignore[union-attr]  # noqa: E741
    term: torch.Tensor = S
    if l is not None or cv is not None:  # a new tensor is made from S: from the user's cost itself, if S is it
        term = S.__dict__.get("_source", S) if type(S) is CostTensor else S
    if l is not None:
        term = elementwise(operator.mul, magic_box(_sum_extra_dims(l)), term)
    if cv is not None:
        term = elementwise(operator.add, term, _sum_extra_dims(cv))
    record.add(node.method, (tensor, downstream, term))  # type: ignore[union-attr]
    return term


def _surrogate_order(plate: Plate) -> int:
    return plate.surrogate_order


class _Partial:
    """A cost's surrogate part way through the recursion, stopped at a step of a single-sample chain.

    ``fresh``: still the registered cost itself (no node step applied yet); ``index``: its place
    among the registered costs (partials are merged in that order)."""

    __slots__ = ("S", "name", "fresh", "index", "plate")

    def __init__(self, S: torch.Tensor, name: str, fresh: bool, index: int, plate: ChainPlate) -> None:
        self.S, self.name, self.fresh, self.index, self.plate = S, name, fresh, index, plate


def _cost_surrogate(S: torch.Tensor, name: str, record: _Record, alone: bool = False) -> "torch.Tensor | _Stopped":
    """Run the recursion on ``S`` (a registered cost, or a partial surrogate) until no plate is left,
    and return the plain result; or stop at a step of a single-sample chain (``S``'s chain steps are
    processed together with the other costs that reach them, see `_chain_steps`).

    ``alone``: ``S`` is the only registered cost. The first step of a chain is then reached by it
    alone (a tensor carries one step of a chain, the newest it depends on), and its node term is
    the one the chain's recursion forms for a single step: made here, as any node's."""
    cost = S
    while isinstance(S, Tensor) and S._layout.plates:
        plate = _next_plate(S._layout.plates)
        if plate.node is None:
            S = reduce_plate(S, plate, detach_weights=False)
        elif isinstance(plate, ChainPlate) and not (alone and plate.ancestor is None):
            return _Stopped(S, plate)
        else:
            S = _node_step(S, plate, name, record)  # type: ignore[arg-type]
    if S is cost or not isinstance(S, Tensor):
        return plain(S)
    S.__class__ = torch.Tensor  # a reduction storch made: retyped in place (no view, no autograd node)
    return S


def _next_plate(plates: tuple[Plate, ...]) -> Plate:
    """The plate the recursion handles next: the newest, except an independent plate that a node among
    ``plates`` was drawn on (an equal plate among the node's parents), which comes after that node.

    Only an independent plate made again after the node was drawn (``storch.denote_independent`` of
    each step's observations in a rollout) is newer than such a node: reduced first, it would average
    the costs over the plate along which the node's log-probabilities vary."""
    plate = max(plates, key=_surrogate_order)
    if plate.node is not None or not any(q.node is not None and plate in q.parents for q in plates):
        return plate
    return _next_plate(tuple(p for p in plates if p is not plate))


class _Stopped:
    """``_cost_surrogate``'s answer for a partial surrogate that reached a chain step."""

    __slots__ = ("S", "plate")

    def __init__(self, S: torch.Tensor, plate: ChainPlate) -> None:
        self.S, self.plate = S, plate


def _chain_steps(partials: list[_Partial], record: _Record) -> torch.Tensor | None:
    """Finish the partial surrogates that stopped at steps of single-sample chains.

    Steps are processed newest first. At each step, the partials that reach it with the same plates
    are summed before the step's node term is formed: for a node ``s`` of a chain with costs ``c_t``
    after it, ``S_s = □(l_s)·R_s + (1 − □(l_s))·a_s(R_s)`` with ``R_s = Σ_{t ≥ s} (c_t carried through
    the later steps)``, the reward-to-go. Every node term is linear in ``R_s``, so this equals the sum
    of the costs' separate recursions (a baseline is computed on ``R_s``, named after the first cost
    registered at this step, else after the carried partial); each step is formed once, so ``T``
    decisions with a reward after each cost ``O(T)``, not ``O(T²)``.
    """
    heap = [(-p.plate.surrogate_order, p.index, i) for i, p in enumerate(partials)]
    heapq.heapify(heap)
    total = None
    stepwise: set[int] = set()  # the chains formed step by step (the whole chain's form was refused)
    while heap:
        _, _, i = heapq.heappop(heap)
        first = partials[i]
        group = [first]
        while heap and partials[heap[0][2]].plate is first.plate:
            group.append(partials[heapq.heappop(heap)[2]])
        formed = None
        if id(first.plate.chain) not in stepwise:
            formed, heap = _whole_chain(group, heap, partials, record)
            if formed is None:
                stepwise.add(id(first.plate.chain))
        if formed is None:
            formed = [_step_term(merged, record) for merged in _merge_by_layout(group)]
        for S, name, index in formed:
            result = _cost_surrogate(S, name, record)
            if isinstance(result, _Stopped):
                partials.append(_Partial(result.S, name, False, index, result.plate))
                heapq.heappush(heap, (-result.plate.surrogate_order, index, len(partials) - 1))
            else:
                total = result if total is None else total + result
    return total


def _step_term(merged: _Partial, record: _Record) -> tuple[torch.Tensor, str, int]:
    """The node term of one chain step on the summed partials ``merged``, stepped back to the step before."""
    S = _node_term(merged.S, merged.plate, merged.name, record)  # type: ignore[arg-type]
    return _step_back(S, merged.plate), merged.name, merged.index


def _whole_chain(
    group: list[_Partial], heap: list[tuple[int, int, int]], partials: list[_Partial], record: _Record
) -> tuple[list[tuple[torch.Tensor, str, int]] | None, list[tuple[int, int, int]]]:
    """The terms of the whole chain whose newest reached step is ``group``'s, formed at once
    (`storch._chain_terms`), and the heap without the chain's other steps; or
    ``None`` and the heap as it was, where the chain is formed step by step."""
    chain = group[0].plate.chain
    mine, newest_other = list(group), -1
    for _, _, i in heap:
        p = partials[i]
        if p.plate.chain is chain:
            mine.append(p)
        else:
            newest_other = max(newest_other, p.plate.surrogate_order)
    formed = chain_term(mine, newest_other, record)
    if formed is None:
        return None, heap
    rest = [entry for entry in heap if partials[entry[2]].plate.chain is not chain]
    heapq.heapify(rest)
    return [formed], rest


def _merge_by_layout(group: list[_Partial]) -> list[_Partial]:
    """The partials at one chain step, summed per set of plates (in registration order)."""
    by_plates: dict[tuple, list[_Partial]] = {}
    for partial in sorted(group, key=lambda p: p.index):
        by_plates.setdefault(partial.S._layout.plates, []).append(partial)
    merged = []
    for members in by_plates.values():
        if len(members) == 1:
            merged.append(members[0])
            continue
        fresh = [m for m in members if m.fresh]
        named = fresh[0] if fresh else members[0]
        S = members[0].S
        for m in members[1:]:
            S = elementwise(operator.add, S, m.S)
        merged.append(_Partial(S, named.name, False, members[0].index, named.plate))
    return merged


def _step_back(S: torch.Tensor, plate: ChainPlate) -> torch.Tensor:
    """``S`` after the node step of chain step ``plate``: relabelled to the previous step (one sample:
    no reduction), or, at the chain's first step, reduced over its plate (of weight 1)."""
    if plate.ancestor is None:
        return reduce_plate(S, plate, detach_weights=False)  # type: ignore[arg-type]
    plates = [plate.ancestor if p is plate else p for p in S._layout.plates]
    order = sorted(range(len(plates)), key=lambda i: plates[i].order, reverse=True)  # newest first
    with _Disable():
        moved = S.permute(*order, *range(len(plates), S.dim())) if order != sorted(order) else S.view_as(S)
    return wrap_new(moved, layout_of_plates([plates[i] for i in order]))


def _no_costs_error() -> ValueError:
    """The error for a surrogate without costs: never registered, or consumed by a `backward`."""
    if _CONSUMED.get():
        return ValueError(
            "No costs are registered in this context: the previous storch.backward() consumed them "
            "(it clears the registry when it ends, also when it raises), and no storch.add_cost was "
            "called since. Re-run the model and call storch.add_cost(cost, name) again before each "
            "storch.backward(). (retain_graph=True keeps torch's autograd graph, not storch's costs; "
            "to differentiate the same costs more than once, take loss = storch.surrogate_loss(), "
            "which keeps the registry, and call loss.backward(retain_graph=True).)"
        )
    return ValueError(
        "No costs are registered in this context: call storch.add_cost(cost, name) before "
        "storch.backward() or storch.surrogate_loss()."
    )


def _surrogate(costs: tuple[CostTensor, ...], record: _Record) -> torch.Tensor:
    if not costs:
        raise _no_costs_error()
    _check_one_step(costs)
    total = None
    partials: list[_Partial] = []
    alone = len(costs) == 1
    for index, cost in enumerate(costs):
        s = _cost_surrogate(cost, cost.name, record, alone)
        if isinstance(s, _Stopped):  # at a chain step: with the other costs that reach it
            partials.append(_Partial(s.S, cost.name, s.S is cost, index, s.plate))
        else:
            total = s if total is None else total + s
    if partials:
        chained = _chain_steps(partials, record)
        total = chained if total is None else total + chained
    for tensor in record.nodes.values():  # parameters the estimators computed with dispatch off
        distribution = tensor._node.distribution_if_made()  # (a copy not made was not computed with)
        if distribution is not None:
            restore_lazy_plates(distribution)
    return total  # type: ignore[return-value]


def _check_one_step(costs: tuple[CostTensor, ...]) -> None:
    """Refuse costs whose stochastic nodes clash: two different nodes with one plate name.

    Within one step, node names are unique (they clash in any operation that meets both), so such
    costs come from two steps: a cost left over from a step that raised before ``backward``.
    """
    if len(costs) < 2:
        return
    try:
        for a, b in _plates_sharing_a_name(costs):
            merge_layouts([layout_of_plates([a]), layout_of_plates([b])])
    except PlateClashError as clash:
        reset()
        names = ", ".join(repr(c.name) for c in costs)
        raise StaleCostError(
            f"The registered costs ({names}) hold two different stochastic nodes with one plate name: "
            f"{clash} Within one step a node name is unique, so one of these costs is left over from "
            "an earlier step that raised before storch.backward(). Call storch.reset() at the start "
            "of each step (or where you catch the error); the registry has been cleared."
        ) from None


def _plates_sharing_a_name(costs: tuple[CostTensor, ...]) -> list[tuple[Plate, Plate]]:
    """The pairs of different plates with one name among the costs' plates: the only ones that can clash.

    Each cost is reduced over its own plates, so costs never meet in one tensor, and the check looks
    at the plates one name at a time: costs of independent nodes need not fit in one tensor together
    (an episode with a reward after each of a hundred decisions holds a hundred plates).
    """
    first: dict[str, Plate] = {}
    pairs: dict[tuple[int, int], tuple[Plate, Plate]] = {}
    for cost in costs:
        for plate in layout_of(cost).plates:
            seen = first.setdefault(plate.name, plate)
            if seen is not plate and not _steps_of_one_chain(seen, plate):
                pairs.setdefault((id(seen), id(plate)), (seen, plate))
    return list(pairs.values())


def _steps_of_one_chain(a: Plate, b: Plate) -> bool:
    """Whether ``a`` and ``b`` are steps of one single-sample chain (one name, never a clash: the
    newer step is kept where they meet), so that a rollout's costs are not merged pairwise."""
    return type(a) is ChainPlate and type(b) is ChainPlate and a.chain is b.chain


def surrogate_loss(costs: tuple[CostTensor, ...] | None = None) -> torch.Tensor:
    """The surrogate loss of the registered costs (or of ``costs``), without differentiating it.

    Its value is the estimate of the expected total cost; its derivatives are the gradient
    estimates. Unlike `storch.inference.backward` this keeps the registry and updates no method state.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> x = storch.method.Reparameterization("x", n_samples=3)(Normal(torch.tensor(1.0), 1.0))
        >>> storch.add_cost(x * 0.0 + 2.0, "two")
        >>> storch.surrogate_loss()
        tensor(2.)
        >>> storch.reset()
    """
    return _surrogate(_COSTS.items() if costs is None else tuple(costs), _Record())


def _retain_param_grads(record: _Record) -> list[Any]:
    """Hooks that store, for each node in this surrogate, the gradient of each distribution
    parameter in ``node.param_grads``; removed again right after the backward pass.

    (Not ``retain_grad``: it cannot be undone, and a later ``autograd.grad(create_graph=True)``
    through the parameter, as in RELAX's variance step or a user's Hessian, would store a gradient
    whose graph holds the parameter itself: a reference cycle through autograd that ``gc`` cannot
    free, leaking the whole step.)
    """
    handles = []
    with _Disable():  # plain Tensor.register_hook: no trip through storch's __torch_function__
        for tensor in record.nodes.values():
            node = tensor._node
            grads = node.param_grads
            grads.clear()
            distribution, previous_step = node.drawn_distribution()
            seen = None  # the parameters of a distribution mostly share one layout: worked out once
            for name, param in dict(_named_parameters(distribution)).items():  # get_distr_parameters, inline
                if not param.requires_grad:
                    continue
                layout = layout_of(param)
                if layout is not seen:
                    seen = layout
                    # a chain step drawn from parameters that carry the previous step: its gradient without it
                    carried = previous_step is not None and any(p is previous_step for p in layout.plates)
                    at = layout.position(previous_step) if carried else None
                    kept_layout = layout if at is None else layout.without_position(at)
                grad_fn = param.grad_fn
                if grad_fn is None:  # a leaf: a hook on the tensor (run by its gradient accumulator)
                    handles.append(param.register_hook(functools.partial(_keep_grad, grads, name, kept_layout, at)))
                else:  # a pre-hook of the node that computed it (registered in C++, after the tensor's own hooks)
                    keep = functools.partial(_keep_output_grad, grads, name, kept_layout, at, param.output_nr)
                    handles.append(grad_fn.register_prehook(keep))
    return handles


def _keep_grad(grads: dict, name: str, layout: Any, drop: int | None, grad: torch.Tensor) -> None:
    """Store a parameter's gradient, laid out as ``layout``, with the size-1 dimension ``drop`` removed."""
    with _Disable():
        value = (grad if drop is None else grad.select(drop, 0)).detach().clone()  # autograd may reuse ``grad``
    grads[name] = wrap_new(value, layout) if layout.plates else value


def _keep_output_grad(
    grads: dict, name: str, layout: Any, drop: int | None, index: int, grad_outputs: tuple[torch.Tensor | None, ...]
) -> None:
    """`_keep_grad` of output ``index`` of an autograd node, from the gradients of its outputs (a
    pre-hook of the node: none when no gradient reached the parameter)."""
    grad = grad_outputs[index]
    if grad is not None:
        _keep_grad(grads, name, layout, drop, grad)


def _named_costs(costs: tuple[CostTensor, ...]) -> list[tuple[str, torch.Tensor, list[str]]]:
    """``(name, detached plain values, plate names)`` of each cost, for `non_finite_error`."""
    return [(cost.name, plain(cost).detach(), cost.plate_names) for cost in costs]


def _check_finite(loss: torch.Tensor, costs: tuple[CostTensor, ...]) -> None:
    """Raise `storch.inference.NonFiniteCostError`, naming the costs, if the surrogate loss is
    NaN or infinite."""
    if loss.device.type == "meta" or math.isfinite(loss.item()):  # meta tensors hold no values
        return
    raise non_finite_error(
        loss.item(), _named_costs(costs),
        "Nothing was differentiated, no baseline or method state was updated, and the registry was cleared.",
    )


def non_finite_error(
    loss: float, costs: list[tuple[str, torch.Tensor, list[str]]], consequence: str
) -> NonFiniteCostError:
    """The error for a non-finite surrogate loss: which costs are not finite, and where.

    ``costs`` holds ``(name, plain values, plate names)`` per cost; ``consequence`` says what was
    (not) done about the step.
    """
    with _Disable():
        found = []
        for name, values, plate_names in costs:
            bad = ~torch.isfinite(values)
            n_bad = int(bad.sum())
            if n_bad:
                where = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
                found.append(
                    f"{name!r} at {n_bad} of {bad.numel()} values (plates {plate_names}; "
                    f"first at index {where}: {values[where].item()})"
                )
    detail = (
        "Non-finite costs: " + "; ".join(found) + "."
        if found
        else "Every cost is finite, so a log-probability, weight or control variate of an estimator is "
        "not (e.g. log p(x) = -inf for a sample outside the support)."
    )
    return NonFiniteCostError(f"storch.backward: the surrogate loss is {loss}. {detail} {consequence}")


def _refuse_state_between_steps(record: _Record) -> None:
    """In a trace of `storch.compile_step`: refuse methods that keep ``HOST`` state
    between steps (`storch.state.check_replayable`, which names the method,
    the part and the reason), before anything is differentiated or updated.

    The compiled step replays the traced operations only; state kept or decided on the host would stay
    as the traced step left it, silently.
    """
    for method, _ in record.triples.values():
        check_replayable(method)


def _unused_nodes(costs: tuple[CostTensor, ...]) -> list[Plate]:
    """The plates of nodes sampled in this step with parameters that require grad, but carried by no
    registered cost: their gradient is zero (a plate reduced before `add_cost`, or an unused node)."""
    in_costs = set()
    for cost in costs:
        for plate in layout_of(cost).plates:
            while plate is not None and id(plate) not in in_costs:  # a later step of a chain carries
                in_costs.add(id(plate))  # the earlier steps' nodes (each step visited once: O(T))
                plate = getattr(plate, "ancestor", None)
    return [plate for plate in sampled_plates() if id(plate) not in in_costs and plate.node is not None]


def _describe_nodes(plates: list[Plate]) -> str:
    """``'z' (ScoreFunction), 'b' (Expect)``: the nodes that own ``plates``."""
    return ", ".join(f"{plate.name!r} ({type(plate.node.method).__name__})" for plate in plates)  # type: ignore[union-attr]


def _warn_unused_nodes(unused: list[Plate]) -> None:
    """Warn about nodes sampled in this step whose gradient is zero because no cost carries them."""
    for plate in unused:
        warnings.warn(
            f"Node {_describe_nodes([plate])} was sampled in this step, but no registered cost carries "
            f"its plate {plate.name!r}, so its distribution's parameters get no gradient from it. If a "
            "cost depends on it, the plate was reduced before storch.add_cost (storch.reduce_plates, "
            "storch.sum/mean, logsumexp): register the cost with the plate and let storch reduce it. "
            f"{OUTSIDE_TORCH_HINT} If the node is not used, sample it under torch.no_grad().",
            UnusedNodeWarning,
            stacklevel=3,
        )


def _nothing_to_differentiate(unused: list[Plate]) -> ValueError:
    """The error for a surrogate loss that requires no grad, naming the real cause.

    With nodes whose parameters require grad but whose plates no cost carries, the cause is a plate
    reduced before `add_cost`, not ``requires_grad`` or ``torch.no_grad``.
    """
    if unused:
        plates = ", ".join(repr(plate.name) for plate in unused)
        return ValueError(
            "storch.backward: no registered cost depends on a tensor that requires grad, so there is "
            f"nothing to differentiate. Node(s) {_describe_nodes(unused)} have parameters that require "
            f"grad, but no registered cost carries their plate(s) {plates}. {OUTSIDE_TORCH_HINT} "
            "Otherwise the plates were reduced before storch.add_cost (storch.reduce_plates, "
            "storch.sum/mean, logsumexp). Keep the plate on the cost, e.g. storch.add_cost(f(z), 'c') "
            "instead of storch.add_cost(storch.reduce_plates(f(z), 'z'), 'c'): storch reduces it for "
            "you, weighted by the node's method, when it builds the surrogate loss."
        )
    return ValueError(
        "storch.backward: no registered cost depends on a tensor that requires grad, so there "
        "is nothing to differentiate. Check that your parameters have requires_grad=True and "
        "that the costs were not computed under torch.no_grad(), or use "
        "storch.surrogate_loss() to only estimate the cost."
    )


def backward(
    *positional: Any,
    create_graph: bool = False,
    retain_graph: bool = False,
    update_parameters: bool = True,
    print_costs: bool = False,
    debug: bool = False,
    update_estimator_params: bool | None = None,
) -> torch.Tensor:
    """Estimate the gradients of the expected total cost and accumulate them in ``.grad``.

    Builds the surrogate loss of every registered cost, calls ``backward`` on it, lets each method
    update its state (baselines, temperatures) and clears the registry, also when an error occurs.
    Every argument is keyword-only: Storchastic's first positional argument was ``debug``, storch's
    first option is ``create_graph``, so a positional ``storch.backward(True)`` is refused rather
    than read with either meaning.

    Args:
        create_graph: keep the graph of the derivative, for higher-order derivatives (e.g.
            ``torch.autograd.grad(param.grad, param)`` gives an unbiased Hessian estimate).
        retain_graph: keep the graph for another backward pass.
        update_parameters: call each method's ``update_parameters`` afterwards.
        print_costs: print the estimate of each cost.
        debug: Storchastic's keyword; storch prints the estimate of each cost (as ``print_costs``).
        update_estimator_params: Storchastic's name for ``update_parameters`` (overrides it when given).

    Returns:
        The estimate of the expected total cost (a plain, detached 0-dim tensor): the forward value
            of the surrogate loss. With a relaxation that feeds relaxed (continuous) samples to the
            costs (`GumbelSoftmax` and `UnorderedSetGumbelSoftmax` without ``straight_through``) it
            is the relaxed objective at the current temperature, not the expected cost of the discrete
            model; to report the latter, evaluate the model with discrete samples (e.g. under
            `Expect`, or with ``straight_through=True``). Straight-through estimators, `RELAX` and
            `REBAR` evaluate the costs at the discrete samples, so they return the plain estimate.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> p = torch.tensor(0.3, requires_grad=True)
        >>> x = storch.method.Expect("x")(Bernoulli(p))   # exact: E[5x] = 5p
        >>> storch.add_cost(5.0 * x, "f")
        >>> storch.backward(), p.grad
        (tensor(1.5000), tensor(5.))
    """
    if positional:
        reset()  # as for every error in backward: no cost left over from this step
        raise TypeError(
            f"storch.backward takes keyword arguments only, got {len(positional)} positional: "
            f"{', '.join(repr(a) for a in positional)}. Storchastic's first argument was debug, storch's "
            "first option is create_graph: write storch.backward(create_graph=True) for higher-order "
            "derivatives, or storch.backward(debug=True) (the same as print_costs=True) to print each "
            "cost's estimate."
        )
    if update_estimator_params is not None:
        update_parameters = update_estimator_params
    print_costs = print_costs or debug
    costs = _COSTS.items()
    record = _Record()
    try:
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "storch.backward() was called with gradients disabled (inside torch.no_grad() or "
                "torch.inference_mode()), so the surrogate loss cannot be differentiated. Call it "
                "outside that block, or use storch.surrogate_loss() to only estimate the cost."
            )
        loss = _surrogate(costs, record)
        trace = _tracing.current()
        if trace is None:
            _check_finite(loss, costs)
        else:  # storch.compile_step checks the loss after each replay: no host read in the graph
            _refuse_state_between_steps(record)
            trace.note_loss(loss.detach(), _named_costs(costs))
        unused = _unused_nodes(costs)
        _warn_unused_nodes(unused)
        if print_costs:
            for cost in costs:
                estimate = _surrogate((cost,), _Record())
                print(f"{cost.name}: {'(meta)' if estimate.is_meta else format(estimate.item(), '.6g')}")
        if not loss.requires_grad:
            raise _nothing_to_differentiate(unused)
        handles = _retain_param_grads(record)
        # methods that learn from the gradient estimate (RELAX's control variate) differentiate
        # through the surrogate again in update_parameters, so its graph must outlive backward
        keep_graph = update_parameters and any(
            method.needs_graph_after_backward for method, _ in record.triples.values()
        )
        try:
            loss.backward(create_graph=create_graph, retain_graph=retain_graph or create_graph or keep_graph)
        finally:
            for handle in handles:
                handle.remove()
        if update_parameters:
            for method, triples in record.triples.values():
                method.update_parameters(triples)
        with _Disable():
            return loss.detach()
    finally:
        _clear_registry()
        if costs:
            _CONSUMED.set(True)

