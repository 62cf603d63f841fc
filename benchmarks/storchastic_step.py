"""Benchmark Storchastic 0.3.7 (the original library) in its own virtual environment.

Run it with the interpreter of ``.venv-storchastic`` (see benchmarks/README.md), never with ours:
Storchastic also imports as ``storch``, so the two cannot share a process::

    .venv-storchastic/bin/python benchmarks/storchastic_step.py [--quick]

It measures, with one thread:

* per-op overhead: ``a + b``, ``a * b``, ``a.exp()`` and ``torch.relu(a)`` on Storchastic
  tensors with one plate ("data", made by ``storch.denote_independent``) against the same op on
  the plain tensors; overhead = median time (storch) - median time (plain);
* one training step of the discrete VAE of ``handwritten.py`` (same layers, same
  initialisation) with ``storch.method.ScoreFunction("z", n_samples=8,
  baseline_factory="batch_average")``, written as in the manual's tutorial, against the
  hand-written step of ``handwritten.py``, at batch 8 and 100. Steps of the two are interleaved,
  after a warm-up, and the median is reported.

Data: random binary 784-dim vectors (pixels ~ Bernoulli(0.5), fixed seed); the step time does
not depend on the pixel values.

Run on its own, it prints a summary to stderr and, as the last line of stdout, one JSON object
with the results (times of ops in microseconds, of steps in milliseconds). With ``--serve``
(what ``benchmarks/run.py`` uses) it sets up and warms up, then takes commands on stdin to run
its measurements in chunks, so that the parent can interleave them with its own chunks and
machine noise or load changes affect both processes alike (see :func:`serve`).

Compatibility: with torch 2.13.0 on Python 3.11, Storchastic 0.3.7 imports and runs this
benchmark without any shim (checked), so none is installed here. Note that importing
Storchastic sets ``Distribution.set_default_validate_args(False)`` globally (one of its defects,
SPEC section 1), so in this process the hand-written step also runs without argument
validation of ``torch.distributions``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)

# Our own package also lives at <repo>/storch: make sure `import storch` finds the installed
# Storchastic, not it (the repository root is on sys.path with `python -m`, `-c` or PYTHONPATH).
sys.path[:] = [p for p in sys.path
               if os.path.abspath(p or os.curdir) != _REPO]
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402

# Shims for torch 2.13 / Python 3.11: none needed (see the module docstring). Any future shim
# goes here, before `import storch`, with a comment saying what it replaces; never patch the
# installed package files.

import storch  # noqa: E402  (Storchastic 0.3.7)
from torch.distributions import OneHotCategorical  # noqa: E402

from common import FULL, QUICK, OpBench, StepBench, add_measurement_arguments, chunks  # noqa: E402
from handwritten import (  # noqa: E402
    CLASSES,
    LATENTS,
    handwritten_step,
    make_data,
    make_model_and_optimizer,
)

if os.path.abspath(storch.__file__).startswith(os.path.join(_REPO, "storch")):
    sys.exit("storchastic_step.py imported the repository's storch, not Storchastic 0.3.7; "
             "run it with .venv-storchastic/bin/python and without PYTHONPATH")


def storchastic_version() -> str:
    try:
        from importlib.metadata import version
        return version("storchastic")
    except Exception:  # pragma: no cover
        return "unknown"


# ---------------------------------------------------------------- per-op overhead

def make_op_bench(batch: int, dim: int, inner: int) -> OpBench:
    torch.manual_seed(0)
    a0, b0 = torch.randn(batch, dim), torch.randn(batch, dim)
    a = storch.denote_independent(a0.clone(), 0, "data")
    b = storch.denote_independent(b0.clone(), 0, "data")

    def check(name, r):  # the op really runs on Storchastic tensors and keeps the plate
        assert isinstance(r, storch.Tensor) and [p.name for p in r.plates] == ["data"], \
            (name, type(r))

    return OpBench((a0, b0), (a, b), inner, check)


# ---------------------------------------------------------------- VAE step

def storchastic_step(model, optimizer, method, data: torch.Tensor) -> torch.Tensor:
    """One training step written as in the manual's discrete-VAE tutorial."""
    optimizer.zero_grad()
    x = storch.denote_independent(data, 0, "data")
    logits = model.encode(x)
    logits = logits.reshape(logits.shape[:-1] + (LATENTS, CLASSES))
    q = OneHotCategorical(probs=logits.softmax(dim=-1))
    z = method(q)
    prior = OneHotCategorical(probs=torch.ones_like(q.probs) / CLASSES)
    kl = torch.distributions.kl_divergence(q, prior).sum(-1)
    storch.add_cost(kl, "kl-div")
    recon = model.decode(z.reshape(z.shape[:-2] + (LATENTS * CLASSES,)))
    bce = storch.nn.b_binary_cross_entropy(recon, x, reduction="none").sum(-1)
    storch.add_cost(bce, "reconstruction")
    value = storch.backward()
    optimizer.step()
    return value.detach()


def _make_method(n_samples: int):
    return storch.method.ScoreFunction("z", n_samples=n_samples, baseline_factory="batch_average")


