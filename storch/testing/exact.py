"""The exact objective of a random graph and its derivatives, with plain torch (no storch).

Every discrete node is enumerated: all ``K^D`` joint values of its ``D`` variables lie along one
axis of a grid (one axis per node, after the data plate's), and the grid's weight gains
``log q(z | parents)``. The Normal node (one variable) is integrated by Gauss–Hermite quadrature,
reparameterized: its values ``μ + σ √2 t_g`` with weights ``w_g / √π`` (``t_g``, ``w_g`` the nodes
and weights of ``∫ e^{-t²} h(t) dt``), so that autograd differentiates the quadrature in ``μ`` and
``σ``; with 48 points it is exact for polynomials of degree < 96 and, for the smooth costs of the
tester, accurate to rounding. The objective is, as storch defines it, the sum over costs of their
expectation, averaged over the data plate:

    J(θ) = Σ_k mean_p Σ_grid Π_i q_i(z_i | parents) · c_k(z, θ).

`storch.testing.exact.exact_derivatives` returns ``∇J`` and, at order 2, the
Hessian-vector product ``∇(∇J · v)``.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from storch.testing.graphs import Graph, Node

__all__ = ["exact_objective", "exact_derivatives"]

QUADRATURE_POINTS = 48


def _discrete_values(node: Node) -> torch.Tensor:
    """All ``K^D`` joint values of the node's variables, ``(S, D)`` (``(S, D, K)`` one-hot)."""
    idx = torch.tensor(list(itertools.product(range(node.categories), repeat=node.size)), dtype=torch.long)
    if node.kind == "categorical":
        return idx
    if node.kind == "onehot":
        return F.one_hot(idx, node.categories).double()
    return idx.double()


def exact_objective(model: Callable, graph: Graph, p: dict, x: dict, c: dict) -> torch.Tensor:
    """``J(θ)`` of ``graph``, differentiable in the tensors of ``p``; ``model`` is the graph's exact
    model (``model_source(graph, exact=True)``)."""
    lead = 1 if graph.plate else 0
    dims = lead + len(graph.nodes)
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    log_weight: list[torch.Tensor] = []

    def along(t: torch.Tensor, axis: int) -> torch.Tensor:
        """``t`` (first dimension the grid's values) placed on ``axis`` of the grid."""
        shape = [1] * dims + list(t.shape[1:])
        shape[axis] = t.shape[0]
        return t.reshape(shape)

    def draw(name: str, q, joint_with: Optional[torch.Tensor] = None) -> torch.Tensor:
        node = graph.nodes[index[name]]
        axis = lead + index[name]
        if node.kind == "normal":
            t, w = np.polynomial.hermite.hermgauss(QUADRATURE_POINTS)
            t = along(torch.tensor(t * math.sqrt(2.0), dtype=torch.float64).unsqueeze(-1), axis)
            log_weight.append(along(torch.tensor(np.log(w / math.sqrt(math.pi)), dtype=torch.float64), axis))
            return q.loc + q.scale * t
        values = along(_discrete_values(node), axis)
        log_weight.append(q.log_prob(values).sum(-1))
        return values

    xs = {k: v.reshape((v.shape[0],) + (1,) * len(graph.nodes) + tuple(v.shape[1:])) for k, v in x.items()}
    costs = model(draw, p, xs, c)
    weight = sum(log_weight).exp()
    grid = tuple(range(lead, dims))
    total = sum((weight * cost).sum(grid) if grid else weight * cost for cost in costs.values())
    return total.mean() if lead else total


def exact_derivatives(
    model: Callable, graph: Graph, p: dict, x: dict, c: dict, v: Optional[dict] = None
) -> tuple[dict, Optional[dict]]:
    """``(∇J, H v)`` by parameter name (``H v`` when ``v``, a direction per parameter, is given)."""
    leaves = {k: t.detach().clone().requires_grad_() for k, t in p.items()}
    objective = exact_objective(model, graph, leaves, x, c)
    names = list(leaves)
    grads = torch.autograd.grad(objective, [leaves[k] for k in names], create_graph=v is not None, allow_unused=True)
    grads = [torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(names, grads)]
    gradient = {k: g.detach() for k, g in zip(names, grads)}
    if v is None:
        return gradient, None
    s = sum((g * v[k]).sum() for k, g in zip(names, grads) if g.requires_grad)
    if not isinstance(s, torch.Tensor):
        return gradient, {k: torch.zeros_like(t) for k, t in leaves.items()}
    hv = torch.autograd.grad(s, [leaves[k] for k in names], allow_unused=True)
    return gradient, {k: (torch.zeros_like(leaves[k]) if h is None else h.detach()) for k, h in zip(names, hv)}
