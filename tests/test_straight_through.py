"""Straight-through family (biased): measured bias, and the limits where the bias vanishes.

Problems: three Bernoulli variables with a quadratic, interacting cost; a four-class one-hot
categorical with a quadratic cost (z·v)² and a cubic cost ((z·v) − ½)³/4. Bias = ‖E ĝ − ∇E f‖,
the mean taken over many samples of one node (the gradient of the plate mean is the mean of the
per-sample estimates); exact gradients by enumeration.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import GumbelSoftmax
from storch.method.straight_through import GumbelRao, ReinMax, StraightThrough
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from problems import bernoulli, one_categorical

pytestmark = pytest.mark.seed(7)

BERNOULLI = bernoulli(interaction=2.0)
QUADRATIC = one_categorical(4)  # f = (z·v)²
CUBIC = one_categorical(4, g=lambda v: (v - 0.5) ** 3 / 4)  # f = ((z·v) − ½)³/4
PHI, THETA, VALUES = BERNOULLI.phi, QUADRATIC.theta, QUADRATIC.values
bernoulli_exact = BERNOULLI.exact

PROBLEMS = {
    "bernoulli": (lambda p: Bernoulli(logits=p), BERNOULLI.cost, PHI, BERNOULLI.exact),
    "categorical_quadratic": (lambda p: OneHotCategorical(logits=p), QUADRATIC.cost, THETA, QUADRATIC.exact),
    "categorical_cubic": (lambda p: OneHotCategorical(logits=p), CUBIC.cost, THETA, CUBIC.exact),
}


def mean_gradient(method, problem: str) -> torch.Tensor:
    """The mean of the per-sample estimates over ``method``'s samples (one backward pass)."""
    make_distr, cost, param, _ = PROBLEMS[problem]
    p = param.clone().requires_grad_()
    storch.add_cost(cost(method(make_distr(p))), "f")
    storch.backward()
    return p.grad


def bias(method, problem: str) -> float:
    return (mean_gradient(method, problem) - PROBLEMS[problem][3]()).norm().item()


def estimates(make, problem: str, repeats: int) -> torch.Tensor:
    make_distr, cost, param, _ = PROBLEMS[problem]

    def model(p):
        storch.add_cost(cost(make()(make_distr(p))), "f")

    (grads,) = replicated_gradients([param], repeats, model)
    return grads


N = 200_000  # samples for bias measurements: Monte Carlo error of the mean about 0.001–0.01


# ---------------------------------------------------------------- straight-through
@pytest.mark.parametrize("problem", ["bernoulli", "categorical"])
def test_straight_through_is_exact_for_linear_costs(problem):
    """f(x) = a·x: ∇f(D)ᵀ ∂π/∂θ = aᵀ ∂π/∂θ = ∇E f for every sample, also under a minibatch plate."""
    if problem == "bernoulli":
        data = torch.tensor([[0.5, -1.0, 0.2], [1.5, 0.3, -0.7]])
        make_distr, param, a = (lambda p: Bernoulli(logits=p)), PHI, torch.tensor([1.0, -2.0, 0.5])
        exact_fn = lambda p: (torch.sigmoid(p + data) * a).sum(-1).mean()  # noqa: E731
    else:
        data = torch.tensor([[0.5, -1.0, 0.2, 0.0], [1.5, 0.3, -0.7, 0.1]])
        make_distr, param, a = (lambda p: OneHotCategorical(logits=p)), THETA, VALUES
        exact_fn = lambda p: ((p + data).softmax(-1) * a).sum(-1).mean()  # noqa: E731

    def model(p):
        shift = storch.denote_independent(data, 0, "data")
        x = StraightThrough("x", n_samples=2)(make_distr(p + shift))
        assert bool(((x._tensor == 0) | (x._tensor == 1)).all())  # hard samples forward
        storch.add_cost((x * a).sum(-1), "f")

    (grads,) = replicated_gradients([param], 50, model)
    exact = torch.autograd.functional.jacobian(exact_fn, param)
    assert torch.allclose(grads, exact.expand_as(grads), atol=1e-5)


def test_straight_through_bias_on_nonlinear_costs():
    # measured (2·10⁵ samples, error ≤ 0.004): 0.113 (Bernoulli, exact norm 0.351), 1.33
    # (categorical quadratic, exact norm 1.65), 0.158 (categorical cubic, exact norm 0.868)
    b = {p: bias(StraightThrough("x", n_samples=N), p) for p in PROBLEMS}
    assert 0.09 < b["bernoulli"] < 0.14, b
    assert 1.2 < b["categorical_quadratic"] < 1.45, b
    assert 0.12 < b["categorical_cubic"] < 0.2, b


