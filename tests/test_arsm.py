"""ARSM (storch.method.arsm): pseudo-actions, unbiasedness, limits, copies and compile_step.

* Every pseudo-action is a Cat(p) sample; the true action is argmin_i π_i e^{−φ_i}.
* The gradient of one draw is the paper's formula, computed by hand over all C² swaps.
* First-order unbiasedness against enumeration: one categorical (C = 3, 4; one-hot, index, probs),
  a factorised node of two variables, a minibatch plate, chains with another estimator up- or
  downstream.
* Second order is not estimated (documented): Hessians from create_graph=True are biased.
* Copies, state_dict and storch.compile_step.

The factorised two-variable problem defined here is shared with tests/test_carms.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.distributions import Categorical, Normal, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.method.arsm import ARSM, arsm_logit_gradient, arsm_pseudo_actions
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from estimator_checks import DATA, check_compile_step, check_copies, check_cost_without_logit_plates_is_refused
from problems import exact_grads, minibatch_categorical, nested_categorical, one_categorical, replicated_hessians

R = 3000
ONE = {k: one_categorical(k) for k in (3, 4)}


# ------------------------------------------------------------------------------ two variables in one node
@pytest.fixture(scope="module")
def pair():
    return FactorisedPair()


class FactorisedPair:
    """Two categorical variables (3 categories) in one node, ``f = (v·z₁ − 2 v·z₂)² + v·z₁``."""

    theta = torch.tensor([[0.2, -0.4, 0.9], [0.5, 0.0, -0.6]])
    values = torch.tensor([1.0, -2.0, 0.5])

    def cost(self, z: torch.Tensor) -> torch.Tensor:
        a, b = (z[..., 0, :] * self.values).sum(-1), (z[..., 1, :] * self.values).sum(-1)
        return (a - 2 * b) ** 2 + a

    def model(self, method, one_hot: bool = True):
        def model(theta):
            d = OneHotCategorical(logits=theta) if one_hot else Categorical(logits=theta)
            z = method(d)
            storch.add_cost(self.cost(z if one_hot else nn.functional.one_hot(z, 3).to(theta.dtype)), "f")

        return model

    def expectation(self, theta: torch.Tensor) -> torch.Tensor:
        p = theta.softmax(-1)
        eye = torch.eye(3)
        return sum(p[0, a] * p[1, b] * self.cost(torch.stack([eye[a], eye[b]]))
                   for a, b in itertools.product(range(3), repeat=2))

    def exact(self) -> torch.Tensor:
        return exact_grads(self.expectation, [self.theta])[0]


# ------------------------------------------------------------------------------ the pseudo-actions
def test_every_pseudo_action_is_a_categorical_sample():
    phi = torch.tensor([0.3, -1.0, 0.8, 0.0])
    draws = 20000
    e = -torch.rand(draws, 4).log()
    pi = e / e.sum(-1, keepdim=True)
    z = arsm_pseudo_actions(phi, pi)  # (draws, 7)
    assert z.shape == (draws, 7)
    torch.testing.assert_close(z[:, 0], (pi.log() - phi).argmin(-1))  # the true action
    p = phi.softmax(-1)
    for m in range(7):
        freq = torch.bincount(z[:, m], minlength=4) / draws
        assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / draws).sqrt()).all(), (m, freq, p)


def test_one_draw_is_the_papers_formula_over_all_swaps():
    torch.manual_seed(3)
    c = 4
    phi, pi = torch.randn(c), torch.distributions.Dirichlet(torch.ones(c)).sample()
    f = lambda k: float(k) ** 2 - 1.5 * k  # noqa: E731  (a cost of the category index)
    table = torch.zeros(c, c)
    for a, j in itertools.product(range(c), repeat=2):
        swapped = pi.clone()
        swapped[[a, j]] = pi[[j, a]]
        table[a, j] = f(int((swapped.log() - phi).argmin()))
    expected = ((table - table.mean(0)) * (1 / c - pi)).sum(-1)
    points = arsm_pseudo_actions(phi, pi.unsqueeze(0))[0]
    costs = torch.tensor([[f(int(k)) for k in points]])
    torch.testing.assert_close(arsm_logit_gradient(costs, pi.unsqueeze(0), 0)[0], expected)


def test_node_layout_and_forward_weights():
    theta = torch.tensor([0.2, -0.4, 0.9])
    z = ARSM("z", n_samples=5)(OneHotCategorical(logits=theta))
    assert z.shape == (20, 3) and z.plate_names == ["z"]
    weights = storch.extend.plain(z.plates[0].weight)
    torch.testing.assert_close(weights.reshape(5, 4).sum(-1), torch.full((5,), 0.2))
    torch.testing.assert_close(weights[:4], torch.tensor([1 / 3, 2 / 9, 2 / 9, 2 / 9]) / 5)


# ------------------------------------------------------------------------------ unbiasedness
@pytest.mark.parametrize("k,one_hot", [(3, True), (4, True), (4, False)])
def test_one_node_unbiased(k, one_hot):
    problem = ONE[k]
    (grads,) = replicated_gradients([problem.theta], R, problem.model(ARSM("z", n_samples=1), one_hot))
    assert_unbiased(grads, problem.exact(), label=f"C={k} one_hot={one_hot}")


def test_categorical_built_from_probs_gets_the_probs_gradient():
    problem = ONE[3]
    probs = problem.theta.softmax(-1)

    def model(p):
        storch.add_cost(problem.cost(ARSM("z")(OneHotCategorical(probs=p))), "f")

    (grads,) = replicated_gradients([probs], R, model)
    (exact,) = exact_grads(lambda p: (p / p.sum() * problem.cost(torch.eye(3))).sum(), [probs])
    assert_unbiased(grads, exact, label="probs")


@pytest.mark.parametrize("one_hot", [True, False])
def test_factorised_node_of_two_variables(pair, one_hot):
    (grads,) = replicated_gradients([pair.theta], R, pair.model(ARSM("z", n_samples=1), one_hot))
    assert_unbiased(grads, pair.exact(), label="two variables")


def test_minibatch_plate():
    problem = minibatch_categorical()
    (grads,) = replicated_gradients([problem.w], 1000, problem.model(ARSM("z")))
    assert_unbiased(grads, problem.exact(), label="minibatch")


NESTED = nested_categorical(3, 4)
CHAINS = {
    "arsm_then_sf": (lambda: ARSM("z1"), lambda: ScoreFunction("z2", n_samples=2, baseline_factory="batch_average")),
    "sf_then_arsm": (lambda: ScoreFunction("z1", n_samples=2, baseline_factory="batch_average"), lambda: ARSM("z2")),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_two_nested_nodes(name):
    m1, m2 = (f() for f in CHAINS[name])
    NESTED.assert_unbiased(NESTED.model(m1, m2), R, label=name)


# ------------------------------------------------------------------------------ second order (not estimated)
def assert_second_order_is_not_estimated(method) -> None:
    """Documented limit: the term (φ − stopgrad φ)·stopgrad(g) is linear in the normalised logits
    φ = log_softmax θ, so backward(create_graph=True) differentiates only the chain rule through
    log_softmax: the Hessian estimates are far from the exact Hessian."""
    problem = ONE[3]
    hessians = replicated_hessians(problem.theta, 2000, problem.model(method))
    exact = torch.autograd.functional.hessian(problem.expectation, problem.theta.clone()).reshape(-1)
    assert not check_unbiased(hessians, exact).passed


def test_second_derivatives_are_not_estimated():
    assert_second_order_is_not_estimated(ARSM("z"))


# ------------------------------------------------------------------------------ errors
def test_non_categorical_is_refused():
    with pytest.raises(ValueError, match=r"ARSM\('z'\) estimates gradients of categorical logits only, got Normal"):
        ARSM("z")(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match=r"ARSM\('z'\): a categorical needs at least 2 categories"):
        ARSM("z")(OneHotCategorical(logits=torch.zeros(1)))


def test_a_cost_without_the_logits_plates_is_refused_by_name():
    theta = torch.zeros(4, 3, requires_grad=True)
    z = ARSM("z")(OneHotCategorical(logits=storch.denote_independent(theta, 0, "data")))
    check_cost_without_logit_plates_is_refused(z, r"ARSM\('z'\): the logits carry plates \['data'\] that the cost 'f'")


# ------------------------------------------------------------------------------ copies and compile_step
class CategoricalModel(nn.Module):
    """A small categorical VAE: 4 binary inputs, two 3-way latent variables per datum."""

    def __init__(self, method) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.method = method
        self.encoder, self.decoder = nn.Linear(4, 6), nn.Linear(6, 4)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        x = storch.denote_independent(x, 0, "data")
        q = OneHotCategorical(logits=self.encoder(x).reshape(x.shape[:-1] + (2, 3)))
        z = self.method(q)
        decoded = self.decoder(z.reshape(z.shape[:-2] + (6,)))
        log_w = torch.distributions.Bernoulli(logits=decoded).log_prob(x).sum(-1) - q.log_prob(z).sum(-1)
        storch.add_cost(-log_w, "neg_elbo")
        return storch.backward()


def test_copies_pickles_and_state_dict():
    check_copies(lambda: CategoricalModel(ARSM("z", n_samples=2)), DATA)


def test_compile_step_replays_the_eager_step():
    check_compile_step(lambda: CategoricalModel(ARSM("z", n_samples=2)), DATA)
