"""Where storch − floor goes: the linear SBN step (``sbn_step.storch_grad``) timed phase by phase.

``benchmarks/sbn_step.py`` times whole steps; ``benchmarks/eager_breakdown.py`` times pieces in
isolation, where they run warm. This script times the phases of whole steps as they run one after
the other (each phase sees the caches the previous one left), next to the same phases of the
hand-written step (``sbn_step.hw_score_function``, ``hw_arm``, ``hw_disarm``) on plain tensors and on
the floor's subclass (``common.FloorTensor``):

* ``denote``: ``model.zero_grad`` and ``storch.denote_independent`` (plain: ``zero_grad`` only);
* ``encoder``: ``Bernoulli(logits=model.encoder(x))``;
* ``sample``: drawing ``z`` (storch also makes the node);
* ``log_px``, ``log_pz``, ``log_qz``: the three log-probabilities of the negative ELBO, each summed;
* ``cost``: ``-(log_px + log_pz - log_qz)``;
* ``add_cost``: registering it (nothing by hand);
* ``surrogate``: the surrogate loss (by hand: the estimator's arithmetic);
* ``checks_hooks``: the finiteness check, the unused-node check, the hooks that fill ``param_grads``;
* ``autograd``: the backward pass;
* ``update_clear``: the methods' updates and clearing the registry.

The step is that of ``storch.backward``, taken apart (``storch.inference``'s own functions, called in
its order). Thread CPU time, medians over steps, µs; one thread; no optimizer step. Run from the
repository root::

    .venv/bin/python benchmarks/step_phases.py                  # REINFORCE RLOO ARM DisARM
    .venv/bin/python benchmarks/step_phases.py --estimators ARM --blocks 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributions import Bernoulli

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import storch  # noqa: E402
import sbn_step  # noqa: E402
from common import floor_view  # noqa: E402
from storch import inference  # noqa: E402

__all__ = ["PHASES", "storch_phases", "hand_phases", "main"]

PHASES = ("denote", "encoder", "sample", "log_px", "log_pz", "log_qz", "cost", "add_cost", "surrogate",
          "checks_hooks", "autograd", "update_clear")
_now = time.thread_time_ns


def storch_phases(model: sbn_step.LinearSBN, data: torch.Tensor, method, times: list[list[int]]) -> None:
    """One storch step (``sbn_step.storch_grad``, its ``storch.backward`` taken apart), phase by phase."""
    t = [_now()]
    model.zero_grad(set_to_none=True)
    x = storch.denote_independent(data, 0, "data")
    t.append(_now())
    q = Bernoulli(logits=model.encoder(x))
    t.append(_now())
    z = method(q)
    t.append(_now())
    log_px = Bernoulli(logits=model.decoder(z)).log_prob(x).sum(-1)
    t.append(_now())
    log_pz = Bernoulli(logits=model.prior_logits).log_prob(z).sum(-1)
    t.append(_now())
    log_qz = z.log_prob().sum(-1)
    t.append(_now())
    cost = -(log_px + log_pz - log_qz)
    t.append(_now())
    storch.add_cost(cost, "neg_elbo")
    t.append(_now())
    costs, record = storch.registered_costs(), inference._Record()
    loss = inference._surrogate(costs, record)
    t.append(_now())
    inference._check_finite(loss, costs)
    inference._warn_unused_nodes(inference._unused_nodes(costs))
    handles = inference._retain_param_grads(record)
    t.append(_now())
    loss.backward()
    for handle in handles:
        handle.remove()
    t.append(_now())
    for m, triples in record.triples.values():
        m.update_parameters(triples)
    inference._clear_registry()
    t.append(_now())
    for i, phase in enumerate(times):
        phase.append(t[i + 1] - t[i])


def hand_phases(model: sbn_step.LinearSBN, x: torch.Tensor, name: str, times: list[list[int]]) -> None:
    """The hand-written step of ``name`` (as in ``sbn_step``), phase by phase (empty phases: 0)."""
    t = [_now()]
    model.zero_grad(set_to_none=True)
    t.append(_now())
    if name in ("REINFORCE", "RLOO"):
        n = 1 if name == "REINFORCE" else 2
        q = Bernoulli(logits=model.encoder(x))
        t.append(_now())
        z = q.sample((n,))
        t.append(_now())
    else:
        phi = model.encoder(x)
        q = Bernoulli(logits=phi)
        t.append(_now())
        phid = phi.detach()
        u = torch.rand((1,) + tuple(phid.shape), dtype=phid.dtype)
        b = (u < torch.sigmoid(phid)).to(phid.dtype)
        bt = (u > torch.sigmoid(-phid)).to(phid.dtype)
        z = torch.stack([b, bt], 1).reshape((2,) + tuple(phid.shape))
        t.append(_now())
    log_px = Bernoulli(logits=model.decoder(z)).log_prob(x).sum(-1)
    t.append(_now())
    log_pz = Bernoulli(logits=model.prior_logits).log_prob(z).sum(-1)
    t.append(_now())
    log_qz = q.log_prob(z).sum(-1)
    t.append(_now())
    f = -(log_px + log_pz - log_qz)
    t.append(_now())
    t.append(_now())  # add_cost: nothing
    if name in ("REINFORCE", "RLOO"):
        fd = f.detach()
        signal = fd if n == 1 else fd - (fd.sum(0, keepdim=True) - fd) / (n - 1)
        loss = (f + signal * log_qz).mean()
    else:
        loss = sbn_step.antithetic_loss(name, phi, phid, u, b, bt, f)
    t.append(_now())
    t.append(_now())  # checks and hooks: none
    loss.backward()
    t.append(_now())
    t.append(_now())  # update and clear: nothing
    for i, phase in enumerate(times):
        phase.append(t[i + 1] - t[i])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--estimators", nargs="+", default=["REINFORCE", "RLOO", "ARM", "DisARM"],
                    choices=["REINFORCE", "RLOO", "ARM", "DisARM"])
    ap.add_argument("--blocks", type=int, default=40, help="interleaved blocks of 10 steps per variant")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = torch.bernoulli(torch.full((sbn_step.BATCH, sbn_step.X_DIM), 0.3), generator=torch.Generator().manual_seed(0))
    for name in args.estimators:
        model, _ = sbn_step.make_model(0)
        method = sbn_step.make_method(name)
        runs = {v: [[] for _ in PHASES] for v in ("storch", "hand", "floor")}
        for _ in range(20):  # warm-up
            storch_phases(model, data, method, [[] for _ in PHASES])
            hand_phases(model, data, name, [[] for _ in PHASES])
        for _ in range(args.blocks):
            for _ in range(10):
                storch_phases(model, data, method, runs["storch"])
            for _ in range(10):
                hand_phases(model, data, name, runs["hand"])
            for _ in range(10):
                hand_phases(model, floor_view(data), name, runs["floor"])
        print(f"{name}: phase, µs (median) {'storch':>8s} {'hand':>8s} {'floor':>8s} {'storch-floor':>13s}")
        totals = [0.0, 0.0, 0.0]
        for i, phase in enumerate(PHASES):
            s, h, f = (statistics.median(runs[v][i]) / 1000 for v in ("storch", "hand", "floor"))
            totals = [totals[0] + s, totals[1] + h, totals[2] + f]
            print(f"  {phase:14s} {s:8.1f} {h:8.1f} {f:8.1f} {s - f:13.1f}")
        s, h, f = totals
        print(f"  {'sum':14s} {s:8.1f} {h:8.1f} {f:8.1f} {s - f:13.1f}   (storch - floor = {(s - f) / h:.2f} of hand)")


if __name__ == "__main__":
    main()