# ---------------------------------------------------------------- ReinMax
@pytest.mark.parametrize("problem", ["bernoulli", "categorical_quadratic"])
def test_reinmax_is_unbiased_for_quadratic_costs_at_temperature_one(problem):
    grads = estimates(lambda: ReinMax("x"), problem, 10_000)
    assert_unbiased(grads, PROBLEMS[problem][3](), label=f"ReinMax {problem}")
    # straight-through is not, on the same problems
    st = estimates(lambda: StraightThrough("x"), problem, 10_000)
    assert not check_unbiased(st, PROBLEMS[problem][3]()).passed


def test_reinmax_bias_against_straight_through():
    # measured (2·10⁵ samples): τ = 2 loses the quadratic exactness (bias 0.046 Bernoulli, 0.47
    # categorical quadratic); on the cubic cost ReinMax is worse than straight-through (0.82 vs 0.16)
    assert not check_unbiased(estimates(lambda: ReinMax("x", temperature=2.0), "bernoulli", 10_000), bernoulli_exact()).passed
    assert bias(ReinMax("x", n_samples=N, temperature=2.0), "categorical_quadratic") > 0.3
    reinmax_cubic = bias(ReinMax("x", n_samples=N), "categorical_cubic")
    st_cubic = bias(StraightThrough("x", n_samples=N), "categorical_cubic")
    assert 0.7 < reinmax_cubic < 0.95 and reinmax_cubic > 3 * st_cubic, (reinmax_cubic, st_cubic)


# ---------------------------------------------------------------- Gumbel-Rao
@pytest.mark.parametrize("problem", ["bernoulli", "categorical_quadratic"])
def test_gumbel_rao_has_the_mean_of_st_gumbel_softmax_and_lower_variance(problem):
    repeats = 10_000
    gr = estimates(lambda: GumbelRao("x", temperature=0.5, n_relaxed=10), problem, repeats)
    stgs = estimates(lambda: GumbelSoftmax("x", straight_through=True, initial_temperature=0.5), problem, repeats)
    se = ((gr.var(0) + stgs.var(0)) / repeats).sqrt()
    diff = (gr.mean(0) - stgs.mean(0)).abs()
    assert (diff <= 4.5 * se).all(), (gr.mean(0), stgs.mean(0), se)
    # measured total variance: 0.24 vs 0.42 (Bernoulli), 8.6 vs 15.5 (categorical quadratic)
    assert gr.var(0).sum() < 0.75 * stgs.var(0).sum(), (gr.var(0).sum(), stgs.var(0).sum())
    # ... and the same (biased) mean: measured bias 0.083 (Bernoulli), 0.56 (categorical)
    assert not check_unbiased(gr, PROBLEMS[problem][3]()).passed


def test_gumbel_rao_with_one_relaxed_sample_is_st_gumbel_softmax():
    repeats = 10_000
    gr1 = estimates(lambda: GumbelRao("x", temperature=0.5, n_relaxed=1), "bernoulli", repeats)
    stgs = estimates(lambda: GumbelSoftmax("x", straight_through=True, initial_temperature=0.5), "bernoulli", repeats)
    ratio = gr1.var(0).sum() / stgs.var(0).sum()
    assert 0.9 < ratio < 1.1, ratio  # same distribution of the estimate; measured 0.99
    se = ((gr1.var(0) + stgs.var(0)) / repeats).sqrt()
    assert ((gr1.mean(0) - stgs.mean(0)).abs() <= 4.5 * se).all()


# ---------------------------------------------------------------- samples and errors
@pytest.mark.parametrize("make", [StraightThrough, ReinMax, GumbelRao])
def test_forward_values_are_discrete_samples(make):
    z = make("z", n_samples=500)(OneHotCategorical(logits=THETA))
    values = z._tensor
    assert torch.equal(values.sum(-1), torch.ones(500)) and bool(((values == 0) | (values == 1)).all())
    frequencies = values.mean(0)
    assert (frequencies - THETA.softmax(-1)).abs().max() < 0.08  # sampled from π
    b = make("b", n_samples=500)(Bernoulli(logits=PHI))
    assert b.shape == (500, 3) and bool(((b._tensor == 0) | (b._tensor == 1)).all())


def test_unsupported_distributions_and_options_raise():
    with pytest.raises(ValueError, match="Use OneHotCategorical instead of Categorical"):
        StraightThrough("z")(Categorical(logits=THETA))
    with pytest.raises(ValueError, match="no one-hot view of Normal"):
        ReinMax("z")(Normal(0.0, 1.0))
    with pytest.raises(ValueError, match="temperature must be positive"):
        GumbelRao("z", temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be positive"):
        ReinMax("z", temperature=-1.0)
    with pytest.raises(ValueError, match="n_relaxed must be at least 1"):
        GumbelRao("z", n_relaxed=0)
