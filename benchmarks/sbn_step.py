"""Linear sigmoid belief network (784-[200]) on binarized MNIST: storch vs. hand-written steps.

The ``sbn-linear`` model of the ARM (Yin & Zhou 2019) and DisARM (Dong, Mnih & Tucker 2020)
papers::

    q(z|x) = Bernoulli(logits = W_q x + b_q),   z in {0, 1}^200       (encoder)
    p(x|z) = Bernoulli(logits = W_p z + b_p)                           (decoder)
    p(z)   = Bernoulli(logits = b_prior)                               (learned prior)
    f(x, z) = -[log p(x|z) + log p(z) - log q(z|x)]                    (negative ELBO per datum)

Minibatches of 50, Adam (lr 1e-3), one thread. Four estimators of the encoder gradient; decoder
and prior get the pathwise gradient of the ELBO in every case:

* ``REINFORCE`` (n=1):  storch ``ScoreFunction("z", n_samples=1)``
* ``RLOO`` (n=2):       storch ``ScoreFunction("z", n_samples=2, baseline_factory="batch_average")``
* ``ARM`` (1 pair):     storch ``ARM("z", n_samples=1)``    (2 cost evaluations)
* ``DisARM`` (1 pair):  storch ``DisARM("z", n_samples=1)`` (2 cost evaluations)
* ``BSB`` (n=1):        storch ``LocalExpectation("z", n_samples=1)``, the GSB paper's Bernoulli rule
  (local expectations): the sample and its 200 one-bit flips, 201 cost evaluations

In the storch steps the negative ELBO is one cost, registered with ``storch.add_cost``, whose
``log q(z|x)`` is the samples' own ``z.log_prob()``, so its direct dependence on the encoder
(the pathwise gradient of ``log q`` at the fixed sample) is part of the estimate, and the
estimators that need ``log q(z|x)`` reuse it, as the hand-written steps do. The hand-written
steps (plain PyTorch, :func:`hw_score_function`, :func:`hw_arm`, :func:`hw_disarm`) compute the
same estimators, including that direct term. Both build their Bernoulli distributions with
``torch.distributions`` so that the ratio of step times measures storch's overhead and not that
of ``torch.distributions``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/sbn_step.py --check      # hand-written == storch on the same draws
    .venv/bin/python benchmarks/sbn_step.py              # interleaved timing table (~1 min)
    .venv/bin/python benchmarks/sbn_step.py --blocks 4 --steps 5 --warmup 5   # smoke run
    .venv/bin/python benchmarks/sbn_step.py --train 3000 --seeds 0 1 2   # same test -ELBO within 1 nat?

The timing table has a third variant, the *floor*: the hand-written step with its data wrapped in
``common.FloorTensor``, a tensor subclass whose ``__torch_function__`` only calls the function. It is
what any ``__torch_function__`` library pays before doing work of its own; ``storch - floor`` is
storch's own cost.

``--check`` seeds both versions identically: storch draws its samples with the same torch calls
(``Bernoulli.sample((n,))`` for the score function, ``torch.rand((n, *logits.shape))`` for
ARM/DisARM), so the draws align exactly and the gradients are compared directly, in float64.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributions import Bernoulli

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import storch  # noqa: E402
from common import floor_view  # noqa: E402

X_DIM = 784
Z_DIM = 200
BATCH = 50
LR = 1e-3
DEFAULT_DATA = ROOT.parent / "shared" / "data"

ESTIMATORS = ("REINFORCE", "RLOO", "ARM", "DisARM", "BSB")
# storch; the hand-written step; the hand-written step on a do-nothing tensor subclass (FloorTensor);
# the storch step under storch.compile_step (traced once, replayed as a graph of aten operations)
VARIANTS = ("storch", "hand-written", "floor", "compiled")


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------


class LinearSBN(nn.Module):
    """784-[200] linear sigmoid belief network with a linear Bernoulli encoder."""

    def __init__(self, x_dim: int = X_DIM, z_dim: int = Z_DIM, train_mean: Optional[torch.Tensor] = None):
        super().__init__()
        self.encoder = nn.Linear(x_dim, z_dim)
        self.decoder = nn.Linear(z_dim, x_dim)
        self.prior_logits = nn.Parameter(torch.zeros(z_dim))
        if train_mean is not None:  # decoder bias at the logit of the pixel means, as in the papers
            with torch.no_grad():
                m = train_mean.clamp(1e-3, 1 - 1e-3)
                self.decoder.bias.copy_(torch.log(m) - torch.log1p(-m))


def make_model(seed: int = 0, train_mean: Optional[torch.Tensor] = None, dtype=torch.float32):
    torch.manual_seed(seed)
    model = LinearSBN(train_mean=train_mean).to(dtype)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


# --------------------------------------------------------------------------------------------
# hand-written steps (plain PyTorch). Each computes the gradient into .grad and returns the
# estimate of the mean negative ELBO; the optimizer step is taken by the caller.
# --------------------------------------------------------------------------------------------


def _neg_elbo(model: LinearSBN, x: torch.Tensor, z: torch.Tensor, q: Bernoulli) -> Tuple[torch.Tensor, torch.Tensor]:
    """``f = -(log p(x|z) + log p(z) - log q(z|x))`` of shape ``z.shape[:-1]`` and ``log q(z|x)``."""
    log_px = Bernoulli(logits=model.decoder(z)).log_prob(x).sum(-1)
    log_pz = Bernoulli(logits=model.prior_logits).log_prob(z).sum(-1)
    log_qz = q.log_prob(z).sum(-1)
    return -(log_px + log_pz - log_qz), log_qz


def hw_score_function(model: LinearSBN, x: torch.Tensor, n: int) -> torch.Tensor:
    """REINFORCE (n=1, no baseline) or RLOO (n>=2, leave-one-out baseline)::

        z_j ~ q (no gradient),  f_j = f(x, z_j),  b_j = (sum_{m!=j} f_m)/(n-1)  (0 for n=1)
        surrogate = mean_{j, batch} [ f_j + stopgrad(f_j - b_j) * log q(z_j|x) ]

    ``f_j`` keeps its own gradient: the decoder and prior get the pathwise gradient, and the
    encoder the direct gradient of ``log q(z_j|x)`` at the fixed sample besides the score term.
    """
    model.zero_grad(set_to_none=True)
    q = Bernoulli(logits=model.encoder(x))  # (B, Z)
    z = q.sample((n,))  # (n, B, Z)
    f, log_qz = _neg_elbo(model, x, z, q)  # (n, B)
    fd = f.detach()
    signal = fd if n == 1 else fd - (fd.sum(0, keepdim=True) - fd) / (n - 1)
    loss = (f + signal * log_qz).mean()
    loss.backward()
    return fd.mean()


def _antithetic(model: LinearSBN, x: torch.Tensor, n: int):
    """Shared part of ARM/DisARM: ``n`` uniforms, the pairs ``[b, b~]`` and the costs of both."""
    phi = model.encoder(x)  # (B, Z)
    q = Bernoulli(logits=phi)
    phid = phi.detach()
    u = torch.rand((n,) + tuple(phid.shape), dtype=phid.dtype, device=phid.device)
    b = (u < torch.sigmoid(phid)).to(phid.dtype)
    bt = (u > torch.sigmoid(-phid)).to(phid.dtype)
    z = torch.stack([b, bt], 1).reshape((2 * n,) + tuple(phid.shape))  # points b_1, b~_1, b_2, ...
    f, _ = _neg_elbo(model, x, z, q)  # (2n, B)
    return phi, phid, u, b, bt, f


def antithetic_loss(estimator: str, phi, phid, u, b, bt, f) -> torch.Tensor:
    """The hand-written ARM or DisARM surrogate from the pairs' costs ``f`` (``2n`` points, ``b_1, b~_1,
    b_2, ...``): ``mean(f) + mean_{n, batch} sum_i (phi_i - stopgrad phi_i) g_i`` with ARM's or DisARM's
    ``g`` (`hw_arm`, `hw_disarm`)."""
    pairs = f.detach().reshape(u.shape[0], 2, -1)
    f_b, f_bt = pairs[:, 0].unsqueeze(-1), pairs[:, 1].unsqueeze(-1)
    if estimator == "ARM":
        g = (f_bt - f_b) * (u - 0.5)  # (n, B, Z)
    else:
        g = 0.5 * (f_b - f_bt) * (1.0 - 2.0 * bt) * (b != bt).to(phid.dtype) * torch.sigmoid(phid.abs())
    return f.mean() + ((phi - phid) * g).sum(-1).mean()


def hw_arm(model: LinearSBN, x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """ARM (Yin & Zhou 2019), ``g_phi = [f(b~) - f(b)] (u - 1/2)`` with ``b = 1[u < s(phi)]`` and
    ``b~ = 1[u > s(-phi)]``; surrogate ``mean(f over the 2n points) + mean_{n, batch} sum_i
    (phi_i - stopgrad phi_i) g_i``. The cost keeps its own gradient at both points (pathwise for
    the decoder and prior, the direct ``log q`` term for the encoder)."""
    model.zero_grad(set_to_none=True)
    terms = _antithetic(model, x, n)
    antithetic_loss("ARM", *terms).backward()
    return terms[-1].detach().mean()


def hw_disarm(model: LinearSBN, x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """DisARM (Dong et al. 2020), ``g_phi_i = 1/2 (f(b) - f(b~)) (-1)^{b~_i} 1[b_i != b~_i]
    s(|phi_i|)`` on the same antithetic pairs as ARM; the same surrogate otherwise."""
    model.zero_grad(set_to_none=True)
    terms = _antithetic(model, x, n)
    antithetic_loss("DisARM", *terms).backward()
    return terms[-1].detach().mean()


def hw_bsb(model: LinearSBN, x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """BSB (Echraibi et al., the GSB paper's Bernoulli rule) = local expectations::

        z_j ~ q (no gradient);  z_j^(d) = z_j with bit d flipped, d = 1..D;
        g_phi_d = [p_d(1 - z_jd)]' (f(z_j^(d)) - f(z_j))   (the sample's own value drops out)
        surrogate = mean_{j, batch} [ f(z_j) + sum_d (q_d - stopgrad q_d) stopgrad(f(z_j^(d)) - f(z_j)) ]

    with ``q_d = p_d(1 − z_jd)`` the probability of the flipped value. The model is evaluated at the
    ``n·(1 + D)`` points in one batched call, as a user would write it.
    """
    model.zero_grad(set_to_none=True)
    phi = model.encoder(x)  # (B, Z)
    q = Bernoulli(logits=phi)
    z = q.sample((n,))  # (n, B, Z)
    flips = torch.eye(z.shape[-1], dtype=torch.bool)  # (d, Z): which bit each point flips
    changed = torch.where(flips[:, None], 1.0 - z[:, None], z[:, None])  # (n, d, B, Z)
    points = torch.cat([z[:, None], changed], 1)  # (n, 1 + D, B, Z)
    f, _ = _neg_elbo(model, x, points, q)  # (n, 1 + D, B)
    f0 = f[:, 0]
    gaps = (f[:, 1:] - f0[:, None]).detach().transpose(1, 2)  # (n, B, D)
    p = torch.sigmoid(phi)
    q_other = torch.where(z == 1.0, 1.0 - p, p)  # probability of the flipped value
    loss = f0.mean() + ((q_other - q_other.detach()) * gaps).sum(-1).mean()
    loss.backward()
    return f0.detach().mean()


# --------------------------------------------------------------------------------------------
# storch steps
# --------------------------------------------------------------------------------------------


def make_method(name: str):
    m = storch.method
    if name == "REINFORCE":
        return m.ScoreFunction("z", n_samples=1)
    if name == "RLOO":
        return m.ScoreFunction("z", n_samples=2, baseline_factory="batch_average")
    if name == "ARM":
        return m.ARM("z", n_samples=1)
    if name == "DisARM":
        return m.DisARM("z", n_samples=1)
    if name == "BSB":
        return m.LocalExpectation("z", n_samples=1)
    raise ValueError(name)


def storch_grad(model: LinearSBN, data: torch.Tensor, method) -> torch.Tensor:
    """The storch version, written as a user would: one cost, the negative ELBO."""
    model.zero_grad(set_to_none=True)
    x = storch.denote_independent(data, 0, "data")
    q = Bernoulli(logits=model.encoder(x))
    z = method(q)
    log_px = Bernoulli(logits=model.decoder(z)).log_prob(x).sum(-1)
    log_pz = Bernoulli(logits=model.prior_logits).log_prob(z).sum(-1)
    log_qz = z.log_prob().sum(-1)  # q.log_prob(z), computed once and shared with the estimator
    storch.add_cost(-(log_px + log_pz - log_qz), "neg_elbo")
    return storch.backward().detach()


def floor_grad(name: str) -> Callable[[LinearSBN, torch.Tensor], torch.Tensor]:
    """The hand-written step of ``name`` with the data as a ``common.FloorTensor``."""
    hw = hw_grad(name)

    def grad(model: LinearSBN, x: torch.Tensor) -> torch.Tensor:
        return hw(model, floor_view(x)).as_subclass(torch.Tensor)

    return grad


def hw_grad(name: str) -> Callable[[LinearSBN, torch.Tensor], torch.Tensor]:
    return {
        "REINFORCE": lambda model, x: hw_score_function(model, x, 1),
        "RLOO": lambda model, x: hw_score_function(model, x, 2),
        "ARM": lambda model, x: hw_arm(model, x, 1),
        "DisARM": lambda model, x: hw_disarm(model, x, 1),
        "BSB": lambda model, x: hw_bsb(model, x, 1),
    }[name]


# --------------------------------------------------------------------------------------------
# --check: same draws, same gradients
# --------------------------------------------------------------------------------------------


def _grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def check_estimators(
    data: torch.Tensor, seeds=(0, 1, 2), tol: float = 1e-5, dtype=torch.float64
) -> List[Tuple[str, float, float, float, bool]]:
    """For every estimator and seed: seed, storch gradient; same seed, hand-written gradient; same
    seed, a replay of the storch step under ``storch.compile_step``.

    Returns rows ``(estimator, max |value difference|, max |gradient difference| over all
    parameters and both storch versions, max |gradient|, ok)``, ``ok`` when the gradient difference
    is within ``tol`` (absolute, in ``dtype``) and the values agree.
    """
    data = data.to(dtype)
    model, _ = make_model(0, train_mean=data.mean(0), dtype=dtype)
    rows = []
    for name in ESTIMATORS:
        method = make_method(name)
        hw = hw_grad(name)
        compiled = storch.compile_step(functools.partial(storch_grad, model, method=method), model)
        compiled(data)  # the trace: the calls below are replays
        dv = dg = gmax = 0.0
        for seed in seeds:
            storch.reset()
            torch.manual_seed(seed)
            v_s = float(storch_grad(model, data, method))
            g_s = _grads(model)
            torch.manual_seed(seed)
            v_h = float(hw(model, data))
            g_h = _grads(model)
            torch.manual_seed(seed)
            v_c = float(compiled(data))
            g_c = _grads(model)
            dv = max(dv, abs(v_s - v_h), abs(v_c - v_h))
            for k in g_s:
                dg = max(dg, float((g_s[k] - g_h[k]).abs().max()), float((g_c[k] - g_h[k]).abs().max()))
                gmax = max(gmax, float(g_s[k].abs().max()))
        rows.append((name, dv, dg, gmax, dg <= tol and dv <= tol * max(1.0, abs(v_s))))
    return rows


def print_check(rows) -> bool:
    print(
        "check: storch (eager, and replayed by storch.compile_step) vs hand-written on identical draws "
        "(float64, seeds 0-2, tolerance 1e-5 absolute)"
    )
    print(f"{'estimator':<10} | {'max |dvalue|':>12} | {'max |dgrad|':>12} | {'max |grad|':>10} | ok")
    for name, dv, dg, gmax, ok in rows:
        print(f"{name:<10} | {dv:12.3e} | {dg:12.3e} | {gmax:10.3g} | {'yes' if ok else 'NO'}")
    return all(r[-1] for r in rows)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def load_train(data_dir: Path) -> torch.Tensor:
    from storch.datasets import load_binarized_mnist

    x, _ = load_binarized_mnist(data_dir, "train")
    return x


class Batches:
    """Shuffled minibatches of the training set, cycled."""

    def __init__(self, x: torch.Tensor, batch: int, seed: int):
        self.x, self.batch = x, batch
        self.gen = torch.Generator().manual_seed(seed)
        self._new_epoch()

    def _new_epoch(self):
        self.perm = torch.randperm(self.x.shape[0], generator=self.gen)
        self.pos = 0

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > self.perm.numel():
            self._new_epoch()
        idx = self.perm[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return self.x[idx]


def make_runners(train: torch.Tensor, name: str, batch: int):
    """One closure per variant (:data:`VARIANTS`), each running ``k`` training steps on its own
    model, optimizer and batches."""
    mean = train.mean(0)
    runners = {}
    for variant in VARIANTS:
        model, opt = make_model(0, train_mean=mean)
        batches = Batches(train, batch, seed=1)
        if variant == "storch":
            method = make_method(name)

            def grad(m=model, method=method, b=batches):
                return storch_grad(m, b.next(), method)

        elif variant == "compiled":
            step = storch.compile_step(functools.partial(storch_grad, model, method=make_method(name)), model)

            def grad(m=model, step=step, b=batches):
                m.zero_grad(set_to_none=True)  # as storch_grad does inside: no .grad comes in
                return step(b.next())

        else:
            hw = hw_grad(name) if variant == "hand-written" else floor_grad(name)

            def grad(m=model, hw=hw, b=batches):
                return hw(m, b.next())

        def run(k: int, grad=grad, opt=opt) -> float:
            t0 = time.thread_time()  # this thread's CPU time (one torch thread): other jobs do not count
            for _ in range(k):
                grad()
                opt.step()
            return (time.thread_time() - t0) * 1000.0 / k

        runners[variant] = run
    return runners


def load_split(data_dir: Path, split: str) -> torch.Tensor:
    from storch.datasets import load_binarized_mnist

    return load_binarized_mnist(data_dir, split)[0]


@torch.no_grad()
def test_neg_elbo(model: LinearSBN, x: torch.Tensor, samples: int = 10, seed: int = 0) -> float:
    """The test negative ELBO in nats: mean over ``x`` and ``samples`` draws of ``z ~ q(z|x)``."""
    gen = torch.Generator().manual_seed(seed)
    q = Bernoulli(logits=model.encoder(x))
    total = 0.0
    for _ in range(samples):
        z = torch.bernoulli(q.probs, generator=gen)
        total += _neg_elbo(model, x, z, q)[0].mean().item()
    return total / samples


def train_both(train: torch.Tensor, test: torch.Tensor, name: str, steps: int, batch: int, seed: int) -> Dict[str, float]:
    """Train the storch model (eager and under ``storch.compile_step``) and the hand-written model
    from one initialisation on the same minibatches and the same random stream; their test
    negative ELBOs."""
    result = {}
    for variant in ("storch", "compiled", "hand-written"):
        model, opt = make_model(0, train_mean=train.mean(0))
        batches = Batches(train, batch, seed=1)
        method, hw = make_method(name), hw_grad(name)
        compiled = storch.compile_step(functools.partial(storch_grad, model, method=method), model)
        torch.manual_seed(seed)
        for _ in range(steps):
            x = batches.next()
            if variant == "storch":
                storch_grad(model, x, method)
            elif variant == "compiled":
                compiled(x)
            else:
                hw(model, x)
            opt.step()
        result[variant] = test_neg_elbo(model, test)
    return result


def print_training(train: torch.Tensor, test: torch.Tensor, steps: int, batch: int, seeds: List[int]) -> bool:
    """Test -ELBO of storch (eager and compiled) and hand-written training side by side.

    The two runs of one seed see the same draws, but float rounding differs, and a high-variance
    estimator (REINFORCE without a baseline) lets the trajectories drift apart by about as much as
    two seeds do. The check is on the mean over seeds: True if it differs by at most 1 nat.
    """
    print(
        f"sbn-linear 784-[200] trained {steps} steps (batch {batch}, Adam {LR}) from one initialisation, same "
        f"minibatches and random stream; test -ELBO (nats, {test.shape[0]} test images x 10 samples)"
    )
    print(f"{'estimator':<10} | {'seed':>5} | {'storch':>8} | {'compiled':>8} | {'hand-written':>12} | difference")
    ok = True
    for name in ESTIMATORS:
        rows = [train_both(train, test, name, steps, batch, seed) for seed in seeds]
        for seed, r in zip(seeds, rows):
            print(f"{name:<10} | {seed:>5} | {r['storch']:8.2f} | {r['compiled']:8.2f} | {r['hand-written']:12.2f} | "
                  f"{r['storch'] - r['hand-written']:+.3f}")
        s_mean, c_mean, h_mean = (statistics.mean(r[v] for r in rows) for v in ("storch", "compiled", "hand-written"))
        ok &= abs(s_mean - h_mean) <= 1.0 and abs(c_mean - h_mean) <= 1.0
        print(f"{name:<10} | {'mean':>5} | {s_mean:8.2f} | {c_mean:8.2f} | {h_mean:12.2f} | {s_mean - h_mean:+.3f}")
    return ok


def bench(train: torch.Tensor, blocks: int, steps: int, warmup: int, batch: int, estimators=ESTIMATORS):
    runners = {name: make_runners(train, name, batch) for name in estimators}
    for r in runners.values():  # warm-up
        for variant in VARIANTS:
            r[variant](warmup)
    times = {name: {variant: [] for variant in VARIANTS} for name in estimators}
    for blk in range(blocks):  # interleaved blocks, rotating which variant goes first
        for i, name in enumerate(estimators):
            k = (blk + i) % len(VARIANTS)
            for variant in VARIANTS[k:] + VARIANTS[:k]:
                times[name][variant].append(runners[name][variant](steps))
    return times


def print_table(times, blocks: int, steps: int):
    print(
        f"sbn-linear 784-[200], batch {BATCH}, Adam lr {LR}, 1 thread; {blocks} interleaved blocks x "
        f"{steps} steps per variant; medians over blocks (ms/step)"
    )
    print(
        f"{'estimator':<10} | {'storch':>7} | {'hand-written':>12} | {'floor':>7} | {'compiled':>8} | "
        f"{'ratio':>6} | {'median block ratio':>18} | {'floor ratio':>11} | {'compiled ratio':>14} | storch - floor"
    )
    for name, t in times.items():
        s, h, f, c = (statistics.median(t[v]) for v in VARIANTS)

        def block_ratio(variant: str, t=t) -> float:
            return statistics.median(a / b for a, b in zip(t[variant], t["hand-written"]))

        print(
            f"{name:<10} | {s:7.3f} | {h:12.3f} | {f:7.3f} | {c:8.3f} | {s / h:6.2f} | "
            f"{block_ratio('storch'):18.2f} | {block_ratio('floor'):11.2f} | {block_ratio('compiled'):14.2f} | "
            f"{1000 * (s - f):8.0f} us"
        )
    print(
        "ratio: storch / hand-written. floor: the hand-written step with its data as a tensor subclass "
        "whose __torch_function__ only calls the function (FloorTensor): the cost any "
        "__torch_function__ library pays before doing its own work. compiled: the same storch step "
        "under storch.compile_step (backend 'eager': traced once, then replayed as a graph of aten "
        "operations); block ratios against hand-written."
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only check hand-written == storch gradients")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with binarized_mnist_packed.npz")
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--train", type=int, metavar="STEPS", help="train both versions STEPS steps and compare test -ELBO")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="random streams for --train")
    p.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=list(ESTIMATORS),
                   help="time these estimators only (default: all)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    if args.train:
        ok = print_training(load_train(args.data), load_split(args.data, "test"), args.train, args.batch, args.seeds)
        return 0 if ok else 1

    if args.check:
        try:
            data = load_train(args.data)[: args.batch]
        except Exception as e:  # the check does not need real data
            print(f"(no MNIST in {args.data}: {e}; checking on a random binary batch)")
            data = torch.bernoulli(torch.full((args.batch, X_DIM), 0.3, generator=None))
        return 0 if print_check(check_estimators(data)) else 1

    train = load_train(args.data)
    ok = print_check(check_estimators(train[: args.batch]))
    print()
    times = bench(train, args.blocks, args.steps, args.warmup, args.batch, tuple(args.estimators))
    print_table(times, args.blocks, args.steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
