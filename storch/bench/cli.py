"""Command line of ``storch-bench`` (also ``python -m storch.bench``).

    storch-bench [options]              train (one run per --seed) and print a table
    storch-bench list                   models, data sets and estimators
    storch-bench compare RUN_DIR ...    mean ± std over seeds, grouped by (model, data, estimator)

Data parallel on N processes (gloo on the CPU, NCCL with ``--device cuda``; rank 0 prints and
writes the run folder)::

    torchrun --standalone --nproc-per-node N -m storch.bench --distributed [options]
    torchrun --standalone --nproc-per-node N -m storch.bench --distributed --device cuda [options]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from storch.bench.data import DATASETS
from storch.bench.estimators import ESTIMATORS, NOT_INCLUDED, BudgetError
from storch.bench.models import MODELS

__all__ = ["main", "build_parser", "catalog_text", "compare_table"]


def catalog_text() -> str:
    lines = ["models:"]
    lines += [f"  {k:<18} {v}" for k, v in MODELS.items()]
    lines += ["data sets:"]
    lines += [f"  {k:<18} {v}" for k, v in DATASETS.items()]
    lines += ["estimators (latents; objectives; cost evaluations per sample):"]
    for e in ESTIMATORS.values():
        special = {"expect": "K^D", "local-expectation": "1+D*(K-1)", "mvd": "1+D*(K-1)"}
        evals = special.get(e.name) or str(e.evals(None))
        lines.append(f"  {e.name:<18} {'/'.join(e.kinds)}; {'/'.join(e.objectives)}; {evals}: {e.help}")
    lines += ["not included:"]
    lines += [f"  {k}: {v}" for k, v in NOT_INCLUDED.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="storch-bench",
        description="Train discrete-latent models on real data with storch's gradient estimators "
                    "(subcommands: `list`, `compare RUN_DIR...`).",
        epilog=catalog_text() + "\n\nexample: storch-bench --model sbn-linear --estimator disarm --steps 500 "
                                "--seed 0 1 2 --out runs/quick",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--model", default="sbn-linear", choices=list(MODELS))
    a("--data", default="digits", choices=list(DATASETS))
    a("--data-dir", default=None, help="folder with the data files (default ../shared/data next to the repository)")
    a("--estimator", default="score-function", choices=list(ESTIMATORS))
    a("--objective", default="elbo", choices=["elbo", "iwae"], help="training bound (iwae: K = --k samples)")
    a("--k", type=int, default=None, help="samples in the iwae bound (= --n-samples)")
    a("--n-samples", type=int, default=None, help="samples (pairs, groups) per datum (default: the minimum)")
    a("--budget", type=int, default=None, help="cost evaluations per datum and step; sets n for each estimator")
    a("--baseline", default=None, choices=["none", "moving_average", "batch_average"], help="score-function")
    a("--temperature", type=float, default=None, help="relaxations (default 1.0)")
    a("--spsa-c", type=float, default=None, help="SPSA perturbation size (default 0.1)")
    a("--latent-dim", type=int, default=None, help="latent variables (default 200; categorical models 20)")
    a("--categories", type=int, default=None, help="categories of the categorical models (default 10)")
    a("--batch-size", type=int, default=50)
    a("--lr", type=float, default=1e-3)
    a("--steps", type=int, default=None, help="training steps (default 1000)")
    a("--seed", type=int, nargs="+", default=[0], help="one run per seed")
    a("--eval-every", type=int, default=None, help="steps between evaluations (default steps/10)")
    a("--eval-size", type=int, default=1000, help="data per split used for evaluation")
    a("--eval-k", type=int, default=200, help="samples of the final test bound -log p(x)")
    a("--var-every", type=int, default=None, help="steps between gradient-variance probes (default: at evaluations)")
    a("--var-reps", type=int, default=20, help="gradient estimates per variance probe")
    a("--no-var", action="store_true", help="no gradient-variance probes")
    a("--checkpoint-every", type=int, default=None)
    a("--resume", default=None, metavar="RUN_DIR", help="continue a run from its checkpoint (--steps: new total)")
    a("--out", default="runs", help="output folder: one sub-folder per run")
    a("--overwrite", action="store_true", help="replace existing run folders")
    a("--threads", type=int, default=None, help="torch.set_num_threads")
    a("--device", default="cpu", help="where the model trains: cpu (default) or cuda / cuda:N (data are "
                                      "prepared on the CPU); with --distributed, cuda means each rank's "
                                      "LOCAL_RANK GPU and NCCL")
    a("--no-progress", action="store_true", help="no tqdm progress bar")
    a("--compile-step", action="store_true",
      help="train with storch.compile_step: the step is traced once and replayed as a graph of torch "
           "operations (no storch Python per step; estimators that keep state between steps are refused)")
    a("--distributed", action="store_true",
      help="data parallel: join the process group that torchrun sets up (gloo), wrap the model in DDP, give "
           "each rank its slice of every minibatch; start with `torchrun --standalone --nproc-per-node N "
           "-m storch.bench --distributed ...` (--batch-size: the whole minibatch, a multiple of N; gloo on "
           "the CPU, NCCL with --device cuda)")
    return p


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", text).strip("_")


def _fmt(v, width=9, prec=2) -> str:
    if v is None or v == "":
        return f"{'-':>{width}}"
    return f"{v:{width}.{prec}f}"


SUMMARY_COLUMNS = [("test_nelbo", "test -ELBO"), ("test_nll", "test -log p(x)"), ("valid_nelbo", "valid -ELBO"),
                   ("train_nelbo", "train -ELBO"), ("grad_logvar", "grad log-var"), ("ms_per_step", "ms/step"),
                   ("peak_memory_mb", "peak MiB")]


def run_table(summaries: Sequence[Dict]) -> str:
    head = f"{'model':<15} {'data':<15} {'estimator':<44} {'seed':>4} {'evals':>5} " + " ".join(
        f"{t:>14}" for _, t in SUMMARY_COLUMNS)
    lines = [head, "-" * len(head)]
    for s in summaries:
        lines.append(f"{s['model']:<15} {s['data']:<15} {s['label']:<44} {s['seed']:>4} {s['evals_per_datum']:>5} "
                     + " ".join(_fmt(s.get(k), 14, 0 if k == "peak_memory_mb" else 2) for k, _ in SUMMARY_COLUMNS))
    return "\n".join(lines)


def _find_summaries(paths: Sequence[str]) -> List[Dict]:
    out = []
    for p in paths:
        p = Path(p)
        files = [p / "summary.json"] if (p / "summary.json").is_file() else sorted(p.rglob("summary.json"))
        if not files:
            print(f"(no summary.json under {p})", file=sys.stderr)
        for f in files:
            with open(f) as fh:
                out.append(json.load(fh))
    return out


def compare_table(summaries: Sequence[Dict]) -> str:
    groups: Dict[tuple, List[Dict]] = {}
    for s in summaries:
        groups.setdefault((s["model"], s["data"], s["label"]), []).append(s)
    head = f"{'model':<15} {'data':<15} {'estimator':<44} {'seeds':>5} " + " ".join(
        f"{t:>17}" for _, t in SUMMARY_COLUMNS)
    lines = [head, "-" * len(head)]
    for (model, data, label), ss in sorted(groups.items()):
        cells = []
        for k, _ in SUMMARY_COLUMNS:
            vals = [s[k] for s in ss if s.get(k) is not None and math.isfinite(s[k])]
            if not vals:
                cells.append(f"{'-':>17}")
                continue
            m = statistics.fmean(vals)
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{m:9.2f} ± {sd:5.2f}")
        lines.append(f"{model:<15} {data:<15} {label:<44} {len(ss):>5} " + " ".join(cells))
    return "\n".join(lines)


def _config(args) -> Dict:
    n = args.n_samples
    if args.k is not None:
        if n is not None and n != args.k:
            raise SystemExit("storch-bench: --k and --n-samples disagree")
        n = args.k
    return dict(
        model=args.model, data=args.data, data_dir=args.data_dir, estimator=args.estimator, objective=args.objective,
        n_samples=n, budget=args.budget, baseline=args.baseline, temperature=args.temperature, spsa_c=args.spsa_c,
        latent_dim=args.latent_dim, categories=args.categories, batch_size=args.batch_size, lr=args.lr,
        steps=args.steps if args.steps is not None else 1000, eval_every=args.eval_every, eval_size=args.eval_size,
        eval_k=args.eval_k, var_reps=args.var_reps, checkpoint_every=args.checkpoint_every, threads=args.threads,
        device=args.device, compile_step=args.compile_step,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "list":
        print(catalog_text())
        return 0
    if argv and argv[0] == "compare":
        if len(argv) < 2:
            print("usage: storch-bench compare RUN_DIR [RUN_DIR ...]", file=sys.stderr)
            return 2
        summaries = _find_summaries(argv[1:])
        if not summaries:
            return 1
        print(compare_table(summaries))
        return 0
    args = build_parser().parse_args(argv)
    import torch

    from storch import distributed

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.distributed:
        return _main(args)
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    try:
        distributed.init_process_group_from_env(backend=backend)  # NCCL: sets the LOCAL_RANK GPU current
    except RuntimeError as e:
        print(f"storch-bench: --distributed: {e}", file=sys.stderr)
        return 2
    try:
        code = _main(args)
        gc.collect()  # free the DDP wrappers (their reducers hold the process group) before teardown:
        # a gloo process group destroyed under a live reducer can abort the process at exit
        torch.distributed.barrier()  # rank 0 has written its files: leave together
        return code
    finally:
        torch.distributed.destroy_process_group()


def _main(args) -> int:
    from storch import distributed
    from storch.bench import train
    from storch.exceptions import CompileStepError

    main_rank = distributed.is_main_process()
    out = print if main_rank else (lambda *a, **k: None)  # rank 0 alone prints
    progress = not args.no_progress
    if args.resume:
        try:
            summary = train.resume(args.resume, steps=args.steps, progress=progress)
        except (ValueError, FileNotFoundError, CompileStepError) as e:
            out(f"storch-bench: {e}", file=sys.stderr)
            return 2
        if main_rank:
            out(run_table([summary]))
            out(f"\nrun folder: {args.resume}")
        return 0
    cfg = _config(args)
    est = ESTIMATORS[args.estimator]
    for opt in ("baseline", "temperature", "spsa_c"):
        if cfg.get(opt) is not None and opt not in est.options:
            out(f"storch-bench: --{opt.replace('_', '-')} does not apply to {est.name}", file=sys.stderr)
            return 2
    summaries, dirs = [], []
    for seed in args.seed:
        c = dict(cfg, seed=seed)
        eval_every = c["eval_every"] or max(1, c["steps"] // 10)
        c["var_every"] = None if args.no_var else (args.var_every or eval_every)
        parts = [args.model, args.data, args.estimator]
        if args.objective == "iwae":
            parts.append("iwae")
        for key in ("budget", "n_samples", "baseline", "temperature", "spsa_c", "latent_dim", "categories"):
            if c.get(key) is not None:
                parts.append(f"{key}={c[key]}")
        if args.device != "cpu":  # a GPU run does not overwrite the CPU run of the same settings
            parts.append(args.device)
        if args.compile_step:
            parts.append("compiled")
        parts.append(f"seed{seed}")
        run_dir = Path(args.out) / _slug("_".join(parts))
        try:
            summaries.append(train.run(c, run_dir, progress=progress, overwrite=args.overwrite))
        except (BudgetError, ValueError, FileNotFoundError, FileExistsError, CompileStepError) as e:
            out(f"storch-bench: {e}", file=sys.stderr)
            return 2
        dirs.append(run_dir)
    if not main_rank:
        return 0
    out(run_table(summaries))
    out("\nrun folders: " + " ".join(str(d) for d in dirs))
    if len(summaries) > 1:
        out()
        out(compare_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
