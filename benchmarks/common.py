"""Timing helpers shared by ``run.py`` (our venv) and ``storchastic_step.py`` (Storchastic's venv).

Imports nothing but ``torch`` and the standard library, so that both programs measure in the
same way.

Measurements are collected in *chunks* (``run_chunk``) so that a parent process can interleave
its own chunks with those of a child process (Storchastic runs in its own process): machine
noise and load changes then affect every variant alike. Results are medians over all chunks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

class FloorTensor(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` does nothing but call the function.

    A hand-written step run on it (its data wrapped with :func:`floor_view`, so every operation
    downstream of the data is a ``FloorTensor``) costs what *any* library built on a
    ``__torch_function__`` subclass pays before doing any work of its own: the trip from torch's
    C++ into Python and back for every operation and every shape query (about 0.8 us each).
    storch's own cost is what it adds above this floor.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs) if kwargs else func(*args)
        if type(out) is torch.Tensor:
            out.__class__ = cls
        elif type(out) is tuple:
            for o in out:
                if type(o) is torch.Tensor:
                    o.__class__ = cls
        return out


def floor_view(x: torch.Tensor) -> FloorTensor:
    """A :class:`FloorTensor` view of ``x`` (``x`` itself is left as it is)."""
    v = x.view_as(x)
    v.__class__ = FloorTensor
    return v


# The per-op benchmark: each takes two tensors of shape (op_batch, op_dim) with one plate.
OPS: dict[str, Callable] = {
    "add": (lambda a, b: a + b),
    "mul": (lambda a, b: a * b),
    "exp": (lambda a, b: a.exp()),
    "relu": (lambda a, b: torch.relu(a)),
}

# Repetition counts: blocks of ops per variant, ops per block, warm-up steps, timed steps per
# variant, and the chunk sizes (blocks / steps per variant) used when interleaving processes.
FULL = dict(op_reps=32, op_inner=300, warmup=5, step_reps=32, op_chunk=4, step_chunk=4)
QUICK = dict(op_reps=4, op_inner=50, warmup=2, step_reps=4, op_chunk=2, step_chunk=2)


def time_block(fn: Callable, a, b, inner: int) -> float:
    """Mean time of one call ``fn(a, b)`` in microseconds over a block of ``inner`` calls."""
    t0 = time.perf_counter_ns()
    for _ in range(inner):
        fn(a, b)
    return (time.perf_counter_ns() - t0) / inner / 1000.0


def time_ms(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def chunks(total: int, size: int) -> list[int]:
    """Split ``total`` repetitions into chunks of at most ``size``."""
    size = max(1, size)
    return [min(size, total - i) for i in range(0, total, size)]


class OpBench:
    """Per-op time on plain tensors and on storch tensors, and their difference.

    Blocks of plain and storch calls alternate, so that machine noise affects both alike.
    ``check(name, result)`` (optional) is called once per op on the storch result.
    """

    def __init__(self, plain_pair, storch_pair, inner: int, check: Callable | None = None):
        self.plain_pair, self.storch_pair, self.inner = plain_pair, storch_pair, inner
        self.plain: dict[str, list[float]] = {n: [] for n in OPS}
        self.storch: dict[str, list[float]] = {n: [] for n in OPS}
        for name, fn in OPS.items():
            if check is not None:
                check(name, fn(*storch_pair))
            time_block(fn, *plain_pair, inner)  # warm-up
            time_block(fn, *storch_pair, inner)

    def run_chunk(self, reps: int) -> None:
        for name, fn in OPS.items():
            for _ in range(reps):
                self.plain[name].append(time_block(fn, *self.plain_pair, self.inner))
                self.storch[name].append(time_block(fn, *self.storch_pair, self.inner))

    def summary(self) -> dict:
        out = {}
        for name in OPS:
            p, s = statistics.median(self.plain[name]), statistics.median(self.storch[name])
            # overhead: median of the differences of adjacent (paired) blocks, which cancels
            # load changes slower than a block pair
            d = statistics.median(y - x for x, y in zip(self.plain[name], self.storch[name]))
            out[name] = {"plain_us": p, "storch_us": s, "overhead_us": d,
                         "blocks": len(self.plain[name])}
        out["mean_overhead_us"] = statistics.mean(out[n]["overhead_us"] for n in OPS)
        out["mean_plain_us"] = statistics.mean(out[n]["plain_us"] for n in OPS)
        return out


class StepBench:
    """Median time in milliseconds of each zero-argument function (a training step).

    Each round calls every function once, rotating the order from round to round, so that
    noise and cache effects hit all of them alike.
    """

    def __init__(self, fns: dict[str, Callable], warmup: int):
        self.fns = fns
        self.names = list(fns)
        self.times: dict[str, list[float]] = {n: [] for n in self.names}
        self.round = 0
        for _ in range(warmup):
            for n in self.names:
                fns[n]()

    def run_chunk(self, reps: int) -> None:
        for _ in range(reps):
            k = self.round % len(self.names)
            for n in self.names[k:] + self.names[:k]:
                self.times[n].append(time_ms(self.fns[n]))
            self.round += 1

    def summary(self) -> dict[str, float]:
        return {n: statistics.median(t) for n, t in self.times.items()}

    def ratio(self, num: str, den: str) -> float:
        """Median over rounds of time(num) / time(den) within the same round (paired)."""
        return statistics.median(a / b for a, b in zip(self.times[num], self.times[den]))


class Served:
    """A child process that answers each line written to its stdin with one JSON line (a benchmark
    variant or training served in a process of its own, see `ProcessBench`)."""

    def __init__(self, name: str, command: list[str]):
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str):
        """Write ``line``, return the child's answer (decoded JSON)."""
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the benchmark process of {self.name!r} ended early (exit code {self.process.wait()})")
        return json.loads(answer)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


