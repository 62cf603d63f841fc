"""Data-parallel training (issue 11, item 2): two gloo processes on the loopback interface.

The two ranks run ``tests/_distributed_worker.py`` once for the whole module (a file store in a
temporary folder: no port to choose; ``GLOO_SOCKET_IFNAME=lo``; bounded by a timeout) and save what
they measured; the tests compare the ranks:

(a) with exact enumeration (``Expect``: no sampling), DDP's average of the ranks' gradients on
    their halves of the minibatch equals the one-process gradient of the whole minibatch (~1e-7);
(b) RELAX's and REBAR's own parameters (control variate, temperature, η) are identical on both ranks
    after several steps with the sync, and differ with ``sync=False``;
(c) a synced moving-average baseline is identical on both ranks and equals the moving average of
    the ranks' mean costs; unsynced it is per rank;
(d) storch-bench under DDP: the enumeration run equals the one-process run of the same minibatches,
    and a resumed RELAX run repeats the uninterrupted one; ``torchrun ... -m storch.bench
    --distributed`` works, and rank 0 alone writes and prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import storch
from storch import distributed

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


def _env() -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("STORCH_TEST_SEED", None)
    return env


def _run_ranks(out_dir: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_distributed_worker.py"), str(r), str(WORLD), str(out_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
        )
        for r in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"ranks failed {failed}:\n" + "\n".join(log[-3000:] for log in logs)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp")
    _run_ranks(out_dir)
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        res["out_dir"] = out_dir
        assert res["rank"] == r and res["world"] == WORLD
    return results


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) > 0
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_helpers_average_gradients_and_broadcast(ranks):
    for res in ranks:
        assert torch.equal(res["mean_a"], torch.tensor([1.5, 3.0]))
        assert torch.equal(res["mean_b"], torch.tensor([15.0], dtype=torch.float64))
        assert torch.equal(res["grad_p"], torch.tensor([1.5, 1.5]))
        assert torch.equal(res["grad_q"], torch.full((3,), 0.5))  # rank 0 had none: it counts as zeros
        assert res["grad_r_is_none"]  # no rank had one: stays None
        assert torch.equal(res["broadcast"], torch.tensor([0.0]))
        assert res["local_only_syncing"] is False
    assert [res["local_only_value"].item() for res in ranks] == [0.0, 1.0]


def test_ddp_update_equals_one_process_update_of_the_whole_batch(ranks):
    """(a) Expect on a small model: compare the gradients."""
    for res in ranks:
        assert res["expect_max_grad_diff"] < 1e-6
    assert _max_diff(ranks[0]["expect_grads"], ranks[1]["expect_grads"]) == 0.0  # DDP: one all-reduce


@pytest.mark.parametrize("name", ["relax", "rebar", "critic"])
def test_learned_control_variates_stay_equal_across_ranks(ranks, name):
    """(b) after 5 steps on different shards and samples, the replicas' method parameters are equal."""
    a, b = ranks
    assert _max_diff(a[f"{name}_sync_method"], b[f"{name}_sync_method"]) == 0.0
    assert _max_diff(a[f"{name}_sync_model"], b[f"{name}_sync_model"]) == 0.0


def test_without_sync_the_control_variates_drift_apart(ranks):
    a, b = ranks
    assert _max_diff(a["relax_nosync_method"], b["relax_nosync_method"]) > 1e-4
    assert _max_diff(a["relax_nosync_model"], b["relax_nosync_model"]) == 0.0  # DDP still syncs the model
    assert _max_diff(a["critic_nosync_method"], b["critic_nosync_method"]) > 1e-4  # critics too


def test_synced_moving_average_is_global(ranks):
    """(c) equal on both ranks, and the moving average (β = 0.8) of the ranks' mean costs."""
    a, b = ranks
    assert torch.equal(a["ma_syncTrue_average"], b["ma_syncTrue_average"])
    expected = None
    for loss_a, loss_b in zip(a["ma_syncTrue_losses"], b["ma_syncTrue_losses"]):
        mean = (loss_a + loss_b) / 2
        expected = mean if expected is None else 0.8 * expected + 0.2 * mean
    assert abs(a["ma_syncTrue_average"].item() - expected) < 1e-5
    # per rank without the sync: each its own shard's average
    assert abs(a["ma_syncFalse_average"].item() - b["ma_syncFalse_average"].item()) > 1e-3


