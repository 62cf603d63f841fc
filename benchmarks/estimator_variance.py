"""Gradient variance and bias of every estimator at an equal budget of cost evaluations.

Run from the repository root::

    .venv/bin/python benchmarks/estimator_variance.py            # full run
    .venv/bin/python benchmarks/estimator_variance.py --quick    # smoke run (seconds)
    .venv/bin/python benchmarks/estimator_variance.py --help

Three problems:

(a) **Bernoulli toy** ``f(x) = Σ_i (x_i − p_i)²`` with ``p = (0.49, 0.499, 0.501, 0.51)``,
    ``x_i ~ Bernoulli(σ(θ_i))``, ``θ = 0``. The exact gradient comes from enumerating the 2⁴
    configurations (``Σ_x p_θ(x) f(x)`` differentiated with autograd); it is
    ``0.25·(1 − 2p) = (0.005, 0.0005, −0.0005, −0.005)``, tiny next to the noise of any estimator.
(b) **Categorical VAE, one minibatch**: the 64-256-128-(2×10)-128-256-64 discrete VAE of
    :mod:`storch.demo.vae` on binarized scikit-learn digits, first trained for a few epochs with
    exact gradients (``Expect``), then frozen. The gradient estimated is that of the negative ELBO
    (KL to the uniform prior + Bernoulli reconstruction loss), per datum, with respect to the
    encoder's logits of a fixed minibatch (``B × 2 × 10`` coordinates). The latent space has
    ``10² = 100`` configurations per datum, so the reference is **exact**: ``Expect`` (enumeration),
    not a sampled estimate.
(c) **Multi-sample bound** (VIMCO's objective): ``−log (1/K) Σ_k w(x_k)`` over the ``K`` samples of
    four Bernoulli latents (:class:`IWAEToy`), budget ``K``; exact gradient by enumerating the
    ``16^K`` tuples. Only VIMCO (with and without its leave-one-out baselines) applies; the other
    estimators are listed as not run.

Equal budget: a method's cost evaluations are the size of its node's plate (evaluation-group
methods such as ARM, MVD, LocalExpectation or REBAR put their extra points on the plate, see
:mod:`storch.method.groups`). For a budget ``B`` the benchmark chooses the largest number of samples
``n`` whose plate has at most ``B`` positions (the entry's evaluations-per-sample rule is the first
guess; the real plate size is measured) and prints the actual evaluations. ``Expect`` always
evaluates the whole support. Costs are evaluated per datum, so "evaluations" are per datum.

Per estimator and budget, ``R`` independent estimates are drawn in one backward pass with
:func:`storch.testing.replicated_gradients` (in chunks, to bound memory; a method that cannot be
replicated falls back to ``R`` separate backward passes, noted in the table). Columns:

* ``n``, ``evals``: samples (groups) and cost evaluations (plate size);
* ``bias²``: mean over coordinates of ``(ḡ − g*)² − s²/R``, an unbiased estimate of the squared bias
  (``ḡ``, ``s²``: mean and variance of the R estimates, ``g*`` exact); ≈ 0 (either sign) when unbiased;
* ``max|z|``: the largest ``|ḡ − g*| / (s/√R)`` over coordinates (differences below float32 rounding,
  1e-6 on the toy and 1e-5 on the VAE, are not counted); above ~4.5 the bias is significant (the
  VAE has 320 coordinates, so ~3.5 is the typical maximum of an unbiased estimator there; heavy
  tails of score-function estimates at small R can push it higher);
* ``variance``: mean over coordinates of ``s²``;
* ``MSE``: ``bias² + variance``;
* ``ms/est``: median wall time of one gradient estimate (graph, surrogate, backward), unreplicated.

The tables are printed and written to ``benchmarks/results/estimator_variance.txt`` (raw numbers in
``estimator_variance.json``; ``--quick`` writes ``estimator_variance_quick.*``). Estimators whose
module is not importable yet are listed under the tables with the reason (``--strict`` makes that
an error). The estimators and their evaluation rules are in ``estimator_registry.py``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, TextIO

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
if _REPO not in sys.path:  # our storch, also when it is not pip-installed
    sys.path.insert(1, _REPO)

import torch  # noqa: E402
from torch.distributions import Bernoulli, OneHotCategorical  # noqa: E402

import storch  # noqa: E402
from storch.tensor import layout_of  # noqa: E402
from storch.testing import replicated_gradients  # noqa: E402

from estimator_registry import ESTIMATORS, Entry, ProblemShape, load  # noqa: E402

PLATE = "z"


# ======================================================================== problems


class Problem:
    """A gradient-estimation problem: parameters, a model that samples with a method, the exact gradient."""

    name: str
    title: str
    shape: ProblemShape
    param: torch.Tensor  # the parameter whose gradient is estimated
    scale: float = 1.0  # estimates are multiplied by this (per-datum gradients)
    rows_per_eval: int = 1  # cost evaluations per plate position (data points), to size chunks
    rounding: float = 1e-6  # float32 rounding of a gradient coordinate: differences below it are not bias

    def model(self, method: Any, param_view: torch.Tensor, joint: bool = False) -> storch.StochasticTensor:
        """Sample with ``method`` and register the costs; ``joint``: sample the node as one
        categorical over its joint support (the same distribution)."""
        raise NotImplementedError

    def exact(self) -> torch.Tensor:
        raise NotImplementedError


class BernoulliToy(Problem):
    """``f(x) = Σ_i (x_i − p_i)²``, ``x_i ~ Bernoulli(σ(θ_i))``, ``θ = 0``."""

    name = "bernoulli"
    P = torch.tensor([0.49, 0.499, 0.501, 0.51])

    def __init__(self) -> None:
        d = self.P.numel()
        self.shape = ProblemShape("bernoulli", d, 2, 2**d, (d,))
        self.param = torch.zeros(d)
        self.configs = torch.tensor(list(itertools.product((0.0, 1.0), repeat=d)))  # (2^d, d)
        ps = ", ".join(f"{v:g}" for v in self.P.tolist())
        self.title = (f"(a) Bernoulli toy: f(x) = sum_i (x_i - p_i)^2, p = ({ps}), logits 0; "
                      f"exact gradient by enumerating the {2**d} configurations")

    def model(self, method: Any, theta: torch.Tensor, joint: bool = False) -> storch.StochasticTensor:
        if joint:  # p(c) ∝ exp(Σ_i c_i θ_i) = Π_i Bernoulli(c_i; σ(θ_i))
            node = method(OneHotCategorical(logits=theta @ self.configs.T))
            x = node @ self.configs
        else:
            node = x = method(Bernoulli(logits=theta))
        storch.add_cost(((x - self.P) ** 2).sum(-1), "f")
        return node

    def exact(self) -> torch.Tensor:
        theta = self.param.double().clone().requires_grad_()
        probs = torch.sigmoid(theta)
        p = self.P.double()
        expectation = theta.new_zeros(())
        for bits in itertools.product((0.0, 1.0), repeat=p.numel()):
            x = torch.tensor(bits, dtype=torch.float64)
            px = (probs**x * (1 - probs) ** (1 - x)).prod()
            expectation = expectation + px * ((x - p) ** 2).sum()
        (grad,) = torch.autograd.grad(expectation, theta)
        return grad


class VAEMinibatch(Problem):
    """One minibatch of the demo's discrete VAE (binarized digits), gradient w.r.t. the encoder logits."""

    name = "vae"

    def __init__(self, batch: int = 16, epochs: int = 5, seed: int = 0, train_images: Optional[int] = None,
                 hidden: tuple[int, int] = (256, 128), latents: int = 2, categories: int = 10,
                 out: Optional[TextIO] = None) -> None:
        from storch.datasets import load_digits_binarized, minibatches
        from storch.demo.vae import DiscreteVAE, generative_story

        data, _ = load_digits_binarized()
        if train_images is not None:
            data = data[:train_images]
        torch.manual_seed(seed)
        self.vae = DiscreteVAE(data.shape[1], hidden, latents, categories)
        optimizer = torch.optim.Adam(self.vae.parameters(), lr=3e-3)
        shuffle = torch.Generator().manual_seed(seed + 1)
        t0 = time.perf_counter()
        steps = 0
        for _ in range(epochs):
            for x in minibatches(data, 32, generator=shuffle):
                optimizer.zero_grad()
                generative_story(storch.method.Expect("z"), self.vae, x)
                storch.backward()
                optimizer.step()
                steps += 1
        self.train_seconds = time.perf_counter() - t0
        self.vae.requires_grad_(False)
        idx = torch.randperm(data.shape[0], generator=torch.Generator().manual_seed(seed))[:batch]
        self.data = data[idx]
        with torch.no_grad():
            self.param = self.vae.encode(self.data).reshape(batch, latents, categories).clone()
        self.latents, self.categories, self.batch = latents, categories, batch
        # the K^L joint configurations as rows of L one-hot vectors, flattened: (K^L, L*K)
        eye = torch.eye(categories)
        self.configs = torch.stack([torch.cat([eye[k] for k in ks])
                                    for ks in itertools.product(range(categories), repeat=latents)])
        self.scale = float(batch)  # the cost is the mean over the minibatch: report per-datum gradients
        self.rows_per_eval = batch
        self.rounding = 1e-5  # costs of ~25 nats per datum in float32
        self.shape = ProblemShape("vae", latents, categories, categories**latents, (latents, categories))
        self.title = (f"(b) categorical VAE, one minibatch: {data.shape[1]}-{hidden[0]}-{hidden[1]}-"
                      f"({latents}x{categories} one-hot)-{hidden[1]}-{hidden[0]}-{data.shape[1]} on "
                      f"{data.shape[0]} binarized digits, trained {epochs} epoch(s) ({steps} steps, "
                      f"{self.train_seconds:.1f} s) with Expect, seed {seed}; gradient of the per-datum "
                      f"negative ELBO w.r.t. the encoder logits of {batch} images ({batch * latents * categories} "
                      f"coordinates); reference: exact (Expect over {categories**latents} configurations)")

    def model(self, method: Any, logits: torch.Tensor, joint: bool = False) -> storch.StochasticTensor:
        L, K = self.latents, self.categories
        logits = storch.denote_independent(logits, len(layout_of(logits).plates), "data")
        x = storch.denote_independent(self.data, 0, "data")
        q = OneHotCategorical(logits=logits)
        if joint:  # one categorical over the K^L configurations: logits Σ_l logits_l(k_l)
            node = method(OneHotCategorical(logits=logits.reshape(logits.shape[:-2] + (L * K,)) @ self.configs.T))
            z = (node @ self.configs).reshape(node.shape[:-1] + (L, K))
        else:
            node = z = method(q)
        prior = OneHotCategorical(probs=torch.full((L, K), 1.0 / K))
        storch.add_cost(torch.distributions.kl_divergence(q, prior).sum(-1), "kl-div")
        reconstruction = self.vae.decode(z.reshape(z.shape[:-2] + (L * K,)))
        storch.add_cost(storch.nn.b_binary_cross_entropy(reconstruction, x), "reconstruction")
        return node

    def exact(self) -> torch.Tensor:
        leaf = self.param.clone().requires_grad_()
        try:
            self.model(storch.method.Expect(PLATE), leaf)
            storch.backward()
        finally:
            storch.reset()
        return leaf.grad.double() * self.scale


