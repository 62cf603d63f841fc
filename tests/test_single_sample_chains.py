"""Single-sample chains: rollouts of any length, reward-to-go credit assignment in O(T).

A node drawn with one plain Monte Carlo sample from a distribution that carries the newest step of a
chain extends the chain instead of adding a plate (``storch.plate.ChainPlate``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Bernoulli, Categorical, Normal

import storch
import storch.inference
from storch.plate import ChainPlate, PlateClashError
from storch.testing import assert_unbiased, replicate
from tests.seeding import manual_seed


def rollout(W: torch.Tensor, T: int, methods=None, reward=None):
    """A tabular policy over 4 tokens: token t+1 ~ Categorical(W[token t]); reward 1 for token 2."""
    tok = torch.tensor(0)
    tokens = []
    for t in range(T):
        method = methods[t] if methods is not None else storch.method.ScoreFunction(f"t{t}")
        logits = (F.one_hot(tok, 4).to(W.dtype).unsqueeze(-1) * W).sum(-2)  # W[tok], per sample
        tok = method(Categorical(logits=logits))
        tokens.append(tok)
        storch.add_cost((tok == 2).to(W.dtype) if reward is None else reward(t, tok), f"r{t}")
    return tokens


@pytest.mark.parametrize("T", [100, 1000])
def test_a_rollout_of_any_length_carries_one_plate(T):
    W = torch.zeros(4, 4, requires_grad=True)
    tokens = rollout(W, T)
    assert [p.name for p in tokens[-1].plates] == [f"t{T - 1}"]
    assert isinstance(tokens[-1].plates[0], ChainPlate) and tokens[-1].plates[0].depth == T - 1
    estimate = storch.backward()
    assert torch.isfinite(W.grad).all() and W.grad.abs().sum() > 0
    assert estimate.item() == sum(float(t._tensor.item() == 2) for t in tokens)


def test_the_issue_rollout_with_plain_indexing():
    W = torch.zeros(4, 4, requires_grad=True)
    tok = torch.tensor(0)
    for t in range(100):
        tok = storch.method.ScoreFunction(f"t{t}", n_samples=1)(Categorical(logits=W[tok]))
    storch.add_cost((tok == 2).float(), "last")
    storch.backward()
    assert torch.isfinite(W.grad).all()


def hand_written_reward_to_go(W: torch.Tensor, tokens: list[int], baselines=None) -> torch.Tensor:
    """REINFORCE with reward-to-go on the given draws: Σ_s ∇log p(a_s | a_{s-1}) (G_s - b_s)."""
    rewards = [float(a == 2) for a in tokens]
    loss = W.new_zeros(())
    prev = 0
    for s, a in enumerate(tokens):
        log_p = torch.log_softmax(W[prev], -1)[a]
        to_go = sum(rewards[s:]) - (0.0 if baselines is None else baselines[s])
        loss = loss + log_p * to_go
        prev = a
    return torch.autograd.grad(loss, W)[0]


def test_gradient_equals_hand_written_reward_to_go_on_the_same_draws():
    manual_seed(3)
    W = torch.randn(4, 4, requires_grad=True)
    tokens = [int(t._tensor) for t in rollout(W, 30)]
    storch.backward()
    expected = hand_written_reward_to_go(W.detach().requires_grad_(), tokens)
    torch.testing.assert_close(W.grad, expected)


def test_per_decision_moving_average_baselines_on_the_reward_to_go():
    """Each decision's baseline averages its own reward-to-go (the cost registered at its step names it)."""
    manual_seed(4)
    T = 12
    W = torch.randn(4, 4, requires_grad=True)
    methods = [storch.method.ScoreFunction(f"t{t}", baseline_factory="moving_average") for t in range(T)]
    first = [int(t._tensor) for t in rollout(W, T, methods)]
    storch.backward()
    returns = [sum(float(a == 2) for a in first[s:]) for s in range(T)]
    for s, method in enumerate(methods):  # the first update sets the average to the first value
        assert method.baseline.averages[f"r{s}"].item() == pytest.approx(returns[s])
    W.grad = None
    second = [int(t._tensor) for t in rollout(W, T, methods)]
    storch.backward()
    expected = hand_written_reward_to_go(W.detach().requires_grad_(), second, baselines=returns)
    torch.testing.assert_close(W.grad, expected)


