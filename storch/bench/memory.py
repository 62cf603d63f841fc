"""How much memory a run will need, how much there is, and the refusal when it does not fit.

A training step evaluates the model's cost at ``P`` points per datum (the estimator's cost
evaluations: ``n`` samples times the points of each sample, e.g. ``1 + D·(K − 1)`` for local
expectation, ``K^D`` for enumeration) and keeps, per point, the activations that the backward pass
needs. Measured on the benchmark's models (peak resident memory against the batch size), a point
holds about 3.5 times the floats of the tensors the story computes there (the latents and every
layer after them, see `BenchModel.point_width`);
the estimate takes 4, so it errs on the large side by about a fifth:

    bytes ≈ batch · P · point_width · 4 · bytes per float

An evaluation (no gradients) holds about two copies of the same tensors for a chunk of 100 data
times ``--eval-k`` samples. The run needs the larger of the two, on top of what is already
allocated (the data set, the model). `check_memory` refuses a
run whose estimate exceeds the memory available (the kernel's ``MemAvailable``, capped by the
cgroup's limit, on the CPU; the free memory of the GPU on CUDA) before its first step, with the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from storch.bench.estimators import BudgetError

__all__ = [
    "MemoryEstimate",
    "MemoryEstimateError",
    "available_memory",
    "check_memory",
    "estimate_memory",
    "format_bytes",
]

#: floats a training step keeps per evaluation point, per float of the point's tensors (measured ≈ 3.5)
TRAIN_FLOATS_PER_WIDTH = 4
#: the same for an evaluation, which keeps no activations for a backward pass
EVAL_FLOATS_PER_WIDTH = 2
#: data per chunk of an evaluation (`storch.bench.models.evaluate_bounds`)
EVAL_CHUNK = 100


class MemoryEstimateError(BudgetError):
    """The run's estimated memory exceeds the memory available."""


@dataclass(frozen=True)
class MemoryEstimate:
    """The memory a run is estimated to need, against what is available.

    Attributes:
        points_per_datum: cost evaluations per datum and training step.
        batch: data per training step in this process's memory.
        train_bytes: estimated memory of one training step.
        eval_bytes: estimated memory of one evaluation chunk.
        eval_k: samples per datum of the final evaluation.
        available_bytes: memory available on the device (`None` where unknown).
        device: where the model trains.
    """

    points_per_datum: int
    batch: int
    train_bytes: int
    eval_bytes: int
    eval_k: int
    available_bytes: int | None
    device: str

    @property
    def needed_bytes(self) -> int:
        """The larger of a training step and an evaluation."""
        return max(self.train_bytes, self.eval_bytes)

    @property
    def fits(self) -> bool:
        """Whether the estimate is within the available memory (`True` where that is unknown)."""
        return self.available_bytes is None or self.needed_bytes <= self.available_bytes

    def largest_batch(self) -> int:
        """The largest batch size whose training step fits in the available memory (0 if none)."""
        return _largest(self.batch, self.train_bytes, self.available_bytes)

    def largest_eval_k(self) -> int:
        """The largest ``--eval-k`` whose evaluation fits in the available memory (0 if none)."""
        return _largest(self.eval_k, self.eval_bytes, self.available_bytes)

    def summary(self) -> str:
        """Two short lines: points per datum and step; the memory estimate and the memory available."""
        avail = "unknown" if self.available_bytes is None else format_bytes(self.available_bytes)
        return (f"{self.points_per_datum} evaluation points per datum, {self.points_per_datum * self.batch} per "
                f"step\n  memory: about {format_bytes(self.train_bytes)} per training step, "
                f"{format_bytes(self.eval_bytes)} per evaluation;\n  {avail} available on {self.device}")


def _largest(count: int, nbytes: int, available: int | None) -> int:
    """The largest count whose memory, proportional to it (``nbytes`` at ``count``), fits in ``available``."""
    if available is None or not nbytes:
        return count
    return int(available // (nbytes / max(count, 1)))


def _sentence(text: str) -> str:
    """``text`` with a capital first letter and a full stop."""
    return text[:1].upper() + text[1:] + "."


def format_bytes(n: float) -> str:
    """``n`` bytes as MiB below 1 GiB, else as GiB."""
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of Linux's ``/proc/meminfo`` in bytes (`None` where absent)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available(root: str = "/sys/fs/cgroup") -> int | None:
    """The cgroup (v2) memory limit less its usage, in bytes (`None` without a limit)."""
    try:
        limit = Path(root, "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path(root, "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _sysconf_available() -> int | None:
    """Free physical pages times the page size, where the platform has them (`None` elsewhere)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def available_memory(device: torch.device) -> int | None:
    """Bytes available for a run on ``device``; `None` where that cannot be read.

    On CUDA the device's free memory (`torch.cuda.mem_get_info`); on the CPU Linux's
    ``MemAvailable`` (free memory plus what the kernel can reclaim), capped by a cgroup's limit,
    or else the free physical pages (``os.sysconf``).
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    known = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    if known:
        return min(known)
    return _sysconf_available()


def estimate_memory(points_per_datum: int, batch: int, point_width: int, eval_k: int, eval_size: int,
                    device: torch.device, dtype: torch.dtype | None = None) -> MemoryEstimate:
    """Estimate the memory of a training step and of an evaluation (see the module docstring).

    Args:
        points_per_datum: cost evaluations per datum and step.
        batch: data per step held in this process's memory.
        point_width: floats the model's story computes at one point.
        eval_k: samples per datum of the final evaluation (``--eval-k``).
        eval_size: data per evaluation split (``--eval-size``).
        device: where the model trains.
        dtype: the floats' type (default: torch's default dtype).
    """
    size = torch.empty((), dtype=dtype or torch.get_default_dtype()).element_size()
    train = batch * points_per_datum * point_width * TRAIN_FLOATS_PER_WIDTH * size
    evaluation = min(eval_size, EVAL_CHUNK) * eval_k * point_width * EVAL_FLOATS_PER_WIDTH * size
    return MemoryEstimate(points_per_datum, batch, train, evaluation, eval_k, available_memory(device), str(device))


def check_memory(estimate: MemoryEstimate, model: str, label: str) -> None:
    """Refuse a run whose estimate exceeds the available memory, naming the fix.

    Raises:
        MemoryEstimateError: the estimate exceeds the memory available.
    """
    if estimate.fits:
        return
    available = estimate.available_bytes or 0
    fixes = []
    if estimate.train_bytes > available:
        largest = estimate.largest_batch()
        smaller = (f"a --batch-size of at most {largest}" if 0 < largest < estimate.batch
                   else "a smaller --batch-size")
        fixes.append(f"for the training step, use {smaller}, fewer samples (--n-samples, --budget) or an "
                     "estimator with fewer cost evaluations per sample (storch-bench list)")
    if estimate.eval_bytes > available:
        largest = estimate.largest_eval_k()
        smaller = f"an --eval-k of at most {largest}" if 0 < largest < estimate.eval_k else "a smaller --eval-k"
        fixes.append(f"for the evaluation, use {smaller}")
    raise MemoryEstimateError(
        f"{model} with {label} evaluates the cost at {estimate.points_per_datum} points per datum, "
        f"{estimate.points_per_datum * estimate.batch} per step at batch size {estimate.batch}: it needs about "
        f"{format_bytes(estimate.train_bytes)} per training step and {format_bytes(estimate.eval_bytes)} per "
        f"evaluation, but only {format_bytes(available)} is available on {estimate.device}. "
        + _sentence("; ".join(fixes))
        + " --no-memory-check runs it anyway."
    )
