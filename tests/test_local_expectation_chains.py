"""Chains of local-expectation nodes on one evaluation plate: the sum of the nodes' points, unbiased
first and second derivatives against exact enumeration, the same estimates as the per-node form on
the same draws, and refusals before allocating.

Each statistical test draws R independent estimates in one backward pass (storch.testing) and
requires |mean − exact| ≤ 4.5 standard errors per coordinate (storch.testing.assert_unbiased).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributions import Bernoulli, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.method.local_expectation import (
    LocalExpectation,
    LocalExpectationMemoryError,
    LocalExpectationPlate,
)
from storch.testing import assert_unbiased, replicated_gradients

from problems import replicated_hessians

pytestmark = pytest.mark.seed(2025)

R = 3000


def assert_first_and_second_order(params, model, expectation, label):
    """Gradient and Hessian estimates of ``model`` unbiased against ``expectation``'s, enumerated."""
    (grads,) = replicated_gradients([params], R, model)
    assert_unbiased(grads, torch.autograd.functional.jacobian(expectation, params), label=label)
    hessians = replicated_hessians(params, 4000, model)
    exact = torch.autograd.functional.hessian(expectation, params)
    assert_unbiased(hessians, exact.reshape(-1), label=f"{label} hessian")

# ---------------------------------------------------------------- a Bernoulli chain z1 → z2 under data
# θ = (φ (2), W (2×2), b (2)); z1 ~ Bern(σ(x·φ)) per datum x, z2 | z1 ~ Bern(σ(z1 W + b));
# f = an interacting cost of both layers that also depends on W directly (a pathwise part)
DATA = torch.tensor([1.0, -0.5, 2.0])
THETA = torch.tensor([0.4, -0.7, 0.9, -0.3, 0.5, 1.1, -0.2, 0.3])


def unpack(theta):
    return theta[..., :2], theta[..., 2:6].unflatten(-1, (2, 2)), theta[..., 6:8]


def chain_cost(z1, z2, w):
    t1, t2 = torch.tensor([0.3, 0.8]), torch.tensor([0.6, 0.2])
    cost = ((z1 - t1) ** 2).sum(-1) + ((z2 - t2) ** 2).sum(-1) + 1.5 * z1[..., 0] * z2[..., 1]
    return cost - 0.7 * z2[..., 0] * z1[..., 1] + 0.3 * (w.sum((-1, -2)) * z2[..., 0])


def exact_chain(theta):
    phi, w, b = unpack(theta)
    total = 0.0
    for x in DATA:
        p1 = torch.sigmoid(x * phi)
        for bits1 in itertools.product([0.0, 1.0], repeat=2):
            z1 = torch.tensor(bits1)
            q1 = (p1 * z1 + (1 - p1) * (1 - z1)).prod()
            p2 = torch.sigmoid(z1 @ w + b)
            for bits2 in itertools.product([0.0, 1.0], repeat=2):
                z2 = torch.tensor(bits2)
                q2 = (p2 * z2 + (1 - p2) * (1 - z2)).prod()
                total = total + q1 * q2 * chain_cost(z1, z2, w)
    return total / len(DATA)


def chain_model(m1, m2, check_plates=True):
    def model(theta):
        phi, w, b = unpack(theta)
        x = storch.denote_independent(DATA.unsqueeze(-1), 0, "data")  # (data, 1)
        z1 = m1(Bernoulli(logits=x * phi))
        z2 = m2(Bernoulli(logits=(z1.unsqueeze(-2) @ w).squeeze(-2) + b))
        if check_plates:
            assert z2.plate_names == ["z2", "data", "replicate"], z2.plate_names
            assert z2.plates[0].size == 1 + 2 + 2  # the sample, z1's two flips, z2's two flips
        storch.add_cost(chain_cost(z1, z2, w), "f")

    return model