def test_credit_assignment_forms_each_decision_once(monkeypatch):
    """T decisions with a reward after each: T node terms, not T(T+1)/2."""
    calls = []
    original = storch.inference._node_term
    monkeypatch.setattr(storch.inference, "_node_term", lambda *a: calls.append(1) or original(*a))
    W = torch.zeros(4, 4, requires_grad=True)
    rollout(W, 200)
    storch.backward()
    assert len(calls) == 200


# ----------------------------------------------------------- unbiased against exact enumeration
STEPS = 3
REWARD = torch.tensor([[0.5, -1.0], [2.0, 0.3], [-0.7, 1.5]])


def chain_model(W: torch.Tensor, methods) -> None:
    """Binary actions; a_t ~ Categorical(W[a_{t-1}]); reward after each step depends on a_t and a_{t-1}."""
    prev = torch.tensor(0)
    for t in range(STEPS):
        logits = (F.one_hot(prev, 2).to(W.dtype).unsqueeze(-1) * W).sum(-2)
        a = methods[t](Categorical(logits=logits))
        r = (F.one_hot(a, 2).to(W.dtype) * REWARD[t]).sum(-1) * (1.0 + prev.to(W.dtype))
        storch.add_cost(r, f"r{t}")
        prev = a


def exact_objective(W: torch.Tensor) -> torch.Tensor:
    total = W.new_zeros(())
    for actions in itertools.product(range(2), repeat=STEPS):
        p, value, prev = W.new_ones(()), W.new_zeros(()), 0
        for t, a in enumerate(actions):
            p = p * torch.softmax(W[prev], -1)[a]
            value = value + REWARD[t, a] * (1.0 + prev)
            prev = a
        total = total + p * value
    return total


W0 = torch.tensor([[0.3, -0.2], [-0.5, 0.4]])


@pytest.mark.parametrize("baseline", [None, "moving_average"])
def test_chain_is_unbiased_against_enumeration(baseline):
    methods = [storch.method.ScoreFunction(f"a{t}", baseline_factory=baseline) for t in range(STEPS)]
    exact = torch.autograd.functional.jacobian(exact_objective, W0)
    repeats = 20000
    for _ in range(2):  # the second step uses baselines learned in the first
        leaf, view = replicate(W0, repeats)
        chain_model(view, methods)
        storch.backward()
        assert_unbiased((leaf.grad * repeats).reshape(repeats, -1), exact.reshape(-1), label=f"chain/{baseline}")


def test_chain_second_derivative_is_unbiased():
    """DiCE is exact at every order: the Hessian's row sums against enumeration."""
    repeats = 20000
    methods = [storch.method.ScoreFunction(f"a{t}") for t in range(STEPS)]
    leaf, view = replicate(W0, repeats)
    chain_model(view, methods)
    storch.backward(create_graph=True)
    second = torch.autograd.grad(leaf.grad.sum(), leaf)[0] * repeats
    hessian = torch.autograd.functional.hessian(exact_objective, W0)  # (2, 2, 2, 2)
    assert_unbiased(second.reshape(repeats, -1), hessian.sum((0, 1)).reshape(-1), label="chain Hessian")


def test_reparameterized_chain_matches_the_pathwise_gradient():
    manual_seed(5)
    mu = torch.tensor(0.1, requires_grad=True)
    x = torch.tensor(0.0)
    eps = []
    for t in range(80):
        x = storch.method.Reparameterization(f"x{t}")(Normal(0.9 * x + mu, 0.1))
        eps.append(x)
    storch.add_cost(x * x, "end")
    assert len(x.plates) == 1
    storch.backward()
    values = torch.stack([e._tensor.reshape(()) for e in eps]).detach()
    # x_T = Σ_t 0.9^(T-1-t) (mu + noise_t): d x_T / d mu = Σ_t 0.9^t
    dx = sum(0.9**t for t in range(80))
    torch.testing.assert_close(mu.grad, 2 * values[-1] * dx)


def test_chain_with_a_data_plate_created_at_each_step():
    """A batch of episodes whose observations are made a plate at every step."""
    manual_seed(6)
    head = torch.nn.Linear(3, 2)
    h = torch.zeros(3)
    for t in range(70):
        obs = storch.denote_independent(torch.randn(16, 3), 0, "episodes")
        a = storch.method.ScoreFunction(f"a{t}", baseline_factory="moving_average")(
            Categorical(logits=head(obs + h))
        )
        h = torch.tanh(h + a.unsqueeze(-1).float())
        storch.add_cost(a.float(), f"r{t}")
    assert sorted(p.name for p in a.plates) == ["a69", "episodes"]
    storch.backward()
    assert torch.isfinite(head.weight.grad).all()


