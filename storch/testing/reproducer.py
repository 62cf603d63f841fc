"""A random graph as a standalone script: its model with storch, the same model on plain tensors,
storch's estimates against the exact values, per coordinate."""

from __future__ import annotations

import torch

from storch.method.catalog import entry
from storch.testing.graphs import Graph, event_shape, model_source, values

__all__ = ["reproducer"]



def _literal(t: torch.Tensor) -> str:
    return f"torch.tensor({t.tolist()!r}, dtype=torch.float64)"


def sources_text(sources: dict) -> str:
    return " ".join(sources.values())


def reproducer(graph: Graph, note: str = "", estimates: int = 2000) -> str:
    """``graph`` as a standalone script: storch's estimates of the gradient against the exact values,
    printed per coordinate; ``note`` (what failed) goes into its docstring."""
    p, x, c = values(graph)
    sources = {n.name: (entry(n.estimator).source or f"entry({n.estimator!r}).make({{name}}, {event_shape(n)})")
               for n in graph.nodes}
    classes = sorted({src.split("(", 1)[0] for src in sources.values()} - {"entry"})
    imports = ["ImportanceSampling"] if any("ImportanceSampling" in s for s in sources.values()) else []
    shape = {n.name: event_shape(n) for n in graph.nodes}
    methods = ",\n".join(
        f"        {name!r}: " + src.format(name=repr(name), shape=shape[name] if shape[name] else 1) + ".double()"
        for name, src in sources.items()
    )
    what = f"\n{note}\n" if note else ""

    def block(d: dict) -> str:
        return "{\n" + "".join(f"    {k!r}: {_literal(t)},\n" for k, t in d.items()) + "}"

    catalog_import = "from storch.method.catalog import entry\n" if "entry" in sources_text(sources) else ""
    method_imports = f"from storch.method import {', '.join(classes)}\n" if classes else ""
    sampling_imports = f"from storch.sampling import {', '.join(imports)}\n" if imports else ""
    return f'''"""A random stochastic computation graph on which storch fails (storch.testing.fuzz, seed {graph.seed}).
{what}
storch's estimates (parameters copied R times along an independent plate) against the exact values
(enumeration and quadrature with plain torch, storch.testing.exact).
"""
import math

import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
{method_imports}{sampling_imports}{catalog_import}from storch.testing.exact import exact_derivatives
from storch.testing.graphs import Cost, Graph, Node

graph = {graph!r}

p = {block(p)}
x = {block(x)}
c = {block(c)}


{model_source(graph)}

{model_source(graph, exact=True, name="exact_model")}

def methods():
    return {{
{methods},
    }}


def estimates(steps, replicates={min(1000, estimates)}, warmup={max(entry(n.estimator).warmup for n in graph.nodes)}, order={graph.order}):
    m = methods()
    xs = {{k: storch.denote_independent(t, 0, "data") for k, t in x.items()}}

    def draw(name, q, joint_with=None):
        return m[name](q) if joint_with is None else m[name](q, joint_with=joint_with)

    out = []
    for step in range(warmup + steps):
        storch.reset()
        leaves = {{k: t.unsqueeze(0).repeat((replicates,) + (1,) * t.dim()).requires_grad_() for k, t in p.items()}}
        views = {{k: storch.denote_independent(t, 0, "replicate") for k, t in leaves.items()}}
        for name, cost in model(draw, views, xs, c).items():
            storch.add_cost(cost, name)
        storch.backward(create_graph=order == 2)
        if step >= warmup:
            out.append({{k: (torch.zeros_like(t) if t.grad is None else t.grad * replicates).detach()
                        for k, t in leaves.items()}})
    return {{k: torch.cat([o[k] for o in out]) for k in p}}


torch.manual_seed(0)
exact, _ = exact_derivatives(exact_model, graph, p, x, c)
got = estimates(steps={max(1, estimates // 1000)})
for k in p:
    n = got[k].shape[0]
    mean, se = got[k].mean(0), got[k].std(0) / math.sqrt(n)
    z = ((mean - exact[k]).abs() / se.clamp_min(1e-300)).reshape(-1)
    print(k, "max |z|", round(float(z.max()), 2), "mean", mean.reshape(-1).tolist(), "exact", exact[k].reshape(-1).tolist())
'''
