"""The cost registry, add_cost, surrogate_loss and backward (storch.inference)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
import torch
from torch.distributions import Bernoulli, Normal

import storch
from storch.method import Expect, GumbelSoftmax, Reparameterization, ScoreFunction
from storch.tensor import plain


def _names():
    return [c.name for c in storch.registered_costs()]


# ---------------------------------------------------------------------------- add_cost


def test_add_cost_registers_in_order_with_default_names():
    storch.add_cost(torch.tensor(1.0))
    storch.add_cost(torch.tensor(2.0), "named")
    storch.add_cost(3.0)
    assert _names() == ["cost_0", "named", "cost_2"]
    assert all(type(c) is storch.CostTensor for c in storch.registered_costs())
    storch.reset()
    assert storch.registered_costs() == ()


def test_add_cost_does_not_retype_the_argument():
    z = ScoreFunction("z", n_samples=2)(Normal(0.0, 1.0))
    cost = z * 2
    storch.add_cost(cost, "c")
    assert type(cost) is storch.Tensor
    assert type(z) is storch.StochasticTensor


def test_add_cost_with_event_dims_raises():
    z = ScoreFunction("z", n_samples=3)(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match=r"event dimensions \(2,\)"):
        storch.add_cost(z, "c")
    with pytest.raises(ValueError, match="event dimensions"):
        storch.add_cost(torch.ones(2), "plain")
    assert storch.registered_costs() == ()


def test_a_repeated_cost_name_registers_another_cost():
    storch.add_cost(torch.tensor(1.0), "c")
    storch.add_cost(torch.tensor(2.0), "c")
    storch.add_cost(torch.tensor(4.0), "c#3")  # a user's own name is kept; the next repeat skips it
    storch.add_cost(torch.tensor(8.0), "c")
    assert _names() == ["c", "c#2", "c#3", "c#4"]
    assert storch.surrogate_loss().item() == 15.0
    storch.reset()
    storch.add_cost(torch.tensor(1.0), "c")
    storch.add_cost(torch.tensor(1.0), "c")
    assert _names() == ["c", "c#2"]  # reset starts the count again


def test_integer_cost_raises():
    with pytest.raises(TypeError, match="floating point"):
        storch.add_cost(torch.tensor(1), "int")


# ---------------------------------------------------------------------------- backward


NEVER_ADDED = (
    "No costs are registered in this context: call storch.add_cost(cost, name) before "
    "storch.backward() or storch.surrogate_loss()."
)


def test_backward_with_no_costs_raises():
    with pytest.raises(ValueError) as info:
        storch.backward()
    assert str(info.value) == NEVER_ADDED  # never added: the message is unchanged, no "consumed"
    with pytest.raises(ValueError, match="No costs"):
        storch.surrogate_loss()


def _one_step(w: torch.Tensor) -> torch.Tensor:
    storch.add_cost(w * 2.0, "f")
    return storch.backward()


def test_a_second_backward_says_the_first_consumed_the_costs():
    w = torch.tensor(1.0, requires_grad=True)
    _one_step(w)
    for call in (storch.backward, storch.backward, storch.surrogate_loss):  # also a third time
        with pytest.raises(ValueError, match=r"the previous storch.backward\(\) consumed them.*"
                                             r"add_cost.*again before each storch.backward\(\)"):
            call()


def test_a_backward_that_raised_also_consumed_the_costs():
    z = ScoreFunction("z", n_samples=2)(Normal(0.0, 1.0))
    storch.add_cost(z * z, "c")
    with pytest.raises(ValueError, match="requires_grad"):  # nothing requires grad: backward raises
        storch.backward()
    with pytest.raises(ValueError, match="consumed"):
        storch.backward()


def test_reset_or_add_cost_after_backward_forget_that_it_consumed_the_costs():
    w = torch.tensor(1.0, requires_grad=True)
    _one_step(w)
    storch.reset()
    with pytest.raises(ValueError) as info:
        storch.backward()
    assert str(info.value) == NEVER_ADDED
    _one_step(w)
    assert _one_step(w) == 2.0  # a new add_cost after a backward: the next backward works
    assert w.grad == 6.0


def test_consumed_costs_are_per_context():
    w = torch.tensor(1.0, requires_grad=True)
    _one_step(w)  # this context's backward consumed its costs; a fresh context has seen no backward

    def fresh() -> str:
        try:
            storch.backward()
        except ValueError as error:
            return str(error)
        return ""

    assert contextvars.Context().run(fresh) == NEVER_ADDED


def test_backward_without_anything_requiring_grad_raises_and_clears():
    z = ScoreFunction("z", n_samples=2)(Normal(0.0, 1.0))
    storch.add_cost(z * z, "c")
    with pytest.raises(ValueError, match="requires_grad"):
        storch.backward()
    assert storch.registered_costs() == ()


def test_backward_clears_the_registry():
    p = torch.tensor(0.4, requires_grad=True)
    x = Expect("x")(Bernoulli(p))
    storch.add_cost(x * 1.0, "c")
    storch.backward()
    assert storch.registered_costs() == ()
    with pytest.raises(ValueError, match="No costs"):
        storch.backward()


def test_backward_returns_exact_expectation_for_expect():
    p = torch.tensor([0.3, 0.6], requires_grad=True)
    x = Expect("x")(Bernoulli(p))
    f = 2 * x[..., 0] + 3 * x[..., 1] + 5 * x[..., 0] * x[..., 1]
    storch.add_cost(f, "f")
    estimate = storch.backward()
    # E f = 2 p0 + 3 p1 + 5 p0 p1
    assert type(estimate) is torch.Tensor and estimate.dim() == 0 and not estimate.requires_grad
    torch.testing.assert_close(estimate, torch.tensor(2 * 0.3 + 3 * 0.6 + 5 * 0.3 * 0.6))
    # dE/dp0 = 2 + 5 p1, dE/dp1 = 3 + 5 p0
    torch.testing.assert_close(p.grad, torch.tensor([2 + 5 * 0.6, 3 + 5 * 0.3]))


@pytest.mark.parametrize("straight_through", [False, True])
def test_backward_returns_the_relaxed_objective_with_a_relaxation(straight_through):
    """As its docstring says: with relaxed samples the value is the cost at those samples (far from
    E f here), with straight-through samples the plain estimate of E f."""
    p = torch.tensor(0.3, requires_grad=True)
    x = GumbelSoftmax("x", n_samples=4000, straight_through=straight_through)(Bernoulli(p))
    cost = (x - 0.45) ** 2
    storch.add_cost(cost, "f")
    relaxed_mean = plain(cost).detach().mean()
    exact = 0.7 * 0.45**2 + 0.3 * 0.55**2  # E f = 0.2325 for discrete x
    estimate = storch.backward()
    torch.testing.assert_close(estimate, relaxed_mean)
    assert (abs(estimate.item() - exact) < 0.02) == straight_through  # relaxed: about 0.09


def test_backward_returns_sum_of_cost_estimates_and_averages_minibatch():
    p = torch.tensor(0.25, requires_grad=True)
    x = Expect("x")(Bernoulli(p))
    data = storch.denote_independent(torch.tensor([1.0, 2.0, 6.0]), 0, "data")
    storch.add_cost(x * data, "scaled")  # E = p * mean(data) = 0.25 * 3
    storch.add_cost(x * 0 + 10.0, "const")
    estimate = storch.backward()
    torch.testing.assert_close(estimate, torch.tensor(0.25 * 3.0 + 10.0))
    torch.testing.assert_close(p.grad, torch.tensor(3.0))


def test_backward_estimate_for_monte_carlo_is_the_sample_mean():
    mu = torch.tensor(1.0, requires_grad=True)
    z = Reparameterization("z", n_samples=7)(Normal(mu, 1.0))
    storch.add_cost(z * z, "f")
    raw = z._tensor.detach()
    estimate = storch.backward()
    torch.testing.assert_close(estimate, (raw * raw).mean())
    torch.testing.assert_close(mu.grad, (2 * raw).mean())


def test_surrogate_loss_value_equals_estimate_and_keeps_registry():
    logits = torch.tensor([0.3, -0.2], requires_grad=True)
    z = ScoreFunction("z", n_samples=5, baseline_factory="batch_average")(Bernoulli(logits=logits))
    data = storch.denote_independent(torch.tensor([0.5, 1.5]), 0, "data")
    cost = (z * 3.0 - 1.0).sum(-1) * data
    storch.add_cost(cost, "c")
    storch.add_cost(z.sum(-1) ** 2, "d")
    surrogate = storch.surrogate_loss()
    assert surrogate.requires_grad
    assert _names() == ["c", "d"]
    expected = storch.reduce_plates(cost) + storch.reduce_plates(z.sum(-1) ** 2)
    torch.testing.assert_close(surrogate.detach(), expected._tensor.detach())
    estimate = storch.backward()
    torch.testing.assert_close(estimate, surrogate.detach())


def test_print_costs(capsys):
    p = torch.tensor(0.5, requires_grad=True)
    x = Expect("x")(Bernoulli(p))
    storch.add_cost(x * 4.0, "four")
    storch.add_cost(x * 2.0, "two")
    storch.backward(print_costs=True)
    out = capsys.readouterr().out
    assert "four: 2" in out and "two: 1" in out


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_second_derivative_with_create_graph_is_exact_for_expect():
    theta = torch.tensor(0.4, requires_grad=True)
    x = Expect("x")(Bernoulli(logits=theta))
    storch.add_cost(5.0 * x, "f")
    storch.backward(create_graph=True)
    s = torch.sigmoid(theta.detach())
    torch.testing.assert_close(theta.grad.detach(), 5 * s * (1 - s))
    (hess,) = torch.autograd.grad(theta.grad, theta)
    theta.grad = None  # break the parameter <-> gradient reference cycle
    torch.testing.assert_close(hess, 5 * s * (1 - s) * (1 - 2 * s))


def test_exception_inside_backward_leaves_registry_empty():
    class Broken(ScoreFunction):
        def estimator(self, tensor, cost):
            raise RuntimeError("estimator exploded")

    mu = torch.zeros(1, requires_grad=True)
    z = Broken("z", n_samples=2)(Normal(mu, 1.0))
    storch.add_cost(z.sum(-1), "c")
    with pytest.raises(RuntimeError, match="exploded"):
        storch.backward()
    assert storch.registered_costs() == ()
    # the next graph works normally
    z = ScoreFunction("z", n_samples=2)(Normal(mu, 1.0))
    storch.add_cost(z.sum(-1), "c")
    storch.backward()
    assert mu.grad is not None


def test_exception_in_update_parameters_leaves_registry_empty():
    class BadUpdate(ScoreFunction):
        def update_parameters(self, result_triples):
            raise RuntimeError("update failed")

    mu = torch.zeros(1, requires_grad=True)
    z = BadUpdate("z", n_samples=2)(Normal(mu, 1.0))
    storch.add_cost(z.sum(-1), "c")
    with pytest.raises(RuntimeError, match="update failed"):
        storch.backward()
    assert storch.registered_costs() == ()


def test_update_parameters_false_skips_method_state():
    method = ScoreFunction("z", n_samples=2, baseline_factory="moving_average")
    p = torch.tensor(0.5, requires_grad=True)
    z = method(Bernoulli(p))
    storch.add_cost(z + 1.0, "c")
    storch.backward(update_parameters=False)
    assert method.baseline.averages == {}
    z = method(Bernoulli(p))
    storch.add_cost(z + 1.0, "c")
    storch.backward()
    assert set(method.baseline.averages) == {"c"}


# --------------------------------------------------------------------- context-locality


def test_registry_is_thread_local():
    storch.add_cost(torch.tensor(1.0), "main")
    seen = {}

    def worker():
        seen["start"] = _names()
        mu = torch.tensor(0.0, requires_grad=True)
        z = Reparameterization("z", n_samples=3)(Normal(mu, 1.0))
        storch.add_cost(z * z, "thread")
        seen["before_backward"] = _names()
        storch.backward()
        seen["after"] = _names()
        seen["grad"] = mu.grad

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["start"] == []
    assert seen["before_backward"] == ["thread"]
    assert seen["after"] == []
    assert seen["grad"] is not None
    assert _names() == ["main"]


def test_copied_context_does_not_leak_costs_to_the_parent():
    storch.add_cost(torch.tensor(1.0), "parent")
    ctx = contextvars.copy_context()

    def child():
        storch.add_cost(torch.tensor(2.0), "child")
        return _names()

    assert ctx.run(child) == ["parent", "child"]
    assert _names() == ["parent"]


def test_asyncio_tasks_have_their_own_graph():
    storch.add_cost(torch.tensor(1.0), "parent")

    async def task(name):
        storch.add_cost(torch.tensor(2.0), name)
        await asyncio.sleep(0)
        return _names()

    async def main():
        results = await asyncio.gather(task("a"), task("b"))
        return results, _names()

    (ra, rb), after = asyncio.run(main())
    assert ra == ["parent", "a"] and rb == ["parent", "b"]  # tasks do not see each other's costs
    assert after == ["parent"]
    assert _names() == ["parent"]


# -------------------------------------------------------------------- credit assignment


def _two_node_costs(seed, which):
    """z1 ~ Bernoulli(σ(a)) and z2 ~ Bernoulli(σ(b)), score function; f1 depends on z1 only."""
    torch.manual_seed(seed)
    a = torch.tensor(0.2, requires_grad=True)
    b = torch.tensor(-0.4, requires_grad=True)
    z1 = ScoreFunction("z1", n_samples=4)(Bernoulli(logits=a))
    z2 = ScoreFunction("z2", n_samples=5)(Bernoulli(logits=b))
    f1 = 10.0 * z1 + 3.0
    f2 = (z2 - 0.3) ** 2
    if which == "separate":
        storch.add_cost(f1, "f1")
        storch.add_cost(f2, "f2")
    elif which == "f2":
        storch.add_cost(f2 + 0 * z1, "f2")
    else:  # one joint cost: z2 is credited with f1 as well
        storch.add_cost(f1 + f2, "joint")
    storch.backward()
    return a, b, z1._tensor.detach(), z2._tensor.detach()


def test_per_cost_credit_assignment_with_score_function():
    a, b, z1, z2 = _two_node_costs(5, "separate")
    # score of Bernoulli(logits=b) at x: x - σ(b)
    expected_b = ((z2 - 0.3) ** 2 * (z2 - torch.sigmoid(b.detach()))).mean()
    torch.testing.assert_close(b.grad, expected_b)
    expected_a = ((10.0 * z1 + 3.0) * (z1 - torch.sigmoid(a.detach()))).mean()
    torch.testing.assert_close(a.grad, expected_a)
    # the same b gradient as if f1 did not exist
    _, b_only, _, _ = _two_node_costs(5, "f2")
    torch.testing.assert_close(b.grad, b_only.grad)
    # ... and different from crediting z2 with f1 (the check can fail)
    _, b_joint, _, _ = _two_node_costs(5, "joint")
    assert not torch.allclose(b.grad, b_joint.grad)


def _exact_nested(a, b):
    """E[f1 + f2] for z1 ~ Bern(σ(a)), z2 | z1 ~ Bern(σ(b + z1)), f1 = 7 z1, f2 = (z2 − z1/2)²."""
    total = 0.0
    for v1 in (0.0, 1.0):
        p1 = torch.sigmoid(a) if v1 else 1 - torch.sigmoid(a)
        for v2 in (0.0, 1.0):
            q = torch.sigmoid(b + v1)
            p2 = q if v2 else 1 - q
            total = total + p1 * p2 * (7 * v1 + (v2 - v1 / 2) ** 2)
    return total


def test_credit_assignment_nested_nodes_exact_with_expect():
    def run(costs):
        a = torch.tensor(0.3, requires_grad=True)
        b = torch.tensor(-0.7, requires_grad=True)
        z1 = Expect("z1")(Bernoulli(logits=a))
        z2 = Expect("z2")(Bernoulli(logits=b + z1))
        if "f1" in costs:
            storch.add_cost(7.0 * z1, "f1")
        if "f2" in costs:
            storch.add_cost((z2 - z1 / 2) ** 2, "f2")
        est = storch.backward()
        return est, a.grad, b.grad

    est, ga, gb = run(("f1", "f2"))
    a0 = torch.tensor(0.3, requires_grad=True)
    b0 = torch.tensor(-0.7, requires_grad=True)
    exact = _exact_nested(a0, b0)
    ea, eb = torch.autograd.grad(exact, (a0, b0))
    torch.testing.assert_close(est, exact.detach())
    torch.testing.assert_close(ga, ea)
    torch.testing.assert_close(gb, eb)
    # the cost that depends only on z1 contributes nothing to b
    with pytest.warns(storch.exceptions.UnusedNodeWarning, match="Node 'z2' \\(Expect\\)"):
        _, ga_f1, gb_f1 = run(("f1",))  # z2 is sampled but in no cost: storch says so
    assert gb_f1 is None or float(gb_f1) == 0.0
    torch.testing.assert_close(ga_f1, 7 * torch.sigmoid(torch.tensor(0.3)) * (1 - torch.sigmoid(torch.tensor(0.3))))
    _, _, gb_f2 = run(("f2",))
    torch.testing.assert_close(gb, gb_f2)


def _dispatched_in_backward(monkeypatch, step) -> int:
    """How many operations pass through storch's ``__torch_function__`` in ``storch.backward``."""
    from storch.tensor import Tensor

    inner = Tensor.__dict__["__torch_function__"].__func__
    calls = []

    def counted(cls, func, types, args=(), kwargs=None):
        calls.append(func)
        return inner(cls, func, types, args, kwargs)

    step()  # registers the costs
    monkeypatch.setattr(Tensor, "__torch_function__", classmethod(counted))
    storch.backward()
    return len(calls)


