"""GSB paper, section 6.2: Bayesian logistic regression with Laplace priors and posteriors (figure 3).

Run from the repository root::

    .venv/bin/python benchmarks/gsb/bayes_logreg.py            # default run (~2 minutes on 2 cores)
    .venv/bin/python benchmarks/gsb/bayes_logreg.py --quick    # smoke run (seconds)

Data: scikit-learn's breast-cancer set (569 × 30, the UCI Wisconsin data the paper uses), features
standardised, a constant feature appended for the bias (``D = 31`` weights), ``y ∈ {−1, 1}``. Model:
``w_j ~ Laplace(0, s = 1)``, ``y_n | w ~ σ(y_n x_n·w)``; variational posterior
``q(w) = Π_j Laplace(μ_j, b_j)``, ``b = softplus(ρ)``, from ``μ = 0``, ``b = 0.1``. Negative ELBO, per step
on a minibatch of 64 with 50 posterior samples (the paper's setting):

    −ELBO = −(N/64) Σ_{n ∈ batch} E_q[log σ(y_n x_n·w)] + KL(q ‖ p),
    KL(L(μ, b) ‖ L(0, s)) = log(s/b) − 1 + |μ|/s + (b/s) exp(−|μ|/b)   (closed form, per weight),

the expectation by the estimator under test, the KL exactly. Estimators: GSB truncated at N = 4 and
N = 8 (``storch.method.GSB("w", 50, order=N)``; with ``D = 31`` coordinates order 2 is one exact
31-batched VJP and orders ≥ 3 are unbiased random-sign probes, see :mod:`storch.method.derivatives`),
pathwise (``Laplace.rsample``) and the score function without baseline (the paper uses no control
variates). Adam, lr ``--lr`` (default 1e-2; the paper's 1e-3 needs ~10× the steps, ``--lr 1e-3``).

Metrics (mean ± sd over seeds): the training ELBO on the whole data set (500 posterior samples, exact
KL), the accuracy of the posterior predictive ``E_q σ(x·w) > ½`` on the whole data set, and the
gradient log-variance: ``log10`` of the per-parameter variance of one gradient estimate (50 samples, a
fixed minibatch, the likelihood term only), averaged over the 62 parameters (μ, ρ), from
``--var-repeats`` estimates.
Tables go to stdout and ``benchmarks/gsb/results/logreg.txt`` / ``.json``; the plot to
``results/logreg.png``.
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
from torch.distributions import Laplace

import storch
from gsb_common import Timer, fmt, gradient_log_variance, make_method, mean_sd, plot_curves, pyplot, save_figure, write_results

PRIOR_SCALE = 1.0
B0 = 0.1

ESTIMATORS = {  # label: (method name, GSB order)
    "GSB N=4": ("gsb", 4),
    "GSB N=8": ("gsb", 8),
    "pathwise": ("pathwise", 0),
    "score": ("score", 0),
}


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised breast-cancer features with a constant column, and labels in {−1, 1}."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    x = torch.cat([x, torch.ones(len(x), 1)], 1)
    return x, torch.tensor(y, dtype=torch.float32) * 2 - 1


def laplace_kl(mu: torch.Tensor, b: torch.Tensor, s: float = PRIOR_SCALE) -> torch.Tensor:
    """``KL(Laplace(μ, b) ‖ Laplace(0, s))``, elementwise.

    ``E_q log q = −log 2b − 1`` and ``E_q |w| = |μ| + b e^{−|μ|/b}``, so
    ``KL = log(s/b) − 1 + (|μ| + b e^{−|μ|/b}) / s``.
    """
    return torch.log(s / b) - 1 + (mu.abs() + b * torch.exp(-mu.abs() / b)) / s


def log_likelihood(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``Σ_n log σ(y_n x_n·w)`` per sample of ``w`` (plates first, weights last)."""
    return F.logsigmoid(y * (w.unsqueeze(-2) * x).sum(-1)).sum(-1)


def make_model(label: str, n_samples: int, x: torch.Tensor, y: torch.Tensor, scale: float):
    name, order = ESTIMATORS[label]

    def model(mu: torch.Tensor, rho: torch.Tensor) -> None:
        w = make_method(name, "w", n_samples, order)(Laplace(mu, F.softplus(rho)))
        storch.add_cost(-scale * log_likelihood(w, x, y), "nll")

    return model


@torch.no_grad()
def evaluate(mu: torch.Tensor, rho: torch.Tensor, x: torch.Tensor, y: torch.Tensor, samples: int) -> tuple[float, float]:
    """Whole-data ELBO and accuracy of the posterior predictive ``E_q σ(x·w) > ½`` (``samples`` draws)."""
    b = F.softplus(rho)
    w = Laplace(mu, b).sample((samples,))
    elbo = log_likelihood(w, x, y).mean() - laplace_kl(mu, b).sum()
    predictive = torch.sigmoid(w @ x.T).mean(0)
    accuracy = ((predictive > 0.5).float() * 2 - 1 == y).float().mean()
    return elbo.item(), accuracy.item()


