"""storch.method.Auto against every fixed estimator of the catalog at equal CPU seconds of training.

Every model of storch-bench on the 8x8 digits, every estimator that applies to the model's latents and
to the ELBO at a budget of 4 cost evaluations per datum and step, 3 seeds, each run trained for the
same CPU time (``--seconds``: the training steps' CPU time, evaluations excluded; one thread). An
estimator that cannot run on a model (another objective, more evaluations per sample than the budget,
too large a support to enumerate) is skipped with storch-bench's reason, written to ``skipped.txt``.

usage: python docs/results/auto_equal_time.py OUT [--seconds S] [--seeds 0 1 2] [--part I/N] [--only auto]

``--part I/N`` runs every N-th run from the I-th, so that N copies run side by side (one per core);
a finished run (its ``summary.json`` exists) is skipped, so a stopped copy restarts where it stopped.
The runs go to ``OUT/MODEL/``; ``auto_equal_time_table.py OUT`` prints the tables and draws the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import traceback
from pathlib import Path

from storch.bench import cli
from storch.bench.estimators import ESTIMATORS

MODELS = ("sbn-linear", "sbn-two-layer", "sbn-categorical", "bernoulli-vae", "categorical-vae")
BUDGET = 4
#: every run: the digits, batch 50, Adam 1e-3, one thread, ten evaluations (each tenth of the seconds) on
#: the whole test and validation sets (250 digits each) and 250 training digits; -log p(x) with 200 samples
COMMON = ["--data", "digits", "--budget", str(BUDGET), "--batch-size", "50", "--lr", "1e-3", "--threads", "1",
          "--eval-size", "250", "--eval-k", "200", "--no-var", "--no-progress", "--overwrite"]


def run_dir(out: Path, model: str, estimator: str, seed: int) -> Path:
    """The folder storch-bench gives the run (see ``storch.bench.cli``)."""
    return out / model / f"{model}_digits_{estimator}_budget={BUDGET}_seed{seed}"


def jobs(seeds, only, models=MODELS) -> list[tuple[str, str, int]]:
    """Seed by seed and model by model, Auto and then every fixed estimator: the runs of one model and
    seed are made together, so that a change of the machine's load touches them alike."""
    order = ["auto"] + [e for e in ESTIMATORS if e != "auto"]
    every = [(m, e, s) for s in seeds for m in models for e in order]
    return [j for j in every if not only or j[1] in only]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--part", default="0/1", help="I/N: every N-th run, from the I-th")
    p.add_argument("--only", nargs="+", default=None, help="these estimators only")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="these models only")
    args = p.parse_args(argv)
    part, parts = (int(x) for x in args.part.split("/"))
    todo = jobs(args.seeds, args.only, args.models)[part::parts]
    for model, est, seed in todo:
        folder = run_dir(args.out, model, est, seed)
        if (folder / "summary.json").is_file():
            continue
        argv = COMMON + ["--model", model, "--estimator", est, "--seed", str(seed), "--seconds", str(args.seconds),
                         "--out", str(args.out / model)]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = cli.main(argv)
        except (Exception, SystemExit):  # noqa: BLE001  (a run that fails is reported; the others go on)
            code, reason = 1, traceback.format_exc().strip().splitlines()[-1]
        else:
            reason = err.getvalue().strip().replace("\n", " ")
        if code == 0:
            print(f"done {model} {est} seed {seed}", flush=True)
        else:
            with open(args.out / ("skipped.txt" if code == 2 else "failed.txt"), "a") as f:
                f.write(f"{model}\t{est}\tseed {seed}\t{reason}\n")
            print(f"{'skip' if code == 2 else 'FAIL'} {model} {est} seed {seed}: {reason[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
