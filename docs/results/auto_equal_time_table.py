"""Tables, verdicts and figure of the equal-time comparison of storch.method.Auto (auto_equal_time.py).

usage: python docs/results/auto_equal_time_table.py RUN_ROOT [FIGURE.png] [--auto AUTO_ROOT]

Per model, one row per estimator: the test -ELBO (hard samples) and -log p(x) at the end of the
budget, mean ± standard deviation over the seeds, the steps reached (mean), and for Auto the candidate
it had settled on at the end of each seed. ``--auto AUTO_ROOT`` takes Auto's runs from another folder
(a rerun of Auto alone), the fixed estimators' from RUN_ROOT.

Verdict per model against the goal: Auto within noise of the best fixed estimator (the difference of
the means within two standard errors of that difference, sqrt(sd_a²/n_a + sd_b²/n_b)), and better
than the median of the fixed estimators' means. "Fixed" counts every estimator that ran, biased ones
included; the same verdicts against the unbiased ones alone are printed too.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
from pathlib import Path

#: the row of Auto's runs before the fixes (``--before``): shown, not counted among the fixed estimators
BEFORE = "auto, first version"
#: the row of another batch of Auto's runs (``--earlier``): shown, not counted among the fixed estimators
EARLIER = "auto, earlier batch"
#: the row of Auto's runs without its optimizer (``--no-optimizer``): shown, not counted either
NO_OPTIMIZER = "auto, optimizer not given"
#: the row of Auto's runs with every candidate re-measured in every round (``--no-recheck``)
NO_RECHECK = "auto, recheck=None"
SHOWN = (BEFORE, EARLIER, NO_OPTIMIZER, NO_RECHECK)
MODELS = ("sbn-linear", "sbn-two-layer", "sbn-categorical", "bernoulli-vae", "categorical-vae")


def biased(estimator: str) -> bool:
    if estimator in SHOWN:
        return False
    from storch.bench.estimators import ESTIMATORS

    return bool(re.search(r"(?<!un)biased", ESTIMATORS[estimator].help))


def load(root: Path, keep) -> dict[str, dict[str, list[dict]]]:
    """``model -> estimator -> [summary with its auto.json and metrics rows]``."""
    out: dict[str, dict[str, list[dict]]] = {}
    for f in sorted(Path(root).rglob("summary.json")):
        s = json.loads(f.read_text())
        if not keep(s["estimator"]):
            continue
        auto = f.parent / "auto.json"
        s["auto"] = json.loads(auto.read_text()) if auto.is_file() else None
        with open(f.parent / "metrics.csv") as fh:
            s["rows"] = list(csv.DictReader(fh))
        out.setdefault(s["model"], {}).setdefault(s["estimator"], []).append(s)
    return out


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def cell(values: list[float]) -> str:
    m, sd = mean_sd(values)
    return f"{m:.2f} ± {sd:.2f}"


def auto_choice(runs: list[dict]) -> str:
    """The candidate each seed's Auto had settled on at the end, per node (top layer first)."""
    per_seed = []
    for s in sorted(runs, key=lambda s: s["seed"]):
        nodes = s["auto"] or {}
        per_seed.append("; ".join(f"{v['settled'] or v['choice']}" + (f" ({k})" if len(nodes) > 1 else "")
                                  for k, v in nodes.items()))
    return " / ".join(per_seed)


def verdict(auto: list[float], fixed: dict[str, list[float]]) -> str:
    means = {e: statistics.fmean(v) for e, v in fixed.items()}
    best = min(means, key=means.get)
    median = statistics.median(means.values())
    a_m, a_sd = mean_sd(auto)
    b_m, b_sd = mean_sd(fixed[best])
    se = math.sqrt(a_sd**2 / len(auto) + b_sd**2 / len(fixed[best]))
    near = a_m - b_m <= 2 * se
    rank = 1 + sum(m < a_m for m in means.values())
    return (f"best fixed {best} {b_m:.2f}, Auto {a_m:.2f} (difference {a_m - b_m:+.2f}, two standard errors "
            f"{2 * se:.2f}: {'within noise' if near else 'NOT within noise'}); median of {len(means)} fixed "
            f"{median:.2f}: Auto {'better' if a_m < median else 'NOT better'}; Auto ranks {rank} of "
            f"{len(means) + 1}")


