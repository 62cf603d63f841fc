"""Issue 9: the failures a user cannot see become correct results or clear errors.

Each test reproduces one defect found by using storch as a new user would: memory kept alive by a
step, a lazily computed distribution parameter that lost its plates, costs leaking from a failed
step into the next, plates reduced by dimension index, non-finite costs, bad arguments.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import weakref

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, OneHotCategorical

import storch
from storch import _dispatch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import memory_soak  # noqa: E402  (benchmarks/memory_soak.py: the 10 000-step version of this test)
import test_construction  # noqa: E402  (every method class, built as a model would build it)


# ------------------------------------------------------------------ 1. nothing of a step survives it
@pytest.mark.parametrize("create_graph", [False, True])
def test_a_training_step_keeps_nothing_alive(create_graph):
    enc, dec = torch.nn.Linear(64, 40), torch.nn.Linear(40, 64)
    data = torch.rand(32, 64)
    gc.collect()
    cached = len(_dispatch._union_cache), len(_dispatch._plan_cache)
    refs = [r for _ in range(20) for r in memory_soak.training_step(enc, dec, data, create_graph)]
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} objects of finished steps are still alive: {alive[:4]}"
    # the dispatcher's layout caches drop their entries with the layouts they were keyed by
    assert (len(_dispatch._union_cache), len(_dispatch._plan_cache)) <= cached


def _non_leaf(distr_factory):
    """The distribution of ``distr_factory`` with parameters computed from leaves (an encoder's output)."""
    d = distr_factory()
    kind = type(d)
    if kind is Bernoulli or kind is OneHotCategorical:
        return kind(logits=d.logits * 1.0)
    return kind(d.loc * 1.0, d.scale)


@pytest.mark.parametrize("name", sorted(test_construction.METHODS))
def test_no_method_keeps_a_finished_step_alive(name):
    """Every estimator, with non-leaf parameters: nothing of a finished step survives it, also when
    the step is differentiated again afterwards (RELAX's variance step, a user's second derivative)."""
    build, distr_factory = test_construction.METHODS[name]
    model = test_construction.Model(build())
    refs = []
    for _ in range(3):
        z, cost = model(_non_leaf(distr_factory))
        storch.add_cost(cost, "f")
        storch.backward()
        refs.append(weakref.ref(z.plate))
        del z, cost
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{name}: {len(alive)} of 3 finished steps are still alive"


# Methods that differentiate the surrogate again after backward (RELAX, REBAR, LAX) keep the step's
# graph, whose saved tensors refer back to the step: the cyclic collector frees those (test above).
_WITHOUT_KEPT_GRAPH = sorted(
    name for name, (build, _) in test_construction.METHODS.items() if not build().needs_graph_after_backward
)


@pytest.mark.parametrize("name", _WITHOUT_KEPT_GRAPH)
def test_a_finished_step_is_freed_without_the_cyclic_garbage_collector(name):
    """No reference cycle holds a step: its plate, node, samples and distribution go with the last
    tensor that carries the plate, not at the next cyclic collection (on a GPU, device memory)."""
    build, distr_factory = test_construction.METHODS[name]
    model = test_construction.Model(build())
    refs = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            distr = _non_leaf(distr_factory)
            z, cost = model(distr)
            storch.add_cost(cost, "f")
            storch.backward()
            refs += [weakref.ref(z.plate), weakref.ref(distr)]
            del z, cost, distr
        alive = [r() for r in refs if r() is not None]
    finally:
        gc.enable()
    assert not alive, f"{name}: {len(alive)} plates or distributions of finished steps wait for the cyclic collector"


def test_a_second_derivative_after_backward_keeps_nothing_alive():
    w = torch.tensor([0.3, -0.2], requires_grad=True)
    refs = []
    for _ in range(3):
        z = storch.method.ScoreFunction("z", n_samples=4)(Bernoulli(logits=w * 2.0))
        storch.add_cost((z * torch.tensor([1.0, 2.0])).sum(-1), "f")
        storch.backward(create_graph=True)
        torch.autograd.grad(w.grad.sum(), w)  # the FAQ's Hessian pattern
        w.grad = None
        refs.append(weakref.ref(z.plate))
        del z
    gc.collect()
    assert all(r() is None for r in refs)


def test_layout_caches_still_hit_while_layouts_live():
    a = storch.denote_independent(torch.ones(3, 2), 0, "a")
    b = storch.denote_independent(torch.ones(4, 2), 0, "b")
    first, second = a + b, a * b
    assert first._layout is second._layout  # the cached union, shared by both results
    assert len(_dispatch._union_cache) >= 1


# ------------------------------------------------------------------ 4. a plate reduced by index
def _three_by_three():
    return storch.method.ScoreFunction("z", n_samples=3)(OneHotCategorical(logits=torch.zeros(3, requires_grad=True)))


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.sum(0), lambda t: t.sum(dim=0), lambda t: torch.sum(t, 0), lambda t: t.mean(-2),
        lambda t: t.softmax(0), lambda t: torch.nn.functional.log_softmax(t, dim=0), lambda t: t.max(0),
        lambda t: t.norm(2, 0), lambda t: t.transpose(0, 1), lambda t: t.T, lambda t: t.t(), lambda t: t.mT,
        lambda t: t.flip(0), lambda t: t.movedim(1, 0), lambda t: t.unsqueeze(0), lambda t: t.cumsum(0),
        lambda t: t.logsumexp(0),
    ],
)
def test_a_dimension_argument_on_a_plate_is_refused_even_when_sizes_coincide(op):
    z = _three_by_three()  # plate 'z' of size 3 over a 3-valued one-hot: shape (3, 3)
    with pytest.raises(ValueError, match=r"dimension -?\d+, which is plate 'z' \(size 3\).*storch.reduce_plates\(t, 'z'\)"):
        op(z * torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("op", [lambda t: torch.stack([t, t, t]), lambda t: torch.cat([t, t], 0)])
def test_joining_along_a_plate_is_refused_even_when_sizes_coincide(op):
    z = _three_by_three()
    with pytest.raises(ValueError, match=r"dimension 0, which is plate 'z' \(size 3\).*joins the events of each sample"):
        op(z * torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.sum(-1), lambda t: t.sum(1), lambda t: t.softmax(-1), lambda t: torch.stack([t, t, t], -1),
        lambda t: torch.cat([t, t], -1), lambda t: t.unsqueeze(1), lambda t: torch.max(t, t), lambda t: t.norm(2, -1),
    ],
)
def test_event_dimensions_are_still_fine(op):
    z = _three_by_three()
    out = op(z)
    assert out.plate_names == ["z"] and out.shape[0] == 3


