"""Command line of ``storch-bench`` (also ``python -m storch.bench``).

    storch-bench [options]              train (one run per --seed) and print a table
    storch-bench list                   models, data sets and estimators
    storch-bench compare RUN_DIR ...    mean ± std over seeds, grouped by (model, data, estimator),
                                        and a plot of the runs' test -ELBO against steps and seconds

Data parallel on N processes (gloo on the CPU, NCCL with ``--device cuda``; rank 0 prints and
writes the run folder)::

    torchrun --standalone --nproc-per-node N -m storch.bench --distributed [options]
    torchrun --standalone --nproc-per-node N -m storch.bench --distributed --device cuda [options]
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import re
import statistics
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from storch.bench.data import DATASETS
from storch.bench.estimators import ESTIMATORS, NOT_INCLUDED, BudgetError
from storch.bench.models import MODELS

__all__ = ["build_compare_parser", "build_parser", "catalog_text", "compare_plot", "compare_rows", "compare_table",
           "default_compare_dir", "main", "run_table", "write_compare_csv"]


def catalog_text() -> str:
    """The models, data sets and estimators, one entry each, wrapped at `TABLE_WIDTH` columns."""
    w = max(len(k) for k in [*MODELS, *DATASETS, *ESTIMATORS])
    special = {"expect": "K^D", "local-expectation": "1+D*(K-1)", "mvd": "1+D*(K-1)", "arsm": "1+K*(K-1)/2"}
    entries = [("models:", [(k, v) for k, v in MODELS.items()]),
               ("data sets:", [(k, v) for k, v in DATASETS.items()]),
               ("estimators (latents; objectives; cost evaluations per sample):",
                [(e.name, f"{'/'.join(e.kinds)}; {'/'.join(e.objectives)}; "
                          f"{special.get(e.name) or e.evals(None)}: {e.help}") for e in ESTIMATORS.values()])]
    lines = []
    for title, items in entries:
        lines.append(title)
        lines += [textwrap.fill(f"  {k:<{w}} {v}", TABLE_WIDTH, subsequent_indent=" " * (w + 3),
                                break_on_hyphens=False, break_long_words=False) for k, v in items]
    lines.append("not included:")
    lines += [textwrap.fill(f"  {k}: {v}", TABLE_WIDTH, subsequent_indent="    ", break_on_hyphens=False,
                            break_long_words=False) for k, v in NOT_INCLUDED.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="storch-bench",
        description="Train discrete-latent models on real data with storch's gradient estimators\n"
                    "(subcommands: `list`, `compare RUN_DIR...`, `evaluate RUN_DIR...`).",
        epilog=catalog_text() + "\n\nexample: storch-bench --model sbn-linear --estimator disarm --steps 500 "
                                "--seed 0 1 2 --out runs/quick",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--model", default="sbn-linear", choices=list(MODELS))
    a("--data", default="digits", choices=list(DATASETS))
    a("--data-dir", default=None, help="folder with the data files (default ../shared/data next to the repository)")
    a("--estimator", default="score-function", choices=list(ESTIMATORS), metavar="ESTIMATOR",
      help="one of the estimators below (default score-function)")
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
    a("--steps", type=int, default=None, help="training steps (default 1000, or no limit with --seconds)")
    a("--seconds", type=float, default=None, metavar="S",
      help="train until the training steps have taken S seconds of this process's CPU time "
           "(time.process_time; evaluations and variance probes are not counted): an equal-time budget "
           "that other programs on a busy machine do not shorten, fair between runs at the same --threads "
           "(default 1); with --steps too, whichever comes first; with --resume, the new total")
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
    a("--threads", type=int, default=1,
      help="torch.set_num_threads (default 1, as every timing in the docs; 0 keeps torch's default, one "
           "thread per core, which is slower on a busy machine); the run header prints it")
    a("--device", default="cpu", help="where the model trains: cpu (default) or cuda / cuda:N (data are "
                                      "prepared on the CPU); with --distributed, cuda means each rank's "
                                      "LOCAL_RANK GPU and NCCL")
    a("--no-progress", action="store_true", help="no tqdm progress bar")
    a("--no-memory-check", action="store_true",
      help="train even when the estimated memory (printed before the first step: evaluation points per "
           "datum times the batch size times the model's activations per point) exceeds the memory available")
    a("--compile-step", action="store_true",
      help="train with storch.compile_step: the step is traced once and replayed as a graph of torch "
           "operations (no storch Python per step; MAPO and SPSA are refused); ms/step leaves out the "
           "steps that traced (summary.json's trace_seconds)")
    a("--distributed", action="store_true",
      help="data parallel: join the process group that torchrun sets up (gloo), wrap the model in DDP, give "
           "each rank its slice of every minibatch; start with `torchrun --standalone --nproc-per-node N "
           "-m storch.bench --distributed ...` (--batch-size: the whole minibatch, a multiple of N; gloo on "
           "the CPU, NCCL with --device cuda)")
    return p


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", text).strip("_")


#: the widest line of the tables that storch-bench prints (a terminal of 120 columns)
TABLE_WIDTH = 120

#: the columns of summary.json that the tables show: (key, header, decimals)
SUMMARY_COLUMNS = [("test_nelbo", "test -ELBO", 2), ("test_nll", "-log p(x)", 2), ("valid_nelbo", "valid -ELBO", 2),
                   ("train_nelbo", "train -ELBO", 2), ("train_relaxed_nelbo", "relaxed", 2),
                   ("grad_logvar", "log-var", 2), ("ms_per_step", "ms/step", 2), ("peak_memory_mb", "peak MiB", 0)]

#: printed under the tables: which -ELBO is which
TABLE_LEGEND = (
    "-ELBO: with hard (discrete) samples, comparable across estimators. -log p(x): the test bound with --eval-k\n"
    "samples. relaxed: the relaxed objective that a relaxation (gumbel-softmax) trains, on the training data ('-' for\n"
    "estimators that train on hard samples).")


def _fmt(v, width: int, prec: int = 2) -> str:
    if v is None or v == "" or (isinstance(v, float) and not math.isfinite(v)):
        return f"{'-':>{width}}"
    return f"{v:{width}.{prec}f}"


def _fit_table(first: str, columns: Sequence[tuple[str, int]],
               groups: dict[tuple[str, str], list[tuple[str, list[str]]]]) -> list[str]:
    """A table at most `TABLE_WIDTH` wide: a title line ``model on data`` per group, then one row per
    estimator label (the first column, headed ``first``) and its right-aligned cells (``columns``: header
    and width). A label too long for the room left by the cells stands on a line of its own above them."""
    cells_width = sum(w + 1 for _, w in columns)
    labels = [label for rows in groups.values() for label, _ in rows]
    label_width = max(len(first), min(max(len(label) + 2 for label in labels), TABLE_WIDTH - cells_width))
    head = f"{first:<{label_width}}" + "".join(f" {t:>{w}}" for t, w in columns)
    lines = [head, "-" * len(head)]
    for (model, data), rows in groups.items():
        lines.append(f"{model} on {data}")
        for label, cells in rows:
            numbers = "".join(f" {c:>{w}}" for c, (_, w) in zip(cells, columns))
            if len(label) + 2 > label_width:
                lines.append(f"  {label}")
                label = ""
            lines.append(f"  {label:<{label_width - 2}}{numbers}")
    return lines


def run_table(summaries: Sequence[dict]) -> str:
    """One row per run (``seed``; ``evals``: cost evaluations per datum and step), at most `TABLE_WIDTH` wide."""
    columns = [("seed", 4), ("evals", 5)] + [(t, max(len(t), 8)) for _, t, _ in SUMMARY_COLUMNS]
    groups: dict[tuple[str, str], list[tuple[str, list[str]]]] = {}
    for s in summaries:
        cells = [str(s["seed"]), str(s["evals_per_datum"])]
        cells += [_fmt(s.get(k), w, prec) for (k, _, prec), (_, w) in zip(SUMMARY_COLUMNS, columns[2:])]
        groups.setdefault((s["model"], s["data"]), []).append((s["label"], cells))
    legend = ("log-var: log total variance of the encoder's gradient at the last probe. peak MiB: the process's peak "
              "memory.\n" + TABLE_LEGEND + " Every figure is in the run folder's summary.json and metrics.csv.")
    return "\n".join(_fit_table("estimator", columns, groups) + [legend])


def _find_summaries(paths: Sequence[str]) -> list[dict]:
    """The ``summary.json`` of every run under ``paths``, each with its folder as ``run_dir``."""
    out = []
    for p in paths:
        p = Path(p)
        files = [p / "summary.json"] if (p / "summary.json").is_file() else sorted(p.rglob("summary.json"))
        if not files:
            print(f"(no summary.json under {p})", file=sys.stderr)
        for f in files:
            with open(f) as fh:
                out.append({**json.load(fh), "run_dir": str(f.parent)})
    return out


def _groups(summaries: Sequence[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """Runs grouped by (model, data, estimator label): the seeds of one configuration."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["model"], s["data"], s["label"]), []).append(s)
    return dict(sorted(groups.items()))


