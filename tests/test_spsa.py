"""SPSA (storch.method.spsa): a biased estimator; its bias is measured and its known limits tested.

For F(u) = E_{p(u)} f in the unconstrained parameters u that SPSA perturbs, the expected estimate is
the *smoothed* gradient S_c(u) = E_Δ[(F(u + cΔ) − F(u − cΔ)) Δ / (2c)], which we compute exactly by
enumerating the 2^k sign vectors Δ (F in closed form or by enumeration). The tests check that

* the estimates are unbiased for S_c (so the implementation is right, on several graph shapes);
* the bias S_c − ∇F is O(c²): it shrinks with c, and is detectable at large c;
* SPSA is exact when F is quadratic in the perturbed parameters (e.g. a location with a quadratic
  cost), so in that case the estimates are unbiased for the true gradient.

SPSA is first order only (its gradient enters through (u − stopgrad u)·stopgrad(ĝ)).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Bernoulli, Binomial, Distribution, Exponential, Gamma, Normal, OneHotCategorical, constraints

import storch
from storch.method import Expect, ScoreFunction
from storch.method.spsa import SPSA, perturbable_parameters
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from problems import bernoulli, enumerate_bernoulli, minibatch_bernoulli, nested_bernoulli

R = 4000


def smoothed_gradient(F, u, c):
    """E_Δ[(F(u + cΔ) − F(u − cΔ)) Δ / (2c)] over all sign vectors Δ, for a flat vector u."""
    total = torch.zeros_like(u, dtype=torch.float64)
    signs = list(itertools.product([-1.0, 1.0], repeat=u.numel()))
    for s in signs:
        delta = torch.tensor(s, dtype=torch.float64)
        total += (F(u.double() + c * delta) - F(u.double() - c * delta)) * delta / (2 * c)
    return total / len(signs)


def exact_gradient(F, u):
    leaf = u.double().clone().requires_grad_()
    return torch.autograd.grad(F(leaf), leaf)[0]


# --------------------------------------------------------------- Normal: loc and log-scale
MU = torch.tensor([0.3, -0.5])
LOG_SIGMA = torch.tensor([-0.2, 0.1])
THETA = torch.cat([MU, LOG_SIGMA])  # SPSA perturbs (loc, log scale)


def normal_F(u):  # E e^{x₀} x₁²
    mu, sigma = u[:2], u[2:].exp()
    return torch.exp(mu[0] + sigma[0] ** 2 / 2) * (mu[1] ** 2 + sigma[1] ** 2)


def normal_estimates(c, repeats=R, n=1):
    method = SPSA("x", n_samples=n, c=c)

    def model(mu, log_sigma):
        x = method(Normal(mu, log_sigma.exp()))
        storch.add_cost(x[..., 0].exp() * x[..., 1] ** 2, "f")

    return torch.cat(replicated_gradients([MU, LOG_SIGMA], repeats, model), 1)


# exact bias S_c − ∇F per coordinate (μ₀, μ₁, log σ₀, log σ₁), from enumerating Δ:
#   c = 0.5:  ( 3.29, −0.87, 3.06, 3.29)     (the gradient is (2.78, −1.89, 1.86, 4.61))
#   c = 0.2:  ( 0.40, −0.11, 0.34, 0.40)
#   c = 0.05: ( 0.024, −0.0066, 0.020, 0.024)
#   c = 0.01: ( 0.00094, −0.00026, 0.00079, 0.00095)
# i.e. O(c²): it falls by (0.2/0.5)² ≈ 0.16 and (0.05/0.2)² ≈ 0.06, a little less at large c.
@pytest.mark.parametrize("c", [0.5, 0.2, 0.05])
def test_normal_estimates_are_unbiased_for_the_smoothed_gradient(c):
    estimates = normal_estimates(c, repeats=8000)
    assert_unbiased(estimates, smoothed_gradient(normal_F, THETA, c), label=f"c={c}")


def test_normal_bias_is_order_c_squared():
    exact = exact_gradient(normal_F, THETA)
    bias = {c: (smoothed_gradient(normal_F, THETA, c) - exact).abs() for c in (0.5, 0.2, 0.05, 0.01)}
    for big, small in ((0.5, 0.2), (0.2, 0.05), (0.05, 0.01)):
        ratio = bias[small] / bias[big]
        assert (ratio < (small / big) ** 2 * 1.05).all() and (ratio > (small / big) ** 2 * 0.5).all(), (big, small, ratio)
    assert bias[0.5].max() > 3.0 and bias[0.01].max() < 0.001


def test_normal_bias_is_detected_at_large_c_and_not_at_small_c():
    exact = exact_gradient(normal_F, THETA)
    assert not check_unbiased(normal_estimates(0.5, repeats=8000), exact).passed
    # at c = 0.01 the bias (< 0.001) is far below the standard error: unbiased within sampling error
    assert_unbiased(normal_estimates(0.01, repeats=8000), exact, label="c=0.01")


def test_normal_several_samples_average_the_groups():
    estimates = normal_estimates(0.2, repeats=R, n=4)
    assert_unbiased(estimates, smoothed_gradient(normal_F, THETA, 0.2), label="n=4")
    assert estimates.var(0).max() < normal_estimates(0.2, repeats=R, n=1).var(0).max() / 2


# ------------------------------------------------------------- Bernoulli: perturbed logits
BERNOULLI = bernoulli(interaction=2.0)
PHI, bernoulli_cost = BERNOULLI.phi, BERNOULLI.cost


def bernoulli_F(phi):  # in float64 (the costs of the 8 values in float32, as the model's)
    return enumerate_bernoulli(torch.sigmoid(phi), lambda x: bernoulli_cost(x.float()).double())


@pytest.mark.parametrize("c", [0.5, 0.1])
@pytest.mark.parametrize("built_from", ["logits", "probs"])
def test_bernoulli(c, built_from):
    method = SPSA("x", n_samples=2, c=c)
    make = (lambda p: Bernoulli(logits=p)) if built_from == "logits" else (lambda p: Bernoulli(probs=p))
    param = PHI if built_from == "logits" else torch.sigmoid(PHI)

    def model(p):
        storch.add_cost(bernoulli_cost(method(make(p))), "f")

    (estimates,) = replicated_gradients([param], R, model)
    smoothed = smoothed_gradient(bernoulli_F, PHI, c)  # in logit space, chained to probs below
    if built_from == "probs":
        p = param.double().clone().requires_grad_()
        smoothed = torch.autograd.grad((torch.logit(p) * smoothed).sum(), p)[0]
    assert_unbiased(estimates, smoothed, label=f"{built_from} c={c}")


def test_bernoulli_bias_shrinks_with_c():
    # exact bias norms: 0.0066 (c = 0.5), 0.0011 (c = 0.2), 0.00027 (c = 0.1), 0.000068 (c = 0.05);
    # the gradient's norm is 0.35. Far below the Monte Carlo noise of a few thousand estimates.
    exact = exact_gradient(bernoulli_F, PHI)
    norms = [(smoothed_gradient(bernoulli_F, PHI, c) - exact).norm().item() for c in (0.5, 0.2, 0.1)]
    assert norms[0] > norms[1] > norms[2] and norms[2] < 0.25 * norms[1] * 1.1
    assert norms[0] > 0.005


# --------------------------------------------------------------------- minibatch plate
def test_bernoulli_under_minibatch_plate():
    c = 0.3
    problem = minibatch_bernoulli(interaction=1.0)  # f = Σ (z − t)² + z₁z₂ per data point
    (estimates,) = replicated_gradients([problem.w], R, problem.model(SPSA("z", n_samples=2, c=c)))
    # every data point is its own problem with its own signs: E ĝ_W = mean_i X_iᵀ S_c,i(X_i W)
    x = problem.x.double()
    logits = x @ problem.w.double()
    per_point = []
    for i in range(4):
        F = lambda phi, t=problem.t[i].double(): enumerate_bernoulli(torch.sigmoid(phi), lambda z: problem.cost(z, t))
        per_point.append(smoothed_gradient(F, logits[i], c))
    expected = x.T @ torch.stack(per_point) / 4
    assert_unbiased(estimates, expected, label="minibatch")


# ---------------------------------------------------------------------- two nested nodes
THETA1 = torch.tensor([0.5, -0.3, 0.1])
LOCS = torch.tensor([0.2, 1.5, -0.7])
BONUS = torch.tensor([1.0, -2.0, 0.5])


def test_score_function_parent_and_spsa_child_exact_for_a_quadratic_location_cost():
    # z ~ Cat(θ₁) (score function), x ~ N(loc[z], 1) (SPSA on loc), f = (x − 1)² + bonus[z]:
    # E f = Σ_k p_k ((loc_k − 1)² + 1 + bonus_k) is quadratic in loc, where central differences are
    # exact, so SPSA is unbiased for the true gradient at any c
    m1 = ScoreFunction("z", n_samples=2, baseline_factory="batch_average")
    m2 = SPSA("x", n_samples=1, c=0.5)

    def model(theta1, locs):
        z = m1(OneHotCategorical(logits=theta1))
        x = m2(Normal((z * locs).sum(-1), 1.0))
        assert [p.name for p in x.plates] == ["x", "z", "replicate"]
        storch.add_cost((x - 1.0) ** 2 + (z * BONUS).sum(-1), "f")

    g1, g2 = replicated_gradients([THETA1, LOCS], R, model)
    t1, locs = THETA1.clone().requires_grad_(), LOCS.clone().requires_grad_()
    e1, e2 = torch.autograd.grad((t1.softmax(-1) * ((locs - 1) ** 2 + 1 + BONUS)).sum(), [t1, locs])
    assert_unbiased(g1, e1, label="theta1")
    assert_unbiased(g2, e2, label="locs")


NESTED_PROBLEM = nested_bernoulli()  # x₂'s logits φ₂ + x₁
PHI1, PHI2, nested_F = NESTED_PROBLEM.phi1, NESTED_PROBLEM.phi2, NESTED_PROBLEM.expectation


def test_spsa_parent_and_expect_child():
    c = 0.4
    m1, m2 = SPSA("z1", n_samples=2, c=c), Expect("z2")

    def model(phi1, phi2):
        x1 = m1(Bernoulli(logits=phi1))
        x2 = m2(Bernoulli(logits=phi2 + x1))
        storch.add_cost(NESTED_PROBLEM.cost(x1, x2), "f")

    g1, g2 = replicated_gradients([PHI1, PHI2], R, model)
    # the parent's expected estimate is the smoothed gradient; the child's gradient flows through
    # the real samples of the parent only, so it is unbiased
    assert_unbiased(g1, smoothed_gradient(lambda u: nested_F(u, PHI2.double()), PHI1, c), label="phi1")
    assert_unbiased(g2, exact_gradient(lambda u: nested_F(PHI1.double(), u), PHI2), label="phi2")


# ------------------------------------------------------------------------ other families
def test_families_beyond_mvd_and_arm_gamma_and_binomial():
    # Gamma(k, β) perturbed in (log k, log β); E x = k/β
    c = 0.2
    method = SPSA("x", n_samples=2, c=c)

    def model(log_k, log_b):
        storch.add_cost(method(Gamma(log_k.exp(), log_b.exp())), "f")

    u = torch.tensor([0.5, -0.3])
    g = torch.stack(replicated_gradients([u[0], u[1]], R, model), 1)
    assert_unbiased(g, smoothed_gradient(lambda v: torch.exp(v[0] - v[1]), u, c), label="gamma")

    # Binomial(5, logits): total_count is discrete and never perturbed; E x² = n p (1 − p) + (n p)²
    method = SPSA("y", n_samples=2, c=c)
    assert perturbable_parameters(Binomial(5, logits=torch.zeros(1, requires_grad=True))) == ["logits"]

    def binomial_model(phi):
        storch.add_cost(method(Binomial(5, logits=phi)).pow(2).sum(-1), "f")

    def F(v):
        p = torch.sigmoid(v)
        return (5 * p * (1 - p) + (5 * p) ** 2).sum()

    phi = torch.tensor([0.3, -1.0])
    (g,) = replicated_gradients([phi], R, binomial_model)
    assert_unbiased(g, smoothed_gradient(F, phi, c), label="binomial")


def test_exponential_and_one_hot_categorical():
    c = 0.3
    method = SPSA("x", n_samples=2, c=c)

    def model(log_rate):  # E e^{−x} = λ/(λ + 1), perturbed in log λ
        storch.add_cost(torch.exp(-method(Exponential(log_rate.exp()))), "f")

    u = torch.tensor(0.4)
    (g,) = replicated_gradients([u], R, model)
    assert_unbiased(g.unsqueeze(-1), smoothed_gradient(lambda v: (v.exp() / (v.exp() + 1)).sum(), u.reshape(1), c))

    values = torch.tensor([1.0, -2.0, 0.5])
    method = SPSA("z", n_samples=2, c=c)

    def categorical_model(theta):
        storch.add_cost((method(OneHotCategorical(logits=theta)) * values).sum(-1) ** 2, "f")

    theta = torch.tensor([0.2, -0.4, 0.9])
    (g,) = replicated_gradients([theta], R, categorical_model)
    assert_unbiased(g, smoothed_gradient(lambda v: (v.softmax(-1) * values.double() ** 2).sum(), theta, c))


# ------------------------------------------------------------- layout, coupling and errors
def test_group_layout_weights_and_common_random_numbers():
    mu = torch.tensor([0.5, -1.0], requires_grad=True)
    sigma = torch.tensor([0.3, 2.0], requires_grad=True)
    x = SPSA("x", n_samples=50, c=0.1)(Normal(mu, sigma))
    assert x.shape == (150, 2)
    groups = x._tensor.reshape(50, 3, 2)
    real, plus, minus = groups[:, 0], groups[:, 1], groups[:, 2]
    # the same normal noise ε in all three: x = μ + σε and x± = μ ± cΔ_μ + σ e^{±cΔ_σ} ε for one pair
    # of signs (Δ_μ, Δ_σ) per group and coordinate
    mu, sigma = mu.detach(), sigma.detach()
    eps = (real - mu) / sigma
    matched = torch.zeros(50, 2, dtype=torch.bool)
    for a, b in itertools.product([-1.0, 1.0], repeat=2):
        fits_plus = torch.isclose(plus, mu + a * 0.1 + sigma * torch.exp(torch.tensor(b * 0.1)) * eps, atol=1e-5)
        fits_minus = torch.isclose(minus, mu - a * 0.1 + sigma * torch.exp(torch.tensor(-b * 0.1)) * eps, atol=1e-5)
        matched |= fits_plus & fits_minus
    assert matched.all()
    weights = x.plate.weight._tensor.reshape(50, 3)
    assert torch.equal(weights[:, 0], torch.full((50,), 0.02)) and (weights[:, 1:] == 0).all()


def test_forward_value_is_the_cost_at_the_real_samples():
    mu = torch.tensor([0.2, -0.1], requires_grad=True)
    x = SPSA("x", n_samples=5)(Normal(mu, 1.0))
    c = (x**2).sum(-1)
    storch.add_cost(c, "f")
    assert torch.allclose(storch.backward(), c._tensor.reshape(5, 3)[:, 0].mean())


def test_scale_stays_positive_for_large_perturbations():
    sigma = torch.tensor([0.01, 0.02], requires_grad=True)
    x = SPSA("x", n_samples=100, c=3.0)(Normal(torch.zeros(2), sigma))  # log-space: σ e^{±3}
    assert torch.isfinite(x._tensor).all()


def test_without_parameters_that_require_grad_only_real_samples_are_drawn():
    x = SPSA("x", n_samples=4)(Normal(torch.zeros(2), 1.0))
    assert x.shape == (4, 2)


class _Opaque(Distribution):
    arg_constraints: dict = {}
    support = constraints.real

    def __init__(self, theta):
        self.theta = theta
        super().__init__(theta.shape, validate_args=False)

    def sample(self, sample_shape=torch.Size()):
        return self.theta.detach() + torch.randn(sample_shape + self.theta.shape)


def test_errors():
    with pytest.raises(ValueError, match=r"SPSA\('x'\) cannot read the parameters of _Opaque.*register_spsa_wrapper"):
        SPSA("x")(_Opaque(torch.zeros(2, requires_grad=True)))
    with pytest.raises(ValueError, match="c must be positive"):
        SPSA("x", c=0.0)