def test_a_sibling_gets_its_own_plate():
    """A node drawn from an older step than the chain's newest does not branch the chain."""
    p = torch.tensor(0.4, requires_grad=True)
    a = storch.method.ScoreFunction("a")(Bernoulli(p))
    b = storch.method.ScoreFunction("b")(Bernoulli(p * a + 0.1))  # extends a
    c = storch.method.ScoreFunction("c")(Bernoulli(p * a + 0.2))  # a is no longer the newest step
    assert [q.name for q in b.plates] == ["b"]
    assert sorted(q.name for q in c.plates) == ["a", "c"]
    assert sorted(q.name for q in (b + c).plates) == ["b", "c"]
    storch.add_cost(b + c, "f")
    storch.backward()
    assert torch.isfinite(p.grad)


def test_one_policy_method_called_at_every_decision():
    """The same method called again on a distribution computed from its last sample extends its chain
    (one plate named after it); its moving average keeps one average per decision's reward to go."""
    manual_seed(7)
    T = 40
    W = torch.randn(4, 4, requires_grad=True)
    policy = storch.method.ScoreFunction("action", baseline_factory="moving_average")
    tokens = rollout(W, T, [policy] * T)
    assert [p.name for p in tokens[-1].plates] == ["action"]
    first = [int(t._tensor) for t in tokens]
    storch.backward()
    returns = [sum(float(a == 2) for a in first[s:]) for s in range(T)]
    assert {name: v.item() for name, v in policy.baseline.averages.items()} == pytest.approx(
        {f"r{s}": returns[s] for s in range(T)}
    )
    W.grad = None
    second = [int(t._tensor) for t in rollout(W, T, [policy] * T)]
    storch.backward()
    expected = hand_written_reward_to_go(W.detach().requires_grad_(), second, baselines=returns)
    torch.testing.assert_close(W.grad, expected)


def test_a_thousand_decisions_train_with_per_decision_baselines_as_hand_written_reinforce():
    """T = 1000, a reward after each decision, one policy method with a moving average per decision:
    two steps, each equal to hand-written reward-to-go REINFORCE with the same baselines."""
    manual_seed(8)
    T = 1000
    W = torch.randn(4, 4, requires_grad=True)
    optimizer = torch.optim.SGD([W], lr=0.01)
    policy = storch.method.ScoreFunction("action", baseline_factory="moving_average")
    baselines = None
    for _ in range(2):
        optimizer.zero_grad()
        draws = [int(t._tensor) for t in rollout(W, T, [policy] * T)]
        storch.backward()
        expected = hand_written_reward_to_go(W.detach().requires_grad_(), draws, baselines=baselines)
        # float32 sums of 1000 terms in another order (stacked here, one at a time by hand): their
        # rounding moves the last 4-5 digits with the CPU's kernels (ATEN_CPU_CAPABILITY)
        torch.testing.assert_close(W.grad, expected, rtol=1e-4, atol=1e-3)
        optimizer.step()
        returns = [0.0] * T
        for s in reversed(range(T)):
            returns[s] = float(draws[s] == 2) + (returns[s + 1] if s + 1 < T else 0.0)
        baselines = returns if baselines is None else [0.95 * b + 0.05 * r for b, r in zip(baselines, returns)]
    assert len(policy.baseline.averages) == T


def test_a_method_called_again_without_its_chain_is_refused_where_plates_would_clash():
    """Called again on a distribution that does not carry its last sample, a method starts a second
    chain with the same name: the two meet with a clash that names the plate."""
    p = torch.tensor(0.3, requires_grad=True)
    method = storch.method.ScoreFunction("a")
    first = method(Bernoulli(p))
    second = method(Bernoulli(p))
    with pytest.raises(PlateClashError, match="Two different plates are named 'a'"):
        first + second
    storch.reset()


def test_an_earlier_node_of_a_chain_named_in_a_reduction_is_explained():
    p = torch.tensor(0.3, requires_grad=True)
    a = storch.method.ScoreFunction("a")(Bernoulli(p))
    b = storch.method.ScoreFunction("b")(Bernoulli(0.2 + 0.5 * a))
    with pytest.raises(ValueError, match="'a' is an earlier node of the single-sample chain whose newest node is 'b'"):
        storch.reduce_plates(b, "a")
    storch.reset()


