"""ARMS (storch.method.arms): copulas, equivalences, unbiasedness, the multi-sample bound, limits.

* The copulas: each sample is Bernoulli(σ(φ)) and two samples disagree with the probability the
  estimator divides by (Monte Carlo, and the bivariate normal CDF of scipy for the Gaussian copula).
* ``n = 2`` is DisARM on the same draws; the independent copula is leave-one-out REINFORCE
  (ScoreFunction with the batch_average baseline) on the same draws.
* First-order unbiasedness against enumeration: one node (each copula), probs, a minibatch plate,
  chains with a reparameterized Normal upstream and a score-function node up- or downstream.
* ARMSMultiSample: unbiased for ∇ E[log (1/K) Σ w] against enumeration of all K-tuples.
* Second order is not estimated (documented): the ARMS term leaves second derivatives out.
* Variance at equal cost evaluations: below DisARM and RLOO on the shared three-bit problem.
* Copies, state_dict and storch.compile_step.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Normal

import storch
from storch.method import DisARM, ScoreFunction
from storch.method.arms import ARMS, COPULAS, ARMSMultiSample, arms_iwae_bound, arms_logit_gradient
from storch.method.vimco import iwae_bound
from storch.testing import assert_unbiased, replicate, replicated_gradients, variance_with_stderr

from estimator_checks import DATA, check_compile_step, check_copies, check_cost_without_logit_plates_is_refused
from problems import bernoulli, enumerate_bernoulli, exact_grads, minibatch_bernoulli, nested_bernoulli
from seeding import manual_seed

R = 3000
BERNOULLI = bernoulli(interaction=2.0)  # three bits, a cost that couples two of them
PHI, cost = BERNOULLI.phi, BERNOULLI.cost


# ------------------------------------------------------------------------------ the copulas
@pytest.mark.parametrize("name", list(COPULAS))
@pytest.mark.parametrize("n", [3, 5])
def test_copula_samples_are_bernoulli_and_disagree_as_the_estimator_assumes(name, n):
    phi = torch.tensor([-3.0, -1.2, -0.3, 0.0, 0.4, 1.5, 4.0], dtype=torch.float64)
    draws = 20000
    p = torch.sigmoid(phi)
    u = COPULAS[name].uniforms(phi.expand(draws, -1), n)  # (n, draws, 7)
    b = (u < p).double()
    assert ((u >= 0) & (u <= 1)).all()
    for i in range(n):
        se = (p * (1 - p) / draws).sqrt()
        assert ((b[i].mean(0) - p).abs() <= 4.5 * se + 1e-9).all(), (i, b[i].mean(0), p)
    # every ordered pair (i, j) disagrees as b_i = 1, b_j = 0 with the same probability
    q = COPULAS[name].disagreement(phi, n)
    for i, j in [(0, 1), (n - 1, 0), (1, n - 1)]:
        hits = b[i] * (1 - b[j])
        se = (q * (1 - q) / draws).sqrt()
        assert ((hits.mean(0) - q).abs() <= 4.5 * se + 1e-9).all(), (i, j, hits.mean(0), q)
    if name != "independent":  # antithetic: two samples disagree at least as often as independent ones
        assert (q >= p * (1 - p) - 1e-12).all()


def test_gaussian_disagreement_is_the_bivariate_normal_cdf():
    stats = pytest.importorskip("scipy.stats")
    phi = torch.tensor([-6.0, -2.0, -0.5, 0.0, 0.7, 3.0], dtype=torch.float64)
    for n in (2, 3, 4, 8):
        r = -1 / (n - 1)
        h = stats.norm.ppf(torch.sigmoid(phi).numpy())
        joint = stats.multivariate_normal(mean=[0.0, 0.0], cov=[[1.0, r], [r, 1.0]], allow_singular=True)
        both = np.array([joint.cdf([x, x]) if n > 2 else max(0.0, 2 * stats.norm.cdf(x) - 1) for x in h])
        expected = torch.sigmoid(phi).numpy() - both  # P(b_i = 1) − P(b_i = b_j = 1)
        got = COPULAS["gaussian"].disagreement(phi, n).numpy()
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-9)


@pytest.mark.parametrize("name", ["dirichlet", "gaussian"])
def test_two_samples_are_the_antithetic_pair_with_disarm_factor(name):
    phi = torch.tensor([-2.0, -0.1, 0.0, 0.3, 5.0])
    u = COPULAS[name].uniforms(phi.expand(1000, -1), 2)
    torch.testing.assert_close(u[1], 1 - u[0], atol=2e-6, rtol=0)
    p = torch.sigmoid(phi)
    torch.testing.assert_close(p * (1 - p) / COPULAS[name].disagreement(phi, 2), torch.sigmoid(phi.abs()))


@pytest.mark.parametrize("name", list(COPULAS))
def test_the_correction_is_finite_at_extreme_logits(name):
    phi = torch.tensor([-40.0, -15.0, 15.0, 40.0])
    for n in (2, 4, 16):
        q = COPULAS[name].disagreement(phi, n)
        assert torch.isfinite(q).all() and (q > 0).all(), (name, n, q)
        c = torch.sigmoid(phi) * torch.sigmoid(-phi) / q
        torch.testing.assert_close(c, torch.ones_like(c), atol=1e-3, rtol=0)  # one sample in the minority


# ------------------------------------------------------------------------------ equivalences
def test_two_samples_are_disarm_on_the_same_draws():
    seed = torch.randint(2**31, ()).item()
    grads, samples = {}, {}
    for name, method in (("arms", ARMS("x", n_samples=2)), ("disarm", DisARM("x"))):

        def model(phi, method=method, name=name):
            x = method(Bernoulli(logits=phi))
            samples[name] = x._tensor.detach().clone()
            storch.add_cost(cost(x), "f")

        torch.manual_seed(seed)
        (grads[name],) = replicated_gradients([PHI], 2000, model)
        storch.reset()
    assert torch.equal(samples["arms"], samples["disarm"])  # [b, b̃] of the same uniforms, same order
    torch.testing.assert_close(grads["arms"], grads["disarm"], atol=1e-5, rtol=1e-5)


def test_the_gradient_of_a_pair_is_disarms_formula():
    b = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])  # coordinate 0 disagrees
    phi = torch.tensor([0.8, -0.3, 1.1])
    f = torch.tensor([2.0, -1.0]).unsqueeze(-1)
    disarm = 0.5 * (f[0] - f[1]) * (1 - 2 * b[1]) * (b[0] != b[1]) * torch.sigmoid(phi.abs())
    for name in ("dirichlet", "gaussian"):
        torch.testing.assert_close(arms_logit_gradient(f, b, phi, COPULAS[name]), disarm)


class _Replay(ScoreFunction):
    """ScoreFunction drawing the samples it is given: the same draws as another method's."""

    def __init__(self, samples: torch.Tensor) -> None:
        super().__init__("x", n_samples=samples.shape[0], baseline_factory="batch_average")
        self.samples = samples

    def proposal_dist(self, distr, amt_samples):
        return self.samples


