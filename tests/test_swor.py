"""Sampling without replacement (Gumbel-top-k, stochastic beam search) and ScoreFunctionWOR.

Unbiasedness against exact gradients from enumeration (|mean − exact| ≤ 4.5 SE per coordinate), the
bias of the normalised variant, and the set itself (distinct values, the whole support when k covers
it, the first element distributed as p).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.method.wor import ScoreFunctionWOR
from storch.sampling.swor import SampleWithoutReplacement, log_inclusion_probability
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

R = 3000


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(2024)
    storch.reset()
    yield
    storch.reset()


# ---------------------------------------------------------------- the sampled set
THETA = torch.tensor([0.2, -0.4, 0.9, 0.0, 1.0])
VALUES = torch.tensor([1.0, -2.0, 0.5, 3.0, 2.0])


def categorical_exact(theta=THETA):
    t = theta.clone().requires_grad_()
    return torch.autograd.grad((t.softmax(-1) * VALUES**2).sum(), t)[0]


def test_samples_are_distinct_per_plate_combination():
    logits = torch.randn(50, 6)
    s = SampleWithoutReplacement("z", k=4).sample(Categorical(logits=logits), (storch.plate.Plate("b", 50),), False)
    assert s.shape == (4, 50)
    assert all(len(set(s[:, b].tolist())) == 4 for b in range(50))


def test_k_at_least_support_gives_the_whole_support_with_weights_p():
    theta = torch.tensor([0.3, -1.0, 2.0])
    z = ScoreFunctionWOR("z", k=5)(Categorical(logits=theta))
    assert z.n == 3 and sorted(z._tensor.tolist()) == [0, 1, 2]
    weights = z.plate.weight._tensor
    torch.testing.assert_close(weights, theta.softmax(-1)[z._tensor])


def test_joint_values_of_several_variables_are_distinct():
    # three Bernoulli variables: 8 joint values, sets of 5 distinct joint configurations
    z = ScoreFunctionWOR("z", k=5)(Bernoulli(logits=torch.tensor([0.1, -0.5, 2.0])))
    assert z.shape == (5, 3)
    assert len({tuple(row) for row in z._tensor.tolist()}) == 5


def test_first_element_is_distributed_as_p():
    # the largest perturbed value is a Gumbel-max sample
    n = 20000
    s = SampleWithoutReplacement("z", k=3).sample(Categorical(logits=THETA.expand(n, 5)), (storch.plate.Plate("b", n),), False)
    freq = torch.bincount(s[0], minlength=5).double() / n
    p = THETA.softmax(-1).double()
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4.5 * se).all(), (freq, p)


def test_log_inclusion_probability():
    log_p, kappa = torch.tensor([-0.5, -3.0, -60.0]), torch.tensor(0.2)
    expected = torch.log(-torch.expm1(-torch.exp(log_p.double() - 0.2)))  # accurate in float64
    torch.testing.assert_close(log_inclusion_probability(log_p, kappa).double(), expected, rtol=1e-5, atol=0)


def test_importance_weights_estimate_the_mean_unbiasedly():
    # E[Σ_S p(s)/q_κ(s) f(s)] = Σ_s p(s) f(s), for f = one-hot indicators (the inclusion identity)
    n = 20000
    sampler = SampleWithoutReplacement("z", k=2)
    _, state = sampler.draw(Categorical(logits=THETA.expand(n, 5)), 1)
    w = sampler.weights(state)  # (2, n)
    est = torch.zeros(n, 5).scatter_add_(1, state.tokens.T, w.T)
    assert_unbiased(est, THETA.softmax(-1), label="Σ_S p/q 1[s=j]")


def test_errors():
    with pytest.raises(TypeError, match="finite, enumerable support"):
        ScoreFunctionWOR("z", k=2)(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match="k must be at least 1"):
        SampleWithoutReplacement("z", k=0)


# ---------------------------------------------------------------- unbiasedness, one node
ONE_NODE = {
    "wor_k1": lambda: ScoreFunctionWOR("z", k=1),
    "wor_k2": lambda: ScoreFunctionWOR("z", k=2),
    "wor_k4": lambda: ScoreFunctionWOR("z", k=4),
    "score_function_with_swor_proposal": lambda: ScoreFunction("z", sampling_method=SampleWithoutReplacement("z", 3)),
}


@pytest.mark.parametrize("name", list(ONE_NODE))
@pytest.mark.parametrize("one_hot", [True, False], ids=["onehot", "categorical"])
def test_one_categorical_node_unbiased(name, one_hot):
    method = ONE_NODE[name]()

    def model(theta):
        if one_hot:
            z = method(OneHotCategorical(logits=theta))
            value = (z * VALUES).sum(-1)
        else:
            z = method(Categorical(logits=theta))
            value = VALUES[z]
        storch.add_cost(value**2, "f")

    (grads,) = replicated_gradients([THETA], R, model)
    assert_unbiased(grads, categorical_exact(), label=name)


PHI = torch.tensor([0.3, -0.5, 1.0])
TARGET = torch.tensor([0.49, 0.499, 0.8])


def bernoulli_joint_exact():
    phi = PHI.clone().requires_grad_()
    total = 0.0
    for x in itertools.product([0.0, 1.0], repeat=3):
        x = torch.tensor(x)
        prob = Bernoulli(logits=phi).log_prob(x).sum().exp()
        total = total + prob * (((x - TARGET) ** 2).sum() + 2.0 * x[0] * x[1])
    return phi, total


@pytest.mark.parametrize("k", [2, 5])
def test_several_variables_sampled_jointly_unbiased(k):
    method = ScoreFunctionWOR("x", k=k)

    def model(phi):
        x = method(Bernoulli(logits=phi))
        storch.add_cost(((x - TARGET) ** 2).sum(-1) + 2.0 * x[..., 0] * x[..., 1], "f")

    (grads,) = replicated_gradients([PHI], R, model)
    phi, total = bernoulli_joint_exact()
    assert_unbiased(grads, torch.autograd.grad(total, phi)[0], label=f"joint k={k}")


def test_hessian_unbiased():
    method = ScoreFunctionWOR("x", k=3)
    repeats = 3000
    leaf, view = storch.testing.replicate(PHI, repeats)
    x = method(Bernoulli(logits=view))
    storch.add_cost(((x - TARGET) ** 2).sum(-1) + 2.0 * x[..., 0] * x[..., 1], "f")
    storch.backward(create_graph=True)
    rows = [torch.autograd.grad(leaf.grad[:, i].sum(), leaf, retain_graph=True)[0] * repeats for i in range(3)]
    hessians = torch.stack(rows, 1)
    exact = torch.autograd.functional.hessian(lambda p: _joint_expectation(p), PHI.clone())
    assert_unbiased(hessians.reshape(repeats, -1), exact.reshape(-1), label="hessian")


def _joint_expectation(phi):
    total = 0.0
    for x in itertools.product([0.0, 1.0], repeat=3):
        x = torch.tensor(x)
        prob = (torch.sigmoid(phi) * x + torch.sigmoid(-phi) * (1 - x)).prod()
        total = total + prob * (((x - TARGET) ** 2).sum() + 2.0 * x[0] * x[1])
    return total


# ---------------------------------------------------------------- two nested nodes, minibatch plate
THETA1 = torch.tensor([0.5, -0.3, 0.1])
THETA2 = torch.tensor([[0.2, 1.0, -0.5], [0.0, -1.0, 0.7], [1.2, 0.3, 0.0]])
TABLE = torch.tensor([[1.0, 4.0, -2.0], [0.5, 3.0, 2.5], [-1.0, 0.0, 6.0]])


@pytest.mark.parametrize(
    "make",
    [
        (lambda: ScoreFunctionWOR("z1", k=2), lambda: ScoreFunctionWOR("z2", k=2)),
        (lambda: ScoreFunctionWOR("z1", k=2), lambda: ScoreFunction("z2", n_samples=2)),
        (lambda: ScoreFunction("z1", n_samples=2), lambda: ScoreFunctionWOR("z2", k=2)),
    ],
    ids=["wor_wor", "wor_sf", "sf_wor"],
)
def test_two_nested_nodes_unbiased(make):
    m1, m2 = (f() for f in make)

    def model(theta1, theta2):
        z1 = m1(OneHotCategorical(logits=theta1))
        z2 = m2(OneHotCategorical(logits=(z1.unsqueeze(-1) * theta2).sum(-2)))
        storch.add_cost(((z1.unsqueeze(-1) * TABLE) * z2.unsqueeze(-2)).sum((-1, -2)), "f")

    g1, g2 = replicated_gradients([THETA1, THETA2], R, model)
    t1, t2 = THETA1.clone().requires_grad_(), THETA2.clone().requires_grad_()
    e1, e2 = torch.autograd.grad((t1.softmax(-1)[:, None] * t2.softmax(-1) * TABLE).sum(), [t1, t2])
    assert_unbiased(g1, e1, label="theta1")
    assert_unbiased(g2, e2, label="theta2")


def test_minibatch_plate_unbiased():
    X = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -1.0], [0.3, 0.3, 0.3], [-1.0, 0.5, 0.0]])
    W = torch.tensor([[0.5, -0.2, 0.0], [0.1, 0.4, 0.3], [-0.3, 0.8, -0.6]])
    method = ScoreFunctionWOR("z", k=2)

    def model(w):
        x = storch.denote_independent(X, 0, "data")
        z = method(OneHotCategorical(logits=(x.unsqueeze(-1) * w).sum(-2)))
        assert z.plate_names == ["z", "data", "replicate"]
        storch.add_cost(((z * VALUES[:3]).sum(-1) - x.sum(-1)) ** 2, "f")

    (grads,) = replicated_gradients([W], R, model)
    w = W.clone().requires_grad_()
    p = (X @ w).softmax(-1)  # (4, 3)
    f = (VALUES[:3][None, :] - X.sum(-1, keepdim=True)) ** 2
    exact = torch.autograd.grad((p * f).sum(-1).mean(), w)[0]
    assert_unbiased(grads, exact, label="minibatch")


# ---------------------------------------------------------------- the normalised (biased) variant
def _categorical_estimates(k, biased, repeats=R):
    method = ScoreFunctionWOR("z", k=k, biased=biased)

    def model(theta):
        z = method(OneHotCategorical(logits=theta))
        storch.add_cost(((z * VALUES).sum(-1)) ** 2, "f")

    return replicated_gradients([THETA], repeats, model)[0]


def test_biased_variant_is_exact_when_k_covers_the_support():
    for biased in (False, True):
        grads = _categorical_estimates(5, biased, repeats=20)
        torch.testing.assert_close(grads, categorical_exact().expand(20, 5), rtol=1e-4, atol=1e-5)


def test_biased_variant_with_k1_gives_zero_gradient():
    # one sample: normalised weight 1 and the built-in baseline equals its own cost
    grads = _categorical_estimates(1, True, repeats=50)
    assert grads.abs().max() < 1e-6


def test_biased_variant_bias_shrinks_with_k():
    # measured bias ‖mean − exact‖ (3000 estimates; ‖exact‖ = 1.21): k=2 ≈ 0.45, k=3 ≈ 0.18, k=4 ≈ 0.06
    exact = categorical_exact()
    bias = {}
    for k in (2, 3, 4):
        report = check_unbiased(_categorical_estimates(k, True), exact)
        bias[k] = (report.mean - report.exact).norm().item()
        assert not report.passed, f"k={k}: the normalised estimator should be measurably biased"
    assert bias[2] > bias[3] > bias[4]


def test_biased_variant_has_lower_variance():
    unbiased = _categorical_estimates(3, False).var(0).sum()
    biased = _categorical_estimates(3, True).var(0).sum()
    assert biased < 0.5 * unbiased, (biased, unbiased)
