"""ms/step and peak memory of local expectation against its competitors on the GSB paper's five models.

Each configuration is a short ``storch-bench`` run in its own process (binarized MNIST, batch 50,
``--no-var``, a small evaluation), so that its peak resident memory is its own; the table reports
``storch-bench``'s ms/step (training time only) and peak MiB, with one and with two torch threads.

Usage (from the repository root)::

    .venv/bin/python benchmarks/local_expectation_cost.py               # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/local_expectation_cost.py --steps 5 --models sbn-linear   # smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: model -> the competitors the GSB paper compares local expectation (BSB / CSB) with
COMPETITORS = {
    "sbn-linear": ("rebar", "relax", "disarm"),
    "sbn-two-layer": ("rebar", "relax"),
    "bernoulli-vae": ("rebar", "relax"),
    "categorical-vae": ("gumbel-softmax",),
    "sbn-categorical": ("gumbel-softmax",),
}


def measure(model: str, estimator: str, threads: int, steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "storch.bench", "--model", model, "--estimator", estimator, "--data",
           "binarized-mnist", "--steps", str(steps), "--eval-every", str(steps), "--eval-size", "100",
           "--eval-k", "2", "--no-var", "--threads", str(threads), "--no-progress", "--out", str(out),
           "--overwrite"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    (summary,) = out.rglob(f"{model}_*_{estimator}_seed0/summary.json")
    return json.loads(summary.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="training steps per configuration")
    p.add_argument("--models", nargs="+", choices=list(COMPETITORS), default=list(COMPETITORS))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = p.parse_args(argv)
    print(f"storch-bench, binarized MNIST, batch 50, {args.steps} steps per configuration (training time only)")
    head = f"{'model':<16} {'estimator':<18} {'evals/image':>11}"
    for t in args.threads:
        head += f" {f'ms/step ({t} thr)':>17} {f'peak MiB ({t} thr)':>18}"
    print(head + f" {'LE / competitor (1 thr)':>24}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            rows = {}
            for estimator in ("local-expectation",) + COMPETITORS[model]:
                rows[estimator] = [measure(model, estimator, t, args.steps, Path(tmp)) for t in args.threads]
            le = rows["local-expectation"][0]["ms_per_step"]
            for estimator, results in rows.items():
                line = f"{model:<16} {estimator:<18} {results[0]['evals_per_datum']:>11}"
                for r in results:
                    line += f" {r['ms_per_step']:>17.1f} {r['peak_memory_mb']:>18.0f}"
                ratio = "" if estimator == "local-expectation" else f"{le / results[0]['ms_per_step']:.1f}x"
                print(line + f" {ratio:>24}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
