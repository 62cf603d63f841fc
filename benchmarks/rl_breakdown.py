"""Where a decision of ``benchmarks/rl_rollout.py``'s eager storch step spends its time, part by part.

``rl_rollout.py`` times whole steps; this script times the parts of each decision of one step, next
to the same part of the hand-written step, in µs per decision (the part's time in a step divided by
``T``):

* ``policy``: ``embed``, the GRU cell (storch: through ``storch.make_left_broadcastable``) and the
  linear head;
* ``Categorical(logits=...)``: the distribution (its argument validation, the normalised logits);
* ``draw``: ``method(distribution)`` (the sample and the node: its plate, layout and view of the
  samples, the unused-node bookkeeping) against ``distribution.sample()``;
* ``log_prob``: the hand-written step's ``distribution.log_prob(action)`` in the rollout (storch
  computes it in the surrogate);
* ``reward + add_cost``: the reward and its registration (against appending it to a list);
* ``surrogate``: the surrogate loss (storch: ``storch.surrogate_loss()``; hand-written: stacking,
  the reward to go by a reverse cumulative sum, the REINFORCE expression);
* ``backward + update``: the rest of ``storch.backward()`` (its time less the surrogate's: the
  checks, ``loss.backward()``, the baselines' update) against ``loss.backward()`` and the
  hand-written baseline's update.

Both steps run in alternating rounds in one process, one thread; the table gives the median over
rounds of each part. Below the sum, ``of which garbage collection`` is the time Python's cyclic
garbage collector ran during the step (already counted in the parts it interrupted), with the
full (generation 2) collections per step: the objects a decision leaves alive until the backward
pass (storch's tensors, nodes and plates) are promoted to the oldest generation, and a full
collection traverses every object of the process. Parts are timed in the thread's CPU time (``time.thread_time``), which a machine
shared with other jobs disturbs less than the wall clock (``--wall`` for that).

Run from the repository root::

    .venv/bin/python benchmarks/rl_breakdown.py               # T = 100, 15 rounds
    .venv/bin/python benchmarks/rl_breakdown.py --length 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import storch  # noqa: E402
import rl_rollout  # noqa: E402

__all__ = ["PARTS", "hand_written_parts", "storch_parts", "main"]

PARTS = ("policy", "Categorical(logits=...)", "draw", "log_prob", "reward + add_cost", "surrogate", "backward + update")
_clock = time.thread_time


def hand_written_parts(policy, targets, baseline) -> dict[str, float]:
    """One hand-written step (as ``rl_rollout.hand_written_step``), timed by part (seconds)."""
    parts: dict[str, float] = collections.defaultdict(float)
    n, length = targets.shape
    h = torch.zeros(n, policy.cell.hidden_size)
    previous = torch.full((n,), policy.head.out_features)
    log_probs, costs = [], []
    for t in range(length):
        t0 = _clock()
        h = policy.cell(policy.embed(previous), h)
        logits = policy.head(h)
        t1 = _clock()
        distribution = Categorical(logits=logits)
        t2 = _clock()
        action = distribution.sample()
        t3 = _clock()
        log_probs.append(distribution.log_prob(action))
        t4 = _clock()
        costs.append(-(action == targets[:, t]).float())
        t5 = _clock()
        previous = action
        parts["policy"] += t1 - t0
        parts["Categorical(logits=...)"] += t2 - t1
        parts["draw"] += t3 - t2
        parts["log_prob"] += t4 - t3
        parts["reward + add_cost"] += t5 - t4
    t0 = _clock()
    log_p, cost = torch.stack(log_probs, 1), torch.stack(costs, 1)
    to_go = cost.flip(1).cumsum(1).flip(1)
    surrogate = (log_p * (to_go - baseline.value)).mean(0).sum()
    t1 = _clock()
    surrogate.backward()
    baseline.update(to_go.mean(0))
    t2 = _clock()
    parts["surrogate"] += t1 - t0
    parts["backward + update"] += t2 - t1
    return parts


def storch_parts(policy, cell, method, targets) -> dict[str, float]:
    """One storch step (as ``rl_rollout.storch_step``), timed by part (seconds)."""
    parts: dict[str, float] = collections.defaultdict(float)
    n, length = targets.shape
    targets = storch.denote_independent(targets, 0, "episodes")
    h = storch.denote_independent(torch.zeros(n, policy.cell.hidden_size), 0, "episodes")
    previous = storch.denote_independent(torch.full((n,), policy.head.out_features), 0, "episodes")
    for t in range(length):
        t0 = _clock()
        h = cell(policy.embed(previous), h)
        logits = policy.head(h)
        t1 = _clock()
        distribution = Categorical(logits=logits)
        t2 = _clock()
        action = method(distribution)
        t3 = _clock()
        storch.add_cost(-(action == targets[..., t]).float(), f"r{t}")
        t4 = _clock()
        previous = action
        parts["policy"] += t1 - t0
        parts["Categorical(logits=...)"] += t2 - t1
        parts["draw"] += t3 - t2
        parts["reward + add_cost"] += t4 - t3
    t0 = _clock()
    storch.surrogate_loss()
    t1 = _clock()
    storch.backward()
    t2 = _clock()
    parts["surrogate"] += t1 - t0
    parts["backward + update"] += (t2 - t1) - (t1 - t0)
    return parts


class GarbageClock:
    """The time spent in Python's garbage collector (on the parts' clock) and its full collections,
    from ``gc.callbacks``, while it is installed (``with GarbageClock() as clock``)."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = _clock()
        else:
            self.seconds += _clock() - self._start
            self.full += info["generation"] == 2

    def __enter__(self) -> "GarbageClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=100, help="decisions per episode (T)")
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds (one step of each per round)")
    ap.add_argument("--wall", action="store_true", help="time the parts on the wall clock, not in CPU time")
    args = ap.parse_args(argv)
    global _clock
    _clock = time.perf_counter if args.wall else time.thread_time
    torch.set_num_threads(1)
    policy, targets = rl_rollout._setup(args.length)
    baseline = rl_rollout.HandWrittenBaseline(args.length)
    cell = storch.make_left_broadcastable(policy.cell)
    method = storch.method.ScoreFunction("action", baseline_factory="moving_average")
    hand, ours = collections.defaultdict(list), collections.defaultdict(list)
    for round_ in range(args.rounds + 2):
        policy.zero_grad()
        with GarbageClock() as clock_h:
            h = hand_written_parts(policy, targets, baseline)
        policy.zero_grad()
        with GarbageClock() as clock_s:
            s = storch_parts(policy, cell, method, targets)
        if round_ >= 2:  # two warm-up rounds
            for part in PARTS:
                hand[part].append(h.get(part, 0.0))
                ours[part].append(s.get(part, 0.0))
            hand["gc"].append(clock_h.seconds)
            ours["gc"].append(clock_s.seconds)
            hand["full"].append(clock_h.full)
            ours["full"].append(clock_s.full)
    scale = 1e6 / args.length
    print(f"T = {args.length}, {rl_rollout.EPISODES} episodes; µs per decision, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'part':28s} {'hand-written':>12s} {'storch':>8s} {'difference':>10s}")
    total_h = total_s = 0.0
    for part in PARTS:
        a, b = statistics.median(hand[part]) * scale, statistics.median(ours[part]) * scale
        total_h, total_s = total_h + a, total_s + b
        print(f"{part:28s} {a:12.1f} {b:8.1f} {b - a:10.1f}")
    print(f"{'sum':28s} {total_h:12.1f} {total_s:8.1f} {total_s - total_h:10.1f}")
    gc_h, gc_s = statistics.mean(hand["gc"]) * scale, statistics.mean(ours["gc"]) * scale
    print(f"{'of which garbage collection':28s} {gc_h:12.1f} {gc_s:8.1f} {gc_s - gc_h:10.1f}"
          f"   (mean over rounds; full collections per step: hand-written "
          f"{statistics.mean(hand['full']):.2f}, storch {statistics.mean(ours['full']):.2f})")


if __name__ == "__main__":
    main()
