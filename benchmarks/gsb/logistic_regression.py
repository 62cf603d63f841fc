"""GSB on the Bayesian logistic regression (paper section 6.2): where its variance and its bias come from.

Companion of ``bayes_logreg.py`` (the reproduction of figure 3: same data, model, KL and metrics, imported
from it). That run found GSB N = 8 worse than N = 4 and guessed the random-sign probes. This script
separates the two candidate causes, with ``D = 31`` weights (30 standardised features + a bias):

* **probe variance**: ``storch.method.GSB`` uses exact batched pure derivatives only while
  ``D^{n−1} ≤ max_exact_batch`` (default 256, so orders ≥ 3 are unbiased random-sign probes here). We
  run GSB N = 4 with ``max_exact_batch = 31³`` (exact up to order 4; ~1–2 s per estimate) against the
  default, and a hand-written *closed-form* GSB (not storch): for this model ``f(w) = Σ_i c ℓ(y_i x_i·w)``
  with ``ℓ = log σ``, so ``∂ⁿf/∂w_jⁿ = c Σ_i (y_i x_ij)ⁿ ℓ⁽ⁿ⁾(y_i x_i·w)``, and ``ℓ⁽ⁿ⁾`` is a polynomial
  in ``σ`` (exact pure derivatives of every order at the cost of a few matrix products);
* **truncation bias**: Laplace cumulants give ``κ_{2m}/(2m)! = b^{2m}/m`` while the derivatives of ``log σ``
  grow like ``(n−1)!/πⁿ`` (poles at ``±iπ``), so the series in ``N`` is asymptotic, not convergent:
  measured against the true gradient (pathwise, ``--true-samples`` draws, float64) for ``N = 2 … 16``.

Gradient study, at two parameter points (initialisation ``μ = 0, b = 0.1`` and after 300 pathwise Adam
steps at lr 1e-2, seed 0), on one fixed minibatch of 64 with 50 posterior samples, likelihood term only
(scaled to the data set; the KL is exact): ``log10 var`` = log10 of the per-coordinate variance of one
estimate, averaged over the 62 coordinates (μ, ρ), from ``--repeats`` estimates (``--exact-repeats``
for the exact storch GSB); ``bias/SE`` = ‖mean − true‖ / √(Σ SE²), the SE of the estimator's mean and the Monte Carlo
error of the reference (from two independent references) together: ≈ 1 when no bias is detectable.

Training: Adam (``--lr``, default 1e-2 as in ``bayes_logreg.py``), ``--steps``, ``--seeds``; training
ELBO on the whole data set (500 samples), accuracy of the posterior predictive, and the gradient
log-variance along training, for GSB N = 4/8 with probes (storch), GSB N = 4/8 exact (closed form),
pathwise. ``ms/step`` is the mean wall time of an optimisation step (one thread).

Run from the repository root::

    .venv/bin/python benchmarks/gsb/logistic_regression.py            # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/gsb/logistic_regression.py --quick    # smoke run (seconds)

Tables go to stdout and ``benchmarks/gsb/results/logreg_sources.txt`` / ``.json``, the plot to
``logreg_sources.png`` (``logreg_sources_quick.*`` in quick mode).
"""

from __future__ import annotations

import argparse
import io
import math
import time
from contextlib import redirect_stdout
from typing import Callable, Optional

import bayes_logreg  # noqa: F401  (imports gsb_common, which puts the checkout on sys.path)
import torch
import torch.nn.functional as F
from torch.distributions import Laplace

import storch
from bayes_logreg import B0, laplace_kl, load_data
from gsb_common import Timer, fmt, mean_sd, plot_curves, pyplot, save_figure, write_results

D = 31
EXACT_N4_BATCH = D**3  # max_exact_batch for exact pure derivatives up to order 4


# --------------------------------------------------------------------------- closed-form derivatives
def _sigmoid_derivative_polys(n_max: int) -> list[list[int]]:
    """``P_k`` (ascending integer coefficients) with ``dᵏσ/dtᵏ = P_k(σ)``, ``k = 0 … n_max``.

    ``σ' = σ(1 − σ)``, so ``P_{k+1}(s) = P_k'(s) (s − s²)``.
    """
    polys = [[0, 1]]
    for _ in range(n_max):
        p = polys[-1]
        dp = [i * p[i] for i in range(1, len(p))]
        q = [0] * (len(dp) + 2)
        for i, c in enumerate(dp):
            q[i + 1] += c
            q[i + 2] -= c
        polys.append(q)
    return polys