def check_same_estimate(n_samples: int, steps: int = 3) -> float:
    """Run both steps from the same initialisation and random seed; return the largest
    difference of the cost estimates (they draw the same samples, so it should be ~0)."""
    data = make_data(8)
    m1, o1 = make_model_and_optimizer()
    m2, o2 = make_model_and_optimizer()
    method = _make_method(n_samples)
    torch.manual_seed(123)
    v1 = [handwritten_step(m1, o1, data, n_samples).item() for _ in range(steps)]
    torch.manual_seed(123)
    v2 = [storchastic_step(m2, o2, method, data).item() for _ in range(steps)]
    return max(abs(x - y) for x, y in zip(v1, v2))


def make_step_bench(batch: int, n_samples: int, warmup: int) -> StepBench:
    data = make_data(batch)
    mh, oh = make_model_and_optimizer()
    ms, os_ = make_model_and_optimizer()
    method = _make_method(n_samples)
    return StepBench({
        "handwritten": lambda: handwritten_step(mh, oh, data, n_samples),
        "storchastic": lambda: storchastic_step(ms, os_, method, data),
    }, warmup)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_measurement_arguments(ap)
    ap.add_argument("--serve", action="store_true",
                    help="take commands on stdin (used by run.py to interleave processes)")
    return ap.parse_args(argv)


class StorchasticBench:
    """All Storchastic measurements, runnable in chunks (see common.py)."""

    def __init__(self, args):
        torch.set_num_threads(1)
        self.args = args
        reps = dict(QUICK if args.quick else FULL)
        if args.step_reps:
            reps["step_reps"] = args.step_reps
        if args.op_reps:
            reps["op_reps"] = args.op_reps
        self.reps = reps
        self.estimate_difference = check_same_estimate(args.samples)
        self.ops = make_op_bench(args.op_batch, args.op_dim, reps["op_inner"])
        self.steps = {b: make_step_bench(b, args.samples, reps["warmup"]) for b in args.batches}

    def run_all(self) -> None:
        for n in chunks(self.reps["op_reps"], self.reps["op_chunk"]):
            self.ops.run_chunk(n)
        for b in self.args.batches:
            for n in chunks(self.reps["step_reps"], self.reps["step_chunk"]):
                self.steps[b].run_chunk(n)

    def result(self) -> dict:
        args = self.args
        steps = {}
        for b, bench in self.steps.items():
            t = bench.summary()
            h, s = t["handwritten"], t["storchastic"]
            steps[str(b)] = {"handwritten_ms": h, "storchastic_ms": s,
                             "ratio": bench.ratio("storchastic", "handwritten"),
                             "steps": len(bench.times["handwritten"])}
        return {
            "library": "storchastic",
            "storchastic_version": storchastic_version(),
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "threads": torch.get_num_threads(),
            "quick": args.quick,
            "reps": self.reps,
            "data": "random binary 784-dim vectors (Bernoulli(0.5)), fixed seed",
            "n_samples": args.samples,
            "op_shape": [args.op_batch, args.op_dim],
            "max_estimate_difference_vs_handwritten": self.estimate_difference,
            "ops": self.ops.summary(),
            "steps": steps,
        }


def reply(obj) -> None:
    """One line of the --serve protocol (prefixed, so that stray prints cannot be mistaken)."""
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(args) -> None:
    """Commands, one per line on stdin; each is answered by one '@@ <json>' line:
    ``ops N`` (N more blocks per op), ``steps B N`` (N more steps per variant at batch B),
    ``result`` (the JSON result), ``quit``. The benchmarks are set up (and warmed up) first,
    then ``@@ {"ready": ...}`` is sent."""
    try:
        bench = StorchasticBench(args)
    except Exception as e:
        reply({"error": f"setup failed: {type(e).__name__}: {e}"})
        raise
    reply({"ready": True, "reps": bench.reps})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "ops":
                bench.ops.run_chunk(int(cmd[1]))
                reply({"ok": True})
            elif cmd[0] == "steps":
                bench.steps[int(cmd[1])].run_chunk(int(cmd[2]))
                reply({"ok": True})
            elif cmd[0] == "result":
                reply({"result": bench.result()})
            elif cmd[0] == "quit":
                reply({"ok": True})
                return
            else:
                reply({"error": f"unknown command {line.strip()!r}"})
        except Exception as e:
            reply({"error": f"{line.strip()!r} failed: {type(e).__name__}: {e}"})


def print_summary(res: dict) -> None:
    print(f"Storchastic {res['storchastic_version']}, torch {res['torch_version']}, "
          f"{res['threads']} thread", file=sys.stderr)
    for name, v in res["ops"].items():
        if isinstance(v, dict):
            print(f"  op {name:5s}: plain {v['plain_us']:7.2f} us  storchastic "
                  f"{v['storch_us']:7.2f} us  overhead {v['overhead_us']:7.2f} us", file=sys.stderr)
    for b, v in res["steps"].items():
        print(f"  VAE step batch {b:>4s}: hand-written {v['handwritten_ms']:8.2f} ms  "
              f"storchastic {v['storchastic_ms']:8.2f} ms  ratio {v['ratio']:.3f}", file=sys.stderr)


if __name__ == "__main__":
    _args = parse_args()
    if _args.serve:
        serve(_args)
    else:
        _bench = StorchasticBench(_args)
        _bench.run_all()
        _res = _bench.result()
        print_summary(_res)
        print(json.dumps(_res))
