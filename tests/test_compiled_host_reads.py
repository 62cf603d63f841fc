"""storch.compile_step never replays values that left torch during the trace: every read of a
tensor's value on the host, and every tensor made from numpy data, is refused at its line; a step
that stays in torch replays the eager steps exactly."""

import math
import re

import numpy as np
import pytest
import torch
from torch.distributions import Bernoulli

import storch
from storch.exceptions import CompileStepError


class NumpyCartPole:
    """CartPole's dynamics (the classic control task) in numpy, stepped in Python as a gymnasium
    environment is: an action in {0, 1} in, an observation and a reward out."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.state = self.rng.uniform(-0.05, 0.05, size=4)
        self.steps = 0

    def step(self, action) -> tuple[np.ndarray, float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if int(action) == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        self.state = np.array([x + 0.02 * x_dot, x_dot + 0.02 * x_acc,
                               theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc])
        self.steps += 1
        return self.state.astype(np.float32), 1.0 + float(self.state[2]), abs(self.state[2]) > 0.2


def _policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


READS = {
    ".numpy()": lambda a: a.numpy()[0],
    ".tolist()": lambda a: a.tolist()[0],
    ".item()": lambda a: a[0].item(),
    "int()": lambda a: int(a[0]),
    "float()": lambda a: float(a[0]),
    "a conversion to numpy": lambda a: np.asarray(a)[0],
    "a use as an index": lambda a: [0, 1][a[0].long()],
    "a DLPack export": lambda a: np.from_dlpack(a)[0],
}


def _rollout(policy: torch.nn.Module, env: NumpyCartPole, read, steps: int = 4) -> torch.Tensor:
    """A rollout that hands each action to the numpy environment through ``read``, as the
    reinforcement-learning tutorial does (``storch.deterministic`` around the environment's step)."""

    def env_step(action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        obs, reward, _ = env.step(read(action.detach().reshape(-1)))
        return torch.as_tensor(obs).expand(*action.shape, 4), action * 0.0 + reward

    obs = torch.zeros(4)
    method = storch.method.ScoreFunction("action", n_samples=1, baseline_factory="moving_average")
    for t in range(steps):
        action = method(Bernoulli(logits=policy(obs).squeeze(-1)))
        obs, reward = storch.deterministic(env_step)(action)
        storch.add_cost(-reward, f"reward_{t}")
    return storch.backward()


@pytest.mark.parametrize("what", sorted(READS))
def test_each_host_read_in_a_traced_step_is_refused_with_its_line(what):
    policy = _policy()
    env = NumpyCartPole(0)
    fast = storch.compile_step(lambda: _rollout(policy, env, READS[what]), policy)
    with pytest.raises(CompileStepError, match=re.escape(what)) as caught:
        fast()
    message = str(caught.value)
    assert re.search(r"host at \S*test_compiled_host_reads.py:\d+ \(<lambda>\): \"", message), message
    storch.reset()


def test_printing_and_formatting_in_a_traced_step_are_refused():
    policy = _policy()

    def step(show):
        x = storch.denote_independent(torch.ones(3, 4), 0, "data")
        z = storch.method.ScoreFunction("z", n_samples=2, baseline_factory="batch_average")(
            Bernoulli(logits=policy(x).squeeze(-1)))
        show(z)
        storch.add_cost(z, "f")
        return storch.backward()

    for show, what in ((print, "printing"), (repr, "printing"), (lambda z: f"{z._tensor[0, 0]:.2f}", "formatting")):
        with pytest.raises(CompileStepError, match=what):
            storch.compile_step(step, policy)(show)
        storch.reset()


def test_a_tensor_made_from_numpy_data_in_a_traced_step_is_refused():
    policy = _policy()
    env = NumpyCartPole(0)

    def step(obs):
        z = storch.method.ScoreFunction("z", n_samples=2, baseline_factory="batch_average")(
            Bernoulli(logits=policy(obs).squeeze(-1)))
        storch.add_cost(z, "f")
        return storch.backward()

    def step_with_env():
        return step(torch.as_tensor(env.step(1)[0]))  # the environment's observation enters the graph

    for make in (torch.as_tensor, torch.tensor, lambda a: torch.zeros(1).new_tensor([a[0], a[1]])):
        with pytest.raises(CompileStepError, match=r"makes a tensor from numpy data at .*test_compiled_host_reads.py:"):
            storch.compile_step(lambda make=make: step(make(env.step(1)[0]).reshape(-1)[:2].sum().expand(4)), policy)()
        storch.reset()
    with pytest.raises(CompileStepError, match=r"torch.as_tensor\(env.step"):
        storch.compile_step(step_with_env, policy)()
    storch.reset()
    fast = storch.compile_step(step, policy)  # made outside the step and passed as an argument: replayed
    for _ in range(3):
        policy.zero_grad()
        fast(torch.as_tensor(env.step(1)[0]))
    assert fast.traces == 1


def _eager_and_compiled(step, policy: torch.nn.Module, calls: int = 4):
    results = []
    for f in (step, storch.compile_step(step, policy)):
        torch.manual_seed(3)
        policy.load_state_dict(_policy().state_dict())
        runs = []
        for _ in range(calls):
            policy.zero_grad()
            value = f()
            runs.append((value.detach().clone(), [p.grad.clone() for p in policy.parameters()]))
        results.append(runs)
    return results


def test_a_numpy_environment_in_a_step_is_never_replayed_with_stale_values():
    """Coupled through a host read, the step is refused; the same dynamics in torch (no value leaves
    torch) replay every eager step, each call with new draws and new rewards."""
    policy = _policy()
    env = NumpyCartPole(0)
    with pytest.raises(CompileStepError, match=r"\.numpy\(\)"):
        _eager_and_compiled(lambda: _rollout(policy, env, READS[".numpy()"]), policy)
    storch.reset()

    def torch_step():  # the same task with torch dynamics: all of it is traced
        obs = torch.zeros(4)
        theta = torch.zeros(())
        method = storch.method.ScoreFunction("action", n_samples=1, baseline_factory="moving_average")
        for t in range(4):
            action = method(Bernoulli(logits=policy(obs).squeeze(-1)))
            theta = theta + 0.02 * (2 * action - 1)
            storch.add_cost(-(1.0 + theta), f"reward_{t}")
            obs = torch.stack([theta * 0 + t, theta, theta, theta], -1)
        return storch.backward()

    eager, compiled = _eager_and_compiled(torch_step, policy)
    assert len({round(v.item(), 6) for v, _ in eager}) > 1  # the calls differ: a stale replay would show
    for (v, g), (cv, cg) in zip(eager, compiled):
        assert torch.allclose(v, cv, atol=1e-6)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g, cg))


def test_iterating_over_a_tensor_in_a_traced_step_is_traced_not_refused():
    """Iteration yields tensors (an unbind): nothing leaves torch, and the replays follow the eager
    steps with new draws each call."""
    policy = _policy()

    def step(x):
        logits = policy(x).squeeze(-1)
        total = sum(row for row in logits)  # iteration over a tensor
        z = storch.method.ScoreFunction("z", n_samples=3, baseline_factory="batch_average")(
            Bernoulli(logits=total))
        storch.add_cost(z * total.detach(), "f")
        return storch.backward()

    x = torch.randn(5, 4)
    eager, compiled = _eager_and_compiled(lambda: step(x), policy)
    assert len({round(v.item(), 6) for v, _ in eager}) > 1
    for (v, g), (cv, cg) in zip(eager, compiled):
        assert torch.allclose(v, cv, atol=1e-6)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g, cg))
