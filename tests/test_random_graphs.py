"""storch's random-graph tester (storch.testing.fuzz) on a fixed set of seeds, and the tester itself.

The CI set: the graphs of seeds ``0 .. RANDOM_SEEDS - 1`` and of ``SHAPES`` (graphs of the shapes on
which random graphs first found storch wrong), plus, for every catalog entry declared
unbiased (storch.method.catalog), ``PER_ESTIMATOR`` graphs in which one node uses it, so that an
estimator is checked in random graphs the day it is registered. Each graph's gradient (and, for
about a fifth, a Hessian-vector product) is compared with the exact value (enumeration and
quadrature without storch) by a z-test per coordinate, ``|z| < 5.5``; a failing graph is checked
again with four times the estimates before it counts. ``make fuzz`` runs thousands of graphs.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch.distributions import Bernoulli, Normal

import storch
from seeding import OFFSET
from storch.method import Method
from storch.method.catalog import CatalogEntry, catalog, entry, register_estimator, unbiased_estimators
from storch.testing.exact import exact_objective
from storch.testing.fuzz import check_graph, same_failure
from storch.testing.reproducer import reproducer
from storch.testing.shrink import shrink
from storch.testing.graphs import Cost, Graph, Node, compile_model, model_source, random_graph, values

RANDOM_SEEDS = 200
PER_ESTIMATOR = 3


def _unbiased_labels() -> list[str]:
    return [e.label for e in catalog() if e.unbiased_orders > 0 and not e.requires]


SINGLE_SAMPLE = {"ScoreFunction", "ScoreFunction + moving_average", "ScoreFunction + critic", "Reparameterization",
                 "Infer", "LocalExpectation"}


def _log_prob_then_score_with_probs_and_plate(g: Graph) -> bool:
    return bool(g.plate) and any(n.probs and n.in_plate and any(n.name in c.log_prob and n.name in c.own_score
                                                                for c in g.costs) for n in g.nodes)


def _one_hot_local_expectation_below_another(g: Graph) -> bool:
    return any(n.kind == "onehot" and n.estimator.startswith("LocalExpectation")
               and any(g.node(q).estimator.startswith("LocalExpectation") for q in n.parents) for n in g.nodes)


def _joined_sibling_with_own_cost_under_plate(g: Graph) -> bool:
    return bool(g.plate) and any(n.joint_with and any(n.name in c.uses for c in g.costs) for n in g.nodes)


def _moving_average_below_single_sample(g: Graph) -> bool:
    return any(n.estimator == "ScoreFunction + moving_average" and any(g.node(q).estimator in SINGLE_SAMPLE
                                                                       for q in n.parents) for n in g.nodes)


#: seeds whose graphs have the shapes where random graphs first found storch wrong, with the shape
SHAPES = {
    218: _log_prob_then_score_with_probs_and_plate, 414: _log_prob_then_score_with_probs_and_plate,
    531: _one_hot_local_expectation_below_another, 1089: _one_hot_local_expectation_below_another,
    474: _joined_sibling_with_own_cost_under_plate, 2076: _joined_sibling_with_own_cost_under_plate,
    323: _moving_average_below_single_sample, 427: _moving_average_below_single_sample,
}


def ci_graphs() -> list[Graph]:
    graphs = [random_graph(seed) for seed in list(range(RANDOM_SEEDS)) + list(SHAPES)]
    for k, label in enumerate(_unbiased_labels()):
        graphs += [random_graph(10_000 + 100 * k + j, estimator=label) for j in range(PER_ESTIMATOR)]
    return graphs


CI = ci_graphs()
CHUNK = 16


@pytest.mark.parametrize("start", range(0, len(CI), CHUNK))
def test_random_graphs_agree_with_exact_values(start):
    failures = []
    for graph in CI[start:start + CHUNK]:
        outcome = check_graph(graph, rng_offset=OFFSET)
        if outcome.failed:
            failures.append(outcome.line())
    assert not failures, "\n".join(failures)


def test_the_ci_graphs_cover_the_generator():
    nodes = [n for g in CI for n in g.nodes]
    costs = [c for g in CI for c in g.costs]
    assert {n.kind for n in nodes} == {"bernoulli", "categorical", "onehot", "normal"}
    assert set(_unbiased_labels()) <= {n.estimator for n in nodes}
    assert any(g.order == 2 for g in CI) and any(g.plate for g in CI)
    assert any(n.joint_with for n in nodes) and any(n.probs for n in nodes) and any(n.in_plate for n in nodes)
    assert any(entry(n.estimator).warmup for n in nodes)  # baselines and control variates that learn
    assert any(c.log_prob for c in costs) and any(c.own_score for c in costs)
    assert any(by for c in costs for _, by in c.scores) and any(not by for c in costs for _, by in c.scores)
    assert any(entry(g.node(z).estimator).relaxes for g in CI for c in g.costs for z in c.log_prob)
    assert any(by and by in g.descendants(z) for g in CI for c in g.costs for z, by in c.scores)  # decoders
    assert any(by and by not in g.descendants(z) for g in CI for c in g.costs for z, by in c.scores)
    # a chain: a single-sample node drawn from another single-sample node
    assert any(n.estimator in SINGLE_SAMPLE and any(g.node(q).estimator in SINGLE_SAMPLE for q in n.parents)
               for g in CI for n in g.nodes)
    for seed, shape in SHAPES.items():
        assert shape(random_graph(seed)), (seed, shape.__name__)


# ----------------------------------------------------------------------------------------- the catalog


def test_every_method_of_storch_method_is_in_the_catalog():
    classes = {getattr(storch.method, name) for name in storch.method.__all__}
    methods = {c for c in classes if isinstance(c, type) and issubclass(c, Method) and c is not Method}
    # Auto is no estimator of its own: each step is the estimate of a catalog entry it chose
    # (tests/test_auto.py checks every step, also where it switches), so it is not an entry itself
    assert methods - {storch.method.Auto} <= {e.estimator for e in catalog()}
    assert storch.method.Auto not in {e.estimator for e in catalog()}


def test_catalog_queries_and_registration_errors():
    assert "DisARM" in [e.label for e in unbiased_estimators(Bernoulli, 1)]
    assert "DisARM" not in [e.label for e in unbiased_estimators(Bernoulli, 2)]
    assert "GumbelSoftmax" not in [e.label for e in unbiased_estimators(Bernoulli, 1)]
    assert "DoubleControlVariate" not in [e.label for e in unbiased_estimators(Bernoulli, 1)]
    assert "DoubleControlVariate" in [e.label for e in unbiased_estimators(Bernoulli, 1, plain_models=False)]
    assert entry("Reparameterization").unbiased_for(Normal, 5)
    with pytest.raises(ValueError, match="already registered"):
        register_estimator(entry("Expect"))
    with pytest.raises(KeyError, match="no catalog entry labelled 'Nope'"):
        entry("Nope")
    with pytest.raises(TypeError, match="CatalogEntry"):
        register_estimator("Expect")
    assert isinstance(entry("ARM").make("z", (2,)), Method)
    assert isinstance(entry("ARM"), CatalogEntry)


# ----------------------------------------------------------------------------------------- the exact values


def test_exact_objective_is_the_closed_form_for_a_normal_and_a_bernoulli():
    """Quadrature of E[(a z − t)² + sin(2 a z)], z ~ N(μ, σ²), and enumeration of a Bernoulli."""
    graph = Graph(0, (Node("z0", "normal", 1, 1, (), "Reparameterization"),), (Cost("f0", ("z0",)),))
    p, x, c = values(graph)
    mu, sigma = p["theta_z0"], p["scale_z0"].exp()
    a, t = c["a_f0_z0"], c["t_f0"]
    closed = a**2 * (mu**2 + sigma**2) - 2 * a * mu * t + t**2 + torch.sin(2 * a * mu) * torch.exp(-2 * a**2 * sigma**2)
    got = exact_objective(compile_model(graph, exact=True), graph, p, x, c)
    torch.testing.assert_close(got, closed.squeeze(), rtol=1e-12, atol=1e-12)

    graph = Graph(1, (Node("z0", "bernoulli", 2, 2, (), "Expect", in_plate=True),), (Cost("f0", ("z0",)),), plate=3)
    p, x, c = values(graph)
    probs = torch.sigmoid(p["theta_z0"] + x["z0"])  # (3, 2)
    total = torch.zeros(3, dtype=torch.float64)
    for b0 in (0.0, 1.0):
        for b1 in (0.0, 1.0):
            b = torch.tensor([b0, b1], dtype=torch.float64)
            u = (c["a_f0_z0"] * b).sum()
            total += (probs * b + (1 - probs) * (1 - b)).prod(-1) * ((u - c["t_f0"]) ** 2 + torch.sin(2 * u))
    got = exact_objective(compile_model(graph, exact=True), graph, p, x, c)
    torch.testing.assert_close(got, total.mean(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------- it can fail


def _biased_graph() -> Graph:
    """Straight-through (biased) on a Bernoulli whose cost is not linear, among two sound nodes."""
    nodes = (
        Node("z0", "categorical", 2, 3, (), "Expect"),
        Node("z1", "bernoulli", 2, 2, ("z0",), "StraightThrough"),
        Node("z2", "onehot", 1, 3, ("z1",), "ScoreFunction + batch_average"),
    )
    costs = (Cost("f0", ("z1", "z2"), log_prob=("z2",)), Cost("f1", ("z0",)))
    return Graph(5, nodes, costs)


def test_a_biased_estimator_fails_and_shrinks_to_its_node():
    graph = _biased_graph()
    outcome = check_graph(graph, rng_offset=OFFSET)
    assert outcome.kind == "biased" and outcome.max_z > 5.5
    small = shrink(graph, lambda g: check_graph(g, 500, rng_offset=OFFSET, confirm=False).kind == "biased",
                   valid=lambda g: True)
    assert [n.estimator for n in small.nodes] == ["StraightThrough"] and len(small.costs) == 1
    assert small.nodes[0].parents == () and small.nodes[0].size == 1


def test_an_error_shrinks_to_a_standalone_script(tmp_path):
    """A graph that raises (an estimator refusing its distribution, here ARM on a categorical) shrinks
    to the node that raises, and its reproducer runs on its own and raises the same error."""
    nodes = (
        Node("z0", "bernoulli", 2, 2, (), "ScoreFunction"),
        Node("z1", "categorical", 1, 3, ("z0",), "ARM", in_plate=True),
    )
    graph = Graph(3, nodes, (Cost("f0", ("z0", "z1")), Cost("f1", ("z1",), own_score=("z1",))), plate=2)
    outcome = check_graph(graph)
    assert outcome.kind == "error" and "ARM" in outcome.detail
    small = shrink(graph, same_failure(outcome, 200), valid=lambda g: True)
    assert [n.name for n in small.nodes] == ["z1"] and small.plate == 0 and len(small.costs) == 1
    script = reproducer(small, check_graph(small).line(), estimates=200)
    assert "def model(draw, p, x, c):" in script and "ARM('z1').double()" in script
    path = tmp_path / "reproducer.py"
    path.write_text(script)
    with pytest.raises(ValueError, match="ARM"), contextlib.redirect_stdout(io.StringIO()):
        exec(compile(script, str(path), "exec"), {"__name__": "__main__"})


def test_a_passing_reproducer_prints_z_scores():
    graph = Graph(4, (Node("z0", "onehot", 2, 3, (), "ScoreFunction + batch_average"),),
                  (Cost("f0", ("z0",), log_prob=("z0",)),))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(reproducer(graph, estimates=300), "<reproducer>", "exec"), {"__name__": "__main__"})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("theta_z0 max |z| ") and float(lines[0].split()[3]) < 5.5


def test_model_source_is_the_same_code_with_and_without_storch():
    graph = random_graph(7)
    plain, exact = model_source(graph), model_source(graph, exact=True)
    assert plain.count("\n") == exact.count("\n")
    assert ".log_prob()" not in exact


@pytest.mark.parametrize("estimator", ["DisARM", "MVD"])
def test_an_estimator_unbiased_at_first_order_only_fails_the_hessian_check(estimator):
    """The catalog's orders are not generous: DisARM's second derivative is 0, MVD's is biased."""
    graph = Graph(9, (Node("z0", "bernoulli", 2, 2, (), estimator),), (Cost("f0", ("z0",)),), order=2)
    assert not entry(estimator).unbiased_for(Bernoulli, 2)
    outcome = check_graph(graph, rng_offset=OFFSET)
    assert outcome.kind == "biased" and outcome.detail.startswith("Hessian-vector product")
