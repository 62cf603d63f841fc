"""The overhead of `storch.method.Auto` over the estimator it settles on: linear SBN training steps.

The ``sbn-linear`` model of ``storch-bench`` (784-[200] on statically binarized MNIST, minibatches of
50, Adam 1e-3, one thread). Two variants of the same step, interleaved block by block so that both see
the same machine load:

* ``fixed``: the estimator itself, e.g. ``DisARM("z", n_samples=1)``;
* ``auto``: ``Auto("z", budget=2, candidates=["DisARM"])``, settled on the same estimator after its
  first step; its steps add the measurements (a clock read, the sum of squares of the encoder logits'
  gradient) and the hand-over to the candidate.

Usage (from the repository root)::

    .venv/bin/python benchmarks/auto_overhead.py --data-dir ../shared/data        # ~1 minute
    .venv/bin/python benchmarks/auto_overhead.py --blocks 4 --steps 10              # smoke run (digits)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import storch
from storch.bench.data import load_dataset
from storch.bench.models import make_model, storch_story
from storch.method.catalog import entry

FIXED = {"DisARM": ("DisARM", 1, 2), "ScoreFunction + batch_average": ("ScoreFunction + batch_average", 2, 2)}


def make_step(model, method, data):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        storch.reset()
        opt.zero_grad(set_to_none=True)
        idx = torch.randint(0, data.shape[0], (50,), generator=gen)
        t0 = time.perf_counter()
        storch_story(model, data[idx], {"z": method})
        storch.backward()
        opt.step()
        return time.perf_counter() - t0

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder of binarized_mnist_packed.npz (default: digits)")
    parser.add_argument("--estimator", default="DisARM", choices=sorted(FIXED))
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset("binarized-mnist" if args.data_dir else "digits", args.data_dir)
    label, count, budget = FIXED[args.estimator]
    torch.manual_seed(0)
    models = {k: make_model("sbn-linear", data.input_dim, data.train_mean) for k in ("fixed", "auto")}
    models["auto"].load_state_dict(models["fixed"].state_dict())
    fixed = entry(label).make_counted("z", (200,), count)
    auto = storch.method.Auto("z", budget=budget, candidates=[label], explore_every=10**9)
    steps = {"fixed": make_step(models["fixed"], fixed, data.train), "auto": make_step(models["auto"], auto, data.train)}
    for name, step in steps.items():
        for _ in range(args.warmup):
            step()
    assert auto.settled is not None and auto.choice.startswith(label.split(" ")[0]), auto.choice
    times: dict[str, list[float]] = {"fixed": [], "auto": []}
    for block in range(args.blocks):
        order = ("fixed", "auto") if block % 2 == 0 else ("auto", "fixed")
        for name in order:
            times[name] += [steps[name]() for _ in range(args.steps)]
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"sbn-linear, {data.name}, batch 50, 1 thread; {args.blocks} interleaved blocks of {args.steps} steps")
    print(f"{'variant':<8} {'ms/step (median)':>17}")
    for name in ("fixed", "auto"):
        shown = label if name == "fixed" else f"Auto -> {auto.choice}"
        print(f"{name:<8} {med[name]:>17.3f}   {shown}")
    print(f"auto / fixed: {med['auto'] / med['fixed']:.3f}")


if __name__ == "__main__":
    main()