def test_chain_points_add_up():
    x = LocalExpectation("x", n_samples=3)(Bernoulli(logits=torch.zeros(200)))
    y = LocalExpectation("y")(Bernoulli(logits=x[..., :100] - 0.5))
    assert isinstance(y.plates[0], LocalExpectationPlate) and y.plates[0].ancestor is x.plates[0]
    assert (x.n, y.n) == (3 * 201, 3 * (201 + 100))
    both = x.sum(-1) + y.sum(-1)  # x is re-indexed to y's plate: no product
    assert both.plate_names == ["y"] and both.shape == (3 * 301,)
    # at y's own points x is the group's sample; at the upstream points x is as at that point
    xs, ys = x._tensor.reshape(3, 201, 200), y._tensor.reshape(3, 301, 100)
    assert torch.equal(both._tensor.reshape(3, 301)[:, 201:], (xs[:, :1].sum(-1) + ys[:, 201:].sum(-1)))
    # y's own changes flip one variable of its point-0 draw each
    assert torch.equal((ys[:, 201:] != ys[:, :1]).sum(-1), torch.ones(3, 100, dtype=torch.long))
    storch.reset()


def test_chain_is_unbiased_first_and_second_order():
    model = chain_model(LocalExpectation("z1"), LocalExpectation("z2"))
    assert_first_and_second_order(THETA, model, exact_chain, "z1 -> z2, data plate")


@pytest.mark.parametrize("pair", ["le_sf", "sf_le"])
def test_chain_with_score_function_under_data(pair):
    le = lambda name: LocalExpectation(name)  # noqa: E731
    sf = lambda name: ScoreFunction(name, n_samples=2, baseline_factory="batch_average")  # noqa: E731
    m1, m2 = (le("z1"), sf("z2")) if pair == "le_sf" else (sf("z1"), le("z2"))
    assert_first_and_second_order(THETA, chain_model(m1, m2, check_plates=False), exact_chain, pair)


# ---------------------------------------------------------------- three categorical nodes in a chain
L1 = torch.tensor([0.2, -0.4, 0.7])
L23 = torch.tensor([[0.5, 0.0, -0.8], [1.0, -0.3, 0.2], [-0.6, 0.4, 0.1]])
TABLE = torch.arange(27.0).reshape(3, 3, 3).sin() * 3.0
PARAMS3 = torch.cat([L1, L23.reshape(-1)])


def three_model(theta):
    l1, l23 = theta[..., :3], theta[..., 3:].unflatten(-1, (3, 3))
    z1 = LocalExpectation("z1")(OneHotCategorical(logits=l1))
    z2 = LocalExpectation("z2")(OneHotCategorical(logits=(z1.unsqueeze(-1) * l23).sum(-2)))
    z3 = LocalExpectation("z3")(OneHotCategorical(logits=(z2.unsqueeze(-1) * l23).sum(-2) * 0.5))
    assert z3.plate_names == ["z3", "replicate"] and z3.plates[0].size == 1 + 2 + 2 + 2
    cost = (z1[..., :, None, None] * z2[..., None, :, None] * z3[..., None, None, :] * TABLE).sum((-1, -2, -3))
    storch.add_cost(cost, "f")


def exact_three(theta):
    l1, l23 = theta[:3], theta[3:].reshape(3, 3)
    p1, p2 = l1.softmax(-1), l23.softmax(-1)
    p3 = (0.5 * l23).softmax(-1)
    return (p1[:, None, None] * p2[:, :, None] * p3[None, :, :] * TABLE).sum()


def test_three_node_chain_first_and_second_order():
    assert_first_and_second_order(PARAMS3, three_model, exact_three, "3-chain")


