"""Shrinking a failing random graph to a small one that fails the same way.

`storch.testing.shrink.shrink` is greedy: it tries smaller candidates of the graph in a fixed
order (drop a cost, a node with every reference to it, the data plate, the second order, a cost's
term, an edge, a join, a node's plate or ``probs=`` form, a variable; switch an estimator to a
simpler one, ``Expect``, ``Reparameterization`` or ``ScoreFunction``) and keeps the first one on
which the predicate still holds, until none does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Optional

from storch.method.catalog import entry, unbiased_estimators
from storch.testing.graphs import DISTRIBUTIONS, Cost, Graph, Node

__all__ = ["shrink", "SIMPLER_ESTIMATORS"]



def _without_node(graph: Graph, name: str) -> Optional[Graph]:
    nodes = tuple(
        replace(n, parents=tuple(q for q in n.parents if q != name),
                joint_with=None if n.joint_with == name else n.joint_with)
        for n in graph.nodes if n.name != name
    )
    if not nodes:
        return None
    costs = []
    for cost in graph.costs:
        cost = Cost(cost.name, tuple(z for z in cost.uses if z != name), tuple(z for z in cost.log_prob if z != name),
                    tuple(z for z in cost.own_score if z != name),
                    tuple((z, "" if by == name else by) for z, by in cost.scores if z != name))
        if cost.uses or cost.log_prob or cost.own_score or cost.scores:
            costs.append(cost)
    return replace(graph, nodes=nodes, costs=tuple(costs)) if costs else None


def _terms(cost: Cost) -> int:
    return len(cost.uses) + len(cost.log_prob) + len(cost.own_score) + len(cost.scores)


def _smaller_costs(graph: Graph) -> Iterator[Graph]:
    for i, cost in enumerate(graph.costs):
        def with_cost(new: Cost) -> Graph:
            return replace(graph, costs=graph.costs[:i] + (new,) + graph.costs[i + 1:])
        if _terms(cost) > 1:
            for field_name in ("uses", "log_prob", "own_score", "scores"):
                items = getattr(cost, field_name)
                for j in range(len(items)):
                    yield with_cost(replace(cost, **{field_name: items[:j] + items[j + 1:]}))
        for j, (z, by) in enumerate(cost.scores):
            if by:
                yield with_cost(replace(cost, scores=cost.scores[:j] + ((z, ""),) + cost.scores[j + 1:]))


SIMPLER_ESTIMATORS = ("Expect", "Reparameterization", "ScoreFunction")


def _smaller_nodes(graph: Graph) -> Iterator[Graph]:
    for i, node in enumerate(graph.nodes):
        def with_node(new: Node) -> Graph:
            return replace(graph, nodes=graph.nodes[:i] + (new,) + graph.nodes[i + 1:])
        for parent in node.parents:
            yield with_node(replace(node, parents=tuple(q for q in node.parents if q != parent)))
        if node.joint_with:
            yield with_node(replace(node, joint_with=None))
        if node.in_plate:
            yield with_node(replace(node, in_plate=False))
        if node.probs:
            yield with_node(replace(node, probs=False))
        if node.size > 1 and not any(node.name in n.parents for n in graph.nodes) and not _scored_by(graph, node.name):
            yield with_node(replace(node, size=1))
        allowed = {e.label for e in unbiased_estimators(DISTRIBUTIONS[node.kind], graph.order)}
        if node.joint_with is None:
            for label in SIMPLER_ESTIMATORS:
                if label in allowed and label != node.estimator and node.estimator not in SIMPLER_ESTIMATORS[:1]:
                    yield with_node(replace(node, estimator=label))


def _scored_by(graph: Graph, name: str) -> bool:
    return any(by == name for cost in graph.costs for _, by in cost.scores)


def _candidates(graph: Graph) -> Iterator[Graph]:
    if len(graph.costs) > 1:
        for i in range(len(graph.costs)):
            yield replace(graph, costs=graph.costs[:i] + graph.costs[i + 1:])
    for node in reversed(graph.nodes):
        smaller = _without_node(graph, node.name)
        if smaller is not None:
            yield smaller
    if graph.plate:
        yield replace(graph, plate=0, nodes=tuple(replace(n, in_plate=False) for n in graph.nodes))
    if graph.order == 2:
        yield replace(graph, order=1)
    yield from _smaller_costs(graph)
    yield from _smaller_nodes(graph)


def _valid(graph: Graph) -> bool:
    """Every node's estimator is still declared unbiased for it at the graph's order; joins are kept
    between joinable single-sample nodes."""
    for node in graph.nodes:
        if not entry(node.estimator).unbiased_for(DISTRIBUTIONS[node.kind], graph.order):
            return False
        if node.joint_with and not entry(node.estimator).joinable:
            return False
    return True


def shrink(
    graph: Graph, fails: Callable[[Graph], bool], max_checks: int = 200, valid: Optional[Callable[[Graph], bool]] = None
) -> Graph:
    """A smaller graph on which ``fails`` still holds (greedy: the first smaller candidate that fails,
    until none does or ``max_checks`` candidates were tried). Candidates must be ``valid`` (default:
    every node's estimator declared unbiased for it at the graph's order, joins between joinable nodes)."""
    valid = valid or _valid
    checks = 0
    progress = True
    while progress and checks < max_checks:
        progress = False
        for candidate in _candidates(graph):
            if not valid(candidate):
                continue
            checks += 1
            if fails(candidate):
                graph, progress = candidate, True
                break
            if checks >= max_checks:
                break
    return graph