_POLYS = _sigmoid_derivative_polys(24)


def logsigmoid_derivatives(t: torch.Tensor, order: int) -> list[torch.Tensor]:
    """``[ℓ⁽ⁿ⁾(t) for n = 1..order]`` with ``ℓ = log σ``: ``ℓ' = 1 − σ``, ``ℓ⁽ⁿ⁾ = −P_{n−1}(σ)`` for n ≥ 2."""
    if order > len(_POLYS):
        raise ValueError(f"logsigmoid_derivatives: order ≤ {len(_POLYS)}, got {order}")
    s = torch.sigmoid(t)
    out = [1 - s]
    for n in range(2, order + 1):
        v = torch.zeros_like(s)
        for c in reversed(_POLYS[n - 1]):
            v = v * s + c
        out.append(-v)
    return out


def pure_derivatives_closed_form(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, scale: float,
                                 order: int) -> torch.Tensor:
    """``∂ⁿf/∂w_jⁿ`` of ``f(w) = scale Σ_i log σ(y_i x_i·w)`` for every sample: ``(order, S, D)``."""
    t = y * (w @ x.T)  # (S, B)
    xy = y[:, None] * x  # (B, D)
    return torch.stack([scale * ds @ xy**n for n, ds in enumerate(logsigmoid_derivatives(t, order), 1)])


