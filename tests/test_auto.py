"""storch.method.Auto: the candidates it takes from the catalog, that every step's gradient is unbiased
(also at the steps where it switches), its choice and record, and its refusal by compile_step.

The unbiasedness tests replicate the parameter along an independent plate (storch.testing.replicate):
one step gives R independent estimates drawn with the candidate of that step, chosen from the history
only, and each step is compared with the exact gradient (enumeration) by storch.testing's z-test.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Normal

import storch
from storch.exceptions import CompileStepError, UnusedNodeWarning
from storch.method import Auto
from storch.method.auto import COLD_START
from storch.method.catalog import entry, unbiased_estimators
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from estimator_checks import DATA, check_copies
from problems import bernoulli, minibatch_bernoulli, nested_categorical, one_categorical, replicated_hessians

pytestmark = pytest.mark.seed(4321)

R = 2000


def _steps(auto: Auto, problem, param: torch.Tensor, exact: torch.Tensor, steps: int, z: float = 4.5) -> list[str]:
    """Run ``steps`` steps of ``auto`` on ``problem`` (parameters fixed, so that the exact gradient stays
    put); assert each step unbiased; the candidate of each step."""
    used = []
    for t in range(steps):
        storch.reset()
        choice = auto.choice
        (estimates,) = replicated_gradients([param], R, problem.model(auto))
        used.append(auto.stats[auto.labels.index(choice)].label if choice else auto.labels[0])
        assert_unbiased(estimates, exact, z=z, label=f"step {t} ({used[-1]})")
    return used


def test_every_step_is_unbiased_also_where_the_candidate_switches():
    problem = bernoulli(interaction=2.0)
    auto = Auto("x", budget=4, visits=1, explore_every=2, growth=1.0)
    used = _steps(auto, problem, problem.phi, problem.exact(), steps=45)
    switches = sum(a != b for a, b in zip(used, used[1:]))
    assert switches >= 20 and set(used) == set(auto.labels)  # every candidate was a step's estimator
    assert len(auto.labels) >= 10 and auto.settled is not None


def test_a_data_plate():
    problem = minibatch_bernoulli(interaction=1.0)
    auto = Auto("z", budget=4, candidates=["ScoreFunction + batch_average", "DisARM", "MVD", "VIMCO"],
                visits=1, explore_every=2, growth=1.0)
    used = _steps(auto, problem, problem.w, problem.exact(), steps=10)
    assert len(set(used)) == 4


def test_a_categorical_node():
    problem = one_categorical()
    auto = Auto("z", budget=6, visits=1, explore_every=2, growth=1.0)
    assert "ARSM" not in auto.labels if auto.stats else True
    used = _steps(auto, problem, problem.theta, problem.exact(), steps=25)
    assert len(set(used)) >= 5


def test_two_nodes_choose_each_on_its_own():
    problem = nested_categorical()
    first = Auto("z1", budget=3, visits=1, explore_every=2, growth=1.0)
    second = Auto("z2", budget=2, visits=1, explore_every=2, growth=1.0)
    pairs = []
    for t in range(12):
        storch.reset()
        grads = replicated_gradients(problem.params, R, problem.model(first, second))
        pairs.append((first.choice, second.choice))
        for g, exact, name in zip(grads, problem.exact(), problem.names):
            assert_unbiased(g, exact, label=f"step {t}, {name}")
    assert first.labels != second.labels  # different budgets: different candidate sets
    assert len(set(pairs)) > 3


def test_second_order_candidates_and_hessians():
    problem = bernoulli(interaction=2.0)
    auto = Auto("x", budget=4, order=2, visits=1, explore_every=2, growth=1.0)
    hessian = problem.exact_hessian().reshape(-1)
    for t in range(8):
        storch.reset()
        estimates = replicated_hessians(problem.phi, R, problem.model(auto))
        assert_unbiased(estimates, hessian, label=f"Hessian, step {t} ({auto.choice})")
    second = {e.label for e in unbiased_estimators(Bernoulli, order=2, plain_models=False)}
    assert all(label.split(" [")[0] in second for label in auto.labels)
    assert not any(label.startswith(("DisARM", "ARM")) for label in auto.labels)


def test_the_harness_catches_a_biased_candidate():
    # the negative control: allowed to be biased, a straight-through candidate fails the same check
    problem = bernoulli(interaction=2.0)
    auto = Auto("x", budget=4, allow_bias=True, candidates=["StraightThrough"])
    (estimates,) = replicated_gradients([problem.phi], R, problem.model(auto))
    assert not check_unbiased(estimates, problem.exact()).passed
    assert auto.record()["candidates"][0]["unbiased"] is False


def _run(auto: Auto, steps: int, logits: torch.Tensor | None = None, offset: float = 0.0) -> None:
    logits = torch.zeros(3, requires_grad=True) if logits is None else logits
    for _ in range(steps):
        z = auto(Bernoulli(logits=logits))
        cost = ((z - torch.tensor([0.1, 0.5, 0.9])) ** 2).sum(-1) + 2.0 * z[..., 0] * z[..., 1] + offset
        storch.add_cost(cost, "f")
        storch.backward()


def test_a_far_noisier_candidate_leaves_the_rounds():
    # without a baseline, a cost offset of 100 makes the score function's second moment about 10^4 times
    # the exact gradient's: it is dropped after its first measured step, from this round and the next
    auto = Auto("x", budget=8, candidates=["ScoreFunction", "Expect"], cost="evaluations", visits=4,
                explore_every=2, growth=1.0)
    _run(auto, 12, offset=100.0)
    score_function, expect = auto.stats
    assert score_function.uses == 1 and "round 1" in score_function.dropped and not expect.dropped
    assert auto.choice == "Expect" and auto.record()["candidates"][0]["dropped"]
    # without pruning in the round, the whole round's score (over recheck=4 times Expect's) keeps it
    # out of the later rounds
    rechecked = Auto("x", budget=8, candidates=["ScoreFunction", "Expect"], cost="evaluations", visits=4,
                     explore_every=2, growth=1.0, prune=None)
    _run(rechecked, 12, offset=100.0)
    assert rechecked.stats[0].uses == 4 and "over recheck=4" in rechecked.stats[0].dropped
    assert rechecked.stats[1].uses == 8  # its 4 steps of round 1, 2 chosen, 2 of round 2 (measured alone)
    kept = Auto("x", budget=8, candidates=["ScoreFunction", "Expect"], cost="evaluations", visits=4,
                explore_every=2, growth=1.0, prune=None, recheck=None)
    _run(kept, 12, offset=100.0)
    assert kept.stats[0].uses == 5  # 4 in round 1, the first step of round 2


def test_recheck_keeps_the_candidates_within_its_factor():
    """After a round, a candidate within ``recheck`` times the best score is measured again."""
    auto = Auto("x", budget=4, candidates=["ScoreFunction + batch_average", "DisARM"], cost="evaluations",
                visits=2, explore_every=2, growth=1.0, prune=None, recheck=1e6)
    _run(auto, 12)
    assert not any(s.dropped for s in auto.stats) and all(s.uses >= 4 for s in auto.stats)
    with pytest.raises(ValueError, match="recheck"):
        Auto("x", recheck=1.0)


def test_candidates_follow_the_catalog_declarations():
    auto = Auto("x", budget=4)
    _run(auto, 1)
    excluded = dict(auto.excluded)
    assert "requires a cost differentiable in the sample" in excluded["DoubleControlVariate"]
    assert "relaxed" in excluded["REBAR"] and "allow_bias" in excluded["StraightThrough"]
    assert "over the budget of 4" in excluded["Expect"]  # 8 configurations
    assert "DisARM [n=2]" in auto.labels and "ScoreFunction + batch_average [n=4]" in auto.labels
    assert all("COLD_START" in excluded[label] for label in COLD_START)  # no baseline in their first steps
    everything = Auto("x", budget=4, exclude=())
    _run(everything, 1)
    assert {"ScoreFunction [n=4]", "MAPO [n=4]"} <= set(everything.labels)
    wider = Auto("x", budget=8, include=["DoubleControlVariate"], relaxed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedNodeWarning)  # the candidates' probes are no nodes of the step
        _run(wider, 1)
    assert {"Expect", "DoubleControlVariate [n=8]", "REBAR [n=2]"} <= set(wider.labels)
    assert all(s.unbiased for s in wider.stats)


@pytest.mark.parametrize("distribution, twin", [
    (Bernoulli(logits=torch.zeros(3)), "ScoreFunction + batch_average [n=4]"),
    (Normal(torch.zeros(3), torch.ones(3)), "Reparameterization [n=4]"),
])
def test_an_entry_that_builds_the_same_estimator_is_one_candidate(distribution, twin):
    # Infer delegates to the score function with the batch-average baseline on a discrete node and to
    # reparameterization on a Normal: at the same count, the same estimator as those entries
    auto = Auto("x", budget=4).build(distribution)
    assert twin in auto.labels and "Infer [n=4]" not in auto.labels
    assert dict(auto.excluded)["Infer [n=4]"].startswith(f"the same estimator as {twin}")
    assert len({(type(m), repr(m)) for m in auto.methods}) == len(auto.methods)


def test_lower_second_moment_wins_at_equal_cost():
    auto = Auto("x", budget=8, candidates=["ScoreFunction", "Expect"], cost="evaluations", visits=3)
    _run(auto, 6)
    assert auto.choice == "Expect" and auto.settled is auto.methods[auto.labels.index("Expect")]
    assert auto.switches[-1][1:3] == ("(measuring)", "Expect")


def test_choice_table_and_record_are_visible():
    auto = Auto("x", budget=4, candidates=["ScoreFunction + batch_average", "DisARM"], visits=2, explore_every=3,
                prune=None)
    logits = torch.zeros(3, requires_grad=True)
    z = auto(Bernoulli(logits=logits))
    assert z.method is auto and z.method.choice == "ScoreFunction + batch_average [n=4]"
    storch.add_cost(z.sum(-1), "f")
    storch.backward()
    _run(auto, 10, logits)
    record = json.loads(json.dumps(auto.record()))
    assert record["choice"] == auto.choice and len(record["candidates"]) == 2
    pairs = [(s["from"], s["to"]) for s in record["switches"]]
    assert pairs[0] == ("", "(measuring)") and pairs[1][0] == "(measuring)" and pairs[1][1] in auto.labels
    assert pairs[-1] == ("(measuring)", record["settled"])  # the settled choice of the latest round (time-based)
    assert all(r["steps"] >= 2 and r["cost_per_step"] > 0 for r in record["candidates"])
    table = auto.table()
    assert "DisARM [n=2]" in table and "*" in table
    assert f"settled on {record['settled']}" in table.splitlines()[0]  # the header names the settled one


def test_candidates_keep_their_state_between_steps():
    auto = Auto("x", budget=2, candidates=["ScoreFunction + moving_average", "DisARM"], visits=2, prune=None)
    averages = []
    for _ in range(8):
        used = auto.choice
        _run(auto, 1)
        baseline = auto.methods[0].baseline
        averages.append((used, {k: v.clone() for k, v in baseline.get_extra_state()["averages"].items()}))
    # the moving average moves on the steps of its own candidate only, and is kept across the others'
    for (_, before), (used, after) in zip(averages, averages[1:]):
        same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        assert same == used.startswith("DisARM"), used
    assert {used for used, _ in averages[1:]} == set(auto.labels)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 3)
        self.method = Auto("z", budget=2, candidates=["ScoreFunction + batch_average", "DisARM"])

    def step(self, x: torch.Tensor) -> torch.Tensor:
        x = storch.denote_independent(x, 0, "data")
        z = self.method(Bernoulli(logits=self.encoder(x)))
        storch.add_cost(((z - x[..., :3]) ** 2).sum(-1), "f")
        return storch.backward()


def test_copies_and_compile_step_refusal():
    check_copies(_Model, DATA)
    model = _Model()
    step = storch.compile_step(model.step, model)
    with pytest.raises(CompileStepError, match="Auto"):
        step(DATA)


def test_bad_arguments():
    with pytest.raises(ValueError, match="budget"):
        Auto("x", budget=0)
    with pytest.raises(ValueError, match="no catalog entries labelled"):
        Auto("x", include=["NoSuchEstimator"])
    auto = Auto("x", budget=1, candidates=["Expect"])
    with pytest.raises(ValueError, match="no catalog estimator applies"):
        _run(auto, 1)
    assert entry("Expect").make_counted is None


def _saved(state: dict):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_a_checkpoint_restores_the_measurements_and_the_schedule():
    def make() -> Auto:  # cost by evaluations: the choices are a function of the seed
        return Auto("x", budget=2, candidates=["ScoreFunction + moving_average", "DisARM"], visits=2,
                    explore_every=3, cost="evaluations")

    auto = make()
    _run(auto, 9)
    state = auto.state_dict()
    other = Auto("x", budget=2, candidates=["ScoreFunction + batch_average", "DisARM"]).build(
        Bernoulli(logits=torch.zeros(3)))
    with pytest.raises(ValueError, match="differ"):
        other.load_state_dict(state, strict=False)
    fresh = make()  # not built: loading rebuilds the candidates from their catalog entries
    fresh.load_state_dict(torch.load(_saved(state), weights_only=True))
    assert fresh.record() == auto.record()
    torch.manual_seed(5)
    _run(auto, 4)
    torch.manual_seed(5)
    _run(fresh, 4)
    assert [s[:3] for s in fresh.switches] == [s[:3] for s in auto.switches] and fresh.choice == auto.choice


def test_the_state_dict_holds_each_candidate_once():
    auto = Auto("x", budget=2, candidates=["ScoreFunction + critic", "DisARM"], visits=1)
    _run(auto, 3)
    assert all(key.startswith(("methods.", "_extra_state", "sampling_method")) for key in auto.state_dict())


def test_evaluations_count_the_points_of_differentiated_parameters():
    # measure-valued derivatives lay out 1 + D points per sample for parameters that require grad: also
    # when Auto is built ahead from a distribution whose parameters do not (storch-bench's dummies)
    for logits in (torch.zeros(200), torch.zeros(200, requires_grad=True)):
        auto = Auto("z", budget=201, candidates=["MVD", "DisARM"]).build(Bernoulli(logits=logits))
        assert dict(zip(auto.labels, (s.evaluations for s in auto.stats))) == {"MVD [n=1]": 201, "DisARM [n=100]": 200}
        narrow = Auto("z", budget=200, candidates=["MVD", "DisARM"]).build(Bernoulli(logits=logits))
        assert narrow.labels == ["DisARM [n=100]"] and "over the budget of 200" in dict(narrow.excluded)["MVD"]
        assert len(narrow.excluded) == 1


def test_one_slow_step_drops_no_candidate_but_two_do(monkeypatch):
    # a clock that makes DisARM's steps 100 times slower: its score is over prune x the best one's, its
    # second moment is not; one such step is noise, two mean the candidate is slow
    import storch.method.auto as auto_module

    clock = [0.0]
    monkeypatch.setattr(auto_module.time, "perf_counter", lambda: clock[0])
    for slow_steps, dropped in ((1, False), (3, True)):
        auto = Auto("x", budget=2, candidates=["ScoreFunction + batch_average", "DisARM"], visits=3)
        logits = torch.zeros(3, requires_grad=True)
        disarm_steps = 0
        for _ in range(6):
            z = auto(Bernoulli(logits=logits))
            slow = auto.choice.startswith("DisARM") and disarm_steps < slow_steps
            disarm_steps += auto.choice.startswith("DisARM")
            clock[0] += 100.0 if slow else 1.0
            storch.add_cost(((z - torch.tensor([0.1, 0.5, 0.9])) ** 2).sum(-1), "f")
            storch.backward()
        assert bool(auto.stats[1].dropped) == dropped
        assert auto.stats[1].uses == (2 if dropped else 3)


def test_an_entry_that_builds_an_excluded_estimator_is_left_out_too():
    # Infer at n=1 is the score function with a moving-average baseline, a COLD_START entry: left out with it
    auto = Auto("x", budget=1).build(Bernoulli(logits=torch.zeros(3)))
    assert not any(label.startswith(("Infer", "ScoreFunction")) for label in auto.labels)
    assert dict(auto.excluded)["Infer [n=1]"] == ("the same estimator as ScoreFunction + moving_average [n=1] on "
                                                  "Bernoulli, which exclude= leaves out")
    everything = Auto("x", budget=1, exclude=()).build(Bernoulli(logits=torch.zeros(3)))
    assert "ScoreFunction + moving_average [n=1]" in everything.labels and "Infer [n=1]" not in everything.labels


def test_a_one_hot_node_counts_the_points_of_its_wrapped_parameters():
    # OneHotCategorical keeps its logits in a Categorical: the probe that counts a candidate's evaluation
    # points makes those require grad too, so measure-valued derivatives count 1 + D(K-1) points per sample
    # (181 for 20 variables of 10 categories) and stay out of a budget of 4, not in it at n=4
    from torch.distributions import OneHotCategorical

    auto = Auto("z", budget=4).build(OneHotCategorical(logits=torch.zeros(20, 10)))
    assert not any(label.startswith("MVD") for label in auto.labels)
    assert dict(auto.excluded)["MVD"] == "needs 181 cost evaluations per step, over the budget of 4"
    small = Auto("z", budget=8).build(OneHotCategorical(logits=torch.zeros(2, 3)))
    assert "MVD [n=1]" in small.labels and small.stats[small.labels.index("MVD [n=1]")].evaluations == 5


def test_cpu_cost_reads_the_process_clock(monkeypatch):
    # cost="cpu": a step's cost is the process's CPU time (time.process_time), not the wall clock; a
    # candidate whose steps take 10 CPU seconds loses to one that takes 1 at the same second moment order
    import storch.method.auto as auto_module

    clock, wall = [0.0], [0.0]
    monkeypatch.setattr(auto_module.time, "process_time", lambda: clock[0])
    monkeypatch.setattr(auto_module.time, "perf_counter", lambda: wall[0])
    auto = Auto("x", budget=2, candidates=["ScoreFunction + batch_average", "DisARM"], visits=2, cost="cpu")
    logits = torch.zeros(3, requires_grad=True)
    for _ in range(4):
        z = auto(Bernoulli(logits=logits))
        clock[0] += 10.0 if auto.choice.startswith("ScoreFunction") else 1.0
        wall[0] += 1000.0 if auto.choice.startswith("DisARM") else 1.0  # the wall clock is not read
        storch.add_cost(((z - torch.tensor([0.1, 0.5, 0.9])) ** 2).sum(-1), "f")
        storch.backward()
    record = auto.record()
    assert [r["cost_per_step"] for r in record["candidates"]] == [10.0, 1.0]
    assert {r["cost_unit"] for r in record["candidates"]} == {"CPU seconds"}
    assert "CPU seconds per step" in record["switches"][-1]["reason"]
    with pytest.raises(ValueError, match="cost must be one of"):
        Auto("x", cost="wall")


@pytest.mark.parametrize("label", ["DoubleControlVariate", "REBAR", "ScoreFunction + batch_average"])
def test_the_measured_second_moment_is_the_steps_gradient(label):
    # the hooks count the backward pass of the surrogate only: not double control variates' own gradients
    # while they build their terms, nor REBAR's variance gradient in its update
    other = "DisARM"
    logits = torch.tensor([0.3, -0.5, 1.0], requires_grad=True)
    auto = Auto("x", budget=4, candidates=[label, other], visits=3, prune=None, include=[label], relaxed=True)
    auto.build(Bernoulli(logits=logits))
    seen: dict[str, list[float]] = {name: [] for name in auto.labels}
    while auto.settled is None:
        used = auto.choice
        logits.grad = None
        _run(auto, 1, logits)
        seen[used].append(float((logits.grad.double() ** 2).sum()))
    for stats in auto.stats:
        measured = seen[stats.label][stats.warmup:]
        assert len(measured) == 3
        assert stats.second_moment == pytest.approx(sum(measured) / 3, rel=1e-5)


def test_samples_drawn_without_autograd_leave_no_record():
    """Evaluation under torch.no_grad() runs no backward, which is where Auto forgets a step's
    nodes: it keeps none of them, however many steps are drawn."""
    from torch.distributions import Bernoulli

    auto = Auto("z", budget=2)
    logits = torch.zeros(3, requires_grad=True)
    with torch.no_grad():
        for _ in range(50):
            z = auto(Bernoulli(logits=logits))
    assert z.method is auto and auto._owners == {}


@pytest.mark.parametrize("allow_bias", [False, True])
def test_every_applicable_entry_is_a_candidate_or_left_out_with_a_reason(allow_bias):
    """No catalog entry for the node's type disappears: each is a candidate or in ``excluded`` with its
    reason; entries whose labels differ in more than the sample count keep their settings in the label
    (``ScoreFunctionWOR(biased=True)`` is not a second ``ScoreFunctionWOR``)."""
    from storch.method.catalog import catalog

    auto = Auto("z", budget=4, allow_bias=allow_bias)
    auto(Bernoulli(logits=torch.zeros(3, requires_grad=True)))
    accounted = set(auto.labels) | {label for label, _ in auto.excluded}
    applicable = [e.label for e in catalog() if e.handles(Bernoulli)]
    missing = [label for label in applicable
               if label not in accounted and not any(a.startswith(label + " [n=") for a in accounted)]
    assert missing == []
    assert len(set(auto.labels)) == len(auto.labels)
    if allow_bias:
        assert "ScoreFunctionWOR(biased=True) [n=4]" in auto.labels
    else:
        assert any(label == "ScoreFunctionWOR(biased=True)" for label, _ in auto.excluded)
    storch.reset()


def test_the_optimizer_forgets_the_first_round_once():
    """With ``optimizer=``, Adam's state is cleared once: after the update of the first round's last step,
    before the first step on the chosen candidate; the later rounds leave it alone."""
    logits = torch.zeros(3, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=1e-2)
    auto = Auto("x", budget=4, candidates=["ScoreFunction + batch_average", "DisARM"], visits=2, explore_every=3,
                growth=1.0, prune=None, optimizer=opt)
    first_round = 2 * 2
    adam_steps = []
    for _ in range(first_round + 3 + 2 * 2 + 3):  # round 1, its choice, round 2, its choice
        storch.reset()
        opt.zero_grad()
        z = auto(Bernoulli(logits=logits))
        adam_steps.append(int(opt.state[logits]["step"]) if logits in opt.state else 0)
        storch.add_cost((z - torch.tensor([0.2, 0.5, 0.9])).pow(2).sum(-1), "f")
        storch.backward()
        opt.step()
    # Adam's own count of steps, read at each draw: cleared at the draw after the first round only
    assert adam_steps[:first_round] == list(range(first_round))
    assert adam_steps[first_round:] == list(range(len(adam_steps) - first_round))
    assert auto._round == 3  # the second round came and went without clearing it
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        Auto("x", optimizer=[logits])
