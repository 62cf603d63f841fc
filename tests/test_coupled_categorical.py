"""Coupled categorical estimators (storch.method.coupled_categorical): unbiasedness, DisARM at C = 2,
the pairs, limits, copies and compile_step.

* First-order unbiasedness against enumeration: one categorical (C = 3, 4, 5, every ordering, one-hot
  and index samples, logits and probs), a factorised node of two variables, a minibatch plate, and
  chains with the score function (RLOO) up- and downstream.
* ``C = 2``: the same uniforms give the same pairs and the same gradient as DisARM on the equivalent
  Bernoulli, for both estimators.
* The importance-weighted estimator in an order with a decision ``π ≥ ½`` is biased (why it always
  uses ascending order).
* Second order is not estimated (documented): the term is linear in the normalised logits.
* Variance against RLOO at equal cost evaluations (below it at 2, above at 4); copies, state_dict
  and storch.compile_step.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import DisARM, ScoreFunction
from storch.method.coupled_categorical import ORDERINGS, CoupledCategorical, CoupledCategoricalIW
from storch.testing import assert_unbiased, check_unbiased, replicate, replicated_gradients

from estimator_checks import DATA, check_compile_step, check_copies, check_cost_without_logit_plates_is_refused
from problems import exact_grads, minibatch_categorical, nested_categorical, one_categorical
from seeding import manual_seed

R = 3000
BUILDS = {
    "disarm": lambda n=1, ordering="descending": CoupledCategorical("z", n, ordering=ordering),
    "iw": lambda n=1, ordering=None: CoupledCategoricalIW("z", n),
}


# ------------------------------------------------------------------------------ one categorical
ONE = [("disarm", 3, "descending"), ("disarm", 4, "given"), ("disarm", 5, "ascending"),
       ("disarm", 5, "descending"), ("iw", 3, None), ("iw", 5, None)]


@pytest.mark.parametrize("name,k,ordering", ONE, ids=[f"{a}-C{b}-{c}" for a, b, c in ONE])
def test_one_categorical_unbiased(name, k, ordering):
    problem = one_categorical(k)

    def check(z):
        assert z.shape == (4, R, k) and z.plate_names == ["z", "replicate"]  # 2 pairs

    (grads,) = replicated_gradients([problem.theta], R, problem.model(BUILDS[name](2, ordering), check=check))
    assert_unbiased(grads, problem.exact(), label=f"{name} C={k} {ordering}")


@pytest.mark.parametrize("name", list(BUILDS))
def test_index_samples_and_probs(name):
    problem = one_categorical(4)

    def model(p):
        z = BUILDS[name]()(Categorical(probs=p))
        assert z.dtype == torch.int64 and z.shape == (2, R)
        storch.add_cost(problem.cost(z, one_hot=False), "f")

    probs = problem.theta.softmax(-1)
    (grads,) = replicated_gradients([probs], R, model)
    (exact,) = exact_grads(lambda p: (p / p.sum() * problem.cost(torch.eye(4))).sum(), [probs])
    assert_unbiased(grads, exact, label=f"{name} probs")


# ------------------------------------------------------------------------------ a factorised node
THETA2 = torch.tensor([[0.3, -0.2, 0.8, 0.0], [-0.5, 0.4, 0.1, 0.6]])
VALUES2 = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 2.0, -1.0, 1.0]])


def _factorised_cost(z: torch.Tensor) -> torch.Tensor:
    v = (z * VALUES2).sum(-1)  # the two variables' values
    return (v[..., 0] + v[..., 1] - 1.0) ** 2 + v[..., 0] * v[..., 1]


def _factorised_expectation(theta: torch.Tensor) -> torch.Tensor:
    p = theta.softmax(-1)
    eye = torch.eye(4)
    z = torch.stack(torch.broadcast_tensors(eye[:, None], eye[None, :]), -2)  # (4, 4, 2, 4): every pair
    return (p[0][:, None] * p[1][None, :] * _factorised_cost(z)).sum()


@pytest.mark.parametrize("name", list(BUILDS))
def test_factorised_node_of_two_variables(name):
    def model(theta):
        z = BUILDS[name](2)(OneHotCategorical(logits=theta))
        assert z.shape == (4, R, 2, 4)
        storch.add_cost(_factorised_cost(z), "f")

    (grads,) = replicated_gradients([THETA2], R, model)
    (exact,) = exact_grads(_factorised_expectation, [THETA2])
    assert_unbiased(grads.reshape(R, -1), exact.reshape(-1), label=f"{name} factorised")


@pytest.mark.parametrize("name", list(BUILDS))
def test_minibatch_plate(name):
    problem = minibatch_categorical()
    (grads,) = replicated_gradients([problem.w], R, problem.model(BUILDS[name]()))
    assert_unbiased(grads.reshape(R, -1), problem.exact().reshape(-1), label=f"{name} minibatch")


def test_costs_that_depend_on_the_logits_directly_get_their_pathwise_gradient():
    problem = one_categorical(4)

    def model(theta):
        z = CoupledCategorical("z", 2)(OneHotCategorical(logits=theta))
        storch.add_cost((z * theta).sum(-1), "f")  # E f = Σ p θ

    (grads,) = replicated_gradients([problem.theta], R, model)
    (exact,) = exact_grads(lambda t: (t.softmax(-1) * t).sum(), [problem.theta])
    assert_unbiased(grads, exact)


# ------------------------------------------------------------------------------ chains
NESTED = nested_categorical(3, 4)
RLOO = lambda name: ScoreFunction(name, 2, baseline_factory="batch_average")  # noqa: E731
CHAINS = {
    "coupled_then_rloo": (lambda: CoupledCategorical("z1", 2), lambda: RLOO("z2")),
    "rloo_then_coupled": (lambda: RLOO("z1"), lambda: CoupledCategorical("z2", ordering="given")),
    "coupled_then_iw": (lambda: CoupledCategorical("z1"), lambda: CoupledCategoricalIW("z2", 2)),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_two_nested_nodes(name):
    m1, m2 = (f() for f in CHAINS[name])
    NESTED.assert_unbiased(NESTED.model(m1, m2), R, label=name)


# ------------------------------------------------------------------------------ C = 2 is DisARM
def test_two_categories_are_disarm_on_the_same_draws():
    """Category 0 is the Bernoulli's 1: logits θ₀ − θ₁; the same uniforms give the same pairs."""
    theta = torch.tensor([[0.4, -0.3], [-0.8, 0.1]])  # two variables
    values = torch.tensor([[2.0, -1.0], [0.5, 1.5]])

    def cost(z):  # z one-hot (…, 2, 2)
        v = (z * values).sum(-1)
        return (v[..., 0] - v[..., 1]) ** 2 + v[..., 0]

    seed = torch.randint(2**31, ()).item()
    torch.manual_seed(seed)
    drawn = {}

    def coupled(t):
        z = CoupledCategorical("z", 2, ordering="given")(OneHotCategorical(logits=t))
        drawn["coupled"] = z._tensor[..., 0].clone()
        storch.add_cost(cost(z), "f")

    (g_coupled,) = replicated_gradients([theta], 1000, coupled)
    storch.reset()
    torch.manual_seed(seed)

    def disarm(t):
        x = DisARM("z", 2)(Bernoulli(logits=t[..., 0] - t[..., 1]))
        drawn["disarm"] = x._tensor.clone()
        storch.add_cost(cost(torch.stack([x, 1 - x], -1)), "f")

    (g_disarm,) = replicated_gradients([theta], 1000, disarm)
    assert torch.equal(drawn["coupled"], drawn["disarm"])
    torch.testing.assert_close(g_coupled, g_disarm, atol=1e-5, rtol=1e-5)