# ---------------------------------------------------------------- same estimates as per-coordinate sums
def test_same_gradient_as_evaluating_every_value_on_the_same_draws():
    """The estimator as the 1 + D·K form states it, Σ_d Σ_k ∇p_d(k) f(x≠d, k) with the sample's own
    value evaluated again, on the same draws: equal up to rounding."""
    logits0 = torch.tensor([[0.3, -0.5, 1.0, 0.2], [-1.0, 0.4, 0.0, 0.8]])  # (data 2, D 4)
    target = torch.tensor([0.49, 0.499, 0.8, 0.1])

    def f(x, logits):
        return ((x - target) ** 2).sum(-1) + 2.0 * x[..., 0] * x[..., 1] + (x * logits).sum(-1) ** 2

    torch.manual_seed(5)
    logits = logits0.clone().requires_grad_()
    per_datum = storch.denote_independent(logits, 0, "data")
    x = LocalExpectation("x", n_samples=3)(Bernoulli(logits=per_datum))
    storch.add_cost(f(x, per_datum), "f")
    storch.backward()

    torch.manual_seed(5)
    samples = Bernoulli(logits=logits0).sample((3,))  # the draws the node made: (3, data, D)
    ref = logits0.clone().requires_grad_()
    p = torch.sigmoid(ref)
    total = f(samples, ref).mean(0)  # the pathwise part at the samples
    for d, k in itertools.product(range(4), (0.0, 1.0)):
        point = samples.clone()
        point[..., d] = k
        p_k = p[:, d] if k == 1.0 else 1 - p[:, d]
        total = total + ((p_k - p_k.detach()) * f(point, ref)).mean(0)
    (expected,) = torch.autograd.grad(total.mean(), ref)  # the data plate's weight: 1/2 each
    assert torch.allclose(logits.grad, expected, atol=1e-5), (logits.grad, expected)


# ---------------------------------------------------------------- variance: joint against nested
def test_joint_form_has_no_more_variance_than_nested():
    """First-order estimates of the chain: the joint plate's common random numbers make the
    downstream draws at z1's changes equal where z1's change does not move them (measured, two
    seeds: total variance joint 0.103–0.106, nested 0.132–0.134; for z1's parameters φ alone
    0.030 against 0.058)."""
    joint = replicated_gradients([THETA], R, chain_model(LocalExpectation("z1"), LocalExpectation("z2")))[0]
    nested = replicated_gradients(
        [THETA], R, chain_model(LocalExpectation("z1"), LocalExpectation("z2", joint=False), check_plates=False)
    )[0]
    exact = torch.autograd.functional.jacobian(exact_chain, THETA)
    assert_unbiased(nested, exact, label="nested")
    assert joint.var(0).sum() <= 1.1 * nested.var(0).sum(), (joint.var(0).sum(), nested.var(0).sum())


# ---------------------------------------------------------------- loud refusals
def test_nested_points_that_cannot_fit_are_refused_before_allocating():
    x = LocalExpectation("x")(Bernoulli(logits=torch.zeros(3000)))
    with pytest.raises(LocalExpectationMemoryError, match=r"3001 evaluation points per sample.*nested local"):
        LocalExpectation("y", joint=False)(Bernoulli(logits=x - 0.5))
    y = LocalExpectation("y")(Bernoulli(logits=x - 0.5))  # the joint form: 6001 points
    assert y.n == 6001
    storch.reset()


def test_downstream_node_with_several_samples_is_nested():
    x = LocalExpectation("x")(Bernoulli(logits=torch.zeros(2)))
    y = LocalExpectation("y", n_samples=2)(Bernoulli(logits=x - 0.5))
    assert y.plate_names == ["y", "x"] and y.n == 2 * 3
    storch.reset()


# ---------------------------------------------------------------- branches and siblings on one plate
# θ = (a (2), B (2×2), c (2), V (2)); z1 ~ Bern(σ(a)); z2 | z1 ~ Bern(σ(z1 B)); z3 | z1 ~ Bern(σ(z1 + c));
# w | z1 ~ Bern(σ(z1·V)) (one bit, score function with a baseline); s ~ Bern(σ(c)) a sibling of z1
BRANCH = torch.tensor([0.3, -0.6, 0.8, -0.4, 0.2, 0.9, -0.5, 0.4, 0.7, -0.3])


def bits(k):
    return [torch.tensor(b) for b in itertools.product([0.0, 1.0], repeat=k)]


