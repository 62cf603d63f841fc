"""Random stochastic computation graphs for storch's randomized tester, as data and as code.

A `storch.testing.graphs.Graph` is plain data: nodes (a Bernoulli, Categorical,
OneHotCategorical or Normal variable each, with its parents, its estimator's catalog label, whether
it is built from ``probs=`` and whether its parameters carry a data plate, and optionally the node
whose local-expectation points it joins), costs (a smooth function of some samples plus
log-probability terms: ``z.log_prob()``, ``q.log_prob(z)`` with the node's own distribution, and
``r.log_prob(z)`` with a distribution of the same type built from leaves and another node's sample,
or from constants),
an optional data plate and the derivative order to check.

`storch.testing.graphs.random_graph` draws one from a seed; the estimators are drawn
from the entries that `storch.method.catalog` declares unbiased for the
node's distribution at that order. `storch.testing.graphs.model_source` writes the
graph as a Python function ``model(draw, p, x, c)``: ``draw(name, q)`` samples node ``name`` from
``q`` (storch's method, or the enumeration of `storch.testing.exact`), ``p``
holds the leaf parameters, ``x`` the data of the plated nodes and ``c`` the constants of the costs; it
returns the costs by name. Parameters, data and constants are drawn per name
(`storch.testing.graphs.values`), so dropping a node leaves the others' values unchanged.

A child's logits (a Normal child's location) are its own leaf plus, per parent, a linear map of the
parent's sample; a cost is ``(u − t)² + sin(2u)`` with ``u`` linear in the samples it uses, plus
half of each log-probability term.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

from storch.method.catalog import entry, unbiased_estimators

__all__ = ["Node", "Cost", "Graph", "DISTRIBUTIONS", "random_graph", "model_source", "values", "event_shape"]

#: the node kinds and their torch distributions
DISTRIBUTIONS = {"bernoulli": Bernoulli, "categorical": Categorical, "onehot": OneHotCategorical, "normal": Normal}
_CLASS_NAMES = {"bernoulli": "Bernoulli", "categorical": "Categorical", "onehot": "OneHotCategorical",
                "normal": "Normal"}


@dataclass(frozen=True)
class Node:
    """One stochastic node: ``size`` variables of ``kind`` with ``categories`` values each."""

    name: str
    kind: str
    size: int
    categories: int
    parents: tuple[str, ...]
    estimator: str
    probs: bool = False
    in_plate: bool = False
    joint_with: Optional[str] = None


@dataclass(frozen=True)
class Cost:
    """One cost: a smooth part in the samples of ``uses`` plus log-probability terms."""

    name: str
    uses: tuple[str, ...]
    log_prob: tuple[str, ...] = ()  # z.log_prob()
    own_score: tuple[str, ...] = ()  # q.log_prob(z), q the node's own distribution
    scores: tuple[tuple[str, str], ...] = ()  # (z, by): r(· | by).log_prob(z); by "" for a leaf-only r


@dataclass(frozen=True)
class Graph:
    """A random stochastic computation graph (module docstring)."""

    seed: int
    nodes: tuple[Node, ...]
    costs: tuple[Cost, ...]
    plate: int = 0  # size of the data plate, 0 for none
    order: int = 1  # derivative order checked: 1 (gradients) or 2 (gradients and a Hessian-vector product)

    def descendants(self, name: str) -> set[str]:
        """The nodes drawn, directly or not, from ``name``'s sample."""
        found: set[str] = set()
        for node in self.nodes:
            if name in node.parents or found.intersection(node.parents):
                found.add(node.name)
        return found

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


def event_shape(node: Node) -> tuple[int, ...]:
    """The shape of one sample of ``node`` beyond its plates."""
    return (node.size, node.categories) if node.kind == "onehot" else (node.size,)


def _param_shape(node: Node) -> tuple[int, ...]:
    """The shape of the node's logits (a Normal's location)."""
    return (node.size, node.categories) if node.kind in ("categorical", "onehot") else (node.size,)


def _relaxes(node: Node) -> bool:
    return entry(node.estimator).relaxes