def test_dimension_of_a_plain_table_indexed_by_a_plated_tensor_is_not_a_plate():
    idx = storch.denote_independent(torch.tensor([[0, 1], [2, 0]]), 0, "data")
    out = torch.gather(torch.arange(6.0).reshape(3, 2), 0, idx)  # dim 0 of the plain table
    assert out.plate_names == ["data"] and out._tensor.tolist() == [[0.0, 3.0], [4.0, 1.0]]


# ------------------------------------------------------------------ 2. lazily computed parameters
def test_lazily_computed_probs_keep_their_plates_after_sampling():
    logits = storch.denote_independent(torch.randn(50, 200), 0, "data")
    q = Bernoulli(logits=logits)
    storch.method.ScoreFunction("z")(q)
    assert q.probs.plate_names == ["data"]
    assert (q.probs * logits).shape == (50, 200)


def test_bernoulli_vae_samples_then_computes_its_kl():
    """The discrete-VAE tutorial's order: sample the posterior, then kl_divergence(q, prior)."""
    x = storch.denote_independent(torch.rand(8, 6), 0, "data")
    logits = torch.nn.Linear(6, 4)(x)
    q = Bernoulli(logits=logits)
    z = storch.method.ScoreFunction("z", n_samples=3, baseline_factory="batch_average")(q)
    kl = torch.distributions.kl_divergence(q, Bernoulli(probs=torch.full_like(q.probs, 0.5))).sum(-1)
    assert kl.plate_names == ["data"] and kl.shape == (8,)
    storch.add_cost(kl, "kl")
    storch.add_cost(((z.sum(-1) - 2.0) ** 2), "f")
    storch.backward()


