"""Generalized stochastic backpropagation (GSB): unbiasedness where the cumulant series terminates or
converges fast, measured truncation bias where it does not, discrete dispatch, errors.

Each unbiasedness test draws R independent gradient estimates in one backward pass
(storch.testing.replicated_gradients) and requires |mean − exact| ≤ 4.5 standard errors per
coordinate. Exact gradients come from closed forms of E f (differentiated with autograd), from
Gauss–Legendre quadrature, or from enumeration (discrete).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Gamma, Laplace, Normal

import storch
from storch.method.gsb import GSB, GeneralizedStochasticBackprop
from storch.testing import assert_unbiased, replicated_gradients

R = 3000


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(4)
    storch.reset()
    yield
    storch.reset()


def exact_grads(expectation, params):
    leaves = [p.detach().clone().requires_grad_() for p in params]
    return torch.autograd.grad(expectation(*leaves), leaves)


def check(model, expectation, params, repeats=R, tiny=1e-6, label=""):
    estimates = replicated_gradients(list(params), repeats, model)
    for est, ex, name in zip(estimates, exact_grads(expectation, params), "abcdef"):
        assert_unbiased(est, ex, tiny=tiny, label=f"{label} param {name}")
    return estimates


T = torch.tensor([1.0, 0.2])


# ---------------------------------------------------------------- terminating series: exact at order 2
@pytest.mark.parametrize("n", [1, 4])
def test_gamma_quadratic(n):
    k, rate = torch.tensor([2.0, 0.7]), torch.tensor([1.5, 3.0])

    def model(k, rate):
        z = GSB("z", n_samples=n, order=2)(Gamma(k, rate))
        storch.add_cost(((z - T) ** 2).sum(-1), "f")

    check(model, lambda k, r: (k / r**2 + (k / r - T) ** 2).sum(), (k, rate), label="gamma")


@pytest.mark.parametrize("order", [2, 4])
def test_laplace_quadratic(order):
    mu, b = torch.tensor([0.3, -0.5]), torch.tensor([0.5, 1.2])

    def model(mu, b):
        z = GSB("z", n_samples=3, order=order)(Laplace(mu, b))
        storch.add_cost(((z - T) ** 2).sum(-1), "f")

    check(model, lambda m, b: (2 * b**2 + (m - T) ** 2).sum(), (mu, b), label="laplace")


def test_normal_cubic():
    mu, sigma = torch.tensor([0.3, -0.5]), torch.tensor([0.8, 1.2])

    def model(mu, sigma):
        z = GeneralizedStochasticBackprop("z", n_samples=2, order=3)(Normal(mu, sigma))
        storch.add_cost(((z - T) ** 3).sum(-1), "f")

    check(model, lambda m, s: ((m - T) ** 3 + 3 * (m - T) * s**2).sum(), (mu, sigma), label="normal")


# ---------------------------------------------------------------- errors
def test_order_must_be_positive():
    with pytest.raises(ValueError, match="order must be an integer"):
        GSB("z", order=0)


def test_non_differentiable_cost_is_an_error():
    mu = torch.tensor([0.3], requires_grad=True)
    z = GSB("zz", n_samples=2)(Normal(mu, 1.0))
    storch.add_cost((z.detach() ** 2).sum(-1), "f")
    with pytest.raises(ValueError, match="'zz'.*LocalExpectation or ScoreFunction"):
        storch.backward()


def test_unsupported_distribution_lists_supported():
    from torch.distributions import Uniform

    with pytest.raises(ValueError, match="Uniform.*Gamma.*Laplace.*Normal"):
        GSB("z")(Uniform(torch.tensor(0.0), torch.tensor(1.0)))


# ---------------------------------------------------------------- a converging series: Gamma, f = exp(−εz)
def test_gamma_exponential_cost_order_8():
    """E e^{−εz} = (1 + ε/β)^{−k}. With x = ε/β, the k-series is Σ (−x)ⁿ/n · M and the β-series
    −(k/β) Σ (−x)ⁿ · M (M = E e^{−εz}); both alternate, so the remainder after N terms is below
    x^{N+1}/(N+1) · M and (k/β) x^{N+1} · M. It must be far below the standard error."""
    k, rate, eps, order = torch.tensor(1.5), torch.tensor(2.0), 0.6, 8
    x = eps / rate.item()
    m = (1 + x) ** -k.item()
    bounds = torch.tensor([x ** (order + 1) / (order + 1) * m, k.item() / rate.item() * x ** (order + 1) * m])

    def model(k, rate):
        z = GSB("z", n_samples=1, order=order)(Gamma(k, rate))
        storch.add_cost(torch.exp(-eps * z), "f")

    gk, gr = replicated_gradients([k, rate], R, model)
    ek, er = exact_grads(lambda k, r: (1 + eps / r) ** -k, (k, rate))
    for est, ex, bound in zip((gk, gr), (ek, er), bounds):
        se = est.std() / R**0.5
        assert bound < se / 50, (bound, se)
        assert_unbiased(est.unsqueeze(-1), ex.reshape(1), tiny=float(bound))


# ---------------------------------------------------------------- plates and nested nodes
DATA = torch.tensor([0.5, 1.0, 3.0])


def test_minibatch_plate_the_node_lacks():
    """One Gamma node shared by a minibatch: the cost has a data plate the node does not have."""
    k, rate = torch.tensor([2.0, 0.7]), torch.tensor([1.5, 3.0])

    def model(k, rate):
        data = storch.denote_independent(DATA.unsqueeze(-1).expand(3, 2), 0, "data")
        z = GSB("z", n_samples=2, order=2)(Gamma(k, rate))
        storch.add_cost(((z - data) ** 2).sum(-1), "f")

    def expectation(k, r):
        return (k / r**2 + (k / r - DATA.unsqueeze(-1)) ** 2).sum(-1).mean()

    check(model, expectation, (k, rate), label="shared node")


def test_minibatch_plate_of_the_node():
    """One Laplace per data point: the node's parameters carry the data plate."""
    mu, b = torch.tensor(0.3), torch.tensor(0.8)

    def model(mu, b):
        data = storch.denote_independent(DATA, 0, "data")
        z = GSB("z", n_samples=2, order=2)(Laplace(mu * data, b))
        storch.add_cost((z - 1.0) ** 2 + z * data, "f")

    def expectation(mu, b):
        m = mu * DATA
        return (2 * b**2 + (m - 1.0) ** 2 + m * DATA).mean()

    check(model, expectation, (mu, b), label="per data point")


