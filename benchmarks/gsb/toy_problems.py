"""GSB paper, section 6.1: the gamma toy problems (figures 1 and 2), GSB vs pathwise vs score function.

Run from the repository root::

    .venv/bin/python benchmarks/gsb/toy_problems.py            # default run (~9 minutes on 2 cores)
    .venv/bin/python benchmarks/gsb/toy_problems.py --quick    # smoke run (seconds)

``z ~ Π_j Gamma(k_j, scale μ_j)`` (torch: rate ``1/μ_j``), ``j = 1..d``, ``d ∈ {1, 10, 100}``, with
``k = softplus(a)``, ``μ = softplus(m)`` and ``(a, m)`` trained by Adam (lr 1e-3, as in the paper) from
``k = 2``, ``μ = 0.5``, one sample per step:

* toy 1: ``L = E Σ_j (z_j − ε)²``, ``ε = 0.49``; exact ``L = Σ_j k_j μ_j² + (k_j μ_j − ε)²``. GSB at order 2
  is exact (the cost is quadratic).
* toy 2: ``L = E Σ_j exp(−ε z_j)``; exact ``L = Σ_j (1 + ε μ_j)^{−k_j}``. GSB at order ``N`` (default 10)
  truncates a series in ``x = εμ``; the relative truncation bias of ``∇k`` is at most
  ``x^{N+1} / ((N+1) log(1+x))`` (alternating series) and that of ``∇μ`` is exactly ``x^N``, both printed
  for the largest ``x`` reached (``tests/test_gsb_toy_benchmark.py``).

Metrics per estimator, mean ± sd over seeds (5, as in the paper): the exact loss per coordinate
(``L/d``) along training, and the gradient log-variance ``log10`` of the per-parameter variance of one
gradient estimate, averaged over the ``2d`` parameters, from ``--var-repeats`` independent estimates at
each checkpoint (:func:`gsb_common.gradient_log_variance`); ms per optimisation step. Tables go to
stdout and ``benchmarks/gsb/results/toy.txt`` / ``toy.json``; plots to ``results/toy1.png`` and
``results/toy2.png``.
"""

from __future__ import annotations

import argparse
import io
import math
import time
from contextlib import redirect_stdout

import gsb_common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.nn.functional as F
from torch.distributions import Gamma

import storch
from gsb_common import Timer, fmt, gradient_log_variance, make_method, mean_sd, plot_curves, pyplot, save_figure, write_results

EPS = 0.49
K0, MU0 = 2.0, 0.5


def inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


def distribution(a: torch.Tensor, m: torch.Tensor) -> Gamma:
    """``Π_j Gamma(k_j, scale μ_j)`` with ``k = softplus(a)``, ``μ = softplus(m)``."""
    return Gamma(F.softplus(a), 1.0 / F.softplus(m))


def cost(problem: int, z: torch.Tensor) -> torch.Tensor:
    return ((z - EPS) ** 2).sum(-1) if problem == 1 else torch.exp(-EPS * z).sum(-1)


