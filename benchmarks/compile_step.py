"""A whole training step under ``torch.compile``: eager and compiled, storch and hand-written.

Two models, each step as in the other benchmarks (one thread; CPU, or a GPU with ``--device cuda``):

* ``sbn-linear`` 784-[200] on binarized MNIST, batch 50 (``benchmarks/sbn_step.py``), with
  REINFORCE (n=1) and ARM (one pair);
* the discrete VAE of ``benchmarks/run.py`` (20×10 one-hot latents), batch 8, ScoreFunction with
  8 samples and the leave-one-out baseline (``benchmarks/handwritten.py``).

For each, five variants are timed, interleaved in blocks (medians over blocks): storch eager,
storch compiled (``torch.compile`` of the whole step function, default backend), hand-written
eager and hand-written compiled, and storch under ``storch.compile_step(..., backend="inductor")``
(the step traced once at the aten level, the graph compiled by TorchInductor). On a GPU two more
can be chosen (``--variants``): the hand-written step and ``compile_step`` with
``mode="reduce-overhead"``, TorchInductor's CUDA graphs (one launch replays the step's kernels).
``--models`` picks among the four sbn-linear estimators of ``make bench-sbn`` and the VAE.
Compilation happens before timing (its time is printed). Under ``torch.compile`` storch's own frames run eagerly
(``storch.compiler``), so every operation on a storch tensor is a graph break: expect compiled
storch ≈ eager storch; ``compile_step`` has no storch frames left to run.

Usage::

    .venv/bin/python benchmarks/compile_step.py               # ~2 minutes
    .venv/bin/python benchmarks/compile_step.py --blocks 3 --steps 5   # smoke run
    python benchmarks/compile_step.py --device cuda             # the same table on a GPU
    python benchmarks/compile_step.py --device cuda --models REINFORCE,VAE \
        --variants "hand-written compiled (CUDA graphs),storch compile_step (CUDA graphs)"

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


VARIANTS = (
    "storch eager", "storch compiled", "hand-written eager", "hand-written compiled", "storch compile_step",
    "hand-written compiled (CUDA graphs)", "storch compile_step (CUDA graphs)",
)
CUDA_GRAPHS = {"mode": "reduce-overhead"}  # torch.compile's CUDA graphs (TorchInductor)


def sbn_variants(name: str, data: torch.Tensor, device: torch.device, chosen) -> Dict[str, Callable[[], object]]:
    """The ``chosen`` variants of the sbn-linear step with estimator ``name``, each on a model of its own."""
    hand = sbn.hw_grad(name)
    data = data.to(device)

    def model():
        return sbn.make_model(0)[0].to(device)

    def compile_step(**options):
        m = model()
        return storch.compile_step(functools.partial(sbn.storch_grad, m, method=sbn.make_method(name)), m,
                                   backend="inductor", **options)

    makers = {
        "storch eager": lambda: functools.partial(sbn.storch_grad, model(), data, sbn.make_method(name)),
        "storch compiled": lambda: functools.partial(torch.compile(sbn.storch_grad), model(), data, sbn.make_method(name)),
        "hand-written eager": lambda: functools.partial(hand, model(), data),
        "hand-written compiled": lambda: functools.partial(torch.compile(hand), model(), data),
        "storch compile_step": lambda: functools.partial(compile_step(), data),
        "hand-written compiled (CUDA graphs)": lambda: functools.partial(torch.compile(hand, **CUDA_GRAPHS), model(), data),
        "storch compile_step (CUDA graphs)": lambda: functools.partial(compile_step(**CUDA_GRAPHS), data),
    }
    return {k: makers[k]() for k in chosen}


def vae_variants(device: torch.device, chosen, batch: int = 8, n_samples: int = 8) -> Dict[str, Callable[[], object]]:
    """The ``chosen`` variants of the discrete VAE's step (optimizer step included)."""
    data = make_data(batch).to(device)

    def pair():
        model, optimizer = make_model_and_optimizer()
        model.to(device)  # moves the parameters in place: the optimizer keeps them
        return model, optimizer

    def traced(**options):
        model, optimizer = pair()
        gradient = storch.compile_step(functools.partial(storch_gradient, storch, model, _make_method(storch, n_samples)),
                                       model, backend="inductor", **options)
        optimizer_step = torch.compile(optimizer.step)  # compiled as in the hand-written compiled step

        def step():
            optimizer.zero_grad()
            value = gradient(data)
            optimizer_step()
            return value

        return step

    def storch_eager(step=storch_step):
        model, optimizer = pair()
        method = _make_method(storch, n_samples)
        return lambda: step(storch, model, optimizer, method, data)

    def hand(compiled: bool = True, **options):
        model, optimizer = pair()
        step = torch.compile(handwritten_step, **options) if compiled else handwritten_step
        return lambda: step(model, optimizer, data, n_samples)

    makers = {
        "storch eager": lambda: storch_eager(),
        "storch compiled": lambda: storch_eager(torch.compile(storch_step)),
        "hand-written eager": lambda: hand(compiled=False),
        "hand-written compiled": lambda: hand(),
        "storch compile_step": lambda: traced(),
        "hand-written compiled (CUDA graphs)": lambda: hand(**CUDA_GRAPHS),
        "storch compile_step (CUDA graphs)": lambda: traced(**CUDA_GRAPHS),
    }
    return {k: makers[k]() for k in chosen}


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


