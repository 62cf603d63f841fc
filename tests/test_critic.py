"""Critics (storch.method.critic): learned value functions and Q-functions of a node's non-descendants.

* unbiased, untrained (random networks with large outputs, frozen) and trained, on graphs where the
  non-descendants matter: two nested categorical nodes; a chain of three decisions with a cost after
  each (benchmarks/credit_assignment.py); two Bernoulli nodes with two costs of different ancestors
  (the Q critic over two factorised bits); a minibatch plate; index-valued ``Categorical`` samples;
  and second derivatives (``backward(create_graph=True)``);
* the critics learn: the value critic's prediction approaches ``E[f | z₁]``, the Q critic's
  ``f(z₁, z₂)``, and their losses fall;
* ``state_dict`` round trip into a freshly built method (through ``torch.save``/``torch.load``),
  after which both train identically; pickling and deep copies after training;
* the variance table of the benchmark (tiny version): critic < none, Q critic < critic;
* clear errors.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch.distributions import Bernoulli, Normal

import storch
from storch.method import Critic, Infer, Method, QCritic, ScoreFunction, log_prob
from storch.method.critic import critic_inputs, mlp
from storch.testing import assert_unbiased, replicated_gradients

from problems import bernoulli, minibatch_bernoulli, nested_categorical, one_categorical, replicated_hessians, two_costs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import credit_assignment  # noqa: E402  (benchmarks/credit_assignment.py)

pytestmark = pytest.mark.seed(2019)

R = 3000


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: on a loaded machine one thread is many times faster than several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

TRAIN_STEPS, TRAIN_BATCH = 25, 32


def _random_network(in_features: int, out_features: int) -> torch.nn.Module:
    """A random critic far from any good one: outputs of a few units that vary with the input."""
    net = mlp(in_features, out_features, hidden=16)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(4.0)
    return net


KINDS = {
    "critic_untrained": lambda: Critic(network_factory=_random_network, train_critic=False),
    "critic_trained": lambda: Critic(lr=3e-2),
    "q_critic_untrained": lambda: QCritic(network_factory=_random_network, train_critic=False),
    "q_critic_trained": lambda: QCritic(lr=3e-2),
}


def _train(params, model, steps: int = TRAIN_STEPS) -> None:
    for _ in range(steps):
        replicated_gradients(params, TRAIN_BATCH, model)


def _sf(name: str, kind: str, n: int = 1) -> ScoreFunction:
    return ScoreFunction(name, n_samples=n, baseline_factory=KINDS[kind])


# ---------------------------------------------------------------- unbiasedness
NESTED = nested_categorical(3, 3)
CHAIN = credit_assignment.chain(steps=3, k=3)
TWO_COSTS = two_costs()
MINIBATCH = minibatch_bernoulli(interaction=1.0)
ONE_INDEX = one_categorical(4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_nested_categorical_nodes(kind):
    model = NESTED.model(_sf("z1", kind), _sf("z2", kind, n=2))
    _train(NESTED.params, model)
    NESTED.assert_unbiased(model, R, label=kind)


@pytest.mark.parametrize("kind", list(KINDS))
def test_chain_with_a_cost_after_each_decision(kind):
    model = CHAIN.model([_sf(f"z{t + 1}", kind) for t in range(CHAIN.steps)])
    _train(CHAIN.params, model)
    grads = replicated_gradients(CHAIN.params, R, model)
    for g, e, name in zip(grads, CHAIN.exact(), ("theta0", "theta")):
        assert_unbiased(g, e, label=f"{kind} {name}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_costs_with_different_ancestors(kind):
    model = TWO_COSTS.model(_sf("z1", kind, n=2), _sf("z2", kind))
    _train(TWO_COSTS.params, model)
    TWO_COSTS.assert_unbiased(model, R, label=kind)


@pytest.mark.parametrize("kind", ["critic_trained", "q_critic_trained"])
def test_minibatch_plate(kind):
    method = _sf("z", kind)
    model = MINIBATCH.model(method)
    _train([MINIBATCH.w], model)
    assert method.baseline.head("f").in_features == 2  # the probabilities of one data point's two bits
    (grads,) = replicated_gradients([MINIBATCH.w], R, model)
    assert_unbiased(grads, MINIBATCH.exact(), label=kind)


@pytest.mark.parametrize("kind", ["q_critic_untrained", "q_critic_trained"])
def test_q_critic_with_index_valued_categorical_samples(kind):
    model = ONE_INDEX.model(_sf("z", kind), one_hot=False)
    _train([ONE_INDEX.theta], model)
    (grads,) = replicated_gradients([ONE_INDEX.theta], R, model)
    assert_unbiased(grads, ONE_INDEX.exact(), label=kind)


def test_value_critic_of_ancestor_samples_is_unbiased():
    make = lambda: Critic(lr=3e-2, include_ancestors=True)  # noqa: E731
    m2 = ScoreFunction("z2", n_samples=1, baseline_factory=make)
    model = NESTED.model(ScoreFunction("z1", n_samples=1, baseline_factory=make), m2)
    _train(NESTED.params, model)
    assert m2.baseline.head("f").in_features == 3 + 3  # z2's probabilities and z1's one-hot sample
    NESTED.assert_unbiased(model, R, label="include_ancestors")


INTERACTING = bernoulli(interaction=2.0)


@pytest.mark.parametrize("kind", ["critic_trained", "q_critic_untrained", "q_critic_trained"])
def test_hessian_unbiased(kind):
    method = _sf("x", kind, n=2)
    model = INTERACTING.model(method)
    _train([INTERACTING.phi], model)
    hessians = replicated_hessians(INTERACTING.phi, R, model)
    assert_unbiased(hessians, INTERACTING.exact_hessian().reshape(-1), label=kind)


def test_infer_takes_a_critic():
    phi = INTERACTING.phi
    method = Infer("x", n_samples=1, baseline_factory="critic")
    model = INTERACTING.model(method)
    _train([phi], model, 5)
    assert isinstance(method.score_function.baseline, Critic)
    (grads,) = replicated_gradients([phi], R, model)
    assert_unbiased(grads, INTERACTING.exact(), label="infer")


# ---------------------------------------------------------------- learning
def test_value_critic_learns_the_expected_downstream_cost():
    m1 = ScoreFunction("z1", n_samples=1, baseline_factory="critic")
    m2 = ScoreFunction("z2", n_samples=2, baseline_factory="critic")
    model = NESTED.model(m1, m2)
    losses = []
    for _ in range(150):
        replicated_gradients(NESTED.params, 128, model)
        losses.append(m2.baseline.last_losses["f"].item())
    head = m2.baseline.head("f")
    with torch.no_grad():  # V(probabilities of z2 | z1 = a) against E[f | z1 = a]
        predicted = head.offset + head.scale * head.network(NESTED.theta2.softmax(-1))[..., 0]
        first = m1.baseline.head("f")
        root = first.offset + first.scale * first.network(NESTED.theta1.softmax(-1))[0]
    p1 = NESTED.theta1.softmax(-1)
    conditional = (NESTED.theta2.softmax(-1) * NESTED.table).sum(-1)
    total = (p1 * conditional).sum()
    # the excess squared error over the best value function is a small part of what it explains
    # (Adam at a constant learning rate keeps the prediction moving by ~0.1-0.3)
    explained = (p1 * (conditional - total) ** 2).sum()
    excess = (p1 * (predicted - conditional) ** 2).sum()
    assert excess < 0.2 * explained, (predicted, conditional)
    assert abs(root - total) < 0.3, (root, total)
    assert sum(losses[-10:]) / 10 < 0.5 * losses[0]


def test_q_critic_learns_the_cost_of_each_value():
    m2 = ScoreFunction("z2", n_samples=1, baseline_factory="q_critic")
    model = NESTED.model(ScoreFunction("z1", n_samples=1), m2)
    losses = []
    for _ in range(150):
        replicated_gradients(NESTED.params, 128, model)
        losses.append(m2.baseline.last_losses["f"].item())
    head = m2.baseline.head("f")
    with torch.no_grad():  # Q(probabilities of z2 | z1 = a, z2 = b) against table[a, b]
        q = head.offset + head.scale * head.network(NESTED.theta2.softmax(-1))
    assert torch.allclose(q, NESTED.table, atol=0.2), (q, NESTED.table)
    assert sum(losses[-10:]) / 10 < 0.02 * losses[0]


def test_the_critic_never_reads_the_sample_and_takes_no_gradient_from_the_surrogate():
    theta = torch.tensor([0.2, -0.4, 0.9], requires_grad=True)
    method = ScoreFunction("z", n_samples=5, baseline_factory=Critic(train_critic=False))
    z = method(torch.distributions.OneHotCategorical(logits=theta))
    storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0])).sum(-1), "f")
    features, layout = method.baseline.input_features(z)
    assert layout.plates == () and features.shape == (3,) and not features.requires_grad  # no sample plate
    storch.backward()
    assert all(p.grad is None for p in method.baseline.parameters())
    assert [t.tolist() for t in critic_inputs(Normal(torch.tensor([1.0]), torch.tensor([2.0])))] == [[1.0], [2.0]]


# ---------------------------------------------------------------- checkpoints
def _methods(kind: str) -> list[ScoreFunction]:
    return [ScoreFunction("z1", n_samples=2, baseline_factory=kind), ScoreFunction("z2", n_samples=1, baseline_factory=kind)]


@pytest.mark.parametrize("kind", ["critic", "q_critic"])
def test_state_dict_round_trip_resumes_exactly(kind):
    methods = _methods(kind)
    model = NESTED.model(*methods)
    _train(NESTED.params, model, 5)
    states = []
    for m in methods:
        buffer = io.BytesIO()
        torch.save(m.state_dict(), buffer)
        buffer.seek(0)
        states.append(torch.load(buffer, weights_only=True))
    fresh = _methods(kind)
    for m, state in zip(fresh, states):
        m.load_state_dict(state)
        assert set(m.state_dict()) == set(state)
    rng = torch.get_rng_state()
    grads = replicated_gradients(NESTED.params, 64, model)
    _train(NESTED.params, model, 3)
    torch.set_rng_state(rng)
    fresh_model = NESTED.model(*fresh)
    fresh_grads = replicated_gradients(NESTED.params, 64, fresh_model)
    _train(NESTED.params, fresh_model, 3)
    for g, h in zip(grads, fresh_grads):
        assert torch.equal(g, h)
    for m, n in zip(methods, fresh):
        for (name, a), (_, b) in zip(m.state_dict().items(), n.state_dict().items()):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), name


def test_pickle_and_deepcopy_after_training():
    methods = _methods("q_critic")
    model = NESTED.model(*methods)
    _train(NESTED.params, model, 2)
    for m in methods:
        for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            assert set(twin.state_dict()) == set(m.state_dict())
    storch.reset()


# ---------------------------------------------------------------- the benchmark, tiny
def test_credit_assignment_benchmark_tiny(capsys):
    rows = credit_assignment.main(["--quick", "--samples", "1", "--repeats", "400"])
    out = capsys.readouterr().out
    assert "q_critic" in out and "moving_average" in out
    variance = {r.baseline: r.variance for r in rows}
    assert set(variance) == {"none", "moving_average", "critic", "q_critic"}  # batch_average needs n >= 2
    assert variance["q_critic"] < variance["critic"] < variance["none"]


# ---------------------------------------------------------------- errors
def test_q_critic_refuses_a_continuous_node():
    z = ScoreFunction("z", n_samples=2, baseline_factory="q_critic")(Normal(torch.tensor(0.5, requires_grad=True), 1.0))
    storch.add_cost(z**2, "f")
    with pytest.raises(ValueError, match=r"QCritic of node 'z'.*Normal.*baseline_factory='critic'"):
        storch.backward()


class _NoCorrection(Method):
    """A user-written score function that uses the baseline's value but not its correction."""

    def __init__(self, plate_name, baseline):
        super().__init__(plate_name, None, 2)
        self.baseline = baseline

    def gradient_function(self, tensor):
        return log_prob(tensor)

    def control_variate(self, tensor, cost):
        return self.baseline.compute_baseline(tensor, cost)

    def update_parameters(self, result_triples):
        super().update_parameters(result_triples)
        self.baseline.update()