def bern(p, x):
    return (p * x + (1 - p) * (1 - x)).prod(-1)


def branch_parts(theta):
    return theta[..., :2], theta[..., 2:6].unflatten(-1, (2, 2)), theta[..., 6:8], theta[..., 8:10]


def branch_cost(z1, z2, z3, w):
    return (z1[..., 0] - 2 * z2[..., 1] + z3[..., 0] * z2[..., 0] + 1.5 * w[..., 0] * z3[..., 1]) ** 2 + z1[..., 1]


def exact_branch(theta):
    a, b, c, v = branch_parts(theta)
    total = 0.0
    for z1 in bits(2):
        p2, p3, pw = torch.sigmoid(z1 @ b), torch.sigmoid(z1 + c), torch.sigmoid((z1 * v).sum(-1, keepdim=True))
        for z2, z3, w in itertools.product(bits(2), bits(2), bits(1)):
            prob = bern(torch.sigmoid(a), z1) * bern(p2, z2) * bern(p3, z3) * bern(pw, w)
            total = total + prob * branch_cost(z1, z2, z3, w)
    return total


def branch_model(theta):
    """z2 and z3 both come from z1, and w (score function) is drawn from z1's points between them."""
    a, b, c, v = branch_parts(theta)
    z1 = LocalExpectation("z1")(Bernoulli(logits=a))
    z2 = LocalExpectation("z2")(Bernoulli(logits=(z1.unsqueeze(-2) @ b).squeeze(-2)))
    w = ScoreFunction("w", n_samples=2, baseline_factory="batch_average")(
        Bernoulli(logits=(z1 * v).sum(-1, keepdim=True)))
    z3 = LocalExpectation("z3")(Bernoulli(logits=z1 + c))  # extends the chain's newest step, z2's
    assert z3.plates[0].ancestor is z2.plates[0] and z3.plates[0].size == 1 + 2 + 2 + 2
    storch.add_cost(branch_cost(z1, z2, z3, w), "f")


def test_branches_and_a_score_function_node_between_them():
    assert_first_and_second_order(BRANCH, branch_model, exact_branch, "branches")


SIBLING_DATA = torch.tensor([[0.5], [-1.0]])


def exact_siblings(theta):
    a, b, c, _ = branch_parts(theta)
    total = 0.0
    for x in SIBLING_DATA:
        for z1, s in itertools.product(bits(2), bits(2)):
            prob = bern(torch.sigmoid(a * x), z1) * bern(torch.sigmoid(c), s)
            total = total + prob * ((z1 - s) @ b.sum(0) + z1[0] * s[1]) ** 2
    return total / len(SIBLING_DATA)


def sibling_model(theta):
    a, b, c, _ = branch_parts(theta)
    x = storch.denote_independent(SIBLING_DATA, 0, "data")
    z1 = LocalExpectation("z1")(Bernoulli(logits=a * x))
    s = LocalExpectation("s")(Bernoulli(logits=c), joint_with=z1)  # not computed from z1: a sibling
    assert s.plate_names == ["s", "replicate"] and s.plates[0].size == 1 + 2 + 2
    storch.add_cost((((z1 - s) * b.sum(-2)).sum(-1) + z1[..., 0] * s[..., 1]) ** 2, "f")


def test_siblings_joined_explicitly_are_unbiased_under_a_data_plate():
    assert_first_and_second_order(BRANCH, sibling_model, exact_siblings, "siblings")


