"""Graphs the documentation supports that random graphs broke: each test rebuilds one reproducer and
checks its shape or message, and its gradients against exact enumeration where it has any.

Statistical checks draw R independent estimates in one backward pass (storch.testing) and require
|mean − exact| ≤ 4.5 standard errors per coordinate.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, OneHotCategorical

import storch
from storch.method import Expect, LocalExpectation, ScoreFunction
from storch.sampling import ImportanceSampling
from storch.testing import assert_unbiased, replicated_gradients

pytestmark = pytest.mark.seed(36)

R = 3000


def bits(n):
    return [torch.tensor(b) for b in itertools.product([0.0, 1.0], repeat=n)]


def bern(p, z):
    return (p * z + (1 - p) * (1 - z)).prod(-1)


# ---------------------------------------------------------------- z.log_prob() leaves no plain parameter behind
LOGITS = torch.tensor([[0.2, -0.3, 0.1], [0.5, 0.0, -0.4]])


def _categorical(form):
    t = storch.denote_independent(LOGITS, 0, "data")
    return Categorical(probs=torch.softmax(t, -1)) if form == "probs" else Categorical(logits=t)


def _bernoulli(form):
    t = storch.denote_independent(LOGITS, 0, "data")
    return Bernoulli(probs=torch.sigmoid(t)) if form == "probs" else Bernoulli(logits=t)


@pytest.mark.parametrize("form", ["probs", "logits"])
@pytest.mark.parametrize("make", [_categorical, _bernoulli], ids=["Categorical", "Bernoulli"])
@pytest.mark.parametrize("method", [lambda: Expect("z"), lambda: ScoreFunction("z", n_samples=3)],
                         ids=["Expect", "ScoreFunction"])
@pytest.mark.parametrize("own_first", [True, False], ids=["z.log_prob first", "q.log_prob first"])
def test_log_prob_of_the_node_then_of_the_user_have_the_same_plates(form, make, method, own_first):
    q = make(form)
    z = method()(q)
    if own_first:
        own = z.log_prob()
        users = q.log_prob(z)
    else:
        users = q.log_prob(z)
        own = z.log_prob()
    assert users.plate_names == own.plate_names == ["z", "data"]
    assert users.shape == own.shape == z.shape[: 2 + (make is _bernoulli)]
    assert torch.allclose(users._tensor, own._tensor)
    for name in ("logits", "probs"):  # nothing cached on the user's distribution lost its plates
        value = q.__dict__.get(name)
        assert value is None or isinstance(value, storch.Tensor), name
        assert getattr(q, name).plate_names == ["data"]
    storch.reset()


# ---------------------------------------------------------------- chains: a newer step scores an earlier step's sample
A = torch.tensor([0.4, -0.6])
W = torch.tensor([[0.5, -1.0], [0.3, 0.8], [-0.7, 0.2]])
TABLE3 = torch.tensor([0.7, -1.3, 2.1])
THETA_OH = torch.cat([A, W.reshape(-1)])


def _onehot_parts(theta):
    return theta[..., :2], theta[..., 2:].unflatten(-1, (3, 2))


def onehot_child_model(theta):
    a, w = _onehot_parts(theta)
    b = LocalExpectation("b")(Bernoulli(logits=a))
    q = OneHotCategorical(logits=(b.unsqueeze(-2) * w).sum(-1))
    z = LocalExpectation("z")(q)  # joins b's chain
    assert q.batch_shape[0] == q._categorical.batch_shape[0] == z.shape[0] == 1 + 2 + 2
    cost = z.log_prob() + q.log_prob(z) + (z * TABLE3).sum(-1) * b[..., 0]
    storch.add_cost(cost, "f")


def exact_onehot_child(theta):
    a, w = _onehot_parts(theta)
    total = 0.0
    for b in bits(2):
        pb = bern(torch.sigmoid(a), b)
        logp = torch.log_softmax((b * w).sum(-1), -1)
        total = total + pb * (logp.exp() * (2 * logp + TABLE3 * b[0])).sum()
    return total


def test_one_hot_categorical_child_of_a_chain_scores_its_own_sample():
    (grads,) = replicated_gradients([THETA_OH], R, onehot_child_model)
    exact = torch.autograd.functional.jacobian(exact_onehot_child, THETA_OH)
    assert_unbiased(grads, exact, label="OneHotCategorical child of a chain")


X2 = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
SBN2 = torch.linspace(-0.8, 0.9, 31)


def _sbn2_parts(theta):
    sizes = [(2, 3), (2,), (2, 2), (2,), (2, 2), (2,), (3, 2), (3,), (2,)]
    out, i = [], 0
    for shape in sizes:
        k = int(torch.tensor(shape).prod())
        out.append(theta[..., i: i + k].unflatten(-1, shape))
        i += k
    return out


def _linear(w, b, x):
    return (w * x.unsqueeze(-2)).sum(-1) + b


def sbn2_model(theta):
    """The two-layer SBN's negative ELBO written with torch.distributions and validation on."""
    wq1, bq1, wq2, bq2, wp1, bp1, wpx, bpx, prior = _sbn2_parts(theta)
    x = storch.denote_independent(X2, 0, "data")
    q1 = Bernoulli(logits=_linear(wq1, bq1, x))
    h1 = LocalExpectation("h1")(q1)
    q2 = Bernoulli(logits=_linear(wq2, bq2, h1))
    h2 = LocalExpectation("h2")(q2)
    assert h1.shape[0] != h2.shape[0]  # the steps of the chain have different sizes
    log_px = Bernoulli(logits=_linear(wpx, bpx, h1)).log_prob(x).sum(-1)
    log_p1 = Bernoulli(logits=_linear(wp1, bp1, h2)).log_prob(h1).sum(-1)  # the newer step scores h1
    log_p2 = Bernoulli(logits=prior).log_prob(h2).sum(-1)
    cost = -(log_px + log_p1 + log_p2 - q1.log_prob(h1).sum(-1) - q2.log_prob(h2).sum(-1))
    storch.add_cost(cost, "neg_elbo")


