"""One benchmark run: training loop, evaluation, gradient variance, checkpoints and output files.

A run directory holds ``config.json`` (everything needed to rerun or resume it), ``metrics.csv``
(one row per evaluation), ``summary.json`` (the final metrics), ``checkpoint.pt`` (with
``--checkpoint-every``) and ``plots.png`` (when matplotlib is installed).

Randomness: the global torch generator drives the model's initialisation and the estimators'
samples; the minibatch order and the dynamic binarisation have generators of their own. Evaluations
and gradient-variance probes run under `torch.random.fork_rng` with seeds of their own, so they
do not change the training trajectory, and a resumed run repeats an uninterrupted one exactly.

Checkpoints hold state dicts only (model, optimizer, each method's ``state_dict`` with its own
optimizer state and baselines, generator states), so they load with ``torch.load(weights_only=True)``.

Data parallel (``torchrun --nproc-per-node N -m storch.bench --distributed ...``, gloo on CPU): every
rank builds the same model (same seed), wrapped in ``DistributedDataParallel``; every rank draws the
same minibatch of ``--batch-size`` data and trains on its own contiguous slice of ``batch-size / N``
of them, with a random stream of its own for the estimators' samples. DDP averages the model's
gradients, so one step is the step of one process on the whole minibatch with ``N`` times as many
independent samples drawn. The methods keep their own state in sync (`storch.distributed`).
Rank 0 alone evaluates, prints and writes files; a checkpoint holds every rank's random state and
method state, and resumes with the same number of ranks.

Devices (``--device cuda``): the model is initialised on the CPU (the same initialisation as a CPU
run of the same seed), then moved with its methods to the device; minibatches are drawn and
binarised on the CPU and moved there. The estimators then draw their samples from the device's
generator, so a GPU run follows its own random stream; evaluations fork that generator too, and a
checkpoint holds its state. Under ``torchrun`` each rank takes the GPU of its ``LOCAL_RANK`` and
the process group uses NCCL.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

import storch
from storch import distributed
from storch.bench.data import Dataset, eval_subset, load_dataset
from storch.bench.estimators import (
    ESTIMATORS,
    applicable,
    build_methods,
    samples_for_budget,
)
from storch.bench.memory import MemoryEstimate, check_memory, estimate_memory
from storch.bench.models import (
    BenchModel,
    estimator_nelbo,
    evaluate_bounds,
    make_model,
    storch_story,
)
from storch.compiled_step import CompiledStep

__all__ = ["METRIC_FIELDS", "resume", "run", "run_label"]

#: ``seconds``: wall-clock seconds of the training steps so far; ``cpu_seconds``: the CPU time this process
#: spent in them (`time.process_time`, all its threads), what ``--seconds`` budgets;
#: ``train_objective``: the training loss as the estimator computes it, averaged over the steps since the
#: previous row (a relaxed −ELBO for a relaxation); ``*_nelbo``: −ELBO with hard samples on the fixed
#: evaluation subsets; ``train_relaxed_nelbo``: a relaxation's objective (relaxed samples) on the
#: training subset, empty for the other estimators
METRIC_FIELDS = ["step", "seconds", "train_objective", "train_nelbo", "train_relaxed_nelbo", "valid_nelbo",
                 "test_nelbo", "grad_logvar", "ms_per_step", "cpu_seconds"]

# the fields of config.json; defaults for the CLI
DEFAULTS: dict[str, Any] = {
    "model": "sbn-linear", "data": "digits", "data_dir": None, "estimator": "score-function", "objective": "elbo",
    "n_samples": None, "budget": None, "baseline": None, "temperature": None, "spsa_c": None, "latent_dim": None,
    "categories": None, "batch_size": 50, "lr": 1e-3, "steps": 1000, "seconds": None, "seed": 0, "eval_every": None,
    "eval_size": 1000, "eval_k": 200, "eval_elbo_k": 10, "var_every": None, "var_reps": 20,
    "checkpoint_every": None, "threads": None, "device": "cpu", "memory_check": True,
}


def resolve_device(name: str) -> torch.device:
    """``--device`` as a concrete device: ``cuda`` becomes the current CUDA device (under torchrun,
    the one of ``LOCAL_RANK``). Raises ``ValueError`` when the device is not available."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r}: {error}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available (torch.cuda.is_available() is False); "
                             "use --device cpu, or install a CUDA build of torch")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: storch-bench runs on 'cpu' or 'cuda'")
    return device