def test_nested_gsb_then_reparameterized():
    """z1 ~ N(μ, σ) by GSB, z2 ~ N(z1, s) by reparameterization: ∂ⁿS/∂z1ⁿ is unbiased for all n."""
    from storch.method import Reparameterization

    mu, sigma, s, t = torch.tensor(0.4), torch.tensor(0.7), torch.tensor(1.3), 0.9

    def model(mu, sigma, s):
        z1 = GSB("z1", n_samples=2, order=2)(Normal(mu, sigma))
        z2 = Reparameterization("z2", n_samples=2)(Normal(z1, s))
        storch.add_cost((z2 - t) ** 2 + 0.5 * z1**2, "f")

    def expectation(mu, sigma, s):
        return s**2 + sigma**2 + (mu - t) ** 2 + 0.5 * (sigma**2 + mu**2)

    check(model, expectation, (mu, sigma, s), label="nested GSB/reparameterized")


def test_nested_gsb_then_gsb_is_first_order_in_the_outer_node():
    """z2 ~ N(z1, s) by GSB as well: z2's term is first order in its parameters, so ∂²S/∂z1² misses the
    path through z2 (the documented limit). ∇μ (κ₁) and ∇s (z2's own κ₂) stay unbiased; ∇σ, which
    needs ∂²/∂z1² E[f | z1] = 2 + 1, gets only the direct part 1: its expectation is σ, not 3σ."""
    mu, sigma, s, t = torch.tensor(0.4), torch.tensor(0.7), torch.tensor(1.3), 0.9

    def model(mu, sigma, s):
        z1 = GSB("z1", n_samples=2, order=2)(Normal(mu, sigma))
        z2 = GSB("z2", n_samples=2, order=2)(Normal(z1, s))
        storch.add_cost((z2 - t) ** 2 + 0.5 * z1**2, "f")

    g_mu, g_sigma, g_s = replicated_gradients([mu, sigma, s], R, model)
    e_mu, e_sigma, e_s = exact_grads(
        lambda mu, sigma, s: s**2 + sigma**2 + (mu - t) ** 2 + 0.5 * (sigma**2 + mu**2), (mu, sigma, s)
    )
    assert_unbiased(g_mu.unsqueeze(-1), e_mu.reshape(1), label="mu")
    assert_unbiased(g_s.unsqueeze(-1), e_s.reshape(1), label="s")
    assert torch.isclose(e_sigma, 3 * sigma)
    assert_unbiased(g_sigma.unsqueeze(-1), sigma.reshape(1), label="sigma (documented bias)")