def test_q_critic_without_its_correction_is_an_error():
    z = _NoCorrection("z", QCritic())(Bernoulli(logits=torch.zeros(2, requires_grad=True)))
    storch.add_cost(z.sum(-1), "f")
    with pytest.raises(RuntimeError, match=r"QCritic of node\(s\) 'z'.*correction"):
        storch.backward()


def test_a_node_whose_shape_changes_is_an_error():
    method = ScoreFunction("z", n_samples=2, baseline_factory="critic")
    for size in (2, 3):
        z = method(Bernoulli(logits=torch.zeros(size, requires_grad=True)))
        storch.add_cost(z.sum(-1), "f")
        if size == 2:
            storch.backward()
    with pytest.raises(ValueError, match=r"Critic of node 'z' was built for cost 'f' with 2 inputs"):
        storch.backward()


def test_unknown_baseline_name_lists_the_critics():
    with pytest.raises(ValueError, match="'critic', 'q_critic'"):
        ScoreFunction("z", baseline_factory="critics")


# ------------------------------------------------------------------ a shared critic over an episode
def _episode(policy, method, T=6, M=4, previous=False):
    """A chain of T decisions over M episodes; each distribution keeps its observation (and, with
    ``previous``, the observation before it) for the critic; a cost per decision."""
    obs = storch.denote_independent(torch.linspace(-1, 1, M * 3).reshape(M, 3), 0, "episodes")
    before, trace = obs, []
    for t in range(T):
        d = torch.distributions.Categorical(logits=policy(obs))
        d.observation, d.previous = obs, before
        action = method(d)
        trace.append((obs, action))
        before, obs = obs, obs + (2 * action - 1).unsqueeze(-1).float() * 0.3
        storch.add_cost((obs ** 2).sum(-1), f"c{t}")
    return trace


