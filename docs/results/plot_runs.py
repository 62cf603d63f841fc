"""Plot test -ELBO against training steps (mean +- std over seeds) from storch-bench runs' metrics.csv.

usage: [X=seconds] python docs/results/plot_runs.py OUT.png TITLE RUN_ROOT [RUN_ROOT ...]
ONLY=est1,est2: keep only these estimators. X=seconds: x axis = training seconds (train time only, one thread) instead of steps.
Y=grad_logvar: y axis = the gradient log-variance probes instead of the test -ELBO.
Runs are grouped by (model, label) read from each run's summary.json; one panel per model, two panels to a row.
"""
import csv
import json
import os
import sys
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


ONLY = [e for e in os.environ.get("ONLY", "").split(",") if e]  # estimator names to keep
XCOL = "seconds" if os.environ.get("X") == "seconds" else "step"
YCOL = "grad_logvar" if os.environ.get("Y") == "grad_logvar" else "test_nelbo"


def load(roots):
    groups = {}
    for root in roots:
        for s in sorted(Path(root).rglob("summary.json")):
            summ = json.loads(s.read_text())
            if ONLY and summ["estimator"] not in ONLY:
                continue
            with open(s.parent / "metrics.csv") as fh:
                # a gradient variance of exactly zero has log −inf: not a point on the plot
                rows = [r for r in csv.DictReader(fh) if r[YCOL] and np.isfinite(float(r[YCOL]))]
            steps = np.array([float(r[XCOL]) for r in rows])
            vals = np.array([float(r[YCOL]) for r in rows])
            groups.setdefault(summ["model"], {}).setdefault(summ["label"], []).append((steps, vals))
    return groups


def main():
    out, title, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
    groups = load(roots)
    cols = min(2, len(groups))  # panels two to a row, so that the page shows them large enough
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows + 0.2), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    all_labels = sorted({label for labels in groups.values() for label in labels})
    colors = {label: f"C{i}" for i, label in enumerate(all_labels)}  # one colour per estimator in all panels
    for ax, (model, labels) in zip(axes.flat, sorted(groups.items())):
        for label, runs in sorted(labels.items()):
            # runs evaluated at different steps (e.g. every 200 vs every 250): interpolate onto the union
            steps = np.unique(np.concatenate([r[0] for r in runs]))
            steps = steps[steps <= min(r[0].max() for r in runs)]
            n = len(steps)
            v = np.stack([np.interp(steps, r[0], r[1]) for r in runs])
            m, sd = v.mean(0), v.std(0, ddof=1) if len(runs) > 1 else np.zeros(n)
            ax.plot(steps, m, marker="." if n < 8 else None, color=colors[label], label=f"{label} ({len(runs)} seeds)")
            ax.fill_between(steps, m - sd, m + sd, color=colors[label], alpha=0.25)
        ax.set_title(f"{model}, binarized MNIST")
        ax.set_xlabel("training seconds (1 thread, without evaluation)" if XCOL == "seconds" else "training step (batch 50; 1000 steps = 1 epoch)")
        if XCOL == "seconds":
            ax.set_xscale("symlog", linthresh=10)
        ax.set_ylabel("log of the summed gradient variance" if YCOL == "grad_logvar" else "test -ELBO (nats, 1000 test images)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        lo = min(min(r[1].min() for r in runs) for runs in labels.values())
        hi = max(max(r[1][1:].max() if len(r[1]) > 1 else r[1].max() for r in runs) for runs in labels.values())
        ax.set_ylim(lo - 3, min(hi + 3, lo + 80))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print("wrote", out)


if __name__ == "__main__":
    main()
