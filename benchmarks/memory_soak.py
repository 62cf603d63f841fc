"""Memory of a long training loop: resident memory must stay flat over many storch steps.

The manual's pattern, one estimator built per step: a 32 x 64 minibatch, a OneHotCategorical 4 x 10
posterior, ScoreFunction with n = 4 and the batch_average baseline, one cost, `storch.backward()`
(first order, and with `create_graph=True`). Prints the resident set size after the warm-up and at
the end, and how many of the step objects sampled along the way (methods, plates, distributions)
are still alive. Not a unit test (tests/test_nothing_silent.py checks the weak references); the
acceptance figure of issue 9 is under 10 MB growth over 10 000 steps.

    .venv/bin/python benchmarks/memory_soak.py [--steps 10000]
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
import weakref

import torch
from torch.distributions import OneHotCategorical

import storch


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def training_step(enc: torch.nn.Module, dec: torch.nn.Module, data: torch.Tensor, create_graph: bool) -> list[weakref.ref]:
    """One step of the manual's pattern; weak references to what the step made (method, plate, q)."""
    x = storch.denote_independent(data, 0, "data")
    q = OneHotCategorical(logits=enc(x).reshape(-1, 4, 10))
    method = storch.method.ScoreFunction("z", n_samples=4, baseline_factory="batch_average")
    z = method(q)
    rec = dec(z.reshape(z.shape[:-2] + (40,)))
    storch.add_cost(((rec - x) ** 2).sum(-1), "reconstruction")
    storch.backward(create_graph=create_graph)
    for p in list(enc.parameters()) + list(dec.parameters()):
        p.grad = None  # with create_graph, .grad holds a graph: drop it as the torch docs advise
    return [weakref.ref(method), weakref.ref(z.plate), weakref.ref(q), weakref.ref(x.plates[0])]


def soak(steps: int, create_graph: bool, warmup: int = 200) -> dict:
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(64, 40), torch.nn.Linear(40, 64)
    data = torch.rand(32, 64)
    refs: list[weakref.ref] = []
    start_mb = None
    t0 = time.perf_counter()
    for i in range(steps + warmup):
        step_refs = training_step(enc, dec, data, create_graph)
        if i % 100 == 0:
            refs += step_refs
        if i == warmup - 1:
            gc.collect()
            start_mb = resident_mb()
    gc.collect()
    end_mb = resident_mb()
    return {
        "create_graph": create_graph, "steps": steps, "start_mb": start_mb, "end_mb": end_mb,
        "growth_mb": end_mb - start_mb, "alive": sum(r() is not None for r in refs), "tracked": len(refs),
        "ms_per_step": 1e3 * (time.perf_counter() - t0) / (steps + warmup),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # torch warns once that backward(create_graph=True) ties parameters to their .grad; the loop
    # resets .grad to None after every step, as that warning advises
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
    print(f"{'create_graph':>12} {'steps':>6} {'RSS start':>10} {'RSS end':>9} {'growth':>8} {'alive':>7} {'ms/step':>8}")
    for create_graph in (False, True):
        r = soak(args.steps, create_graph)
        print(
            f"{str(r['create_graph']):>12} {r['steps']:>6} {r['start_mb']:>8.1f}MB {r['end_mb']:>7.1f}MB "
            f"{r['growth_mb']:>6.1f}MB {r['alive']:>3}/{r['tracked']:<3} {r['ms_per_step']:>8.2f}"
        )


if __name__ == "__main__":
    main()
