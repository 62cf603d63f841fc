"""Markdown rows for docs/results.md from storch-bench run folders (summary.json + metrics.csv).

usage: python docs/results/tables.py RUN_ROOT [RUN_ROOT ...]
Per (model, estimator label): seeds, steps, test -ELBO and test -log p(x) (K=200) mean ± std,
test -ELBO (10 samples) at step AT (env, default 250) from metrics.csv (seeds that have it), ms/step (median over seeds), s/epoch (1000 steps).
"""
import csv
import json
import statistics as st
import os
import sys
from pathlib import Path


def ms(vals):
    return f"{st.fmean(vals):.2f} ± {st.stdev(vals) if len(vals) > 1 else 0.0:.2f}"


AT = int(os.environ.get("AT", "250"))  # the step of the same-steps column
groups = {}
for root in sys.argv[1:]:
    for f in sorted(Path(root).rglob("summary.json")):
        s = json.loads(f.read_text())
        with open(f.parent / "metrics.csv") as fh:
            rows = {int(r["step"]): r for r in csv.DictReader(fh)}
        s["at200"] = float(rows[AT]["test_nelbo"]) if AT in rows and rows[AT]["test_nelbo"] else None
        groups.setdefault((s["model"], s["label"]), []).append(s)
print(f"| model | estimator | seeds | steps | test −ELBO | test −log p(x) | test −ELBO at step {AT} | ms/step (median) | s/epoch |")
print("|---|---|---|---|---|---|---|---|---|")
for (model, label), ss in sorted(groups.items()):
    at = [s["at200"] for s in ss if s["at200"] is not None]
    msps = st.median(s["ms_per_step"] for s in ss)
    print(f"| {model} | {label} | {len(ss)} | {ss[0]['steps']} | {ms([s['test_nelbo'] for s in ss])} | "
          f"{ms([s['test_nll'] for s in ss])} | {(ms(at) + (f' ({len(at)} seeds)' if len(at) != len(ss) else '')) if at else '–'} | {msps:.1f} | {msps:.1f} |")
