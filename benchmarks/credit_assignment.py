"""Credit assignment with critics: gradient variance of the score function on a chain of decisions.

Run from the repository root::

    .venv/bin/python benchmarks/credit_assignment.py            # full run (about a minute)
    .venv/bin/python benchmarks/credit_assignment.py --quick    # smoke run (seconds)

The problem (Weber, Heess, Buesing, Silver 2019, "Credit Assignment Techniques in Stochastic
Computation Graphs", arXiv:1901.01761, the setting of their section on critics): a chain of ``T = 5``
categorical decisions over ``K = 4`` values,

    z₁ ~ Cat(softmax θ₀),   z_t | z_{t−1} ~ Cat(softmax Θ_t[z_{t−1}]),   cost c_t after each step:
    c₁ = r[z₁],   c_t = C_t[z_{t−1}, z_t],

each ``c_t`` registered as its own cost, so decision ``i`` is credited with ``c_i, …, c_T`` only (storch
does that for every estimator). ``C_t`` has a large row effect (the previous decision shifts every later
cost), the situation a baseline of the node's non-descendants is for. The exact expected cost is computed by
the forward recursion over the chain (``K²`` terms per step) and differentiated with autograd.

Estimators (all ``ScoreFunction``, ``n`` samples per decision, so ``nᵀ`` paths per estimate; equal numbers
of samples across rows): baseline ``none``, ``moving_average``, ``batch_average`` (leave-one-out, ``n ≥ 2``),
``critic`` (learned value function ``V(ŝ)`` of the decision's distribution parameters,
:class:`storch.method.Critic`) and ``q_critic`` (learned ``Q(ŝ, z)`` with its exact expectation
correction, :class:`storch.method.QCritic`). At a fixed parameter point every stateful baseline is first
trained (or averaged) for ``--train-steps`` backward passes of ``--train-batch`` independent estimates,
then frozen, and ``R`` independent gradient estimates are drawn in one backward pass
(:func:`storch.testing.replicated_gradients`). Columns: total variance (the sum over the ``K + (T−1)K²``
policy parameters of the variance of their estimates), with its standard error (from the fourth
moments), its ratio to no baseline, the critics' last training loss (squared error of the normalised
prediction: 1 is no better than the running mean) and the training time. Unbiasedness is tested in
``tests/test_critic.py`` (a per-coordinate z-test here would be dominated by rare paths: a decision of
probability 1 % after a state of probability 1 % is seen a few times in 4000 estimates).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.distributions import OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.testing import replicated_gradients

__all__ = ["Chain", "chain", "BASELINES", "measure", "main"]


@dataclass(frozen=True, eq=False)
class Chain:
    """``T`` categorical decisions, each conditioned on the previous one, with a cost after each.

    Attributes:
        theta0: ``(K,)`` logits of the first decision.
        theta: ``(T − 1, K, K)`` transition logits, row ``a`` for the previous value ``a``.
        first_cost: ``(K,)`` the cost ``c₁ = first_cost[z₁]``.
        costs: ``(T − 1, K, K)`` ``c_t = costs[t − 2][z_{t−1}, z_t]``.
    """

    theta0: torch.Tensor
    theta: torch.Tensor
    first_cost: torch.Tensor
    costs: torch.Tensor

    @property
    def steps(self) -> int:
        return self.theta.shape[0] + 1

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.theta0, self.theta]

    def model(self, methods: Sequence[Callable]) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """``model(theta0, theta)``: sample the chain with ``methods[t]`` (one per decision) and register
        the costs ``c1 … cT``."""
        if len(methods) != self.steps:
            raise ValueError(f"Chain of {self.steps} decisions needs {self.steps} methods, got {len(methods)}.")

        def model(theta0: torch.Tensor, theta: torch.Tensor) -> None:
            z = methods[0](OneHotCategorical(logits=theta0))
            storch.add_cost((z * self.first_cost).sum(-1), "c1")
            for t in range(1, self.steps):
                logits = (z.unsqueeze(-1) * theta[..., t - 1, :, :]).sum(-2)
                nxt = methods[t](OneHotCategorical(logits=logits))
                cost = ((z.unsqueeze(-1) * self.costs[t - 1]) * nxt.unsqueeze(-2)).sum((-1, -2))
                storch.add_cost(cost, f"c{t + 1}")
                z = nxt

        return model

    def expectation(self, theta0: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """``E[Σ_t c_t]`` by the forward recursion over the marginals of the chain (exact)."""
        marginal = theta0.softmax(-1)
        total = (marginal * self.first_cost).sum()
        for t in range(1, self.steps):
            joint = marginal[:, None] * theta[t - 1].softmax(-1)
            total = total + (joint * self.costs[t - 1]).sum()
            marginal = joint.sum(0)
        return total

    def exact(self) -> tuple[torch.Tensor, ...]:
        """``(∇θ₀, ∇Θ)`` of the expected total cost."""
        leaves = [p.clone().requires_grad_() for p in self.params]
        return torch.autograd.grad(self.expectation(*leaves), leaves)


def chain(steps: int = 5, k: int = 4, row_effect: float = 3.0, seed: int = 0) -> Chain:
    """A fixed random chain: logits ``N(0, 1)`` with a sticky diagonal (+1), costs ``N(0, 1)`` plus a
    row effect ``row_effect · N(0, 1)`` per previous value (the same numbers for a given seed)."""
    g = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(k, generator=g)
    theta = torch.randn(steps - 1, k, k, generator=g) + torch.eye(k)
    first_cost = 2.0 * torch.randn(k, generator=g)
    costs = torch.randn(steps - 1, k, k, generator=g) + row_effect * torch.randn(steps - 1, k, 1, generator=g)
    return Chain(theta0, theta, first_cost, costs)


#: baseline name -> ``ScoreFunction`` ``baseline_factory`` (and the least number of samples it needs)
BASELINES: dict[str, tuple[Optional[str], int]] = {
    "none": (None, 1),
    "moving_average": ("moving_average", 1),
    "batch_average": ("batch_average", 2),
    "critic": ("critic", 1),
    "q_critic": ("q_critic", 1),
}


@dataclass
class Row:
    baseline: str
    n: int
    variance: float
    stderr: float
    train_s: float
    critic_loss: Optional[float] = None


def _total_variance(estimates: torch.Tensor) -> tuple[float, float]:
    """``Σ_j Var(g_j)`` of ``(R, J)`` estimates, as the mean over estimates of ``‖g_r − ḡ‖² R/(R − 1)``,
    and the standard error of that mean."""
    g = estimates.double()
    r = g.shape[0]
    squared = ((g - g.mean(0)) ** 2).sum(1) * r / (r - 1)
    return squared.mean().item(), (squared.std() / r**0.5).item()


def methods_for(problem: Chain, baseline: str, n: int) -> list[ScoreFunction]:
    factory, _ = BASELINES[baseline]
    return [ScoreFunction(f"z{t + 1}", n_samples=n, baseline_factory=factory) for t in range(problem.steps)]


def measure(
    problem: Chain, baseline: str, n: int, repeats: int, train_steps: int, train_batch: int
) -> Row:
    """Train the baselines of one estimator for ``train_steps`` backward passes, then draw ``repeats``
    independent gradient estimates with them frozen: their total variance and its standard error."""
    methods = methods_for(problem, baseline, n)
    model = problem.model(methods)
    start = time.perf_counter()
    for _ in range(train_steps if BASELINES[baseline][0] in ("moving_average", "critic", "q_critic") else 0):
        replicated_gradients(problem.params, train_batch, model)
    train_s = time.perf_counter() - start
    losses = []
    for m in methods:
        if hasattr(m.baseline, "last_losses"):
            losses += [v.item() for v in m.baseline.last_losses.values()]
            m.baseline.train_critic = False  # frozen while measuring
    grads = replicated_gradients(problem.params, repeats, model)
    variance, stderr = _total_variance(torch.cat([g.reshape(repeats, -1) for g in grads], 1))
    return Row(baseline, n, variance, stderr, train_s, sum(losses) / len(losses) if losses else None)


def table(rows: list[Row]) -> str:
    lines = [
        f"{'n':>2} {'baseline':<15} {'variance':>10} {'± se':>8} {'ratio':>7} {'vs none':>8} {'critic loss':>11} {'train s':>8}"
    ]
    for n in sorted({r.n for r in rows}):
        group = [r for r in rows if r.n == n]
        none = next((r.variance for r in group if r.baseline == "none"), float("nan"))
        for r in group:
            loss = "" if r.critic_loss is None else f"{r.critic_loss:.3f}"
            lines.append(
                f"{r.n:>2} {r.baseline:<15} {r.variance:>10.4g} {r.stderr:>8.2g} {r.variance / none:>7.3f} "
                f"{none / r.variance:>7.2f}x {loss:>11} {r.train_s:>8.1f}"
            )
    return "\n".join(lines)


def run(
    samples: Sequence[int] = (1, 2),
    repeats: int = 4000,
    train_steps: int = 300,
    train_batch: int = 128,
    steps: int = 5,
    k: int = 4,
    seed: int = 0,
    baselines: Sequence[str] = tuple(BASELINES),
) -> list[Row]:
    problem = chain(steps, k, seed=seed)
    rows = []
    for n in samples:
        for name in baselines:
            if n < BASELINES[name][1]:
                continue
            torch.manual_seed(seed + 1)
            storch.reset()
            rows.append(measure(problem, name, n, repeats, train_steps, train_batch))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few repeats and training steps")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 2], help="samples per decision")
    parser.add_argument("--repeats", type=int, default=4000, help="independent estimates per row")
    parser.add_argument("--train-steps", type=int, default=300, help="backward passes to train the baselines")
    parser.add_argument("--train-batch", type=int, default=128, help="independent estimates per training pass")
    parser.add_argument("--steps", type=int, default=5, help="decisions in the chain")
    parser.add_argument("--k", type=int, default=4, help="values per decision")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.train_steps, args.train_batch = 300, 20, 32
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only add contention
    try:
        rows = run(args.samples, args.repeats, args.train_steps, args.train_batch, args.steps, args.k, args.seed)
    finally:
        torch.set_num_threads(threads)
    print(
        f"chain of {args.steps} categorical decisions (K = {args.k}), a cost after each step; ScoreFunction, "
        f"{args.repeats} estimates per row, baselines trained for {args.train_steps} passes of "
        f"{args.train_batch} estimates, then frozen"
    )
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
