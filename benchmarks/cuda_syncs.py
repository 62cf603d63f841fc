"""Where a storch training step waits for the GPU (every host-device synchronisation, with its
line), and how many kernels it launches against the hand-written step.

A training step on a GPU is fast when the host queues kernels without waiting for them; each
synchronisation (``.item()``, ``bool(tensor)``, a copy to the CPU, ``nonzero``, ...) drains the
queue. This runs a few ``sbn-linear`` steps (``benchmarks/sbn_step.py``) under
``torch.cuda.set_sync_debug_mode("warn")`` and prints, per estimator, each synchronising call site
in storch (or the model) with how often it ran per step. Then it counts, with ``torch.profiler``,
the CUDA kernels and the operators dispatched per step by storch's and the hand-written step: on a
GPU a small model's step is bound by launching them.

Usage (needs a CUDA device)::

    python benchmarks/cuda_syncs.py
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import sbn_step as sbn  # noqa: E402


def _site(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    return f"{path.parent.name}/{path.name}:{frame.lineno} {frame.name}"


def sync_sites(name: str, steps: int = 3) -> collections.Counter:
    """Call sites (file:line function) that synchronised, counted over ``steps`` storch steps."""
    model = sbn.make_model(0)[0].cuda()
    data = (torch.rand(50, sbn.X_DIM, device="cuda") < 0.5).float()
    method = sbn.make_method(name)
    sbn.storch_grad(model, data, method)  # warm-up (first-call work)
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        ours = [f for f in stack if "/storch/" in f.filename or "benchmarks" in f.filename]
        if any(f.name == "set_sync_debug_mode" for f in stack):
            return  # switching the mode back
        # the innermost frame (torch's, e.g. a distribution's argument validation) and the
        # innermost two of storch or the model
        frames = [stack[-1]] + [f for f in reversed(ours[-2:]) if f is not stack[-1]]
        where = " <- ".join(_site(f) for f in frames)
        sites[where] += 1

    old = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                sbn.storch_grad(model, data, method)
            torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    return collections.Counter({k: v / steps for k, v in sites.items()})


def launches(step, steps: int = 5) -> tuple:
    """(CUDA kernels, aten operators) per call of ``step``, counted by ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"))
    return kernels / steps, ops / steps


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_syncs.py needs a CUDA device", file=sys.stderr)
        return 2
    for name in sbn.ESTIMATORS:
        sites = sync_sites(name)
        print(f"{name}: {sum(sites.values()):.0f} synchronisations per step")
        for where, n in sites.most_common():
            print(f"  {n:4.1f}  {where}")
    print("\nper step (sbn-linear, batch 50): CUDA kernels | aten operators (incl. nested), storch vs hand-written")
    data = (torch.rand(50, sbn.X_DIM, device="cuda") < 0.5).float()
    for name in sbn.ESTIMATORS:
        model = sbn.make_model(0)[0].cuda()
        method, hand = sbn.make_method(name), sbn.hw_grad(name)
        s_k, s_o = launches(lambda: sbn.storch_grad(model, data, method))
        h_k, h_o = launches(lambda: hand(model, data))
        print(f"  {name:<10} kernels {s_k:5.0f} vs {h_k:5.0f} ({s_k / h_k:.2f}x) | operators {s_o:5.0f} vs {h_o:5.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