def test_a_shared_critic_is_one_network_for_every_decision_trained_once_per_step():
    """Critic(shared=True) fed each decision's observation: one network however long the episode,
    one optimizer step per storch.backward(), and the gradient is REINFORCE with V(s_t) subtracted
    from each decision's cost to go (checked against the sum written by hand)."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(3, 2)
    critic = Critic(inputs=lambda d: [d.observation], shared=True)
    method = ScoreFunction("action", n_samples=1, baseline_factory=critic)
    for step in range(3):
        policy.zero_grad()
        trace = _episode(policy, method)
        head = critic.head(storch.method.critic.SHARED)
        if head is not None:  # V(s_t) of the network as the step uses it
            with torch.no_grad():
                values = [head.offset + head.scale * head.network(o._tensor.reshape(4, 3))[..., 0]
                          for o, _ in trace]
        costs = [c._tensor.reshape(4).detach() for c in storch.registered_costs()]
        storch.backward()
        assert len(critic.heads) == 1 and list(critic._names) == [storch.method.critic.SHARED]
        state = critic.optimizer(storch.method.critic.SHARED).state
        assert all(int(s["step"]) == step + 1 for s in state.values())  # one step per backward
        if head is None:
            continue
        leaf = [p.detach().requires_grad_() for p in policy.parameters()]
        log_p = torch.stack([torch.distributions.Categorical(
            logits=torch.nn.functional.linear(o._tensor.reshape(4, 3), *leaf)).log_prob(a._tensor.reshape(4))
            for o, a in trace], 1)
        to_go = torch.stack(costs, 1).flip(1).cumsum(1).flip(1)
        surrogate = (log_p * (to_go - torch.stack(values, 1))).sum(1).mean()
        expected = torch.autograd.grad(surrogate, leaf)
        for p, e in zip(policy.parameters(), expected):
            assert torch.allclose(p.grad, e, atol=1e-5), (p.grad, e)


def test_a_critic_may_read_the_observations_of_earlier_chain_steps():
    """An input computed at an earlier step of the decision's chain (the observation before the
    current one) is a non-descendant of the decision: read, not refused for carrying that step's plate."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(3, 2)
    critic = Critic(inputs=lambda d: [d.observation, d.previous], shared=True)
    method = ScoreFunction("action", n_samples=1, baseline_factory=critic)
    _episode(policy, method, previous=True)
    storch.backward()
    assert critic.head(storch.method.critic.SHARED).in_features == 6
