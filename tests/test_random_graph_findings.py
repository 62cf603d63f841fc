"""Graphs on which the random-graph tester (storch.testing.fuzz) found storch wrong, shrunk: each
test rebuilds one in plain storch code and checks it against its exact gradient, and the shrunk
graph passes the tester's own check.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal

import storch
from seeding import OFFSET
from storch.method import ARSM, GSB, LocalExpectation, ScoreFunction
from storch.sampling import ImportanceSampling
from storch.testing import assert_unbiased, replicated_gradients
from storch.testing.fuzz import check_graph
from storch.testing.graphs import Cost, Graph, Node

pytestmark = pytest.mark.seed(36)


@pytest.mark.parametrize("proposal", ["fixed", "reads logits"])
def test_importance_sampling_of_a_probs_bernoulli_with_a_plate_has_its_gradient(proposal):
    """The proposal's draws are scored under torch.no_grad: a lazy ``logits`` first computed there, or
    given its plates back there, was cached without its graph, and ``theta`` got no gradient."""
    theta = torch.tensor([0.3, -0.4])
    make = {"fixed": lambda p: Bernoulli(probs=torch.tensor([0.4, 0.6])),
            "reads logits": lambda p: Bernoulli(logits=p.logits / 2)}[proposal]

    def model(t):
        q = Bernoulli(probs=torch.sigmoid(t))  # t carries the replicate plate
        z = ScoreFunction("z", sampling_method=ImportanceSampling("z", 4, make))(q)
        storch.add_cost((z * torch.tensor([1.0, 2.0])).sum(-1), "f")

    (grads,) = replicated_gradients([theta], 3000, model)
    p = torch.sigmoid(theta)
    assert_unbiased(grads, p * (1 - p) * torch.tensor([1.0, 2.0]), label=proposal)


def _chain_graph(estimator: str) -> Graph:
    """z0 one sample; z1 a Normal drawn from it (a step of z0's chain); z2 drawn from z0 by ``estimator``;
    the cost reads z2 and z1: it carries z0 only through the newer step z1."""
    nodes = (
        Node("z0", "categorical", 2, 2, (), "ScoreFunction"),
        Node("z1", "normal", 1, 1, ("z0",), "ScoreFunction"),
        Node("z2", "categorical", 2, 3, ("z0",), estimator),
    )
    return Graph(11303, nodes, (Cost("f1", ("z2",), log_prob=("z1",)),))


@pytest.mark.parametrize("estimator", ["ARSM", "LocalExpectation(n_samples=2)"])
def test_a_node_beside_a_chain_step_accepts_the_cost(estimator):
    """The logits of z2 carry z0's plate; the cost carries z1, the step that extends it. ARSM (and
    the other antithetic estimators) and a local expectation refused the cost as reduced over z0."""
    t0, t1, t2 = (torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True),
                  torch.zeros(3, requires_grad=True))
    z0 = ScoreFunction("z0")(Categorical(logits=t0))
    z1 = ScoreFunction("z1")(Normal(t1 + z0.float(), 1.0))
    method = ARSM("z2") if estimator == "ARSM" else LocalExpectation("z2", n_samples=2)
    z2 = method(Categorical(logits=t2 + z0.float()))
    assert z1.plate_names == ["z1"] and "z0" in z2.plate_names
    storch.add_cost(z2.float() + z1.log_prob().sum(-1), "f")
    storch.backward()
    assert t2.grad is not None
    assert check_graph(_chain_graph(estimator), rng_offset=OFFSET).kind == "pass"


def test_gsb_drawn_from_a_single_sample_node():
    """A GSB node drawn from a one-sample node was a step of its chain, whose samples (a view without
    the step) had lost GSB's record of its hidden leaf."""
    t0, t1 = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    z0 = ScoreFunction("z0")(Categorical(logits=t0))
    z1 = GSB("z1")(Normal(t1 + z0.float(), 1.0))
    assert z1.plate_names == ["z1", "z0"]
    storch.add_cost(z1.sum(-1) ** 2, "f")
    storch.backward()
    assert t1.grad is not None
    graph = Graph(12801, (Node("z0", "categorical", 1, 2, (), "ScoreFunction"),
                          Node("z1", "normal", 1, 1, ("z0",), "GSB")), (Cost("f0", ("z1",)),))
    assert check_graph(graph, rng_offset=OFFSET).kind == "pass"


def test_a_first_order_estimator_below_a_gsb_normal_is_refused_by_name():
    """Below a GSB Normal, an estimator unbiased for first derivatives only gave the Normal's scale a
    zero gradient, silently (found by the random-graph tester); it is refused where it is drawn, and
    an estimator unbiased at every order, or a discrete GSB node above, is drawn as before."""
    from torch.distributions import Bernoulli, Categorical, Normal

    mu = torch.tensor([0.2], requires_grad=True)
    sigma = torch.tensor([0.7], requires_grad=True)
    theta = torch.zeros(3)
    w = torch.tensor([0.5, -0.3, 0.1])
    z0 = storch.method.GSB("z0")(Normal(mu, sigma))
    with pytest.raises(ValueError, match=r"ARSM\('z3'\) is drawn from the samples of GSB\('z0'\).*order 2"):
        storch.method.ARSM("z3")(Categorical(logits=theta + w * z0))
    storch.reset()
    z0 = storch.method.GSB("z0")(Normal(mu, sigma))
    z3 = storch.method.ScoreFunction("z3", n_samples=2)(Categorical(logits=theta + w * z0))
    storch.add_cost(z3.float() * 1.0, "f")
    storch.backward()
    assert sigma.grad is not None and bool(torch.isfinite(sigma.grad).all())
    storch.reset()
    b = storch.method.GSB("b")(Bernoulli(logits=torch.zeros(1, requires_grad=True)))
    storch.method.ARSM("c")(Categorical(logits=theta + w * b))  # the discrete rule takes no derivatives