def test_the_score_function_surrogate_runs_without_dispatch(monkeypatch):
    """The surrogate's own arithmetic (magic boxes, baseline terms, the sums of a chain's partial
    surrogates) runs on the plain values: a chain of decisions with a reward after each and a
    moving-average baseline, and a minibatch with one sample, dispatch nothing in backward."""
    from torch.distributions import Categorical

    logits = torch.zeros(3, requires_grad=True)
    method = storch.method.ScoreFunction("a", baseline_factory="moving_average")

    def chain():
        previous = storch.denote_independent(torch.zeros(4), 0, "episodes")
        for t in range(3):
            action = method(Categorical(logits=logits + previous.unsqueeze(-1)))
            storch.add_cost((action == 1).float(), f"r{t}")
            previous = action.float()

    def minibatch():
        x = storch.denote_independent(torch.ones(5, 3), 0, "data")
        z = storch.method.ScoreFunction("z", n_samples=1)(Bernoulli(logits=logits * x))
        storch.add_cost((z - x).sum(-1) + z.log_prob().sum(-1), "c")

    assert _dispatched_in_backward(monkeypatch, chain) == 0
    monkeypatch.undo()
    assert _dispatched_in_backward(monkeypatch, minibatch) == 0


def test_a_registered_cost_without_gradient_does_not_keep_the_users_tensor_object():
    """storch's own object for a cost that no gradient flows through is not a view of the user's tensor (a
    view holds its base's object, with its plates): that object is freed when the user drops it, while
    the registered cost keeps the values."""
    import weakref

    x = storch.denote_independent(torch.tensor([1.0, 3.0]), 0, "data")
    reward = x * 2.0
    ref = weakref.ref(reward)
    storch.add_cost(reward, "r")
    del reward
    assert ref() is None
    (cost,) = storch.registered_costs()
    assert cost.plate_names == ["data"] and cost.plain().tolist() == [2.0, 6.0]
    assert storch.surrogate_loss().item() == 4.0
    storch.reset()