def judge(auto: list[float], fixed: dict[str, list[float]]) -> dict:
    """Auto against the fixed estimators: the best one, the median of their means, and the verdicts."""
    means = {e: statistics.fmean(v) for e, v in fixed.items()}
    best = min(means, key=means.get)
    a_m, a_sd = mean_sd(auto)
    b_sd = mean_sd(fixed[best])[1]
    se = math.sqrt(a_sd**2 / len(auto) + b_sd**2 / len(fixed[best]))
    median = statistics.median(means.values())
    return {"best": best, "best_mean": means[best], "auto": a_m, "two_se": 2 * se, "median": median,
            "near": a_m - means[best] <= 2 * se, "better": a_m < median,
            "rank": 1 + sum(m < a_m for m in means.values()), "of": len(means) + 1}


def summary(fixed_runs, auto_runs) -> str:
    """One row per model and metric: Auto against the best and the median fixed estimator, among all
    of them and among the unbiased ones."""
    lines = ["| model | metric | fixed | best fixed | median fixed | Auto | Auto − best (2 s.e.) | within noise | "
             "better than median | Auto's rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        fixed, auto = fixed_runs.get(model, {}), auto_runs.get(model, {}).get("auto")
        if not fixed or not auto:
            continue
        for metric, title in (("test_nelbo", "−ELBO"), ("test_nll", "−log p(x)")):
            for which, keep in (("all", lambda e: True), ("unbiased", lambda e: not biased(e))):
                chosen = {e: [s[metric] for s in ss] for e, ss in fixed.items() if keep(e)}
                j = judge([s[metric] for s in auto], chosen)
                seeds = min(len(v) for v in chosen.values())
                lines.append(
                    f"| {model} | {title} | {which} ({len(chosen)}) | {j['best']} {j['best_mean']:.2f} | "
                    f"{j['median']:.2f} | {j['auto']:.2f} | {j['auto'] - j['best_mean']:+.2f} ({j['two_se']:.2f}) | "
                    f"{'yes' if j['near'] else '**no**'} | {'yes' if j['better'] else '**no**'} | "
                    f"{j['rank']} of {j['of']}{'' if seeds >= 3 else f' ({seeds} seed(s) of some fixed)'} |")
    return "\n".join(lines)


UNDECIDED = 0.05
"""Nats between the best and the median fixed estimator below which a model does not decide anything
(on the VAEs every estimator stays at the solution that ignores the latent code)."""


def compact(fixed_runs, auto_runs) -> str:
    """The guide's table: per model, test -ELBO of the best and the median fixed estimator (all of them),
    Auto's, the two verdicts, and the candidate Auto had settled on in most seeds."""
    lines = ["| model | best fixed | median fixed | Auto | within noise of the best | better than the median | "
             "Auto's choice |", "|---|---|---|---|---|---|---|"]
    for model in MODELS:
        fixed, auto = fixed_runs.get(model, {}), auto_runs.get(model, {}).get("auto")
        if not fixed or not auto:
            continue
        j = judge([s["test_nelbo"] for s in auto], {e: [s["test_nelbo"] for s in ss] for e, ss in fixed.items()})
        best = fixed[j["best"]][0]["label"]
        choices = [next(iter((s["auto"] or {}).values()), {}).get("settled") for s in auto]
        top = max(set(choices), key=choices.count)
        if j["median"] - j["best_mean"] < UNDECIDED:  # the estimators did not tell apart: nothing to be near
            near, better = "not decided: every run at the collapsed solution", "not decided"
        else:
            near = f"{'yes' if j['near'] else 'no'} ({j['auto'] - j['best_mean']:+.2f})"
            better = "yes" if j["better"] else "no"
        lines.append(f"| `{model}` | {best} {j['best_mean']:.2f} | {j['median']:.2f} | "
                     f"{cell([s['test_nelbo'] for s in auto])} | {near} | {better} | "
                     f"{top} ({choices.count(top)} of {len(choices)}) |")
    return "\n".join(lines)


def tables(fixed_runs, auto_runs, before_runs=None, earlier_runs=None, no_optimizer_runs=None,
           before_label=BEFORE) -> str:
    lines = []
    for model in MODELS:
        runs = {**fixed_runs.get(model, {}), **({"auto": auto_runs[model]["auto"]} if "auto" in auto_runs.get(model, {}) else {})}
        if before_runs and "auto" in before_runs.get(model, {}):
            runs[before_label] = before_runs[model]["auto"]
        if earlier_runs and "auto" in earlier_runs.get(model, {}):
            runs[EARLIER] = earlier_runs[model]["auto"]
        if no_optimizer_runs and "auto" in no_optimizer_runs.get(model, {}):
            runs[NO_OPTIMIZER] = no_optimizer_runs[model]["auto"]
        if not runs:
            continue
        lines += [f"### {model}", "",
                  "| estimator | seeds | test −ELBO | test −log p(x) | steps | CPU s |",
                  "|---|---|---|---|---|---|"]
        order = sorted(runs, key=lambda e: statistics.fmean(s["test_nelbo"] for s in runs[e]))
        for e in order:
            ss = runs[e]
            name = ("**auto**" if e == "auto" else e if e in SHOWN
                    else ss[0]["label"] + (" (biased)" if biased(e) else ""))
            steps = statistics.fmean(s["steps"] for s in ss)
            cpu = statistics.fmean(s["train_cpu_seconds"] for s in ss)
            lines.append(f"| {name} | {len(ss)} | {cell([s['test_nelbo'] for s in ss])} | "
                         f"{cell([s['test_nll'] for s in ss])} | {steps:.0f} | {cpu:.1f} |")
        lines.append("")
        if "auto" in runs:
            lines += [f"Auto's candidate at the end, per seed: {auto_choice(runs['auto'])}.", ""]
        if EARLIER in runs:
            lines += [f"Earlier batch: {auto_choice(runs[EARLIER])}.", ""]
        if NO_OPTIMIZER in runs:
            lines += [f"Optimizer not given: {auto_choice(runs[NO_OPTIMIZER])}.", ""]
        if "auto" in runs and len(runs) > 1:
            for metric, title in (("test_nelbo", "test −ELBO"), ("test_nll", "test −log p(x)")):
                auto = [s[metric] for s in runs["auto"]]
                every = {e: [s[metric] for s in ss] for e, ss in runs.items() if e not in ("auto", *SHOWN)}
                unbiased = {e: v for e, v in every.items() if not biased(e)}
                if not every:
                    continue
                lines.append(f"- {title}, all fixed: {verdict(auto, every)}")
                if unbiased and len(unbiased) < len(every):
                    lines.append(f"- {title}, unbiased fixed only: {verdict(auto, unbiased)}")
            lines.append("")
    return "\n".join(lines)


def figure(fixed_runs, auto_runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if m in fixed_runs or m in auto_runs]
    rows = math.ceil(len(models) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 5.2 * rows))
    for ax, model in zip(axes.flat, models):
        runs = {**fixed_runs.get(model, {}), **auto_runs.get(model, {})}
        stats = {e: mean_sd([s["test_nelbo"] for s in ss]) for e, ss in runs.items()}
        order = sorted(stats, key=lambda e: stats[e][0], reverse=True)
        ys = range(len(order))
        colors = ["tab:red" if e == "auto" else ("tab:gray" if biased(e) else "tab:blue") for e in order]
        for y, e, color in zip(ys, order, colors):
            ax.errorbar([stats[e][0]], [y], xerr=[stats[e][1]], fmt="o", ms=4, color=color, capsize=2)
        lo = min(m - sd for m, sd in stats.values())
        hi = max(m + sd for m, sd in stats.values())
        ax.set_xlim(lo - 0.05 * (hi - lo) - 0.01, hi + 0.05 * (hi - lo) + 0.01)
        ax.set_ylim(-0.7, len(order) - 0.3)
        fixed = [stats[e][0] for e in order if e != "auto"]
        if fixed:
            ax.axvline(statistics.median(fixed), color="k", ls="--", lw=0.8, label="median of the fixed estimators")
        ax.set_yticks(list(ys), [e + (" (biased)" if e != "auto" and biased(e) else "") for e in order],
                     fontsize=8)
        budget = next(iter(runs.values()))[0]["seconds_budget"]
        ax.set(title=f"{model} on digits, {budget:g} CPU seconds of training",
               xlabel="test −ELBO (nats, mean ± sd over the seeds)")
        if fixed:
            ax.legend(fontsize=8, loc="upper right")
    spare = list(axes.flat)[len(models):]
    if spare:
        curves_panel(spare[0], fixed_runs, auto_runs)
    for ax in spare[1:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def mean_curve(runs: list[dict]) -> tuple[list[float], list[float]]:
    """The seeds' mean CPU seconds and test -ELBO at each evaluation (each tenth of the budget)."""
    n = min(len(s["rows"]) for s in runs)
    xs = [statistics.fmean(float(s["rows"][i]["cpu_seconds"]) for s in runs) for i in range(n)]
    ys = [statistics.fmean(float(s["rows"][i]["test_nelbo"]) for s in runs) for i in range(n)]
    return xs, ys


def curves_panel(ax, fixed_runs, auto_runs) -> None:
    """Test -ELBO against CPU seconds on the model where Auto ends farthest behind the best fixed
    estimator: Auto, the best and the median fixed estimator."""
    gaps = {}
    for model in MODELS:
        fixed, auto = fixed_runs.get(model, {}), auto_runs.get(model, {}).get("auto")
        if fixed and auto:
            means = {e: statistics.fmean(s["test_nelbo"] for s in ss) for e, ss in fixed.items()}
            gaps[model] = statistics.fmean(s["test_nelbo"] for s in auto) - min(means.values())
    if not gaps:
        ax.axis("off")
        return
    model = max(gaps, key=gaps.get)
    fixed = fixed_runs[model]
    order = sorted(fixed, key=lambda e: statistics.fmean(s["test_nelbo"] for s in fixed[e]))
    shown = [("auto", auto_runs[model]["auto"], "tab:red"), (f"{order[0]} (best fixed)", fixed[order[0]], "tab:blue"),
             (f"{order[len(order) // 2]} (median rank)", fixed[order[len(order) // 2]], "tab:gray")]
    for name, runs, color in shown:
        xs, ys = mean_curve(runs)
        ax.plot(xs[1:], ys[1:], marker=".", color=color, label=name)
    ax.set(title=f"{model}: over training (mean of the seeds)", xlabel="CPU seconds of training",
           ylabel="test −ELBO (nats)")
    ax.legend(fontsize=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path)
    p.add_argument("figure", type=Path, nargs="?")
    p.add_argument("--auto", type=Path, default=None, help="Auto's runs from this folder instead")
    p.add_argument("--earlier", type=Path, default=None,
                   help=f"another batch of Auto's runs, as the row '{EARLIER}'")
    p.add_argument("--no-optimizer", type=Path, default=None,
                   help=f"Auto's runs made without giving it the optimizer, as the row '{NO_OPTIMIZER}'")
    p.add_argument("--before", action="store_true",
                   help=f"with --auto: also RUN_ROOT's own Auto runs, as the row '{BEFORE}'")
    p.add_argument("--before-is-no-recheck", action="store_true",
                   help=f"with --before: RUN_ROOT's own Auto runs are Auto(recheck=None), the row '{NO_RECHECK}'")
    args = p.parse_args()
    fixed_runs = load(args.root, lambda e: e != "auto")
    auto_runs = load(args.auto or args.root, lambda e: e == "auto")
    before = load(args.root, lambda e: e == "auto") if args.before else None
    print(compact(fixed_runs, auto_runs))
    print()
    print(summary(fixed_runs, auto_runs))
    print()
    earlier = load(args.earlier, lambda e: e == "auto") if args.earlier else None
    no_optimizer = load(args.no_optimizer, lambda e: e == "auto") if args.no_optimizer else None
    print(tables(fixed_runs, auto_runs, before, earlier, no_optimizer,
                 NO_RECHECK if args.before_is_no_recheck else BEFORE))
    skipped = Path(args.root) / "skipped.txt"
    if skipped.is_file():
        reasons = {}
        for line in skipped.read_text().splitlines():
            model, est, _, why = line.split("\t")
            reasons[(model, est)] = re.sub(r"^storch-bench: ", "", why)
        print("Skipped (the reason storch-bench gives):")
        for (model, est), why in sorted(reasons.items()):
            print(f"- {model}, {est}: {why[:150]}")
    if args.figure:
        figure(fixed_runs, auto_runs, args.figure)
        print(f"\nfigure: {args.figure}")


if __name__ == "__main__":
    main()