def test_categorical_logits_and_bernoulli_logits_after_backward_keep_their_plates():
    probs = storch.denote_independent(torch.softmax(torch.randn(5, 4), -1), 0, "data").requires_grad_()
    q = Categorical(probs=probs)
    z = storch.method.ScoreFunction("z", n_samples=2)(q)
    assert q.logits.plate_names == ["data"] and (q.logits * probs).shape == (5, 4)
    p = storch.denote_independent(torch.rand(5, 3), 0, "data").requires_grad_()
    b = Bernoulli(probs=p)
    y = storch.method.ScoreFunction("y", n_samples=2)(b)
    storch.add_cost(z.float() + y.sum(-1), "f")
    storch.backward()
    assert b.logits.plate_names == ["data"] and (b.logits * p).shape == (5, 3)


# ------------------------------------------------------------------ 3. costs of a failed step
def _step_with_node(fail: bool) -> torch.Tensor:
    w = torch.tensor(1.0, requires_grad=True)
    z = storch.method.ScoreFunction("z", n_samples=2)(Bernoulli(logits=torch.zeros(())))
    storch.add_cost(10.0 * w + z, "loss_a" if fail else "loss_b")  # exact gradient: 10
    if fail:
        raise RuntimeError("the user's code failed between add_cost and backward")
    storch.backward()
    return w.grad


def test_a_cost_left_over_from_a_failed_step_is_refused():
    with pytest.raises(RuntimeError, match="user's code failed"):
        _step_with_node(fail=True)
    with pytest.raises(storch.exceptions.StaleCostError, match=r"two different stochastic nodes.*'z'.*storch.reset\(\)"):
        _step_with_node(fail=False)
    assert storch.registered_costs() == ()  # cleared: the step after that is correct
    assert _step_with_node(fail=False) == 10.0


def test_a_leftover_cost_with_the_same_name_is_refused_and_cleared():
    w = torch.tensor(1.0, requires_grad=True)
    storch.add_cost(10.0 * w, "loss")  # a step that raised before backward
    with pytest.raises(ValueError, match="already registered.*storch.reset"):
        storch.add_cost(10.0 * w, "loss")
    storch.add_cost(10.0 * w, "loss")
    storch.backward()
    assert w.grad == 10.0  # not 20: the leftover did not join this step


def test_reset_at_the_start_of_a_step_forgets_a_failed_step():
    w = torch.tensor(1.0, requires_grad=True)
    storch.add_cost(10.0 * w, "first")  # failed step, no backward
    storch.reset()
    storch.add_cost(10.0 * w, "second")
    storch.backward()
    assert w.grad == 10.0


# ------------------------------------------------------------------ 4. a plate reduced before add_cost
def test_a_cost_whose_node_plate_was_reduced_gives_a_warning():
    logits = torch.zeros(3, requires_grad=True)
    z = storch.method.ScoreFunction("z", n_samples=4)(OneHotCategorical(logits=logits))
    reduced = storch.reduce_plates((z * torch.tensor([1.0, 2.0, 3.0])).sum(-1), "z")
    storch.add_cost(reduced + logits.sum(), "f")
    with pytest.warns(storch.exceptions.UnusedNodeWarning, match=r"Node 'z' \(ScoreFunction\).*reduced before storch.add_cost"):
        storch.backward()