def test_two_categories_iw_is_disarm_in_its_own_order():
    # ascending order puts the less probable category first: the Bernoulli of that category
    theta = torch.tensor([0.6, -0.2])
    seed = torch.randint(2**31, ()).item()
    grads = {}
    for name, build in (("iw", lambda t: CoupledCategoricalIW("z", 3)(OneHotCategorical(logits=t))[..., 1]),
                        ("disarm", lambda t: DisARM("z", 3)(Bernoulli(logits=t[..., 1] - t[..., 0])))):
        torch.manual_seed(seed)
        (grads[name],) = replicated_gradients([theta], 1000, lambda t, b=build: storch.add_cost((b(t) - 0.3) ** 2, "f"))
        storch.reset()
    torch.testing.assert_close(grads["iw"], grads["disarm"], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the pairs
@pytest.mark.parametrize("ordering", list(ORDERINGS))
def test_both_points_are_categorical_samples_and_forward_value(ordering):
    theta = torch.tensor([0.9, -0.4, 0.2, 0.0], requires_grad=True)
    n = 20000
    z = CoupledCategorical("z", n, ordering=ordering)(OneHotCategorical(logits=theta))
    pairs = z._tensor.reshape(n, 2, 4)
    p = theta.detach().softmax(-1)
    se = (p * (1 - p) / n).sqrt()
    for j in (0, 1):
        assert ((pairs[:, j].mean(0) - p).abs() <= 4.5 * se).all(), (ordering, j, pairs[:, j].mean(0), p)
    # antithetic: the first decision has π₀ < ½ in every order here, so the pair never stops there together
    first = ORDERINGS[ordering](theta.detach())[0]
    assert p[first] < 0.5 and not (pairs[:, 0, first] * pairs[:, 1, first]).any()
    c = (z * torch.arange(4.0)).sum(-1)
    storch.add_cost(c, "f")
    assert torch.allclose(storch.backward(), c._tensor.mean())
    assert torch.allclose(z.plate.weight._tensor, torch.full((2 * n,), 1 / (2 * n)))


def test_iw_in_an_order_with_a_sure_decision_is_biased():
    """In descending order the first decision has π₀ = p₀ > ½ (θ below): both samples can never pass
    it, the pairs beyond it are never drawn, and the weighted estimate misses their share."""
    problem = one_categorical(3)
    method = CoupledCategoricalIW("z", 2)
    method.ordering = "descending"
    assert problem.theta.softmax(-1).max() > 0.5
    (grads,) = replicated_gradients([problem.theta], R, problem.model(method))
    assert not check_unbiased(grads, problem.exact()).passed


# ------------------------------------------------------------------------------ second order
@pytest.mark.parametrize("name", list(BUILDS))
def test_second_derivatives_leave_the_term_out(name):
    """Documented limit: the term is linear in the normalised logits, whose gradient sums to 0, so
    with backward(create_graph=True) this node adds nothing to second derivatives."""
    problem = one_categorical(4)
    leaf, theta = replicate(problem.theta, 50)
    storch.add_cost(problem.cost(BUILDS[name](2)(OneHotCategorical(logits=theta))), "f")
    storch.backward(create_graph=True)
    assert leaf.grad.abs().sum() > 0
    if leaf.grad.requires_grad:
        (second,) = torch.autograd.grad(leaf.grad.pow(2).sum(), leaf)
        assert second.abs().max() < 1e-4
    exact_hessian = torch.autograd.functional.hessian(problem.expectation, problem.theta.clone())
    assert exact_hessian.abs().sum() > 1.0


# ------------------------------------------------------------------------------ variance
def _total_variance(method, problem, repeats: int = 8000) -> tuple[float, float]:
    """``E‖g − E g‖²`` (the sum of the coordinates' variances) and its standard error."""
    manual_seed(11)
    (g,) = replicated_gradients([problem.theta], repeats, problem.model(method))
    storch.reset()
    squared = ((g.double() - g.double().mean(0)) ** 2).sum(-1)
    return squared.mean().item() * repeats / (repeats - 1), squared.std().item() / repeats**0.5


def test_variance_against_rloo_at_equal_evaluations():
    # measured (R = 10⁵, C = 5, the table in docs/estimators/coupled-categorical.md): 2 evaluations,
    # one pair 5.64 against RLOO (2 samples) 8.02; 4 evaluations, two pairs 2.82 against RLOO 2.33
    problem = one_categorical(5)
    one_pair = _total_variance(CoupledCategorical("z", 1), problem)
    rloo_2 = _total_variance(ScoreFunction("z", 2, baseline_factory="batch_average"), problem)
    assert one_pair[0] + 4.5 * one_pair[1] < rloo_2[0] - 4.5 * rloo_2[1], (one_pair, rloo_2)
    two_pairs = _total_variance(CoupledCategorical("z", 2), problem)
    rloo_4 = _total_variance(ScoreFunction("z", 4, baseline_factory="batch_average"), problem)
    assert rloo_4[0] + 4.5 * rloo_4[1] < two_pairs[0] - 4.5 * two_pairs[1], (two_pairs, rloo_4)


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("name", list(BUILDS))
def test_other_distributions_and_single_categories_are_refused(name):
    with pytest.raises(ValueError, match=r"categorical logits only, got Normal.*DisARM for Bernoulli"):
        BUILDS[name]()(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match=r"got Bernoulli"):
        BUILDS[name]()(Bernoulli(logits=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"\('z'\): a categorical needs at least 2 categories"):
        BUILDS[name]()(OneHotCategorical(logits=torch.zeros(3, 1)))


def test_construction_is_checked():
    with pytest.raises(ValueError, match=r"CoupledCategorical\('z'\): ordering must be one of \['ascending', "
                                         r"'descending', 'given'\], got 'random'"):
        CoupledCategorical("z", ordering="random")
    with pytest.raises(TypeError, match=r"CoupledCategorical\('z'\): n_samples must be a positive int, got 2.5"):
        CoupledCategorical("z", 2.5)
    assert CoupledCategorical("z", 3).n_samples == 3
    assert "ordering='descending'" in repr(CoupledCategorical("z"))
    assert "ordering='ascending'" in repr(CoupledCategoricalIW("z"))


@pytest.mark.parametrize("name", list(BUILDS))
def test_a_cost_without_the_logits_plates_is_refused_by_name(name):
    theta = storch.denote_independent(torch.zeros(4, 3, requires_grad=True), 0, "data")
    z = BUILDS[name](2)(OneHotCategorical(logits=theta))
    check_cost_without_logit_plates_is_refused(z, r"\('z'\): the logits carry plates \['data'\] that the cost 'f'")


# ------------------------------------------------------------------------------ copies and compile_step
class _Model(nn.Module):
    def __init__(self, method) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.method = method
        self.encoder, self.decoder = nn.Linear(4, 2 * 3), nn.Linear(2 * 3, 4)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        x = storch.denote_independent(x, 0, "data")
        logits = self.encoder(x).reshape(x.shape[:-1] + (2, 3))
        q = OneHotCategorical(logits=logits)
        z = self.method(q)
        out = self.decoder(z.reshape(z.shape[:-2] + (6,)))
        log_w = Bernoulli(logits=out).log_prob(x).sum(-1) - q.log_prob(z).sum(-1)
        storch.add_cost(-log_w, "neg_elbo")
        return storch.backward()




@pytest.mark.parametrize("name", list(BUILDS))
def test_copies_pickles_and_state_dict(name):
    check_copies(lambda: _Model(BUILDS[name](2, "given")), DATA)


@pytest.mark.parametrize("name", list(BUILDS))
def test_compile_step_replays_the_eager_step(name):
    check_compile_step(lambda: _Model(BUILDS[name](2)), DATA, atol=1e-6, rtol=1e-5)