def test_a_step_frees_its_chain():
    """Nothing of a rollout outlives its step, without waiting for the cyclic garbage collector (the
    chain's plates hold their nodes, the nodes refer back only weakly)."""
    import gc
    import weakref

    W = torch.zeros(4, 4, requires_grad=True)
    gc.disable()
    try:
        tokens = rollout(W, 50)
        first = weakref.ref(tokens[0].plates[0])
        storch.backward()
        del tokens
        assert first() is None
    finally:
        gc.enable()


def test_a_node_drawn_from_two_chains_extends_the_newer():
    p = torch.tensor(0.4, requires_grad=True)
    a = storch.method.ScoreFunction("a")(Bernoulli(p))
    b = storch.method.ScoreFunction("b")(Bernoulli(p))  # independent of a: a chain of its own
    c = storch.method.ScoreFunction("c")(Bernoulli(0.1 + 0.4 * (a + b)))
    assert sorted(q.name for q in c.plates) == ["a", "c"]  # c took b's place, a stays
    assert c.plates[0].ancestor is b.plates[0]
    storch.add_cost(c, "f")
    storch.backward()
    assert torch.isfinite(p.grad)


def test_a_chain_steps_distribution_copy_is_made_only_when_read():
    """A step's distribution without the previous step's plate is copied on the first read only: the
    surrogate's log-probabilities come from the distribution it was drawn from (the same values), so a
    rollout's backward makes no copy; a read gives the copy, with the samples' plates."""
    W = torch.randn(4, 4, requires_grad=True)
    data = storch.denote_independent(torch.zeros(3), 0, "episodes")
    method = storch.method.ScoreFunction("a")
    tok = method(Categorical(logits=W[0] + data.unsqueeze(-1)))
    steps = [tok]
    for _ in range(3):
        tok = method(Categorical(logits=(F.one_hot(tok, 4).to(W.dtype).unsqueeze(-1) * W).sum(-2)))
        steps.append(tok)
        storch.add_cost((tok == 2).to(W.dtype), "r")
    nodes = [s._node for s in steps]
    assert all(n.distribution_if_made() is None for n in nodes[1:])
    storch.backward()
    assert all(n.distribution_if_made() is None for n in nodes[1:])  # backward made no copy
    for node in nodes[1:]:
        with storch.extend.no_dispatch():
            drawn_from = node.own_samples_log_prob()
        copy = node.distribution  # made now
        assert node.distribution_if_made() is copy
        assert storch.extend.layout_of(copy.logits).plates == node.layout.plates[1:]
        with storch.extend.no_dispatch():
            assert torch.equal(drawn_from, node.own_samples_log_prob())
            assert torch.equal(drawn_from, copy.log_prob(node.samples))


def test_param_grads_of_chain_steps_are_the_gradients_of_their_parameters():
    """``param_grads`` of a chain step (whose distribution's copy without the previous step is never made)
    is the surrogate's gradient with respect to the parameters it was drawn from, without the previous
    step's size-1 dimension, laid out with the samples' other plates."""
    W = torch.randn(4, 4, requires_grad=True)

    def steps():
        data = storch.denote_independent(torch.zeros(3), 0, "episodes")
        method = storch.method.ScoreFunction("a")
        tok = method(Categorical(logits=W[0] + data.unsqueeze(-1)))
        out = []
        for _ in range(3):
            logits = (F.one_hot(tok, 4).to(W.dtype).unsqueeze(-1) * W).sum(-2)
            tok = method(Categorical(logits=logits))
            out.append((tok, logits))
            storch.add_cost((tok == 2).to(W.dtype) + tok.to(W.dtype), "r")
        return out

    manual_seed(3)
    drawn = steps()
    dists = [tok._node.drawn_distribution() for tok, _ in drawn]
    params = [d.logits for d, _ in dists]
    expected = torch.autograd.grad(storch.surrogate_loss(), params)
    storch.reset()
    manual_seed(3)
    drawn = steps()
    storch.backward()
    for (tok, _), (_, previous), grad in zip(drawn, dists, expected):
        got = tok.param_grads["logits"]
        assert got.plate_names == ["episodes"]
        at = storch.extend.layout_of(grad).names.index(previous.name)
        assert torch.equal(got.plain(), grad.plain().select(at, 0))
