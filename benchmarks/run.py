"""Side-by-side performance benchmark of storch (SPEC section 6).

Run in our virtual environment, from the repository root::

    .venv/bin/python benchmarks/run.py            # full run (about a minute or two)
    .venv/bin/python benchmarks/run.py --quick    # smoke run (a few seconds)

In one process, with one thread, it measures (interleaving the variants so that machine noise
affects all of them alike):

* per-op time of ``a + b``, ``a * b``, ``a.exp()`` and ``torch.relu(a)`` on plain tensors and on
  storch tensors with one plate (``storch.denote_independent``); per-op overhead = storch time
  minus plain time (medians);
* one training step of the discrete VAE of ``handwritten.py`` (784-512-256-(20x10)-256-512-784,
  score function with 8 samples and the leave-one-out baseline, KL to a uniform prior + Bernoulli
  reconstruction cost, Adam) at batch 8 and 100: hand-written in plain PyTorch, the same with raw
  tensor ops instead of ``torch.distributions`` (for information), the hand-written step on a
  do-nothing ``__torch_function__`` subclass (the *floor*, ``common.FloorTensor``: what any such
  library pays before its own work), and with storch, written as in the manual's tutorial.

Then, when ``.venv-storchastic/bin/python`` exists, it runs ``storchastic_step.py`` in that
interpreter (Storchastic 0.3.7 also imports as ``storch``, so it needs its own process) and
parses the JSON on its last line.

It prints one table of absolute times and ratios, with the SPEC targets, and writes it to
``benchmarks/results/latest.txt`` (and the raw numbers to ``latest.json``). The exit status is
1 when a part could not be measured.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
if _REPO not in sys.path:  # our storch, also when it is not pip-installed
    sys.path.insert(1, _REPO)

import torch  # noqa: E402

from common import FULL, QUICK, OpBench, StepBench, add_measurement_arguments, chunks, floor_view  # noqa: E402
from handwritten import (  # noqa: E402
    CLASSES,
    LATENTS,
    handwritten_step,
    handwritten_step_raw,
    make_data,
    make_model_and_optimizer,
)

STORCHASTIC_PY = os.path.join(_REPO, ".venv-storchastic", "bin", "python")
RESULTS_DIR = os.path.join(_HERE, "results")

# SPEC section 6 targets
TARGET_STEP_RATIO_B8 = 1.10
TARGET_COMPILED_RATIO_B8 = 1.05  # issue 10, item 3
TARGET_OP_OVERHEAD_US = 8.0
TARGET_OVERHEAD_FACTOR = 4.0


# ---------------------------------------------------------------- storch (ours)

def make_op_bench(storch, batch: int, dim: int, inner: int) -> OpBench:
    """Plain vs storch tensors; plain vs plain when storch is None (only the plain column is
    then reported)."""
    torch.manual_seed(0)
    a0, b0 = torch.randn(batch, dim), torch.randn(batch, dim)
    if storch is None:
        return OpBench((a0, b0), (a0.clone(), b0.clone()), inner)
    a = storch.denote_independent(a0.clone(), 0, "data")
    b = storch.denote_independent(b0.clone(), 0, "data")

    def check(name, r):  # the op really runs on storch tensors and keeps the plate
        assert isinstance(r, storch.Tensor), (name, type(r))
        names = [p.name for p in r.plates]
        assert names == ["data"], (name, names)

    return OpBench((a0, b0), (a, b), inner, check)


def storch_step(storch, model, optimizer, method, data: torch.Tensor) -> torch.Tensor:
    """One training step with storch, written as in the manual's discrete-VAE tutorial."""
    optimizer.zero_grad()
    value = storch_gradient(storch, model, method, data)
    optimizer.step()
    return value.detach()