@pytest.mark.parametrize("reduce", [
    lambda t: storch.reduce_plates(t, "z"), lambda t: storch.mean(t, "z"), lambda t: storch.sum(t, "z"),
], ids=["reduce_plates", "mean", "sum"])
def test_backward_names_a_reduced_plate_not_requires_grad_when_nothing_else_needs_grad(reduce):
    """The only gradient path ran through the reduced plate: the error says so, with the fix, and
    does not send the user to requires_grad / no_grad (issue 12)."""
    mu = torch.tensor(0.5, requires_grad=True)
    z = storch.method.ScoreFunction("z", n_samples=4)(torch.distributions.Normal(mu, 1.0))
    storch.add_cost(reduce(z * z), "c")
    with pytest.warns(storch.exceptions.UnusedNodeWarning), pytest.raises(ValueError) as info:
        storch.backward()
    message = str(info.value)
    assert re.search(r"Node\(s\) 'z' \(ScoreFunction\) have parameters that require grad.*plate\(s\) 'z'.*"
                     r"reduced before storch.add_cost.*Keep the plate on the cost", message), message
    assert "requires_grad=True" not in message and "no_grad" not in message
    assert storch.registered_costs() == ()


def test_backward_still_suggests_requires_grad_when_that_is_the_cause():
    z = storch.method.ScoreFunction("z", n_samples=4)(torch.distributions.Normal(0.5, 1.0))  # no parameters
    storch.add_cost(storch.reduce_plates(z * z, "z"), "c")
    with pytest.raises(ValueError, match=r"requires_grad=True.*torch.no_grad\(\)") as info:
        storch.backward()
    assert "reduced before" not in str(info.value)


def test_reduced_reparameterized_nodes_and_nodes_without_grad_do_not_warn(recwarn):
    mu = torch.tensor(0.5, requires_grad=True)
    x = storch.method.Reparameterization("x", n_samples=4)(torch.distributions.Normal(mu, 1.0))
    storch.add_cost(storch.reduce_plates(x * x, "x"), "f")  # pathwise: reducing is fine
    with torch.no_grad():
        storch.method.ScoreFunction("unused", n_samples=2)(Bernoulli(logits=mu))
    storch.backward()
    assert not [w for w in recwarn if issubclass(w.category, storch.exceptions.UnusedNodeWarning)]
    assert mu.grad is not None


# ------------------------------------------------------------------ 5. non-finite costs
def test_a_nan_cost_is_named_and_does_not_poison_the_moving_average():
    logits = torch.zeros(2, requires_grad=True)
    method = storch.method.ScoreFunction("z", n_samples=4, baseline_factory="moving_average")

    def step(bad: bool):
        z = method(Bernoulli(logits=logits))
        cost = z.sum(-1)
        if bad:
            cost = cost * torch.tensor(float("nan"))
        storch.add_cost(cost, "f")
        storch.add_cost(logits.sum() * 0.0, "g")
        logits.grad = None
        storch.backward()
        return logits.grad

    step(False)
    with pytest.raises(storch.exceptions.NonFiniteCostError, match=r"'f' at 4 of 4 values \(plates \['z'\].*nan.*registry was cleared"):
        step(True)
    assert storch.registered_costs() == ()
    assert logits.grad is None  # nothing was differentiated
    for _ in range(3):
        assert torch.isfinite(step(False)).all()
    assert all(torch.isfinite(v) for v in method.baseline.averages.values())


def test_the_moving_average_skips_a_non_finite_mean():
    baseline = storch.method.baseline.MovingAverageBaseline(0.5)
    baseline._pending["f"] = torch.tensor(2.0)
    baseline.update()
    baseline._pending["f"] = torch.tensor(float("inf"))
    baseline.update()
    assert baseline.averages["f"] == 2.0
    baseline._pending["g"] = torch.tensor(float("nan"))
    baseline.update()
    assert baseline.averages["g"] == 0.0