#: the columns of ``compare``'s printed table (every column of `SUMMARY_COLUMNS` goes to its CSV)
COMPARE_COLUMNS = ("test_nelbo", "test_nll", "valid_nelbo", "train_nelbo", "train_relaxed_nelbo", "ms_per_step")


def _finite(ss: Sequence[dict], key: str) -> list[float]:
    return [s[key] for s in ss if s.get(key) is not None and math.isfinite(s[key])]


def _spread_cell(vals: Sequence[float], prec: int = 2) -> str:
    """``mean±std`` over seeds; the value alone for one seed (a spread of one value means nothing)."""
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{prec}f}"
    return f"{statistics.fmean(vals):.{prec}f}±{statistics.stdev(vals):.{prec}f}"


def compare_table(summaries: Sequence[dict]) -> str:
    """Mean ± standard deviation over seeds of the main summary columns (`COMPARE_COLUMNS`), one row per
    (model, data, estimator), at most `TABLE_WIDTH` wide; ``seeds`` is the number of runs, and a row of one
    run shows its values without a spread. `compare_rows` has every column, for the CSV."""
    shown = [(k, t, p) for k, t, p in SUMMARY_COLUMNS if k in COMPARE_COLUMNS]
    groups: dict[tuple[str, str], list[tuple[str, list[str]]]] = {}
    for (model, data, label), ss in _groups(summaries).items():
        cells = [str(len(ss))] + [_spread_cell(_finite(ss, k), p) for k, _, p in shown]
        groups.setdefault((model, data), []).append((label, cells))
    widths = [max([len(t), *(len(cells[i + 1]) for rows in groups.values() for _, cells in rows)])
              for i, (_, t, _) in enumerate(shown)]
    columns = [("seeds", 5)] + [(t, w) for (_, t, _), w in zip(shown, widths)]
    legend = ("mean±standard deviation over seeds (one seed: its value alone); the CSV file has every column, with\n"
              "the gradient's log-variance and the peak memory.\n" + TABLE_LEGEND)
    return "\n".join(_fit_table("estimator", columns, groups) + [legend])