# ----------------------------------------------------------------------------------------- drawing


def random_graph(seed: int, *, order: Optional[int] = None, max_nodes: int = 4, estimator: Optional[str] = None,
                 relaxed_log_prob: bool = True, cross_scores: bool = True) -> Graph:
    """A random graph from ``seed``: 1–``max_nodes`` nodes (at most one Normal), 1–3 costs.

    ``order`` fixes the derivative order (default: 2 for about a fifth of the seeds).
    ``estimator``: a catalog label that one node (of a kind it handles) must use; the order is then
    at most the one the entry declares.
    ``relaxed_log_prob``: ``z.log_prob()`` terms also on nodes whose estimator relaxes the sample.
    ``cross_scores``: ``r.log_prob(z)`` terms with ``r`` built from any other node's sample;
    ``False``: only from a descendant of ``z`` (a decoder ``p(z | h)`` with ``h`` drawn from ``z``)
    whose plates end with those of ``z``, or from constants.
    """
    rng = random.Random(seed)
    order = order if order is not None else (2 if rng.random() < 0.2 else 1)
    forced = entry(estimator) if estimator is not None else None
    forced_kinds = [k for k, d in DISTRIBUTIONS.items() if forced is not None and forced.unbiased_for(d, 1)]
    if forced is not None:
        if not forced_kinds:
            raise ValueError(f"random_graph: the catalog declares {estimator!r} unbiased for none of {list(DISTRIBUTIONS)}.")
        order = min(order, max(1, forced.unbiased_orders))
    plate = rng.choice((2, 3)) if rng.random() < 0.4 else 0
    count = rng.randint(1, max_nodes)
    forced_at = rng.randrange(count)
    nodes: list[Node] = []
    for i in range(count):
        normal_free = not any(n.kind == "normal" for n in nodes) and not (forced_kinds == ["normal"] and i < forced_at)
        kinds = ["bernoulli", "categorical", "onehot"]
        if normal_free and rng.random() < 0.25:
            kinds = ["normal"]
        if forced is not None and i == forced_at:
            kinds = [k for k in forced_kinds if k != "normal" or normal_free]
        kind = rng.choice(kinds)
        size = 1 if kind == "normal" else rng.choice((1, 2))
        categories = {"bernoulli": 2, "normal": 1}.get(kind) or rng.choice((2, 3))
        parents = tuple(n.name for n in nodes if rng.random() < 0.5)
        needed = max([order] + [entry(a.estimator).downstream_orders for a in nodes
                                if a.name in parents or a.name in _ancestors(nodes, *parents)])
        if forced is not None and i == forced_at and forced.unbiased_orders < needed:
            parents, needed = (), order  # the forced estimator cannot sit below this parent's
        labels = sorted(e.label for e in unbiased_estimators(DISTRIBUTIONS[kind], needed))
        label = estimator if forced is not None and i == forced_at else rng.choice(labels)
        # a node joins the points of an earlier one whose chain began after all of its own parents
        joinable = [n.name for k, n in enumerate(nodes) if entry(n.estimator).joinable
                    and all(q.name not in parents for q in nodes[k:])]
        joiners = [lb for lb in labels if entry(lb).joinable]
        if joinable and joiners and not (forced is not None and i == forced_at) and rng.random() < 0.5:
            label = rng.choice(joiners)  # a sibling that joins an earlier node's points (joint_with)
        joint_with = rng.choice(joinable) if entry(label).joinable and joinable and rng.random() < 0.7 else None
        nodes.append(Node(
            f"z{i}", kind, size, categories, parents, label,
            probs=kind != "normal" and rng.random() < 0.3,
            in_plate=bool(plate) and rng.random() < 0.6,
            joint_with=joint_with,
        ))
    costs = [_random_cost(rng, f"f{k}", nodes, relaxed_log_prob, cross_scores) for k in range(rng.randint(1, 3))]
    return Graph(seed, tuple(nodes), tuple(costs), plate, order)