# ------------------------------------------------------------------ 6. what add_cost accepts
@pytest.mark.parametrize("bad", ["high", None, {"a": 1.0}, [1.0, 2.0], True])
def test_add_cost_refuses_what_is_not_a_cost(bad):
    with pytest.raises(TypeError, match=r"storch.add_cost\('loss'\): a cost is a tensor"):
        storch.add_cost(bad, "loss")
    assert storch.registered_costs() == ()


def test_add_cost_accepts_numbers_and_refuses_bad_names():
    storch.add_cost(2.5, "constant")
    assert storch.registered_costs()[0].item() == 2.5
    with pytest.raises(TypeError, match="a cost name is a non-empty string"):
        storch.add_cost(torch.tensor(1.0), 3)


# ------------------------------------------------------------------ 8. gather_samples and variance
def test_gather_samples_takes_a_list_of_weights():
    g = storch.gather_samples([torch.tensor(1.0), torch.tensor(3.0)], "s", weight=[0.25, 0.75])
    assert storch.reduce_plates(g, "s").item() == 2.5
    with pytest.raises(ValueError, match=r"one weight per sample \(2\), got shape \(3,\)"):
        storch.gather_samples([torch.tensor(1.0), torch.tensor(3.0)], "s", weight=[0.2, 0.3, 0.5])


def test_variance_of_one_sample_is_an_error():
    g = storch.gather_samples([torch.tensor(1.0)], "s")
    with pytest.raises(ValueError, match="'s' needs at least 2 samples"):
        storch.variance(g, "s")


# ------------------------------------------------------------------ 10. backward under no_grad
def test_backward_under_no_grad_says_so():
    w = torch.tensor(1.0, requires_grad=True)
    storch.add_cost(w * 2.0, "f")
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"gradients disabled \(inside torch.no_grad\(\)"):
        storch.backward()
    assert storch.registered_costs() == ()


# ------------------------------------------------------------------ 11. more than 64 plates
class NoChain(storch.method.ScoreFunction):
    """A score function whose single-sample nodes do not extend chains (storch.plate.ChainPlate), so
    that every node adds a plate: how plates pile up where they really multiply (several samples per
    node), without allocating 2^64 values."""

    extends_chains = False


def test_single_sample_nodes_drawn_from_each_other_do_not_pile_up_plates():
    p = torch.tensor(0.5, requires_grad=True)
    x = storch.method.ScoreFunction("x0")(Bernoulli(p))
    for i in range(1, 200):
        x = storch.method.ScoreFunction(f"x{i}")(Bernoulli(0.25 + 0.5 * x))
    assert [q.name for q in x.plates] == ["x199"]
    storch.add_cost(x, "f")
    storch.backward()
    assert torch.isfinite(p.grad)


def test_more_than_64_independent_single_sample_nodes_in_one_tensor_says_why():
    """Independent single-sample nodes (each its own chain) still add a plate each where they meet."""
    from storch.plate import TooManyPlatesError

    p = torch.tensor(0.5, requires_grad=True)
    total = torch.tensor(0.0)
    with pytest.raises(TooManyPlatesError, match="65 plates would meet in one tensor.*at most 64"):
        for i in range(65):
            total = total + storch.method.ScoreFunction(f"x{i}")(Bernoulli(p))
    storch.reset()


