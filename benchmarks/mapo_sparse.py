"""MAPO against REINFORCE on a sparse-reward program search (Liang et al. 2018, storch.method.MAPO).

A program is ``L`` tokens over the operations ``+1, +2, +3, −1, ×2, ×3``, run left to right from 0;
it *hits* when it evaluates to ``target`` (reward 1, cost −1; every other program costs 0). The
policy is factorised, ``Independent(Categorical(logits=θ), 1)`` with ``θ`` of shape ``(L, 6)``,
started uniform and trained by gradient descent (SGD, lr 1). With ``L = 6`` and ``target = 216``,
47 of the 46 656 programs hit (one in 993).

Every method gets the same number of cost evaluations (program runs), at most ``n`` per step.
REINFORCE with a baseline (``ScoreFunction``, ``moving_average`` or ``batch_average``) draws ``n``
programs per step; MAPO (``buffer_size = 4``, ``threshold = 0``: only hits enter the buffer;
systematic exploration, exact here because explored programs cost 0) evaluates its buffer and
``n/2`` programs from outside it, with memory weight clipping ``α = 0.1`` (``mapo``) or without
(``mapo-unclipped``). Until the first hit every gradient is zero, so all methods search at random;
after it, REINFORCE only learns when it samples a hit again (its expected gradient is
``∇π(hits)``, tiny while ``π(hits)`` is), while MAPO's buffer pulls the policy towards the hits at
every step, with weight ``α`` while ``π_B < α``. Unclipped MAPO has REINFORCE's expected gradient
without its noise, so it is as slow. With Adam (``--optimizer adam --lr 0.1``), whose per-coordinate
normalisation turns one sampled hit into a full-size step, every method solves the task once it has
sampled a hit, and the methods differ only in how soon that happens.

Run from the repository root::

    .venv/bin/python benchmarks/mapo_sparse.py                 # 10 seeds, about a minute
    .venv/bin/python benchmarks/mapo_sparse.py --seeds 3 --budget 2000 --optimizer adam --lr 0.1

It prints, per method, the seeds that solved the task (the greedy program hits and ``P(hit) > 0.5``
at the end of the budget), the mean probability of a hit under the final policy, and the median
number of evaluations to the first sampled hit and to solving the task.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.distributions import Categorical, Independent

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import storch  # noqa: E402
from storch.method import MAPO, ScoreFunction  # noqa: E402

OPS = ("+1", "+2", "+3", "-1", "*2", "*3")


def evaluate(programs: torch.Tensor) -> torch.Tensor:
    """The value of each program ``(..., L)`` of operation indices, run left to right from 0."""
    acc = torch.zeros_like(programs[..., 0])
    for t in range(programs.shape[-1]):
        op = programs[..., t]
        acc = torch.where(op == 0, acc + 1, acc)
        acc = torch.where(op == 1, acc + 2, acc)
        acc = torch.where(op == 2, acc + 3, acc)
        acc = torch.where(op == 3, acc - 1, acc)
        acc = torch.where(op == 4, acc * 2, acc)
        acc = torch.where(op == 5, acc * 3, acc)
    return acc


def hitting_programs(length: int, target: int) -> torch.Tensor:
    """Every program of ``length`` tokens that evaluates to ``target``: ``(h, length)``."""
    programs = torch.tensor(list(itertools.product(range(len(OPS)), repeat=length)))
    return programs[evaluate(programs) == target]


def hit_probability(theta: torch.Tensor, hits: torch.Tensor) -> float:
    """``P(hit)`` under the factorised policy with logits ``theta`` ``(L, V)``."""
    log_p = theta.detach().log_softmax(-1)
    return float(log_p.gather(-1, hits.T).sum(0).exp().sum())


@dataclass
class Run:
    method: str
    seed: int
    evaluations: int
    first_hit: Optional[int]  # evaluations until the first hit was sampled
    solved_at: Optional[int]  # evaluations until P(hit) > 0.5 and the greedy program hits
    final_p_hit: float
    greedy_hits: bool


def make_method(name: str, n_samples: int):
    if name == "mapo":
        return MAPO("program", n_samples=n_samples, buffer_size=4, clip=0.1, threshold=0.0,
                    systematic_exploration=True)
    if name == "mapo-unclipped":
        return MAPO("program", n_samples=n_samples, buffer_size=4, threshold=0.0, systematic_exploration=True)
    if name == "reinforce-moving-average":
        return ScoreFunction("program", n_samples=n_samples, baseline_factory="moving_average")
    if name == "reinforce-batch-average":
        return ScoreFunction("program", n_samples=n_samples, baseline_factory="batch_average")
    raise ValueError(f"unknown method {name!r}")


def train(name: str, seed: int, budget: int, length: int = 6, target: int = 216, n_samples: int = 8,
          lr: float = 1.0, optimizer: str = "sgd", hits: Optional[torch.Tensor] = None) -> Run:
    """Train one policy until ``budget`` cost evaluations are spent."""
    torch.manual_seed(seed)
    hits = hitting_programs(length, target) if hits is None else hits
    theta = torch.zeros(length, len(OPS), requires_grad=True)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)([theta], lr=lr)
    # MAPO evaluates its buffer too: it draws fewer new programs, so that both use n per step at most
    method = make_method(name, n_samples // 2 if name.startswith("mapo") else n_samples)
    spent, first_hit, solved_at = 0, None, None
    while spent < budget:
        opt.zero_grad()
        program = method(Independent(Categorical(logits=theta), 1))
        hit = evaluate(program._tensor) == target
        cost = -(evaluate(program) == target).float()
        storch.add_cost(cost, "miss")
        storch.backward()
        opt.step()
        spent += program.shape[0]
        if first_hit is None and bool(hit.any()):
            first_hit = spent
        if solved_at is None and _solved(theta, hits, target):
            solved_at = spent
    return Run(name, seed, spent, first_hit, solved_at, hit_probability(theta, hits), _greedy_hits(theta, target))


def _greedy_hits(theta: torch.Tensor, target: int) -> bool:
    return bool(evaluate(theta.detach().argmax(-1)) == target)


def _solved(theta: torch.Tensor, hits: torch.Tensor, target: int) -> bool:
    return _greedy_hits(theta, target) and hit_probability(theta, hits) > 0.5


METHODS = ("mapo", "mapo-unclipped", "reinforce-moving-average", "reinforce-batch-average")


def table(runs: list[Run]) -> str:
    lines = [
        f"{'method':<26} {'solved':>8} {'mean P(hit)':>12} {'median evals to 1st hit':>24} {'median evals to solve':>22}",
    ]
    for name in dict.fromkeys(r.method for r in runs):
        rs = [r for r in runs if r.method == name]
        solved = sum(r.solved_at is not None for r in rs)
        first = [r.first_hit for r in rs if r.first_hit is not None]
        solve = [r.solved_at for r in rs if r.solved_at is not None]
        med_first = f"{statistics.median(first):.0f}" if first else "-"
        med_solve = f"{statistics.median(solve):.0f}" if solve else "-"
        lines.append(
            f"{name:<26} {f'{solved}/{len(rs)}':>8} {statistics.mean(r.final_p_hit for r in rs):>12.3f} "
            f"{med_first + f' ({len(first)}/{len(rs)})':>24} {med_solve:>22}"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budget", type=int, default=4000, help="cost evaluations per run")
    parser.add_argument("--length", type=int, default=6)
    parser.add_argument("--target", type=int, default=216)
    parser.add_argument("--n-samples", type=int, default=8, help="evaluations per step")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hits = hitting_programs(args.length, args.target)
    total = len(OPS) ** args.length
    print(f"programs of {args.length} tokens over {', '.join(OPS)}; target {args.target}: "
          f"{len(hits)} of {total} hit (1 in {total / max(len(hits), 1):.0f}); budget {args.budget} "
          f"evaluations, {args.n_samples} per step, {args.optimizer} lr {args.lr}, seeds 0..{args.seeds - 1}")
    runs = [
        train(name, seed, args.budget, args.length, args.target, args.n_samples, args.lr, args.optimizer, hits)
        for name in args.methods for seed in range(args.seeds)
    ]
    print(table(runs))
    return runs


if __name__ == "__main__":
    main()
