"""Importance sampling (storch.sampling.importance.ImportanceSampling) with the score function.

Unbiasedness against exact gradients from enumeration (|mean − exact| ≤ 4.5 SE per coordinate) on
one node, several samples with a baseline, two nested nodes, a minibatch plate, a continuous node,
second derivatives; a variance check on a rare-event cost; and the errors.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.sampling.importance import ImportanceSampling
from storch.testing import assert_unbiased, check_unbiased, replicate, replicated_gradients

from problems import bernoulli, minibatch_bernoulli, nested_categorical, one_categorical, replicated_hessians

R = 3000

CATEGORICAL = one_categorical(5)
THETA, VALUES = CATEGORICAL.theta, CATEGORICAL.values
UNIFORM5 = OneHotCategorical(probs=torch.ones(5) / 5)


def tempered(p):
    return OneHotCategorical(logits=p.logits / 3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ScoreFunction("z", sampling_method=ImportanceSampling("z", 1, UNIFORM5)),
        lambda: ScoreFunction("z", sampling_method=ImportanceSampling("z", 3, tempered)),
        lambda: ScoreFunction(
            "z", sampling_method=ImportanceSampling("z", 3, tempered), baseline_factory="batch_average"
        ),
    ],
    ids=["fixed_uniform_n1", "tempered_n3", "tempered_n3_batch_average"],
)
def test_one_categorical_node(make):
    (grads,) = replicated_gradients([THETA], R, CATEGORICAL.model(make()))
    assert_unbiased(grads, CATEGORICAL.exact())


def test_cost_estimate_is_unbiased_and_weights_are_detached():
    theta = THETA.clone().requires_grad_()
    _, view = replicate(THETA, 4000)
    z = ScoreFunction("z", sampling_method=ImportanceSampling("z", 2, UNIFORM5))(OneHotCategorical(logits=view))
    assert not z.plate.weight.requires_grad
    storch.add_cost(((z * VALUES).sum(-1)) ** 2, "f")
    surrogate = storch.surrogate_loss()  # the mean of 4000 independent estimates of E f
    exact = (theta.softmax(-1) * VALUES**2).sum().item()
    # the weights p/(n r) are at most 5·max p / 2 ≈ 0.9 per sample, f ≤ 9: se well below 0.1
    assert abs(surrogate.item() - exact) < 0.15, (surrogate.item(), exact)


# ---------------------------------------------------------------- two nested nodes
def test_two_nested_nodes():
    problem = nested_categorical(3, 3)
    uniform3 = OneHotCategorical(probs=torch.ones(3) / 3)
    m1 = ScoreFunction("z1", sampling_method=ImportanceSampling("z1", 2, uniform3), baseline_factory="batch_average")
    m2 = ScoreFunction("z2", sampling_method=ImportanceSampling("z2", 2, tempered))
    problem.assert_unbiased(problem.model(m1, m2), R)


# ---------------------------------------------------------------- minibatch plate, several variables
def test_bernoulli_variables_under_a_minibatch_plate():
    # one fixed proposal Bernoulli(0.5) for both variables of every data point: expanded to the
    # target's batch shape (replicate, data, 2)
    problem = minibatch_bernoulli()  # f = Σ (z − t)² per data point
    method = ScoreFunction("z", sampling_method=ImportanceSampling("z", 2, Bernoulli(torch.tensor(0.5))))

    def weights_per_data_point(z):
        assert z.plate.weight.plate_names == ["z", "data", "replicate"]

    (grads,) = replicated_gradients([problem.w], R, problem.model(method, check=weights_per_data_point))
    assert_unbiased(grads, problem.exact())


# ---------------------------------------------------------------- a continuous node
def test_normal_node_with_a_wider_proposal():
    # the introduction example: e ~ N(b + c, 1), f = (a + b) e², ∂E f/∂c = 2(a + b)(b + c) = −11.08
    a, b, c = 5.0, -3.0, 0.23
    method = ScoreFunction("e", sampling_method=ImportanceSampling("e", 4, lambda p: Normal(p.loc.detach(), 2.0)))

    def model(c_):
        e = method(Normal(b + c_, 1.0))
        storch.add_cost((a + b) * e * e, "f")

    (grads,) = replicated_gradients([torch.tensor(c)], R, model)
    assert_unbiased(grads.unsqueeze(-1), torch.tensor([2 * (a + b) * (b + c)]))


# ---------------------------------------------------------------- second order
def test_hessian_unbiased():
    problem = bernoulli(interaction=2.0)
    method = ScoreFunction("x", sampling_method=ImportanceSampling("x", 2, Bernoulli(torch.tensor([0.5, 0.4, 0.7]))))
    hessians = replicated_hessians(problem.phi, 4000, problem.model(method))
    assert_unbiased(hessians, problem.exact_hessian().reshape(-1))


# ---------------------------------------------------------------- variance: a rare event
def test_proposal_that_finds_the_rare_event_reduces_variance():
    theta = torch.tensor([3.0, 0.0, 0.0, 0.0, -3.0])  # the last value has probability ≈ 0.0023
    rare = torch.tensor([0.0, 0.0, 0.0, 0.0, 100.0])
    to_rare = OneHotCategorical(probs=torch.tensor([0.3, 0.1, 0.1, 0.1, 0.4]))

    def run(method):
        def model(th):
            z = method(OneHotCategorical(logits=th))
            storch.add_cost((z * rare).sum(-1), "f")

        return replicated_gradients([theta], R, model)[0]

    plain = run(ScoreFunction("z", n_samples=2))
    importance = run(ScoreFunction("z", sampling_method=ImportanceSampling("z", 2, to_rare)))
    t = theta.clone().requires_grad_()
    exact = torch.autograd.grad((t.softmax(-1) * rare).sum(), t)[0]
    assert check_unbiased(importance, exact).passed
    assert (importance.var(0) < plain.var(0) / 20).all(), (importance.var(0), plain.var(0))


# ---------------------------------------------------------------- errors
def test_errors_name_the_problem():
    theta = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="event shape"):
        ScoreFunction("z", sampling_method=ImportanceSampling("z", 2, Categorical(logits=torch.zeros(3))))(
            OneHotCategorical(logits=theta)
        )
    with pytest.raises(TypeError, match="Distribution"):
        ImportanceSampling("z", 2, "uniform")
    with pytest.raises(TypeError, match="returned"):
        ScoreFunction("z", sampling_method=ImportanceSampling("z", 2, lambda p: p.logits))(OneHotCategorical(logits=theta))
    with pytest.raises(ValueError, match="broadcast"):
        ScoreFunction("z", sampling_method=ImportanceSampling("z", 2, OneHotCategorical(logits=torch.zeros(2, 3))))(
            OneHotCategorical(logits=torch.zeros(4, 3, requires_grad=True))
        )
    with pytest.raises(ValueError, match="probability 0"):
        ScoreFunction("z", sampling_method=ImportanceSampling("z", 20, OneHotCategorical(logits=torch.zeros(3))))(
            OneHotCategorical(logits=torch.tensor([0.0, 0.0, -float("inf")]))
        )
    with pytest.raises(ValueError, match="at least 1"):
        ImportanceSampling("z", 0, UNIFORM5)
    with pytest.raises(ValueError, match="score-function estimator"):
        storch.method.Reparameterization("e", sampling_method=ImportanceSampling("e", 2, Normal(0.0, 2.0)))(
            Normal(torch.zeros((), requires_grad=True), 1.0)
        )
