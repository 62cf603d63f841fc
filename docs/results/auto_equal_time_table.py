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

MODELS = ("sbn-linear", "sbn-two-layer", "sbn-categorical", "bernoulli-vae", "categorical-vae")


def biased(estimator: str) -> bool:
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


def tables(fixed_runs, auto_runs) -> str:
    lines = []
    for model in MODELS:
        runs = {**fixed_runs.get(model, {}), **({"auto": auto_runs[model]["auto"]} if "auto" in auto_runs.get(model, {}) else {})}
        if not runs:
            continue
        lines += [f"### {model}", "",
                  "| estimator | seeds | test −ELBO | test −log p(x) | steps | CPU s |",
                  "|---|---|---|---|---|---|"]
        order = sorted(runs, key=lambda e: statistics.fmean(s["test_nelbo"] for s in runs[e]))
        for e in order:
            ss = runs[e]
            name = "**auto**" if e == "auto" else ss[0]["label"] + (" (biased)" if biased(e) else "")
            steps = statistics.fmean(s["steps"] for s in ss)
            cpu = statistics.fmean(s["train_cpu_seconds"] for s in ss)
            lines.append(f"| {name} | {len(ss)} | {cell([s['test_nelbo'] for s in ss])} | "
                         f"{cell([s['test_nll'] for s in ss])} | {steps:.0f} | {cpu:.1f} |")
        lines.append("")
        if "auto" in runs:
            lines += [f"Auto's candidate at the end, per seed: {auto_choice(runs['auto'])}.", ""]
        if "auto" in runs and len(runs) > 1:
            for metric, title in (("test_nelbo", "test −ELBO"), ("test_nll", "test −log p(x)")):
                auto = [s[metric] for s in runs["auto"]]
                every = {e: [s[metric] for s in ss] for e, ss in runs.items() if e != "auto"}
                unbiased = {e: v for e, v in every.items() if not biased(e)}
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
        ax.errorbar([stats[e][0] for e in order], ys, xerr=[stats[e][1] for e in order], fmt="none",
                    ecolor=colors, capsize=2)
        ax.scatter([stats[e][0] for e in order], ys, c=colors, zorder=3, s=18)
        fixed = [stats[e][0] for e in order if e != "auto"]
        if fixed:
            ax.axvline(statistics.median(fixed), color="k", ls="--", lw=0.8, label="median of the fixed estimators")
        ax.set_yticks(list(ys), [e + (" (biased)" if e != "auto" and biased(e) else "") for e in order],
                     fontsize=8)
        ax.set(title=f"{model} on digits, 10 CPU seconds", xlabel="test −ELBO (nats, mean ± sd over 3 seeds)")
        ax.legend(fontsize=8, loc="lower right")
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path)
    p.add_argument("figure", type=Path, nargs="?")
    p.add_argument("--auto", type=Path, default=None, help="Auto's runs from this folder instead")
    args = p.parse_args()
    fixed_runs = load(args.root, lambda e: e != "auto")
    auto_runs = load(args.auto or args.root, lambda e: e == "auto")
    print(tables(fixed_runs, auto_runs))
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