def test_dirac_is_backpropagation_and_no_grad_is_left_on_samples():
    from storch.distributions import Dirac

    a = torch.tensor([0.3, -1.2], requires_grad=True)
    z = GSB("z", n_samples=3, order=4)(Dirac(a))
    storch.add_cost(torch.sin(z).sum(-1), "f")
    storch.backward()
    torch.testing.assert_close(a.grad, torch.cos(a.detach()))
    assert z._node.samples._gsb_leaf.grad is None  # the hidden leaf keeps no gradient
    assert not z.is_leaf and z.grad_fn is not None


# ---------------------------------------------------------------- discrete distributions
def test_bernoulli_dispatches_to_local_expectation():
    """Same seed, same points, same surrogate: GSB's gradient equals LocalExpectation's, and it is
    unbiased against enumeration."""
    from torch.distributions import Bernoulli

    from storch.method.local_expectation import LocalExpectation

    logits0 = torch.tensor([0.3, -0.5, 1.0])
    target = torch.tensor([0.49, 0.499, 0.8])

    def run(method_cls, **kw):
        torch.manual_seed(11)
        logits = logits0.clone().requires_grad_()
        x = method_cls("x", n_samples=3, **kw)(Bernoulli(logits=logits))
        storch.add_cost(((x - target) ** 2).sum(-1) + 2.0 * x[..., 0] * x[..., 1], "f")
        storch.backward()
        return x.n, logits.grad

    n_gsb, g_gsb = run(GSB, order=3)
    n_le, g_le = run(LocalExpectation)
    assert n_gsb == n_le == 3 * (1 + 3 * 2)
    torch.testing.assert_close(g_gsb, g_le)

    def model(logits):
        x = GSB("x", n_samples=1)(Bernoulli(logits=logits))
        storch.add_cost(((x - target) ** 2).sum(-1) + 2.0 * x[..., 0] * x[..., 1], "f")

    def expectation(logits):
        import itertools

        p, total = torch.sigmoid(logits), 0.0
        for x in itertools.product([0.0, 1.0], repeat=3):
            x = torch.tensor(x)
            total = total + (p * x + (1 - p) * (1 - x)).prod() * (((x - target) ** 2).sum() + 2.0 * x[0] * x[1])
        return total

    check(model, expectation, (logits0,), repeats=1000, label="bernoulli")


def test_one_hot_categorical_unbiased():
    from torch.distributions import OneHotCategorical

    logits0 = torch.tensor([[0.2, -0.4, 0.9], [0.0, 0.5, -1.0]])
    values = torch.tensor([1.0, -2.0, 0.5])

    def cost(x):
        v = (x * values).sum(-1)
        return v[..., 0] * v[..., 1] + v[..., 0] ** 2

    def model(logits):
        x = GSB("x", n_samples=1)(OneHotCategorical(logits=logits))
        storch.add_cost(cost(x), "f")

    def expectation(logits):
        p = torch.softmax(logits, -1)
        eye = torch.eye(3)
        return sum(p[0, i] * p[1, j] * cost(torch.stack([eye[i], eye[j]])) for i in range(3) for j in range(3))

    check(model, expectation, (logits0,), repeats=1000, label="one-hot categorical")


def test_poisson_finite_differences_unbiased():
    from torch.distributions import Poisson

    rate0, t = torch.tensor([1.5, 0.4]), torch.tensor([1.0, 2.0])

    def model(rate):
        z = GSB("z", n_samples=2, order=4)(Poisson(rate))
        assert z.n == 2 * (1 + 2)  # the sample and one +1 point per coordinate
        storch.add_cost(((z - t) ** 2 + torch.exp(-0.3 * z)).sum(-1), "f")

    def expectation(rate):
        return (rate + (rate - t) ** 2 + torch.exp(rate * (math.exp(-0.3) - 1))).sum()

    check(model, expectation, (rate0,), label="poisson")
