"""Gumbel-sparsemax and Gumbel-1.5-entmax (biased relaxations): the projections, the nodes, the measured bias.

Problems (``tests/problems.py``, as for Gumbel-softmax in ``tests/test_unbiased.py``): three Bernoullis with
``f = Σ (x − t)²``, and a four-class one-hot categorical with ``f = (vᵀz)²``. Bias = ‖E ĝ − ∇E f‖ over the
samples of one node; exact gradients and expected costs by enumeration.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import sys

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import GumbelEntmax, GumbelSoftmax, GumbelSparseMax
from storch.method.gumbel_sparse import entmax15, gumbel_perturb, sparsemax

from problems import bernoulli, one_categorical
from test_construction import Model, _round_trip, _step

pytestmark = pytest.mark.seed(11)

BERNOULLI = bernoulli(interaction=0.0)  # f = Σ (x − t)², exact gradient norm 0.118, E f = 0.703
QUADRATIC = one_categorical(4)  # f = (vᵀz)², exact gradient norm 1.65, E f = 2.526
METHODS = [GumbelSparseMax, GumbelEntmax]
PROJECTIONS = {"sparsemax": sparsemax, "entmax15": entmax15}
N = 200_000  # samples per bias measurement


# ---------------------------------------------------------------- the projections
@pytest.mark.parametrize("name", PROJECTIONS)
def test_projections_lie_on_the_simplex(name):
    y = PROJECTIONS[name](torch.randn(500, 7) * 3)
    assert (y >= 0).all()
    torch.testing.assert_close(y.sum(-1), torch.ones(500))
    # they keep the order of the scores: the largest entry is at the largest score
    scores = torch.randn(500, 7)
    assert torch.equal(PROJECTIONS[name](scores).argmax(-1), scores.argmax(-1))


@pytest.mark.parametrize("name", PROJECTIONS)
def test_equal_scores_give_the_uniform_distribution(name):
    for k in (1, 2, 5):
        torch.testing.assert_close(PROJECTIONS[name](torch.full((3, k), 2.5)), torch.full((3, k), 1.0 / k))


def test_sparsemax_closed_forms():
    # two classes: sparsemax(a, b)₂ = clamp((b − a + 1)/2, 0, 1) (a hard sigmoid of the difference)
    d = torch.linspace(-3, 3, 61)
    y = sparsemax(torch.stack([torch.zeros_like(d), d], -1))
    torch.testing.assert_close(y[:, 1], ((d + 1) / 2).clamp(0, 1))
    # the Euclidean projection: y = [s − η]₊ with one threshold η on the support; Jacobian I − 11ᵀ/|S| there
    s = torch.tensor([1.0, 0.8, 0.5, -1.0], requires_grad=True)
    eta = (1.0 + 0.8 + 0.5 - 1.0) / 3  # the support is the three largest: 0.5 > η > −1
    torch.testing.assert_close(sparsemax(s), torch.tensor([1.0 - eta, 0.8 - eta, 0.5 - eta, 0.0]))
    jacobian = torch.autograd.functional.jacobian(sparsemax, s.detach())
    expected = torch.zeros(4, 4)
    expected[:3, :3] = torch.eye(3) - 1.0 / 3
    torch.testing.assert_close(jacobian, expected)


def test_entmax15_threshold_and_jacobian():
    # 1.5-entmax: y = [s/2 − η]₊² with Σ y = 1 (Peters et al. 2019, Algorithm 2)
    s = torch.tensor([1.0, 0.8, -0.3, -2.0], dtype=torch.float64)
    y = entmax15(s)
    support = y > 0
    eta = (s / 2 - y.sqrt())[support]
    torch.testing.assert_close(eta, eta[:1].expand_as(eta))  # one threshold on the support
    assert bool((s[~support] / 2 <= eta[0]).all())
    # its backward pass against finite differences
    assert torch.autograd.gradcheck(entmax15, (torch.randn(3, 5, dtype=torch.float64, requires_grad=True),))
    assert torch.autograd.gradcheck(sparsemax, (torch.randn(3, 5, dtype=torch.float64, requires_grad=True),))


@pytest.mark.parametrize("name, gap", [("sparsemax", 1.0), ("entmax15", 2.0)])
def test_low_temperature_gives_sparse_and_then_one_hot_samples(name, gap):
    project = PROJECTIONS[name]
    z = gumbel_perturb(torch.tensor([0.2, -0.4, 0.9, 0.0, 0.1, -1.0]), 20_000)
    mean_support = {tau: (project(z / tau) > 0).sum(-1).float().mean().item() for tau in (5.0, 0.5, 0.05)}
    assert mean_support[5.0] > 3 and mean_support[0.5] < 2.5 and mean_support[0.05] < 1.1, mean_support
    # exactly one-hot wherever the two largest scores are more than gap·τ apart; as τ → 0, everywhere
    one_hot = torch.nn.functional.one_hot(z.argmax(-1), 6).float()
    top2 = z.topk(2, -1).values
    for tau in (0.5, 0.05, 1e-4):
        y = project(z / tau)
        separated = top2[:, 0] - top2[:, 1] > gap * tau
        assert torch.equal(y[separated], one_hot[separated]), tau
        assert (y[~separated] > 0).sum(-1).ge(2).all(), tau  # and only there
    assert separated.float().mean() > 0.999
    assert not bool(((torch.softmax(z / 0.05, -1) == 0) | (torch.softmax(z / 0.05, -1) == 1)).all())


# ---------------------------------------------------------------- the nodes
@pytest.mark.parametrize("make", METHODS)
def test_relaxed_one_hot_values_under_a_data_plate(make):
    logits = torch.randn(4, 3, requires_grad=True)
    batch = storch.denote_independent(logits, 0, "data")
    z = make("z", n_samples=5, initial_temperature=0.5)(OneHotCategorical(logits=batch))
    assert z.shape == (5, 4, 3) and [p.name for p in z.plates] == ["z", "data"]
    values = z._tensor.detach()
    assert (values >= 0).all() and (values == 0).any()  # sparse
    torch.testing.assert_close(values.sum(-1), torch.ones(5, 4))
    storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0])).sum(-1) ** 2, "c")
    storch.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("make", METHODS)
def test_bernoulli_values_and_gradient(make):
    phi = torch.tensor([0.3, -0.5, 1.0], requires_grad=True)
    x = make("x", n_samples=6)(Bernoulli(logits=phi))
    assert x.shape == (6, 3) and bool(((x._tensor >= 0) & (x._tensor <= 1)).all())
    storch.add_cost(BERNOULLI.cost(x), "f")
    storch.backward()
    assert torch.isfinite(phi.grad).all() and phi.grad.abs().sum() > 0


def test_bernoulli_sparsemax_is_the_hard_sigmoid_of_the_logistic_perturbed_logit():
    # x = clamp((φ + L)/(2τ) + ½, 0, 1): x = 1 with probability σ(φ − τ), x = 0 with σ(−φ − τ)
    phi, tau, n = torch.tensor([0.3, -0.5, 1.0]), 0.4, 100_000
    x = GumbelSparseMax("x", n_samples=n, initial_temperature=tau)(Bernoulli(logits=phi))._tensor
    for value, expected in ((1.0, torch.sigmoid(phi - tau)), (0.0, torch.sigmoid(-phi - tau))):
        frequency = (x == value).float().mean(0)
        se = (expected * (1 - expected) / n).sqrt()
        assert ((frequency - expected).abs() < 4.5 * se).all(), (value, frequency, expected)


@pytest.mark.parametrize("make", METHODS)
def test_straight_through_is_the_discrete_sample_forward(make):
    theta = QUADRATIC.theta.clone().requires_grad_()
    n = 40_000
    z = make("z", n_samples=n, straight_through=True)(OneHotCategorical(logits=theta))
    values = z._tensor.detach()
    assert set(values.unique().tolist()) <= {0.0, 1.0}
    frequency, p = values.mean(0), theta.detach().softmax(-1)
    assert ((frequency - p).abs() < 4.5 * (p * (1 - p) / n).sqrt()).all(), (frequency, p)
    storch.add_cost(QUADRATIC.cost(z), "f")
    storch.backward()
    assert theta.grad.abs().sum() > 0


@pytest.mark.parametrize("make", METHODS)
def test_unsupported_distributions_and_temperatures_are_refused(make):
    with pytest.raises(ValueError, match=r"cannot relax a Categorical.*Use OneHotCategorical"):
        make("c")(Categorical(logits=torch.zeros(3)))
    with pytest.raises(ValueError, match=r"cannot relax a Normal.*register_one_hot_view"):
        make("n")(Normal(0.0, 1.0))
    with pytest.raises(ValueError, match=r"\('t'\): temperatures must be positive"):
        make("t", initial_temperature=0.0)


@pytest.mark.parametrize("make", METHODS)
def test_temperature_annealing_after_backward(make):
    method = make("g", n_samples=2, initial_temperature=2.0, min_temperature=0.5, annealing_rate=0.3)
    assert not method.keeps_state_between_steps and not make("h").keeps_state_between_steps
    for step in range(1, 7):
        z = method(OneHotCategorical(logits=torch.zeros(3, requires_grad=True)))
        storch.add_cost((z * torch.arange(3.0)).sum(-1), "c")
        storch.backward()
        assert float(method.temperature) == pytest.approx(max(0.5, 2.0 * math.exp(-0.3 * step)), rel=1e-6)


@pytest.mark.parametrize("make", METHODS)
def test_pickle_deepcopy_and_state_dict_round_trip(make):
    def distr():
        return OneHotCategorical(logits=torch.tensor([0.1, -0.3, 0.4, 0.0], requires_grad=True))

    model = Model(make("z", n_samples=2, initial_temperature=1.5, annealing_rate=0.1))
    pickle.loads(pickle.dumps(model))
    _step(model, distr)
    _step(model, distr)
    for clone in (copy.deepcopy(model), _round_trip(model), pickle.loads(pickle.dumps(model))):
        assert type(clone.method) is make and clone.method.steps == 2
        torch.testing.assert_close(dict(clone.state_dict()), dict(model.state_dict()))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = Model(make("z", n_samples=2, initial_temperature=1.5, annealing_rate=0.1))
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.method.steps == 2 and float(fresh.method.temperature) == pytest.approx(1.5 * math.exp(-0.2))
    rng = torch.get_rng_state()
    _step(model, distr)
    torch.set_rng_state(rng)
    storch.reset()
    _step(fresh, distr)
    torch.testing.assert_close(dict(fresh.state_dict()), dict(model.state_dict()))


def test_names_are_exported():
    assert storch.method.GumbelSparseMax is GumbelSparseMax and storch.method.GumbelEntmax is GumbelEntmax
    assert {"GumbelSparseMax", "GumbelEntmax"} <= set(storch.method.__all__)


# ---------------------------------------------------------------- measured bias
def measure(make, problem: str, tau: float) -> tuple[float, float]:
    """``(‖mean gradient − exact‖, |relaxed expected cost − exact expected cost|)`` from ``N`` samples."""
    if problem == "bernoulli":
        p, distr, prob = BERNOULLI.phi.clone().requires_grad_(), Bernoulli, BERNOULLI
    else:
        p, distr, prob = QUADRATIC.theta.clone().requires_grad_(), OneHotCategorical, QUADRATIC
    x = make("x", n_samples=N, initial_temperature=tau)(distr(logits=p))
    storch.add_cost(prob.cost(x), "f")
    relaxed_cost = storch.backward()
    exact_cost = prob.expectation(p.detach())
    return (p.grad - prob.exact()).norm().item(), (relaxed_cost - exact_cost).abs().item()


@pytest.mark.parametrize("make", METHODS)
def test_bias_shrinks_with_temperature(make):
    # measured with 10⁶ samples (norm of mean − exact; Gumbel-softmax in brackets):
    #   Bernoulli   sparsemax 0.057, 0.019, 0.004 at τ = 2, 0.5, 0.1; entmax 0.066, 0.029, 0.006 (0.074, 0.044, 0.012)
    #   categorical sparsemax 0.75, 0.22, 0.06;                      entmax 1.10, 0.35, 0.08   (1.39, 0.67, 0.14)
    bern = {tau: measure(make, "bernoulli", tau)[0] for tau in (2.0, 0.5, 0.1)}
    cat = {tau: measure(make, "categorical", tau)[0] for tau in (2.0, 0.5, 0.1)}
    assert bern[2.0] > 0.045 and bern[2.0] > bern[0.5] > bern[0.1] and bern[0.1] < 0.012, bern
    assert cat[2.0] > 0.6 and cat[2.0] > cat[0.5] > cat[0.1] and cat[0.1] < 0.15, cat
    # lower than Gumbel-softmax's at the same temperature on these problems
    assert bern[0.5] < measure(GumbelSoftmax, "bernoulli", 0.5)[0]
    assert cat[0.5] < measure(GumbelSoftmax, "categorical", 0.5)[0]


@pytest.mark.parametrize("make", METHODS)
def test_expected_relaxed_cost_approaches_the_true_expected_cost(make):
    # measured (exact 2.526): sparsemax 1.66, 2.23, 2.46, 2.51 at τ = 2, 0.5, 0.1, 0.02; entmax 1.27, 2.07, 2.42, 2.50
    gap = {tau: measure(make, "categorical", tau)[1] for tau in (2.0, 0.5, 0.1, 0.02)}
    assert gap[2.0] > 0.5 and gap[2.0] > gap[0.5] > gap[0.1] > gap[0.02] and gap[0.02] < 0.05, gap


def test_a_missing_entmax_package_is_a_clear_error_when_sampling(monkeypatch):
    monkeypatch.setitem(sys.modules, "entmax", None)  # as if not installed
    with pytest.raises(ImportError) as error:
        GumbelSparseMax("z")(OneHotCategorical(logits=torch.zeros(3)))
    # one line that names the extra to install
    assert str(error.value) == 'GumbelSparseMax and GumbelEntmax need the entmax package: pip install "storch[entmax]"'
