"""One rank of the data-parallel checks of tests/test_distributed.py (run as a script, 2 processes).

    python tests/_distributed_worker.py RANK WORLD_SIZE OUT_DIR

The ranks meet through a file store in OUT_DIR (no port to choose) and talk over gloo on the
loopback interface. Each rank writes what it measured to ``OUT_DIR/rank{RANK}.pt``; the test
compares the ranks. Importing this file does nothing (pytest's doctest collection imports it).
"""

from __future__ import annotations

import copy
import gc
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributions import OneHotCategorical

import storch
from storch import distributed
from storch.method import REBAR, RELAX, Critic, Expect, ScoreFunction
from storch.method.baseline import MovingAverageBaseline

D, K, BATCH = 5, 4, 8


class Net(nn.Module):
    """``x → OneHotCategorical(enc(x)) → z → ‖dec(z) − x‖²`` with the method inside the model."""

    def __init__(self, method: storch.method.Method) -> None:
        super().__init__()
        self.enc = nn.Linear(D, K)
        self.dec = nn.Linear(K, D)
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = storch.denote_independent(x, 0, "data")
        z = self.method(OneHotCategorical(logits=self.enc(xs)))
        return ((self.dec(z) - xs) ** 2).sum(-1)


def data() -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(123))


def shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n]


def step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer | None = None) -> float:
    storch.reset()
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    storch.add_cost(model(x), "f")
    loss = float(storch.backward())
    if opt is not None:
        opt.step()
    return loss


def ddp(model: nn.Module) -> nn.Module:
    distributed.exclude_methods_from_ddp(model)
    return nn.parallel.DistributedDataParallel(model)


def check_helpers(rank: int, out: dict) -> None:
    a = torch.tensor([1.0, 2.0]) * (rank + 1)
    b = torch.tensor([10.0], dtype=torch.float64) * (rank + 1)
    distributed.all_reduce_mean_([a, b])
    out["mean_a"], out["mean_b"] = a, b
    p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    p.grad = torch.full((2,), float(rank + 1))
    q.grad = torch.ones(3) if rank == 1 else None  # only rank 1 has a gradient for q
    r = nn.Parameter(torch.zeros(1))  # no gradient anywhere
    distributed.all_reduce_gradients_([p, q, r])
    out["grad_p"], out["grad_q"], out["grad_r_is_none"] = p.grad, q.grad, r.grad is None
    c = torch.tensor([float(rank)])
    distributed.broadcast_([c])
    out["broadcast"] = c
    with distributed.local_only():
        out["local_only_syncing"] = distributed.syncing()
        d = torch.tensor([float(rank)])
        distributed.all_reduce_mean_([d])  # a no-op: rank 0 alone could call it
        out["local_only_value"] = d


def check_expect_matches_one_process(rank: int, world: int, out: dict) -> None:
    """(a) DDP's averaged gradient of the local exact estimates = the whole batch in one process."""
    torch.manual_seed(0)
    model = Net(Expect("z"))
    reference = copy.deepcopy(model)
    x = data()
    with distributed.local_only():
        step(reference, x)
    wrapped = ddp(model)
    step(wrapped, shard(x, rank, world))
    diffs = [(p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())]
    out["expect_max_grad_diff"] = max(diffs)
    out["expect_grads"] = [p.grad.clone() for p in model.parameters()]


def train_learned(rank: int, world: int, method_factory, steps: int = 5) -> tuple[list, list]:
    """Several DDP steps, each rank on its shard and with its own random stream."""
    torch.manual_seed(0)
    model = Net(method_factory())
    wrapped = ddp(model)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("method.")], lr=1e-2)
    torch.manual_seed(1000 + rank)  # the ranks draw different samples
    x = data()
    for _ in range(steps):
        step(wrapped, shard(x, rank, world), opt)
    method_params = [p.detach().clone() for p in model.method.parameters()]
    model_params = [p.detach().clone() for n, p in model.named_parameters() if not n.startswith("method.")]
    return method_params, model_params


def relax(sync: bool) -> RELAX:
    return RELAX("z", control_variate=nn.Linear(K, 1), n_samples=2, sync=sync,
                 optimizer_factory=lambda ps: torch.optim.Adam(ps, lr=1e-2))


def check_learned_control_variates(rank: int, world: int, out: dict) -> None:
    """(b) RELAX / REBAR / critic parameters equal across ranks with the sync, different without."""
    for name, factory in [
        ("relax_sync", lambda: relax(True)),
        ("relax_nosync", lambda: relax(False)),
        ("rebar_sync", lambda: REBAR("z", n_samples=2, lr=1e-2)),
        ("critic_sync", lambda: ScoreFunction("z", n_samples=2, baseline_factory=Critic(hidden=8))),
        ("critic_nosync", lambda: ScoreFunction("z", n_samples=2, baseline_factory=Critic(hidden=8, sync=False))),
    ]:
        out[f"{name}_method"], out[f"{name}_model"] = train_learned(rank, world, factory)


def check_moving_average(rank: int, world: int, out: dict) -> None:
    """(c) A synced moving-average baseline is the same on every rank (and is the global average)."""
    for sync in (True, False):
        torch.manual_seed(0)
        model = Net(ScoreFunction("z", n_samples=2, baseline_factory=MovingAverageBaseline(0.8, sync=sync)))
        wrapped = ddp(model)
        opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("method.")], lr=1e-2)
        torch.manual_seed(2000 + rank)
        x = data()
        losses = [step(wrapped, shard(x, rank, world), opt) for _ in range(4)]
        out[f"ma_sync{sync}_average"] = model.method.baseline.averages["f"].clone()
        out[f"ma_sync{sync}_losses"] = losses


#: a small storch-bench configuration (the test runs the same in one process for comparison)
BENCH = dict(data="digits", steps=4, eval_every=2, eval_size=30, eval_k=4, eval_elbo_k=2, var_every=None,
             batch_size=10, latent_dim=4, lr=1e-2)


def check_bench(rank: int, out_dir: Path, out: dict) -> None:
    """storch-bench under DDP: exact enumeration (deterministic) and a RELAX run resumed from a checkpoint."""
    from storch.bench import train
    from storch.bench.data import load_dataset

    digits = load_dataset("digits")
    quiet = dict(progress=False, log=lambda *_: None)
    out["bench_expect"] = train.run({**BENCH, "estimator": "expect"}, out_dir / "expect", data=digits, **quiet)
    relax_cfg = {**BENCH, "estimator": "relax", "checkpoint_every": 2, "var_every": 2, "var_reps": 2}
    out["bench_full"] = train.run(relax_cfg, out_dir / "full", data=digits, **quiet)
    train.run({**relax_cfg, "steps": 2}, out_dir / "part", data=digits, **quiet)
    out["bench_resumed"] = train.resume(out_dir / "part", steps=4, **quiet)


def main() -> None:
    rank, world, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    out: dict = {"world": distributed.world_size(), "rank": distributed.rank()}
    try:
        check_helpers(rank, out)
        check_expect_matches_one_process(rank, world, out)
        check_learned_control_variates(rank, world, out)
        check_moving_average(rank, world, out)
        check_bench(rank, out_dir, out)
        gc.collect()  # free the DDP wrappers (their reducers hold the process group) before teardown
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    torch.save(out, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
