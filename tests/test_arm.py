"""ARM and DisARM (storch.method.arm): unbiasedness against enumeration, layout, errors, variance.

Exact gradients come from enumerating every Bernoulli configuration and differentiating
Σ_x p(x) f(x) with autograd. Both estimators are unbiased for first-order gradients only (their
gradient enters through (φ − stopgrad φ)·stopgrad(ĝ)), so no second-order checks.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Normal, OneHotCategorical

import storch
from storch.method import Expect, ScoreFunction
from storch.method.arm import ARM, DisARM, bernoulli_logits
from storch.testing import assert_unbiased, replicated_gradients

from problems import bernoulli, enumerate_bernoulli, exact_grads, minibatch_bernoulli, nested_bernoulli

R = 3000
METHODS = {"arm": ARM, "disarm": DisARM}

# not separable over coordinates, so the antithetic pair's cost difference mixes them
BERNOULLI = bernoulli(interaction=2.0)
PHI, cost = BERNOULLI.phi, BERNOULLI.cost


# ------------------------------------------------------------------------------ one node
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("n", [1, 4], ids=["n1", "n4"])
def test_one_node_logits(name, n):
    method = METHODS[name]("x", n_samples=n)

    def model(phi):
        x = method(Bernoulli(logits=phi))
        assert x.shape[0] == 2 * n  # [b, b̃] per uniform draw
        storch.add_cost(cost(x), "f")

    (grads,) = replicated_gradients([PHI], R, model)
    assert_unbiased(grads, BERNOULLI.exact(), label=f"{name} n={n}")


@pytest.mark.parametrize("name", list(METHODS))
def test_bernoulli_built_from_probs_gets_the_probs_gradient(name):
    # the estimator differentiates φ = logit(p); the chain rule carries it to p
    probs = torch.tensor([0.6, 0.35, 0.8])
    method = METHODS[name]("x", n_samples=2)

    def model(p):
        storch.add_cost(cost(method(Bernoulli(probs=p))), "f")

    (grads,) = replicated_gradients([probs], R, model)
    (exact,) = exact_grads(lambda p: enumerate_bernoulli(p, cost), [probs])
    assert_unbiased(grads, exact, label=f"{name} probs")


# ----------------------------------------------------------------------- minibatch plate
MINIBATCH = minibatch_bernoulli(interaction=1.0)  # f = Σ (z − t)² + z₁z₂ per data point


@pytest.mark.parametrize("name", list(METHODS))
def test_minibatch_plate(name):
    model = MINIBATCH.model(METHODS[name]("z", n_samples=2))
    (grads,) = replicated_gradients([MINIBATCH.w], R, model)
    assert_unbiased(grads, MINIBATCH.exact(), label=f"{name} minibatch")


# ---------------------------------------------------------------------- two nested nodes
COUPLING = torch.tensor([[1.0, -0.5], [0.3, 0.8]])
NESTED_PROBLEM = nested_bernoulli(COUPLING)


NESTED = {
    "arm_arm": (lambda: ARM("z1", n_samples=2), lambda: ARM("z2")),
    "disarm_disarm": (lambda: DisARM("z1"), lambda: DisARM("z2", n_samples=2)),
    "disarm_then_sf": (lambda: DisARM("z1", n_samples=2), lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average")),
    "sf_then_arm": (lambda: ScoreFunction("z1", n_samples=2, baseline_factory="batch_average"), lambda: ARM("z2", n_samples=2)),
    "expect_then_disarm": (lambda: Expect("z1"), lambda: DisARM("z2")),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_two_nested_nodes(name):
    m1, m2 = (f() for f in NESTED[name])

    def model(phi1, phi2):
        x1 = m1(Bernoulli(logits=phi1))
        x2 = m2(Bernoulli(logits=phi2 + (x1.unsqueeze(-1) * COUPLING).sum(-2)))
        assert [p.name for p in x2.plates] == ["z2", "z1", "replicate"]
        storch.add_cost(NESTED_PROBLEM.cost(x1, x2), "f")

    NESTED_PROBLEM.assert_unbiased(model, R, label=name)


# ----------------------------------------------------------------- layout and forward value
def test_antithetic_pairs_and_weights():
    phi = torch.tensor([2.0, -2.0, 0.0])
    x = ARM("x", n_samples=5000)(Bernoulli(logits=phi))
    pairs = x._tensor.reshape(5000, 2, 3)
    b, b_tilde = pairs[:, 0], pairs[:, 1]
    # both points are Bernoulli(σ(φ)) samples, antithetic: P(b = b̃ = 0) = 0 when σ(φ) > 1/2
    # (u < σ(φ) or u > σ(−φ) always holds), and P(b = b̃ = 1) = 0 when σ(φ) < 1/2
    p = torch.sigmoid(phi)
    for points in (b, b_tilde):
        se = (p * (1 - p) / 5000).sqrt()
        assert ((points.mean(0) - p).abs() <= 4.5 * se).all()
    assert not ((b[:, 0] == 0) & (b_tilde[:, 0] == 0)).any()
    assert not ((b[:, 1] == 1) & (b_tilde[:, 1] == 1)).any()
    assert torch.allclose(x.plate.weight._tensor, torch.full((10000,), 1 / 10000))


@pytest.mark.parametrize("name", list(METHODS))
def test_forward_value_averages_both_points(name):
    phi = PHI.clone().requires_grad_()
    x = METHODS[name]("x", n_samples=3)(Bernoulli(logits=phi))
    c = cost(x)
    storch.add_cost(c, "f")
    assert torch.allclose(storch.backward(), c._tensor.mean())


def test_costs_that_depend_on_the_logits_directly_get_their_pathwise_gradient():
    # f(x, φ) = φ·x: ∂/∂φ E f = p + φ p (1 − p)
    def model(phi):
        x = DisARM("x", n_samples=2)(Bernoulli(logits=phi))
        storch.add_cost((phi * x).sum(-1), "f")

    (grads,) = replicated_gradients([PHI], R, model)
    p = torch.sigmoid(PHI)
    assert_unbiased(grads, p + PHI * p * (1 - p))


# ---------------------------------------------------------------------------- variance
def test_disarm_has_lower_variance_than_arm():
    # Common random numbers: both estimators draw their uniforms the same way (one torch.rand in
    # proposal_dist), so from the same seed they see the same u and the same pairs [b, b̃]. DisARM is
    # E[ARM | b, b̃], hence Var ARM − Var DisARM = E Var(ARM | b, b̃) > 0, and the paired difference
    # hᵢ = (Aᵢ − Ā)² − (Dᵢ − D̄)² estimates it with a far smaller standard error than two
    # independent variance estimates: measured over seeds 0..9, mean(h) ≈ 0.020–0.026 at ≈ 12 (11–15)
    # standard errors per coordinate (ARM ≈ 0.11, 0.14, 0.16; DisARM ≈ 0.086, 0.11, 0.14; n = 1).
    seed = torch.randint(2**31, ()).item()  # from the test's seed (tests/conftest.py)
    grads, samples = {}, {}
    for name, make in METHODS.items():
        method = make("x")

        def model(phi, method=method, name=name):
            x = method(Bernoulli(logits=phi))
            samples[name] = x._tensor.detach().clone()
            storch.add_cost(cost(x), "f")

        torch.manual_seed(seed)
        (grads[name],) = replicated_gradients([PHI], 6000, model)
        storch.reset()
    assert torch.equal(samples["arm"], samples["disarm"])  # the pairing holds: same u, same [b, b̃]
    a, d = grads["arm"].double(), grads["disarm"].double()
    h = (a - a.mean(0)) ** 2 - (d - d.mean(0)) ** 2
    diff, se = h.mean(0), h.std(0) / h.shape[0] ** 0.5
    assert (diff > 5 * se).all(), (diff, se, a.var(0), d.var(0))


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("name", list(METHODS))
def test_non_bernoulli_is_refused(name):
    with pytest.raises(ValueError, match=r"Bernoulli logits only, got Normal.*Bernoulli\(logits=\.\.\.\)"):
        METHODS[name]("x")(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match="got OneHotCategorical"):
        METHODS[name]("x")(OneHotCategorical(logits=torch.zeros(3)))


def test_bernoulli_logits_ignores_a_cached_plain_copy():
    _, phi = storch.testing.replicate(PHI, 4)
    d = Bernoulli(logits=phi)
    assert bernoulli_logits(d) is d.logits
    d_probs = Bernoulli(probs=torch.sigmoid(phi))
    assert torch.allclose(bernoulli_logits(d_probs)._tensor, phi._tensor, atol=1e-5)
    assert [p.name for p in bernoulli_logits(d_probs).plates] == ["replicate"]


@pytest.mark.parametrize("name", list(METHODS))
def test_a_cost_without_the_logits_plates_is_refused_by_name(name):
    """The logits vary over a minibatch plate that was reduced before add_cost: the per-variable
    gradient has no cost value to pair with, so the estimator says which plate and which cost."""
    phi = torch.zeros(4, 3, requires_grad=True)
    x = storch.denote_independent(phi, 0, "data")
    z = METHODS[name]("z", n_samples=2)(Bernoulli(logits=x))
    storch.add_cost(storch.reduce_plates(z.sum(-1), "data"), "f")
    with pytest.raises(ValueError, match=r"carry plates \['data'\] that the cost 'f' does not have"):
        storch.backward()


# ------------------------------------------------------------------------------ the term without alignment
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("n_samples", [1, 3])
def test_laid_out_term_equals_the_aligned_term(name, n_samples):
    """The shortcut taken when the logits carry the cost's other plates in its order gives the same term
    (values and gradient) as the general alignment, for one group (a view) and several (a copy)."""
    torch.manual_seed(0)
    phi = torch.randn(4, 3, requires_grad=True)
    x = storch.denote_independent(phi, 0, "data")
    method = METHODS[name]("b", n_samples=n_samples)
    b = method(Bernoulli(logits=x))
    cost = ((b - 0.3) ** 2 * torch.arange(1.0, 4.0)).sum(-1)
    storch.add_cost(cost, "f")
    registered = storch.registered_costs()[0]
    logits = bernoulli_logits(b.distribution)
    fast = method._laid_out_term(b, registered, logits)
    general = method._aligned_term(b, registered, logits)
    storch.reset()
    assert fast.plate_names == general.plate_names == ["b", "data"]
    assert torch.equal(fast.plain(), general.plain())
    (g_fast,) = torch.autograd.grad(fast.plain().sum(), phi)
    (g_general,) = torch.autograd.grad(general.plain().sum(), phi)
    assert torch.equal(g_fast, g_general)
