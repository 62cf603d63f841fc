"""Markdown table of the new estimators' comparison at equal cost evaluations (docs/results.md).

usage: python docs/results/new_estimators_table.py RUN_ROOT   (runs of docs/results/new_estimators.sh)

One row per (model, evaluations per image, estimator), mean ± std over the seeds that finished
(the value alone for one seed): test −ELBO and −log p(x) (K = 100, 1000 random test images), the
gradient log-variance at the last probe, and ms/step (median; runs shared two busy cores, so only
indicative).
"""

from __future__ import annotations

import json
import math
import statistics as st
import sys
from pathlib import Path


def cell(values: list[float], digits: int = 2) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "–"
    if len(finite) == 1:
        return f"{finite[0]:.{digits}f}"
    return f"{st.fmean(finite):.{digits}f} ± {st.stdev(finite):.{digits}f}"


def main(argv: list[str]) -> int:
    groups: dict[tuple, list[dict]] = {}
    for f in sorted(Path(argv[0]).rglob("summary.json")):
        s = json.loads(f.read_text())
        groups.setdefault((s["model"], s["evals_per_datum"], s["label"]), []).append(s)
    print("| model | evals/image | estimator | seeds | test −ELBO | test −log p(x), K = 100 | grad log-var | ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for (model, evals, label), runs in sorted(groups.items()):
        print(f"| {model} | {evals} | {label} | {len(runs)} | {cell([r['test_nelbo'] for r in runs])} | "
              f"{cell([r['test_nll'] for r in runs])} | {cell([r['grad_logvar'] for r in runs])} | "
              f"{st.median(r['ms_per_step'] for r in runs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
