"""Which ways of writing a plate-carrying ``__torch_function__`` subclass can TorchDynamo compile?

storch's dispatch runs once per operation in eager mode; under ``torch.compile`` its frames are
skipped (``storch.compiler``), so a compiled storch step keeps that cost. Removing it means letting
TorchDynamo trace the dispatch into the graph. This script asks the installed torch, with a small
subclass ``P`` that carries a Python attribute (``_layout``, as ``storch.Tensor`` does) through a
linear layer, a sigmoid and a reduction, how each way of re-wrapping results fares:

* ``retype``: the result's ``__class__`` is assigned (what storch does today, no copy);
* ``as_subclass``: ``out.as_subclass(P)`` inside ``__torch_function__``;
* ``super``: torch's default ``Tensor.__torch_function__`` (it converts results to ``P``), then
  the attribute is set on the result;

each with the subclass made inside the compiled function from plain data (as a training step
that calls ``storch.denote_independent`` on its minibatch) or passed in as a graph input, on the
``eager``, ``aot_eager`` and ``inductor`` backends. It prints, per case, the number of graphs and
graph breaks (``torch._dynamo.explain``) with the first break reason, and whether the compiled
function ran and gave the eager value, layout and gradient.

Usage (about a minute on 2 cores)::

    .venv/bin/python benchmarks/dynamo_probe.py
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch._dynamo

_Disable = torch._C.DisableTorchFunctionSubclass
LAYOUT = ("data",)


def _source_layout(args: tuple) -> object:
    return next((a._layout for a in args if isinstance(a, torch.Tensor) and hasattr(a, "_layout")), None)


class Retype(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with _Disable():
            out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor:
            out.__class__ = cls
            out._layout = _source_layout(args)
        return out


class AsSubclass(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with _Disable():
            out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor:
            out = out.as_subclass(cls)
            out._layout = _source_layout(args)
        return out


class Super(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(out, cls):
            out._layout = _source_layout(args)
        return out


WAYS = {"retype": Retype, "as_subclass": AsSubclass, "super": Super}


def _wrap(x: torch.Tensor, cls: type) -> torch.Tensor:
    if cls is Retype:
        x = x.view_as(x)
        x.__class__ = cls
    else:
        x = x.as_subclass(cls)
    x._layout = LAYOUT
    return x


def step_factory(cls: type, wrap_inside: bool) -> Callable:
    def step(x: torch.Tensor, w: torch.Tensor):
        if wrap_inside:
            x = _wrap(x, cls)
        y = (torch.sigmoid(torch.nn.functional.linear(x, w)) * 2 + 1).sum(-1)
        return y, y._layout

    return step


def probe(way: str, wrap_inside: bool, backend: str) -> str:
    cls = WAYS[way]
    torch._dynamo.reset()
    x0 = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    w0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    step = step_factory(cls, wrap_inside)

    def call(fn: Callable) -> tuple:
        w = w0.clone().requires_grad_()
        x = x0 if wrap_inside else _wrap(x0, cls)
        y, layout = fn(x, w)
        with _Disable():
            y.sum().backward()
            return y.detach().clone(), layout, w.grad

    expected = call(step)
    try:
        explained = torch._dynamo.explain(step)(x0 if wrap_inside else _wrap(x0, cls), w0.clone().requires_grad_())
        graphs = f"{explained.graph_count} graph(s), {explained.graph_break_count} break(s)"
        if explained.break_reasons:
            graphs += f" [{str(explained.break_reasons[0].reason).splitlines()[0][:70]}]"
    except Exception as e:  # noqa: BLE001 - report what torch says
        graphs = f"explain failed: {type(e).__name__}"
    try:
        got = call(torch.compile(step, backend=backend))
    except Exception as e:  # noqa: BLE001
        return f"{graphs}; compiled: FAILS ({type(e).__name__}: {str(e).splitlines()[0][:70]})"
    same = torch.equal(got[0], expected[0]) and got[1] == expected[1] and torch.allclose(got[2], expected[2])
    return f"{graphs}; compiled: {'runs, same value, layout and gradient' if same else 'runs, DIFFERENT result'}"


def main() -> int:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}")
    for way in WAYS:
        for wrap_inside in (True, False):
            for backend in ("eager", "aot_eager", "inductor"):
                where = "made inside" if wrap_inside else "graph input"
                print(f"{way:<11} | {where:<11} | {backend:<9} | {probe(way, wrap_inside, backend)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