def storch_gradient(storch, model, method, data: torch.Tensor) -> torch.Tensor:
    """The step without its optimizer: sample, register the costs, ``storch.backward()``."""
    x = storch.denote_independent(data, 0, "data")
    logits = model.encode(x)
    logits = logits.reshape(logits.shape[:-1] + (LATENTS, CLASSES))
    q = torch.distributions.OneHotCategorical(probs=logits.softmax(dim=-1))
    z = method(q)
    prior = torch.distributions.OneHotCategorical(probs=torch.ones_like(q.probs) / CLASSES)
    kl = torch.distributions.kl_divergence(q, prior).sum(-1)
    storch.add_cost(kl, "kl-div")
    recon = model.decode(z.reshape(z.shape[:-2] + (LATENTS * CLASSES,)))
    bce = storch.nn.b_binary_cross_entropy(recon, x, reduction="none").sum(-1)
    storch.add_cost(bce, "reconstruction")
    return storch.backward()


def compiled_storch_step(storch, model, optimizer, method):
    """:func:`storch_step` with its gradient under ``storch.compile_step`` (traced on the first call)."""
    gradient = storch.compile_step(functools.partial(storch_gradient, storch, model, method), model)

    def step(data: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        value = gradient(data)
        optimizer.step()
        return value

    return step


def _make_method(storch, n_samples: int):
    return storch.method.ScoreFunction("z", n_samples=n_samples, baseline_factory="batch_average")


def storch_estimate_difference(storch, n_samples: int, steps: int = 3) -> float:
    """Largest difference of the cost estimates of the storch and hand-written steps run from
    the same initialisation and seed (0 up to rounding if storch draws the same samples)."""
    data = make_data(8)
    m1, o1 = make_model_and_optimizer()
    m2, o2 = make_model_and_optimizer()
    method = _make_method(storch, n_samples)
    torch.manual_seed(123)
    v1 = [handwritten_step(m1, o1, data, n_samples).item() for _ in range(steps)]
    torch.manual_seed(123)
    v2 = [float(storch_step(storch, m2, o2, method, data)) for _ in range(steps)]
    return max(abs(x - y) for x, y in zip(v1, v2))


def make_step_bench(storch, batch: int, n_samples: int, warmup: int) -> StepBench:
    data = make_data(batch)
    fns = {}
    mh, oh = make_model_and_optimizer()
    fns["handwritten"] = lambda: handwritten_step(mh, oh, data, n_samples)
    mr, or_ = make_model_and_optimizer()
    fns["handwritten_raw"] = lambda: handwritten_step_raw(mr, or_, data, n_samples)
    mf, of = make_model_and_optimizer()
    floor_data = floor_view(data)
    fns["floor"] = lambda: handwritten_step(mf, of, floor_data, n_samples)
    if storch is not None:
        ms, os_ = make_model_and_optimizer()
        method = _make_method(storch, n_samples)
        fns["storch"] = lambda: storch_step(storch, ms, os_, method, data)
        mc, oc = make_model_and_optimizer()
        compiled = compiled_storch_step(storch, mc, oc, _make_method(storch, n_samples))
        fns["storch_compiled"] = lambda: compiled(data)
    return StepBench(fns, warmup)


def step_summary(bench: StepBench) -> dict:
    t = bench.summary()
    out = {f"{k}_ms": v for k, v in t.items()}
    out["steps"] = len(bench.times["handwritten"])
    out["raw_ratio"] = bench.ratio("handwritten_raw", "handwritten")
    out["floor_ratio"] = bench.ratio("floor", "handwritten")
    if "storch" in t:
        out["ratio"] = bench.ratio("storch", "handwritten")
        out["compiled_ratio"] = bench.ratio("storch_compiled", "handwritten")
    return out


# ---------------------------------------------------------------- Storchastic (subprocess)

class StorchasticChild:
    """``storchastic_step.py --serve`` in .venv-storchastic, driven chunk by chunk."""

    def __init__(self, args, timeout: float = 1800):
        cmd = [STORCHASTIC_PY, os.path.join(_HERE, "storchastic_step.py"), "--serve",
               "--batches", *map(str, args.batches), "--samples", str(args.samples),
               "--op-batch", str(args.op_batch), "--op-dim", str(args.op_dim)]
        if args.quick:
            cmd.append("--quick")
        if args.step_reps:
            cmd += ["--step-reps", str(args.step_reps)]
        if args.op_reps:
            cmd += ["--op-reps", str(args.op_reps)]
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # it must import the installed Storchastic, not our storch
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env, cwd=_HERE)
        self.watchdog = threading.Timer(timeout, self.proc.kill)
        self.watchdog.daemon = True
        self.watchdog.start()
        self.ready = self._read()  # set-up and warm-up done

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                self.stderr.seek(0)
                raise RuntimeError(f"storchastic_step.py exited ({self.proc.returncode}):\n"
                                   + self.stderr.read()[-3000:])
            if line.startswith("@@ "):
                msg = json.loads(line[3:])
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.watchdog.cancel()
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