def test_more_than_64_plates_in_one_tensor_says_why():
    """The 65th plate of a chain is refused where it is made, with storch's reason and fix (not torch's
    "only tensors with up to 64 dims are supported" one operation later)."""
    from storch.plate import MAX_PLATES, TooManyPlatesError

    p = torch.tensor(0.5, requires_grad=True)
    x = NoChain("x0")(Bernoulli(p))
    for i in range(1, MAX_PLATES):
        x = NoChain(f"x{i}")(Bernoulli(0.25 + 0.5 * x))
    assert len(x.plates) == MAX_PLATES
    storch.add_cost(x, "f")  # 64 plates: fine
    storch.reset()
    with pytest.raises(TooManyPlatesError, match=r"cannot add node 'x64'.*65 plates.*65 in all.*at most 64.*chain of N nodes"):
        NoChain("x64")(Bernoulli(0.25 + 0.5 * x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_more_than_25_dimensions_on_cuda_says_why():
    """CUDA kernels take at most 25 dimensions: the node that passes the limit is named, with its plates."""
    from storch.plate import CudaDimensionError

    p = torch.tensor(0.5, device="cuda", requires_grad=True)
    x = storch.method.ScoreFunction("x0")(Bernoulli(p))
    with pytest.raises(CudaDimensionError, match=r"ScoreFunction\('x\d+'\) sampling: .* at most 25"):
        for i in range(1, 30):
            x = storch.method.ScoreFunction(f"x{i}")(Bernoulli(0.25 + 0.5 * x))


def test_cuda_dimension_limit_inside_an_operation_names_the_plates():
    """The same translation for an operation on plated tensors (simulated on the CPU: the operation
    raises CUDA's message)."""
    from storch.plate import CudaDimensionError

    def kernel(t: torch.Tensor) -> torch.Tensor:
        if torch.overrides.has_torch_function((t,)):
            return torch.overrides.handle_torch_function(kernel, (t,), t)
        raise RuntimeError("CUDA Tensors cannot have more than 25 dimensions")

    x = storch.method.ScoreFunction("x", n_samples=2)(Bernoulli(torch.tensor(0.5, requires_grad=True)))
    with pytest.raises(CudaDimensionError, match=r"kernel: .* 1 plates \('x'\).*at most 25") as info:
        kernel(x)
    assert isinstance(info.value.__cause__, RuntimeError)

    def other(t: torch.Tensor) -> torch.Tensor:
        if torch.overrides.has_torch_function((t,)):
            return torch.overrides.handle_torch_function(other, (t,), t)
        raise RuntimeError("something else")
    with pytest.raises(RuntimeError, match="something else"):  # other errors pass unchanged
        other(x)


# ------------------------------------------------------------------ 12. zero-probability values
def test_expect_ignores_an_infinite_cost_of_probability_zero():
    def run(last: float):
        logits = torch.tensor([0.0, 0.0, -float("inf")], requires_grad=True)
        z = storch.method.Expect("z")(Categorical(logits=logits))
        storch.add_cost(torch.tensor([1.0, 2.0, last])[z], "f")
        return storch.backward(), logits.grad

    est_inf, grad_inf = run(float("inf"))
    est_zero, grad_zero = run(0.0)
    assert est_inf == est_zero == 1.5
    torch.testing.assert_close(grad_inf, grad_zero)
    torch.testing.assert_close(grad_inf, torch.tensor([-0.25, 0.25, 0.0]))


@pytest.mark.parametrize("p0", [0.0, 1.0])
def test_expect_weights_read_probs_exactly_at_the_edges(p0):
    """torch clamps probs before its logarithm: exp(log_prob) would give weight 1.2e-7 and gradient 0."""
    p = torch.tensor(p0, requires_grad=True)
    z = storch.method.Expect("z")(Bernoulli(probs=p))
    storch.add_cost(1.0 + 2.0 * z, "f")  # E f = 1 + 2p, d/dp = 2
    assert storch.backward() == 1.0 + 2.0 * p0
    assert p.grad == 2.0
    q = torch.tensor([0.5, 0.5, 0.0], requires_grad=True)
    y = storch.method.Expect("y")(OneHotCategorical(probs=q))
    storch.add_cost((y * torch.tensor([1.0, 2.0, 3.0])).sum(-1), "g")
    assert storch.backward() == 1.5  # weights exactly (0.5, 0.5, 0), not (0.5, 0.5, 1.2e-7)
    torch.testing.assert_close(q.grad, torch.tensor([-0.5, 0.5, 1.5]))  # d/dq of Σ q_k f_k / Σ q


# ------------------------------------------------------------------ 13. integer parameters
@pytest.mark.parametrize("name", sorted(set(test_construction.METHODS) - {"MAPO"}))
def test_integer_parameters_are_refused_before_sampling_naming_node_method_and_distribution(name):
    """``Normal(torch.tensor(0), torch.tensor(1))``: not torch's bare "normal_kernel_cpu not implemented
    for 'Long'" from deep inside the sampler, but the node, the method, the distribution and the fix."""
    method = test_construction.METHODS[name][0]()
    with pytest.raises(TypeError, match=rf"^{name} cannot sample node 'z': the parameters of Normal must be "
                                        r"floating point tensors, got loc \(torch.int64\), scale \(torch.int64\)\..*"
                                        r"torch.tensor\(0.\) instead of torch.tensor\(0\)"):
        method(torch.distributions.Normal(loc=torch.tensor(0), scale=torch.tensor(1)))


def test_mapo_refuses_a_normal_for_its_support_first():
    with pytest.raises(TypeError, match=r"MAPO\('z'\): Normal has no finite support"):
        test_construction.METHODS["MAPO"][0]()(torch.distributions.Normal(torch.tensor(0), torch.tensor(1)))


@pytest.mark.parametrize("method", [
    lambda: storch.method.ScoreFunction("b", n_samples=2), lambda: storch.method.Expect("b"),
    lambda: storch.method.ARM("b", n_samples=2), lambda: storch.method.ScoreFunctionWOR("b", k=2),
    lambda: storch.method.UnorderedSetEstimator("b", k=2),
], ids=["ScoreFunction", "Expect", "ARM", "ScoreFunctionWOR", "UnorderedSetEstimator"])
@pytest.mark.parametrize("param", ["probs", "logits"])
def test_integer_bernoulli_parameters_are_refused(method, param):
    with pytest.raises(TypeError, match=rf"cannot sample node 'b': the parameters of Bernoulli .* got {param} "):
        method()(Bernoulli(**{param: torch.tensor([0, 1])}))


def test_integer_parameters_inside_a_wrapper_are_named_with_their_distribution():
    normal = torch.distributions.Independent(torch.distributions.Normal(torch.tensor([0]), 1.0), 1)
    with pytest.raises(TypeError, match=r"parameters of Independent .* got Normal.loc \(torch.int64\), "
                                        r"Normal.scale \(torch.int64\)"):
        storch.method.Reparameterization("z")(normal)


def test_parameters_that_torch_accepts_as_integers_still_work():
    """Discrete parameters (Binomial's total_count) and Categorical's probs, which torch normalises to
    floating point, are fine."""
    b = storch.method.ScoreFunction("b", n_samples=2)(
        torch.distributions.Binomial(torch.tensor(3), probs=torch.tensor(0.5, requires_grad=True))
    )
    c = storch.method.Expect("c")(Categorical(probs=torch.tensor([1, 3])))
    assert b.shape == (2,) and c.shape == (2,)


def test_a_node_whose_parameters_would_pass_torchs_dimension_limit_is_refused_by_name():
    """Plates plus one parameter's own dimensions over 64: storch's error at the node, not torch's in backward."""
    from torch.distributions import Categorical

    from storch.plate import TooManyPlatesError

    theta, x = torch.zeros(2, requires_grad=True), torch.tensor(0.0)
    for t in range(63):  # 63 plates and the logits' one dimension: 64, the limit
        a = NoChain(f"a{t}", n_samples=1)(Categorical(logits=theta + x))
        x = x + a
    storch.add_cost(x.float(), "c")
    storch.backward()
    assert theta.grad is not None and torch.isfinite(theta.grad).all()
    theta, x = torch.zeros(2, requires_grad=True), torch.tensor(0.0)
    with pytest.raises(TooManyPlatesError, match="cannot add node 'a63'.*65 in all"):
        for t in range(64):
            a = NoChain(f"a{t}", n_samples=1)(Categorical(logits=theta + x))
            x = x + a
    storch.reset()
