"""``storch-bench evaluate``: the test bounds of finished runs on more test data than they used.

Training runs evaluate the final importance-weighted bound on a fixed random subset of the test set
(``--eval-size``, 1000 images by default) to keep every run cheap. Papers report the bound on the whole
test set (10 000 binarized MNIST images, ``K = 200``): this subcommand reloads each run's model from its
``checkpoint.pt`` (so the run must have been trained with ``--checkpoint-every``) and evaluates it on
``--eval-size`` test images (default: all), writing ``test_eval.json`` into the run folder beside
``summary.json``::

    storch-bench evaluate runs/gsb-scale/*_seed0 --eval-k 200
    storch-bench evaluate RUN_DIR --eval-size 5000 --device cuda

The checkpoint must hold the run's final step (a checkpoint older than ``summary.json`` is refused:
the bound would belong to another model than the run's table row).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from storch.bench.data import eval_subset, load_dataset
from storch.bench.models import evaluate_bounds, make_model

__all__ = ["evaluate_run", "evaluate_main", "EVAL_FILE"]

#: the file each evaluated run folder gets
EVAL_FILE = "test_eval.json"


def _read(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's configuration and summary; refuses a folder without a finished run or a checkpoint."""
    for name in ("config.json", "summary.json", "checkpoint.pt"):
        if not (run_dir / name).is_file():
            hint = " (train with --checkpoint-every N)" if name == "checkpoint.pt" else " (is the run finished?)"
            raise FileNotFoundError(f"{run_dir} has no {name}{hint}")
    return json.loads((run_dir / "config.json").read_text()), json.loads((run_dir / "summary.json").read_text())


def evaluate_run(run_dir: Path | str, eval_size: int | None = None, eval_k: int = 200, device: str = "cpu",
                 data_dir: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Evaluate the model of the finished run in ``run_dir`` on ``eval_size`` test images (``None``:
    all): mean ``−ELBO`` over the ``eval_k`` samples and ``−log p(x)`` by the ``eval_k``-sample bound, in
    nats per image. Writes and returns the record of ``test_eval.json``."""
    run_dir = Path(run_dir)
    cfg, summary = _read(run_dir)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True, map_location="cpu")
    if state["step"] != summary.get("steps", state["step"]):
        raise ValueError(f"{run_dir}: its checkpoint is from step {state['step']}, but the run ended at step "
                         f"{summary['steps']}; resume it to the end (storch-bench --resume) before evaluating")
    data = load_dataset(cfg["data"], data_dir if data_dir is not None else cfg.get("data_dir"))
    model = make_model(cfg["model"], data.input_dim, data.train_mean, cfg.get("latent_dim"), cfg.get("categories"))
    model.load_state_dict(state["model"])
    model.to(device).eval()
    test = data.test if eval_size is None else eval_subset(data.test, eval_size)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        nelbo, nll = evaluate_bounds(model, test.to(device), eval_k)
    record = {"step": state["step"], "eval_size": int(test.shape[0]), "requested_eval_size": eval_size,
              "eval_k": eval_k, "test_nelbo_k": nelbo,
              "test_nll": nll, "seconds": round(time.perf_counter() - start, 2), "label": summary.get("label")}
    (run_dir / EVAL_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="storch-bench evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", help="finished run folders (with checkpoint.pt)")
    p.add_argument("--eval-size", type=int, default=None, help="test images (default: the whole test set)")
    p.add_argument("--eval-k", type=int, default=200, help="samples of the importance-weighted bound")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-dir", default=None, help="folder with the data files (default: the run's)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    p.add_argument("--skip-done", action="store_true", help=f"leave out runs that already have {EVAL_FILE} "
                   "with the same --eval-size and --eval-k")
    return p


def _done(run_dir: Path, eval_size: int | None, eval_k: int) -> bool:
    path = run_dir / EVAL_FILE
    if not path.is_file():
        return False
    old = json.loads(path.read_text())  # the same request (None: the whole test set), not the same count
    return old.get("eval_k") == eval_k and "requested_eval_size" in old and old["requested_eval_size"] == eval_size


def evaluate_main(argv: Sequence[str]) -> int:
    """``storch-bench evaluate RUN_DIR... [--eval-size N] [--eval-k K] [--device D]``."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    failed = 0
    print(f"{'run':70s} {'images':>7s} {'K':>4s} {'-ELBO':>8s} {'-log p(x)':>10s} {'seconds':>8s}")
    for name in args.run_dirs:
        run_dir = Path(name)
        if args.skip_done and _done(run_dir, args.eval_size, args.eval_k):
            continue
        try:
            r = evaluate_run(run_dir, args.eval_size, args.eval_k, args.device, args.data_dir)
        except (FileNotFoundError, ValueError) as error:
            print(f"{run_dir.name:70s} skipped: {error}")
            failed += 1
            continue
        name = run_dir.name
        if len(name) > 70:  # the table stays 112 columns wide: a long name on a line of its own
            print(name)
            name = ""
        print(f"{name:70s} {r['eval_size']:7d} {r['eval_k']:4d} {r['test_nelbo_k']:8.2f} "
              f"{r['test_nll']:10.2f} {r['seconds']:8.1f}", flush=True)
    return 1 if failed else 0
