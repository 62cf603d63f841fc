"""storch-bench (storch/bench): catalog, budget arithmetic, loaders, end-to-end runs, resume."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from storch.bench import cli, train
from storch.bench.data import DATASETS, load_dataset
from storch.bench.estimators import ESTIMATORS, BudgetError, samples_for_budget
from storch.bench.models import MODELS, Latent
from storch.datasets import write_idx
from storch.exceptions import CompileStepError

QUICK = {"steps": 6, "eval_every": 3, "eval_size": 40, "eval_k": 8, "eval_elbo_k": 2, "var_every": 3,
         "var_reps": 3, "batch_size": 20, "latent_dim": 12}


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_help_and_list_name_the_catalog(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    for name in [*MODELS, *DATASETS, *ESTIMATORS]:
        assert name in text and name in listed, name


BERN = [Latent("z", "bernoulli", 200, 2)]
CAT = [Latent("z", "categorical", 20, 10)]
TWO = [Latent("z1", "bernoulli", 200, 2), Latent("z2", "bernoulli", 200, 2)]


@pytest.mark.parametrize("est, latents, budget, n, evals", [
    ("score-function", BERN, 10, 10, 10),
    ("rloo", BERN, 7, 7, 7),
    ("arm", BERN, 10, 5, 10),
    ("disarm", BERN, 5, 2, 4),
    ("rebar", BERN, 10, 3, 9),
    ("spsa", CAT, 6, 2, 6),
    ("local-expectation", BERN, 900, 4, 804),    # 1 + D*(K-1) = 201
    ("local-expectation", CAT, 201, 1, 181),     # 1 + 20*9
    ("local-expectation", TWO, 900, 2, 802),     # chained layers add their points: 1 + 200 + 200
    ("mvd", BERN, 201, 1, 201),                  # 1 + D
    ("mvd", CAT, 400, 2, 362),                   # 1 + D*(K-1) = 181
    ("arm", TWO, 8, 2, 8),                       # 2 per pair on each layer
    ("rloo", TWO, 8, 4, 8),                      # the lower layer takes 2 samples per upper sample
    ("expect", [Latent("z", "bernoulli", 6, 2)], 64, 1, 64),
    ("vimco", BERN, 5, 5, 5),
    ("auto", BERN, 4, 4, 4),
    ("auto", TWO, 4, 2, 4),                      # Auto's lower layer: 2 evaluations per upper sample, as RLOO's
])
def test_budget_arithmetic(est, latents, budget, n, evals):
    assert samples_for_budget(ESTIMATORS[est], latents, budget) == (n, evals)


@pytest.mark.parametrize("est, latents, budget", [
    ("rloo", BERN, 1), ("arm", BERN, 1), ("local-expectation", BERN, 200), ("mvd", CAT, 180),
    ("expect", [Latent("z", "bernoulli", 6, 2)], 63), ("expect", BERN, None), ("rebar", TWO, 8),
])
def test_budget_too_small(est, latents, budget):
    with pytest.raises(BudgetError):
        samples_for_budget(ESTIMATORS[est], latents, budget)


def test_cli_reports_small_budget(tmp_path, capsys):
    assert cli.main(["--estimator", "arm", "--budget", "1", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "too small for arm" in capsys.readouterr().err


# ------------------------------------------------------------------ loaders on fixtures


def _mnist_idx(d, n_train=30, n_test=10, gz=True):
    ext = ".gz" if gz else ""
    rng = np.random.default_rng(0)
    write_idx(d / f"train-images-idx3-ubyte{ext}", rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8))
    write_idx(d / f"train-labels-idx1-ubyte{ext}", rng.integers(0, 10, n_train, dtype=np.uint8))
    write_idx(d / f"t10k-images-idx3-ubyte{ext}", rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8))
    write_idx(d / f"t10k-labels-idx1-ubyte{ext}", rng.integers(0, 10, n_test, dtype=np.uint8))


@pytest.mark.parametrize("name, gz", [("mnist", True), ("fashion-mnist", False)])
def test_idx_loaders(tmp_path, name, gz):
    _mnist_idx(tmp_path, gz=gz)
    ds = load_dataset(name, tmp_path)
    assert ds.dynamic and ds.input_dim == 784
    assert (ds.train.shape[0], ds.valid.shape[0], ds.test.shape[0]) == (25, 5, 10)  # last sixth = valid
    assert 0 <= float(ds.train.min()) and float(ds.train.max()) <= 1
    assert set(ds.valid.unique().tolist()) <= {0.0, 1.0} and set(ds.test.unique().tolist()) <= {0.0, 1.0}
    batch = ds.binarize(ds.train[:4], torch.Generator().manual_seed(0))
    assert set(batch.unique().tolist()) <= {0.0, 1.0}


def test_npz_loaders(tmp_path):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "mnist_uint8.npz", x_train=rng.integers(0, 256, (24, 784), dtype=np.uint8),
             y_train=np.zeros(24, np.uint8), x_test=rng.integers(0, 256, (6, 784), dtype=np.uint8),
             y_test=np.zeros(6, np.uint8))
    ds = load_dataset("mnist", tmp_path)
    assert (ds.train.shape[0], ds.valid.shape[0], ds.test.shape[0]) == (20, 4, 6)
    with pytest.raises(FileNotFoundError, match="IDX"):  # Fashion-MNIST is never read from MNIST's npz
        load_dataset("fashion-mnist", tmp_path)
    pixels = {s: rng.integers(0, 2, (n, 784), dtype=np.uint8) for s, n in (("train", 8), ("valid", 3), ("test", 2))}
    np.savez(tmp_path / "binarized_mnist_packed.npz", **{s: np.packbits(p, axis=1) for s, p in pixels.items()})
    ds = load_dataset("binarized-mnist", tmp_path)
    assert not ds.dynamic
    assert torch.equal(ds.valid, torch.from_numpy(pixels["valid"]).float())
    assert ds.test.shape == (2, 784)


# ------------------------------------------------------------------ end to end


def _rows(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("cfg", [
    {"estimator": "score-function", "n_samples": 2, "baseline": "batch_average"},
    {"estimator": "disarm", "budget": 4},
    {"estimator": "gumbel-softmax", "temperature": 0.5},
    {"model": "categorical-vae", "estimator": "rloo", "budget": 2, "latent_dim": 3, "categories": 4},
    {"model": "sbn-categorical", "estimator": "local-expectation", "latent_dim": 3, "categories": 4},
    {"model": "sbn-two-layer", "estimator": "arm"},
    {"estimator": "vimco", "objective": "iwae", "n_samples": 3},
    {"estimator": "expect", "latent_dim": 4},
])
def test_end_to_end(tmp_path, digits, cfg):
    run_dir = tmp_path / "run"
    s = train.run({**QUICK, **cfg}, run_dir, progress=False, data=digits, log=lambda *_: None)
    for f in ("config.json", "metrics.csv", "summary.json"):
        assert (run_dir / f).is_file(), f
    assert s == json.loads((run_dir / "summary.json").read_text())
    for k in ("train_nelbo", "valid_nelbo", "test_nelbo", "test_nll", "ms_per_step"):
        assert math.isfinite(s[k]), k
    assert s["test_nll"] <= s["test_nelbo"] + 1e-4  # the K-sample bound is tighter than the ELBO
    rows = _rows(run_dir)
    assert [int(r["step"]) for r in rows] == [0, 3, 6]
    assert all(r["grad_logvar"] != "" for r in rows)


@pytest.mark.parametrize("cfg", [
    {"estimator": "disarm", "budget": 4},
    {"model": "categorical-vae", "estimator": "rloo", "budget": 2, "latent_dim": 3, "categories": 4},
    {"model": "sbn-two-layer", "estimator": "arm"},
    {"estimator": "score-function", "baseline": "moving_average", "n_samples": 2},
    {"estimator": "relax"},
    {"estimator": "rebar"},
    {"estimator": "gumbel-softmax"},
])
def test_compile_step_trains_as_the_eager_run(tmp_path, digits, cfg):
    """--compile-step: the same metrics as the eager run, up to rounding (same draws, same steps)."""
    eager = train.run({**QUICK, **cfg}, tmp_path / "eager", progress=False, data=digits, log=lambda *_: None)
    compiled = train.run({**QUICK, **cfg, "compile_step": True}, tmp_path / "compiled", progress=False,
                         data=digits, log=lambda *_: None)
    for k in ("train_nelbo", "valid_nelbo", "test_nelbo", "test_nll"):
        assert compiled[k] == pytest.approx(eager[k], rel=1e-4), k


def test_compare_keeps_compiled_and_gpu_runs_apart_from_the_eager_cpu_run():
    """A compiled (or GPU) run of one setting is its own row in ``compare``, not another seed of the
    eager run: their ms/step would be averaged."""
    cfg = {**train.DEFAULTS, "estimator": "rebar", "n_samples_resolved": 1}
    eager = train.run_label(cfg)
    compiled = train.run_label({**cfg, "compile_step": True})
    gpu = train.run_label({**cfg, "device": "cuda"})
    assert len({eager, compiled, gpu}) == 3
    assert compiled == eager + " compiled" and gpu == eager + " cuda"
    rows = [{"model": "m", "data": "d", "label": label} for label in (eager, compiled, eager)]
    assert [len(runs) for runs in cli._groups(rows).values()] == [2, 1]


def test_compile_step_refuses_a_stateful_estimator_by_name(tmp_path, digits):
    cfg = {**QUICK, "estimator": "spsa", "compile_step": True}
    with pytest.raises(CompileStepError, match=r"SPSA\('z'\) keeps state between steps that a replay cannot follow"):
        train.run(cfg, tmp_path / "run", progress=False, data=digits, log=lambda *_: None)


def test_cli_seeds_compare_and_plots(tmp_path, capsys):
    args = ["--estimator", "disarm", "--steps", "4", "--eval-every", "2", "--eval-size", "30", "--eval-k", "5",
            "--var-reps", "2", "--latent-dim", "10", "--seed", "0", "1", "--out", str(tmp_path), "--no-progress"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "-log p(x)" in out and "±" in out
    tables = [line for line in out.splitlines() if str(tmp_path) not in line]  # the run folders aside
    assert max(len(line) for line in tables) <= cli.TABLE_WIDTH  # both tables fit a terminal
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [d.name[-5:] for d in dirs] == ["seed0", "seed1"]
    assert all((d / "plots.png").is_file() for d in dirs)  # matplotlib is in the test extra
    assert cli.main(["compare", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "disarm(n=1)" in table and "    2 " in table  # one group of two seeds
    assert max(len(line) for line in table.splitlines() if str(tmp_path) not in line) <= cli.TABLE_WIDTH
    assert cli.main(args) == 2  # the folders exist: refused without --overwrite


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_resume_repeats_an_uninterrupted_run(tmp_path, digits, device):
    cfg = {**QUICK, "steps": 8, "eval_every": 2, "var_every": 4, "checkpoint_every": 4,
           "estimator": "score-function", "baseline": "moving_average", "n_samples": 2, "device": device}
    full = train.run(cfg, tmp_path / "full", progress=False, data=digits, log=lambda *_: None)
    train.run({**cfg, "steps": 4}, tmp_path / "part", progress=False, data=digits, log=lambda *_: None)
    assert (tmp_path / "part" / "checkpoint.pt").is_file()
    resumed = train.resume(tmp_path / "part", steps=8, progress=False, log=lambda *_: None)
    timing = {"seconds", "cpu_seconds", "ms_per_step"}
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "part")
    assert [{k: v for k, v in r.items() if k not in timing} for r in a] == \
           [{k: v for k, v in r.items() if k not in timing} for r in b]
    for k in ("train_nelbo", "valid_nelbo", "test_nelbo", "test_nll", "grad_logvar", "steps"):
        assert full[k] == resumed[k], k


def test_seconds_budget_stops_on_cpu_time_and_resumes_to_the_new_total(tmp_path, digits):
    """--seconds S: training stops at the first step at which the training steps' CPU time reaches S
    (evaluations not counted), evaluating each tenth of S; --resume continues to a new total."""
    cfg = {**QUICK, "steps": None, "seconds": 0.2, "eval_every": None, "checkpoint_every": 5,
           "estimator": "disarm", "budget": 4}
    first = train.run(cfg, tmp_path / "run", progress=False, data=digits, log=lambda *_: None)
    rows = _rows(tmp_path / "run")
    cpu = [float(r["cpu_seconds"]) for r in rows]
    assert first["train_cpu_seconds"] >= 0.2 and first["seconds_budget"] == 0.2
    assert cpu[0] == 0 and cpu == sorted(cpu) and cpu[-1] == pytest.approx(first["train_cpu_seconds"], abs=1e-3)
    assert 2 <= len(rows) <= 12  # the start, at most one evaluation per tenth of the budget, the end
    assert all(cpu[i] >= 0.02 * i - 1e-6 for i in range(len(rows) - 1))  # not before its tenth is spent
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["seconds"] == 0.2 and config["steps"] is None
    more = train.resume(tmp_path / "run", seconds=0.4, progress=False, log=lambda *_: None)
    assert more["train_cpu_seconds"] >= 0.4 and more["steps"] > first["steps"]
    assert [r["step"] for r in _rows(tmp_path / "run")][: len(rows) - 1] == [r["step"] for r in rows[:-1]]
    with pytest.raises(ValueError, match="--seconds 0"):
        train.run({**cfg, "seconds": 0}, tmp_path / "zero", progress=False, data=digits, log=lambda *_: None)
    with pytest.raises(ValueError, match="give --steps or --seconds"):
        train.run({**cfg, "seconds": None}, tmp_path / "none", progress=False, data=digits, log=lambda *_: None)


def test_cli_seconds_without_steps(tmp_path, capsys):
    args = ["--estimator", "rloo", "--seconds", "0.1", "--eval-size", "30", "--eval-k", "5", "--latent-dim", "10",
            "--out", str(tmp_path), "--no-progress"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "0.1 CPU seconds of training" in out  # the run header
    (summary,) = tmp_path.rglob("summary.json")
    s = json.loads(summary.read_text())
    assert s["train_cpu_seconds"] >= 0.1 and s["steps"] >= 1


@CUDA
@pytest.mark.parametrize("cfg", [
    {"estimator": "disarm", "budget": 4},
    {"estimator": "relax", "n_samples": 1},
    {"model": "categorical-vae", "estimator": "gumbel-softmax", "latent_dim": 3, "categories": 4},
])
def test_end_to_end_on_cuda(tmp_path, digits, cfg):
    """The model and the methods' own parameters (RELAX's control variate) train on the GPU."""
    s = train.run({**QUICK, **cfg, "device": "cuda"}, tmp_path / "run", progress=False, data=digits,
                  log=lambda *_: None)
    assert s["device"].startswith("cuda")
    for k in ("train_nelbo", "valid_nelbo", "test_nelbo", "test_nll"):
        assert math.isfinite(s[k]), k


@CUDA
def test_cli_on_cuda_keeps_the_cpu_run(tmp_path, capsys):
    args = ["--steps", "2", "--eval-size", "20", "--eval-k", "2", "--latent-dim", "5", "--no-var", "--no-progress",
            "--out", str(tmp_path)]
    assert cli.main(args) == 0 and cli.main(args + ["--device", "cuda"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["sbn-linear_digits_score-function_latent_dim=5_cuda_seed0",
                     "sbn-linear_digits_score-function_latent_dim=5_seed0"]
    summary = json.loads((tmp_path / names[0] / "summary.json").read_text())
    assert summary["device"] == "cuda:0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["--device", "cuda", "--steps", "2", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_unknown_device_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["--device", "tpu", "--steps", "2", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err


# ------------------------------------------------------------------ storch-bench evaluate
def test_evaluate_a_finished_run_on_the_whole_test_set(tmp_path, digits, capsys):
    cfg = {**QUICK, "estimator": "disarm", "checkpoint_every": 3}
    summary = train.run(cfg, tmp_path / "run", progress=False, data=digits, log=lambda *_: None)
    assert cli.main(["evaluate", str(tmp_path / "run"), "--eval-k", "20"]) == 0
    record = json.loads((tmp_path / "run" / "test_eval.json").read_text())
    assert record["eval_size"] == digits.test.shape[0] > cfg["eval_size"]  # all of it, not the run's subset
    assert (record["step"], record["eval_k"], record["label"]) == (6, 20, summary["label"])
    assert math.isfinite(record["test_nll"]) and record["test_nll"] <= record["test_nelbo_k"]
    assert "run " in capsys.readouterr().out
    from storch.bench.evaluate import evaluate_run

    again = evaluate_run(tmp_path / "run", eval_k=20)  # seeded: the same bound
    assert again["test_nll"] == record["test_nll"]
    subset = evaluate_run(tmp_path / "run", eval_size=cfg["eval_size"], eval_k=20)
    assert subset["eval_size"] == cfg["eval_size"]
    capsys.readouterr()
    assert cli.main(["evaluate", str(tmp_path / "run"), "--eval-k", "20", "--skip-done"]) == 0  # a subset is
    assert "run " in capsys.readouterr().out.splitlines()[-1]  # not the whole test set: evaluated again
    assert json.loads((tmp_path / "run" / "test_eval.json").read_text())["eval_size"] == digits.test.shape[0]
    assert cli.main(["evaluate", str(tmp_path / "run"), "--eval-k", "20", "--skip-done"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # the header only: done


def test_evaluate_refuses_runs_it_cannot_trust(tmp_path, digits, capsys):
    train.run({**QUICK, "estimator": "disarm"}, tmp_path / "nockpt", progress=False, data=digits, log=lambda *_: None)
    train.run({**QUICK, "estimator": "disarm", "checkpoint_every": 3}, tmp_path / "stale", progress=False,
              data=digits, log=lambda *_: None)
    summary = json.loads((tmp_path / "stale" / "summary.json").read_text())
    (tmp_path / "stale" / "summary.json").write_text(json.dumps({**summary, "steps": 9}))  # trained on past it
    assert cli.main(["evaluate", str(tmp_path / "nockpt"), str(tmp_path / "stale")]) == 1
    out = capsys.readouterr().out
    assert "has no checkpoint.pt (train with --checkpoint-every N)" in out  # evaluate: its own message
    assert "its checkpoint is from step 6, but the run ended at step 9" in out
    assert not (tmp_path / "stale" / "test_eval.json").exists()


def test_ms_per_step_of_a_compiled_run_leaves_out_its_traces(tmp_path, digits):
    """The steps in which storch.compile_step traced (seconds each) are reported apart, so that a short
    compiled run's ms/step is its replays' cost; an eager run has none."""
    cfg = {**QUICK, "estimator": "disarm", "budget": 4}
    eager = train.run(cfg, tmp_path / "eager", progress=False, data=digits, log=lambda *_: None)
    assert eager["trace_seconds"] == 0
    assert eager["ms_per_step"] == pytest.approx(1000 * eager["train_seconds"] / eager["steps"])
    compiled = train.run({**cfg, "compile_step": True}, tmp_path / "compiled", progress=False, data=digits,
                         log=lambda *_: None)
    assert 0 < compiled["trace_seconds"] < compiled["train_seconds"]
    steady = (compiled["train_seconds"] - compiled["trace_seconds"]) / compiled["steps"]
    assert 1000 * steady < compiled["ms_per_step"] < 1000 * compiled["train_seconds"] / compiled["steps"]
