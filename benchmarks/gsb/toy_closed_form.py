"""GSB's toy problems (Echraibi et al. 2020, section 6.1) where the truncated series diverges: eq. 25 vs order N.

A companion of ``toy_problems.py`` (the main reproduction, started at ``k = 2, μ = 0.5`` where toy 2 keeps
``εμ < 0.73`` and the truncated series converges). Here the runs start at ``k = μ = 1`` with a log
parameterisation, so toy 2 drives ``εμ`` past 1, the radius of convergence of GSB's gamma series; the
script compares the truncated series with the series summed in closed form (the paper's eq. 25,
:class:`GSBExponential`) and checks every estimator against the **exact** gradient at each checkpoint
(``max|z|``), which shows which estimators are unbiased where.

Run from the repository root::

    .venv/bin/python benchmarks/gsb/toy_closed_form.py            # d = 1, 10, 100; 2000 steps; 5 runs (~5 min)
    .venv/bin/python benchmarks/gsb/toy_closed_form.py --quick    # smoke run (seconds)
    .venv/bin/python benchmarks/gsb/toy_closed_form.py --help

Results: ``benchmarks/gsb/results/toy_closed_form.{txt,json}`` and ``toy_closed_form_problem{1,2}.png``
(plots with matplotlib's Agg backend when matplotlib is installed, ``pip install -e '.[bench]'``; without it
the tables are still printed and written).

``z ~ Π_j Gamma(k_j, μ_j)`` with the paper's scale ``μ`` (torch's ``rate = 1/μ``), parameterised as
``k = exp(a)``, ``μ = exp(b)``, ``a = b = 0`` at the start (``k = μ = 1``), ``θ = (a, b)``.

* Problem 1: ``L = E Σ_j (z_j − ε)²``, ε = 0.49; exact ``L = Σ_j k_j μ_j² + (k_j μ_j − ε)²``.
* Problem 2: ``L = E Σ_j exp(−ε z_j)``; exact ``L = Σ_j (1 + ε μ_j)^(−k_j)``.

Estimators, all storch methods with ``--samples`` samples per step and no control variate (as in the paper):

* ``GSB order 2`` (problem 1): :class:`storch.method.gsb.GSB` truncated at 2, exact for a quadratic cost
  (eq. 24: ``∇κ₁ E f' + ∇κ₂/2 E f''``).
* ``GSB eq. 25`` (problem 2): the series summed in closed form. For a cost whose dependence on ``z_j`` is
  ``c·exp(−ε z_j)``, ``∂ⁿf/∂z_jⁿ = (−ε)^(n−1) ∂f/∂z_j``, so ``Σ_n ∇κ_n/n! E ∂ⁿf = ∇K_j(−ε)/(−ε) · E ∂f/∂z_j``
  with the cumulant generating function ``K(t) = log E e^{tz} = −k log(1 − tμ)``; this is the paper's
  ``∇θ log φθ(ε/i) · E f`` per coordinate, and it is exact for every μ (:class:`GSBExponential`, a
  :class:`GSB` whose term uses the first derivative only).
* ``GSB order N`` (problem 2, ``--order2``, default 8): the plain truncated series. Its terms are
  ``∝ (εμ)ⁿ/n``: it converges only while ``εμ < 1`` (μ < 2.04), and problem 2 drives μ upwards, so it
  shows where truncation stops being harmless.
* ``pathwise``: :class:`storch.method.Reparameterization`, i.e. torch's ``Gamma.rsample``, whose gradient
  is the implicit reparameterization gradient (Figurnov et al. 2018).
* ``score function``: :class:`storch.method.ScoreFunction` without baseline.

Measured per estimator, ``d`` and run (``--seeds`` runs, one storch graph, see the helpers below): the exact
training loss at every step; at ``--checkpoints`` evenly spaced steps, ``--var-reps`` independent gradient
estimates at the current parameters, from which the log10 of the per-coordinate variance of one estimate
(averaged over the 2d coordinates of ``(a, b)``) and ``max|z|`` = the largest ``|mean − exact|/se`` over
coordinates, runs and checkpoints against the exact gradient (autograd of the closed form). For an
unbiased estimator ``max|z|`` stays around 4–5 (it is a maximum over up to 2·100·5·11 values); far
above, the estimator is biased. Tables: mean ± sd over the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributions import Gamma

import storch
from storch.method import Reparameterization, ScoreFunction
from storch.method.derivatives import pure_derivatives
from storch.method.gsb import GSB, _foreign_plate_weights, leaf_of
from storch.reductions import sum as plate_sum
from storch.tensor import (
    CostTensor,
    StochasticTensor,
    _Disable,
    is_storch,
    layout_of,
    plain,
    wrap_new,
)
from storch.testing import replicated_gradients

EPS = 0.49


# --------------------------------------------------------------------------- helpers
# Seeds as a plate: the S runs of one estimator are one storch graph. The parameters have a leading
# dimension S that the model declares an independent plate "seed" (seed_view); each run draws its own
# samples and Adam is elementwise, so the runs do not interact. storch averages over an independent
# plate (weight 1/S), so gradients are multiplied by S before the step (rescale_grads). Gradient
# variance: R independent estimates in one backward pass (storch.testing.replicated_gradients, a
# "replicate" plate in front of "seed"); per run, the variance of one estimate per coordinate,
# averaged over coordinates, as log10.
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SEED_PLATE = "seed"


def seed_view(param: torch.Tensor, plate: str = SEED_PLATE) -> torch.Tensor:
    """Declare the leading non-plate dimension of ``param`` (the runs) an independent plate."""
    dim = len(layout_of(param).plates) if is_storch(param) else 0
    return storch.denote_independent(param, dim, plate)


def rescale_grads(params: Sequence[torch.Tensor], factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def replicated_estimates(
    params: Sequence[torch.Tensor], repeats: int, model: Callable[..., None], n_seeds: int, chunk: int = 0
) -> list[torch.Tensor]:
    """``R`` independent gradient estimates per run: one tensor ``(R, S, ...)`` per parameter.

    ``model(*views)`` builds the graph and registers the costs (it calls :func:`seed_view` itself).
    ``chunk`` > 0 splits the ``R`` replicates into several backward passes (memory).
    """
    chunk = chunk if chunk > 0 else repeats
    parts: list[list[torch.Tensor]] = []
    done = 0
    while done < repeats:
        r = min(chunk, repeats - done)
        grads = replicated_gradients([p.detach() for p in params], r, model)
        parts.append([g.detach() * n_seeds for g in grads])  # undo the 1/S of the seed plate
        done += r
    return [torch.cat([p[i] for p in parts]) for i in range(len(params))]


def log10_mean_variance(estimates: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per run (dim 1): log10 of the mean over all coordinates of the variance over replicates (dim 0)."""
    flat = torch.cat([e.double().flatten(2) for e in estimates], dim=2)  # (R, S, coordinates)
    return flat.var(0).mean(-1).log10()