def exact_loss(problem: int, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    k, mu = F.softplus(a), F.softplus(m)
    if problem == 1:
        return (k * mu**2 + (k * mu - EPS) ** 2).sum()
    return ((1 + EPS * mu) ** (-k)).sum()


def run(problem: int, d: int, estimator: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one (problem, d, estimator, seed); return the loss / log-variance curves and timing."""
    torch.manual_seed(seed)
    a = torch.full((d,), inverse_softplus(K0), requires_grad=True)
    m = torch.full((d,), inverse_softplus(MU0), requires_grad=True)
    opt = torch.optim.Adam([a, m], lr=args.lr)
    order = 2 if problem == 1 else args.order

    def model(a_: torch.Tensor, m_: torch.Tensor) -> None:
        z = make_method(estimator, "z", 1, order)(distribution(a_, m_))
        storch.add_cost(cost(problem, z), "f")

    checkpoints = sorted({0, *range(0, args.steps + 1, max(args.steps // args.n_checkpoints, 1)), args.steps})
    losses, logvars, timer, max_x = [], [], Timer(), 0.0
    for step in range(args.steps + 1):
        if step in checkpoints:
            with torch.no_grad():
                losses.append(exact_loss(problem, a, m).item() / d)
                max_x = max(max_x, (EPS * F.softplus(m)).max().item())
            logvars.append(gradient_log_variance([a, m], args.var_repeats, model))
        if step == args.steps:
            break
        with timer:
            storch.reset()
            model(a, m)
            storch.backward()
            opt.step()
            opt.zero_grad()
    storch.reset()
    return {"steps": checkpoints, "loss": losses, "logvar": logvars, "ms_per_step": timer.ms, "max_x": max_x}


def truncation_bound(x: float, order: int) -> float:
    """Relative bound on the truncation bias of GSB's ``∇k`` for toy 2 (alternating series in ``x``)."""
    return x ** (order + 1) / ((order + 1) * math.log1p(x))


def table(problem: int, results: dict, args: argparse.Namespace) -> str:
    lines = []
    title = {1: f"toy 1: E sum_j (z_j - {EPS})^2 (GSB order 2: exact)",
             2: f"toy 2: E sum_j exp(-{EPS} z_j) (GSB order {args.order})"}[problem]
    lines.append(title)
    header = f"{'d':>4} {'estimator':<10} {'loss/d start':>14} {'loss/d end (mean ± sd)':>26} " \
             f"{'log10 var start':>16} {'log10 var end':>20} {'ms/step':>8}"
    lines += [header, "-" * len(header)]
    for d in args.dims:
        for est in args.estimators:
            runs = results[(problem, d, est)]
            start = fmt([r["loss"][0] for r in runs])
            end = fmt([r["loss"][-1] for r in runs])
            lv0 = fmt([r["logvar"][0] for r in runs], 3)
            lv1 = fmt([r["logvar"][-1] for r in runs], 3)
            ms = mean_sd([r["ms_per_step"] for r in runs])[0]
            lines.append(f"{d:>4} {est:<10} {start:>14} {end:>26} {lv0:>16} {lv1:>20} {ms:>8.2f}")
    if problem == 2 and "gsb" in args.estimators:
        x = max(r["max_x"] for d in args.dims for r in results[(2, d, "gsb")])
        lines.append(f"GSB truncation (order {args.order}): largest x = eps*mu reached {x:.3f}; relative bias of "
                     f"grad k at most {truncation_bound(x, args.order):.1e}, of grad mu exactly x^N = "
                     f"{x ** args.order:.1e}")
    return "\n".join(lines)


def plot(problem: int, results: dict, args: argparse.Namespace) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(args.dims), figsize=(4 * len(args.dims), 6), squeeze=False)
    for col, d in enumerate(args.dims):
        steps = results[(problem, d, args.estimators[0])][0]["steps"]
        loss = {e: [r["loss"] for r in results[(problem, d, e)]] for e in args.estimators}
        logvar = {e: [r["logvar"] for r in results[(problem, d, e)]] for e in args.estimators}
        plot_curves(axes[0][col], steps, loss, "exact loss / d", f"toy {problem}, d = {d}")
        plot_curves(axes[1][col], steps, logvar, "log10 gradient variance", f"toy {problem}, d = {d}")
    axes[0][0].legend(fontsize=8)
    print("plot:", save_figure(fig, f"toy{problem}{'_quick' if args.quick else ''}.png"))
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--dims", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--estimators", nargs="+", default=["gsb", "pathwise", "score"])
    p.add_argument("--problems", type=int, nargs="+", default=[1, 2])
    p.add_argument("--order", type=int, default=10, help="GSB truncation order for toy 2")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--var-repeats", type=int, default=100)
    p.add_argument("--n-checkpoints", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke run: 20 steps, 2 seeds, d in {1, 10}")
    if p.parse_args(argv).quick:  # quick defaults; options given explicitly still win
        p.set_defaults(steps=20, seeds=2, dims=[1, 10], var_repeats=20, n_checkpoints=2)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results = {}
    for problem in args.problems:
        for d in args.dims:
            for est in args.estimators:
                results[(problem, d, est)] = [run(problem, d, est, s, args) for s in range(args.seeds)]
    out = io.StringIO()
    with redirect_stdout(out):
        print(f"GSB toy problems (paper section 6.1) -- {time.strftime('%Y-%m-%dT%H:%M:%S')}")
        print(f"torch {torch.__version__}, {args.threads} thread(s); Adam lr {args.lr}, {args.steps} steps, "
              f"1 sample per step, {args.seeds} seeds (mean ± sd); init k = {K0}, mu = {MU0}; "
              f"log-variance from {args.var_repeats} estimates per checkpoint")
        for problem in args.problems:
            print()
            print(table(problem, results, args))
        print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    text = out.getvalue()
    print(text, end="")
    write_results("toy_quick" if args.quick else "toy", text,
                  {f"toy{p}_d{d}_{e}": v for (p, d, e), v in results.items()})
    for problem in args.problems:
        plot(problem, results, args)
    return results


if __name__ == "__main__":
    main()
