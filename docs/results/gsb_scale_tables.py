"""Markdown tables for the local-expectation section of docs/results.md, from storch-bench run folders.

usage: python docs/results/gsb_scale_tables.py RUN_ROOT [RUN_ROOT ...]

Three tables, one row per (model, estimator), mean ± std over the seeds that every estimator of
the model finished:

1. equal steps: test -ELBO and test -log p(x) (K = 200) after the run's steps (on the runs' 1000-image
   test subset, and on the whole test set where ``storch-bench evaluate`` wrote ``test_eval.json``),
   the gradient log-variance of the last probe, ms/step (median over seeds);
2. equal seconds: for every competitor, its training seconds for the whole run, and local
   expectation's step and test -ELBO at the last evaluation within those seconds;
3. the gradient log-variance at each probe (the GSB paper's Figures 5-6).
"""

from __future__ import annotations

import csv
import math
import json
import statistics as st
import sys
from pathlib import Path

LE = "local-expectation"


def mean_std(values, digits=2):
    values = [v for v in values if v is not None]
    finite = [v for v in values if math.isfinite(v)]
    note = f" (−∞ in {len(values) - len(finite)})" if len(finite) < len(values) else ""  # zero variance
    if not finite:
        return "−∞" if values else "–"
    if len(finite) == 1:
        return f"{finite[0]:.{digits}f}{note}"
    return f"{st.fmean(finite):.{digits}f} ± {st.stdev(finite):.{digits}f}{note}"


def load(roots):
    runs = {}
    for root in roots:
        for f in sorted(Path(root).rglob("summary.json")):
            s = json.loads(f.read_text())
            full = f.parent / "test_eval.json"  # storch-bench evaluate: the whole test set
            s["full_test"] = json.loads(full.read_text()) if full.is_file() else None
            with open(f.parent / "metrics.csv") as fh:
                s["rows"] = [r for r in csv.DictReader(fh)]
            runs.setdefault((s["model"], s["estimator"], s["label"]), []).append(s)
    return runs


def common_seeds(runs):
    """Keep, per model, the seeds that every estimator of that model finished (a fair comparison)."""
    by_model = {}
    for (model, _, _), ss in runs.items():
        by_model.setdefault(model, []).append({s["seed"] for s in ss})
    keep = {model: set.intersection(*sets) for model, sets in by_model.items()}
    return {key: [s for s in ss if s["seed"] in keep[key[0]]] for key, ss in runs.items()}


def value(row, key):
    return float(row[key]) if row.get(key) not in (None, "") else None


def full_test(ss):
    """−log p(x) on the whole test set (``storch-bench evaluate``), when every seed has it."""
    records = [s["full_test"] for s in ss]
    if any(r is None or r.get("requested_eval_size", 0) is not None for r in records):
        return "–"  # not evaluated, or on a subset only
    return mean_std([r["test_nll"] for r in records])


def equal_steps(runs):
    print("| model | estimator | seeds | steps | evals/image | test −ELBO | test −log p(x), K = 200 | "
          "−log p(x), full test set | grad log-var (last probe) | ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (model, _, label), ss in sorted(runs.items()):
        print(f"| {model} | {label} | {len(ss)} | {ss[0]['steps']} | {ss[0]['evals_per_datum']} | "
              f"{mean_std([s['test_nelbo'] for s in ss])} | {mean_std([s['test_nll'] for s in ss])} | "
              f"{full_test(ss)} | {mean_std([s['grad_logvar'] for s in ss])} | "
              f"{st.median(s['ms_per_step'] for s in ss):.1f} |")


def at_seconds(run, seconds):
    """(step, test -ELBO) of the last evaluation of ``run`` within ``seconds`` of training."""
    best = None
    for row in run["rows"]:
        if value(row, "seconds") is not None and value(row, "seconds") <= seconds and value(row, "test_nelbo"):
            best = (int(row["step"]), value(row, "test_nelbo"))
    return best


def equal_seconds(runs):
    print("| model | competitor | its training seconds | its test −ELBO | local expectation within those "
          "seconds: step | test −ELBO |")
    print("|---|---|---|---|---|---|")
    for (model, est, label), ss in sorted(runs.items()):
        le = [r for (m, e, _), rs in runs.items() if m == model and e == LE for r in rs]
        if est == LE or not le:
            continue
        seconds = st.fmean(s["train_seconds"] for s in ss)
        points = [at_seconds(r, seconds) for r in le]
        points = [p for p in points if p is not None]
        steps = sorted({p[0] for p in points})
        print(f"| {model} | {label} | {seconds:.0f} | {mean_std([s['test_nelbo'] for s in ss])} | "
              f"{'/'.join(map(str, steps)) or '–'} | {mean_std([p[1] for p in points])} |")


def variance(runs):
    steps = sorted({int(r["step"]) for ss in runs.values() for s in ss for r in s["rows"] if r.get("grad_logvar")})
    print("| model | estimator | " + " | ".join(f"step {k}" for k in steps) + " |")
    print("|---|---|" + "---|" * len(steps))
    for (model, _, label), ss in sorted(runs.items()):
        cells = []
        for k in steps:
            vals = [value(r, "grad_logvar") for s in ss for r in s["rows"] if int(r["step"]) == k]
            cells.append(mean_std(vals))
        print(f"| {model} | {label} | " + " | ".join(cells) + " |")


def main(argv):
    runs = common_seeds(load(argv))
    print("Equal steps\n")
    equal_steps(runs)
    print("\nEqual seconds\n")
    equal_seconds(runs)
    print("\nGradient log-variance over training\n")
    variance(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
