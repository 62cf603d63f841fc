"""A whole training step under ``torch.compile``: eager and compiled, storch and hand-written.

Two models, each step as in the other benchmarks (one thread; CPU, or a GPU with ``--device cuda``):

* ``sbn-linear`` 784-[200] on binarized MNIST, batch 50 (``benchmarks/sbn_step.py``), with
  REINFORCE (n=1) and ARM (one pair);
* the discrete VAE of ``benchmarks/run.py`` (20×10 one-hot latents), batch 8, ScoreFunction with
  8 samples and the leave-one-out baseline (``benchmarks/handwritten.py``).

For each, five variants are timed, interleaved in blocks (medians over blocks): storch eager,
storch compiled (``torch.compile`` of the whole step function, default backend), hand-written
eager and hand-written compiled, and storch under ``storch.compile_step(..., backend="inductor")``
(the step traced once at the aten level, the graph compiled by TorchInductor). Compilation happens
before timing (its time is printed). Under ``torch.compile`` storch's own frames run eagerly
(``storch.compiler``), so every operation on a storch tensor is a graph break: expect compiled
storch ≈ eager storch; ``compile_step`` has no storch frames left to run.

Usage::

    .venv/bin/python benchmarks/compile_step.py               # ~2 minutes
    .venv/bin/python benchmarks/compile_step.py --blocks 3 --steps 5   # smoke run
    python benchmarks/compile_step.py --device cuda             # the same table on a GPU

On a GPU the models and data live on the device and each timed block ends with
``torch.cuda.synchronize()``; the models are small, so a step is bound by kernel launches and
Python, which is where storch's overhead shows.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import storch  # noqa: E402
import sbn_step as sbn  # noqa: E402
from handwritten import handwritten_step, make_data, make_model_and_optimizer  # noqa: E402
from run import _make_method, storch_gradient, storch_step  # noqa: E402


def sbn_variants(name: str, data: torch.Tensor, device: torch.device) -> Dict[str, Callable[[], object]]:
    hand = sbn.hw_grad(name)
    data = data.to(device)
    models = [sbn.make_model(0)[0].to(device) for _ in range(5)]
    method_eager, method_compiled = sbn.make_method(name), sbn.make_method(name)
    storch_compiled, hand_compiled = torch.compile(sbn.storch_grad), torch.compile(hand)
    traced = storch.compile_step(functools.partial(sbn.storch_grad, models[4], method=sbn.make_method(name)),
                                 models[4], backend="inductor")
    return {
        "storch eager": lambda: sbn.storch_grad(models[0], data, method_eager),
        "storch compiled": lambda: storch_compiled(models[1], data, method_compiled),
        "hand-written eager": lambda: hand(models[2], data),
        "hand-written compiled": lambda: hand_compiled(models[3], data),
        "storch compile_step": lambda: traced(data),
    }


def vae_variants(device: torch.device, batch: int = 8, n_samples: int = 8) -> Dict[str, Callable[[], object]]:
    data = make_data(batch).to(device)
    pairs = [make_model_and_optimizer() for _ in range(5)]
    for model, _ in pairs:
        model.to(device)  # moves the parameters in place: the optimizers keep them
    methods = [_make_method(storch, n_samples) for _ in range(3)]
    storch_compiled = torch.compile(storch_step)
    hand_compiled = torch.compile(handwritten_step)
    model4, optimizer4 = pairs[4]
    gradient = storch.compile_step(functools.partial(storch_gradient, storch, model4, methods[2]), model4,
                                   backend="inductor")
    optimizer_step = torch.compile(optimizer4.step)  # compiled as in the hand-written compiled step

    def traced(x):
        optimizer4.zero_grad()
        value = gradient(x)
        optimizer_step()
        return value

    return {
        "storch eager": lambda: storch_step(storch, *pairs[0], methods[0], data),
        "storch compiled": lambda: storch_compiled(storch, *pairs[1], methods[1], data),
        "hand-written eager": lambda: handwritten_step(*pairs[2], data, n_samples),
        "hand-written compiled": lambda: hand_compiled(*pairs[3], data, n_samples),
        "storch compile_step": lambda: traced(data),
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(
    variants: Dict[str, Callable[[], object]], blocks: int, steps: int, device: torch.device
) -> Dict[str, float]:
    for name, fn in variants.items():  # compile and warm up
        start = time.perf_counter()
        for _ in range(3):
            fn()
        _synchronize(device)
        print(f"    {name}: first 3 calls {time.perf_counter() - start:.2f} s", flush=True)
    times: Dict[str, list] = {k: [] for k in variants}
    for _ in range(blocks):
        for name, fn in variants.items():
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            _synchronize(device)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--data-dir", type=Path, default=sbn.DEFAULT_DATA, help="folder of binarized_mnist_packed.npz")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(1)
    data = sbn.load_train(args.data_dir)[:50]
    rows = []
    for label, make in [
        ("sbn-linear REINFORCE", lambda: sbn_variants("REINFORCE", data, device)),
        ("sbn-linear ARM", lambda: sbn_variants("ARM", data, device)),
        ("discrete VAE, batch 8", lambda: vae_variants(device)),
    ]:
        print(label, flush=True)
        rows.append((label, time_variants(make(), args.blocks, args.steps, device)))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\nms/step on {where} (torch {torch.__version__}), medians of {args.blocks} interleaved blocks of "
          f"{args.steps} steps, 1 CPU thread")
    head = ["storch eager", "storch compiled", "hand-written eager", "hand-written compiled", "storch compile_step"]
    print("model | " + " | ".join(head) + " | compiled storch / compiled hand | compiled storch / eager hand"
          " | compile_step / compiled hand")
    for label, t in rows:
        cells = " | ".join(f"{t[h]:.3f}" for h in head)
        r1 = t["storch compiled"] / t["hand-written compiled"]
        r2 = t["storch compiled"] / t["hand-written eager"]
        r3 = t["storch compile_step"] / t["hand-written compiled"]
        print(f"{label} | {cells} | {r1:.2f} | {r2:.2f} | {r3:.2f}")
    print("storch compiled: torch.compile of the step (storch's frames eager); storch compile_step: "
          "storch.compile_step(..., backend='inductor') (the VAE's optimizer step outside it, under its own "
          "torch.compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
