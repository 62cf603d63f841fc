"""Demonstrations that reproduce the Storchastic manual: ``python -m storch.demo`` (or ``make demo``).

* `storch.demo.intro` -- the introduction example (§1.2): mean and variance of the gradient
  of ``E[(a+b) e²]``, ``e ~ N(b+c, 1)``, w.r.t. ``c`` for several estimators, against exact values.
* `storch.demo.vae` -- the discrete VAE tutorial (§1.3): training with the score function
  (with and without a baseline), Gumbel-softmax and exact enumeration, and with the estimators of
  the catalog (importance sampling, sampling without replacement, local expectations, MVD, SPSA,
  straight-through variants, REBAR/RELAX, ...), with gradient variance and bias measured against
  ``Expect``. Catalog methods that do not fit the model (ARM: Bernoulli only) are listed, not run.

Command line::

    python -m storch.demo [--part intro|vae|all] [--epochs N] [--seed S] [--quick]
                          [--mnist DIR] [--methods score,score-rloo,gumbel,...]
                          [--repetitions R] [--grad-samples S] [--device cpu] [--threads N]
                          [--no-progress]

Tables go to stdout, progress bars to stderr. ``--mnist DIR`` reads binarized MNIST from ``DIR``
(``binarized_mnist_packed.npz`` or the ``.amat`` files, else MNIST IDX / ``mnist_uint8.npz``) and
uses the manual's 784-512-256-(2x10)-256-512-784 network; nothing is ever downloaded.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main", "progress_bar"]

#: what a demo without tqdm prints once, instead of its progress bars
NO_TQDM = '(no progress bars: tqdm is not installed; pip install "storch[demo]")'


@functools.cache
def _note_no_tqdm() -> None:
    print(NO_TQDM, file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar on ``sys.stderr`` (hidden when stderr is not a terminal); ``None``, after a one-line
    note (once per process), when tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        _note_no_tqdm()
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, disable=None)


def _method_keys() -> list[str]:
    from storch.demo.vae import METHODS

    return list(METHODS)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m storch.demo``.

    Examples:
        >>> build_parser().parse_args(["--part", "intro", "--quick"]).part
        'intro'
    """
    p = argparse.ArgumentParser(
        prog="python -m storch.demo",
        description="Reproduce the Storchastic manual: the introduction example's estimator table and "
        "the discrete VAE tutorial (gradient variance and bias of the manual's four estimators and of the "
        "estimator catalog).",
    )
    p.add_argument("--part", choices=("intro", "vae", "all"), default="all", help="what to run (default: all)")
    p.add_argument("--epochs", type=int, default=None,
                   help="training epochs per method (default: 3 on digits, 5 on MNIST, 1 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--quick", action="store_true", help="a fast smoke run (small R, tiny VAE run)")
    p.add_argument("--mnist", metavar="DIR", default=None,
                   help="train the manual's 784-512-256-(2x10) VAE on binarized MNIST read from DIR "
                   "(never downloads; on a CPU the methods take tens of minutes for the default 5 epochs: "
                   "try --epochs 1 or --methods)")
    p.add_argument("--methods", default=None,
                   help="comma-separated VAE methods (default: all): " + ", ".join(_method_keys()))
    p.add_argument("--repetitions", "-R", type=int, default=None,
                   help="gradient estimates per row of the introduction table (default: 1000, 50 with --quick)")
    p.add_argument("--grad-samples", type=int, default=None,
                   help="gradient samples per VAE evaluation (default: 50 on digits, 100 on MNIST, 4 with --quick)")
    p.add_argument("--device", default="cpu", help="torch device for the VAE (default: cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for the small digits model, whose matrices are too "
                   "small to gain from threads, which only slow it down on a busy machine; torch's default "
                   "with --mnist)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    args = build_parser().parse_args(argv)
    progress = not args.no_progress

    import torch

    threads = args.threads if args.threads is not None else (None if args.mnist else 1)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(args, progress)
    finally:
        torch.set_num_threads(saved_threads)


def _run(args: argparse.Namespace, progress: bool) -> int:
    start = time.perf_counter()
    if args.part in ("intro", "all"):
        from storch.demo.intro import run_intro

        reps = args.repetitions if args.repetitions is not None else (50 if args.quick else 1000)
        run_intro(repetitions=reps, seed=args.seed, progress_bar=progress)
        print(flush=True)
    if args.part in ("vae", "all"):
        from storch.demo import vae

        kw = {}
        if args.methods:
            kw["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
            unknown = [m for m in kw["methods"] if m not in vae.METHODS]
            if unknown or not kw["methods"]:
                print(f"error: --methods {args.methods!r}: choose among {', '.join(vae.METHODS)}", file=sys.stderr)
                return 2
        if args.grad_samples is not None:
            kw["grad_samples"] = args.grad_samples
        if args.epochs is not None:
            kw["epochs"] = args.epochs
        if args.mnist:
            try:
                config = vae.mnist_config(args.mnist, seed=args.seed, device=args.device, **kw)
            except FileNotFoundError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            if args.quick:
                config.data_name += ", first 512 (quick)"
                config.train_data = config.train_data[:512]
                config.epochs = kw.get("epochs", 1)
                config.eval_every, config.eval_batch, config.nelbo_subset = 8, 16, 256
                config.grad_samples = kw.get("grad_samples", 8)
        elif args.quick:
            config = vae.quick_config(seed=args.seed, device=args.device, **kw)
        else:
            config = vae.digits_config(seed=args.seed, device=args.device, **kw)
        vae.run_vae(config, progress_bar=progress)
    print(f"\nTotal time {time.perf_counter() - start:.1f} s", flush=True)
    return 0