class IWAEToy(Problem):
    """A multi-sample (IWAE) bound on four Bernoulli latents, VIMCO's objective.

    ``q_θ(x) = Π_i Bernoulli(x_i; σ(θ_i))``, ``θ = 0``; prior ``Bernoulli(½)⁴``; likelihood
    ``y = 1.5 ~ N(w·x, 1)``, ``w = (1, 0.5, −0.5, 1)``; ``log w(x) = log p(x) + log p(y|x) − log q_θ(x)``
    and the cost ``−L = −log (1/K) Σ_k w(x_k)`` over the node's ``K`` samples (``iwae_bound``). The
    exact gradient of ``E[−L]`` comes from enumerating the ``16^K`` tuples. The budget is ``K``.
    """

    name = "iwae"
    W = torch.tensor([1.0, 0.5, -0.5, 1.0])
    Y = 1.5

    def __init__(self) -> None:
        d = self.W.numel()
        self.shape = ProblemShape("iwae", d, 2, 2**d, (d,))
        self.param = torch.zeros(d)
        self.configs = torch.tensor(list(itertools.product((0.0, 1.0), repeat=d)))
        self.title = ("(c) multi-sample bound (VIMCO's objective) on 4 Bernoulli latents: q = Bernoulli(sigmoid(theta)), "
                      "theta = 0, prior Bernoulli(1/2), y = 1.5 ~ N(w.x, 1), w = (1, 0.5, -0.5, 1); cost "
                      "-log mean_k w(x_k) over the K samples (budget K); exact gradient by enumerating the 16^K tuples")

    def _log_w(self, x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        prior = Bernoulli(probs=torch.full_like(self.W, 0.5))
        likelihood = torch.distributions.Normal((x * self.W).sum(-1), 1.0).log_prob(torch.tensor(self.Y))
        return prior.log_prob(x).sum(-1) + likelihood - Bernoulli(logits=theta).log_prob(x).sum(-1)

    def model(self, method: Any, theta: torch.Tensor, joint: bool = False) -> storch.StochasticTensor:
        from storch.method.vimco import iwae_bound

        x = method(Bernoulli(logits=theta))
        iwae_bound(self._log_w(x, theta), x)
        return x

    def exact_for(self, k: int) -> torch.Tensor:
        theta = self.param.double().clone().requires_grad_()
        c = self.configs.double()
        log_q = Bernoulli(logits=theta).log_prob(c).sum(-1)  # (16,)
        prior = Bernoulli(probs=torch.full((c.shape[1],), 0.5, dtype=torch.float64))
        lik = torch.distributions.Normal((c * self.W.double()).sum(-1), 1.0).log_prob(torch.tensor(self.Y, dtype=torch.float64))
        log_w = prior.log_prob(c).sum(-1) + lik - log_q  # (16,)
        idx = torch.cartesian_prod(*[torch.arange(c.shape[0])] * k) if k > 1 else torch.arange(c.shape[0])[:, None]
        bound = torch.logsumexp(log_w[idx], -1) - math.log(k)
        expectation = (log_q[idx].sum(-1).exp() * -bound).sum()
        (grad,) = torch.autograd.grad(expectation, theta)
        return grad

    def exact(self) -> torch.Tensor:
        raise ValueError("IWAEToy: the exact gradient depends on K; use exact_for(K)")


# ======================================================================== measurement


@dataclass
class Row:
    problem: str
    budget: int
    label: str
    source: str
    n: Optional[int] = None
    evals: Optional[int] = None
    repeats: int = 0
    bias2: float = float("nan")
    bias2_raw: float = float("nan")
    max_z: float = float("nan")
    variance: float = float("nan")
    ms_per_estimate: float = float("nan")
    mode: str = ""
    status: str = "ok"  # ok | n/a | error
    deterministic: bool = False  # every estimate is the same (no variance)
    enumerates: bool = False  # the entry enumerates the support (n does not apply)
    notes: list[str] = field(default_factory=list)

    @property
    def mse(self) -> float:
        return self.bias2 + self.variance


def _plate_size(problem: Problem, entry: Entry, cls: Any, n: int) -> int:
    """The number of cost evaluations of ``entry`` with ``n`` samples (its plate size), by building the graph."""
    try:
        # a parameter that requires grad: methods such as SPSA and MVD only perturb those
        leaf = problem.param.clone().requires_grad_()
        z = problem.model(entry.make(cls, PLATE, n, problem.shape), leaf, entry.joint)
        return int(z.n)
    finally:
        storch.reset()


def choose_n(problem: Problem, entry: Entry, cls: Any, budget: int) -> tuple[Optional[int], int]:
    """The largest ``n ≥ min_samples`` whose plate fits ``budget`` (``None`` if none does), and its plate size."""
    if entry.exact:
        return 1, _plate_size(problem, entry, cls, 1)
    per = max(1, entry.evals(problem.shape))
    most = entry.most_samples(problem.shape)
    n = max(entry.min_samples, budget // per)
    if most is not None:
        n = min(n, most)
    size = _plate_size(problem, entry, cls, n)
    while size > budget and n > entry.min_samples:
        n -= 1
        size = _plate_size(problem, entry, cls, n)
    if size > budget:
        return None, size
    for _ in range(64):  # the rule may over-estimate the group size
        if most is not None and n + 1 > most:
            break
        bigger = _plate_size(problem, entry, cls, n + 1)
        if bigger > budget:
            break
        n, size = n + 1, bigger
    return n, size


def _single_estimate(problem: Problem, method: Any, joint: bool) -> tuple[torch.Tensor, int]:
    leaf = problem.param.clone().requires_grad_()
    try:
        z = problem.model(method, leaf, joint)
        size = int(z.n)
        storch.backward()
    finally:
        storch.reset()
    return leaf.grad.detach().double() * problem.scale, size


def estimates(problem: Problem, entry: Entry, method: Any, repeats: int, max_rows: int,
              size: int) -> tuple[torch.Tensor, str, list[str]]:
    """``repeats`` independent estimates ``(R, *param.shape)``: replicated in chunks, else one by one."""
    notes: list[str] = []
    units = entry.memory_per_sample(size) if entry.memory_per_sample is not None else size
    chunk = max(2, min(repeats, max_rows // max(1, units * problem.rows_per_eval)))

    def model(view: torch.Tensor) -> None:
        problem.model(method, view, entry.joint)

    parts: list[torch.Tensor] = []
    left, passes = repeats, 0
    try:
        while left > 0:
            r = max(2, min(chunk, left))  # replicated_gradients needs a plate: a last chunk of one becomes two
            try:
                (g,) = replicated_gradients([problem.param], r, model)
            except RuntimeError as e:
                if "memory" not in str(e) or chunk <= 2:
                    raise
                chunk //= 2  # out of memory: smaller chunks of replicates
                continue
            finally:
                storch.reset()
            parts.append(g.detach().double() * problem.scale)
            left -= r
            passes += 1
        grads = torch.cat(parts)[:repeats]
        mode = "replicated" if passes == 1 else f"replicated, {passes} passes of <= {chunk}"
        return grads, mode, notes
    except Exception as e:  # noqa: BLE001 -- fall back to separate backward passes and say so
        notes.append(f"replicated_gradients failed ({type(e).__name__}: {_short(e)}); {repeats} separate passes")
    grads = torch.stack([_single_estimate(problem, method, entry.joint)[0] for _ in range(repeats)])
    return grads, "loop", notes


def _short(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def measure(problem: Problem, entry: Entry, cls: Any, budget: int, repeats: int, timing_reps: int,
            exact: torch.Tensor, max_rows: int, seed: int, max_warmup: Optional[int] = None) -> Row:
    row = Row(problem.name, budget, entry.label, entry.source, enumerates=entry.exact)
    torch.manual_seed(seed)
    try:
        n, size = choose_n(problem, entry, cls, budget)
    except Exception as e:  # noqa: BLE001
        row.status = "error"
        row.notes.append(f"{type(e).__name__}: {_short(e)}")
        return row
    if n is None:
        row.status = "n/a"
        row.evals = size
        row.notes.append(f"needs {size} evaluations with the fewest samples ({entry.min_samples}) > budget {budget}")
        return row
    row.n, row.evals = n, size
    if entry.exact and size > budget:
        row.notes.append(f"enumeration: {size} evaluations, over the budget of {budget}")
    try:
        method = entry.make(cls, PLATE, n, problem.shape)
        warmup = entry.warmup if max_warmup is None else min(entry.warmup, max_warmup)
        if warmup < entry.warmup:
            row.notes.append(f"warm-up cut to {warmup} backward passes (--quick)")
        for _ in range(warmup):  # stateful baselines / learned control variates
            _single_estimate(problem, method, entry.joint)
        r = min(repeats, 8) if entry.exact else repeats
        grads, row.mode, notes = estimates(problem, entry, method, r, max_rows, size)
        row.notes += notes
        times = []
        for _ in range(timing_reps):
            t0 = time.perf_counter()
            _, single_size = _single_estimate(problem, method, entry.joint)
            times.append(time.perf_counter() - t0)
        row.ms_per_estimate = 1000.0 * statistics.median(times)
        if single_size != size:
            row.notes.append(f"plate size varies: {size} vs {single_size}")
    except Exception as e:  # noqa: BLE001
        row.status = "error"
        row.notes.append(f"{type(e).__name__}: {_short(e)}")
        return row
    g = grads.reshape(grads.shape[0], -1)
    ex = exact.reshape(-1).double()
    r = g.shape[0]
    mean = g.mean(0)
    var = g.var(0)
    d2 = (mean - ex) ** 2
    row.repeats = r
    row.bias2_raw = float(d2.mean())
    row.bias2 = float((d2 - var / r).mean())
    se = (var / r).sqrt()
    diff = ((mean - ex).abs() - problem.rounding).clamp_min(0.0)  # float32 rounding is not bias
    if bool((se == 0).all()):  # deterministic (enumeration): exact up to float rounding, or not
        row.deterministic = True
        row.max_z = 0.0 if float(diff.max()) == 0.0 else math.inf
    else:
        row.max_z = float((diff / se.clamp_min(1e-300)).max())
    row.variance = float(var.mean())
    return row


# ======================================================================== tables


def _fmt(x: float, spec: str = ".3e") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


HEAD = (f"{'estimator':<46} {'n':>4} {'evals':>5} {'bias²':>10} {'max|z|':>7} {'variance':>10} "
        f"{'MSE':>10} {'ms/est':>8} {'R':>6}")


def format_table(rows: list[Row]) -> str:
    lines = [HEAD, "-" * len(HEAD)]
    notes: list[str] = []
    for row in rows:
        if row.status != "ok":
            text = f"{row.label:<46} {_fmt(row.n, 'd') if row.n else '-':>4} {row.evals or '-':>5} {row.status}"
            lines.append(text)
        else:
            zs = ("exact" if row.max_z == 0 else "inf") if row.deterministic else _fmt(row.max_z, ".1f")
            n = "all" if row.enumerates else str(row.n)
            lines.append(f"{row.label:<46} {n:>4} {row.evals:>5d} {_fmt(row.bias2, '10.3e')} {zs:>7} "
                         f"{_fmt(row.variance, '10.3e')} {_fmt(row.mse, '10.3e')} "
                         f"{_fmt(row.ms_per_estimate, '8.2f')} {row.repeats:>6d}")
        extra = list(row.notes)
        if row.mode == "loop":
            extra.append(f"estimates: {row.mode}")
        for note in extra:
            notes.append(f"  [{row.label}] {note}")
    if notes:
        lines.append("notes:")
        lines += notes
    return "\n".join(lines)


# ======================================================================== driver


def available_estimators() -> tuple[list[tuple[Entry, Any]], list[tuple[Entry, str]]]:
    present, missing = [], []
    for entry in ESTIMATORS:
        cls, reason = load(entry)
        if cls is None:
            missing.append((entry, reason or "not importable"))
        else:
            present.append((entry, cls))
    return present, missing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/estimator_variance.py",
        description="Gradient variance and bias of every storch estimator at an equal budget of cost "
        "evaluations, on a Bernoulli toy (exact gradient by enumeration) and one minibatch of a small "
        "categorical VAE on binarized digits (exact gradient by Expect).",
    )
    p.add_argument("--budget", type=int, nargs="+", default=None, metavar="B",
                   help="cost evaluations per estimate on the Bernoulli toy (default: 6 12; --quick: 6)")
    p.add_argument("--vae-budget", type=int, nargs="+", default=None, metavar="B",
                   help="cost evaluations per datum per estimate on the VAE (default: 21 42; --quick: 21)")
    p.add_argument("--repeats", "-R", type=int, default=None,
                   help="independent estimates per row on the toy (default: 10000; --quick: 400)")
    p.add_argument("--vae-repeats", type=int, default=None,
                   help="independent estimates per row on the VAE (default: 200; --quick: 20)")
    p.add_argument("--vae-batch", type=int, default=None, help="images in the VAE minibatch (default: 16; --quick: 4)")
    p.add_argument("--vae-epochs", type=int, default=None,
                   help="epochs of exact (Expect) training of the VAE before measuring (default: 5; --quick: 1 "
                   "epoch on 256 images)")
    p.add_argument("--timing-reps", type=int, default=None,
                   help="single estimates timed per row, median reported (default: 10; --quick: 3)")
    p.add_argument("--problems", default="bernoulli,vae,iwae",
                   help="comma-separated: bernoulli, vae, iwae (default: all three)")
    p.add_argument("--iwae-k", type=int, nargs="+", default=None, metavar="K",
                   help="samples in the multi-sample bound of problem (c), its budget (default: 2 4; --quick: 2)")
    p.add_argument("--estimators", default=None,
                   help="comma-separated substrings: only rows whose label contains one of them")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--max-rows", type=int, default=200_000,
                   help="cost evaluations (data x plate x replicates) per replicated backward pass; more "
                   "replicates are split into chunks, and chunks are halved when memory runs out (default: 200000)")
    p.add_argument("--out", default=os.path.join(_HERE, "results"),
                   help="folder for estimator_variance[_quick].txt/.json (default: benchmarks/results)")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 when an estimator of the registry is not importable")
    return p


class _Tee:
    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> None:
        for s in self.streams:
            s.write(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    q = args.quick
    # multiples of the common group sizes 2 (ARM), 3 (REBAR, SPSA) and, on the VAE, 21 (LocalExpectation);
    # below the support sizes (16, 100), where sampling without replacement would be enumeration
    budgets = args.budget or ([6] if q else [6, 12])
    vae_budgets = args.vae_budget or ([21] if q else [21, 42])
    repeats = args.repeats or (400 if q else 10000)
    vae_repeats = args.vae_repeats or (20 if q else 200)
    timing_reps = args.timing_reps or (3 if q else 10)
    problems = [s.strip() for s in args.problems.split(",") if s.strip()]
    unknown = [s for s in problems if s not in ("bernoulli", "vae", "iwae")]
    if unknown:
        print(f"error: unknown problem(s) {unknown}; choose bernoulli, vae, iwae", file=sys.stderr)
        return 2
    if min(budgets + vae_budgets) < 1 or repeats < 2 or vae_repeats < 2:
        print("error: budgets must be >= 1 and repeats >= 2", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    os.makedirs(args.out, exist_ok=True)
    stem = "estimator_variance_quick" if q else "estimator_variance"
    txt_path = os.path.join(args.out, stem + ".txt")
    with open(txt_path, "w", encoding="utf-8") as txt:
        out = _Tee(sys.stdout, txt)
        return _run(args, out, budgets, vae_budgets, repeats, vae_repeats, timing_reps, problems,
                    os.path.join(args.out, stem + ".json"), txt_path)


def _run(args: argparse.Namespace, out: Any, budgets: list[int], vae_budgets: list[int], repeats: int,
         vae_repeats: int, timing_reps: int, problems: list[str], json_path: str, txt_path: str) -> int:
    start = time.perf_counter()
    present, missing = available_estimators()
    if args.estimators:
        keys = [k.strip().lower() for k in args.estimators.split(",") if k.strip()]
        present = [(e, c) for e, c in present if any(k in e.label.lower() for k in keys)]
        missing = [(e, r) for e, r in missing if any(k in e.label.lower() for k in keys)]
    print(f"Gradient variance and bias at equal budgets of cost evaluations -- "
          f"{datetime.datetime.now().isoformat(timespec='seconds')}", file=out)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{torch.get_num_threads()} thread(s), seed {args.seed}{', QUICK' if args.quick else ''}", file=out)
    print("bias² = mean over coordinates of (mean - exact)² - var/R (unbiased estimate of the squared bias, ≈0 "
          "either sign when unbiased); max|z| = max over coordinates of |mean - exact| / (sd/√R); variance = "
          "mean over coordinates of the variance of one estimate; ms/est = median time of one unreplicated "
          "estimate", file=out)
    legend = [(e.label, e.note) for e, _ in present if e.note]
    if legend:
        print("estimators:", file=out)
        for label, note in legend:
            print(f"  {label}: {note}", file=out)
    all_rows: list[Row] = []
    status = 0
    for name in problems:
        t0 = time.perf_counter()
        if name == "bernoulli":
            problem: Problem = BernoulliToy()
            plist, R = budgets, repeats
        elif name == "iwae":
            problem = IWAEToy()
            plist, R = args.iwae_k or ([2] if args.quick else [2, 4]), repeats
        else:
            if args.quick:
                problem = VAEMinibatch(batch=args.vae_batch or 4, epochs=args.vae_epochs or 1, seed=args.seed,
                                       train_images=256)
            else:
                problem = VAEMinibatch(batch=args.vae_batch or 16, epochs=args.vae_epochs or 5, seed=args.seed)
            plist, R = vae_budgets, vae_repeats
        print(f"\n{problem.title}", file=out)
        if name != "iwae":
            exact = problem.exact()
            print(f"exact gradient: {_describe(exact)}", file=out)
        skipped = [e.label for e, _ in present if name not in e.problems]
        for budget in plist:
            if name == "iwae":
                exact = problem.exact_for(budget)
                print(f"\nK = {budget}: exact gradient {_describe(exact)}", file=out)
            rows = []
            for entry, cls in present:
                if name == "iwae" and name not in entry.problems:
                    continue  # listed once below the tables
                if name not in entry.problems:
                    rows.append(Row(problem.name, budget, entry.label, entry.source, status="n/a",
                                    notes=[entry.scope or f"applies to {', '.join(entry.problems)} only"]))
                    continue
                try:
                    rows.append(measure(problem, entry, cls, budget, R, timing_reps, exact, args.max_rows, args.seed,
                                        max_warmup=5 if args.quick else None))
                except Exception:  # noqa: BLE001 -- a broken estimator must not hide the others
                    row = Row(problem.name, budget, entry.label, entry.source, status="error")
                    row.notes.append(traceback.format_exc().strip().splitlines()[-1])
                    rows.append(row)
            print(f"\n[{problem.name}] budget {budget} cost evaluations{' per datum' if name == 'vae' else ''}, "
                  f"R = {R}", file=out)
            print(format_table(rows), file=out)
            out.flush()
            all_rows += rows
        if name == "iwae" and skipped:
            print("not run on (c), VIMCO's objective: " + ", ".join(skipped) + ". iwae_bound is for a "
                  "joint-sample estimator (VIMCO) or a reparameterized node, and rejects per-sample score "
                  "functions (they would credit each sample with 1/K of the bound).", file=out)
        print(f"({problem.name}: {time.perf_counter() - t0:.1f} s)", file=out)

    if missing:
        print("\nNot measured -- estimators not importable yet (module or class missing):", file=out)
        for entry, reason in missing:
            print(f"  {entry.label:<46} {entry.source}: {reason}", file=out)
        if args.strict:
            status = 1
    else:
        print("\nAll estimators of the registry are importable.", file=out)
    errors = [r for r in all_rows if r.status == "error"]
    if errors:
        print(f"{len(errors)} row(s) failed (see 'error' rows and notes above).", file=out)
    total = time.perf_counter() - start
    print(f"\nTotal time {total:.1f} s; tables written to {os.path.relpath(txt_path)}", file=out)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "seed": args.seed,
            "quick": args.quick, "seconds": total,
            "rows": [dict(asdict(r), mse=r.mse) for r in all_rows],
            "missing": [{"label": e.label, "source": e.source, "reason": reason} for e, reason in missing],
        }, f, indent=1, default=float)
    return status


def _describe(exact: torch.Tensor) -> str:
    flat = exact.reshape(-1)
    if flat.numel() <= 8:
        return "(" + ", ".join(f"{v:.6g}" for v in flat.tolist()) + ")"
    return (f"{tuple(exact.shape)}, mean square {float((flat**2).mean()):.4g}, "
            f"max |g| {float(flat.abs().max()):.4g}")


if __name__ == "__main__":
    sys.exit(main())
