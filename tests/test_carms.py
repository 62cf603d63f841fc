"""CARMS (storch.method.carms): the samples, equivalences, unbiasedness, limits, variance, copies.

* The stick-breaking samples are Cat(p) and two of them fall on (a, c) with the probability the
  weights divide by (Monte Carlo).
* With two categories CARMS is ARMS on the same copula draws; the independent copula is
  leave-one-out REINFORCE (ScoreFunction with batch_average) on the same draws.
* First-order unbiasedness against enumeration: one categorical (C = 3, 4; each copula; one-hot,
  index, probs), a factorised node of two variables, a minibatch plate, chains with another estimator.
* Second order is not estimated (documented); errors; copies, state_dict, storch.compile_step.
* Variance at equal cost evaluations against RLOO and ARSM.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.method.arms import ARMS, COPULAS
from storch.method.arsm import ARSM
from storch.method.carms import CARMS, carms_samples, pair_weights
from storch.testing import assert_unbiased, replicated_gradients

from problems import bernoulli, exact_grads, minibatch_categorical
from seeding import manual_seed
from estimator_checks import DATA, check_compile_step, check_copies, check_cost_without_logit_plates_is_refused
from test_arsm import NESTED, ONE, CategoricalModel, FactorisedPair, assert_second_order_is_not_estimated

R = 3000


@pytest.fixture(scope="module")
def pair():
    return FactorisedPair()


# ------------------------------------------------------------------------------ the samples
@pytest.mark.parametrize("name", list(COPULAS))
@pytest.mark.parametrize("n", [2, 4])
def test_samples_are_categorical_and_pairs_have_the_assumed_law(name, n):
    phi = torch.tensor([0.3, -1.0, 0.8, 0.0])
    draws = 20000
    b = carms_samples(phi.expand(draws, 4), n, COPULAS[name])  # (n, draws)
    p = phi.softmax(-1)
    for i in range(n):
        freq = torch.bincount(b[i], minlength=4) / draws
        assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / draws).sqrt() + 1e-9).all(), (i, freq, p)
    rank, rho = pair_weights(phi, n, COPULAS[name])
    joint = torch.zeros(4, 4)
    joint.index_put_((b[0], b[-1]), torch.ones(draws), accumulate=True)
    joint /= draws
    for a in range(4):
        for c in range(4):
            if a != c:  # P(a, c) = p_a p_c / w(a, c)
                q = p[a] * p[c] / rho[min(rank[a], rank[c])]
                assert abs(joint[a, c] - q) <= 4.5 * (q * (1 - q) / draws).sqrt() + 1e-9, (a, c, joint[a, c], q)


def test_antithetic_pairs_disagree_more_often_than_independent_ones():
    phi = torch.tensor([0.3, -1.0, 0.8, 0.0])
    rank, rho = pair_weights(phi, 3, COPULAS["dirichlet"])
    assert (rho[:-1] < 1).all()  # P(a, c) > p_a p_c for every pair a ≠ c
    _, ones = pair_weights(phi, 3, COPULAS["independent"])
    torch.testing.assert_close(ones[:-1], torch.ones(3))


def test_the_weights_are_finite_at_extreme_logits():
    phi = torch.tensor([-30.0, 0.0, 12.0, 30.0])
    for n in (2, 4, 16):
        _, rho = pair_weights(phi, n, COPULAS["dirichlet"])
        assert torch.isfinite(rho).all() and (rho >= 0).all(), (n, rho)


# ------------------------------------------------------------------------------ equivalences
BERNOULLI = bernoulli(interaction=2.0)


def test_two_categories_are_arms_on_the_same_draws():
    seed = torch.randint(2**31, ()).item()
    grads, samples = {}, {}

    def arms_model(phi):
        x = ARMS("x", n_samples=4)(Bernoulli(logits=phi))
        samples["arms"] = x._tensor.detach().clone()
        storch.add_cost(BERNOULLI.cost(x), "f")

    def carms_model(phi):
        z = CARMS("x", n_samples=4)(OneHotCategorical(logits=torch.stack([torch.zeros_like(phi), phi], -1)))
        samples["carms"] = z._tensor[..., 1].detach().clone()
        storch.add_cost(BERNOULLI.cost(z[..., 1]), "f")

    for name, model in (("arms", arms_model), ("carms", carms_model)):
        torch.manual_seed(seed)
        (grads[name],) = replicated_gradients([BERNOULLI.phi], 1000, model)
        storch.reset()
    assert torch.equal(samples["arms"], samples["carms"])  # the same draws, in the same order
    torch.testing.assert_close(grads["arms"], grads["carms"], atol=1e-5, rtol=1e-5)


class _Replay(ScoreFunction):
    """ScoreFunction drawing the samples it is given: the same draws as another method's."""

    def __init__(self, samples: torch.Tensor) -> None:
        super().__init__("z", n_samples=samples.shape[0], baseline_factory="batch_average")
        self.samples = samples

    def proposal_dist(self, distr, amt_samples):
        return self.samples


