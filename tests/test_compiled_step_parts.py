"""The parts of ``storch.compile_step`` (``storch._compile``): graph passes, checks and outputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import storch
from storch._compile import passes
from storch._compile.checks import Check, CheckFailed, failed_assertions
from storch._compile.replay import replay_module
from storch._compile.trace import StepOutputs
from test_compiled_step import Scales  # noqa: E402  (tests/ is on the path through conftest)


def _ops(module: torch.fx.GraphModule, name: str) -> int:
    return sum(1 for n in module.graph.nodes if n.op == "call_function" and name in str(n.target))


def test_the_cse_pass_merges_repeated_pure_computations():
    def f(x):
        return (x.exp() + 1) * (x.exp() + 1)

    graph = passes.simplify(make_fx(f)(torch.ones(3)))
    assert _ops(graph, "aten.exp") == 1 and _ops(graph, "aten.add") == 1
    torch.testing.assert_close(graph(torch.ones(3)), f(torch.ones(3)))


def test_the_cse_pass_keeps_values_around_an_update_in_place_apart():
    def f(x, buffer):
        before = buffer * 2.0
        buffer.add_(1.0)
        after = buffer * 2.0
        return x + before + after

    graph = passes.simplify(make_fx(f)(torch.ones(2), torch.zeros(2)))
    assert _ops(graph, "aten.mul") == 2 and _ops(graph, "aten.add_") == 1
    buffer = torch.zeros(2)
    assert torch.equal(graph(torch.ones(2), buffer), torch.full((2,), 1.0 + 0.0 + 2.0))
    assert torch.equal(buffer, torch.ones(2))


def test_random_draws_are_not_merged_and_profiler_ranges_are_dropped():
    def f(x):
        with torch.profiler.record_function("range"):
            return torch.rand(3) + torch.rand(3) + x

    graph = passes.simplify(make_fx(f)(torch.ones(3)))
    assert _ops(graph, "aten.rand") == 2 and _ops(graph, "profiler") == 0


def test_identities_are_removed():
    def f(x):
        return x.detach().view(3) * 2

    graph = passes.simplify(make_fx(f)(torch.ones(3)))
    assert _ops(graph, "detach") == 0 and _ops(graph, "aten.view") == 0


def _outputs(a, b, c, d, e) -> StepOutputs:
    """A step's outputs made of five tensors: two result tensors, one gradient, one loss with two costs."""
    return StepOutputs(result=[a.exp() * 2, b.sum()], grads=[c + 1], checks=[], losses=[d.sum()],
                       costs=[[d, e]], ok=torch.isfinite(d.sum()))


def test_the_replay_module_computes_what_the_graph_computes():
    """The replay takes the inputs' lists, runs the operations through their C++ handles (no
    ``torch.ops`` lookups in its code) and returns the graph's `StepOutputs`."""

    def f(trainable, incoming_grads, frozen, buffers, arguments):
        return _outputs(*trainable, *arguments)

    inputs = ([torch.ones(2), torch.ones(3)], [], [], [], [torch.ones(4), torch.full((2,), 3.0), torch.ones(1)])
    graph = passes.simplify(make_fx(f)(*inputs))
    expected = f(*inputs)
    replay = replay_module(graph, expected)
    assert "torch.ops" not in replay.forward.__self__.code and "aten_exp_default" in replay.forward.__self__.code
    outputs = replay(*inputs)
    assert isinstance(outputs, StepOutputs)
    for a, b in zip(pytree.tree_leaves(outputs), pytree.tree_leaves(expected), strict=True):
        assert torch.equal(a, b)


def test_outputs_read_back_from_their_flat_leaves():
    """`StepOutputs.from_flat` is the inverse of pytree's flattening, for any counts."""
    t = [torch.tensor(float(i)) for i in range(9)]
    outputs = StepOutputs(result=t[:2], grads=[t[2]], checks=[t[3]], losses=[t[4], t[5]],
                          costs=[[t[6]], [t[7]]], ok=t[8])
    back = StepOutputs.from_flat(pytree.tree_leaves(outputs), outputs.counts())
    assert pytree.tree_structure(back) == pytree.tree_structure(outputs)
    assert all(a is b for a, b in zip(pytree.tree_leaves(back), t, strict=True))
    empty = StepOutputs([], [], [], [], [], t[0])
    assert StepOutputs.from_flat([t[0]], empty.counts()) == empty


def test_a_failed_assertion_becomes_its_check():
    check = Check(RuntimeError, "the index is out of range")
    with pytest.raises(CheckFailed) as caught, failed_assertions({check.message: check}):
        torch._assert_async(torch.tensor(False), check.message)
    assert caught.value.check is check
    assert type(check.exception(" (note)")) is RuntimeError
    with pytest.raises(RuntimeError, match="another"), failed_assertions({check.message: check}):
        raise RuntimeError("another")


def _eager_error(model: Scales, scale: torch.Tensor) -> BaseException:
    with pytest.raises(Exception) as caught:
        model.step(scale)
    storch.reset()
    return caught.value


def test_a_failed_validation_raises_the_eager_error_in_the_trace_and_in_a_replay():
    model = Scales()
    bad = torch.tensor([1.0, -2.0])
    eager = _eager_error(model, bad)
    with pytest.raises(type(eager)) as traced:
        storch.compile_step(model.step, model)(bad)
    assert str(traced.value) == str(eager)
    step = storch.compile_step(model.step, model)
    step(torch.tensor([1.0, 2.0]))
    mu, grad = model.mu.detach().clone(), model.mu.grad.clone()
    with pytest.raises(type(eager)) as replayed:
        step(bad)
    assert str(replayed.value) == str(eager)  # torch's own message, from an eager run of the step
    assert torch.equal(model.mu, mu) and torch.equal(model.mu.grad, grad)
    assert storch.registered_costs() == ()


def test_the_graph_returns_the_step_outputs():
    model = Scales()
    step = storch.compile_step(model.step, model)
    step(torch.tensor([1.0, 2.0]))
    trace = next(iter(step._cache.values()))
    outputs = trace.run([model.mu], [], [], [], [torch.tensor([1.0, 2.0])])
    assert isinstance(outputs, StepOutputs)
    assert len(outputs.result) == 1 and len(outputs.grads) == 1 and len(outputs.losses) == 1
    assert outputs.costs[0][0].shape == (2,) and bool(outputs.ok)
