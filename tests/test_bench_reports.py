"""storch-bench's reports: hard and relaxed −ELBO, threads, `compare` (help, one seed, plot), the
progress bar, and the memory estimate that refuses a run before its first step."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch

from storch.bench import cli, memory, train
from storch.bench.data import load_dataset
from storch.bench.estimators import (
    ESTIMATORS,
    applicable,
    build_methods,
    samples_for_budget,
)
from storch.bench.models import estimator_nelbo, log_weights, make_model

QUICK = {"steps": 6, "eval_every": 3, "eval_size": 40, "eval_k": 8, "eval_elbo_k": 2, "var_every": 3,
         "var_reps": 3, "batch_size": 20, "latent_dim": 12}
CLI_QUICK = ["--steps", "3", "--eval-every", "3", "--eval-size", "20", "--eval-k", "2", "--latent-dim", "6",
             "--batch-size", "10", "--no-var"]


def quiet(*_args, **_kwargs):
    """A ``log`` that prints nothing."""


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture
def one_thread():
    """Restore torch's thread count after a test that runs the CLI (which sets it)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _rows(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ hard and relaxed -ELBO


class _Options:
    baseline = temperature = spsa_c = None


@pytest.mark.parametrize("model_name, sizes", [("sbn-linear", {"latent_dim": 4}),
                                               ("sbn-categorical", {"latent_dim": 3, "categories": 4})])
def test_relaxed_flag_marks_the_estimators_whose_objective_is_not_the_hard_elbo(digits, model_name, sizes):
    """Each estimator's training objective (its forward value) against the −ELBO with hard samples, on
    the same parameters and data: equal within sampling error unless the estimator is `relaxed`."""
    torch.manual_seed(0)
    model = make_model(model_name, digits.input_dim, digits.train_mean, **sizes)
    x = digits.train[:200]
    per_sample = -log_weights(model, x, 4000).mean(1)  # the -ELBO of each of 4000 samples, averaged over x
    hard, hard_se = float(per_sample.mean()), float(per_sample.std() / math.sqrt(per_sample.numel()))
    checked = []
    for est in ESTIMATORS.values():
        if applicable(est, model.latents, "elbo"):
            continue
        n, _ = samples_for_budget(est, model.latents, None)
        reps = torch.tensor([estimator_nelbo(model, x, build_methods(est, model.latents, n, _Options()), 200)
                             for _ in range(8)])
        se = math.hypot(float(reps.std()) / math.sqrt(len(reps)), hard_se)
        gap = abs(float(reps.mean()) - hard)
        if est.relaxed:
            assert gap > 8 * se, (est.name, gap, se)
        else:
            assert gap <= 4.5 * se + 1e-3, (est.name, gap, se)
        checked.append(est.name)
    assert "gumbel-softmax" in checked and "st-gumbel-softmax" in checked


def test_a_relaxation_reports_its_relaxed_elbo_next_to_the_hard_one(tmp_path, digits):
    cfg = {**QUICK, "model": "categorical-vae", "estimator": "gumbel-softmax", "latent_dim": 3, "categories": 4}
    s = train.run(cfg, tmp_path / "gs", progress=False, data=digits, log=quiet)
    assert s["relaxed"] is True
    assert math.isfinite(s["train_relaxed_nelbo"]) and math.isfinite(s["train_nelbo"])
    assert s["train_relaxed_nelbo"] != s["train_nelbo"]
    assert all(r["train_relaxed_nelbo"] != "" for r in _rows(tmp_path / "gs"))
    other = train.run({**QUICK, "estimator": "disarm"}, tmp_path / "disarm", progress=False, data=digits, log=quiet)
    assert other["relaxed"] is False and other["train_relaxed_nelbo"] is None
    assert all(r["train_relaxed_nelbo"] == "" for r in _rows(tmp_path / "disarm"))
    table = cli.compare_table([s, other])
    assert " relaxed " in table.splitlines()[0] and "hard (discrete) samples" in table


# ------------------------------------------------------------------ threads


def test_threads_default_to_one_and_the_header_says_so(tmp_path, capsys, one_thread):
    args = cli.build_parser().parse_args([])
    assert args.threads == 1
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "default 1" in " ".join(capsys.readouterr().out.split())
    torch.set_num_threads(2)
    assert cli.main(CLI_QUICK + ["--out", str(tmp_path), "--no-progress"]) == 0
    assert torch.get_num_threads() == 1
    out = capsys.readouterr().out
    assert "cpu, 1 thread\n" in out
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert summary["threads"] == 1