def test_independent_copula_is_leave_one_out_reinforce_on_the_same_draws(pair):
    drawn = {}

    def check(z):
        drawn["z"] = z._tensor.detach().clone()

    def model(theta):
        z = CARMS("z", n_samples=4, copula="independent")(OneHotCategorical(logits=theta))
        check(z)
        storch.add_cost(pair.cost(z), "f")

    (carms,) = replicated_gradients([pair.theta], 500, model)
    storch.reset()
    (loo,) = replicated_gradients([pair.theta], 500, pair.model(_Replay(drawn["z"])))
    torch.testing.assert_close(carms, loo, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ unbiasedness
@pytest.mark.parametrize("k,copula,n,one_hot", [
    (3, "dirichlet", 2, True), (4, "dirichlet", 3, True), (4, "dirichlet", 5, False),
    (4, "gaussian", 4, True), (3, "independent", 3, True),
])
def test_one_node_unbiased(k, copula, n, one_hot):
    problem = ONE[k]
    (grads,) = replicated_gradients([problem.theta], R, problem.model(CARMS("z", n, copula=copula), one_hot))
    assert_unbiased(grads, problem.exact(), label=f"C={k} {copula} n={n}")


def test_categorical_built_from_probs_gets_the_probs_gradient():
    problem = ONE[3]
    probs = problem.theta.softmax(-1)

    def model(p):
        storch.add_cost(problem.cost(CARMS("z", 3)(Categorical(probs=p)), one_hot=False), "f")

    (grads,) = replicated_gradients([probs], R, model)
    (exact,) = exact_grads(lambda p: (p / p.sum() * problem.cost(torch.eye(3))).sum(), [probs])
    assert_unbiased(grads, exact, label="probs")


@pytest.mark.parametrize("n,one_hot", [(2, True), (4, False)])
def test_factorised_node_of_two_variables(pair, n, one_hot):
    (grads,) = replicated_gradients([pair.theta], R, pair.model(CARMS("z", n), one_hot))
    assert_unbiased(grads, pair.exact(), label=f"two variables n={n}")


def test_minibatch_plate():
    problem = minibatch_categorical()
    (grads,) = replicated_gradients([problem.w], 1500, problem.model(CARMS("z", 3)))
    assert_unbiased(grads, problem.exact(), label="minibatch")


CHAINS = {
    "carms_then_sf": (lambda: CARMS("z1", 3),
                      lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average")),
    "arsm_then_carms": (lambda: ARSM("z1"), lambda: CARMS("z2", 2, copula="gaussian")),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_two_nested_nodes(name):
    m1, m2 = (f() for f in CHAINS[name])
    NESTED.assert_unbiased(NESTED.model(m1, m2), R, label=name)


def test_second_derivatives_are_not_estimated():
    assert_second_order_is_not_estimated(CARMS("z", 3))


# ------------------------------------------------------------------------------ variance
def total_variance(g: torch.Tensor) -> tuple[float, float]:
    """``Σ_c Var(g_c)`` of ``R`` estimates (first dimension) and its standard error."""
    g = g.detach().double().flatten(1)
    squares = ((g - g.mean(0)) ** 2).sum(-1) * g.shape[0] / (g.shape[0] - 1)
    return squares.mean().item(), (squares.std() / g.shape[0] ** 0.5).item()


def _variance(method, problem, repeats: int = 4000) -> tuple[float, float]:
    manual_seed(7)
    (g,) = replicated_gradients([problem.theta], repeats, problem.model(method))
    storch.reset()
    return total_variance(g)


def test_variance_below_rloo_and_arsm_at_equal_evaluations():
    # measured (10⁵ estimates, Σ_c Var(g_c); C = 3, 4 evaluations): CARMS 0.217, RLOO 0.416, ARSM
    # 0.600 (one Dirichlet draw, 4 points); the table is in docs/estimators/antithetic.md
    one = ONE[3]
    carms = _variance(CARMS("z", 4), one)
    for other in (ScoreFunction("z", n_samples=4, baseline_factory="batch_average"), ARSM("z")):
        var, se = _variance(other, one)
        assert carms[0] + 4.5 * carms[1] < var - 4.5 * se, (type(other).__name__, carms, var, se)


# ------------------------------------------------------------------------------ errors
def test_non_categorical_is_refused():
    with pytest.raises(ValueError, match=r"CARMS\('z'\) estimates gradients of categorical logits only, got Normal"):
        CARMS("z", 2)(Normal(torch.zeros(2), 1.0))


def test_construction_is_checked():
    with pytest.raises(ValueError, match=r"CARMS\('z'\): the copula .* need n_samples >= 2 .* got 1"):
        CARMS("z", n_samples=1)
    with pytest.raises(TypeError, match=r"CARMS\('z'\): n_samples must be a positive int, got 2.5"):
        CARMS("z", n_samples=2.5)
    with pytest.raises(ValueError, match=r"CARMS\('z'\): copula must be one of \['dirichlet', 'gaussian', "
                                         r"'independent'\], got 'clayton'"):
        CARMS("z", 3, copula="clayton")
    assert CARMS("z", 3).n_samples == 3 and "copula='dirichlet'" in repr(CARMS("z", 3))


def test_a_cost_without_the_logits_plates_is_refused_by_name():
    theta = torch.zeros(4, 3, requires_grad=True)
    z = CARMS("z", 2)(OneHotCategorical(logits=storch.denote_independent(theta, 0, "data")))
    check_cost_without_logit_plates_is_refused(z, r"CARMS\('z'\): the logits carry plates \['data'\] that the cost 'f'")


# ------------------------------------------------------------------------------ copies and compile_step
@pytest.mark.parametrize("copula", ["dirichlet", "gaussian"])
def test_copies_pickles_and_state_dict(copula):
    check_copies(lambda: CategoricalModel(CARMS("z", 3, copula=copula)), DATA)


@pytest.mark.parametrize("copula", ["dirichlet", "gaussian"])
def test_compile_step_replays_the_eager_step(copula):
    check_compile_step(lambda: CategoricalModel(CARMS("z", 3, copula=copula)), DATA)