def compare_rows(summaries: Sequence[dict]) -> list[dict]:
    """The rows of ``compare``'s CSV: per (model, data, estimator), the number of seeds and the mean and
    standard deviation over them of every summary column (empty where undefined)."""
    rows = []
    for (model, data, label), ss in _groups(summaries).items():
        row: dict = {"model": model, "data": data, "estimator": label, "seeds": len(ss)}
        for k, _, _ in SUMMARY_COLUMNS:
            vals = _finite(ss, k)
            row[f"{k}_mean"] = statistics.fmean(vals) if vals else ""
            row[f"{k}_std"] = statistics.stdev(vals) if len(vals) > 1 else ""
        rows.append(row)
    return rows


def write_compare_csv(summaries: Sequence[dict], path: Path) -> None:
    """`compare_rows` into the CSV file ``path``."""
    rows = compare_rows(summaries)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _read_curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """``(step, training seconds, test -ELBO)`` of each row of a run's ``metrics.csv``."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [(int(r["step"]), float(r["seconds"]), float(r["test_nelbo"])) for r in csv.DictReader(f)
                if r.get("test_nelbo") not in (None, "")]


def _mean_curve(curves: Sequence[list[tuple[int, float, float]]]) -> list[tuple[int, float, float]]:
    """The seeds' mean seconds and -ELBO at the steps every seed has."""
    steps = sorted(set.intersection(*({r[0] for r in c} for c in curves))) if curves else []
    by_step = [{r[0]: r for r in c} for c in curves]
    return [(t, statistics.fmean(c[t][1] for c in by_step), statistics.fmean(c[t][2] for c in by_step))
            for t in steps]


