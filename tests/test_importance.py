"""Importance sampling (storch.sampling.importance.ImportanceSampling) with the score function.

Unbiasedness against exact gradients from enumeration (|mean − exact| ≤ 4.5 SE per coordinate) on
one node, several samples with a baseline, two nested nodes, a minibatch plate, a continuous node,
second derivatives; a variance check on a rare-event cost; and the errors.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.sampling.importance import ImportanceSampling
from storch.testing import assert_unbiased, check_unbiased, replicate, replicated_gradients

R = 3000

THETA = torch.tensor([0.2, -0.4, 0.9, 0.0, -1.0])
VALUES = torch.tensor([1.0, -2.0, 0.5, 3.0, 2.0])
UNIFORM5 = OneHotCategorical(probs=torch.ones(5) / 5)


def tempered(p):
    return OneHotCategorical(logits=p.logits / 3)


def exact_categorical_grad():
    theta = THETA.clone().requires_grad_()
    return torch.autograd.grad((theta.softmax(-1) * VALUES**2).sum(), theta)[0]


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
    method = make()

    def model(theta):
        z = method(OneHotCategorical(logits=theta))
        storch.add_cost(((z * VALUES).sum(-1)) ** 2, "f")

    (grads,) = replicated_gradients([THETA], R, model)
    assert_unbiased(grads, exact_categorical_grad())


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
THETA1 = torch.tensor([0.5, -0.3, 0.1])
THETA2 = torch.tensor([[0.2, 1.0, -0.5], [0.0, -1.0, 0.7], [1.2, 0.3, 0.0]])
TABLE = torch.tensor([[1.0, 4.0, -2.0], [0.5, 3.0, 2.5], [-1.0, 0.0, 6.0]])


def test_two_nested_nodes():
    uniform3 = OneHotCategorical(probs=torch.ones(3) / 3)
    m1 = ScoreFunction("z1", sampling_method=ImportanceSampling("z1", 2, uniform3), baseline_factory="batch_average")
    m2 = ScoreFunction("z2", sampling_method=ImportanceSampling("z2", 2, tempered))

    def model(theta1, theta2):
        z1 = m1(OneHotCategorical(logits=theta1))
        z2 = m2(OneHotCategorical(logits=(z1.unsqueeze(-1) * theta2).sum(-2)))
        assert [p.name for p in z2.plates] == ["z2", "z1", "replicate"]
        storch.add_cost(((z1.unsqueeze(-1) * TABLE) * z2.unsqueeze(-2)).sum((-1, -2)), "f")

    g1, g2 = replicated_gradients([THETA1, THETA2], R, model)
    t1, t2 = THETA1.clone().requires_grad_(), THETA2.clone().requires_grad_()
    e1, e2 = torch.autograd.grad((t1.softmax(-1)[:, None] * t2.softmax(-1) * TABLE).sum(), [t1, t2])
    assert_unbiased(g1, e1, label="theta1")
    assert_unbiased(g2, e2, label="theta2")


# ---------------------------------------------------------------- minibatch plate, several variables
X = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -1.0], [0.3, 0.3, 0.3], [-1.0, 0.5, 0.0]])
W = torch.tensor([[0.5, -0.2], [0.1, 0.4], [-0.3, 0.8]])
T = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.2, 0.7]])


def test_bernoulli_variables_under_a_minibatch_plate():
    # one fixed proposal Bernoulli(0.5) for both variables of every data point: expanded to the
    # target's batch shape (replicate, data, 2)
    method = ScoreFunction("z", sampling_method=ImportanceSampling("z", 2, Bernoulli(torch.tensor(0.5))))

    def model(w):
        x = storch.denote_independent(X, 0, "data")
        t = storch.denote_independent(T, 0, "data")
        z = method(Bernoulli(logits=(x.unsqueeze(-1) * w).sum(-2)))
        assert z.plate.weight.plate_names == ["z", "data", "replicate"]
        storch.add_cost(((z - t) ** 2).sum(-1), "f")

    (grads,) = replicated_gradients([W], R, model)
    w = W.clone().requires_grad_()
    p = torch.sigmoid(X @ w)
    exact = torch.autograd.grad((p * (1 - T) ** 2 + (1 - p) * T**2).sum(-1).mean(), w)[0]
    assert_unbiased(grads, exact)


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
PHI = torch.tensor([0.3, -0.5, 1.0])
TARGET = torch.tensor([0.49, 0.499, 0.8])


def test_hessian_unbiased():
    def cost(x):
        return ((x - TARGET) ** 2).sum(-1) + 2.0 * x[..., 0] * x[..., 1]

    def expectation(phi):
        p = torch.sigmoid(phi)
        total = 0.0
        for x in itertools.product([0.0, 1.0], repeat=3):
            x = torch.tensor(x)
            total = total + (p * x + (1 - p) * (1 - x)).prod() * cost(x)
        return total

    repeats = 4000
    leaf, view = replicate(PHI, repeats)
    method = ScoreFunction("x", sampling_method=ImportanceSampling("x", 2, Bernoulli(torch.tensor([0.5, 0.4, 0.7]))))
    x = method(Bernoulli(logits=view))
    storch.add_cost(cost(x), "f")
    storch.backward(create_graph=True)
    rows = [torch.autograd.grad(leaf.grad[:, i].sum(), leaf, retain_graph=True)[0] * repeats for i in range(3)]
    hessians = torch.stack(rows, 1).reshape(repeats, -1)
    assert_unbiased(hessians, torch.autograd.functional.hessian(expectation, PHI.clone()).reshape(-1))


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
