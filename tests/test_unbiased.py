"""Statistical unbiasedness tests of the core estimators against exact gradients (SPEC §5).

Each test draws R independent gradient estimates in one backward pass (the parameters are
replicated along an independent plate, see storch.testing.replicate) and requires
|mean − exact| ≤ 4.5 standard errors per coordinate. Exact gradients come from enumerating the
discrete problem and differentiating Σ_x p(x) f(x) with autograd, or from closed forms.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Bernoulli, Normal

import storch
from storch.method import Expect, Infer, Reparameterization, ScoreFunction
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from problems import bernoulli, minibatch_bernoulli, nested_categorical, one_categorical, replicated_hessians, two_costs
from score_function_loo import ScoreFunctionLOO  # examples/score_function_loo.py, the manual's estimator

pytestmark = pytest.mark.seed(1234)

R = 3000

# ---------------------------------------------------------------- one Bernoulli node
BERNOULLI = bernoulli(interaction=0.0)  # f = Σ (x − t)²
PHI = BERNOULLI.phi

ONE_NODE_METHODS = {
    "score_function": lambda: ScoreFunction("x", n_samples=1),
    "score_function_batch_average": lambda: ScoreFunction("x", n_samples=4, baseline_factory="batch_average"),
    "score_function_moving_average": lambda: ScoreFunction("x", n_samples=2, baseline_factory="moving_average"),
    "expect": lambda: Expect("x"),
    "infer": lambda: Infer("x", n_samples=2),
    "user_written_loo": lambda: ScoreFunctionLOO("x", n_samples=3),
}


@pytest.mark.parametrize("name", list(ONE_NODE_METHODS))
def test_one_bernoulli_node(name):
    model = BERNOULLI.model(ONE_NODE_METHODS[name]())
    for _ in range(3):  # let stateful baselines (moving average) move away from zero first
        replicated_gradients([PHI], 10, model)
    (grads,) = replicated_gradients([PHI], R, model)
    assert_unbiased(grads, BERNOULLI.exact(), label=name)


# ---------------------------------------------------------------- one categorical node
CATEGORICAL = one_categorical(4)


@pytest.mark.parametrize("name", ["score_function", "score_function_batch_average", "expect", "user_written_loo"])
def test_one_categorical_node(name):
    method = {
        "score_function": lambda: ScoreFunction("z", n_samples=1),
        "score_function_batch_average": lambda: ScoreFunction("z", n_samples=3, baseline_factory="batch_average"),
        "expect": lambda: Expect("z"),
        "user_written_loo": lambda: ScoreFunctionLOO("z", n_samples=3),
    }[name]()
    (grads,) = replicated_gradients([CATEGORICAL.theta], R, CATEGORICAL.model(method))
    assert_unbiased(grads, CATEGORICAL.exact(), label=name)


# ---------------------------------------------------------------- two nested categorical nodes
NESTED_PROBLEM = nested_categorical(3, 3)

NESTED = {
    "sf_sf": (lambda: ScoreFunction("z1"), lambda: ScoreFunction("z2")),
    "sf_sf_batch_average": (
        lambda: ScoreFunction("z1", n_samples=3, baseline_factory="batch_average"),
        lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average"),
    ),
    "expect_expect": (lambda: Expect("z1"), lambda: Expect("z2")),
    "expect_then_sf": (lambda: Expect("z1"), lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average")),
    "sf_then_expect": (lambda: ScoreFunction("z1", n_samples=2), lambda: Expect("z2")),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_two_nested_categorical_nodes(name):
    m1, m2 = (f() for f in NESTED[name])
    NESTED_PROBLEM.assert_unbiased(NESTED_PROBLEM.model(m1, m2), R, label=name)


# ---------------------------------------------------------------- two costs, different ancestors
TWO_COSTS_PROBLEM = two_costs()

TWO_COSTS = {
    "sf_sf": (lambda: ScoreFunction("z1", n_samples=2), lambda: ScoreFunction("z2", n_samples=2)),
    "sf_batch_average": (
        lambda: ScoreFunction("z1", n_samples=3, baseline_factory="batch_average"),
        lambda: ScoreFunction("z2", n_samples=3, baseline_factory="batch_average"),
    ),
    "expect_then_sf": (lambda: Expect("z1"), lambda: ScoreFunction("z2", n_samples=2)),
}


@pytest.mark.parametrize("name", list(TWO_COSTS))
def test_two_costs_with_different_ancestors(name):
    m1, m2 = (f() for f in TWO_COSTS[name])
    TWO_COSTS_PROBLEM.assert_unbiased(TWO_COSTS_PROBLEM.model(m1, m2), R, label=name)


# ---------------------------------------------------------------- Bernoulli under a minibatch plate
MINIBATCH = minibatch_bernoulli()  # f = Σ (z − t)² per data point

@pytest.mark.parametrize(
    "make",
    [
        lambda: ScoreFunction("z", n_samples=2, baseline_factory="batch_average"),
        lambda: ScoreFunction("z", n_samples=1, baseline_factory=None),
        lambda: Expect("z"),
    ],
    ids=["sf_batch_average", "sf", "expect"],
)
def test_bernoulli_under_minibatch_plate(make):
    (grads,) = replicated_gradients([MINIBATCH.w], R, MINIBATCH.model(make()))
    assert_unbiased(grads, MINIBATCH.exact(), label="minibatch")


# ---------------------------------------------------------------- the introduction example (continuous)
A_, B_, C_ = 5.0, -3.0, 0.23
EXACT_DC = 2 * (A_ + B_) * (B_ + C_)  # -11.08


def intro_model(method):
    def model(c):
        d = A_ + B_
        e = method(Normal(B_ + c, 1.0))
        storch.add_cost(d * e * e, "f")

    return model


@pytest.mark.parametrize(
    "make",
    [
        lambda: Reparameterization("e", n_samples=1),
        lambda: ScoreFunction("e", n_samples=5),
        lambda: ScoreFunction("e", n_samples=5, baseline_factory="batch_average"),
        lambda: Infer("e", n_samples=1),
    ],
    ids=["reparameterization", "score_function", "batch_average", "infer"],
)
def test_introduction_example_unbiased(make):
    (grads,) = replicated_gradients([torch.tensor(C_)], R, intro_model(make()))
    assert_unbiased(grads, torch.tensor(EXACT_DC))


# True variances of one gradient estimate of ∂E f/∂c (SPEC §5). Closed forms with μ = b + c,
# f = 2 e²: reparameterization 4e → 16/n; score function 2e²(e − μ) →
# 4(μ⁴ + 18μ² + 15) − 16μ² per sample; leave-one-out with n = 20 has no short closed form: 14.94
# from 4·10⁶ simulated estimates (standard error 0.011).
MU = B_ + C_
SF_VAR = 4 * (MU**4 + 18 * MU**2 + 15) - 16 * MU**2
MANUAL_VARIANCES = {
    "reparameterization n=1": (lambda: Reparameterization("e", n_samples=1), 16.0),
    "reparameterization n=10": (lambda: Reparameterization("e", n_samples=10), 1.6),
    "score_function n=1": (lambda: ScoreFunction("e", n_samples=1, baseline_factory=None), SF_VAR),
    "score_function n=45": (lambda: ScoreFunction("e", n_samples=45, baseline_factory=None), SF_VAR / 45),
    "batch_average n=20": (lambda: ScoreFunction("e", n_samples=20, baseline_factory="batch_average"), 14.94),
}


@pytest.mark.parametrize("name", list(MANUAL_VARIANCES))
def test_manual_variances_within_sampling_error(name):
    from storch.testing import variance_with_stderr

    make, true = MANUAL_VARIANCES[name]
    (grads,) = replicated_gradients([torch.tensor(C_)], 4000, intro_model(make()))
    var, se = variance_with_stderr(grads)
    assert abs(var - true) <= 4.5 * se + 0.02, f"{name}: variance {var:.3f} ± {se:.3f}, true {true:.3f}"


def test_true_score_function_variance_matches_spec():
    assert SF_VAR == pytest.approx(725.2, abs=0.1)
    assert SF_VAR / 45 == pytest.approx(16.1, abs=0.05)


# ---------------------------------------------------------------- second order
INTERACTING = bernoulli(interaction=2.0)  # f = Σ (x − t)² + 2 x₁x₂


@pytest.mark.parametrize(
    "make",
    [lambda: ScoreFunction("x", n_samples=1), lambda: ScoreFunction("x", n_samples=3, baseline_factory="batch_average")],
    ids=["score_function", "batch_average"],
)
def test_score_function_hessian_unbiased(make):
    hessians = replicated_hessians(INTERACTING.phi, 4000, INTERACTING.model(make()))
    assert_unbiased(hessians, INTERACTING.exact_hessian().reshape(-1))


@pytest.mark.parametrize(
    "make",
    [lambda: Reparameterization("e", n_samples=1), lambda: ScoreFunction("e", n_samples=4, baseline_factory="batch_average")],
    ids=["reparameterization", "score_function"],
)
def test_intro_second_derivative_unbiased(make):
    # E f = (a + b)(1 + (b + c)²) so ∂²E f/∂c² = 2(a + b) = 4
    repeats = 4000
    leaf, view = storch.testing.replicate(torch.tensor(C_), repeats)
    intro_model(make())(view)
    storch.backward(create_graph=True)
    second = torch.autograd.grad(leaf.grad.sum(), leaf)[0] * repeats
    assert_unbiased(second.unsqueeze(-1), torch.tensor([2 * (A_ + B_)]))


# ---------------------------------------------------------------- biased: Gumbel-softmax
def gumbel_bias(temperature: float, n: int = 200_000) -> float:
    phi = PHI.clone().requires_grad_()
    x = storch.method.GumbelSoftmax("x", n_samples=n, initial_temperature=temperature)(Bernoulli(logits=phi))
    storch.add_cost(BERNOULLI.cost(x), "f")
    storch.backward()
    return (phi.grad - BERNOULLI.exact()).norm().item()


def test_gumbel_softmax_bias_shrinks_with_temperature():
    biases = {t: gumbel_bias(t) for t in (2.0, 0.5, 0.1)}
    # measured (norm of mean − exact): 0.074 at τ=2, 0.044 at τ=0.5, 0.012 at τ=0.1, with
    # 2·10⁵ samples each (Monte Carlo noise about 0.002)
    assert biases[2.0] > 0.05, biases
    assert biases[2.0] > biases[0.5] > biases[0.1], biases
    assert biases[0.1] < 0.025, biases


# ---------------------------------------------------------------- variance reduction
def test_batch_average_reduces_variance():
    # a large constant offset in the cost is pure noise for the plain score function
    def run(baseline):
        method = ScoreFunction("x", n_samples=4, baseline_factory=baseline)

        def model(phi):
            x = method(Bernoulli(logits=phi))
            storch.add_cost(BERNOULLI.cost(x) + 10.0, "f")

        (grads,) = replicated_gradients([PHI], R, model)
        return grads

    plain, rloo = run(None), run("batch_average")
    assert check_unbiased(plain, BERNOULLI.exact()).passed
    assert check_unbiased(rloo, BERNOULLI.exact()).passed
    assert (rloo.var(0) < plain.var(0) / 10).all(), (rloo.var(0), plain.var(0))


def test_harness_detects_a_biased_estimator():
    """The harness must be able to fail: a deliberately biased estimator (GumbelSoftmax, τ=2)."""
    method = storch.method.GumbelSoftmax("x", n_samples=1, initial_temperature=2.0)
    (grads,) = replicated_gradients([PHI], R, BERNOULLI.model(method))
    assert not check_unbiased(grads, BERNOULLI.exact()).passed
    with pytest.raises(AssertionError, match="biased"):
        assert_unbiased(grads, BERNOULLI.exact())


def test_expect_is_exact():
    (grads,) = replicated_gradients([PHI], 5, BERNOULLI.model(Expect("x")))
    assert torch.allclose(grads, BERNOULLI.exact().expand(5, 3), atol=1e-6)
    assert math.isfinite(grads.sum().item())
