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