def run(label: str, seed: int, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> dict:
    torch.manual_seed(seed)
    n_data, dim = x.shape
    mu = torch.zeros(dim, requires_grad=True)
    rho = torch.full((dim,), math.log(math.expm1(B0)), requires_grad=True)
    opt = torch.optim.Adam([mu, rho], lr=args.lr)
    scale = n_data / args.batch
    fixed = torch.randperm(n_data)[: args.batch]
    probe = make_model(label, args.samples, x[fixed], y[fixed], scale)
    checkpoints = sorted({*range(0, args.steps + 1, max(args.steps // args.n_checkpoints, 1)), args.steps})
    elbos, accs, logvars, timer = [], [], [], Timer()
    order = torch.randperm(n_data)
    cursor = 0
    for step in range(args.steps + 1):
        if step in checkpoints:
            elbo, acc = evaluate(mu, rho, x, y, args.eval_samples)
            elbos.append(elbo)
            accs.append(acc)
            logvars.append(gradient_log_variance([mu, rho], args.var_repeats, probe))
        if step == args.steps:
            break
        if cursor + args.batch > n_data:
            order, cursor = torch.randperm(n_data), 0
        idx = order[cursor : cursor + args.batch]
        cursor += args.batch
        with timer:
            storch.reset()
            make_model(label, args.samples, x[idx], y[idx], scale)(mu, rho)
            storch.backward()
            laplace_kl(mu, F.softplus(rho)).sum().backward()
            opt.step()
            opt.zero_grad()
    storch.reset()
    return {"steps": checkpoints, "elbo": elbos, "accuracy": accs, "logvar": logvars, "ms_per_step": timer.ms}


def table(results: dict, args: argparse.Namespace) -> str:
    header = f"{'estimator':<10} {'ELBO start':>12} {'ELBO end (mean ± sd)':>22} {'accuracy end':>16} " \
             f"{'log10 var start':>16} {'log10 var end':>16} {'ms/step':>8}"
    lines = [header, "-" * len(header)]
    for label, runs in results.items():
        lines.append(
            f"{label:<10} {fmt([r['elbo'][0] for r in runs]):>12} {fmt([r['elbo'][-1] for r in runs]):>22} "
            f"{fmt([r['accuracy'][-1] for r in runs], 3):>16} {fmt([r['logvar'][0] for r in runs], 3):>16} "
            f"{fmt([r['logvar'][-1] for r in runs], 3):>16} {mean_sd([r['ms_per_step'] for r in runs])[0]:>8.1f}"
        )
    lines.append("")
    lines.append("ELBO along training (mean over seeds), steps " + " ".join(str(s) for s in next(iter(results.values()))[0]["steps"]))
    for label, runs in results.items():
        curve = torch.tensor([r["elbo"] for r in runs]).mean(0)
        lines.append(f"{label:<10} " + " ".join(f"{v:.1f}" for v in curve.tolist()))
    return "\n".join(lines)


def plot(results: dict, args: argparse.Namespace) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    steps = next(iter(results.values()))[0]["steps"]
    for ax, key, ylabel in zip(axes, ("elbo", "logvar", "accuracy"), ("training ELBO", "log10 gradient variance", "accuracy")):
        plot_curves(ax, steps, {k: [r[key] for r in v] for k, v in results.items()}, ylabel,
                    "Bayesian logistic regression (Laplace)")
    axes[0].set_ylim(bottom=max(min(min(r["elbo"]) for v in results.values() for r in v), -2000))
    axes[0].legend(fontsize=8)
    print("plot:", save_figure(fig, f"{stem(args)}.png"))
    plt.close(fig)


def stem(args: argparse.Namespace) -> str:
    return args.name or ("logreg_quick" if args.quick else "logreg")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=50, help="posterior samples per step")
    p.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=list(ESTIMATORS))
    p.add_argument("--var-repeats", type=int, default=20)
    p.add_argument("--eval-samples", type=int, default=500)
    p.add_argument("--n-checkpoints", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default=None, help="stem of the result files (default logreg / logreg_quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 6 steps, 1 seed")
    if p.parse_args(argv).quick:  # quick defaults; options given explicitly still win
        p.set_defaults(steps=6, seeds=1, var_repeats=4, n_checkpoints=2, eval_samples=50)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    x, y = load_data()
    results = {label: [run(label, s, x, y, args) for s in range(args.seeds)] for label in args.estimators}
    out = io.StringIO()
    with redirect_stdout(out):
        print(f"GSB Bayesian logistic regression (paper section 6.2) -- {time.strftime('%Y-%m-%dT%H:%M:%S')}")
        print(f"torch {torch.__version__}, {args.threads} thread(s); breast cancer {tuple(x.shape)} (with bias); "
              f"Adam lr {args.lr}, {args.steps} steps, batch {args.batch}, {args.samples} posterior samples, "
              f"{args.seeds} seeds (mean ± sd); log-variance from {args.var_repeats} estimates on a fixed batch")
        print()
        print(table(results, args))
        print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    text = out.getvalue()
    print(text, end="")
    write_results(stem(args), text, results)
    plot(results, args)
    return results


if __name__ == "__main__":
    main()