def exact_sbn2(theta):
    wq1, bq1, wq2, bq2, wp1, bp1, wpx, bpx, prior = _sbn2_parts(theta)
    total = 0.0
    for x in X2:
        for h1, h2 in itertools.product(bits(2), bits(2)):
            lq1, lq2 = _linear(wq1, bq1, x), _linear(wq2, bq2, h1)
            q = bern(torch.sigmoid(lq1), h1) * bern(torch.sigmoid(lq2), h2)
            log_joint = (Bernoulli(logits=_linear(wpx, bpx, h1)).log_prob(x).sum()
                         + Bernoulli(logits=_linear(wp1, bp1, h2)).log_prob(h1).sum()
                         + Bernoulli(logits=prior).log_prob(h2).sum())
            log_q = Bernoulli(logits=lq1).log_prob(h1).sum() + Bernoulli(logits=lq2).log_prob(h2).sum()
            total = total + q * (log_q - log_joint)
    return total / len(X2)


def test_two_layer_sbn_with_torch_distributions_validates_and_is_unbiased():
    assert torch.distributions.Distribution._validate_args  # torch's default: validation on
    (grads,) = replicated_gradients([SBN2], R, sbn2_model)
    assert_unbiased(grads, torch.autograd.functional.jacobian(exact_sbn2, SBN2), label="two-layer SBN")


def test_validation_still_refuses_a_value_of_the_wrong_shape_or_support():
    h1 = LocalExpectation("h1")(Bernoulli(logits=torch.zeros(3, 2)))
    h2 = LocalExpectation("h2")(Bernoulli(logits=h1[..., 0, :]))
    with pytest.raises(ValueError, match="broadcastable"):  # per sample (2,) against (3, 2): refused as before
        Bernoulli(logits=h2).log_prob(h1.unsqueeze(-1).expand(*h1.shape, 4))
    with pytest.raises(ValueError, match="support"):
        Bernoulli(logits=h2).log_prob(h1[..., 0, :] + 0.5)
    storch.reset()


# ---------------------------------------------------------------- a joint_with sibling with a cost of its own
SIB_X = torch.tensor([[1.0], [-2.0], [0.5]])
SIB = torch.tensor([0.3, -0.5, 0.2, -0.1])


def sibling_model(theta):
    w, t = theta[..., :2], theta[..., 2:]
    x = storch.denote_independent(SIB_X, 0, "data")
    b = LocalExpectation("b")(Bernoulli(logits=x * w))
    z = LocalExpectation("z")(Bernoulli(logits=t), joint_with=b)
    storch.add_cost(((b - z) ** 2).sum(-1) + 0.5 * b[..., 0] * z[..., 1], "f")
    storch.add_cost((z * torch.tensor([1.5, -2.0])).sum(-1) + z[..., 0] * z[..., 1], "g")  # no data plate


def exact_sibling(theta):
    w, t = theta[:2], theta[2:]
    pz = torch.sigmoid(t)
    f = 0.0
    for x in SIB_X:
        for b, z in itertools.product(bits(2), bits(2)):
            prob = bern(torch.sigmoid(x * w), b) * bern(pz, z)
            f = f + prob * (((b - z) ** 2).sum() + 0.5 * b[0] * z[1])
    g = sum(bern(pz, z) * ((z * torch.tensor([1.5, -2.0])).sum() + z[0] * z[1]) for z in bits(2))
    return f / len(SIB_X) + g


