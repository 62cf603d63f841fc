"""REINFORCE on gymnasium's CartPole-v1 and Pendulum-v1: storch against the same step written by hand.

Each update plays a batch of ``M = 8`` episodes (``M`` environments stepped in a Python loop, one
batched policy call per decision) to their end and takes one Adam step. The policy is an MLP (two
hidden layers of 64, tanh): logits over the two actions on CartPole; on Pendulum the mean of a
Gaussian with a learned log standard deviation (the environment is not differentiable, so the
Gaussian's gradient is the score function too). Both steps train with REINFORCE on the reward to go
and a moving-average baseline per decision ``t`` (decay 0.95, set by its first update), and the same
hyperparameters:

* ``hand-written``: plain PyTorch; log-probabilities and rewards stacked to ``(M, T)``, the reward to
  go by a reverse cumulative sum, one running average per decision;
* ``storch``: the episodes are a plate, one ``ScoreFunction("action", baseline_factory=
  MovingAverageBaseline(0.95))`` is called at every decision (its nodes form one chain), the
  environment's step is wrapped in ``storch.deterministic`` (its observation and reward carry the
  action's plates), and each reward is a cost of its own (``storch.add_cost(-reward, f"r{t}")``).
* ``floor``: the hand-written update with its observations on a tensor subclass whose
  ``__torch_function__`` only calls the function (``common.FloorTensor``): what any library built on
  a tensor subclass pays before doing any work of its own; ``storch - floor`` is storch's own cost.

An episode that has ended is no longer stepped: its reward is 0 and its observation stays, while the
batch plays on until its longest episode ends (in both steps alike; the score terms of those
decisions have expectation zero). ``storch.compile_step`` does not apply: a numpy environment reads
the actions on the host, which a traced step refuses.

``--check`` seeds both steps alike (``torch.manual_seed`` and the environments' seeds) and compares
the gradients of several updates in a row (the same actions, hence the same episodes, and the
baselines of the earlier updates). The timing runs both trainings in one process, interleaved
update by update (which goes first alternates), each with its own environments and policy from the
same seeds, and reports the median time per update with and without the time spent inside the
environments' ``step`` and ``reset``, and the median of the paired ratios storch / hand-written.
With ``--processes`` the two trainings run in processes of their own (the same updates, still
alternating): storch keeps more objects alive during an update, which makes Python's garbage
collector run full collections more often, and in one process those are charged to whichever
training runs when they trigger.

Needs ``gymnasium`` (``pip install -e ".[rl]"``). Run from the repository root::

    .venv/bin/python benchmarks/rl_cartpole.py --check
    .venv/bin/python benchmarks/rl_cartpole.py                 # about a minute
    .venv/bin/python benchmarks/rl_cartpole.py --updates 10 --env Pendulum-v1
    .venv/bin/python benchmarks/rl_cartpole.py --processes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import storch  # noqa: E402
from storch.method.baseline import MovingAverageBaseline  # noqa: E402
from common import Served, floor_view  # noqa: E402

__all__ = ["EnvBatch", "HandWrittenBaseline", "Policy", "check", "hand_written_update", "main", "storch_update"]

EPISODES, HIDDEN, LR, DECAY = 8, 64, 0.01, 0.95
#: the trainings timed side by side: storch, the hand-written update, and the same on a do-nothing
#: tensor subclass (the floor of any ``__torch_function__`` library)
NAMES = ("hand-written", "storch", "floor")


class EnvBatch:
    """``M`` gymnasium environments stepped in a loop; ended episodes are not stepped again.

    Attributes:
        seconds: the time spent inside the environments' ``reset`` and ``step`` so far.
    """

    def __init__(self, name: str, m: int = EPISODES, make: Callable[[str], Any] | None = None) -> None:
        if make is None:
            import gymnasium  # the optional extra storch[rl]

            make = gymnasium.make
        self.envs = [make(name) for _ in range(m)]
        space = self.envs[0].action_space
        self.discrete = hasattr(space, "n")
        self.low = None if self.discrete else float(space.low[0])
        self.high = None if self.discrete else float(space.high[0])
        self.seconds = 0.0
        self.obs = np.zeros((m,) + self.envs[0].observation_space.shape, dtype=np.float32)
        self.done = np.zeros(m, dtype=bool)

    def reset(self, seed: int) -> np.ndarray:
        start = time.perf_counter()
        for i, env in enumerate(self.envs):
            self.obs[i] = env.reset(seed=seed + i)[0]
        self.done[:] = False
        self.seconds += time.perf_counter() - start
        return self.obs.copy()

    @property
    def all_done(self) -> bool:
        return bool(self.done.all())

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step every running episode with its action; the observations and rewards of all ``M``."""
        rewards = np.zeros(len(self.envs), dtype=np.float32)
        start = time.perf_counter()
        for i, env in enumerate(self.envs):
            if self.done[i]:
                continue
            action = int(actions[i]) if self.discrete else np.clip(actions[i], self.low, self.high)
            obs, reward, terminated, truncated, _ = env.step(action)
            self.obs[i], rewards[i], self.done[i] = obs, reward, terminated or truncated
        self.seconds += time.perf_counter() - start
        return self.obs.copy(), rewards

    def step_tensor(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` on tensors, for ``storch.deterministic``: the action's leading dimensions (its
        plates) are kept on the observation and the reward."""
        lead = action.shape[:-1] if not self.discrete else action.shape
        values = action.detach().reshape(len(self.envs), -1).numpy()
        obs, rewards = self.step(values[:, 0] if self.discrete else values)
        return torch.from_numpy(obs).reshape(*lead, -1), torch.from_numpy(rewards).reshape(lead)


class Policy(nn.Module):
    """An MLP from the observation to a categorical (discrete actions) or a Gaussian (continuous)."""

    def __init__(self, obs_dim: int, actions: int, discrete: bool) -> None:
        super().__init__()
        self.discrete = discrete
        self.net = nn.Sequential(nn.Linear(obs_dim, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, actions))
        self.log_std = nn.Parameter(torch.zeros(actions)) if not discrete else None

    def forward(self, obs: torch.Tensor) -> Distribution:
        out = self.net(obs)
        if self.discrete:
            return Categorical(logits=out)
        return Independent(Normal(out, self.log_std.exp()), 1)


class HandWrittenBaseline:
    """One moving average per decision ``t``: the first update sets it, later ones ``b ← β b + (1 − β) m``."""

    def __init__(self, decay: float = DECAY) -> None:
        self.value = torch.zeros(0)
        self.updated = torch.zeros(0, dtype=torch.bool)
        self.decay = decay

    def values(self, length: int) -> torch.Tensor:
        return torch.cat([self.value, torch.zeros(max(0, length - len(self.value)))])[:length]

    def update(self, mean_to_go: torch.Tensor) -> None:
        length = len(mean_to_go)
        if length > len(self.value):
            grow = length - len(self.value)
            self.value = torch.cat([self.value, torch.zeros(grow)])
            self.updated = torch.cat([self.updated, torch.zeros(grow, dtype=torch.bool)])
        old, seen = self.value[:length], self.updated[:length]
        self.value[:length] = torch.where(seen, self.decay * old + (1 - self.decay) * mean_to_go, mean_to_go)
        self.updated[:length] = True


def hand_written_update(
    policy: Policy, envs: EnvBatch, baseline: HandWrittenBaseline, seed: int, data: Callable = lambda t: t
) -> float:
    """Play the batch, accumulate REINFORCE's gradient in ``.grad``; returns the mean return.

    ``data`` is applied to each observation: ``common.floor_view`` makes it the *floor*, the same
    update on a do-nothing tensor subclass."""
    obs = data(torch.from_numpy(envs.reset(seed)))
    log_probs, costs = [], []
    while not envs.all_done:
        distribution = policy(obs)
        action = distribution.sample()
        log_probs.append(distribution.log_prob(action))
        next_obs, reward = envs.step(action.numpy())
        obs = data(torch.from_numpy(next_obs))
        costs.append(-torch.from_numpy(reward))
    log_p, cost = torch.stack(log_probs, 1), torch.stack(costs, 1)  # (episodes, T)
    to_go = cost.flip(1).cumsum(1).flip(1)
    surrogate = (log_p * (to_go - baseline.values(to_go.shape[1]))).mean(0).sum()
    surrogate.backward()
    baseline.update(to_go.mean(0))
    return -cost.sum(1).mean().item()


def storch_update(policy: Policy, envs: EnvBatch, method: storch.method.Method, seed: int) -> float:
    """The same update in storch: the episodes a plate, one node per decision, one cost per reward."""
    storch.reset()
    obs = storch.denote_independent(torch.from_numpy(envs.reset(seed)), 0, "episodes")
    env_step = storch.deterministic(envs.step_tensor)  # the reward carries the action's plates
    t = 0
    while not envs.all_done:
        action = method(policy(obs))
        obs, reward = env_step(action)
        storch.add_cost(-reward, f"r{t}")
        t += 1
    return -storch.backward().item()


def _make(env_name: str, seed: int, make: Callable[[str], Any] | None = None) -> tuple[EnvBatch, Policy]:
    envs = EnvBatch(env_name, make=make)
    space = envs.envs[0].action_space
    torch.manual_seed(seed)
    policy = Policy(envs.obs.shape[1], space.n if envs.discrete else space.shape[0], envs.discrete)
    return envs, policy


def _method() -> storch.method.Method:
    return storch.method.ScoreFunction("action", baseline_factory=MovingAverageBaseline(DECAY))


def check(env_name: str, updates: int = 3, seed: int = 0, make: Callable[[str], Any] | None = None) -> float:
    """The largest difference between the storch and hand-written gradients over ``updates``
    updates (each followed by the same Adam step) on the same seeds, relative to the largest
    gradient entry (Pendulum's costs reach 16 per decision and its gradients thousands). ``make``
    makes an environment from its name (default ``gymnasium.make``)."""
    (envs_a, hand), (envs_b, with_storch) = _make(env_name, seed, make), _make(env_name, seed, make)
    opt_a, opt_b = (torch.optim.Adam(p.parameters(), lr=LR) for p in (hand, with_storch))
    baseline, method = HandWrittenBaseline(), _method()
    worst = 0.0
    for update in range(updates):
        torch.manual_seed(100 + update)
        opt_a.zero_grad()
        r_a = hand_written_update(hand, envs_a, baseline, 1000 * update)
        torch.manual_seed(100 + update)
        opt_b.zero_grad()
        r_b = storch_update(with_storch, envs_b, method, 1000 * update)
        assert abs(r_a - r_b) <= 1e-5 * max(1.0, abs(r_a)), (r_a, r_b)  # the same episodes
        scale = max(p.grad.abs().max().item() for p in hand.parameters())
        for p, q in zip(hand.parameters(), with_storch.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item() / scale)
        opt_a.step()
        opt_b.step()
    return worst


def _training(name: str, env_name: str, seed: int = 0) -> tuple:
    """One training's environments, policy, optimizer and baseline state."""
    envs, policy = _make(env_name, seed)
    state = _method() if name == "storch" else HandWrittenBaseline()
    return envs, policy, torch.optim.Adam(policy.parameters(), lr=LR), state


def _one_update(name: str, run: tuple, update: int) -> tuple[float, float, float]:
    """``(seconds, environment seconds, mean return)`` of update ``update`` of training ``run``."""
    envs, policy, optimizer, state = run
    torch.manual_seed(100 + update)
    before = envs.seconds
    start = time.perf_counter()
    optimizer.zero_grad()
    if name == "storch":
        ret = storch_update(policy, envs, state, 1000 * update)
    else:
        ret = hand_written_update(policy, envs, state, 1000 * update, floor_view if name == "floor" else lambda t: t)
    optimizer.step()
    return time.perf_counter() - start, envs.seconds - before, ret


def timing(env_name: str, updates: int, seed: int = 0) -> dict[str, list[tuple[float, float, float]]]:
    """``(seconds, environment seconds, mean return)`` per update of each training, interleaved."""
    runs = {name: _training(name, env_name, seed) for name in NAMES}
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for update in range(updates):
        order = list(runs) if update % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(_one_update(name, runs[name], update))
    return times


def timing_in_processes(env_name: str, updates: int) -> dict[str, list[tuple[float, float, float]]]:
    """`timing` with each training in a process of its own (``--serve``), updates still alternating:
    each then pays for its own garbage collection (see ``common.ProcessBench``)."""
    names = NAMES
    children = {name: Served(name, [sys.executable, __file__, "--serve", name, "--env", env_name]) for name in names}
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    try:
        for update in range(updates):
            for name in names if update % 2 == 0 else reversed(names):
                times[name].append(tuple(children[name].ask(str(update))))
    finally:
        for child in children.values():
            child.close()
    return times


def _serve(name: str, env_name: str) -> None:
    """A `timing_in_processes` child: one update per line on stdin (its number), its times as JSON."""
    run = _training(name, env_name)
    for line in sys.stdin:
        print(json.dumps(_one_update(name, run, int(line))), flush=True)


def _ratios(mine: list, hand: list) -> tuple[float, float]:
    """Medians of the paired ratios per update, with and without the environment's time."""
    with_env = [s / h for (s, _, _), (h, _, _) in zip(mine, hand)]
    without_env = [(s - se) / (h - he) for (s, se, _), (h, he, _) in zip(mine, hand)]
    return statistics.median(with_env), statistics.median(without_env)


def report(env_name: str, times: dict, skip: int = 2) -> None:
    hand, mine, floor = times["hand-written"][skip:], times["storch"][skip:], times["floor"][skip:]
    steps = statistics.median(r for _, _, r in hand)
    print(f"{env_name}: {EPISODES} episodes per update, MLP policy ({HIDDEN}x2, tanh), Adam lr {LR}; "
          f"{len(hand)} timed updates (median return {steps:.1f}); one thread")
    print(f"  returns, first and last update: hand-written {times['hand-written'][0][2]:.1f} -> "
          f"{times['hand-written'][-1][2]:.1f}, storch {times['storch'][0][2]:.1f} -> {times['storch'][-1][2]:.1f}")
    for label, column in (("hand-written", hand), ("storch", mine), ("floor", floor)):
        total = statistics.median(t for t, _, _ in column) * 1e3
        env = statistics.median(e for _, e, _ in column) * 1e3
        rest = statistics.median(t - e for t, e, _ in column) * 1e3
        print(f"  {label:13s} ms per update {total:8.1f}  in the environment {env:7.1f}  without it {rest:8.1f}")
    (storch_with, storch_without), (floor_with, floor_without) = _ratios(mine, hand), _ratios(floor, hand)
    print(f"  storch / hand-written per update (median of paired ratios): with the environment "
          f"{storch_with:.2f}, without it {storch_without:.2f}")
    print(f"  floor / hand-written: with the environment {floor_with:.2f}, without it {floor_without:.2f}; "
          f"storch - floor {storch_with - floor_with:.2f} and {storch_without - floor_without:.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", nargs="+", default=["CartPole-v1", "Pendulum-v1"])
    ap.add_argument("--updates", type=int, default=None, help="updates per environment (default 40, Pendulum 10)")
    ap.add_argument("--check", action="store_true", help="only compare the gradients with hand-written")
    ap.add_argument("--processes", action="store_true",
                    help="each training in a process of its own (each pays for its own garbage collection)")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # a --processes child: the training it runs
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.serve is not None:
        _serve(args.serve, args.env[0])
        return
    for env_name in args.env:
        if args.check:
            for seed in (0, 1, 2):
                print(f"{env_name}, seed {seed}: largest |storch - hand-written| gradient difference over 3 "
                      f"updates, relative to the largest gradient entry {check(env_name, seed=seed):.2e}")
            continue
        updates = args.updates or (10 if env_name.startswith("Pendulum") else 40)
        report(env_name, (timing_in_processes if args.processes else timing)(env_name, updates))


if __name__ == "__main__":
    main()