def test_joint_with_is_checked():
    z = ScoreFunction("z")(Bernoulli(logits=torch.zeros(2)))
    with pytest.raises(TypeError, match="joint_with must be the samples of a LocalExpectation node"):
        LocalExpectation("s")(Bernoulli(logits=torch.zeros(2)), joint_with=z)
    b = LocalExpectation("b")(Bernoulli(logits=torch.zeros(2)))
    with pytest.raises(ValueError, match="needs joint=True and n_samples=1"):
        LocalExpectation("s", n_samples=2)(Bernoulli(logits=torch.zeros(2)), joint_with=b)
    a = LocalExpectation("a")(Bernoulli(logits=torch.zeros(2)))
    with pytest.raises(ValueError, match="joint_with names the chain of 'b', but the distribution is computed from "
                                         "the chain of 'a'"):
        LocalExpectation("s")(Bernoulli(logits=a - 0.5), joint_with=b)
    late = ScoreFunction("late")(Bernoulli(logits=torch.zeros(2)))  # drawn after b's chain began
    with pytest.raises(ValueError, match=r"cannot join the points of 'b'.*\['late'\]"):
        LocalExpectation("s")(Bernoulli(logits=late), joint_with=b)
    storch.reset()


# ---------------------------------------------------------------- the ELBO of a two-layer network, as users write it
X2 = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])  # two data points of 3 pixels
SBN2 = torch.linspace(-0.8, 0.9, 31)  # q1 (2×3, 2), q2 (2×2, 2), p1 (2×2, 2), px (3×2, 3), prior (2)


def sbn2_parts(theta):
    sizes = [(2, 3), (2,), (2, 2), (2,), (2, 2), (2,), (3, 2), (3,), (2,)]
    out, i = [], 0
    for shape in sizes:
        k = math.prod(shape)
        out.append(theta[..., i: i + k].unflatten(-1, shape))
        i += k
    return out


def linear(w, b, x):
    return (w * x.unsqueeze(-2)).sum(-1) + b


def sbn2_model(theta):
    """q(z1|x) q(z2|z1), p(z2) p(z1|z2) p(x|z1), 2 + 2 bits, each layer with LocalExpectation."""
    wq1, bq1, wq2, bq2, wp1, bp1, wpx, bpx, prior = sbn2_parts(theta)
    x = storch.denote_independent(X2, 0, "data")
    q1 = Bernoulli(logits=linear(wq1, bq1, x))
    z1 = LocalExpectation("z1")(q1)
    q2 = Bernoulli(logits=linear(wq2, bq2, z1))
    z2 = LocalExpectation("z2")(q2)
    assert q2.batch_shape[0] == z2.shape[0] == 1 + 2 + 2  # q2 was moved to z2's plate
    p1 = Bernoulli(logits=linear(wp1, bp1, z2))  # scores the earlier z1 (validated as aligned to z2's points)
    px = Bernoulli(logits=linear(wpx, bpx, z1))  # x's data plate is newer than the replicate plate
    cost = -(px.log_prob(x).sum(-1) + p1.log_prob(z1).sum(-1)
             + Bernoulli(logits=prior).log_prob(z2).sum(-1) - q1.log_prob(z1).sum(-1) - q2.log_prob(z2).sum(-1))
    storch.add_cost(cost, "neg_elbo")


def exact_sbn2(theta):
    wq1, bq1, wq2, bq2, wp1, bp1, wpx, bpx, prior = sbn2_parts(theta)
    total = 0.0
    for x in X2:
        for z1, z2 in itertools.product(bits(2), bits(2)):
            lq1, lq2 = linear(wq1, bq1, x), linear(wq2, bq2, z1)
            q = bern(torch.sigmoid(lq1), z1) * bern(torch.sigmoid(lq2), z2)
            log_joint = (Bernoulli(logits=linear(wpx, bpx, z1)).log_prob(x).sum() + Bernoulli(logits=linear(wp1, bp1, z2))
                         .log_prob(z1).sum() + Bernoulli(logits=prior).log_prob(z2).sum())
            log_q = Bernoulli(logits=lq1).log_prob(z1).sum() + Bernoulli(logits=lq2).log_prob(z2).sum()
            total = total + q * (log_q - log_joint)
    return total / len(X2)


def test_two_layer_elbo_with_torch_distributions():
    (grads,) = replicated_gradients([SBN2], R, sbn2_model)
    assert_unbiased(grads, torch.autograd.functional.jacobian(exact_sbn2, SBN2), label="two-layer ELBO")
