"""Where the eager storch step of the linear SBN spends its time over the hand-written step, piece by piece.

``benchmarks/sbn_step.py`` times whole steps; this script times the pieces of one REINFORCE step
(``sbn_step.storch_grad``) next to the same piece on plain tensors, as the hand-written step
(``sbn_step.hw_score_function``) computes it:

* ``denote_independent``: marking the data plate (no plain counterpart: 0);
* ``Bernoulli(logits=…)``: a distribution built on a plated tensor (its argument validation runs
  on storch tensors);
* ``method(q)`` / ``q.sample((1,))``: drawing the sample (storch also makes the node);
* ``q.log_prob(z).sum(-1)``: one log-probability with its sample validation (``broadcast_all``,
  ``binary_cross_entropy_with_logits``, the support check), of which the step has three;
* ``broadcast_all``, ``binary_cross_entropy_with_logits`` (after ``broadcast_all``), ``z == 0``,
  ``neg`` and ``sum``: the operations inside it, one at a time;
* ``add_cost + surrogate``: registering the cost and forming the surrogate loss (storch recomputes
  ``log q(z)``, forms the magic box and reduces the plates) against ``(f + f.detach() * log_q).mean()``;
* ``add_cost + surrogate`` of the ARM and DisARM steps (``sbn_step.make_method("ARM")``): the
  control-variate term of the antithetic pair and the weighted reduction over the pair, against the
  same arithmetic in ``sbn_step.hw_arm`` / ``hw_disarm`` (from the pair's costs to the loss).

Each row runs the plain and the storch piece in alternating blocks and reports the minimum block
of each (µs per call, thread CPU time: other processes on the machine do not count) and the median
of the paired differences, so that load that changes slower than a block pair cancels. One thread.

Run from the repository root::

    .venv/bin/python benchmarks/eager_breakdown.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributions import Bernoulli
from torch.distributions.utils import broadcast_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import storch  # noqa: E402
import sbn_step  # noqa: E402
from storch import inference  # noqa: E402

__all__ = ["paired", "pieces", "main"]


def paired(plain: Callable, stochastic: Callable, inner: int, pairs: int) -> tuple[float, float, float]:
    """``(min plain µs, min storch µs, median paired difference µs)`` over ``pairs`` block pairs."""
    for _ in range(3):
        plain(), stochastic()
    p, s = [], []
    for _ in range(pairs):
        t0 = time.thread_time()
        for _ in range(inner):
            plain()
        t1 = time.thread_time()
        for _ in range(inner):
            stochastic()
        t2 = time.thread_time()
        p.append((t1 - t0) / inner * 1e6)
        s.append((t2 - t1) / inner * 1e6)
    return min(p), min(s), statistics.median(b - a for a, b in zip(p, s))


def _surrogate_of(cost: torch.Tensor) -> torch.Tensor:
    """``storch.add_cost`` then the surrogate loss, leaving the registry empty (no backward)."""
    storch.add_cost(cost, "neg_elbo")
    try:
        return inference._surrogate(storch.registered_costs(), inference._Record())
    finally:
        inference._clear_registry()


def pieces() -> list[tuple[str, Callable, Callable]]:
    """``(label, plain piece, storch piece)`` for the REINFORCE step of ``sbn_step`` at batch 50."""
    batch = torch.bernoulli(torch.full((sbn_step.BATCH, sbn_step.X_DIM), 0.3), generator=torch.Generator().manual_seed(0))
    model, _ = sbn_step.make_model(0)
    method = sbn_step.make_method("REINFORCE")
    x = storch.denote_independent(batch, 0, "data")
    logits, logits_plain = model.encoder(x), model.encoder(batch)
    q, q_plain = Bernoulli(logits=logits), Bernoulli(logits=logits_plain)
    z, z_plain = method(q), q_plain.sample((1,))
    log_px = Bernoulli(logits=model.decoder(z)).log_prob(x).sum(-1)
    log_pz = Bernoulli(logits=model.prior_logits).log_prob(z).sum(-1)
    log_qz = q.log_prob(z).sum(-1)
    cost = -(log_px + log_pz - log_qz)
    cost_plain, log_qz_plain = cost.as_subclass(torch.Tensor), log_qz.as_subclass(torch.Tensor)
    b, b_plain = broadcast_all(logits, z), broadcast_all(logits_plain, z_plain)
    bce = F.binary_cross_entropy_with_logits(*b, reduction="none")
    bce_plain = bce.as_subclass(torch.Tensor)
    storch.reset()

    def draw():
        method(q)
        storch.reset()

    return [
        ("denote_independent", lambda: None, lambda: storch.denote_independent(batch, 0, "data")),
        ("Bernoulli(logits=...)", lambda: Bernoulli(logits=logits_plain), lambda: Bernoulli(logits=logits)),
        ("method(q) / q.sample((1,))", lambda: q_plain.sample((1,)), draw),
        ("q.log_prob(z).sum(-1)", lambda: q_plain.log_prob(z_plain).sum(-1), lambda: q.log_prob(z).sum(-1)),
        ("  broadcast_all", lambda: broadcast_all(logits_plain, z_plain), lambda: broadcast_all(logits, z)),
        ("  bce_with_logits", lambda: F.binary_cross_entropy_with_logits(*b_plain, reduction="none"),
         lambda: F.binary_cross_entropy_with_logits(*b, reduction="none")),
        ("  z == 0", lambda: z_plain == 0, lambda: z == 0),
        ("  neg", lambda: -bce_plain, lambda: -bce),
        ("  sum(-1)", lambda: bce_plain.sum(-1), lambda: bce.sum(-1)),
        ("add_cost + surrogate", lambda: (cost_plain + cost_plain.detach() * log_qz_plain).mean(),
         lambda: _surrogate_of(cost)),
    ]


def antithetic_pieces() -> list[tuple[str, Callable, Callable]]:
    """``(label, hand-written arithmetic, storch add_cost + surrogate)`` for the ARM and DisARM steps."""
    rows = []
    seeded = torch.Generator().manual_seed(0)
    batch = torch.bernoulli(torch.full((sbn_step.BATCH, sbn_step.X_DIM), 0.3), generator=seeded)
    model, _ = sbn_step.make_model(0)
    for name in ("ARM", "DisARM"):
        method = sbn_step.make_method(name)
        x = storch.denote_independent(batch, 0, "data")
        q = Bernoulli(logits=model.encoder(x))
        z = method(q)
        log_px = Bernoulli(logits=model.decoder(z)).log_prob(x).sum(-1)
        log_pz = Bernoulli(logits=model.prior_logits).log_prob(z).sum(-1)
        cost = -(log_px + log_pz - z.log_prob().sum(-1))
        terms = sbn_step._antithetic(model, batch, 1)
        storch.reset()

        def plain(terms=terms, name=name) -> torch.Tensor:
            return sbn_step.antithetic_loss(name, *terms)

        rows.append((f"add_cost + surrogate, {name}", plain, lambda cost=cost: _surrogate_of(cost)))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inner", type=int, default=20, help="calls per block")
    ap.add_argument("--pairs", type=int, default=60, help="block pairs per row")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'piece':28s} {'plain':>8s} {'storch':>8s} {'storch - plain':>15s}   (µs per call; min blocks, median paired difference)")
    for label, plain, stochastic in pieces() + antithetic_pieces():
        p, s, d = paired(plain, stochastic, args.inner, args.pairs)
        print(f"{label:28s} {p:8.1f} {s:8.1f} {d:15.1f}")


if __name__ == "__main__":
    main()