def test_independent_copula_is_leave_one_out_reinforce_on_the_same_draws():
    n, drawn = 4, {}

    def arms_model(phi):
        x = ARMS("x", n_samples=n, copula="independent")(Bernoulli(logits=phi))
        drawn["x"] = x._tensor.detach().clone()
        storch.add_cost(cost(x), "f")

    (arms,) = replicated_gradients([PHI], 1000, arms_model)
    storch.reset()
    rloo = _Replay(drawn["x"])
    (loo,) = replicated_gradients([PHI], 1000, BERNOULLI.model(rloo))
    torch.testing.assert_close(arms, loo, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ unbiasedness
@pytest.mark.parametrize("copula,n", [("dirichlet", 3), ("dirichlet", 5), ("gaussian", 4), ("independent", 3)])
def test_one_node_unbiased(copula, n):
    def model(phi):
        x = ARMS("x", n_samples=n, copula=copula)(Bernoulli(logits=phi))
        assert x.shape == (n, R, 3) and x.plate_names == ["x", "replicate"]
        storch.add_cost(cost(x), "f")

    (grads,) = replicated_gradients([PHI], R, model)
    assert_unbiased(grads, BERNOULLI.exact(), label=f"{copula} n={n}")


def test_bernoulli_built_from_probs_gets_the_probs_gradient():
    probs = torch.tensor([0.6, 0.35, 0.8])

    def model(p):
        storch.add_cost(cost(ARMS("x", n_samples=3)(Bernoulli(probs=p))), "f")

    (grads,) = replicated_gradients([probs], R, model)
    (exact,) = exact_grads(lambda p: enumerate_bernoulli(p, cost), [probs])
    assert_unbiased(grads, exact, label="probs")


def test_minibatch_plate():
    problem = minibatch_bernoulli(interaction=1.0)
    (grads,) = replicated_gradients([problem.w], R, problem.model(ARMS("z", n_samples=3, copula="gaussian")))
    assert_unbiased(grads, problem.exact(), label="minibatch")


def test_costs_that_depend_on_the_logits_directly_get_their_pathwise_gradient():
    def model(phi):
        x = ARMS("x", n_samples=3)(Bernoulli(logits=phi))
        storch.add_cost((phi * x).sum(-1), "f")  # ∂/∂φ E f = p + φ p (1 − p)

    (grads,) = replicated_gradients([PHI], R, model)
    p = torch.sigmoid(PHI)
    assert_unbiased(grads, p + PHI * p * (1 - p))


COUPLING = torch.tensor([[1.0, -0.5], [0.3, 0.8]])
NESTED = nested_bernoulli(COUPLING)
CHAINS = {
    "arms_then_sf": (lambda: ARMS("z1", n_samples=3),
                     lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average")),
    "sf_then_arms": (lambda: ScoreFunction("z1", n_samples=2, baseline_factory="batch_average"),
                     lambda: ARMS("z2", n_samples=3, copula="gaussian")),
    "arms_then_arms": (lambda: ARMS("z1", n_samples=2), lambda: ARMS("z2", n_samples=4)),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_two_nested_nodes(name):
    m1, m2 = (f() for f in CHAINS[name])

    def model(phi1, phi2):
        x1 = m1(Bernoulli(logits=phi1))
        x2 = m2(Bernoulli(logits=phi2 + (x1.unsqueeze(-1) * COUPLING).sum(-2)))
        assert x2.plate_names == ["z2", "z1", "replicate"]
        storch.add_cost(NESTED.cost(x1, x2), "f")

    NESTED.assert_unbiased(model, R, label=name)


def test_a_reparameterized_normal_upstream():
    """e ~ N(μ, 1) (pathwise), x | e ~ Bernoulli(σ(φ + e·a)) (ARMS), f = cost(x) + (e − ½)²."""
    a = torch.tensor([0.5, -1.0, 0.8])

    def model(mu, phi):
        e = storch.method.Reparameterization("e", n_samples=2)(Normal(mu, 1.0))
        x = ARMS("x", n_samples=3)(Bernoulli(logits=phi + e.unsqueeze(-1) * a))
        storch.add_cost(cost(x) + (e - 0.5) ** 2, "f")

    def expectation(mu, phi):  # Gauss–Hermite over e
        nodes, weights = (torch.tensor(v, dtype=torch.float64) for v in np.polynomial.hermite_e.hermegauss(40))
        e = mu.double() + nodes
        p = torch.sigmoid(phi.double() + e.unsqueeze(-1) * a.double())
        inner = enumerate_bernoulli(p, lambda x: cost(x.double())) + (e - 0.5) ** 2
        return (weights * inner).sum() / math.sqrt(2 * math.pi)

    mu = torch.tensor(0.2)
    g_mu, g_phi = replicated_gradients([mu, PHI], R, model)
    e_mu, e_phi = exact_grads(expectation, [mu, PHI])
    assert_unbiased(g_mu, e_mu, label="mu")
    assert_unbiased(g_phi, e_phi, label="phi")


# ------------------------------------------------------------------------------ the multi-sample bound
BOUND_PHI = torch.tensor([0.4, -0.7, 0.2])  # encoder logits of q(z), three bits
BOUND_PSI = torch.tensor([-0.2, 0.5, 0.0])  # prior logits of p(z)
BOUND_W = torch.tensor([1.5, -0.8, 0.6])  # decoder: x ~ N(w·z + 0.3, 1)
X_OBS = 1.1
BITS = torch.tensor(list(itertools.product([0.0, 1.0], repeat=3)))


def log_weights(z, phi, psi, w, x=X_OBS):
    log_likelihood = -0.5 * (x - (z * w).sum(-1) - 0.3) ** 2 - 0.5 * math.log(2 * math.pi)  # N(x; w·z + 0.3, 1)
    return Bernoulli(logits=psi).log_prob(z).sum(-1) + log_likelihood - Bernoulli(logits=phi).log_prob(z).sum(-1)


def exact_bound(phi, psi, w, k, x=X_OBS):
    """E[log (1/K) Σ_k w(z_k)] over all 8^K tuples of latent values."""
    log_q = Bernoulli(logits=phi).log_prob(BITS).sum(-1)
    lw = log_weights(BITS, phi, psi, w, x)
    tuples = torch.cartesian_prod(*[torch.arange(8)] * k).reshape(-1, k)
    return (log_q[tuples].sum(-1).exp() * (torch.logsumexp(lw[tuples], -1) - math.log(k))).sum()


@pytest.mark.parametrize("copula,k", [("dirichlet", 3), ("gaussian", 2)])
def test_multi_sample_bound_unbiased(copula, k):
    def model(phi, psi, w):
        z = ARMSMultiSample("z", n_samples=k, copula=copula)(Bernoulli(logits=phi))
        assert z.shape == (2 * k, R, 3)
        bound = arms_iwae_bound(log_weights(z, phi, psi, w), z)
        assert bound.plate_names == ["replicate"]

    grads = replicated_gradients([BOUND_PHI, BOUND_PSI, BOUND_W], R, model)
    exact = torch.autograd.functional.jacobian(
        lambda a, b, c: exact_bound(a, b, c, k), (BOUND_PHI, BOUND_PSI, BOUND_W))
    for name, g, e in zip(["phi", "psi", "w"], grads, exact):
        assert_unbiased(-g, e, label=f"{copula} K={k} {name}")  # the cost is −L


DATA_X = torch.tensor([0.5, -1.0, 2.0])
ENC = torch.tensor([[0.8, -0.3, 0.1], [0.2, 0.6, -0.4]])  # encoder logits = ENC[0] · x + ENC[1]


def test_multi_sample_bound_under_a_minibatch_plate():
    k = 2

    def model(enc, w):
        x = storch.denote_independent(DATA_X, 0, "data")
        logits = enc[..., 0, :] * x.unsqueeze(-1) + enc[..., 1, :]
        z = ARMSMultiSample("z", n_samples=k)(Bernoulli(logits=logits))
        assert z.plate_names == ["z", "data", "replicate"]
        bound = arms_iwae_bound(log_weights(z, logits, BOUND_PSI, w, x), z)
        assert bound.plate_names == ["data", "replicate"]

    g_enc, g_w = replicated_gradients([ENC, BOUND_W], R, model)

    def exact(enc, w):
        return torch.stack([exact_bound(enc[0] * xi + enc[1], BOUND_PSI, w, k, xi) for xi in DATA_X]).mean()

    e_enc, e_w = torch.autograd.functional.jacobian(exact, (ENC, BOUND_W))
    assert_unbiased(-g_enc.reshape(R, -1), e_enc.reshape(-1), label="encoder")
    assert_unbiased(-g_w, e_w, label="decoder")


def test_multi_sample_bound_with_a_per_sample_cost_beside_it():
    k = 2

    def model(phi):
        z = ARMSMultiSample("z", n_samples=k)(Bernoulli(logits=phi))
        arms_iwae_bound(log_weights(z, phi, BOUND_PSI, BOUND_W), z)
        storch.add_cost(0.7 * z.sum(-1), "penalty")

    (g,) = replicated_gradients([BOUND_PHI], R, model)
    exact = torch.autograd.functional.jacobian(
        lambda phi: -exact_bound(phi, BOUND_PSI, BOUND_W, k) + 0.7 * torch.sigmoid(phi).sum(), BOUND_PHI)
    assert_unbiased(g, exact, label="bound + penalty")


def test_multi_sample_node_with_a_plain_cost_is_unbiased():
    (grads,) = replicated_gradients([PHI], R, BERNOULLI.model(ARMSMultiSample("x", n_samples=3)))
    assert_unbiased(grads, BERNOULLI.exact(), label="per-sample cost")


def test_the_bound_is_that_of_the_iid_half_and_the_forward_value():
    phi = torch.zeros(3, requires_grad=True)
    z = ARMSMultiSample("z", n_samples=3)(Bernoulli(logits=phi))
    log_w = log_weights(z, phi, BOUND_PSI, BOUND_W)
    bound = arms_iwae_bound(log_w, z)
    torch.testing.assert_close(bound._tensor, torch.logsumexp(log_w._tensor[:3], 0) - math.log(3))
    torch.testing.assert_close(storch.backward(), -bound._tensor)


def test_bound_errors_name_the_node_and_the_fix():
    phi = torch.zeros(3)
    z = ARMSMultiSample("z", n_samples=2)(Bernoulli(logits=phi))
    log_w = log_weights(z, phi, BOUND_PSI, BOUND_W)
    with pytest.raises(ValueError, match=r"iwae_bound over 'z'.*storch.method.arms.arms_iwae_bound\(log_w, z\)"):
        iwae_bound(log_w, z)
    assert storch.registered_costs() == ()
    storch.reset()
    y = ARMS("y", n_samples=2)(Bernoulli(logits=phi))
    with pytest.raises(ValueError, match=r"node 'y' is sampled with ARMS; use ARMSMultiSample\('y', n_samples=K\)"):
        arms_iwae_bound(log_weights(y, phi, BOUND_PSI, BOUND_W), y)
    storch.reset()
    z = ARMSMultiSample("z", n_samples=2)(Bernoulli(logits=phi))
    later = ScoreFunction("later", n_samples=2)(Normal(z.sum(-1), 1.0))
    with pytest.raises(ValueError, match=r"log_w depends on nodes \['later'\] sampled after it"):
        arms_iwae_bound(log_weights(z, phi, BOUND_PSI, BOUND_W) + later, z)
    with pytest.raises(ValueError, match="sum the event dimensions first"):
        arms_iwae_bound(z, z)


# ------------------------------------------------------------------------------ second order (not estimated)
def test_second_derivatives_leave_the_arms_term_out():
    """Documented limit: the term (φ − stopgrad φ)·stopgrad(g) is linear in φ, so with
    backward(create_graph=True) the Hessian of a cost that reaches φ only through the samples is 0."""
    leaf, phi = replicate(PHI, 200)
    storch.add_cost(cost(ARMS("x", n_samples=3)(Bernoulli(logits=phi))), "f")
    storch.backward(create_graph=True)
    assert leaf.grad.abs().sum() > 0  # first order: estimated
    assert not leaf.grad.requires_grad  # second order: no graph, nothing estimated
    assert BERNOULLI.exact_hessian().abs().sum() > 0.1


# ------------------------------------------------------------------------------ variance
def _variance(method, repeats: int = 6000) -> tuple[float, float]:
    manual_seed(7)
    (g,) = replicated_gradients([PHI], repeats, BERNOULLI.model(method))
    storch.reset()
    return variance_with_stderr(g.sum(-1))


def test_variance_below_disarm_and_rloo_at_equal_evaluations():
    # measured (R = 10⁵, variance of the sum of the coordinates' estimates): ARMS 0.1193, DisARM
    # (2 pairs) 0.1797, RLOO (n = 4) 0.1776; the per-coordinate table is in docs/estimators/antithetic.md
    arms = _variance(ARMS("x", n_samples=4))
    for other in (DisARM("x", n_samples=2), ScoreFunction("x", n_samples=4, baseline_factory="batch_average")):
        var, se = _variance(other)
        assert arms[0] + 4.5 * arms[1] < var - 4.5 * se, (type(other).__name__, arms, var, se)


# ------------------------------------------------------------------------------ errors
def test_non_bernoulli_is_refused():
    for method in (ARMS("x", 2), ARMSMultiSample("x", 2)):
        with pytest.raises(ValueError, match=r"Bernoulli logits only, got Normal.*Bernoulli\(logits=\.\.\.\)"):
            method(Normal(torch.zeros(2), 1.0))


def test_construction_is_checked():
    with pytest.raises(ValueError, match=r"ARMS\('z'\): the copula .* need n_samples >= 2 .* got 1"):
        ARMS("z", n_samples=1)
    with pytest.raises(TypeError, match=r"ARMSMultiSample\('z'\): n_samples must be a positive int, got 2.5"):
        ARMSMultiSample("z", n_samples=2.5)
    with pytest.raises(ValueError, match=r"ARMS\('z'\): copula must be one of \['dirichlet', 'gaussian', "
                                         r"'independent'\], got 'clayton'"):
        ARMS("z", 3, copula="clayton")
    assert ARMS("z", 3).n_samples == 3 and "copula='dirichlet'" in repr(ARMS("z", 3))


def test_a_cost_without_the_logits_plates_is_refused_by_name():
    phi = torch.zeros(4, 3, requires_grad=True)
    z = ARMS("z", n_samples=2)(Bernoulli(logits=storch.denote_independent(phi, 0, "data")))
    check_cost_without_logit_plates_is_refused(z, r"ARMS\('z'\): the logits carry plates \['data'\] that the cost 'f'")


# ------------------------------------------------------------------------------ copies and compile_step
class _Model(nn.Module):
    def __init__(self, method) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.method = method
        self.encoder, self.decoder = nn.Linear(4, 3), nn.Linear(3, 4)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        x = storch.denote_independent(x, 0, "data")
        q = Bernoulli(logits=self.encoder(x))
        z = self.method(q)
        log_w = Bernoulli(logits=self.decoder(z)).log_prob(x).sum(-1) - q.log_prob(z).sum(-1)
        if isinstance(self.method, ARMSMultiSample):
            arms_iwae_bound(log_w, z)
        else:
            storch.add_cost(-log_w, "neg_elbo")
        return storch.backward()


BUILDS = {
    "dirichlet": lambda: ARMS("z", n_samples=3),
    "gaussian": lambda: ARMS("z", n_samples=4, copula="gaussian"),
    "multi_sample": lambda: ARMSMultiSample("z", n_samples=2),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_copies_pickles_and_state_dict(name):
    check_copies(lambda: _Model(BUILDS[name]()), DATA)


@pytest.mark.parametrize("name", list(BUILDS))
def test_compile_step_replays_the_eager_step(name):
    check_compile_step(lambda: _Model(BUILDS[name]()), DATA)