def laplace_gsb_surrogate(mu: torch.Tensor, b: torch.Tensor, mean_derivs: torch.Tensor) -> torch.Tensor:
    """``Σ_j Σ_n κ_n/n! · E∂ⁿf/∂w_jⁿ`` with Laplace cumulants: ``κ₁ = μ``, ``κ_{2m}/(2m)! = b^{2m}/m``."""
    total = (mu * mean_derivs[0]).sum()
    for n in range(2, mean_derivs.shape[0] + 1, 2):
        total = total + (b**n / (n // 2) * mean_derivs[n - 1]).sum()
    return total


# --------------------------------------------------------------------------- gradient estimators
def log_likelihood(w, x: torch.Tensor, y: torch.Tensor):
    """``Σ_i log σ(y_i x_i·w)`` per sample of ``w`` (a matrix product: 3× faster GSB than a broadcast)."""
    return F.logsigmoid(y * (w @ x.T)).sum(-1)


def storch_estimator(make: Callable[[], storch.method.Method]) -> Callable:
    """Gradient of ``−scale E_q log-likelihood`` wrt ``(μ, ρ)`` by a storch method."""

    def grad(mu, rho, x, y, scale):
        storch.reset()
        w = make()(Laplace(mu, F.softplus(rho)))
        storch.add_cost(-scale * log_likelihood(w, x, y), "nll")
        storch.backward()
        g = torch.cat([mu.grad, rho.grad])
        mu.grad = rho.grad = None
        storch.reset()
        return g

    return grad


def closed_form_gsb(order: int, n_samples: int = 50) -> Callable:
    """GSB truncated at ``order`` with exact pure derivatives in closed form (not storch)."""

    def grad(mu, rho, x, y, scale):
        b = F.softplus(rho)
        w = Laplace(mu.detach(), b.detach()).sample((n_samples,))
        d = pure_derivatives_closed_form(w, x, y, scale, order).mean(1)
        return torch.cat(torch.autograd.grad(-laplace_gsb_surrogate(mu, b, d), [mu, rho]))

    return grad


def estimators(n_samples: int) -> dict[str, Callable]:
    return {
        "pathwise": storch_estimator(lambda: storch.method.Reparameterization("w", n_samples=n_samples)),
        "score": storch_estimator(lambda: storch.method.ScoreFunction("w", n_samples=n_samples)),
        "GSB N=4 probes": storch_estimator(lambda: storch.method.GSB("w", n_samples=n_samples, order=4)),
        "GSB N=8 probes": storch_estimator(lambda: storch.method.GSB("w", n_samples=n_samples, order=8)),
        "GSB N=4 exact": storch_estimator(
            lambda: storch.method.GSB("w", n_samples=n_samples, order=4, max_exact_batch=EXACT_N4_BATCH)),
        "GSB N=4 closed": closed_form_gsb(4, n_samples),
        "GSB N=8 closed": closed_form_gsb(8, n_samples),
    }


TRAINED = ["GSB N=4 probes", "GSB N=8 probes", "GSB N=4 closed", "GSB N=8 closed", "pathwise"]


def true_gradient(mu, rho, x, y, scale, samples: int, chunk: int = 20_000) -> torch.Tensor:
    """``∇ −scale E_q log-likelihood`` by pathwise Monte Carlo with many samples, in float64."""
    m, r = mu.detach().double().requires_grad_(), rho.detach().double().requires_grad_()
    total, k = 0.0, max(samples // chunk, 1)
    for _ in range(k):
        w = Laplace(m, F.softplus(r)).rsample((min(chunk, samples),))
        f = -scale * log_likelihood(w, x.double(), y.double()).mean()
        total = total + torch.cat(torch.autograd.grad(f, [m, r]))
    return total / k


def truncation_biases(mu, rho, x, y, scale, true: torch.Tensor, samples: int, orders: list[int],
                      chunk: int = 20_000) -> dict[int, float]:
    """‖closed-form GSB gradient at order N (``samples`` draws, float64) − true‖ over the ρ coordinates.

    Only the ρ part depends on N (κ₁ = μ is the only cumulant carrying μ).
    """
    m, r = mu.detach().double().requires_grad_(), rho.detach().double().requires_grad_()
    b = F.softplus(r)
    k, top = max(samples // chunk, 1), max(orders)
    d = sum(pure_derivatives_closed_form(Laplace(m.detach(), b.detach()).sample((min(chunk, samples),)),
                                         x.double(), y.double(), scale, top).mean(1) for _ in range(k)) / k
    out = {}
    for n in orders:
        g = torch.autograd.grad(-laplace_gsb_surrogate(m, F.softplus(r), d[:n]), r)[0]
        out[n] = (g - true[D:]).norm().item()
    return out


# --------------------------------------------------------------------------- study and training
def gradient_study(x, y, args) -> dict:
    n_data = len(x)
    scale = n_data / args.batch
    gen = torch.Generator().manual_seed(0)
    fixed = torch.randperm(n_data, generator=gen)[: args.batch]
    xb, yb = x[fixed], y[fixed]
    points = {"init": _init_params()}
    if not args.quick:
        points["after 300 pathwise steps"] = _pathwise_trained(x, y, 300, 1e-2)
    ests = estimators(args.samples)
    study = {}
    for point, (mu0, rho0) in points.items():
        torch.manual_seed(1)
        true = true_gradient(mu0, rho0, xb, yb, scale, args.true_samples)
        ref_err = (true - true_gradient(mu0, rho0, xb, yb, scale, args.true_samples)).pow(2) / 2  # its MC variance
        rows = {}
        for label, est in ests.items():
            if args.quick and label == "GSB N=4 exact":
                continue
            repeats = args.exact_repeats if label == "GSB N=4 exact" else args.repeats
            mu, rho = mu0.clone().requires_grad_(), rho0.clone().requires_grad_()
            t0 = time.perf_counter()
            g = torch.stack([est(mu, rho, xb, yb, scale) for _ in range(repeats)]).double()
            ms = 1000 * (time.perf_counter() - t0) / repeats
            var = g.var(0)
            se = (var / repeats + ref_err).sum().sqrt().item()  # of the estimator's mean and of the reference
            rows[label] = {
                "log10_var": math.log10(var.mean().item()),
                "log10_var_mu": math.log10(var[:D].mean().item()),
                "log10_var_rho": math.log10(var[D:].mean().item()),
                "bias_over_se": (g.mean(0) - true).norm().item() / se,
                "rho_bias_over_se": (g.mean(0)[D:] - true[D:]).norm().item() / (var[D:] / repeats + ref_err[D:]).sum().sqrt().item(),
                "ms": ms, "repeats": repeats,
            }
        trunc = truncation_biases(mu0, rho0, xb, yb, scale, true, args.true_samples, args.orders)
        study[point] = {
            "rows": rows, "truncation_rho_bias": trunc,
            "true_norm_mu": true[:D].norm().item(), "true_norm_rho": true[D:].norm().item(),
            "true_rho_mc_error": ref_err[D:].sum().sqrt().item(),
            "b_range": [F.softplus(rho0).min().item(), F.softplus(rho0).max().item()],
        }
    return study


def _init_params() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(D), torch.full((D,), math.log(math.expm1(B0)))


def _pathwise_trained(x, y, steps: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    mu0, rho0 = _init_params()
    mu, rho = mu0.requires_grad_(), rho0.requires_grad_()
    opt = torch.optim.Adam([mu, rho], lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,))
        w = Laplace(mu, F.softplus(rho)).rsample((50,))
        loss = -(len(x) / 64) * log_likelihood(w, x[idx], y[idx]).mean() + laplace_kl(mu, F.softplus(rho)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return mu.detach(), rho.detach()


@torch.no_grad()
def evaluate(mu, rho, x, y, samples: int) -> tuple[float, float]:
    """Whole-data ELBO (exact KL) and accuracy of the posterior predictive ``E_q σ(x·w) > ½``."""
    b = F.softplus(rho)
    w = Laplace(mu, b).sample((samples,))
    elbo = log_likelihood(w, x, y).mean() - laplace_kl(mu, b).sum()
    accuracy = ((torch.sigmoid(w @ x.T).mean(0) > 0.5).float() * 2 - 1 == y).float().mean()
    return elbo.item(), accuracy.item()


def train(label: str, est: Callable, seed: int, x, y, args) -> dict:
    torch.manual_seed(seed)
    n_data = len(x)
    scale = n_data / args.batch
    mu0, rho0 = _init_params()
    mu, rho = mu0.requires_grad_(), rho0.requires_grad_()
    opt = torch.optim.Adam([mu, rho], lr=args.lr)
    fixed = torch.randperm(n_data)[: args.batch]
    checkpoints = sorted({*range(0, args.steps + 1, max(args.steps // args.n_checkpoints, 1)), args.steps})
    out = {"steps": checkpoints, "elbo": [], "accuracy": [], "logvar": []}
    timer, order, cursor = Timer(), torch.randperm(n_data), 0
    for step in range(args.steps + 1):
        if step in checkpoints:
            elbo, acc = evaluate(mu, rho, x, y, args.eval_samples)
            g = torch.stack([est(mu, rho, x[fixed], y[fixed], scale) for _ in range(args.train_repeats)])
            out["elbo"].append(elbo)
            out["accuracy"].append(acc)
            out["logvar"].append(math.log10(g.var(0).mean().item()))
        if step == args.steps:
            break
        if cursor + args.batch > n_data:
            order, cursor = torch.randperm(n_data), 0
        idx = order[cursor: cursor + args.batch]
        cursor += args.batch
        with timer:
            g = est(mu, rho, x[idx], y[idx], scale)
            kl = torch.autograd.grad(laplace_kl(mu, F.softplus(rho)).sum(), [mu, rho])
            mu.grad, rho.grad = g[:D] + kl[0], g[D:] + kl[1]
            opt.step()
            opt.zero_grad()
    out["ms_per_step"] = timer.ms
    return out


# --------------------------------------------------------------------------- report
def study_tables(study: dict, args) -> str:
    lines = []
    for point, s in study.items():
        lo, hi = s["b_range"]
        lines.append(f"Gradient study at {point} (b in [{lo:.3g}, {hi:.3g}]; |true grad| mu {s['true_norm_mu']:.4g}, "
                     f"rho {s['true_norm_rho']:.4g}; fixed minibatch of {args.batch}, {args.samples} samples)")
        head = f"{'estimator':<16} {'log10 var':>9} {'(mu)':>7} {'(rho)':>7} {'bias/SE':>8} {'rho bias/SE':>11} {'ms/est':>8} {'R':>4}"
        lines += [head, "-" * len(head)]
        for label, r in s["rows"].items():
            lines.append(f"{label:<16} {r['log10_var']:>9.3f} {r['log10_var_mu']:>7.2f} {r['log10_var_rho']:>7.2f} "
                         f"{r['bias_over_se']:>8.2f} {r['rho_bias_over_se']:>11.2f} {r['ms']:>8.1f} {r['repeats']:>4}")
        tr = s["truncation_rho_bias"]
        lines.append(f"truncation bias of exact GSB, ||rho part - true|| ({args.true_samples} samples; MC error of "
                     f"'true' {s['true_rho_mc_error']:.3g}):")
        lines.append("  N    " + " ".join(f"{n:>9d}" for n in tr))
        lines.append("  bias " + " ".join(f"{v:>9.3g}" for v in tr.values()))
        lines.append("")
    return "\n".join(lines)


def training_table(results: dict) -> str:
    head = f"{'estimator':<16} {'ELBO end (mean ± sd)':>22} {'accuracy end':>16} {'log10 var start':>16} {'log10 var end':>16} {'ms/step':>8}"
    lines = [head, "-" * len(head)]
    for label, runs in results.items():
        lines.append(f"{label:<16} {fmt([r['elbo'][-1] for r in runs]):>22} {fmt([r['accuracy'][-1] for r in runs], 3):>16} "
                     f"{fmt([r['logvar'][0] for r in runs], 3):>16} {fmt([r['logvar'][-1] for r in runs], 3):>16} "
                     f"{mean_sd([r['ms_per_step'] for r in runs])[0]:>8.1f}")
    steps = next(iter(results.values()))[0]["steps"]
    lines += ["", "ELBO along training (mean over seeds), steps " + " ".join(map(str, steps))]
    for label, runs in results.items():
        lines.append(f"{label:<16} " + " ".join(f"{v:.1f}" for v in torch.tensor([r["elbo"] for r in runs]).mean(0).tolist()))
    return "\n".join(lines)


def plot(results: dict, stem: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    steps = next(iter(results.values()))[0]["steps"]
    for ax, key, ylabel in zip(axes, ("elbo", "logvar", "accuracy"),
                               ("training ELBO", "log10 gradient variance", "accuracy")):
        plot_curves(ax, steps, {k: [r[key] for r in v] for k, v in results.items()}, ylabel,
                    "GSB probes vs exact derivatives (Laplace logistic regression)")
    axes[0].set_ylim(bottom=max(min(min(r["elbo"]) for v in results.values() for r in v), -2000))
    axes[0].legend(fontsize=8)
    path = save_figure(fig, f"{stem}.png")
    plt.close(fig)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=50, help="posterior samples per estimate")
    p.add_argument("--repeats", type=int, default=50, help="estimates per variance in the gradient study")
    p.add_argument("--exact-repeats", type=int, default=10, help="the same for the exact storch GSB N=4 (~1.5 s each)")
    p.add_argument("--train-repeats", type=int, default=20, help="estimates per variance along training")
    p.add_argument("--true-samples", type=int, default=200_000)
    p.add_argument("--orders", type=int, nargs="+", default=[2, 4, 6, 8, 10, 12, 16])
    p.add_argument("--eval-samples", type=int, default=500)
    p.add_argument("--n-checkpoints", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-study", action="store_true", help="skip the gradient study")
    p.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    if p.parse_args(argv).quick:
        p.set_defaults(steps=4, seeds=1, repeats=3, train_repeats=3, n_checkpoints=2, eval_samples=50,
                       true_samples=2000, orders=[2, 4, 8])
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    x, y = load_data()
    study = {} if args.no_study else gradient_study(x, y, args)
    t_study = time.perf_counter() - t0
    ests = estimators(args.samples)
    results = {label: [train(label, ests[label], s, x, y, args) for s in range(args.seeds)] for label in TRAINED}
    stem = "logreg_sources_quick" if args.quick else "logreg_sources"
    out = io.StringIO()
    with redirect_stdout(out):
        print(f"GSB logistic regression: probe variance vs truncation bias -- {time.strftime('%Y-%m-%dT%H:%M:%S')}")
        print(f"torch {torch.__version__}, {args.threads} thread(s); breast cancer {tuple(x.shape)} (with bias); "
              f"'probes' = storch GSB default (max_exact_batch 256: orders >= 3 random-sign probes), "
              f"'exact' = storch GSB max_exact_batch {EXACT_N4_BATCH}, 'closed' = exact pure derivatives in closed "
              "form (hand-written, not storch)\n")
        if study:
            print(study_tables(study, args))
            print(f"(gradient study {t_study:.1f} s)\n")
        print(f"Training: Adam lr {args.lr}, {args.steps} steps, batch {args.batch}, {args.samples} samples, "
              f"{args.seeds} seeds (mean ± sd); log-variance from {args.train_repeats} estimates on a fixed batch\n")
        print(training_table(results))
        print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    text = out.getvalue()
    print(text, end="")
    data = {"study": {p: {**s, "truncation_rho_bias": {str(k): v for k, v in s["truncation_rho_bias"].items()}}
                      for p, s in study.items()}, "training": results, "args": vars(args)}
    write_results(stem, text, data)
    path = plot(results, stem)
    if path:
        print("plot:", path)
    return {"study": study, "training": results}


if __name__ == "__main__":
    main()