def test_joint_with_sibling_with_its_own_cost_under_a_data_plate():
    (grads,) = replicated_gradients([SIB], R, sibling_model)
    assert_unbiased(grads, torch.autograd.functional.jacobian(exact_sibling, SIB), label="sibling with its own cost")


def test_a_local_expectation_cost_reduced_over_the_data_plate_is_refused_by_name():
    x = storch.denote_independent(SIB_X, 0, "data")
    b = LocalExpectation("b")(Bernoulli(logits=x * torch.tensor([0.3, -0.5], requires_grad=True)))
    storch.add_cost(storch.reduce_plates(((b - 0.3) ** 2).sum(-1), "data"), "f")
    with pytest.raises(ValueError, match=r"LocalExpectation\('b'\): the cost 'f' carries the node's plate but not "
                                         r"the plates \['data'\]"):
        storch.backward()
    storch.reset()


# ---------------------------------------------------------------- a size-1 chain plate and the moving average
MA = torch.tensor([0.3, -0.2])


def exact_moving_average_chain(p):
    # a ~ Bern(σ(p)); b, c ~ Bern(σ(a)) independently: E Σ b c = Σ_d E[σ(a_d)²]
    s = torch.sigmoid(p)
    return (s * torch.sigmoid(torch.tensor(1.0)) ** 2 + (1 - s) * 0.25).sum()


@pytest.mark.parametrize("middle", ["Expect", "ImportanceSampling"])
def test_moving_average_baseline_after_a_chain_plate_left_by_reduce_plates(middle):
    c_method = ScoreFunction("c", baseline_factory="moving_average")  # one baseline, learning over the steps
    proposal = Bernoulli(probs=torch.tensor([0.5, 0.5]))

    def model(p):
        a = ScoreFunction("a")(Bernoulli(logits=p))  # one sample: a chain plate of size 1
        if middle == "Expect":
            b = Expect("b")(Bernoulli(logits=a))
        else:
            b = ScoreFunction("b", sampling_method=ImportanceSampling("b", 4, proposal))(Bernoulli(logits=a))
        c = c_method(Bernoulli(logits=a))
        storch.add_cost((b * c).sum(-1), "f")

    for _ in range(3):  # the baseline is updated after each step, then used by the next
        (grads,) = replicated_gradients([MA], R, model)
    assert c_method.baseline.averages["f"].dim() == 0
    assert_unbiased(grads, torch.autograd.functional.jacobian(exact_moving_average_chain, MA), label=middle)


# ---------------------------------------------------------------- messages that name the actual clash
def test_two_data_plates_of_one_name_and_different_sizes_name_that_clash():
    a = storch.denote_independent(torch.zeros(5, 2), 0, "data")
    b = storch.denote_independent(torch.zeros(4, 2), 0, "data")
    with pytest.raises(storch.plate.PlateClashError) as info:
        a + b
    message = str(info.value)
    assert message.startswith("Two independent plates are named 'data', of sizes 5 and 4")
    assert "denote_independent(t, dim, 'data2')" in message
    assert "stochastic node" not in message and "Method(" not in message


def test_a_node_and_a_data_plate_of_one_name_name_that_clash():
    x = storch.denote_independent(torch.zeros(5, 3), 0, "data")
    d = ScoreFunction("data", n_samples=4)(Bernoulli(logits=torch.zeros(3)))
    with pytest.raises(storch.plate.PlateClashError, match="A stochastic node and an independent plate are both "
                                                           "named 'data'"):
        x + d
    storch.reset()


@pytest.mark.parametrize("join", [torch.stack, torch.cat])
@pytest.mark.parametrize("dim", [0, 1])
def test_joining_along_a_plate_says_joins_are_not_reductions(join, dim):
    x = ScoreFunction("x", n_samples=2)(Bernoulli(logits=torch.zeros(3)))
    y = ScoreFunction("y", n_samples=5)(Bernoulli(logits=torch.zeros(3)))
    name = join.__name__
    # dim 1 is plate 'x' of the inputs aligned to their plates ['y', 'x'] (it was joined silently)
    with pytest.raises(ValueError) as info:
        join([x, y], dim)
    message = str(info.value)
    assert message.startswith(f"{name} got dimension {dim}, which is plate {['y', 'x'][dim]!r}")
    assert f"{name} joins the events of each sample, never plates" in message
    assert f"{name}(tensors, dim=-1)" in message and "reduce_plates" not in message
    joined = join([x, y], -1)
    assert joined.plate_names == ["y", "x"] and joined.shape[-1] == (2 if name == "stack" else 6)
    storch.reset()


# ---------------------------------------------------------------- relaxed samples: z.log_prob() and the user's q.log_prob(z)
PHI = torch.tensor([[0.3, -1.0, 2.0], [-0.4, 0.8, 0.0]])


def _relaxing(name):
    if name == "GumbelSoftmax":
        return storch.method.GumbelSoftmax("z", n_samples=4)
    if name == "REBAR":
        return storch.method.REBAR("z")
    return storch.method.RELAX("z", rebar=True)


