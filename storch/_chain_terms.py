"""The surrogate terms of a whole single-sample chain at once, when its steps share one method.

The surrogate recursion (`storch.inference`) forms one node term per step of a
chain (`storch.plate.ChainPlate`), newest first, on the reward to go
``R_s = c_s + S_{s+1}``: ``S_s = □(l_s)·R_s + (1 − □(l_s))·a_s``. Unrolled over the steps
``s = 0 … T−1`` of a chain whose nodes have a gradient function ``l_s`` that does not depend on the
costs and a control variate ``a_s`` computed from the values of ``R_s`` only (the score function
with or without a moving-average baseline), this is

    S_0 = Σ_t c_t □(L_t) + Σ_s (1 − □(l_s)) a_s □(L_{s−1}),    L_t = Σ_{s≤t} l_s,  □(L_{−1}) = 1,

because ``□(x)·□(y) = □(x + y)`` as functions (DiCE's magic box ``□(x) = exp(x − ⊥x)``; Foerster
et al. 2018): the same values and the same derivatives of every order. Formed from the stacked
log-probabilities with one cumulative sum, a chain of ``T`` decisions costs a fixed number of
operations besides each step's log-probability, instead of a handful of operations and autograd
nodes per step; the control variates are computed from the reward to go, a reversed cumulative sum
of the costs' values, as hand-written reward-to-go REINFORCE computes it.

`storch._chain_terms.chain_term` takes the partial surrogates that reach the chain's
steps and answers ``None`` whenever the unrolled form does not apply, so the recursion forms the
chain step by step, as before: steps drawn by different methods, a method whose estimator or
baseline needs each step's own cost (`Method.vectorises_chain`), costs with different plates at
different steps, or other nodes' plates between the chain's steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch

from storch._dispatch import align_tensor, no_dispatch
from storch.plate import ChainPlate, PlateLayout, layout_of_plates
from storch.tensor import Tensor, wrap_new
from storch.util import magic_box

if TYPE_CHECKING:  # pragma: no cover  (the recursion's own bookkeeping, duck-typed here)
    from storch.inference import _Partial, _Record

__all__ = ["ChainCosts", "chain_term", "unrolled_surrogate"]


class ChainCosts(NamedTuple):
    """What reaches the steps of one chain, oldest step first.

    Attributes:
        steps: the chain's steps ``0 … T−1`` (``T − 1`` the newest step any cost reaches).
        plates: the costs' other plates (the same at every step, all older than the chain).
        costs: the summed costs of each step, ``(T, *plate sizes)`` (zero where none); plain, or, for a
            single step, storch's own tensor of them: read it with torch functions off.
        names: per step, the cost name its node's control variate is computed for (the recursion's
            rule: the first cost registered at the step, else the name carried from the step after).
        index: the place among the registered costs that the chain's result keeps.
    """

    steps: list[ChainPlate]
    plates: PlateLayout
    costs: torch.Tensor
    names: list[str]
    index: int


def _steps_of(top: ChainPlate) -> list[ChainPlate]:
    """The steps of ``top``'s chain up to ``top``, oldest first."""
    steps = []
    step: ChainPlate | None = top
    while step is not None:
        steps.append(step)
        step = step.ancestor  # type: ignore[assignment]
    steps.reverse()
    return steps


def _other_plates(partials: Sequence["_Partial"], root: ChainPlate) -> PlateLayout | None:
    """The plates the partials carry besides their step, if every partial carries the same ones and
    the nodes among them are older than the chain's first step (else ``None``). Independent plates
    may be newer (a minibatch plate made again at each step): the recursion reduces them after the
    nodes drawn on them, and reducing one earlier changes nothing (it is linear)."""
    plates = _without(partials[0].S._layout.plates, partials[0].plate)
    for p in partials:
        if _without(p.S._layout.plates, p.plate) != plates:
            return None
    if any(q.node is not None and q.surrogate_order >= root.surrogate_order for q in plates):
        return None
    return layout_of_plates(plates)


def _without(plates: tuple, step: ChainPlate) -> tuple:
    return tuple(q for q in plates if q is not step)


def _one_method(steps: list[ChainPlate], plates: PlateLayout) -> Any:
    """The method that drew every step, if it forms a chain's terms at once (else ``None``)."""
    method = steps[-1].node.method if steps[-1].node is not None else None
    if method is None or not method.vectorises_chain(plates):
        return None
    others = set(plates.plates)
    for step in steps:
        node = step.node
        if node is None or node.method is not method or not others.issuperset(node.parents):
            return None
    return method


def _gather(partials: Sequence["_Partial"], steps: list[ChainPlate], plates: PlateLayout) -> ChainCosts:
    """Sum the partials per step and name each step's control variate as the recursion does."""
    at: dict[int, list] = {}
    for p in partials:
        at.setdefault(p.plate.depth, []).append(p)
    first = partials[0].S
    zero = None
    costs, names = [], []
    carried: tuple[str, int] | None = None  # (name, index) of the partial carried from the step after
    for step in reversed(steps):  # newest first, as the recursion
        members = sorted(at.get(step.depth, ()), key=lambda p: p.index)
        with no_dispatch():
            total = None
            for m in members:
                total = _step_first(m.S, step) if total is None else total + _step_first(m.S, step)
            if total is None:
                if zero is None:
                    zero = torch.zeros((1,) + plates.sizes, dtype=first.dtype, device=first.device)
                total = zero
        costs.append(total)
        fresh = [m for m in members if m.fresh]
        candidates = [(m.index, m.name) for m in members] + ([(carried[1], carried[0])] if carried else [])
        index, name = min(candidates)
        if fresh:
            name = fresh[0].name
        names.append(name)
        carried = (name, index)
    costs.reverse()
    names.reverse()
    if len(costs) == 1:  # one step: its summed costs as they are (storch's own tensor, read with torch functions off)
        return ChainCosts(steps, plates, costs[0], names, carried[1])  # type: ignore[index]
    with no_dispatch():
        stacked = torch.cat(costs, 0)
    return ChainCosts(steps, plates, stacked, names, carried[1])  # type: ignore[index]