def _plated(nodes: list[Node], name: str) -> bool:
    """Whether the samples of ``name`` carry the data plate (its own parameters or a parent's do)."""
    node = next(n for n in nodes if n.name == name)
    return node.in_plate or any(_plated(nodes, q) for q in node.parents)


def _ancestors(nodes: list[Node], *names: str) -> set[str]:
    """The nodes that ``names`` are drawn from, directly or not."""
    found: set[str] = set()
    for name in names:
        node = next(n for n in nodes if n.name == name)
        found |= set(node.parents) | _ancestors(nodes, *node.parents)
    return found


def _decodes(nodes: list[Node], z: str, by: str) -> bool:
    """Whether the plates of ``r(z | by)`` end with those of ``z`` (storch puts newer plates first):
    ``by`` is drawn from ``z``, its other ancestors are drawn after ``z``, and it carries the data
    plate only if ``z`` does."""
    names = [n.name for n in nodes]
    others = _ancestors(nodes, by) - _ancestors(nodes, z) - {z}
    return (z in _ancestors(nodes, by) and all(names.index(a) > names.index(z) for a in others)
            and (_plated(nodes, z) or not _plated(nodes, by)))


def _random_cost(rng: random.Random, name: str, nodes: list[Node], relaxed_log_prob: bool, cross: bool) -> Cost:
    names = [n.name for n in nodes]
    uses = tuple(n for n in names if rng.random() < 0.6) or (rng.choice(names),)
    hard = [n.name for n in nodes if not _relaxes(n)]
    log_prob = tuple(n.name for n in nodes if (relaxed_log_prob or not _relaxes(n)) and rng.random() < 0.25)
    own_score = tuple(n for n in hard if rng.random() < 0.2)
    scores = tuple(
        (z, rng.choice([""] + [n for n in names if n != z and (cross or _decodes(nodes, z, n))]))
        for z in hard if rng.random() < 0.25
    )
    return Cost(name, uses, log_prob, own_score, scores)


# ----------------------------------------------------------------------------------------- values


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62)


def _draw(seed: int, name: str, shape: tuple[int, ...], scale: float, shift: float = 0.0) -> torch.Tensor:
    return shift + scale * torch.randn(shape, generator=_generator(seed, name), dtype=torch.float64)