def compare_plot(summaries: Sequence[dict], path: Path, log=print) -> bool:
    """Plot the test -ELBO (hard samples) of the compared runs against steps and against training
    seconds into ``path``, one line per (model, data, estimator), the mean over its seeds.

    Returns `False` (and says why through ``log``) without matplotlib or without curves to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log('(no plot: matplotlib is not installed; pip install "storch[bench]")')
        return False
    groups = _groups(summaries)
    one_setting = len({(m, d) for m, d, _ in groups}) == 1
    lines = []
    for (model, data, label), ss in groups.items():
        curves = [c for c in (_read_curve(Path(s["run_dir"])) for s in ss if s.get("run_dir")) if c]
        mean = _mean_curve(curves)
        if mean:
            name = label if one_setting else f"{model} {data} {label}"
            lines.append((f"{name} ({len(curves)} seed{'s' if len(curves) > 1 else ''})", mean))
    if not lines:
        log("(no plot: the runs have no metrics.csv)")
        return False
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, mean in lines:
        steps, secs, ys = zip(*mean)
        ax[0].plot(steps, ys, marker=".", label=name)
        ax[1].plot(secs, ys, marker=".", label=name)
    ax[0].set(xlabel="step", ylabel="test -ELBO (nats, hard samples)")
    ax[1].set(xlabel="training seconds", ylabel="test -ELBO (nats, hard samples)")
    ax[0].legend(fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def build_compare_parser() -> argparse.ArgumentParser:
    """The parser of ``storch-bench compare``."""
    p = argparse.ArgumentParser(
        prog="storch-bench compare",
        description="Print mean ± standard deviation over seeds of the runs under RUN_DIR... (every "
                    "summary.json found below them), one row per (model, data, estimator), write every column "
                    "into a CSV file, and plot their test -ELBO against steps and against training seconds, one "
                    "line per row (the mean over its seeds). A row of one seed shows its values without a "
                    "spread. The files go into the folder of the runs: RUN_DIR itself when one is given, "
                    "otherwise the deepest folder that holds every RUN_DIR.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run folder, or a folder of run folders")
    p.add_argument("--csv", default=None, metavar="PATH",
                   help="where to write the table with every column (default: compare.csv in the folder of the runs)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="where to write the plot (default: compare.png in the folder of the runs; needs "
                        "matplotlib: pip install \"storch[bench]\")")
    p.add_argument("--no-plot", action="store_true", help="no plot (the table and its CSV only)")
    return p


def default_compare_dir(run_dirs: Sequence[str]) -> Path:
    """The folder of the runs, where ``compare`` writes its files by default: RUN_DIR itself when one is
    named, otherwise the deepest folder that holds every RUN_DIR."""
    dirs = [os.path.abspath(d if Path(d).is_dir() else Path(d).parent) for d in run_dirs]
    return Path(os.path.commonpath(dirs))


def compare_main(argv: Sequence[str]) -> int:
    """``storch-bench compare RUN_DIR... [--csv PATH] [--plot PATH | --no-plot]``."""
    args = build_compare_parser().parse_args(argv)
    summaries = _find_summaries(args.run_dirs)
    if not summaries:
        return 1
    print(compare_table(summaries))
    folder = default_compare_dir(args.run_dirs)
    csv_path = Path(args.csv) if args.csv else folder / "compare.csv"
    write_compare_csv(summaries, csv_path)
    print(f"\ncsv: {csv_path}")
    if not args.no_plot:
        path = Path(args.plot) if args.plot else folder / "compare.png"
        if compare_plot(summaries, path):
            print(f"plot: {path}")
    return 0


def _config(args) -> dict:
    n = args.n_samples
    if args.k is not None:
        if n is not None and n != args.k:
            raise SystemExit("storch-bench: --k and --n-samples disagree")
        n = args.k
    return {
        "model": args.model, "data": args.data, "data_dir": args.data_dir, "estimator": args.estimator,
        "objective": args.objective, "n_samples": n, "budget": args.budget, "baseline": args.baseline,
        "temperature": args.temperature, "spsa_c": args.spsa_c, "latent_dim": args.latent_dim,
        "categories": args.categories, "batch_size": args.batch_size, "lr": args.lr,
        "steps": args.steps if args.steps is not None or args.seconds is not None else 1000,
        "seconds": args.seconds, "eval_every": args.eval_every,
        "eval_size": args.eval_size, "eval_k": args.eval_k, "var_reps": args.var_reps,
        "checkpoint_every": args.checkpoint_every, "threads": args.threads, "device": args.device,
        "compile_step": args.compile_step, "memory_check": not args.no_memory_check,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "list":
        argparse.ArgumentParser(prog="storch-bench list",
                                description="List the models, data sets and estimators.").parse_args(argv[1:])
        print(catalog_text())
        return 0
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    if argv and argv[0] == "evaluate":
        from storch.bench.evaluate import evaluate_main

        return evaluate_main(argv[1:])
    args = build_parser().parse_args(argv)
    import torch

    from storch import distributed

    if args.threads < 0:
        print(f"storch-bench: --threads {args.threads}: give a positive number, or 0 for torch's default",
              file=sys.stderr)
        return 2
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


def _out_of_memory(run_dir, error: BaseException) -> str:
    """The message for a run that ran out of memory although its estimate fitted."""
    return (f"storch-bench: out of memory in {run_dir}: {error or type(error).__name__}. The estimate printed "
            "before the first step was too low for this machine: use a smaller --batch-size, fewer samples, or "
            "another estimator.")


def _main(args) -> int:
    import torch

    from storch import distributed
    from storch.bench import train
    from storch.exceptions import CompileStepError

    main_rank = distributed.is_main_process()
    out = print if main_rank else (lambda *a, **k: None)  # rank 0 alone prints
    progress = not args.no_progress
    if args.resume:
        try:
            summary = train.resume(args.resume, steps=args.steps, progress=progress,
                                   memory_check=not args.no_memory_check, seconds=args.seconds)
        except (ValueError, FileNotFoundError, CompileStepError) as e:
            out(f"storch-bench: {e}", file=sys.stderr)
            return 2
        except (MemoryError, torch.OutOfMemoryError) as e:
            out(_out_of_memory(args.resume, e), file=sys.stderr)
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
        eval_every = c["eval_every"] or (max(1, c["steps"] // 10) if c["steps"] else None)
        c["var_every"] = None if args.no_var else (args.var_every or eval_every or 0)  # 0: at evaluations
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
        except (MemoryError, torch.OutOfMemoryError) as e:
            out(_out_of_memory(run_dir, e), file=sys.stderr)
            return 2
        dirs.append(run_dir)
    if not main_rank:
        return 0
    out(run_table(summaries))
    out("\nrun folders:\n" + "\n".join(f"  {d}" for d in dirs))
    if len(summaries) > 1:
        out()
        out(compare_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
