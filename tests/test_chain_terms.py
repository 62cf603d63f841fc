"""A single-sample chain whose steps share one score-function method is formed at once.

``storch._chain_terms``: ``Σ_t c_t □(L_t) + Σ_s (1 − □(l_s)) b_s □(L_{s−1})`` from the stacked
log-probabilities and the reward to go, instead of one node term per step. It must be the per-step
recursion's surrogate exactly: the same values, gradients and Hessians on the same draws; unbiased
against enumeration; and chains it does not apply to (mixed methods) are formed step by step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical

import storch
import storch.inference
from storch.testing import assert_unbiased, replicate
from tests.seeding import manual_seed
from tests.test_single_sample_chains import STEPS, W0, chain_model, exact_objective, hand_written_reward_to_go, rollout

T = 6


class StepByStep(storch.method.ScoreFunction):
    """The same estimator, its chains formed one node term per step (the recursion's general path)."""

    def vectorises_chain(self, plates) -> bool:
        return False


@pytest.fixture
def node_terms(monkeypatch):
    """The number of per-step node terms the surrogate forms."""
    calls = []
    original = storch.inference._node_term
    monkeypatch.setattr(storch.inference, "_node_term", lambda *a: calls.append(1) or original(*a))
    return calls


def episodes(W: torch.Tensor, theta: torch.Tensor, method) -> None:
    """Three episodes of a tabular policy over 4 tokens; each reward depends on the token and on
    ``theta`` directly (a pathwise part), so values, gradients and Hessians all have both parts."""
    tok = storch.denote_independent(torch.tensor([0, 1, 3]), 0, "episodes")
    for t in range(T):
        logits = (F.one_hot(tok, 4).to(W.dtype).unsqueeze(-1) * W).sum(-2)
        tok = method(Categorical(logits=logits))
        reward = (tok == 2).to(W.dtype) * theta[t % 2] + theta[1] ** 2 * (tok == 1).to(W.dtype) - 0.3 * t
        storch.add_cost(reward, f"r{t}")


def derivatives(cls: type, baseline: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The surrogate's value, gradient and Hessian in ``(W, theta)`` on fixed draws, and the baselines'
    averages after the step; with a baseline, a first step sets the averages."""
    W = torch.tensor([[0.3, -0.2, 0.1, 0.5], [-0.5, 0.4, 0.0, 0.2], [0.1, 0.1, -0.3, 0.0], [0.2, -0.1, 0.4, -0.4]],
                     dtype=torch.float64, requires_grad=True)
    theta = torch.tensor([0.7, -1.2], dtype=torch.float64, requires_grad=True)
    method = cls("action", baseline_factory=baseline)
    if baseline is not None:
        manual_seed(1)
        episodes(W, theta, method)
        storch.backward()
    manual_seed(2)
    episodes(W, theta, method)
    value = storch.surrogate_loss()
    storch.reset()
    params = [W, theta]
    gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, params, create_graph=True)])
    rows = []
    for i in range(gradient.numel()):
        row = torch.autograd.grad(gradient[i], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if r is None else r).reshape(-1) for r, p in zip(row, params)]))
    averages = {} if method.baseline is None else {k: v.item() for k, v in method.baseline.averages.items()}
    return value.detach(), gradient.detach(), torch.stack(rows), averages


@pytest.mark.parametrize("baseline", [None, "moving_average"])
def test_values_gradients_and_hessians_equal_the_per_step_terms(baseline, node_terms):
    value, gradient, hessian, averages = derivatives(storch.method.ScoreFunction, baseline)
    assert node_terms == []  # formed at once: no per-step node term
    expected = derivatives(StepByStep, baseline)
    assert len(node_terms) == T * (2 if baseline else 1)
    torch.testing.assert_close(value, expected[0])
    torch.testing.assert_close(gradient, expected[1])
    torch.testing.assert_close(hessian, expected[2])
    assert hessian.abs().sum() > 0 and (hessian - hessian.T).abs().max() < 1e-12
    assert averages == pytest.approx(expected[3]) and len(averages) == (T if baseline else 0)


@pytest.mark.parametrize("baseline", [None, "moving_average"])
def test_one_method_chain_is_unbiased_against_enumeration(baseline, node_terms):
    method = storch.method.ScoreFunction("a", baseline_factory=baseline)
    exact = torch.autograd.functional.jacobian(exact_objective, W0)
    repeats = 20000
    for _ in range(2):  # the second step uses the baselines learned in the first
        leaf, view = replicate(W0, repeats)
        chain_model(view, [method] * STEPS)
        storch.backward()
        assert_unbiased((leaf.grad * repeats).reshape(repeats, -1), exact.reshape(-1), label=f"one method/{baseline}")
    assert node_terms == []


def test_one_method_chain_second_derivative_is_unbiased(node_terms):
    repeats = 20000
    method = storch.method.ScoreFunction("a")
    leaf, view = replicate(W0, repeats)
    chain_model(view, [method] * STEPS)
    storch.backward(create_graph=True)
    second = torch.autograd.grad(leaf.grad.sum(), leaf)[0] * repeats
    hessian = torch.autograd.functional.hessian(exact_objective, W0)
    assert_unbiased(second.reshape(repeats, -1), hessian.sum((0, 1)).reshape(-1), label="one method Hessian")
    assert node_terms == []


def test_a_chain_of_mixed_methods_is_formed_step_by_step(node_terms):
    """Two methods taking turns along one chain: one node term per step, the hand-written gradient."""
    manual_seed(3)
    W = torch.randn(4, 4, requires_grad=True)
    a, b = storch.method.ScoreFunction("a"), storch.method.ScoreFunction("b")
    tokens = [int(t._tensor) for t in rollout(W, 20, [a, b] * 10)]
    storch.backward()
    assert len(node_terms) == 20
    torch.testing.assert_close(W.grad, hand_written_reward_to_go(W.detach().requires_grad_(), tokens))


def _observed_rollout(recreate: bool, method_of) -> torch.Tensor:
    """16 episodes of 10 decisions on observations made a plate once, or at every step as a numpy
    environment's are; the gradient of the linear policy."""
    manual_seed(0)
    head = torch.nn.Linear(3, 2)
    observations = torch.randn(10, 16, 3)
    once = storch.denote_independent(observations.transpose(0, 1), 0, "episodes")
    manual_seed(1)
    h = torch.zeros(3)
    for t in range(10):
        obs = storch.denote_independent(observations[t], 0, "episodes") if recreate else once[..., t, :]
        a = method_of(t)(Categorical(logits=head(obs + h)))
        h = torch.tanh(h + a.unsqueeze(-1).float())
        storch.add_cost(a.float() - 0.5, f"r{t}")
    storch.backward()
    return head.weight.grad


def _hand_written_observed_rollout() -> torch.Tensor:
    manual_seed(0)
    head = torch.nn.Linear(3, 2)
    observations = torch.randn(10, 16, 3)
    manual_seed(1)
    h = torch.zeros(16, 3)
    log_probs, rewards = [], []
    for t in range(10):
        distribution = Categorical(logits=head(observations[t] + h))
        a = distribution.sample((1,))[0]
        log_probs.append(distribution.log_prob(a))
        rewards.append(a.float() - 0.5)
        h = torch.tanh(h + a.unsqueeze(-1).float())
    to_go = torch.stack(rewards, 1).flip(1).cumsum(1).flip(1)
    (torch.stack(log_probs, 1) * to_go).mean(0).sum().backward()
    return head.weight.grad


@pytest.mark.parametrize("shared", [True, False], ids=["one method", "a method per step"])
def test_a_data_plate_made_again_at_every_step_keeps_each_episode_its_credit(shared):
    """An independent plate made after a node was drawn on an equal one is reduced after that node:
    each episode's log-probabilities multiply that episode's reward to go, not the average over episodes."""
    method = storch.method.ScoreFunction("a")
    method_of = (lambda t: method) if shared else (lambda t: storch.method.ScoreFunction(f"a{t}"))
    expected = _hand_written_observed_rollout()
    torch.testing.assert_close(_observed_rollout(False, method_of), expected)
    torch.testing.assert_close(_observed_rollout(True, method_of), expected)


def test_a_compiled_step_replays_the_chain_formed_at_once():
    """storch.compile_step traces the chain's stacked terms and replays the eager gradients."""
    head = torch.nn.Linear(4, 3)
    compiled_method = storch.method.ScoreFunction("a", baseline_factory="moving_average")
    eager_method = storch.method.ScoreFunction("a", baseline_factory="moving_average")

    def step(method, x):
        obs = storch.denote_independent(x, 0, "episodes")
        h = obs
        for t in range(4):
            a = method(Categorical(logits=head(h)))
            h = h + a.unsqueeze(-1).to(x.dtype)
            storch.add_cost((a == t % 3).to(x.dtype), f"r{t}")
        return storch.backward()

    compiled = storch.compile_step(lambda x: step(compiled_method, x), head, compiled_method)
    x = torch.randn(5, 4)
    for i in range(3):  # trace, then replays
        manual_seed(20 + i)
        head.zero_grad()
        compiled(x)
        replayed = [p.grad.clone() for p in head.parameters()]
        manual_seed(20 + i)
        head.zero_grad()
        step(eager_method, x)
        for r, e in zip(replayed, head.parameters()):
            torch.testing.assert_close(r, e.grad)


def test_a_baseline_subclass_with_its_own_computation_is_asked_step_by_step(node_terms):
    """A MovingAverageBaseline subclass that computes its baseline otherwise is not bypassed: the chain
    is formed step by step and its compute_baseline sees every decision."""
    seen = []

    class Halved(storch.method.baseline.MovingAverageBaseline):
        def compute_baseline(self, tensor, cost_node):
            seen.append(cost_node.name)
            return 0.5 * super().compute_baseline(tensor, cost_node)

    W = torch.zeros(4, 4, requires_grad=True)
    policy = storch.method.ScoreFunction("action", baseline_factory=Halved())
    rollout(W, 5, [policy] * 5)
    storch.backward()
    assert len(node_terms) == 5 and sorted(seen) == [f"r{t}" for t in range(5)]


@pytest.mark.parametrize("baseline", [None, "moving_average"])
def test_a_one_step_chain_with_one_cost_is_the_chains_one_step_term(baseline, node_terms):
    """A single-sample node with one cost (REINFORCE on a minibatch) gets its node term as any node
    does; it is the term the chain's recursion forms when another cost reaches the step too (here a
    zero one): the same values, gradients, Hessians and baseline averages, over two steps."""

    def run(extra_cost: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        W = W0.clone().double().requires_grad_()
        method = storch.method.ScoreFunction("a", baseline_factory=baseline)
        results = []
        for seed in (1, 2):
            manual_seed(seed)
            tok = storch.denote_independent(torch.tensor([0, 1, 1, 0]), 0, "episodes")
            a = method(Categorical(logits=W[tok]))
            reward = W[a, a] ** 2 - 0.3 * (a == 1).double()
            storch.add_cost(reward, "r")
            if extra_cost:
                storch.add_cost(0.0 * reward.detach(), "zero")
            value = storch.surrogate_loss()
            gradient = torch.autograd.grad(value, W, create_graph=True)[0]
            hessian = torch.autograd.grad(gradient.sum(), W, retain_graph=True)[0]
            storch.backward(retain_graph=True)  # updates the baseline
            results = [value.detach(), gradient.detach(), hessian]
        averages = {} if method.baseline is None else {k: v.item() for k, v in method.baseline.averages.items()}
        return (*results, averages)

    alone = run(extra_cost=False)
    assert len(node_terms) == 4  # the node term of each step, for surrogate_loss and for backward
    together = run(extra_cost=True)
    for a, b in zip(alone[:3], together[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert alone[1].abs().sum() > 0 and alone[2].abs().sum() > 0
    assert alone[3] == pytest.approx(together[3]) and len(alone[3]) == (1 if baseline else 0)