def _bernoulli_formula(z, phi):
    p = torch.sigmoid(phi)
    return z * p.log() + (1 - z) * (1 - p).log()


@pytest.mark.parametrize("form", ["logits", "probs"])
@pytest.mark.parametrize("method", ["GumbelSoftmax", "REBAR", "RELAX(rebar=True)"])
def test_log_prob_of_relaxed_bernoulli_samples_is_the_continuous_extension(method, form):
    phi = PHI.clone().requires_grad_()
    data = storch.denote_independent(phi, 0, "data")
    q = Bernoulli(logits=data) if form == "logits" else Bernoulli(probs=torch.sigmoid(data))
    m = _relaxing(method)
    assert m.relaxes_samples
    z = m(q)
    samples = z._tensor
    assert ((samples > 0) & (samples < 1)).any()  # relaxed values between 0 and 1
    own = z.log_prob()
    assert own.plate_names == ["z", "data"] and own.shape == z.shape
    expected = _bernoulli_formula(samples, phi)
    assert torch.allclose(own._tensor, expected, atol=1e-6)
    weights = torch.linspace(0.5, 1.5, samples.numel()).reshape(samples.shape)
    got = torch.autograd.grad((own._tensor * weights).sum(), phi, retain_graph=True)[0]
    want = torch.autograd.grad((expected * weights).sum(), phi, retain_graph=True)[0]
    assert torch.allclose(got, want, atol=1e-5)  # pathwise through z and through the parameters
    hard = (samples == 0) | (samples == 1)
    if method != "GumbelSoftmax":  # REBAR's first point of each sample is the discrete sample b
        assert hard[0].all()
    with torch.no_grad():
        exact = Bernoulli(logits=phi).log_prob(samples.round())
    rounded = storch.distributions.relaxation.continuous_log_prob(Bernoulli(logits=phi), samples.round())
    assert torch.allclose(rounded, exact) and torch.allclose(own._tensor[hard], exact[hard])
    storch.reset()


def test_log_prob_of_relaxed_one_hot_samples_is_the_continuous_extension():
    logits = torch.tensor([[0.1, 0.5, -0.3], [1.0, -2.0, 0.0]], requires_grad=True)
    q = OneHotCategorical(logits=logits)
    z = storch.method.GumbelSoftmax("z", n_samples=3)(q)
    own = z.log_prob()
    expected = (z._tensor * torch.log_softmax(logits, -1)).sum(-1)
    assert own.plate_names == ["z"] and torch.allclose(own._tensor, expected)
    got = torch.autograd.grad(own._tensor.sum(), logits, retain_graph=True)[0]
    assert torch.allclose(got, torch.autograd.grad(expected.sum(), logits)[0], atol=1e-6)
    hard = torch.eye(3)[torch.tensor([2, 0])]
    extension = storch.distributions.relaxation.continuous_log_prob(q, hard)
    assert torch.allclose(extension, q.log_prob(hard))
    storch.reset()


@pytest.mark.parametrize("method", ["GumbelSoftmax", "REBAR", "RELAX(rebar=True)"])
def test_the_users_log_prob_of_relaxed_samples_names_node_estimator_and_fix(method):
    logits = PHI[0].clone().requires_grad_()
    q = Bernoulli(logits=logits)
    z = _relaxing(method)(q)
    for d in (q, Bernoulli(logits=torch.zeros(3))):  # the encoder's q and a prior
        with pytest.raises(storch.exceptions.RelaxedSampleError) as info:
            d.log_prob(z)
        message = str(info.value)
        estimator = "GumbelSoftmax" if method == "GumbelSoftmax" else method.split("(")[0]
        assert f"node 'z', whose estimator {estimator}('z') relaxes its samples" in message
        assert "z.log_prob()" in message and "validate_args=False" in message
        assert len(message) < 700 and "tensor(" not in message  # a few lines, no tensor dump
    # the fixes the message names work
    assert torch.allclose(Bernoulli(logits=logits, validate_args=False).log_prob(z)._tensor, z.log_prob()._tensor)
    storch.reset()


def test_a_relaxed_elbo_with_z_log_prob_trains():
    """Switching a linear SBN's estimator to REBAR changes one line: z.log_prob() scores the relaxed points."""
    enc = torch.nn.Linear(4, 3)
    x = storch.denote_independent(torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]]), 0, "data")
    z = storch.method.REBAR("z")(Bernoulli(logits=enc(x)))
    cost = -(torch.nn.functional.logsigmoid(z.sum(-1)) - z.log_prob().sum(-1))
    storch.add_cost(cost, "neg_elbo")
    storch.backward()
    assert enc.weight.grad is not None and torch.isfinite(enc.weight.grad).all()