MODELS = ("REINFORCE", "RLOO", "ARM", "DisARM", "VAE")
RATIOS = (  # (label, numerator, denominator)
    ("eager storch / eager hand", "storch eager", "hand-written eager"),
    ("compiled storch / compiled hand", "storch compiled", "hand-written compiled"),
    ("compile_step / compiled hand", "storch compile_step", "hand-written compiled"),
    ("compile_step / compiled hand, CUDA graphs", "storch compile_step (CUDA graphs)",
     "hand-written compiled (CUDA graphs)"),
)


def _names(text: str, allowed, what: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {list(allowed)}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--models", default="REINFORCE,ARM,VAE",
                        help=f"comma-separated, from {', '.join(MODELS)} (sbn-linear estimators, the discrete VAE)")
    parser.add_argument("--variants", default=",".join(VARIANTS[:5]),
                        help="comma-separated, from: " + "; ".join(VARIANTS) + " (the CUDA graph variants need a GPU)")
    parser.add_argument("--data-dir", type=Path, default=sbn.DEFAULT_DATA, help="folder of binarized_mnist_packed.npz")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    models, chosen = _names(args.models, MODELS, "models"), _names(args.variants, VARIANTS, "variants")
    torch.set_num_threads(1)
    data = sbn.load_train(args.data_dir)[:50]
    rows = []
    for name in models:
        label = "discrete VAE, batch 8" if name == "VAE" else f"sbn-linear {name}"
        print(label, flush=True)
        variants = vae_variants(device, chosen) if name == "VAE" else sbn_variants(name, data, device, chosen)
        rows.append((label, time_variants(variants, args.blocks, args.steps, device)))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    ratios = [r for r in RATIOS if r[1] in chosen and r[2] in chosen]
    print(f"\nms/step on {where} (torch {torch.__version__}), medians of {args.blocks} interleaved blocks of "
          f"{args.steps} steps, 1 CPU thread")
    print("| model | " + " | ".join(chosen + [r[0] for r in ratios]) + " |")
    print("| --- " * (1 + len(chosen) + len(ratios)) + "|")
    for label, t in rows:
        cells = [f"{t[h]:.3f}" for h in chosen] + [f"{t[a] / t[b]:.2f}" for _, a, b in ratios]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("storch compiled: torch.compile of the step (storch's frames eager); storch compile_step: "
          "storch.compile_step(..., backend='inductor'); CUDA graphs: mode='reduce-overhead' (the VAE's "
          "optimizer step outside compile_step, under its own torch.compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
