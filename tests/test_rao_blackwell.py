"""RaoBlackwellSF (storch.method.rao_blackwell): unbiasedness against exact enumeration on one node,
two nested nodes, a minibatch plate and several variables (one node each), second derivatives,
variance against the score function, edge cases and errors."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.method.rao_blackwell import RaoBlackwellSF
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from problems import (
    BERNOULLI_PHI,
    BERNOULLI_TARGET,
    minibatch_categorical,
    nested_categorical,
    one_categorical,
    replicated_hessians,
)

R = 3000

CATEGORICAL = one_categorical(6)
THETA, VALUES, categorical_exact = CATEGORICAL.theta, CATEGORICAL.values, CATEGORICAL.exact


@pytest.mark.parametrize("k,n_sampled", [(2, 1), (3, 1), (3, 2), (6, 1)])
@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot", "categorical"])
def test_one_categorical_node(k, n_sampled, one_hot):
    def check(z):
        assert z.n == k - 1 + n_sampled

    model = CATEGORICAL.model(RaoBlackwellSF("z", k=k, n_sampled=n_sampled), one_hot, check)
    (grads,) = replicated_gradients([THETA], R, model)
    assert_unbiased(grads, categorical_exact())
    if k == 6:  # everything but one value summed, the last one "sampled" with probability 1: exact
        assert torch.allclose(grads, categorical_exact().expand_as(grads), atol=1e-5)


def test_summed_values_and_weights():
    theta = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.0, 3.0, 1.0, -2.0]], requires_grad=True)
    logits = storch.denote_independent(theta, 0, "data")
    z = RaoBlackwellSF("z", k=3, n_sampled=2)(Categorical(logits=logits))
    assert z.plate_names == ["z", "data"]
    samples = z._tensor
    assert samples[:2].tolist() == [[0, 1], [3, 2]]  # per data point, its two most probable values
    p = theta.detach().softmax(-1)
    w = z.plate.weight._tensor
    assert torch.allclose(w[:2], p.gather(-1, samples[:2].T).T)
    rest = 1 - p.gather(-1, samples[:2].T).sum(-1)
    assert torch.allclose(w[2:], (rest / 2).expand(2, 2))
    assert torch.allclose(w.sum(0), torch.ones(2))
    assert not w.requires_grad
    # the samples come from the values outside the summed set
    assert not (samples[2:, 0] == 0).any() and not (samples[2:, 0] == 3).any()


# ---------------------------------------------------------------- two nested nodes
NESTED_PROBLEM = nested_categorical(4, 5)


@pytest.mark.parametrize("second", ["rao_blackwell", "score_function"])
def test_two_nested_nodes(second):
    m1 = RaoBlackwellSF("z1", k=2)
    m2 = RaoBlackwellSF("z2", k=3) if second == "rao_blackwell" else ScoreFunction("z2", n_samples=2)
    NESTED_PROBLEM.assert_unbiased(NESTED_PROBLEM.model(m1, m2), R)


# ---------------------------------------------------------------- a minibatch plate
def test_categorical_under_a_minibatch_plate():
    problem = minibatch_categorical()
    (grads,) = replicated_gradients([problem.w], R, problem.model(RaoBlackwellSF("z", k=2)))
    assert_unbiased(grads, problem.exact())


def test_bernoulli_with_k_2_is_exact():
    phi, target = BERNOULLI_PHI, BERNOULLI_TARGET

    def model(p):
        data = storch.denote_independent(p, -1, "var")  # three independent variables as a plate
        t = storch.denote_independent(target, 0, "var")
        x = RaoBlackwellSF("x", k=2)(Bernoulli(logits=data))
        storch.add_cost((x - t) ** 2, "f")

    (grads,) = replicated_gradients([phi], 5, model)
    p = torch.sigmoid(phi)
    exact = p * (1 - p) * ((1 - target) ** 2 - target**2) / 3  # the plate "var" is a mean
    assert torch.allclose(grads, exact.expand(5, 3), atol=1e-6)


# ---------------------------------------------------------------- several variables, one node each
def test_two_independent_variables_feeding_one_cost():
    theta_a = torch.tensor([0.3, -0.2, 1.1, 0.0])
    theta_b = torch.tensor([-0.5, 0.4, 0.2])
    table = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, -1.0], [2.0, 1.0, 4.0], [-3.0, 2.0, 0.0]])

    def model(ta, tb):
        a = RaoBlackwellSF("a", k=2)(OneHotCategorical(logits=ta))
        b = RaoBlackwellSF("b", k=2, n_sampled=2)(OneHotCategorical(logits=tb))
        storch.add_cost(((a.unsqueeze(-1) * table) * b.unsqueeze(-2)).sum((-1, -2)) ** 2, "f")

    ga, gb = replicated_gradients([theta_a, theta_b], R, model)
    ta, tb = theta_a.clone().requires_grad_(), theta_b.clone().requires_grad_()
    ea, eb = torch.autograd.grad((ta.softmax(-1)[:, None] * tb.softmax(-1) * table**2).sum(), [ta, tb])
    assert_unbiased(ga, ea, label="a")
    assert_unbiased(gb, eb, label="b")


def test_several_variables_in_one_node_is_an_error():
    with pytest.raises(ValueError, match=r"one variable per plate element.*denote_independent"):
        RaoBlackwellSF("z", k=2)(OneHotCategorical(logits=torch.zeros(3, 4, requires_grad=True)))


# ---------------------------------------------------------------- second order
def test_hessian_unbiased():
    hessians = replicated_hessians(THETA, 4000, CATEGORICAL.model(RaoBlackwellSF("z", k=3)))
    assert_unbiased(hessians, torch.autograd.functional.hessian(CATEGORICAL.expectation, THETA.clone()).reshape(-1))


# ---------------------------------------------------------------- variance
def test_variance_below_the_score_function():
    theta = torch.tensor([3.0, 1.5, 0.0, -0.5, -1.0, 0.0])  # concentrated on the first two values

    def run(method):
        return replicated_gradients([theta], 10000, CATEGORICAL.model(method))[0]  # skewed estimates: more replicates

    exact = categorical_exact(theta)
    rb = run(RaoBlackwellSF("z", k=3))
    sf1 = run(ScoreFunction("z", n_samples=1))
    sf3 = run(ScoreFunction("z", n_samples=3))  # the same number of cost evaluations
    for g in (rb, sf1, sf3):
        assert check_unbiased(g, exact).passed
    total = {name: g.var(0).sum().item() for name, g in {"rb": rb, "sf1": sf1, "sf3": sf3}.items()}
    # measured (three seeds): rb 0.22–0.25, sf3 1.9–2.1, sf1 5.7–6.1 (total variance over the coordinates)
    assert total["rb"] < total["sf3"] / 4 < total["sf1"] / 4, total


# ---------------------------------------------------------------- edge cases and errors
def test_values_of_probability_zero_give_finite_gradients():
    theta = torch.tensor([0.0, 1.0, -float("inf"), -float("inf")], requires_grad=True)
    z = RaoBlackwellSF("z", k=3)(OneHotCategorical(logits=theta))  # only 2 values can occur
    storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum(-1), "f")
    estimate = storch.backward()
    p = torch.tensor([0.0, 1.0]).softmax(-1)
    assert torch.isclose(estimate, p[0] + 2 * p[1])
    assert torch.isfinite(theta.grad).all()
    assert torch.allclose(theta.grad[:2], torch.tensor([-1.0, 1.0]) * p[0] * p[1])


def test_errors():
    with pytest.raises(ValueError, match="only 4 values"):
        RaoBlackwellSF("z", k=5)(OneHotCategorical(logits=torch.zeros(4, requires_grad=True)))
    with pytest.raises(ValueError, match="no enumerable support"):
        RaoBlackwellSF("z", k=2)(Normal(torch.zeros((), requires_grad=True), 1.0))
    with pytest.raises(ValueError, match="at least 1"):
        RaoBlackwellSF("z", k=0)