# ------------------------------------------------------------------ compare


def test_compare_help_is_real_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--help"])
    assert e.value.code == 0
    captured = capsys.readouterr()
    assert "usage: storch-bench compare" in captured.out and "--plot" in captured.out
    assert "no summary.json" not in captured.out + captured.err


def test_compare_one_seed_shows_no_spread_and_writes_a_plot(tmp_path, capsys, one_thread):
    assert cli.main(CLI_QUICK + ["--estimator", "disarm", "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    assert cli.main(CLI_QUICK + ["--estimator", "rloo", "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("  disarm(", "  rloo("))]
    assert "sbn-linear on digits" in out and len(rows) == 2 and all(" 1 " in r and "±" not in r for r in rows)
    assert (tmp_path / "runs" / "compare.png").is_file()  # the default: next to the runs
    assert cli.main(["compare", str(tmp_path / "runs"), "--plot", str(tmp_path / "mine.png")]) == 0
    assert (tmp_path / "mine.png").is_file()


def test_compare_without_matplotlib_prints_the_table(tmp_path, capsys, monkeypatch, one_thread):
    assert cli.main(CLI_QUICK + ["--out", str(tmp_path), "--no-progress"]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert cli.main(["compare", str(tmp_path), "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "score-function(n=1)" in out and "matplotlib is not installed" in out
    assert not (tmp_path / "c.png").exists()


# ------------------------------------------------------------------ progress bar


def test_progress_bar_starts_after_the_first_step(tmp_path, digits, monkeypatch):
    events = []

    class FakeBar:
        def __init__(self, total, initial=0, **_):
            events.append(("bar", initial))
            self.updates = 0

        def update(self, n):
            events.append(("update", n))

        def set_postfix(self, *_args, **_kwargs):
            pass

        def close(self):
            events.append(("close", None))

    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", FakeBar)
    step, record = train.Run.train_step, train.Run.record
    monkeypatch.setattr(train.Run, "train_step", lambda self: events.append(("step", None)) or step(self))
    monkeypatch.setattr(train.Run, "record", lambda self, final=False: events.append(("record", None)) or
                        record(self, final))
    train.run({**QUICK, "steps": 4, "eval_every": 10}, tmp_path / "run", progress=True, data=digits, log=quiet)
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["record", "step", "bar"]  # evaluation at step 0 and the first step come before the bar
    assert events[2] == ("bar", 1)  # the first step counts as done, outside the rate
    assert kinds.count("update") == 3 and kinds.count("close") == 1


def test_a_run_with_the_real_progress_bar(tmp_path, digits):
    s = train.run({**QUICK, "steps": 3}, tmp_path / "run", progress=True, data=digits, log=quiet)
    assert s["steps"] == 3


# ------------------------------------------------------------------ memory


def test_memory_estimate_arithmetic(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 10 * 2**20)
    est = memory.estimate_memory(points_per_datum=401, batch=50, point_width=1584, eval_k=200, eval_size=1000,
                                 device=torch.device("cpu"), dtype=torch.float32)
    assert est.train_bytes == 50 * 401 * 1584 * 4 * 4
    assert est.eval_bytes == 100 * 200 * 1584 * 2 * 4
    assert not est.fits and est.largest_batch() == 10 * 2**20 // (401 * 1584 * 16)
    assert "401 evaluation points per datum, 20050 per step" in est.summary()


def test_the_refusal_names_the_part_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 2**30)
    est = memory.estimate_memory(points_per_datum=1, batch=50, point_width=1000, eval_k=100_000, eval_size=1000,
                                 device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(memory.MemoryEstimateError) as e:
        memory.check_memory(est, "sbn-linear", "disarm(n=1)")
    message = str(e.value)
    assert "For the evaluation, use an --eval-k of at most 1342" in message  # 2**30 // (100 * 1000 * 2 * 4)
    assert "--batch-size" not in message
    memory.check_memory(memory.estimate_memory(1, 50, 1000, 200, 1000, torch.device("cpu")), "sbn-linear", "x")


def test_point_width_counts_the_layers_after_the_latents(digits):
    two = make_model("sbn-two-layer", 784)
    assert two.point_width() == 2 * 200 + 200 + 200 + 784
    vae = make_model("categorical-vae", 784)
    assert vae.point_width() == 20 * 10 + 256 + 512 + 784


def test_available_memory_reads_meminfo_and_cgroup(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable:   2048 kB\n")
    assert memory._meminfo_available(str(tmp_path / "meminfo")) == 2048 * 1024
    assert memory._meminfo_available(str(tmp_path / "missing")) is None
    (tmp_path / "memory.max").write_text("max\n")
    assert memory._cgroup_available(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("300\n")
    assert memory._cgroup_available(str(tmp_path)) == 700
    available = memory.available_memory(torch.device("cpu"))
    assert available is None or available > 0


def test_an_impossible_configuration_is_refused_before_training(tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.setattr(memory, "available_memory", lambda device: 2**20)  # 1 MiB

    def no_training(self):
        raise AssertionError("trained although the estimate exceeds the memory available")

    monkeypatch.setattr(train.Run, "train_step", no_training)
    out_dir = tmp_path / "runs"
    args = ["--model", "sbn-two-layer", "--estimator", "local-expectation", "--latent-dim", "12", "--batch-size", "50",
            "--steps", "2", "--no-progress", "--out", str(out_dir)]
    assert cli.main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    for part in ("sbn-two-layer", "local-expectation(n=1)", "25 points per datum", "1250 per step",
                 "only 1 MiB is available on cpu", "--batch-size of at most",
                 "an estimator with fewer cost evaluations", "--no-memory-check"):
        assert part in err, part
    assert not out_dir.exists()  # refused before touching the disk


def test_no_memory_check_trains_anyway_and_the_header_prints_the_estimate(tmp_path, capsys, monkeypatch,
                                                                          one_thread):
    monkeypatch.setattr(memory, "available_memory", lambda device: 2**20)
    args = ["--model", "sbn-two-layer", "--estimator", "local-expectation", "--latent-dim", "4", "--batch-size", "10",
            "--steps", "1", "--eval-size", "10", "--eval-k", "2", "--no-var", "--no-progress", "--out", str(tmp_path),
            "--no-memory-check"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "9 evaluation points per datum, 90 per step\n  memory: about" in out and "1 MiB available on cpu" in out
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert summary["estimated_memory_mb"] > 0


# ------------------------------------------------------------------ at a terminal's width


def _summary(label, model="sbn-linear", data="digits", seed=0, scale=1.0):
    return {"model": model, "data": data, "label": label, "seed": seed, "evals_per_datum": 201,
            "test_nelbo": 101.25 * scale, "test_nll": 95.5 * scale, "valid_nelbo": 100.75 * scale,
            "train_nelbo": 99.125 * scale, "train_relaxed_nelbo": None, "grad_logvar": 12.5,
            "ms_per_step": 1234.5, "peak_memory_mb": 123456.0}


LONG_LABEL = "relax(temperature=0.5,baseline=batch_average,n=12)/iwae cuda:0 compiled"


def test_the_tables_fit_in_120_columns_and_keep_every_figure():
    runs = [_summary("disarm(n=1)"), _summary("disarm(n=1)", seed=1, scale=1.01),
            _summary(LONG_LABEL, model="categorical-vae", data="binarized-mnist", scale=10.0)]
    table = cli.run_table(runs)
    assert max(len(line) for line in table.splitlines()) <= cli.TABLE_WIDTH
    lines = table.splitlines()
    assert "sbn-linear on digits" in lines and "categorical-vae on binarized-mnist" in lines
    # the long label stands on its own line, its figures on the next one
    i = lines.index(f"  {LONG_LABEL}")
    assert "1012.50" in lines[i + 1] and "123456" in lines[i + 1] and "1234.50" in lines[i + 1]
    compared = cli.compare_table(runs)
    assert max(len(line) for line in compared.splitlines()) <= cli.TABLE_WIDTH
    assert "101.76±0.72" in compared  # the two seeds of disarm: mean ± std of 101.25 and 102.2625
    rows = {r["estimator"]: r for r in cli.compare_rows(runs)}  # the CSV keeps what the table leaves out
    assert rows["disarm(n=1)"]["seeds"] == 2 and rows["disarm(n=1)"]["peak_memory_mb_mean"] == 123456.0
    assert rows[LONG_LABEL]["grad_logvar_mean"] == 12.5 and rows[LONG_LABEL]["grad_logvar_std"] == ""


def test_compare_writes_its_files_where_its_help_says(tmp_path, capsys, one_thread):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: compare.csv in the folder of the runs" in help_text
    assert "default: compare.png in the folder of the runs" in help_text
    assert "RUN_DIR itself when one is given, otherwise the deepest folder that holds every RUN_DIR" in help_text
    for name in ("a", "b"):
        assert cli.main(CLI_QUICK + ["--out", str(tmp_path / "runs" / name), "--no-progress"]) == 0
    capsys.readouterr()
    for args, folder in ([[str(tmp_path / "runs")], tmp_path / "runs"],  # one RUN_DIR: the files go into it
                         [[str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "b")], tmp_path / "runs"],
                         [[str(tmp_path / "runs" / "a")], tmp_path / "runs" / "a"]):
        assert cli.main(["compare", *args]) == 0
        out = capsys.readouterr().out
        assert f"csv: {folder / 'compare.csv'}" in out and f"plot: {folder / 'compare.png'}" in out
        assert (folder / "compare.csv").is_file() and (folder / "compare.png").is_file()
        (folder / "compare.csv").unlink()
        (folder / "compare.png").unlink()
    assert cli.main(["compare", str(tmp_path / "runs"), "--csv", str(tmp_path / "t.csv"), "--no-plot"]) == 0
    with open(tmp_path / "t.csv") as f:
        assert [r["seeds"] for r in csv.DictReader(f)] == ["2"]  # runs a and b: one setting, two runs of seed 0
    assert not (tmp_path / "runs" / "compare.png").exists()


def test_an_existing_run_without_checkpoints_is_not_sent_to_resume(tmp_path, capsys, one_thread):
    args = CLI_QUICK + ["--out", str(tmp_path), "--no-progress"]
    assert cli.main(args) == 0
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--overwrite" in err and "--checkpoint-every" in err and "--resume" not in err
    assert cli.main(["--resume", str(run_dir), "--no-progress"]) == 2  # asked anyway: what to do, in one line
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "trained without --checkpoint-every" in err
    assert "--overwrite --checkpoint-every N" in err
    assert cli.main(["--resume", str(tmp_path), "--no-progress"]) == 2  # not a run folder
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a storch-bench run folder" in err
    # with checkpoints, the hint is --resume, and it works
    assert cli.main(args + ["--overwrite", "--checkpoint-every", "3"]) == 0
    capsys.readouterr()
    assert cli.main(args + ["--checkpoint-every", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--resume {run_dir}" in err
    assert cli.main(["--resume", str(run_dir), "--steps", "6", "--no-progress"]) == 0


def test_a_run_without_tqdm_says_so_in_one_line(tmp_path, digits, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    train._note_no_tqdm.cache_clear()
    lines = []
    train.run({**QUICK, "steps": 3}, tmp_path / "a", progress=True, data=digits, log=lines.append)
    train.run({**QUICK, "steps": 3}, tmp_path / "b", progress=True, data=digits, log=lines.append)
    notes = [line for line in lines if "tqdm" in line]
    assert notes == [train.NO_TQDM]  # once per process
    assert 'pip install "storch[bench]"' in train.NO_TQDM
    train._note_no_tqdm.cache_clear()


def test_list_help_and_evaluate_fit_in_120_columns(tmp_path, capsys, monkeypatch, one_thread):
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert max(len(line) for line in listed.splitlines()) <= cli.TABLE_WIDTH
    assert "  gapped-straight-through " in listed  # the longest name keeps its column
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= cli.TABLE_WIDTH
    name = "sbn-linear_binarized-mnist_local-expectation_budget=400_n_samples=2_latent_dim=200_seed0"
    assert len(name) > 70
    args = CLI_QUICK + ["--out", str(tmp_path), "--no-progress", "--checkpoint-every", "3"]
    assert cli.main(args) == 0
    next(p for p in tmp_path.iterdir() if p.is_dir()).rename(tmp_path / name)
    capsys.readouterr()
    assert cli.main(["evaluate", str(tmp_path / name), "--eval-k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == name and max(len(line) for line in lines) <= cli.TABLE_WIDTH
