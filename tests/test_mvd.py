"""Measure-valued derivatives (storch.method.mvd, registry storch.distributions.measure_valued).

Unbiasedness against exact gradients: enumeration for the discrete distributions, closed forms for
Normal (E e^x = e^{μ+σ²/2}, E x² = μ² + σ²), Poisson (E x = λ, E x² = λ + λ², E e^{−sx} =
e^{λ(e^{−s} − 1)}) and Exponential (E x² = 2/λ², E e^{−x} = λ/(λ + 1)). MVD is unbiased for
first-order gradients only (its gradient enters through (θ − stopgrad θ)·stopgrad(ĝ)), so there are
no second-order checks.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Exponential, Gamma, Normal, OneHotCategorical, Poisson

import storch
from storch.method import Expect, Reparameterization, ScoreFunction
from storch.distributions.measure_valued import MeasureValuedDecomposition, MeasureValuedParameter, register_measure_valued
from storch.method.mvd import MVD
from storch.testing import assert_unbiased, replicated_gradients, variance_with_stderr

from problems import bernoulli, exact_grads, minibatch_bernoulli, nested_categorical

R = 3000


def check(make_distribution, cost, expectation, params, n=1, repeats=R, label=""):
    method = MVD("x", n_samples=n)

    def model(*views):
        storch.add_cost(cost(method(make_distribution(*views))), "f")

    grads = replicated_gradients(params, repeats, model)
    for g, e, i in zip(grads, exact_grads(expectation, params), itertools.count()):
        assert_unbiased(g, e, label=f"{label} parameter {i}")


# --------------------------------------------------------------------- one node, continuous
MU = torch.tensor([0.3, -0.5])
LOG_SIGMA = torch.tensor([-0.2, 0.1])


def normal_cost(x):
    return x[..., 0].exp() * x[..., 1] ** 2


def normal_expectation(mu, log_sigma):
    sigma = log_sigma.exp()
    return torch.exp(mu[0] + sigma[0] ** 2 / 2) * (mu[1] ** 2 + sigma[1] ** 2)


@pytest.mark.parametrize("n", [1, 3], ids=["n1", "n3"])
def test_normal_mean_and_scale(n):
    check(lambda mu, ls: Normal(mu, ls.exp()), normal_cost, normal_expectation, [MU, LOG_SIGMA], n=n, label="normal")


def test_normal_mean_only_with_a_fixed_scale():
    sigma = LOG_SIGMA.exp()
    check(lambda mu: Normal(mu, sigma), normal_cost, lambda mu: normal_expectation(mu, LOG_SIGMA), [MU], label="mean")


def test_normal_scale_only():
    # σ as a leaf: ∂/∂σ E f with the Maxwell points coupled to the real sample's noise
    check(lambda s: Normal(MU, s), normal_cost, lambda s: normal_expectation(MU, s.log()), [LOG_SIGMA.exp()], label="scale")


RATE = torch.tensor([0.7, 1.5])


def test_poisson():
    check(
        Poisson,
        lambda x: x[..., 0] * x[..., 1] ** 2 + torch.exp(-0.5 * x[..., 0]),
        lambda lam: lam[0] * (lam[1] + lam[1] ** 2) + torch.exp(lam[0] * (math.exp(-0.5) - 1)),
        [RATE],
        label="poisson",
    )


def test_exponential():
    check(
        Exponential,
        lambda x: x[..., 0] ** 2 * x[..., 1] + torch.exp(-x[..., 1]),
        lambda lam: 2 / lam[0] ** 2 / lam[1] + lam[1] / (lam[1] + 1),
        [RATE],
        label="exponential",
    )


# ----------------------------------------------------------------------- one node, discrete
BERNOULLI = bernoulli(interaction=2.0)


@pytest.mark.parametrize("built_from", ["logits", "probs"])
def test_bernoulli(built_from):
    make = (lambda phi: Bernoulli(logits=phi)) if built_from == "logits" else (lambda phi: Bernoulli(probs=torch.sigmoid(phi)))
    check(make, BERNOULLI.cost, BERNOULLI.expectation, [BERNOULLI.phi], n=2, label=built_from)


THETA = torch.tensor([[0.2, -0.4, 0.9], [0.0, 0.5, -1.0]])  # two categorical coordinates, K = 3
VALUES = torch.tensor([1.0, -2.0, 0.5])


def categorical_expectation(theta):
    p = theta.softmax(-1)
    return sum(p[0, a] * p[1, b] * (VALUES[a] + 2 * VALUES[b]) ** 2 for a, b in itertools.product(range(3), repeat=2))


def one_hot_cost(x):
    v = (x * VALUES).sum(-1)
    return (v[..., 0] + 2 * v[..., 1]) ** 2


@pytest.mark.parametrize("kind", ["categorical", "one_hot_logits", "one_hot_probs"])
def test_categorical(kind):
    make = {
        "categorical": lambda t: Categorical(logits=t),
        "one_hot_logits": lambda t: OneHotCategorical(logits=t),
        "one_hot_probs": lambda t: OneHotCategorical(probs=t.exp()),  # unnormalised probs
    }[kind]
    cost = {"categorical": lambda x: one_hot_cost(torch.nn.functional.one_hot(x, 3).float())}.get(kind, one_hot_cost)
    check(make, cost, categorical_expectation, [THETA], label=kind)


# ----------------------------------------------------------------------- minibatch plate
MINIBATCH = minibatch_bernoulli(interaction=1.0)  # f = Σ (z − t)² + z₁z₂ per data point
X, W, T = MINIBATCH.x, MINIBATCH.w, MINIBATCH.t


def test_bernoulli_under_minibatch_plate():
    def two_points_per_sample(z):
        assert z.shape[0] == 2 * (1 + 2)  # per sample: x and one flipped point per coordinate

    (grads,) = replicated_gradients([W], R, MINIBATCH.model(MVD("z", n_samples=2), check=two_points_per_sample))
    assert_unbiased(grads, MINIBATCH.exact(), label="minibatch")


def test_normal_under_minibatch_plate():
    # x ~ N(X W, σ), f = Σ (x − t)² + x₀x₁: E f = Σ (μ − t)² + 2σ² + μ₀μ₁ per data point
    method = MVD("z")

    def model(w, log_sigma):
        x = storch.denote_independent(X, 0, "data")
        t = storch.denote_independent(T, 0, "data")
        z = method(Normal((x.unsqueeze(-1) * w).sum(-2), log_sigma.exp()))
        storch.add_cost(((z - t) ** 2).sum(-1) + z[..., 0] * z[..., 1], "f")

    def expectation(w, log_sigma):
        mu = X @ w
        return (((mu - T) ** 2).sum(-1) + 2 * log_sigma.exp() ** 2 + mu[:, 0] * mu[:, 1]).mean()

    g_w, g_s = replicated_gradients([W, torch.tensor(-0.3)], R, model)
    e_w, e_s = exact_grads(expectation, [W, torch.tensor(-0.3)])
    assert_unbiased(g_w, e_w, label="W")
    assert_unbiased(g_s.unsqueeze(-1), e_s.unsqueeze(-1), label="log sigma")


# ---------------------------------------------------------------------- two nested nodes
NESTED_PROBLEM = nested_categorical(3, 3)

NESTED = {
    "mvd_mvd": (lambda: MVD("z1", n_samples=2), lambda: MVD("z2")),
    "mvd_then_sf": (lambda: MVD("z1"), lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average")),
    "sf_then_mvd": (lambda: ScoreFunction("z1", n_samples=2, baseline_factory="batch_average"), lambda: MVD("z2")),
    "mvd_then_expect": (lambda: MVD("z1"), lambda: Expect("z2")),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_two_nested_categorical_nodes(name):
    m1, m2 = (f() for f in NESTED[name])
    NESTED_PROBLEM.assert_unbiased(NESTED_PROBLEM.model(m1, m2), R, label=name)


@pytest.mark.parametrize("child", ["mvd", "reparameterization"])
def test_two_nested_normal_nodes(child):
    # x1 ~ N(μ, σ1), x2 ~ N(a·x1, σ2), f = x2² + x1: E f = a²(μ² + σ1²) + σ2² + μ
    a = 0.7
    m1 = MVD("x1")
    m2 = MVD("x2") if child == "mvd" else Reparameterization("x2")

    def model(mu, log_s1, log_s2):
        x1 = m1(Normal(mu, log_s1.exp()))
        x2 = m2(Normal(a * x1, log_s2.exp()))
        storch.add_cost(x2**2 + x1, "f")

    params = [torch.tensor(0.4), torch.tensor(-0.2), torch.tensor(0.3)]
    grads = replicated_gradients(params, R, model)
    exact = exact_grads(lambda mu, s1, s2: a**2 * (mu**2 + s1.exp() ** 2) + s2.exp() ** 2 + mu, params)
    assert_unbiased(torch.stack(grads, 1), torch.stack(exact), label=f"mvd then {child}")


# ----------------------------------------------------------------------------- layout
def test_group_layout_and_weights():
    mu = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)  # coordinates C = (1, 3)
    x = MVD("x", n_samples=4)(Normal(mu, torch.ones(1, 3, requires_grad=True)))
    m = 1 + 2 * 3 + 1 * 3  # real sample, 2 mean points and 1 scale point per coordinate
    assert x.shape == (4 * m, 1, 3)
    groups = x._tensor.reshape(4, m, 3)
    real, points = groups[:, :1], groups[:, 1:]
    differs = points != real
    # every extra point differs from its real sample in exactly its own coordinate d (row-major)
    assert (differs.sum(-1) == 1).all()
    assert (differs.float().argmax(-1) == torch.arange(3).repeat(3)).all()
    weights = x.plate.weight._tensor.reshape(4, m)
    assert torch.equal(weights[:, 0], torch.full((4,), 0.25)) and (weights[:, 1:] == 0).all()


def test_only_parameters_that_require_grad_get_points():
    mu = torch.zeros(2, requires_grad=True)
    assert MVD("x")(Normal(mu, 1.0)).shape[0] == 1 + 2 * 2
    assert MVD("y")(Normal(torch.zeros(2), torch.ones(2, requires_grad=True))).shape[0] == 1 + 2
    assert MVD("c")(Categorical(logits=torch.zeros(2, 4, requires_grad=True))).shape[0] == 1 + 3 * 2
    x = MVD("z", n_samples=3)(Normal(torch.zeros(2), 1.0))  # nothing to differentiate: plain samples
    assert x.shape[0] == 3 and torch.equal(x.plate.weight._tensor, torch.full((3,), 1 / 3))


def test_forward_value_is_the_cost_at_the_real_samples():
    mu = torch.tensor([0.2, -0.1], requires_grad=True)
    x = MVD("x", n_samples=5)(Normal(mu, 1.0))
    c = (x**2).sum(-1)
    storch.add_cost(c, "f")
    real = c._tensor.reshape(5, 5)[:, 0]
    assert torch.allclose(storch.backward(), real.mean())


def test_scale_points_are_coupled_to_the_real_sample():
    # the Maxwell point of coordinate d shares the sign of x_d − μ_d and lies further out
    sigma = torch.tensor([0.5, 2.0], requires_grad=True)
    mu = torch.tensor([1.0, -1.0])
    x = MVD("x", n_samples=200)(Normal(mu, sigma))._tensor.reshape(200, 3, 2)
    real, points = x[:, 0], x[:, 1:]
    for d in range(2):
        eps, eps_point = real[:, d] - mu[d], points[:, d, d] - mu[d]
        assert (torch.sign(eps) == torch.sign(eps_point)).all()
        assert (eps_point.abs() >= eps.abs()).all()


# ------------------------------------------------------------------ registry and variance
class _TestNormal(Normal):
    """A Normal subclass for registering another decomposition in one place."""


def _independent_rayleigh_points(params, x):
    mu, sigma = params["loc"], params["scale"]
    w = torch.sqrt(-2.0 * torch.log(torch.rand((2,) + x.shape).clamp_min(1e-30)))
    return torch.stack([mu + sigma * w[0], mu - sigma * w[1]], 1)


def _mean_gradient(params, x, f_x, f_points):
    return (f_points[0] - f_points[1]) / (params["scale"] * math.sqrt(2 * math.pi))


# the mean's points without common random numbers, registered for a new type in one place
register_measure_valued(
    _TestNormal,
    MeasureValuedDecomposition(
        lambda d: {"loc": d.loc, "scale": d.scale},
        {"loc": MeasureValuedParameter(_independent_rayleigh_points, _mean_gradient)},
    ),
)


def _mean_gradient_variances(cost, expectation):
    variances = {}
    for name, dist in (("coupled", Normal), ("independent", _TestNormal)):
        method = MVD("x")

        def model(mu, method=method, dist=dist):
            storch.add_cost(cost(method(dist(mu, LOG_SIGMA.exp()))), "f")

        (grads,) = replicated_gradients([MU], 4000, model)
        assert_unbiased(grads, exact_grads(lambda mu: expectation(mu, LOG_SIGMA), [MU])[0], label=name)
        variances[name] = [variance_with_stderr(grads[:, d]) for d in range(2)]
    return variances


RAYLEIGH_VARIANCE = (4 - math.pi) / 2


def test_common_random_numbers_cut_the_variance_of_the_mean_gradient_for_even_costs():
    # f(μ + σW) − f(μ − σW) with one W cancels the part of f that is even around μ. For
    # f = Σ (x − t)² the coupled estimate is 4W(μ − t)/√(2π), variance 16(μ − t)² Var W/(2π)
    # (0.011 for |μ − t| = 0.1); with independent W it is 0.87 and 1.5 (measured).
    target = MU - torch.tensor([0.1, -0.1])
    variances = _mean_gradient_variances(
        lambda x: ((x - target) ** 2).sum(-1),
        lambda mu, ls: ((mu - target) ** 2).sum() + (ls.exp() ** 2).sum(),
    )
    exact = 16 * 0.1**2 * RAYLEIGH_VARIANCE / (2 * math.pi)
    for (v_c, se_c), (v_i, se_i) in zip(variances["coupled"], variances["independent"]):
        assert abs(v_c - exact) <= 4.5 * se_c, variances
        assert v_c * 10 < v_i, variances


def test_common_random_numbers_double_the_variance_for_linear_costs():
    # the known limit: for f increasing in x_d the two points are anti-correlated under one W. For
    # linear f = Σ x the coupled estimate is 2W/√(2π) (variance (4 − π)/π = 0.273), the independent
    # one (W₁ + W₂)/√(2π) (variance (4 − π)/(2π) = 0.137): twice, the most coupling can cost,
    # since Var(A − B) ≤ 2(Var A + Var B). For e^{x₀} x₁² the two are close (31.0 against 29.1
    # for coordinate 0, from 2·10⁷ plain draws).
    variances = _mean_gradient_variances(lambda x: x.sum(-1), lambda mu, ls: mu.sum())
    for name, exact in (("coupled", 2 * RAYLEIGH_VARIANCE / math.pi), ("independent", RAYLEIGH_VARIANCE / math.pi)):
        for v, se in variances[name]:
            assert abs(v - exact) <= 4.5 * se, (name, variances)


def test_unsupported_distribution_is_refused():
    with pytest.raises(ValueError, match=r"MVD\('x'\) has no measure-valued decomposition for Gamma.*register_measure_valued"):
        MVD("x")(Gamma(torch.ones(2), 1.0))
