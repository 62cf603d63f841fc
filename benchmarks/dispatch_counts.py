"""How many operations of a training step pass through storch's ``__torch_function__``, per estimator.

Each such call costs the ``__torch_function__`` protocol (about a microsecond) plus storch's plate
bookkeeping, so the count is the first thing to cut when the eager step is slower than the same
step written by hand. Counted on the steps of ``benchmarks/sbn_step.py`` (linear SBN, batch 50,
the four estimators of ``make bench-sbn``) and ``benchmarks/rl_rollout.py`` (per decision, at
``T = 20``), grouped by the phase of the step: building the model's distributions and costs
(``model``), drawing the samples (``sample``), and ``storch.backward`` (``backward``).

Run from the repository root::

    .venv/bin/python benchmarks/dispatch_counts.py            # the table
    .venv/bin/python benchmarks/dispatch_counts.py --by-op    # also the most frequent functions
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.distributions import Bernoulli

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import storch  # noqa: E402
import rl_rollout  # noqa: E402
import sbn_step  # noqa: E402
from storch import _dispatch  # noqa: E402
from storch.tensor import Tensor  # noqa: E402

__all__ = ["Counter", "count_sbn", "count_rl", "main"]


class Counter:
    """Counts the calls of ``storch.Tensor.__torch_function__`` by phase and by function."""

    def __init__(self) -> None:
        self.phase = "model"
        self.by_phase: collections.Counter = collections.Counter()
        self.by_func: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def installed(self):
        original = Tensor.__dict__["__torch_function__"]
        inner = original.__func__

        def counting(cls, func, types, args=(), kwargs=None):
            self.by_phase[self.phase] += 1
            self.by_func[_dispatch._func_name(func)] += 1
            return inner(cls, func, types, args, kwargs)

        Tensor.__torch_function__ = classmethod(counting)
        try:
            yield self
        finally:
            Tensor.__torch_function__ = original

    @contextlib.contextmanager
    def during(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous


def _count_step(counter: Counter, method: storch.method.Method, step) -> None:
    """Run ``step()`` once to warm caches (as a training loop does), then once counted, with the
    method's sampling and ``storch.backward`` marked as their phases."""
    step()
    original_forward = type(method).forward
    original_backward = storch.backward

    def forward(self, distr):
        with counter.during("sample"):
            return original_forward(self, distr)

    def backward(*args, **kwargs):
        with counter.during("backward"):
            return original_backward(*args, **kwargs)

    type(method).forward = forward
    storch.backward = backward
    try:
        with counter.installed():
            step()
    finally:
        type(method).forward = original_forward
        storch.backward = original_backward


def count_sbn(name: str, counter: Counter, batch: torch.Tensor) -> None:
    """One ``sbn_step.storch_grad`` step, phases marked."""
    model, _ = sbn_step.make_model(0)
    method = sbn_step.make_method(name)
    _count_step(counter, method, lambda: sbn_step.storch_grad(model, batch, method))


def count_rl(counter: Counter, length: int = 20) -> None:
    """One ``rl_rollout.storch_step`` of ``length`` decisions, phases marked."""
    policy, targets = rl_rollout._setup(length)
    cell = storch.make_left_broadcastable(policy.cell)
    method = storch.method.ScoreFunction("action", baseline_factory="moving_average")
    _count_step(counter, method, lambda: rl_rollout.storch_step(policy, cell, method, targets))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--by-op", action="store_true", help="also list the most frequent functions")
    args = ap.parse_args(argv)
    batch = torch.bernoulli(torch.full((50, sbn_step.X_DIM), 0.3), generator=torch.Generator().manual_seed(0))
    rows = []
    for name in ("REINFORCE", "RLOO", "ARM", "DisARM"):
        counter = Counter()
        count_sbn(name, counter, batch)
        rows.append((f"sbn-linear {name}", counter, 1))
    length = 20
    counter = Counter()
    count_rl(counter, length)
    rows.append((f"rl-rollout, per decision (T = {length})", counter, length))
    print(f"{'step':38s} {'model':>7s} {'sample':>7s} {'backward':>9s} {'total':>7s}")
    for label, counter, per in rows:
        phases = [counter.by_phase[p] / per for p in ("model", "sample", "backward")]
        print(f"{label:38s} {phases[0]:7.0f} {phases[1]:7.0f} {phases[2]:9.0f} {sum(phases):7.0f}")
    if args.by_op:
        for label, counter, per in rows:
            common = ", ".join(f"{name} {n / per:.0f}" for name, n in counter.by_func.most_common(12))
            print(f"\n{label}: {common}")


if __name__ == "__main__":
    main()