def _gradient_functions(method: Any, chain: ChainCosts, record: "_Record") -> torch.Tensor:
    """``l_s`` of every step (``method.gradient_function`` of its node), plain, ``(T, *plate sizes)``:
    all steps in one call where the method can (`Method.chain_gradient_functions`), else step by step."""
    tensors = []
    for step in chain.steps:
        tensor = record.node_tensor(step)
        record.add(method, (tensor, None, None))
        tensors.append(tensor)
    n_plates = 1 + len(chain.plates.sizes)
    with no_dispatch():
        l = method.chain_gradient_functions([step.node for step in chain.steps], chain.plates)  # noqa: E741
        if l is not None:
            return l.sum(tuple(range(n_plates, l.dim()))) if l.dim() > n_plates else l
    shape = (1,) + chain.plates.sizes
    parts = []
    for step, tensor in zip(chain.steps, tensors):
        l = method.gradient_function(tensor)  # noqa: E741
        layout = l._layout
        with no_dispatch():
            if l.dim() > len(layout.sizes):  # per-variable terms: summed over the non-plate dimensions
                l = l.sum(tuple(range(len(layout.sizes), l.dim())))  # noqa: E741
            if layout.plates[1:] != chain.plates.plates:
                l = align_tensor(l, layout_of_plates((step,) + chain.plates.plates)).expand(shape)  # noqa: E741
            parts.append(l)  # (torch functions are off: cat takes a storch tensor as a plain one)
    if len(parts) == 1:
        return parts[0]
    with no_dispatch():
        return torch.cat(parts, 0)


def _step_first(S: Tensor, step: ChainPlate) -> torch.Tensor:
    """A partial surrogate with its step's dimension first (an independent plate made after the step
    comes before it in the layout), for plain arithmetic: torch functions disabled."""
    position = next(i for i, q in enumerate(S._layout.plates) if q is step)
    return S.movedim(position, 0) if position else S


def reward_to_go(costs: torch.Tensor) -> torch.Tensor:
    """``R_s = Σ_{t≥s} c_t`` along the first dimension, of the costs' values (detached)."""
    values = costs.detach()
    if values.shape[0] == 1:  # one step: its own costs
        return values
    return values.flip(0).cumsum(0).flip(0)


def unrolled_surrogate(costs: torch.Tensor, l: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:  # noqa: E741
    """``Σ_t c_t □(L_t) + Σ_s (1 − □(l_s)) a_s □(L_{s−1})`` over the first dimension (plain tensors).

    Examples:
        >>> c = torch.tensor([1.0, 2.0]); l = torch.tensor([0.1, 0.2], requires_grad=True)
        >>> s = unrolled_surrogate(c, l, torch.tensor([0.5, 0.5]))
        >>> s.item(), torch.autograd.grad(s, l)[0].tolist()   # R − a = [3 − 0.5, 2 − 0.5]
        (3.0, [2.5, 1.5])
    """
    if l.shape[0] == 1:  # one step: □(l) (L = l, and □(L_{−1}) = 1), and no sum over it
        box = magic_box(l)
        total = costs * box
        return (total if a is None else total + (1 - box) * a).squeeze(0)
    boxes = magic_box(l.cumsum(0))  # □(L_t)
    total = (costs * boxes).sum(0)
    if a is None:
        return total
    before = torch.cat([torch.ones_like(boxes[:1]), boxes[:-1]])  # □(L_{s−1})
    return total + ((1 - magic_box(l)) * a * before).sum(0)


def chain_term(partials: Sequence["_Partial"], newest_other: int, record: "_Record") -> tuple[Tensor, str, int] | None:
    """The surrogate of the chain that ``partials`` (every partial surrogate stopped at one of its
    steps) reach, its first step reduced: ``(S, name, index)`` to continue the recursion with, or
    ``None`` if the chain must be formed step by step (see the module docstring). ``newest_other``
    is the newest surrogate order among the partials stopped elsewhere (``-1``: none)."""
    steps = _steps_of(max((p.plate for p in partials), key=lambda plate: plate.depth))
    root = steps[0]
    if newest_other >= root.surrogate_order or not root.has_uniform_weight:
        return None
    plates = _other_plates(partials, root)
    method = None if plates is None else _one_method(steps, plates)
    if method is None:
        return None
    chain = _gather(partials, steps, plates)  # type: ignore[arg-type]
    with no_dispatch():
        to_go = reward_to_go(chain.costs)
    a = method.chain_control_variates(chain.names, to_go, chain.plates)
    l = _gradient_functions(method, chain, record)  # noqa: E741
    with no_dispatch():
        S = unrolled_surrogate(chain.costs, l, a)
    return wrap_new(S, plates), chain.names[0], chain.index  # type: ignore[arg-type]