def max_abs_z(estimates: Sequence[torch.Tensor], exact: Sequence[torch.Tensor], floor: float = 1e-7) -> float:
    """Largest ``|mean − exact| / (sd/√R)`` over all coordinates of all runs (``storch.testing``'s statistic)."""
    worst = 0.0
    for e, g in zip(estimates, exact):
        e = e.double()
        r = e.shape[0]
        diff = (e.mean(0) - g.double()).abs()
        se = e.std(0) / math.sqrt(r)
        z = torch.where(diff > floor, diff / se.clamp_min(1e-30), torch.zeros_like(diff))
        worst = max(worst, float(z.max()))
    return worst


def mean_sd(values: Sequence[float] | torch.Tensor) -> tuple[float, float]:
    t = torch.as_tensor(values, dtype=torch.float64).flatten()
    if t.numel() == 0:
        return float("nan"), float("nan")
    sd = float(t.std()) if t.numel() > 1 else 0.0
    return float(t.mean()), sd


def fmt_ms(m: float, s: float, digits: int = 3) -> str:
    """``mean ± sd`` in a compact scientific or fixed form."""
    if not math.isfinite(m):
        return "nan"
    if m != 0 and (abs(m) < 1e-2 or abs(m) >= 1e4):
        return f"{m:.{digits - 1}e} ± {s:.1e}"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "argv": sys.argv[1:],
    }


