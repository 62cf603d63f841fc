"""benchmarks/rl_cartpole.py's comparison, on a numpy stand-in with gymnasium's interface (gymnasium is
an optional extra): storch and the hand-written REINFORCE give the same gradients on the same seeds,
for discrete (categorical) and continuous (Gaussian) actions, with episodes that end at different times."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rl_cartpole  # noqa: E402


class Balance:
    """A pole that falls unless pushed back: the observation is its angle and speed; the episode ends
    when the angle passes 0.3 or after 40 steps; a reward of 1 per step (discrete) or minus the squared
    angle and push (continuous)."""

    def __init__(self, name: str) -> None:
        self.discrete = name == "discrete"
        self.action_space = SimpleNamespace(n=2) if self.discrete else SimpleNamespace(
            shape=(1,), low=np.array([-2.0]), high=np.array([2.0]))
        self.observation_space = SimpleNamespace(shape=(2,))

    def reset(self, seed=None):
        self.rng = np.random.default_rng(seed)
        self.state, self.t = self.rng.uniform(-0.05, 0.05, 2), 0
        return self.state.astype(np.float32), {}

    def step(self, action):
        push = (1.0 if action == 1 else -1.0) if self.discrete else float(np.asarray(action).reshape(-1)[0])
        angle, speed = self.state
        speed = speed + 0.1 * (angle - 0.05 * push) + 0.01 * self.rng.normal()
        self.state, self.t = np.array([angle + 0.1 * speed, speed]), self.t + 1
        reward = 1.0 if self.discrete else -(angle ** 2 + 0.01 * push ** 2)
        return self.state.astype(np.float32), reward, abs(self.state[0]) > 0.3, self.t >= 40, {}


@pytest.mark.parametrize("kind", ["discrete", "continuous"])
def test_storch_and_hand_written_reinforce_give_the_same_gradients(kind):
    assert rl_cartpole.check(kind, updates=3, seed=1, make=Balance) < 1e-5
