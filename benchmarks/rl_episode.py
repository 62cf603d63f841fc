"""An episode with a reward after every decision: credit assignment, variance and cost per step.

The environment of the reinforcement-learning tutorial (``docs/tutorials/reinforcement-learning.md``):
a corridor of ``CELLS = 5`` cells, the agent starts in the first, moves left or right at each of
``T`` steps (walls hold it in) and earns 1 for every step that ends in the last cell. The policy is
a table of logits, one row per cell. Two ways to write an episode in storch:

* ``per-decision``: one ``ScoreFunction(f"a{t}", n_samples=1)`` node per decision, one cost
  ``r{t}`` per reward; the episodes of a step are a plate. storch credits each decision with the
  rewards registered after it that depend on it (the reward to go). The decisions form one chain
  of single-sample nodes, so the episodes' tensors carry one plate for them whatever ``T``.
* ``decoder``: ``ScoreFunctionWOR("episode", k, sampling_method=MCDecoder("episode", k))`` called
  once per decision: ``k`` i.i.d. episodes on one ancestral plate, the reward of step ``t``
  estimated with the log-probability of the first ``t + 1`` actions (the same reward to go).

Part 1 (variance): at a fixed random policy, ``R`` independent estimates of the policy gradient
from one backward pass each (``storch.testing.replicated_gradients``), total variance (summed over
the table) with its standard error, and the mean distance to the exact gradient (computed by
propagating the distribution over cells through the ``T`` steps) in standard errors. Rows:

* ``whole return, 1 cost``: the rewards summed and registered as *one* cost, so every decision is
  credited with the whole return (the textbook REINFORCE without reward to go);
* ``reward to go``: one cost per reward, no baseline;
* ``reward to go + moving_average``: one average per cost name (a time-dependent baseline),
  after ``--warmup`` passes at the same policy;
* ``decoder, k episodes``, ``decoder + batch_average``: one estimate from ``k`` episodes, without a
  baseline and with the leave-one-out baseline per reward; multiply by ``k`` to compare per episode.

Part 2 (time): wall time of one training step (roll out ``M = 8`` episodes, ``storch.backward()``),
the median of ``--repeats``, on one thread, for both ways and growing ``T``.

Run from the repository root::

    .venv/bin/python benchmarks/rl_episode.py            # about a minute
    .venv/bin/python benchmarks/rl_episode.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import storch  # noqa: E402
from storch.method import ScoreFunction, ScoreFunctionWOR  # noqa: E402
from storch.sampling import MCDecoder  # noqa: E402
from storch.testing import replicated_gradients, variance_with_stderr  # noqa: E402

__all__ = ["CELLS", "step", "logits", "exact_gradient", "per_decision", "decoder", "main"]

CELLS = 5


def step(cell: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next cell (0 left, 1 right; walls hold) and the reward (1 in the last cell)."""
    cell = (cell + 2 * action - 1).clamp(0, CELLS - 1)
    return cell, (cell == CELLS - 1).float()