def write_results(out_dir: Path, stem: str, text: str, data: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    txt, js = out_dir / f"{stem}.txt", out_dir / f"{stem}.json"
    txt.write_text(text + "\n")
    js.write_text(json.dumps(data, indent=1, default=float) + "\n")
    return [txt, js]


def pyplot() -> Optional[Any]:
    """matplotlib.pyplot with the Agg backend, or None (and a printed note) when matplotlib is missing."""
    if os.environ.get("GSB_BENCH_NO_PLOTS"):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: tables only, no plots (pip install -e '.[bench]' or make bench-gsb).")
        return None
    return plt


def band(ax: Any, x: Sequence[float], runs: torch.Tensor, label: str, color: Optional[str] = None, log: bool = False) -> None:
    """Mean ± sd over runs (dim 0 of ``runs``) as a line with a shaded band."""
    r = runs.double()
    if log:  # mean and sd of log10 values: a band that stays positive
        r = r.clamp_min(1e-300).log10()
    m = r.mean(0)
    s = r.std(0) if r.shape[0] > 1 else torch.zeros_like(m)
    lo, hi = m - s, m + s
    if log:
        m, lo, hi = 10**m, 10**lo, 10**hi
    (ln,) = ax.plot(list(x), m.tolist(), label=label, color=color, lw=1.2)
    ax.fill_between(list(x), lo.tolist(), hi.tolist(), color=ln.get_color(), alpha=0.2, lw=0)


# --------------------------------------------------------------------------- GSB summed in closed form (eq. 25)
class GSBExponential(GSB):
    """GSB for Gamma nodes whose cost depends on each ``z_j`` through ``c_j·exp(−ε z_j)`` (eq. 25).

    Then ``∂ⁿf/∂z_jⁿ = (−ε)^(n−1) ∂f/∂z_j`` for all n, and the whole cumulant series sums to
    ``Σ_j (∇θ K_j(−ε) / (−ε)) · E[∂f/∂z_j]``, ``K(t) = −k log(1 − t/β)`` (Gamma with rate β): one VJP,
    no truncation, exact for every ``εμ`` (the truncated series diverges for ``εμ ≥ 1``). The samples
    and the differentiation leaf are those of :class:`GSB`; only the term differs. For other costs this
    is wrong: it is a benchmark device, not a general estimator.
    """

    def __init__(self, plate_name: str, n_samples: int, eps: float) -> None:
        super().__init__(plate_name, n_samples=n_samples, order=1)
        self.eps = float(eps)

    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[None, Optional[torch.Tensor]]:
        distr = tensor.distribution
        if not isinstance(distr, Gamma):
            raise TypeError(f"GSBExponential({tensor.name!r}) handles Gamma nodes only, got {type(distr).__name__}.")
        leaf = leaf_of(tensor)  # the detached sample GSB differentiates the cost by
        layout = tensor._node.layout
        u = _foreign_plate_weights(cost, layout)
        (g1,) = pure_derivatives(plain(cost), leaf, 1, len(layout.sizes), u)
        with _Disable():
            cgf = -distr.concentration * torch.log1p(self.eps / distr.rate)  # K(−ε) = log E exp(−εz)
            total = (cgf - cgf.detach()) * (g1 / -self.eps)
            n_lead = len(layout.sizes)
            if total.dim() > n_lead:
                total = total.sum(tuple(range(n_lead, total.dim())))
        term = wrap_new(total, layout)
        missing = [p for p in layout.plates if p.name not in cost._layout.names]
        return None, (plate_sum(term, missing) if missing else term)


# --------------------------------------------------------------------------- problems
def gamma(a: torch.Tensor, b: torch.Tensor) -> Gamma:
    return Gamma(a.exp(), (-b).exp())  # k = e^a, scale μ = e^b, rate = 1/μ


def cost1(z: torch.Tensor) -> torch.Tensor:
    return ((z - EPS) ** 2).sum(-1)


def cost2(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(-EPS * z).sum(-1)


def exact1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    k, mu = a.exp(), b.exp()
    return (k * mu**2 + (k * mu - EPS) ** 2).sum(-1)


def exact2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    k, mu = a.exp(), b.exp()
    return torch.exp(-k * torch.log1p(EPS * mu)).sum(-1)


PROBLEMS: dict[int, tuple[str, Callable, Callable]] = {
    1: ("E||z - 0.49||^2", cost1, exact1),
    2: ("E sum_j exp(-0.49 z_j)", cost2, exact2),
}


def estimators(problem: int, order2: int) -> list[tuple[str, Callable[[int], Any]]]:
    pathwise = ("pathwise (implicit)", lambda n: Reparameterization("z", n_samples=n))
    score = ("score function", lambda n: ScoreFunction("z", n_samples=n))
    if problem == 1:
        return [("GSB order 2 (exact)", lambda n: GSB("z", n_samples=n, order=2)), pathwise, score]
    return [
        ("GSB eq. 25 (closed form)", lambda n: GSBExponential("z", n, EPS)),
        (f"GSB order {order2} (truncated)", lambda n: GSB("z", n_samples=n, order=order2)),
        pathwise,
        score,
    ]


# --------------------------------------------------------------------------- one training run (S seeds at once)
def model(a: torch.Tensor, b: torch.Tensor, method: Any, cost: Callable) -> None:
    z = method(gamma(seed_view(a), seed_view(b)))
    storch.add_cost(cost(z), "f")


def exact_grads(a: torch.Tensor, b: torch.Tensor, exact: Callable) -> list[torch.Tensor]:
    a, b = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    return list(torch.autograd.grad(exact(a, b).sum(), (a, b)))


def train(problem: int, d: int, make: Callable[[int], Any], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    _, cost, exact = PROBLEMS[problem]
    torch.manual_seed(seed)
    S = args.seeds
    a = torch.zeros(S, d, requires_grad=True)
    b = torch.zeros(S, d, requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=args.lr)
    method = make(args.samples)
    checkpoints = sorted({round(i * args.steps / args.checkpoints) for i in range(args.checkpoints + 1)})
    losses = torch.empty(args.steps + 1, S, dtype=torch.float64)
    logvar, zmax, step_time = [], 0.0, 0.0
    for t in range(args.steps + 1):
        with torch.no_grad():
            losses[t] = exact(a.double(), b.double())
        if t in checkpoints:
            est = replicated_estimates(
                [a, b], args.var_reps, lambda a_, b_: model(a_, b_, make(args.samples), cost), S, args.chunk
            )
            logvar.append(log10_mean_variance(est))
            zmax = max(zmax, max_abs_z(est, exact_grads(a, b, exact)))
        if t == args.steps:
            break
        t0 = time.perf_counter()
        opt.zero_grad()
        model(a, b, method, cost)
        storch.backward()
        rescale_grads([a, b], S)
        opt.step()
        step_time += time.perf_counter() - t0
    return {
        "losses": losses,
        "checkpoints": checkpoints,
        "logvar": torch.stack(logvar),  # (checkpoints, S)
        "max_abs_z": zmax,
        "ms_per_step": 1e3 * step_time / max(args.steps, 1),
        "final_params": {"k": a.detach().exp().mean(-1).tolist(), "mu": b.detach().exp().mean(-1).tolist()},
    }


# --------------------------------------------------------------------------- tables and plots
def summary_rows(results: dict[str, dict[str, Any]], steps: int) -> list[list[str]]:
    rows = []
    marks = [max(1, steps // 10), steps // 2, steps]
    for label, r in results.items():
        L = r["losses"]
        cells = [label] + [fmt_ms(*mean_sd(L[m])) for m in marks]
        cells.append(fmt_ms(*mean_sd(r["logvar"].mean(0)), digits=2))
        cells.append(f"{r['max_abs_z']:.1f}")
        cells.append(f"{r['ms_per_step']:.1f}")
        rows.append(cells)
    return rows


def header(steps: int, seeds: int) -> list[str]:
    marks = [max(1, steps // 10), steps // 2, steps]
    return ["estimator"] + [f"loss@{m}" for m in marks] + ["log10 Var(grad)", "max|z|", f"ms/step ({seeds} runs)"]


def plot(all_results: dict, args: argparse.Namespace, out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    files = []
    for problem, by_d in all_results.items():
        dims = list(by_d)
        fig, axes = plt.subplots(2, len(dims), figsize=(4.2 * len(dims), 6.4), squeeze=False)
        for col, d in enumerate(dims):
            for label, r in by_d[d].items():
                steps = range(r["losses"].shape[0])
                band(axes[0][col], steps, r["losses"].T, label, log=True)
                band(axes[1][col], r["checkpoints"], r["logvar"].T, label)
            axes[0][col].set_yscale("log")
            axes[0][col].set_title(f"problem {problem}, d = {d}: training loss")
            axes[1][col].set_title("log10 variance of the gradient")
            axes[1][col].set_xlabel("step (Adam, lr 1e-3)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out / f"toy_closed_form{'_quick' if args.quick else ''}_problem{problem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--dims", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--steps", type=int, default=2000, help="Adam steps (default 2000)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (the paper's 1e-3)")
    p.add_argument("--seeds", type=int, default=5, help="independent runs per estimator (default 5)")
    p.add_argument("--samples", type=int, default=10, help="samples per gradient estimate (default 10)")
    p.add_argument("--checkpoints", type=int, default=10, help="variance checkpoints besides step 0 (default 10)")
    p.add_argument("--var-reps", type=int, default=100, help="estimates per variance checkpoint (default 100)")
    p.add_argument("--chunk", type=int, default=0, help="replicates per backward pass in variance checkpoints (0: all)")
    p.add_argument("--order2", type=int, default=8, help="truncation order of the plain GSB on problem 2 (default 8)")
    p.add_argument("--estimators", default="", help="comma-separated substrings of estimator labels to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="smoke run: d = 1, 10; 60 steps; 2 runs; 20 estimates")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.dims, args.steps, args.seeds = [1, 10], 60, 2
        args.checkpoints, args.var_reps = 2, 20
    torch.set_num_threads(args.threads)
    wanted = [s.strip().lower() for s in args.estimators.split(",") if s.strip()]
    text = [
        (f"GSB toy problems (Echraibi et al. 2020, sec. 6.1): z ~ Gamma(k = e^a, scale mu = e^b), a = b = 0 at start, "
        f"eps = {EPS}; Adam lr {args.lr}, {args.steps} steps, {args.samples} samples per estimate, "
        f"{args.seeds} runs (mean ± sd); log10 Var = variance of one estimate per coordinate of (a, b), averaged "
        f"over coordinates and over {len(range(args.checkpoints + 1))} checkpoints, {args.var_reps} estimates each; "
        f"max|z| = largest |mean - exact|/se against the exact gradient (unbiased: ~4-5).")
    ]
    print(text[0], flush=True)
    all_results: dict[int, dict[int, dict[str, Any]]] = {}
    data: dict[str, Any] = {"env": environment(), "args": {k: str(v) for k, v in vars(args).items()}, "tables": {}}
    t_start = time.perf_counter()
    for problem in args.problems:
        name = PROBLEMS[problem][0]
        for d in args.dims:
            results = {}
            for i, (label, make) in enumerate(estimators(problem, args.order2)):
                if wanted and not any(w in label.lower() for w in wanted):
                    continue
                results[label] = train(problem, d, make, args, args.seed + 1000 * problem + 10 * d + i)
            all_results.setdefault(problem, {})[d] = results
            table = format_table(header(args.steps, args.seeds), summary_rows(results, args.steps))
            block = f"\nProblem {problem}: {name}, d = {d}\n{table}"
            print(block, flush=True)
            text.append(block)
            data["tables"][f"problem{problem}_d{d}"] = {
                label: {
                    "loss_mean": r["losses"].mean(1).tolist()[:: max(1, args.steps // 200)],
                    "loss_sd": r["losses"].std(1).tolist()[:: max(1, args.steps // 200)] if args.seeds > 1 else None,
                    "loss_final": r["losses"][-1].tolist(),
                    "checkpoints": r["checkpoints"],
                    "log10_var": r["logvar"].tolist(),
                    "max_abs_z": r["max_abs_z"],
                    "ms_per_step": r["ms_per_step"],
                    "final_params_mean_over_d": r["final_params"],
                }
                for label, r in results.items()
            }
    elapsed = time.perf_counter() - t_start
    text.append(f"\n(total {elapsed:.0f} s)")
    print(text[-1])
    stem = "toy_closed_form_quick" if args.quick else "toy_closed_form"
    files = write_results(args.out, stem, "\n".join(text), data)
    files += plot(all_results, args, args.out)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