def run_label(cfg: dict[str, Any]) -> str:
    """``estimator(options)``: the name under which ``compare`` groups runs (the seeds of one setting).

    The objective, a device other than the CPU and ``--compile-step`` are part of it, so that
    ``compare`` shows a compiled or a GPU run beside the eager CPU run instead of averaging them as
    seeds of one row."""
    est = ESTIMATORS[cfg["estimator"]]
    opts = [f"{o}={cfg[o]}" for o in est.options if cfg.get(o) is not None]
    opts.append(f"n={cfg['n_samples_resolved']}")
    label = f"{est.name}({','.join(opts)})"
    if cfg["objective"] != "elbo":
        label += "/iwae"
    if (cfg.get("device") or "cpu") != "cpu":
        label += f" {cfg['device']}"
    if cfg.get("compile_step"):
        label += " compiled"
    return label


class Batches:
    """Shuffled minibatches, cycled epoch after epoch; its state is part of a checkpoint."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch = n, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.perm, self.pos = torch.randperm(n, generator=self.gen), 0

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > self.n:
            self.perm, self.pos = torch.randperm(self.n, generator=self.gen), 0
        idx = self.perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return idx

    def state_dict(self):
        return {"gen": self.gen.get_state(), "perm": self.perm.clone(), "pos": self.pos}

    def load_state_dict(self, s):
        self.gen.set_state(s["gen"])
        self.perm, self.pos = s["perm"].clone(), s["pos"]


def _from_main(fn):
    """``fn()`` run on rank 0 alone; every rank gets its result, or raises its exception."""
    if not distributed.syncing():
        return fn()
    box: list[Any] = [None]
    if distributed.is_main_process():
        try:
            box[0] = ("ok", fn())
        except Exception as error:  # noqa: BLE001  (handed to every rank, raised there)
            box[0] = ("error", error)
    torch.distributed.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


class Run:
    """A run being built, trained or resumed (see `run` and `resume`)."""

    def __init__(self, cfg: dict[str, Any], run_dir: Path, data: Dataset | None = None, progress: bool = True,
                 log=print):
        self.cfg, self.dir, self.log = cfg, Path(run_dir), log
        self.world, self.rank = distributed.world_size(), distributed.rank()
        self.main = self.rank == 0
        self.progress = progress and self.main
        if cfg["batch_size"] % self.world:
            raise ValueError(f"--batch-size {cfg['batch_size']} does not split evenly over {self.world} ranks; "
                             f"use a multiple of {self.world}")
        self.device = resolve_device(cfg.get("device") or "cpu")
        seconds = cfg.get("seconds")
        if seconds is not None and not seconds > 0:
            raise ValueError(f"--seconds {seconds}: give a positive number of CPU seconds of training")
        if seconds is not None and self.world > 1:
            raise ValueError("--seconds does not run with --distributed (each rank measures its own CPU time, and "
                             "the ranks must stop at the same step); give --steps instead")
        if cfg["steps"] is None and seconds is None:
            raise ValueError("give --steps or --seconds: how long the run trains")
        self.data = data if data is not None else load_dataset(cfg["data"], cfg.get("data_dir"))
        torch.manual_seed(cfg["seed"])
        self.model: BenchModel = make_model(cfg["model"], self.data.input_dim, self.data.train_mean,
                                            cfg.get("latent_dim"), cfg.get("categories")).to(self.device)
        est = self.estimator = ESTIMATORS[cfg["estimator"]]
        if cfg["objective"] == "iwae" and not self.model.iwae_ok:
            raise ValueError(f"--objective iwae: {cfg['model']} has several stochastic layers; the bound needs "
                             "every later node reparameterized (use --objective elbo)")
        reason = applicable(est, self.model.latents, cfg["objective"])
        if reason:
            raise ValueError(reason)
        n, evals = samples_for_budget(est, self.model.latents, cfg.get("budget"), cfg.get("n_samples"))
        cfg["n_samples_resolved"], cfg["evals_per_datum"] = n, evals
        cfg["label"] = run_label(cfg)
        self.methods = build_methods(est, self.model.latents, n, _Namespace(cfg))
        for lat in self.model.latents:  # Auto's candidates exist before a checkpoint is loaded
            if isinstance(self.methods[lat.name], storch.method.Auto):
                self.methods[lat.name].build(lat.dummy())
        for method in self.methods.values():
            method.to(self.device)  # control variates, temperatures, baselines' buffers
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg["lr"])
        for method in self.methods.values():  # Auto clears Adam's state when its first round ends
            if isinstance(method, storch.method.Auto):
                method.optimizer = self.opt
        # the module the training steps call: DDP averages its gradients over the ranks
        self.train_module: torch.nn.Module = self.model
        if self.world > 1:
            self.train_module = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            torch.manual_seed((cfg["seed"] + 1) * 1_000_003 + self.rank)  # each rank its own samples
        self.compiled_step = self._compile_step() if cfg.get("compile_step") else None
        self.batches = Batches(self.data.train.shape[0], cfg["batch_size"], cfg["seed"] + 1)
        self.bin_gen = torch.Generator().manual_seed(cfg["seed"] + 2)
        self.step, self.train_time, self.rows = 0, 0.0, []
        self.cpu_time = 0.0  # CPU seconds of this process in the training steps (what --seconds budgets)
        # the steps in which storch.compile_step traced (their seconds are in train_time): ms/step leaves
        # them out, so that a short compiled run reports what its replays cost
        self.trace_steps, self.trace_time = 0, 0.0
        self._acc, self._acc_n, self._acc_time = 0.0, 0, 0.0
        # fixed evaluation subsets (dynamic data: binarised once) and the variance minibatch
        k = cfg["eval_size"]
        g = torch.Generator().manual_seed(12345)
        eval_sets = {"train": self.data.binarize(eval_subset(self.data.train, k), g),
                     "valid": eval_subset(self.data.valid, k), "test": eval_subset(self.data.test, k)}
        self.eval_sets = {split: x.to(self.device) for split, x in eval_sets.items()}
        self.var_batch = self.eval_sets["train"][: cfg["batch_size"]]
        self.memory = self._estimate_memory()
        if cfg.get("memory_check", True):
            check_memory(self.memory, cfg["model"], cfg["label"])

    def _estimate_memory(self) -> MemoryEstimate:
        """The memory of a training step and of an evaluation (see `storch.bench.memory`).

        On the CPU the ranks of a data-parallel run share the host, so the whole minibatch counts; on
        CUDA each rank holds its own slice on its own GPU.
        """
        cfg = self.cfg
        batch = cfg["batch_size"] // self.world if self.device.type == "cuda" else cfg["batch_size"]
        return estimate_memory(cfg["evals_per_datum"], batch, self.model.point_width(), cfg["eval_k"],
                               cfg["eval_size"], self.device)

    def header(self) -> str:
        """What the run is and what it costs, printed before its first step."""
        cfg = self.cfg
        ranks = f", {self.world} ranks" if self.world > 1 else ""
        threads = torch.get_num_threads()
        length = _length(cfg)
        return (f"storch-bench: {cfg['model']} on {cfg['data']}, {cfg['label']}\n  seed {cfg['seed']}, batch size "
                f"{cfg['batch_size']}, {length}; {self.device}{ranks}, {threads} "
                f"thread{'s' if threads > 1 else ''}\n  {self.memory.summary()}")

    # ---------------------------------------------------------------- training
    def train_step(self) -> float:
        storch.reset()
        self.opt.zero_grad(set_to_none=True)
        # every rank draws (and binarises) the same minibatch, then keeps its own slice of it
        x = self.data.binarize(self.data.train[self.batches.next()], self.bin_gen).to(self.device)
        if self.world > 1:
            size = x.shape[0] // self.world
            x = x[self.rank * size:(self.rank + 1) * size]
        if self.compiled_step is not None:
            loss = self.compiled_step(x)
        else:
            storch_story(self.train_module, x, self.methods, self.cfg["objective"])
            loss = storch.backward()
        self.opt.step()
        if self.world > 1:
            distributed.all_reduce_mean_([loss])  # the objective on the whole minibatch
        return float(loss)

    def _compile_step(self) -> CompiledStep:
        """The training step under `storch.compile_step` (the model and the methods' modules)."""
        if self.world > 1:
            raise ValueError("--compile-step does not run with --distributed (DDP's gradient hooks are not "
                             "traced); train eagerly on several ranks")
        model, methods, objective = self.model, self.methods, self.cfg["objective"]

        def step(x: torch.Tensor) -> torch.Tensor:
            storch_story(model, x, methods, objective)
            return storch.backward()

        return storch.compile_step(step, model, *methods.values())

    def _forked_rng(self):
        """The random streams of the run's devices, restored on exit (evaluations and probes do not
        change the training trajectory)."""
        return torch.random.fork_rng(devices=[self.device.index] if self.device.type == "cuda" else [])

    def grad_log_variance(self) -> float:
        """log Σ_coordinates Var[ĝ] of the encoder's first layer weight over ``var_reps`` estimates on
        one fixed minibatch (each with a fresh copy of the estimators, so none learns from the probes)."""
        w = self.model.encoder_weight()
        grads = []
        # rank 0 alone probes: the methods' collectives must not run (local_only)
        with self._forked_rng(), distributed.local_only():
            torch.manual_seed(self.cfg["seed"] * 7919 + self.step + 1)
            for _ in range(self.cfg["var_reps"]):
                methods = copy.deepcopy(self.methods)
                storch.reset()
                self.model.zero_grad(set_to_none=True)
                storch_story(self.model, self.var_batch, methods, self.cfg["objective"])
                storch.backward()
                grads.append(w.grad.detach().flatten().clone())
        self.model.zero_grad(set_to_none=True)
        total = float(torch.stack(grads).var(0).sum())
        return math.log(total) if total > 0 else float("-inf")

    def relaxed_nelbo(self) -> float:
        """A relaxation's training objective (relaxed samples) on the training subset, in nats per datum.

        Drawn by a copy of the run's methods (their temperature; no state changes), on the same data
        as ``train_nelbo`` (hard samples), so the two compare like with like.
        """
        methods = copy.deepcopy(self.methods)
        with distributed.local_only():  # rank 0 alone evaluates: no collectives
            return estimator_nelbo(self.model, self.eval_sets["train"], methods, self.cfg["batch_size"])

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """−ELBO (hard samples) on each evaluation subset, a relaxation's relaxed −ELBO on the training
        subset, and at the end the test set's importance-weighted bound."""
        out = {}
        with self._forked_rng():
            torch.manual_seed(self.cfg["seed"] * 104729 + self.step)
            for split, x in self.eval_sets.items():
                out[f"{split}_nelbo"], _ = evaluate_bounds(self.model, x, self.cfg["eval_elbo_k"])
            if self.estimator.relaxed:
                out["train_relaxed_nelbo"] = self.relaxed_nelbo()
            if final:
                out["test_nelbo_k"], out["test_nll"] = evaluate_bounds(self.model, self.eval_sets["test"],
                                                                      self.cfg["eval_k"])
        return out

    def record(self, final: bool = False) -> dict[str, float]:
        cfg = self.cfg
        row = {"step": self.step, "seconds": round(self.train_time, 4), "cpu_seconds": round(self.cpu_time, 4),
               "train_objective": self._acc / self._acc_n if self._acc_n else "",
               "ms_per_step": 1000.0 * self._acc_time / self._acc_n if self._acc_n else ""}
        ev = self.evaluate(final)
        row.update({k: ev[k] for k in ("train_nelbo", "valid_nelbo", "test_nelbo")})
        row["train_relaxed_nelbo"] = ev.get("train_relaxed_nelbo", "")
        var_every = cfg.get("var_every")  # None: no probes; 0: at every evaluation
        row["grad_logvar"] = (self.grad_log_variance()
                              if var_every is not None and (var_every == 0 or self.step % var_every == 0 or final)
                              else "")
        self.rows.append(row)
        self._acc, self._acc_n, self._acc_time = 0.0, 0, 0.0
        self.write_metrics()
        return ev

    def write_metrics(self):
        with open(self.dir / "metrics.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
            w.writeheader()
            w.writerows(self.rows)

    # ---------------------------------------------------------------- checkpoints
    def _rank_state(self) -> dict[str, Any]:
        """What differs between ranks: the random stream and the methods' state (e.g. per-rank baselines)."""
        state = {"rng": torch.get_rng_state(), "methods": {k: m.state_dict() for k, m in self.methods.items()}}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def save_checkpoint(self):
        """Write ``checkpoint.pt`` (state dicts only; every rank takes part, rank 0 writes)."""
        ranks = [self._rank_state()]
        if self.world > 1:
            gathered: list[Any] | None = [None] * self.world if self.main else None
            torch.distributed.gather_object(ranks[0], gathered, dst=0)
            ranks = gathered  # type: ignore[assignment]
        if not self.main:
            return
        state = {
            "step": self.step, "train_time": self.train_time, "cpu_time": self.cpu_time, "rows": self.rows,
            "traces": (self.trace_steps, self.trace_time),
            "acc": (self._acc, self._acc_n, self._acc_time),
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
            "world_size": self.world, "ranks": ranks,
            "batches": self.batches.state_dict(), "bin_gen": self.bin_gen.get_state(),
        }
        tmp = self.dir / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.dir / "checkpoint.pt")

    def load_checkpoint(self):
        """Restore ``checkpoint.pt`` (read by rank 0, handed to every rank)."""
        state = _from_main(lambda: torch.load(self.dir / "checkpoint.pt", weights_only=True))
        if "ranks" not in state:
            raise ValueError(f"{self.dir / 'checkpoint.pt'} was written by an older storch-bench (methods pickled "
                             "whole); rerun it")
        if state["world_size"] != self.world:
            raise ValueError(f"{self.dir / 'checkpoint.pt'} was written by {state['world_size']} rank(s); resume it "
                             f"with as many (this run has {self.world}: torchrun --nproc-per-node "
                             f"{state['world_size']} ... --distributed)")
        self.step, self.train_time, self.rows = state["step"], state["train_time"], state["rows"]
        self.cpu_time = state.get("cpu_time", state["train_time"])  # absent before --seconds: wall time
        self.trace_steps, self.trace_time = state.get("traces", (0, 0.0))  # absent before trace timing
        self._acc, self._acc_n, self._acc_time = state["acc"]
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        mine = state["ranks"][self.rank]
        for k, m in self.methods.items():
            m.load_state_dict(mine["methods"][k])
        torch.set_rng_state(mine["rng"])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda_rng"], self.device)
        self.batches.load_state_dict(state["batches"])
        self.bin_gen.set_state(state["bin_gen"])

    # ---------------------------------------------------------------- the loop
    def train(self) -> dict[str, Any] | None:
        """Train to ``cfg["steps"]``; the summary (``None`` on ranks other than 0)."""
        cfg = self.cfg
        steps, seconds = cfg["steps"], cfg.get("seconds")
        # with --seconds and no --eval-every: an evaluation each tenth of the budget
        eval_every = cfg.get("eval_every") or (None if seconds else max(1, steps // 10))
        next_eval = (math.floor(self.cpu_time / (seconds / 10)) + 1) * seconds / 10 if seconds else None
        ckpt_every = cfg.get("checkpoint_every")
        if self.main:
            self.log(self.header())
        bar = None
        first_step = True
        if self.main and self.step == 0 and not self.rows:
            self.record()
        while not self._done():
            traces = self.compiled_step.traces if self.compiled_step is not None else 0
            c0, t0 = time.process_time(), time.perf_counter()
            loss = self.train_step()
            dt = time.perf_counter() - t0
            self.cpu_time += time.process_time() - c0
            if self.compiled_step is not None and self.compiled_step.traces > traces:
                self.trace_steps += 1
                self.trace_time += dt
            self.step += 1
            self.train_time += dt
            self._acc += loss
            self._acc_n += 1
            self._acc_time += dt
            if not math.isfinite(loss):
                raise FloatingPointError(f"step {self.step}: training objective {loss}")
            if first_step:
                # the bar starts after the first step, which carries the setup (lazy initialisation, the
                # first allocations): its rate and time left count the steady steps only
                bar, first_step = self._progress_bar(), False
            elif bar is not None:
                bar.update(1)
            if bar is not None and self.step % 10 == 0:
                bar.set_postfix({"relaxed loss" if self.estimator.relaxed else "loss": f"{loss:.2f}"})
            if eval_every:
                due = self.step % eval_every == 0
            else:
                due = self.cpu_time >= next_eval
                while next_eval <= self.cpu_time:
                    next_eval += seconds / 10
            if self.main and due and not self._done():
                self.record()
            if ckpt_every and self.step % ckpt_every == 0:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        if not self.main:
            if ckpt_every:
                self.save_checkpoint()  # a collective: rank 0 gathers every rank's state
            return None
        if self.rows and self.rows[-1]["step"] == self.step:
            self.rows.pop()  # resumed at the end: the final evaluation replaces the last row
        final = self.record(final=True)
        if ckpt_every:
            self.save_checkpoint()
        summary = self._summary(final)
        with open(self.dir / "summary.json", "w") as f:
            json.dump(summary, f, indent=2)
        self.write_auto_record()
        plot_run(self.dir, self.rows, cfg["label"], self.log)
        return summary

    def _done(self) -> bool:
        """Whether training has reached ``steps``, or spent ``seconds`` of CPU time (``--seconds``)."""
        steps, seconds = self.cfg["steps"], self.cfg.get("seconds")
        return (steps is not None and self.step >= steps) or (seconds is not None and self.cpu_time >= seconds)

    def write_auto_record(self) -> None:
        """``auto.json``: for each latent layer drawn by `storch.method.Auto`, its choice, per-candidate
        table and switches (`storch.method.Auto.record`)."""
        records = {name: m.record() for name, m in self.methods.items() if isinstance(m, storch.method.Auto)}
        if records:
            with open(self.dir / "auto.json", "w") as f:
                json.dump(records, f, indent=2)

    def _summary(self, final: dict[str, float]) -> dict[str, Any]:
        """The run's ``summary.json``: its configuration, the final evaluation ``final`` and its costs."""
        cfg = self.cfg
        last_var = [r["grad_logvar"] for r in self.rows if r["grad_logvar"] != ""]
        return {
            "model": cfg["model"], "data": cfg["data"], "estimator": cfg["estimator"], "label": cfg["label"],
            "objective": cfg["objective"], "seed": cfg["seed"], "steps": self.step,
            "n_samples": cfg["n_samples_resolved"], "evals_per_datum": cfg["evals_per_datum"],
            "train_nelbo": final["train_nelbo"], "train_relaxed_nelbo": final.get("train_relaxed_nelbo"),
            "relaxed": self.estimator.relaxed, "valid_nelbo": final["valid_nelbo"],
            "test_nelbo": final["test_nelbo_k"], "test_nll": final["test_nll"], "eval_k": cfg["eval_k"],
            "eval_size": len(self.eval_sets["test"]),
            "grad_logvar": last_var[-1] if last_var else None,
            "ms_per_step": self._ms_per_step(),
            "train_seconds": self.train_time, "train_cpu_seconds": self.cpu_time, "seconds_budget": cfg.get("seconds"),
            "trace_seconds": self.trace_time, "device": str(self.device), "threads": torch.get_num_threads(),
            "peak_memory_mb": peak_memory_mb(self.device),
            "estimated_memory_mb": self.memory.needed_bytes / 2**20,
        }

    def _ms_per_step(self) -> float | None:
        """Mean training time per step, without the steps in which `storch.compile_step` traced (all
        steps when every one of them traced)."""
        steady = self.step - self.trace_steps
        if steady > 0:
            return 1000.0 * (self.train_time - self.trace_time) / steady
        return 1000.0 * self.train_time / self.step if self.step else None

    def _progress_bar(self):
        """A tqdm bar from the current step on (``None`` without progress or without tqdm)."""
        if not self.progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            _note_no_tqdm(self.log)
            return None
        return tqdm(total=self.cfg["steps"], initial=self.step, desc=self.cfg["label"], leave=False,
                    dynamic_ncols=True)


#: what a run without tqdm prints once, instead of its progress bar
NO_TQDM = '(no progress bar: tqdm is not installed; pip install "storch[bench]", or pass --no-progress)'


@functools.cache
def _note_no_tqdm(log) -> None:
    log(NO_TQDM)


def peak_memory_mb(device: torch.device) -> float | None:
    """The peak memory of this process so far, in MiB: the most the CUDA allocator held on a GPU,
    the peak resident set size on the CPU (the data set included); ``None`` where unknown."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on every platform
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class _Namespace:
    def __init__(self, d):
        self.__dict__.update(d)


def _prepare_dir(run_dir: Path, overwrite: bool) -> None:
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            if (run_dir / "checkpoint.pt").is_file():
                raise FileExistsError(f"{run_dir} exists: pass --resume {run_dir} to continue it, or --overwrite "
                                      "to replace it")
            raise FileExistsError(f"{run_dir} exists (without a checkpoint to resume from): pass --overwrite to "
                                  "replace it, with --checkpoint-every N to make the new run resumable")
        for name in ("config.json", "metrics.csv", "summary.json", "checkpoint.pt", "plots.png", "auto.json"):
            (run_dir / name).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)


def _write_config(run_dir: Path, cfg: dict[str, Any]) -> None:
    with open(run_dir / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)


def run(cfg: dict[str, Any], run_dir, progress: bool = True, overwrite: bool = False, data=None, log=print):
    """Train one configuration into ``run_dir``; returns the summary (``None`` on ranks other than 0).

    Under ``torch.distributed`` every rank calls it with the same arguments (see the module docstring).
    """
    cfg = {**DEFAULTS, **cfg}
    if distributed.world_size() > 1:
        cfg["world_size"] = distributed.world_size()
    run_dir = Path(run_dir)
    r = Run(cfg, run_dir, data=data, progress=progress, log=log)  # validates before touching the disk
    _from_main(lambda: (_prepare_dir(run_dir, overwrite), _write_config(run_dir, cfg)))
    return r.train()


def _length(cfg: dict[str, Any]) -> str:
    """How long the run trains: ``N steps``, ``S CPU seconds`` or both (whichever comes first)."""
    parts = [] if cfg["steps"] is None else [f"{cfg['steps']} steps"]
    if cfg.get("seconds") is not None:
        parts.append(f"{cfg['seconds']:g} CPU seconds of training")
    return " or ".join(parts)


def _read_config(run_dir: Path, steps: int | None, seconds: float | None = None) -> dict[str, Any]:
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: not a storch-bench run folder (no config.json); name the "
                                "folder of one run, as printed after 'run folders:'")
    if not (run_dir / "checkpoint.pt").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: the run was trained without --checkpoint-every, so there is "
                                "nothing to resume; train it again with --overwrite --checkpoint-every N")
    with open(run_dir / "config.json") as f:
        cfg = json.load(f)
    if steps is not None:
        cfg["steps"] = steps
    if seconds is not None:
        cfg["seconds"] = seconds
    return cfg


def resume(run_dir, steps: int | None = None, progress: bool = True, log=print, memory_check: bool = True,
           seconds: float | None = None):
    """Continue the run in ``run_dir`` from its checkpoint (to ``steps`` or ``seconds`` of CPU time in
    training, default the configured ones: the budget is the run's total, the time before the
    checkpoint included).

    A run trained on ``N`` ranks resumes on ``N`` ranks (each takes back its own random state).
    ``memory_check=False`` resumes even when the memory estimate exceeds the memory available.
    """
    run_dir = Path(run_dir)
    cfg = _from_main(lambda: _read_config(run_dir, steps, seconds))
    cfg["memory_check"] = memory_check
    r = Run(cfg, run_dir, progress=progress, log=log)
    r.load_checkpoint()

    def refresh():
        (run_dir / "summary.json").unlink(missing_ok=True)
        _write_config(run_dir, cfg)

    _from_main(refresh)
    return r.train()


def auto_timeline(record: dict[str, Any], last_step: int) -> list[tuple[int, int, str]]:
    """``(first step, end step, candidate or "(measuring)")`` spans of an `storch.method.Auto` record's
    switches: the rounds of measurements and the candidate chosen after each, up to ``last_step``."""
    events = [(s["step"], s["to"]) for s in record["switches"]]
    return [(t, events[i + 1][0] if i + 1 < len(events) else last_step, what)
            for i, (t, what) in enumerate(events)]


def plot_auto_choices(ax, record: dict[str, Any], last_step: int) -> None:
    """Auto's choices over the steps into ``ax``: a bar per span on the row of the candidate chosen, the
    rounds of measurements shaded, the switches marked."""
    names = [c["candidate"] for c in record["candidates"]]
    for start, end, what in auto_timeline(record, last_step):
        if what == "(measuring)":
            ax.axvspan(start, max(end, start + 1), color="0.85", lw=0)
        elif what in names:
            ax.plot([start, end], [names.index(what)] * 2, lw=4, color="tab:red")
            ax.axvline(start, color="tab:red", lw=0.5, ls=":")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_ylim(-0.5, len(names) - 0.5)
    ax.set(xlabel="step (grey: rounds of measurements)",
           title=f"Auto({record['node']!r}): {record['settled'] or record['choice']}")


def plot_run(run_dir: Path, rows: list[dict[str, Any]], label: str, log=print) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f'(no plots for {run_dir.name}: matplotlib is not installed; pip install "storch[bench]")')
        return False
    steps = [r["step"] for r in rows]
    secs = [r["seconds"] for r in rows]
    auto = run_dir / "auto.json"
    records = json.loads(auto.read_text()) if auto.is_file() else {}
    fig, ax = plt.subplots(1, 3 + len(records), figsize=(15 + 6 * len(records), 4))
    for split in ("train", "valid", "test"):
        ys = [r[f"{split}_nelbo"] for r in rows]
        ax[0].plot(steps, ys, label=split)
        ax[1].plot(secs, ys, label=split)
    relaxed = [(r["step"], r["seconds"], r["train_relaxed_nelbo"]) for r in rows
               if r.get("train_relaxed_nelbo") not in ("", None)]
    if relaxed:
        r_steps, r_secs, r_vals = zip(*relaxed)
        ax[0].plot(r_steps, r_vals, "--", label="train, relaxed samples")
        ax[1].plot(r_secs, r_vals, "--", label="train, relaxed samples")
    ax[0].set(xlabel="step", ylabel="-ELBO (nats, hard samples)", title=label)
    ax[1].set(xlabel="training seconds", ylabel="-ELBO (nats, hard samples)")
    ax[0].legend()
    var = [(r["step"], r["grad_logvar"]) for r in rows if r["grad_logvar"] not in ("", None)]
    if var:
        ax[2].plot(*zip(*var), marker="o")
    ax[2].set(xlabel="step", ylabel="log total variance of encoder W grad")
    for panel, record in zip(ax[3:], records.values()):
        plot_auto_choices(panel, record, steps[-1] if steps else record["step"])
    fig.tight_layout()
    fig.savefig(run_dir / "plots.png", dpi=80)
    plt.close(fig)
    return True