class ProcessBench(StepBench):
    """`StepBench`'s rounds with each variant in a process of its own, in its process's CPU time.

    A step that leaves many objects alive until its end (storch's nodes and tensors) makes Python's
    garbage collector run full collections more often, and in one process a collection is charged to
    whichever step is running when it triggers, often the other variant's. In processes of their own
    each variant pays for its own collections, as in a user's program. ``command(name)`` is the
    command line of the child that serves variant ``name`` (see `serve_steps`); rounds still
    alternate between the children, so that load changes hit all variants alike.
    """

    def __init__(self, command: Callable[[str], list[str]], names: list[str], warmup: int):
        self.names = list(names)
        self.times = {n: [] for n in self.names}
        self.round = 0
        self.children = {n: Served(n, command(n)) for n in self.names}
        for n in self.names:
            self.children[n].ask(str(warmup))

    def run_chunk(self, reps: int) -> None:
        for _ in range(reps):
            k = self.round % len(self.names)
            for n in self.names[k:] + self.names[:k]:
                self.times[n].extend(self.children[n].ask("1"))
            self.round += 1

    def close(self) -> None:
        for child in self.children.values():
            child.close()


def serve_steps(fn: Callable[[], None]) -> None:
    """The child's side of `ProcessBench`: for each line ``k`` on stdin, run ``fn`` ``k`` times and
    print the times (ms of this process's CPU time) as one JSON line; stop at the end of stdin."""
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            start = time.process_time()
            fn()
            times.append((time.process_time() - start) * 1000.0)
        print(json.dumps(times), flush=True)


def add_measurement_arguments(ap: argparse.ArgumentParser) -> None:
    """The options both benchmark processes share (run.py and storchastic_step.py)."""
    ap.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 100])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--op-batch", type=int, default=8)
    ap.add_argument("--op-dim", type=int, default=16)
    ap.add_argument("--step-reps", type=int, default=None,
                    help="timed training steps per variant (default 32, 4 with --quick)")
    ap.add_argument("--op-reps", type=int, default=None,
                    help="timed blocks of ops per variant (default 32, 4 with --quick)")