def test_bench_under_ddp_equals_one_process_and_resumes_exactly(ranks, tmp_path):
    """(d) storch-bench in the worker: enumeration = one process; RELAX resumed = uninterrupted."""
    import _distributed_worker as worker

    from storch.bench import train
    from storch.bench.data import load_dataset

    a, b = ranks
    assert b["bench_expect"] is None and b["bench_full"] is None  # rank 0 alone returns the summary
    single = train.run({**worker.BENCH, "estimator": "expect"}, tmp_path / "single", data=load_dataset("digits"),
                       progress=False, log=lambda *_: None)
    for key in ("train_nelbo", "valid_nelbo", "test_nelbo", "test_nll"):
        assert abs(a["bench_expect"][key] - single[key]) < 1e-4, key
    for key in ("train_nelbo", "valid_nelbo", "test_nelbo", "test_nll", "grad_logvar", "steps"):
        assert a["bench_full"][key] == a["bench_resumed"][key], key
    state = torch.load(a["out_dir"] / "part" / "checkpoint.pt", weights_only=True)
    assert state["world_size"] == WORLD and len(state["ranks"]) == WORLD
    assert not torch.equal(state["ranks"][0]["rng"], state["ranks"][1]["rng"])  # each rank its own samples


def test_bench_cli_under_torchrun(tmp_path):
    """``torchrun --standalone --nproc-per-node 2 -m storch.bench --distributed``: rank 0 prints the table."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "-m", "storch.bench", "--distributed", "--estimator", "rloo", "--n-samples", "2", "--steps", "4",
           "--eval-every", "2", "--eval-size", "20", "--eval-k", "2", "--var-reps", "2", "--latent-dim", "6",
           "--batch-size", "10", "--out", str(tmp_path), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("storch-bench: ") == 1  # one header: rank 0's
    assert proc.stdout.count("rloo(n=2)") == 2  # in the header and in one table: rank 0's
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run_dir / "summary.json").is_file() and (run_dir / "metrics.csv").is_file()
    assert '"world_size": 2' in (run_dir / "config.json").read_text()
    # an odd split is refused with the reason, on every rank
    bad = subprocess.run(cmd[:-3] + ["--batch-size", "9", "--out", str(tmp_path / "odd"), "--no-progress"],
                         capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=ROOT)
    assert bad.returncode != 0 and "does not split evenly over 2 ranks" in bad.stderr


# ------------------------------------------------------------------ one process: everything is a no-op


def test_one_process_nothing_syncs():
    assert not distributed.is_initialized() and distributed.world_size() == 1 and not distributed.syncing()
    g = torch.tensor([1.0, 2.0])
    distributed.all_reduce_mean_([g])
    assert torch.equal(g, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="floating-point"):
        distributed.all_reduce_mean_([torch.tensor([1, 2])])


def test_init_from_env_says_to_use_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        distributed.init_process_group_from_env()


def test_bench_cli_distributed_without_torchrun(monkeypatch, capsys):
    from storch.bench import cli

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["--distributed", "--steps", "1"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_methods_sync_flag_and_exclusion_from_ddp():
    from torch import nn

    from storch.method import LAX, REBAR, RELAX, ScoreFunction

    assert RELAX("z", control_variate=nn.Linear(2, 1)).sync and not REBAR("z", sync=False).sync
    assert "sync=False" in repr(LAX("z", control_variate=nn.Linear(2, 1), sync=False))
    method = ScoreFunction("z", n_samples=2, baseline_factory="moving_average")
    assert method.baseline.sync
    model = nn.Module()
    model.inner = nn.Module()
    model.inner.method = REBAR("z")
    model.other = nn.Linear(1, 1)
    assert distributed.exclude_methods_from_ddp(model) == ["inner.method.log_temperature", "inner.method.eta"]
    assert model._ddp_params_and_buffers_to_ignore == ["inner.method.log_temperature", "inner.method.eta"]
    storch.reset()
