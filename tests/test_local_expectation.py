"""LocalExpectation (IndeCateR): unbiased first and second derivatives against exact enumeration.

Each test draws R independent estimates in one backward pass (storch.testing.replicate) and requires
|mean − exact| ≤ 4.5 standard errors per coordinate; exact values come from enumerating the discrete
problem and differentiating Σ_x p(x) f(x) with autograd.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Independent, Normal, OneHotCategorical

import storch
from storch.method import Expect, ScoreFunction
from storch.method.local_expectation import (
    IndeCateR,
    LocalExpectation,
    local_expectation_group_size,
    local_expectation_points,
)
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from problems import minibatch_bernoulli, nested_categorical, one_categorical, replicated_hessians

pytestmark = pytest.mark.seed(2024)

R = 3000


# ---------------------------------------------------------------- factorised Bernoulli, interacting cost
PHI = torch.tensor([0.3, -0.5, 1.0])
TARGET = torch.tensor([0.49, 0.499, 0.8])


def bernoulli_cost(x, phi=None):
    cost = ((x - TARGET) ** 2).sum(-1) + 2.0 * x[..., 0] * x[..., 1] - 1.5 * x[..., 1] * x[..., 2]
    if phi is not None:  # a cost that also depends on the parameters directly
        cost = cost + (x * phi).sum(-1) ** 2
    return cost


def bernoulli_expectation(phi, direct=False):
    p = torch.sigmoid(phi)
    total = 0.0
    for x in itertools.product([0.0, 1.0], repeat=3):
        x = torch.tensor(x)
        total = total + (p * x + (1 - p) * (1 - x)).prod() * bernoulli_cost(x, phi if direct else None)
    return total


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("direct", [False, True], ids=["f(x)", "f(x,phi)"])
def test_one_bernoulli_node(n, direct):
    method = LocalExpectation("x", n_samples=n)

    def model(phi):
        x = method(Bernoulli(logits=phi))
        assert x.n == n * (1 + 3 * 1)  # the sample and its 3 flips
        storch.add_cost(bernoulli_cost(x, phi if direct else None), "f")

    (grads,) = replicated_gradients([PHI], R, model)
    exact = torch.autograd.functional.jacobian(lambda p: bernoulli_expectation(p, direct), PHI)
    assert_unbiased(grads, exact, label=f"n={n}")


@pytest.mark.parametrize("direct", [False, True], ids=["f(x)", "f(x,phi)"])
def test_bernoulli_hessian_unbiased(direct):
    method = LocalExpectation("x")

    def model(phi):
        x = method(Bernoulli(logits=phi))
        storch.add_cost(bernoulli_cost(x, phi if direct else None), "f")

    hessians = replicated_hessians(PHI, 4000, model)
    exact = torch.autograd.functional.hessian(lambda p: bernoulli_expectation(p, direct), PHI)
    assert_unbiased(hessians, exact.reshape(-1), label="hessian")


# ---------------------------------------------------------------- two categorical coordinates, K = 3
THETA = torch.tensor([[0.2, -0.4, 0.9], [0.5, 0.0, -1.0]])


def categorical_cost(i0, i1):
    """An interacting cost of the two coordinates' indices."""
    return (i0 - 1.3) ** 2 * (i1 + 0.5) + 0.7 * i0 * i1 - i1


def categorical_expectation(theta):
    p = theta.softmax(-1)
    return sum(p[0, a] * p[1, b] * categorical_cost(torch.tensor(float(a)), torch.tensor(float(b)))
               for a in range(3) for b in range(3))


def indices(z, one_hot):
    if one_hot:
        return (z * torch.arange(3.0)).sum(-1)
    return z.to(torch.get_default_dtype())


@pytest.mark.parametrize("dist", [Categorical, OneHotCategorical])
def test_categorical_coordinates(dist):
    one_hot = dist is OneHotCategorical
    method = IndeCateR("z", n_samples=2)

    def model(theta):
        z = method(dist(logits=theta))
        i = indices(z, one_hot)
        storch.add_cost(categorical_cost(i[..., 0], i[..., 1]), "f")

    (grads,) = replicated_gradients([THETA], R, model)
    exact = torch.autograd.functional.jacobian(categorical_expectation, THETA)
    assert_unbiased(grads.reshape(R, -1), exact.reshape(-1), label=dist.__name__)


def test_categorical_hessian_unbiased():
    method = LocalExpectation("z")

    def model(theta):
        z = method(OneHotCategorical(logits=theta))
        i = indices(z, True)
        storch.add_cost(categorical_cost(i[..., 0], i[..., 1]), "f")

    hessians = replicated_hessians(THETA, 4000, model)
    exact = torch.autograd.functional.hessian(categorical_expectation, THETA)
    assert_unbiased(hessians, exact.reshape(-1), label="categorical hessian")


def test_one_variable_is_exact():
    """With D = 1 the sum over the values is the whole expectation: every estimate is exact."""
    problem = one_categorical(4)
    (grads,) = replicated_gradients([problem.theta], 20, problem.model(LocalExpectation("z")))
    assert torch.allclose(grads, problem.exact().expand(20, 4), atol=1e-5)


# ---------------------------------------------------------------- two nested nodes
NESTED_PROBLEM = nested_categorical(3, 3)


