"""Episodes of T decisions with a reward after each: storch against hand-written REINFORCE.

A batch of ``B = 16`` episodes; a GRU policy (``nn.Embedding`` of the previous action, ``nn.GRUCell``,
a linear head over ``A = 8`` actions) draws one action per step; the reward of step ``t`` is 1 when
the action equals the episode's target token ``t`` (a token-matching task). Both steps train with
REINFORCE on the reward to go and a moving-average baseline per decision:

* ``hand-written``: plain PyTorch; log-probabilities and rewards stacked to ``(B, T)``, the reward
  to go by a reverse cumulative sum, one running average per step ``t``;
* ``storch``: one ``ScoreFunction("action", baseline_factory="moving_average")`` called at every
  step (its single-sample nodes form one chain: the episodes carry one plate whatever ``T``), one
  ``storch.add_cost`` per reward; storch credits each decision with the costs after it and keeps one
  average per decision's reward to go;
* ``storch compiled``: the storch step under ``storch.compile_step`` (traced once, replayed);
* ``floor``: the hand-written step with its inputs on a tensor subclass whose ``__torch_function__``
  only calls the function (``common.FloorTensor``): what any library built on a tensor subclass pays
  for the protocol before doing any work of its own. ``storch - floor`` (the difference of the two
  ratios) is storch's own cost, as a fraction of the hand-written step.

``--check`` seeds both identically and compares the gradients (they draw their actions with the
same torch calls, so the draws align). The table reports the median step time over interleaved
rounds and the paired ratio to hand-written, for ``T`` in ``--lengths`` (default 8, 100, 1000).
With ``--processes`` each variant runs in a process of its own and is timed in that process's CPU
time: storch keeps more objects alive during a step than the hand-written step, which makes
Python's garbage collector run full collections more often, and in one process those are charged
to whichever variant is running when they trigger (``common.ProcessBench``). ``--gc-freeze`` (with
``--processes``) calls ``gc.freeze()`` in each process after two warm-up steps, as a user can after
building the model: the full collections then no longer traverse the objects that live for the whole
run (torch, the model), which is most of what they cost.

Run from the repository root::

    .venv/bin/python benchmarks/rl_rollout.py --check
    .venv/bin/python benchmarks/rl_rollout.py                    # a few minutes
    .venv/bin/python benchmarks/rl_rollout.py --quick --lengths 8 100
    .venv/bin/python benchmarks/rl_rollout.py --processes --no-compile --lengths 100 1000
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import storch  # noqa: E402
from common import ProcessBench, StepBench, floor_view, serve_steps  # noqa: E402

__all__ = ["Policy", "HandWrittenBaseline", "hand_written_step", "storch_step", "check", "main"]

ACTIONS, HIDDEN, EPISODES, DECAY = 8, 32, 16, 0.95


class Policy(nn.Module):
    """The previous action (``ACTIONS`` at the start) -> GRU state -> logits over the actions."""

    def __init__(self, actions: int = ACTIONS, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Embedding(actions + 1, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.head = nn.Linear(hidden, actions)


class HandWrittenBaseline:
    """One moving average per step ``t``: the first update sets it, later ones ``b ← β b + (1 − β) m``."""

    def __init__(self, length: int, decay: float = DECAY) -> None:
        self.value = torch.zeros(length)
        self.decay = decay
        self.updated = False

    def update(self, mean_to_go: torch.Tensor) -> None:
        if self.updated:
            self.value.mul_(self.decay).add_((1 - self.decay) * mean_to_go)
        else:
            self.value.copy_(mean_to_go)
            self.updated = True


def hand_written_step(
    policy: Policy, targets: torch.Tensor, baseline: HandWrittenBaseline, data: Callable = lambda t: t
) -> torch.Tensor:
    """REINFORCE on the reward to go with a per-step moving average; accumulates ``.grad``.

    ``data`` is applied to the step's input tensors (the targets, the initial state and action):
    ``common.floor_view`` makes it the *floor*, the same step on a do-nothing tensor subclass."""
    n, length = targets.shape
    targets = data(targets)
    h = data(torch.zeros(n, policy.cell.hidden_size))
    previous = data(torch.full((n,), policy.head.out_features))
    log_probs, costs = [], []
    for t in range(length):
        h = policy.cell(policy.embed(previous), h)
        distribution = Categorical(logits=policy.head(h))
        action = distribution.sample()
        log_probs.append(distribution.log_prob(action))
        costs.append(-(action == targets[:, t]).float())
        previous = action
    log_p, cost = torch.stack(log_probs, 1), torch.stack(costs, 1)  # (episodes, T)
    to_go = cost.flip(1).cumsum(1).flip(1)
    surrogate = (log_p * (to_go - baseline.value)).mean(0).sum()
    surrogate.backward()
    baseline.update(to_go.mean(0).as_subclass(torch.Tensor))
    return cost.sum(1).mean()


def storch_step(policy: Policy, cell: nn.Module, method: storch.method.Method, targets: torch.Tensor) -> torch.Tensor:
    """The same step in storch: one node per decision (one chain), one cost per reward."""
    n, length = targets.shape
    targets = storch.denote_independent(targets, 0, "episodes")
    h = storch.denote_independent(torch.zeros(n, policy.cell.hidden_size), 0, "episodes")
    previous = storch.denote_independent(torch.full((n,), policy.head.out_features), 0, "episodes")
    for t in range(length):
        h = cell(policy.embed(previous), h)
        action = method(Categorical(logits=policy.head(h)))
        storch.add_cost(-(action == targets[..., t]).float(), f"r{t}")
        previous = action
    return storch.backward()


def _setup(length: int, seed: int = 0):
    torch.manual_seed(seed)
    policy = Policy()
    targets = torch.randint(0, ACTIONS, (EPISODES, length))
    return policy, targets


def check(length: int = 20, seed: int = 0, steps: int = 2) -> float:
    """The largest difference between the storch and hand-written gradients over ``steps`` steps on
    the same draws (the second step uses the baselines of the first)."""
    policy, targets = _setup(length, seed)
    cell = storch.make_left_broadcastable(policy.cell)
    method = storch.method.ScoreFunction("action", baseline_factory=storch.method.baseline.MovingAverageBaseline(DECAY))
    baseline = HandWrittenBaseline(length)
    worst = 0.0
    for step in range(steps):
        torch.manual_seed(100 + step)
        policy.zero_grad()
        hand_written_step(policy, targets, baseline)
        expected = [p.grad.clone() for p in policy.parameters()]
        torch.manual_seed(100 + step)
        policy.zero_grad()
        storch_step(policy, cell, method, targets)
        for p, e in zip(policy.parameters(), expected):
            worst = max(worst, (p.grad - e).abs().max().item())
    return worst


def check_floor(length: int = 20, seed: int = 0) -> float:
    """The largest difference between the floor's gradient and the hand-written step's on the same
    draws (the same operations on a do-nothing subclass: 0.0)."""
    policy, targets = _setup(length, seed)
    grads = []
    for data in (lambda t: t, floor_view):
        torch.manual_seed(100)
        policy.zero_grad()
        hand_written_step(policy, targets, HandWrittenBaseline(length), data)
        grads.append([p.grad.clone() for p in policy.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def _variants(length: int, compiled: bool) -> dict:
    policy, targets = _setup(length)
    baseline = HandWrittenBaseline(length)
    cell = storch.make_left_broadcastable(policy.cell)
    method = storch.method.ScoreFunction("action", baseline_factory="moving_average")

    floor_baseline = HandWrittenBaseline(length)

    def hand_written() -> None:
        policy.zero_grad()
        hand_written_step(policy, targets, baseline)

    def floor() -> None:
        policy.zero_grad()
        hand_written_step(policy, targets, floor_baseline, floor_view)

    def eager() -> None:
        policy.zero_grad()
        storch_step(policy, cell, method, targets)

    variants = {"hand-written": hand_written, "storch": eager, "floor": floor}
    if compiled:
        step = storch.compile_step(functools.partial(storch_step, policy, cell, method), policy, method)

        def replayed() -> None:
            policy.zero_grad()
            step(targets)

        variants["storch compiled"] = replayed
    return variants


def _freeze_after_warm_up(step) -> None:
    """Two warm-up steps, then ``gc.freeze()``: the objects alive now (torch, the model, the caches) move
    to the collector's permanent generation, which its full collections no longer traverse."""
    import gc

    for _ in range(2):
        step()
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 100, 1000])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per length (default 20, 3 with --quick)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="leave out the storch.compile_step column")
    ap.add_argument("--check", action="store_true", help="only compare the gradients with hand-written")
    ap.add_argument("--processes", action="store_true",
                    help="each variant in a process of its own, in CPU time (each pays for its own garbage collection)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="with --processes: gc.freeze() in each process after two warm-up steps (see the docstring)")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # a --processes child: the variant it runs
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.serve is not None:
        step = _variants(args.lengths[0], args.serve == "storch compiled")[args.serve]
        if args.gc_freeze:
            _freeze_after_warm_up(step)
        serve_steps(step)
        return
    if args.gc_freeze and not args.processes:
        ap.error("--gc-freeze needs --processes (each variant's process freezes its own objects)")
    if args.check:
        for length in (5, 40):
            print(f"T = {length}: largest |storch - hand-written| gradient difference {check(length):.2e}; "
                  f"|floor - hand-written| {check_floor(length):.2e}")
        return
    rounds = args.rounds or (3 if args.quick else 20)
    where = "each variant in its own process, CPU time" if args.processes else "one process, wall clock"
    where += ", gc.freeze() after warm-up" if args.gc_freeze else ""
    print(f"{EPISODES} episodes, GRU policy ({HIDDEN} units, {ACTIONS} actions), reward after each decision; "
          f"one thread, median of {rounds} interleaved rounds ({where})")
    print(f"{'T':>6s} {'hand-written ms':>16s} {'storch ms':>10s} {'ratio':>6s} {'floor ms':>9s} {'ratio':>6s} "
          f"{'storch - floor':>14s} {'compiled ms':>12s} {'ratio':>6s}")
    for length in args.lengths:
        warmup = 1 if length >= 1000 else 2
        if args.processes:
            names = ["hand-written", "storch", "floor"] + ([] if args.no_compile else ["storch compiled"])
            bench = ProcessBench(
                lambda name: [sys.executable, __file__, "--serve", name, "--lengths", str(length)]
                + (["--gc-freeze"] if args.gc_freeze else []),
                names,
                warmup,
            )
        else:
            bench = StepBench(_variants(length, not args.no_compile), warmup=warmup)
        bench.run_chunk(max(2, rounds // (5 if length >= 1000 else 1)))
        if args.processes:
            bench.close()
        times = bench.summary()
        ratio, floor_ratio = bench.ratio("storch", "hand-written"), bench.ratio("floor", "hand-written")
        row = (f"{length:6d} {times['hand-written']:16.2f} {times['storch']:10.2f} {ratio:6.2f} {times['floor']:9.2f} "
               f"{floor_ratio:6.2f} {ratio - floor_ratio:14.2f}")
        if "storch compiled" in times:
            row += f" {times['storch compiled']:12.2f} {bench.ratio('storch compiled', 'hand-written'):6.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