def logits(theta: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
    """The row of the table ``theta`` for ``cell``, per sample also when ``theta`` carries a plate
    (the replicated copies of ``storch.testing``): ``theta[cell]`` would index the plate dimension
    of a plated ``theta``, so the row is picked with a one-hot product instead."""
    return (torch.nn.functional.one_hot(cell, CELLS).unsqueeze(-1) * theta).sum(-2)


def exact_gradient(theta: torch.Tensor, T: int) -> torch.Tensor:
    """``∇θ E[−Σ_t r_t]``: the distribution over cells pushed through ``T`` steps, differentiated."""
    theta = theta.detach().requires_grad_()
    p = theta.softmax(-1)
    cells = torch.arange(CELLS)
    occupancy = torch.zeros(CELLS)
    occupancy[0] = 1.0
    total = torch.zeros(())
    for _ in range(T):
        moved = torch.zeros(CELLS)
        moved = moved.index_add(0, (cells - 1).clamp(0), occupancy * p[:, 0])
        moved = moved.index_add(0, (cells + 1).clamp(max=CELLS - 1), occupancy * p[:, 1])
        occupancy = moved
        total = total + occupancy[-1]
    return torch.autograd.grad(-total, theta)[0]


def per_decision(theta: torch.Tensor, first: torch.Tensor, methods: list, one_cost: bool = False) -> None:
    """One node per decision; a cost per reward (or, ``one_cost``, one cost for their sum)."""
    cell, total = first, 0.0
    for t, method in enumerate(methods):
        action = method(Categorical(logits=logits(theta, cell)))
        cell, reward = step(cell, action)
        if one_cost:
            total = total + reward
        else:
            storch.add_cost(-reward, f"r{t}")
    if one_cost:
        storch.add_cost(-total, "return")


def decoder(theta: torch.Tensor, first: torch.Tensor, T: int, k: int, baseline: Optional[str] = None) -> None:
    """``k`` i.i.d. episodes on one plate, one call of the method per decision."""
    method = ScoreFunctionWOR("episode", k=k, sampling_method=MCDecoder("episode", k), baseline_factory=baseline)
    cell = first
    for t in range(T):
        action = method(Categorical(logits=logits(theta, cell)))
        cell, reward = step(cell, action)
        storch.add_cost(-reward, f"r{t}")


def _methods(T: int, baseline: Optional[str]) -> list:
    return [ScoreFunction(f"a{t}", n_samples=1, baseline_factory=baseline) for t in range(T)]


def variance_table(T: int, repeats: int, warmup: int, k: int, seed: int) -> None:
    torch.manual_seed(seed)
    theta = torch.randn(CELLS, 2)
    exact = exact_gradient(theta, T)
    print(f"T = {T}: {repeats} estimates at a random tabular policy; total variance of one estimate")
    print(f"{'estimator':34s} {'episodes':>8s} {'variance':>10s} {'± s.e.':>8s} {'max|z|':>7s}")

    def first_cell(view: torch.Tensor) -> torch.Tensor:
        # one start cell per replicate: the replicate plate of the view, with the cell's dtype
        return (view[..., 0, 0] * 0).long()

    rows: list[tuple[str, int, Callable[[torch.Tensor], None]]] = []
    rows.append(("whole return, 1 cost", 1, lambda v: per_decision(v, first_cell(v), _methods(T, None), True)))
    rows.append(("reward to go", 1, lambda v: per_decision(v, first_cell(v), _methods(T, None))))
    moving = _methods(T, "moving_average")
    rows.append(("reward to go + moving_average", 1, lambda v: per_decision(v, first_cell(v), moving)))
    rows.append((f"decoder, {k} episodes", k, lambda v: decoder(v, first_cell(v), T, k)))
    rows.append((f"decoder + batch_average, {k} ep.", k, lambda v: decoder(v, first_cell(v), T, k, "batch_average")))
    for _ in range(warmup):  # the moving averages settle at this policy
        storch.reset()
        replicated_gradients([theta], 64, lambda v: per_decision(v, first_cell(v), moving))
    for name, episodes, model in rows:
        storch.reset()
        (g,) = replicated_gradients([theta], repeats, model)
        flat = g.reshape(repeats, -1).double()
        total = sum(variance_with_stderr(flat[:, j])[0] for j in range(flat.shape[1]))
        se = sum(variance_with_stderr(flat[:, j])[1] ** 2 for j in range(flat.shape[1])) ** 0.5
        stderr = flat.std(0) / repeats**0.5
        z = ((flat.mean(0) - exact.reshape(-1).double()).abs() / stderr.clamp_min(1e-12)).max().item()
        print(f"{name:34s} {episodes:8d} {total:10.3f} {se:8.3f} {z:7.2f}")
    print()


def time_table(lengths: list[int], decoder_lengths: list[int], repeats: int, M: int) -> None:
    print(f"seconds per training step ({M} episodes, rollout and storch.backward(), median of {repeats}, one thread)")
    print(f"{'T':>5s} {'per-decision':>13s} {'+ moving_avg':>13s} {'decoder':>9s} {'+ batch_avg':>12s}")
    theta = torch.zeros(CELLS, 2, requires_grad=True)
    first = storch.denote_independent(torch.zeros(M, dtype=torch.long), 0, "episodes")

    def seconds(run: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            storch.reset()
            start = time.perf_counter()
            run()
            storch.backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    for T in sorted(set(lengths) | set(decoder_lengths)):
        cells = []
        for baseline in (None, "moving_average"):
            if T in lengths:
                methods = _methods(T, baseline)
                cells.append(f"{seconds(lambda m=methods: per_decision(theta, first, m)):.3f}")
            else:
                cells.append("-")
        for baseline in (None, "batch_average"):
            run = lambda T=T, b=baseline: decoder(theta, torch.tensor(0), T, M, b)  # noqa: E731
            cells.append(f"{seconds(run):.3f}")
        print(f"{T:5d} {cells[0]:>13s} {cells[1]:>13s} {cells[2]:>9s} {cells[3]:>12s}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        variance_table(T=10, repeats=500, warmup=10, k=8, seed=args.seed)
        time_table([10, 20], [50], repeats=2, M=8)
    else:
        for T in (10, 30):
            variance_table(T=T, repeats=4000, warmup=100, k=8, seed=args.seed)
        time_table([10, 20, 40, 60], [100, 200], repeats=5, M=8)


if __name__ == "__main__":
    main()