NESTED = {
    "le_le": (lambda: LocalExpectation("z1"), lambda: LocalExpectation("z2")),
    "le_le_nested": (lambda: LocalExpectation("z1"), lambda: LocalExpectation("z2", joint=False)),
    "le_le_n2": (lambda: LocalExpectation("z1", n_samples=2), lambda: LocalExpectation("z2")),
    "le_then_sf": (lambda: LocalExpectation("z1"), lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average")),
    "sf_then_le": (lambda: ScoreFunction("z1", n_samples=2, baseline_factory="batch_average"), lambda: LocalExpectation("z2")),
    "expect_then_le": (lambda: Expect("z1"), lambda: LocalExpectation("z2", n_samples=2)),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_two_nested_nodes(name):
    m1, m2 = (f() for f in NESTED[name])
    NESTED_PROBLEM.assert_unbiased(NESTED_PROBLEM.model(m1, m2), R, label=name)


# ---------------------------------------------------------------- two independent nodes feeding one cost
def test_two_independent_nodes_one_cost():
    phi0 = torch.tensor([0.4, -0.8])
    theta0 = torch.tensor([0.1, 0.6, -0.3])
    weights = torch.tensor([1.0, -2.0, 0.5])

    def cost(b, z):
        return (b[..., 0] - 2 * b[..., 1] + (z * weights).sum(-1)) ** 2

    def model(phi, theta):
        b = LocalExpectation("b")(Bernoulli(logits=phi))
        z = LocalExpectation("z", n_samples=2)(OneHotCategorical(logits=theta))
        storch.add_cost(cost(b, z), "f")

    gb, gz = replicated_gradients([phi0, theta0], R, model)

    def expectation(phi, theta):
        p, q = torch.sigmoid(phi), theta.softmax(-1)
        total = 0.0
        for bits in itertools.product([0.0, 1.0], repeat=2):
            b = torch.tensor(bits)
            for k in range(3):
                pb = (p * b + (1 - p) * (1 - b)).prod()
                total = total + pb * q[k] * cost(b, torch.eye(3)[k])
        return total

    eb, ez = torch.autograd.functional.jacobian(expectation, (phi0, theta0))
    assert_unbiased(gb, eb, label="bernoulli")
    assert_unbiased(gz, ez, label="categorical")


# ---------------------------------------------------------------- Bernoulli under a minibatch plate
def test_bernoulli_under_minibatch_plate():
    problem = minibatch_bernoulli(interaction=3.0)  # f = Σ (z − t)² + 3 z₁z₂ per data point
    (grads,) = replicated_gradients([problem.w], R, problem.model(LocalExpectation("z")))
    assert_unbiased(grads.reshape(R, -1), problem.exact().reshape(-1), label="minibatch")


# ---------------------------------------------------------------- layout, estimate, variance, errors
def test_points_layout_and_forward_estimate():
    distr = OneHotCategorical(logits=torch.randn(2, 3))
    points = local_expectation_points(distr, 4)
    assert points.shape == (4, 1 + 2 * 2, 2, 3)
    assert local_expectation_group_size(distr) == 5
    eye = torch.eye(3)
    for j in range(4):
        sample = points[j, 0]
        for d in range(2):
            others = [k for k in range(3) if not torch.equal(sample[d], eye[k])]
            for i, k in enumerate(others):  # every value but the sample's own, in order
                expected = sample.clone()
                expected[d] = eye[k]
                assert torch.equal(points[j, 1 + 2 * d + i], expected)

    # the estimate of E f is the mean of f over the samples; the other points weigh 0
    logits = torch.tensor([0.3, -0.5, 1.0], requires_grad=True)
    x = LocalExpectation("x", n_samples=5)(Bernoulli(logits=logits))
    cost = bernoulli_cost(x)
    storch.add_cost(cost, "f")
    estimate = storch.backward()
    assert torch.allclose(estimate, cost._tensor.reshape(5, 4)[:, 0].mean())


PHI8 = torch.linspace(-1.0, 1.0, 8)
TARGET8 = torch.linspace(0.2, 0.8, 8)


def eight_bit_cost(x, interaction):
    return ((x - TARGET8) ** 2).sum(-1) + interaction * x[..., 0] * x[..., 1]


def test_additive_cost_is_exact_and_weak_interaction_beats_rloo():
    """Each coordinate's sum is exact, so only interactions between coordinates add variance."""

    def run(method, interaction, repeats=R):
        def model(phi):
            storch.add_cost(eight_bit_cost(method(Bernoulli(logits=phi)), interaction), "f")

        (grads,) = replicated_gradients([PHI8], repeats, model)
        return grads

    def exact(interaction):
        phi = PHI8.clone().requires_grad_()
        p = torch.sigmoid(phi)
        expectation = (p * (1 - TARGET8) ** 2 + (1 - p) * TARGET8**2).sum() + interaction * p[0] * p[1]
        return torch.autograd.grad(expectation, phi)[0]

    additive = run(LocalExpectation("x"), 0.0, repeats=20)
    assert torch.allclose(additive, exact(0.0).expand(20, 8), atol=1e-5)

    # 1 + D·(K−1) = 9 cost evaluations each, against the RLOO score function with 17 samples
    le = run(LocalExpectation("x"), 0.5)
    sf = run(ScoreFunction("x", n_samples=17, baseline_factory="batch_average"), 0.5)
    assert_unbiased(le, exact(0.5), label="weak interaction")
    assert check_unbiased(sf, exact(0.5)).passed
    assert le.var(0).sum() < sf.var(0).sum() / 3, (le.var(0).sum(), sf.var(0).sum())


def test_unsupported_distributions_raise():
    with pytest.raises(ValueError, match="no coordinates are registered for Normal"):
        LocalExpectation("x")(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match="Pass the base distribution"):
        LocalExpectation("x")(Independent(Bernoulli(logits=torch.zeros(2)), 1))