# ---------------------------------------------------------------- report

def _f(x, fmt="{:.2f}", na="n/a"):
    return na if x is None else fmt.format(x)


def _target(value, ok: bool) -> str:
    return "n/a" if value is None else ("PASS" if ok else "FAIL")


def format_table(res: dict) -> str:
    L = []
    L.append("storch benchmark (SPEC section 6)")
    L.append(f"  {res['date']}  torch {res['torch_version']}  Python {res['python_version']}  "
             f"{res['threads']} thread  {res['machine']}{'  [--quick]' if res['quick'] else ''}")
    sc = res.get("storchastic")
    if sc:
        L.append(f"  Storchastic {sc['storchastic_version']} (torch {sc['torch_version']}, "
                 f"own venv/process)")
    else:
        L.append(f"  Storchastic: {res.get('storchastic_error', 'not run')}")
    if res.get("storch_error"):
        L.append(f"  storch: NOT MEASURED: {res['storch_error']}")
    L.append("")

    ob, od = res["op_shape"]
    L.append(f"Per-op time, tensors of shape {ob}x{od} with one plate 'data' (median, us)")
    hdr = (f"  {'op':6s}{'plain':>9s}{'storch':>9s}{'overhead':>10s}  |"
           f"{'plain*':>9s}{'Storchastic':>13s}{'overhead':>10s}  |{'Sc/storch overhead':>20s}")
    L.append(hdr)
    L.append("  " + "-" * (len(hdr) - 2))
    ops = res.get("ops") or {}
    sops = (sc or {}).get("ops") or {}
    for name in ops:
        if name == "mean_overhead_us" or not isinstance(ops[name], dict):
            continue
        o = ops[name]
        s = sops.get(name, {})
        fac = (s["overhead_us"] / o["overhead_us"]
               if s and o.get("overhead_us") and o["overhead_us"] > 0 else None)
        L.append(f"  {name:6s}{_f(o.get('plain_us')):>9s}{_f(o.get('storch_us')):>9s}"
                 f"{_f(o.get('overhead_us')):>10s}  |{_f(s.get('plain_us')):>9s}"
                 f"{_f(s.get('storch_us')):>13s}{_f(s.get('overhead_us')):>10s}  |"
                 f"{_f(fac, '{:.1f}x'):>20s}")
    mo = ops.get("mean_overhead_us")
    smo = sops.get("mean_overhead_us")
    mfac = smo / mo if (mo and smo and mo > 0) else None
    L.append(f"  {'mean':6s}{'':>9s}{'':>9s}{_f(mo):>10s}  |{'':>9s}{'':>13s}{_f(smo):>10s}  |"
             f"{_f(mfac, '{:.1f}x'):>20s}")
    L.append("  overhead: median of (storch - plain) over adjacent block pairs; "
             "* plain times measured in Storchastic's process")
    L.append("")

    L.append(f"Discrete-VAE training step, 784-512-256-(20x10)-256-512-784, ScoreFunction "
             f"n={res['n_samples']} + batch_average, Adam (median, ms)")
    hdr = (f"  {'batch':>5s}{'hand':>9s}{'raw ops':>9s}{'floor':>9s}{'floor/hand':>12s}{'storch':>9s}"
           f"{'storch/hand':>13s}{'compiled':>10s}{'comp/hand':>11s}  |{'hand*':>9s}{'Storchastic':>13s}"
           f"{'Sc/hand':>9s}")
    L.append(hdr)
    L.append("  " + "-" * (len(hdr) - 2))
    for b, st in res["steps"].items():
        s = ((sc or {}).get("steps") or {}).get(b, {})
        L.append(f"  {b:>5s}{_f(st.get('handwritten_ms')):>9s}{_f(st.get('handwritten_raw_ms')):>9s}"
                 f"{_f(st.get('floor_ms')):>9s}{_f(st.get('floor_ratio'), '{:.3f}'):>12s}"
                 f"{_f(st.get('storch_ms')):>9s}{_f(st.get('ratio'), '{:.3f}'):>13s}"
                 f"{_f(st.get('storch_compiled_ms')):>10s}{_f(st.get('compiled_ratio'), '{:.3f}'):>11s}  |"
                 f"{_f(s.get('handwritten_ms')):>9s}{_f(s.get('storchastic_ms')):>13s}"
                 f"{_f(s.get('ratio'), '{:.3f}'):>9s}")
    L.append("  hand: plain PyTorch with torch.distributions (the reference); raw ops: the same "
             "estimator without torch.distributions")
    L.append("  floor: the hand-written step on a tensor subclass whose __torch_function__ only calls the "
             "function (what any __torch_function__ library pays before its own work)")
    L.append("  compiled: the storch step's gradient under storch.compile_step (traced once, replayed as a "
             "graph of aten operations; optimizer outside)")
    L.append("  ratios: median over rounds of the ratio of the two steps timed in the same round")
    L.append("  (* measured in Storchastic's process, where Storchastic has switched off "
             "torch.distributions argument validation globally)")
    if res.get("storch_estimate_difference") is not None:
        L.append(f"  same seed, 3 steps: |storch estimate - hand-written estimate| <= "
                 f"{res['storch_estimate_difference']:.3g}")
    if sc and sc.get("max_estimate_difference_vs_handwritten") is not None:
        L.append(f"  same seed, 3 steps: |Storchastic estimate - hand-written estimate| <= "
                 f"{sc['max_estimate_difference_vs_handwritten']:.3g}")
    L.append("")

    L.append("SPEC targets")
    r8 = res["steps"].get("8", {}).get("ratio")
    c8 = res["steps"].get("8", {}).get("compiled_ratio")
    rows = [
        (f"storch step / hand-written step, batch 8 <= {TARGET_STEP_RATIO_B8:.2f}",
         _f(r8, "{:.3f}"), _target(r8, r8 is not None and r8 <= TARGET_STEP_RATIO_B8)),
        (f"storch.compile_step step / hand-written step, batch 8 <= {TARGET_COMPILED_RATIO_B8:.2f}",
         _f(c8, "{:.3f}"), _target(c8, c8 is not None and c8 <= TARGET_COMPILED_RATIO_B8)),
        (f"storch per-op overhead (mean) <= {TARGET_OP_OVERHEAD_US:.0f} us",
         _f(mo, "{:.2f} us"), _target(mo, mo is not None and mo <= TARGET_OP_OVERHEAD_US)),
        (f"Storchastic / storch per-op overhead >= {TARGET_OVERHEAD_FACTOR:.0f}x",
         _f(mfac, "{:.1f}x"),
         _target(mfac, mfac is not None and mfac >= TARGET_OVERHEAD_FACTOR)),
    ]
    for label, value, verdict in rows:
        L.append(f"  {label:48s}{value:>10s}  {verdict}")
    return "\n".join(L)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _error(res: dict, msg: str) -> None:
    res["storch_error"] = (res["storch_error"] + "; " if res.get("storch_error") else "") + msg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="storch vs plain PyTorch vs Storchastic 0.3.7")
    add_measurement_arguments(ap)
    ap.add_argument("--no-storchastic", action="store_true",
                    help="skip the Storchastic 0.3.7 subprocess")
    ap.add_argument("--output", default=os.path.join(RESULTS_DIR, "latest.txt"))
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    reps = dict(QUICK if args.quick else FULL)
    if args.step_reps:
        reps["step_reps"] = args.step_reps
    if args.op_reps:
        reps["op_reps"] = args.op_reps
    failed = False
    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "machine": f"{_cpu_name()}, {os.cpu_count()} cpus",
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "reps": reps,
        "n_samples": args.samples,
        "op_shape": [args.op_batch, args.op_dim],
        "data": "random binary 784-dim vectors (Bernoulli(0.5)), fixed seed",
    }

    storch = None
    try:
        import storch as _storch
        _storch.method.ScoreFunction  # noqa: B018  (the core must be there)
        storch = _storch
    except Exception as e:  # report it and measure the rest
        _error(res, f"import storch failed: {type(e).__name__}: {e}")
        failed = True
    if storch is not None:
        try:
            res["storch_estimate_difference"] = storch_estimate_difference(storch, args.samples)
        except Exception as e:
            traceback.print_exc()
            _error(res, f"VAE step failed: {type(e).__name__}: {e}")
            failed = True

    child = None
    if args.no_storchastic:
        res["storchastic_error"] = "skipped (--no-storchastic)"
    elif not os.path.exists(STORCHASTIC_PY):
        res["storchastic_error"] = (f"not run: {os.path.relpath(STORCHASTIC_PY, _REPO)} missing "
                                    "(make bench-storchastic creates it)")
    else:
        print("starting Storchastic 0.3.7 in .venv-storchastic ...", file=sys.stderr)
        try:
            child = StorchasticChild(args)
        except Exception as e:
            res["storchastic_error"] = f"failed: {type(e).__name__}: {e}"
            failed = True

    def interleave(own, child_cmd: str, sizes) -> None:
        """Our chunk and the child's chunk take turns (alternating which goes first)."""
        nonlocal child, failed
        for i, n in enumerate(sizes):
            if i % 2 == 0:
                own(n)
            if child is not None:
                try:
                    child.ask(child_cmd.format(n=n))
                except Exception as e:
                    res["storchastic_error"] = f"failed: {type(e).__name__}: {e}"
                    failed = True
                    child = None
            if i % 2 == 1:
                own(n)

    try:
        print("timing ops ...", file=sys.stderr)
        ops_ok = storch is not None
        try:
            op_bench = make_op_bench(storch, args.op_batch, args.op_dim, reps["op_inner"])
        except Exception as e:
            traceback.print_exc()
            _error(res, f"per-op benchmark failed: {type(e).__name__}: {e}")
            failed, ops_ok = True, False
            op_bench = make_op_bench(None, args.op_batch, args.op_dim, reps["op_inner"])
        interleave(op_bench.run_chunk, "ops {n}", chunks(reps["op_reps"], reps["op_chunk"]))
        res["ops"] = op_bench.summary()
        if not ops_ok:
            res["ops"] = {k: {"plain_us": v["plain_us"]}
                          for k, v in res["ops"].items() if isinstance(v, dict)}

        res["steps"] = {}
        step_storch = storch if res.get("storch_estimate_difference") is not None else None
        for b in args.batches:
            print(f"timing VAE steps at batch {b} ...", file=sys.stderr)
            bench = make_step_bench(step_storch, b, args.samples, reps["warmup"])
            interleave(bench.run_chunk, f"steps {b} {{n}}",
                       chunks(reps["step_reps"], reps["step_chunk"]))
            res["steps"][str(b)] = step_summary(bench)

        if child is not None:
            res["storchastic"] = child.ask("result")["result"]
    finally:
        if child is not None:
            child.close()

    table = format_table(res)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as fh:
        fh.write(table + "\n")
    with open(os.path.splitext(args.output)[0] + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"\nwritten to {os.path.relpath(args.output, os.getcwd())}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