def values(graph: Graph) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(p, x, c)``: the leaf parameters, the data of plated nodes ``(plate, *logits shape)`` and
    the costs' constants, float64, each drawn from the graph's seed and its own name."""
    s = graph.seed
    p: dict[str, torch.Tensor] = {}
    x: dict[str, torch.Tensor] = {}
    c: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        shape = _param_shape(node)
        p[f"theta_{node.name}"] = _draw(s, f"theta_{node.name}", shape, 0.6)
        if node.kind == "normal":
            p[f"scale_{node.name}"] = _draw(s, f"scale_{node.name}", shape, 0.2, -0.5)
        for parent in node.parents:
            w = f"w_{node.name}_{parent}"
            p[w] = _draw(s, w, shape + event_shape(graph.node(parent)), 0.5)
        if graph.plate and node.in_plate:
            x[node.name] = _draw(s, f"x_{node.name}", (graph.plate,) + shape, 0.8)
    for cost in graph.costs:
        for z in cost.uses:
            c[f"a_{cost.name}_{z}"] = _draw(s, f"a_{cost.name}_{z}", event_shape(graph.node(z)), 0.7)
        c[f"t_{cost.name}"] = _draw(s, f"t_{cost.name}", (), 1.0)
        for z, by in cost.scores:
            shape = _param_shape(graph.node(z))
            if not by:  # a fixed prior
                c.setdefault(f"rho_{z}", _draw(s, f"rho_{z}", shape, 0.6))
                continue
            p.setdefault(f"rho_{z}_{by}", _draw(s, f"rho_{z}_{by}", shape, 0.6))
            if by:
                v = f"v_{z}_{by}"
                p.setdefault(v, _draw(s, v, shape + event_shape(graph.node(by)), 0.5))
    return p, x, c


# ----------------------------------------------------------------------------------------- code


def _feature(node: Node) -> str:
    return f"{node.name}.double()" if node.kind == "categorical" else node.name


def _linear(weight: str, child: Node, parent: Node) -> str:
    """The linear map of ``parent``'s sample into ``child``'s logits, as code."""
    f = _feature(parent)
    spread = ".unsqueeze(-2)" if child.kind in ("categorical", "onehot") else ""
    if parent.kind == "onehot":
        return f"(p[{weight!r}] * {f}.unsqueeze(-3){spread.replace('-2', '-3')}).sum(-1).sum(-1)"
    return f"(p[{weight!r}] * {f}.unsqueeze(-2){spread}).sum(-1)"


def _distribution(node: Node, logits: str) -> str:
    cls = _CLASS_NAMES[node.kind]
    if node.kind == "normal":
        return f"{cls}({logits}, p['scale_{node.name}'].exp())"
    if not node.probs:
        return f"{cls}(logits={logits})"
    squash = f"torch.sigmoid({logits})" if node.kind == "bernoulli" else f"torch.softmax({logits}, -1)"
    return f"{cls}(probs={squash})"


def _sum_event(node: Node) -> str:
    return ".sum(-1).sum(-1)" if node.kind == "onehot" else ".sum(-1)"


def model_source(graph: Graph, *, exact: bool = False, name: str = "model") -> str:
    """The graph as the source of ``def model(draw, p, x, c)`` returning its costs by name.

    ``exact``: write each ``z.log_prob()`` as ``q_z.log_prob(z)`` (the enumeration's samples are
    plain tensors); nothing else differs.
    """
    lines = [f"def {name}(draw, p, x, c):"]
    for node in graph.nodes:
        logits = f"p['theta_{node.name}']"
        if graph.plate and node.in_plate:
            logits += f" + x[{node.name!r}]"
        for parent in node.parents:
            logits += " + " + _linear(f"w_{node.name}_{parent}", node, graph.node(parent))
        lines.append(f"    q_{node.name} = {_distribution(node, logits)}")
        joint = f", joint_with={node.joint_with}" if node.joint_with else ""
        lines.append(f"    {node.name} = draw({node.name!r}, q_{node.name}{joint})")
    returned = []
    for cost in graph.costs:
        terms = []
        if cost.uses:
            u = " + ".join(f"(c['a_{cost.name}_{z}'] * {_feature(graph.node(z))}){_sum_event(graph.node(z))}"
                           for z in cost.uses)
            lines.append(f"    u_{cost.name} = {u}")
            terms.append(f"(u_{cost.name} - c['t_{cost.name}']) ** 2 + torch.sin(2 * u_{cost.name})")
        for z in cost.log_prob:
            lp = f"q_{z}.log_prob({z})" if exact else f"{z}.log_prob()"
            terms.append(f"0.5 * {lp}.sum(-1)")
        for z in cost.own_score:
            terms.append(f"0.5 * q_{z}.log_prob({z}).sum(-1)")
        for z, by in cost.scores:
            node = graph.node(z)
            logits = f"p['rho_{z}_{by}']" if by else f"c['rho_{z}']"
            if by:
                logits += " + " + _linear(f"v_{z}_{by}", node, graph.node(by))
            r = _distribution(replace(node, probs=False), logits).replace(f"p['scale_{z}'].exp()", "1.0")
            terms.append(f"0.5 * {r}.log_prob({z}).sum(-1)")
        lines.append(f"    {cost.name} = " + " + ".join(terms or ["0.0"]))
        returned.append(f"{cost.name!r}: {cost.name}")
    lines.append("    return {" + ", ".join(returned) + "}")
    return "\n".join(lines) + "\n"


def compile_model(graph: Graph, *, exact: bool = False):
    """The function `storch.testing.graphs.model_source` writes, defined."""
    namespace = {"torch": torch, "Bernoulli": Bernoulli, "Categorical": Categorical,
                 "OneHotCategorical": OneHotCategorical, "Normal": Normal}
    exec(compile(model_source(graph, exact=exact), f"<graph {graph.seed}>", "exec"), namespace)  # noqa: S102
    return namespace["model"]

