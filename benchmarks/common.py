"""Timing helpers shared by ``run.py`` (our venv) and ``storchastic_step.py`` (Storchastic's venv).

Imports nothing but ``torch`` and the standard library, so that both programs measure in the
same way.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch

# The per-op benchmark: each takes two tensors of shape (op_batch, op_dim) with one plate.
OPS: Dict[str, Callable] = {
    "add": (lambda a, b: a + b),
    "mul": (lambda a, b: a * b),
    "exp": (lambda a, b: a.exp()),
    "relu": (lambda a, b: torch.relu(a)),
}

# Repetition counts: (op blocks, ops per block, warm-up steps, timed steps)
FULL = dict(op_reps=31, op_inner=300, warmup=5, step_reps=31)
QUICK = dict(op_reps=5, op_inner=50, warmup=2, step_reps=3)


def time_block(fn: Callable, a, b, inner: int) -> float:
    """Mean time of one call ``fn(a, b)`` in microseconds over a block of ``inner`` calls."""
    t0 = time.perf_counter_ns()
    for _ in range(inner):
        fn(a, b)
    return (time.perf_counter_ns() - t0) / inner / 1000.0


def bench_ops(plain_pair, storch_pair, reps: int, inner: int,
              check: Callable = None) -> dict:
    """Median per-op time on plain tensors and on storch tensors, and their difference.

    Blocks of plain and storch calls alternate, so that machine noise affects both alike.
    ``check(name, result)`` (optional) is called once per op on the storch result.
    """
    out = {}
    for name, fn in OPS.items():
        if check is not None:
            check(name, fn(*storch_pair))
        time_block(fn, *plain_pair, inner)  # warm-up
        time_block(fn, *storch_pair, inner)
        plain: List[float] = []
        st: List[float] = []
        for _ in range(reps):
            plain.append(time_block(fn, *plain_pair, inner))
            st.append(time_block(fn, *storch_pair, inner))
        p, s = statistics.median(plain), statistics.median(st)
        out[name] = {"plain_us": p, "storch_us": s, "overhead_us": s - p}
    out["mean_overhead_us"] = statistics.mean(
        v["overhead_us"] for k, v in out.items() if isinstance(v, dict))
    return out


def time_ms(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def bench_interleaved(fns: Dict[str, Callable], warmup: int, reps: int) -> Dict[str, float]:
    """Median time in milliseconds of each zero-argument function.

    After ``warmup`` rounds, each of ``reps`` rounds calls every function once, rotating the
    order from round to round, so that noise and cache effects hit all of them alike.
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(reps):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(time_ms(fns[n]))
    return {n: statistics.median(t) for n, t in times.items()}
