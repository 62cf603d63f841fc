"""The manual's introduction example: the variance of five gradient estimators, against exact values.

The problem (Storchastic manual §1.2): ``a = 5``, ``b = −3``, ``c = 0.23``, ``d = a + b``,
``e ~ N(b + c, 1)``, ``f = d e²``. We estimate ``∂E[f]/∂c`` with several estimators, repeat the
estimate ``R`` times, and compare the sample mean and variance of the ``R`` gradient estimates with
the exact ones.

Exact values, with ``μ = b + c = −2.77``, ``ε = e − μ ~ N(0, 1)``:

* true gradient: ``E[f] = d (1 + μ²)``, so ``∂E[f]/∂c = 2 d μ = −11.08``;
* pathwise (reparameterization), one sample: ``g = 2 d e``, ``Var g = 4 d² = 16``; ``n`` samples: ``16/n``;
* score function, one sample: ``g = d e² ε``,
  ``Var g = d² E[e⁴ ε²] − (2dμ)² = d² (μ⁴ + 14 μ² + 15) = 725.18``; ``n`` samples: ``725.18/n``;
* score function with the leave-one-out (``batch_average``) baseline and ``n`` samples:
  ``g = (1/n) Σ_j ε_j (f_j − f̄_{−j})``. With ``X = f``, ``Y = ε`` and ``h_j = Y_j (X_j − f̄_{−j})``,
  ``E[h_j²] = E[X²Y²] − 2 E[XY²] E[X] + E[X]² + Var(X)/(n−1)``, and for ``j ≠ k`` only the pairs
  ``Y_j X_j`` and ``Y_k X_k`` survive: ``E[h_j h_k] = E[XY]² (1 + 1/(n−1)²)``. Hence
  ``Var g = E[h²]/n + ((n−1)/n) E[XY]² (1 + 1/(n−1)²) − E[XY]²`` (= 14.94 for n = 20).

The moments ``E[X^p Y^q]`` are computed by Gauss–Hermite quadrature, which is exact for these
polynomial integrands; `closed_form_variance` gives the closed forms above as a cross-check.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import torch
from torch.distributions import Normal

import storch
from storch.method import Infer, Method, Reparameterization, ScoreFunction

__all__ = [
    "ROWS",
    "TRUE_GRADIENT",
    "A",
    "B",
    "C",
    "Row",
    "RowResult",
    "closed_form_variance",
    "compute_f",
    "estimate_gradients",
    "exact_variance",
    "run_intro",
    "run_row",
]

A, B, C = 5.0, -3.0, 0.23
MU = B + C  # mean of e
D = A + B  # the factor d = a + b
TRUE_GRADIENT = 2.0 * D * MU  # ∂E[f]/∂c = −11.08


def compute_f(method: Method):
    """The manual's generative story: ``d = a + b``, ``e ~ N(b + c, 1)`` sampled by ``method``, ``f = d e²``.

    Returns ``(f, c)``, with ``c`` the leaf whose ``.grad`` holds the gradient estimate.

    Examples:
        >>> import storch
        >>> f, c = compute_f(storch.method.Reparameterization("e", n_samples=3))
        >>> f.plates[0].name, tuple(f.shape)
        ('e', (3,))
        >>> storch.reset()
    """
    a = torch.tensor(A, requires_grad=True)
    b = torch.tensor(B, requires_grad=True)
    c = torch.tensor(C, requires_grad=True)
    d = a + b

    # Sample e from a normal distribution with the given method
    normal_distribution = Normal(b + c, 1)
    e = method(normal_distribution)

    f = d * e * e
    return f, c


def estimate_gradients(
    method: Method, repetitions: int, progress: Callable[[], None] | None = None
) -> storch.IndependentTensor:
    """``repetitions`` independent estimates of ``∂E[f]/∂c``, gathered into the plate ``"gradients"``.

    Examples:
        >>> import torch, storch
        >>> _ = torch.manual_seed(0)
        >>> g = estimate_gradients(storch.method.Reparameterization("e"), 100)
        >>> g.plates[0].name, g.plates[0].size
        ('gradients', 100)
        >>> abs(storch.reduce_plates(g, "gradients").item() - TRUE_GRADIENT) < 2.0
        True
    """
    gradient_samples = []
    for _ in range(repetitions):
        f, c = compute_f(method)
        storch.add_cost(f, "f")
        storch.backward()
        gradient_samples.append(c.grad)
        if progress is not None:
            progress()
    return storch.gather_samples(gradient_samples, "gradients")


# ------------------------------------------------------------------ exact variances


def _moment(p: int, q: int, quad_points: int = 40) -> float:
    """``E[f^p ε^q]`` with ``f = d (μ + ε)²``, ``ε ~ N(0, 1)``, by Gauss–Hermite quadrature."""
    x, w = np.polynomial.hermite_e.hermegauss(quad_points)  # weight exp(−x²/2)
    w = w / math.sqrt(2.0 * math.pi)
    f = D * (MU + x) ** 2
    return float(np.sum(w * f**p * x**q))


def exact_variance(estimator: str, n: int) -> float:
    """The exact variance of one gradient estimate of ``∂E[f]/∂c`` (by quadrature).

    Args:
        estimator: ``"reparameterization"``, ``"score"`` (no baseline) or ``"score_loo"``
            (``batch_average`` baseline, needs ``n >= 2``).
        n: the number of samples of ``e`` per estimate.

    Examples:
        >>> [round(exact_variance(k, n), 2) for k, n in
        ...  [("reparameterization", 1), ("reparameterization", 10), ("score", 1), ("score", 45), ("score_loo", 20)]]
        [16.0, 1.6, 725.18, 16.12, 14.94]
    """
    if estimator == "reparameterization":
        # g = ∂f/∂c through e = μ + ε: 2 d e
        x, w = np.polynomial.hermite_e.hermegauss(40)
        w = w / math.sqrt(2.0 * math.pi)
        g = 2.0 * D * (MU + x)
        return float(np.sum(w * g**2) - np.sum(w * g) ** 2) / n
    m1 = _moment(1, 1)  # E[f ε] = E[g] for the score function
    if estimator == "score":
        return (_moment(2, 2) - m1**2) / n
    if estimator == "score_loo":
        if n < 2:
            raise ValueError("the leave-one-out baseline needs n >= 2")
        mx, mxx, mxyy, m2 = _moment(1, 0), _moment(2, 0), _moment(1, 2), _moment(2, 2)
        e_h2 = m2 - 2.0 * mxyy * mx + mx**2 + (mxx - mx**2) / (n - 1)
        e_hh = m1**2 * (1.0 + 1.0 / (n - 1) ** 2)
        return e_h2 / n + (n - 1) / n * e_hh - m1**2
    raise ValueError(f"unknown estimator {estimator!r}")


def closed_form_variance(estimator: str, n: int) -> float:
    """The same variances from the closed forms in the module docstring (a cross-check).

    Examples:
        >>> abs(closed_form_variance("score_loo", 20) - exact_variance("score_loo", 20)) < 1e-9
        True
    """
    mu2 = MU * MU
    if estimator == "reparameterization":
        return 4.0 * D * D / n
    if estimator == "score":
        return D * D * (mu2 * mu2 + 14.0 * mu2 + 15.0) / n
    if estimator == "score_loo":
        m1 = 2.0 * D * MU  # E[f ε]
        m2 = D * D * (mu2 * mu2 + 18.0 * mu2 + 15.0)  # E[f² ε²]
        mx = D * (mu2 + 1.0)  # E[f]
        mxx = D * D * (mu2 * mu2 + 6.0 * mu2 + 3.0)  # E[f²]
        mxyy = D * (mu2 + 3.0)  # E[f ε²]
        e_h2 = m2 - 2.0 * mxyy * mx + mx**2 + (mxx - mx**2) / (n - 1)
        return e_h2 / n + (n - 1) / n * m1**2 * (1.0 + 1.0 / (n - 1) ** 2) - m1**2
    raise ValueError(f"unknown estimator {estimator!r}")


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Row:
    """One estimator of the table: a label, how to build the method, and its exact variance."""

    label: str
    n: int
    make: Callable[[int], Method]
    exact: str  # the estimator kind for exact_variance
    manual_variance: float | None  # the value printed in the manual (one run of R = 1000)


ROWS: Sequence[Row] = (
    Row("Reparameterization", 1, lambda n: Reparameterization("e", n_samples=n), "reparameterization", 16.7321),
    Row("Reparameterization", 10, lambda n: Reparameterization("e", n_samples=n), "reparameterization", 1.6388),
    Row("ScoreFunction, no baseline", 1,
        lambda n: ScoreFunction("e", n_samples=n, baseline_factory=None), "score", 748.1914),
    Row("ScoreFunction, no baseline", 45,
        lambda n: ScoreFunction("e", n_samples=n, baseline_factory=None), "score", 17.0591),
    Row("ScoreFunction, batch_average", 20,
        lambda n: ScoreFunction("e", n_samples=n, baseline_factory="batch_average"), "score_loo", 16.8761),
    Row("Infer (reparameterizes)", 1, lambda n: Infer("e", n_samples=n), "reparameterization", None),
)


@dataclass
class RowResult:
    """Statistics of ``R`` gradient estimates for one row."""

    row: Row
    repetitions: int
    mean: float
    variance: float
    true_mean: float
    true_variance: float
    z_mean: float  # (mean − true mean) / standard error of the mean
    z_variance: float  # (variance − true variance) / standard error of the sample variance
    threshold: float

    @property
    def within_error(self) -> bool:
        return abs(self.z_mean) <= self.threshold and abs(self.z_variance) <= self.threshold


def run_row(row: Row, repetitions: int, threshold: float = 3.0,
            progress: Callable[[], None] | None = None) -> RowResult:
    """Estimate the gradient ``repetitions`` times with ``row``'s method and compare with exact values.

    The standard error of the mean uses the exact variance; that of the sample variance uses the
    sample fourth central moment, ``sqrt((m₄ − s⁴)/R)``.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> r = run_row(ROWS[0], 400)
        >>> r.true_variance, r.within_error
        (16.0, True)
    """
    method = row.make(row.n)
    gradients = estimate_gradients(method, repetitions, progress)
    mean = storch.reduce_plates(gradients, "gradients").item()
    variance = storch.variance(gradients, "gradients").item()
    true_variance = round(exact_variance(row.exact, row.n), 10)
    samples = gradients.plain().double()
    m4 = float(((samples - samples.mean()) ** 4).mean())
    se_var = math.sqrt(max(m4 - variance**2, 1e-300) / repetitions)
    z_mean = (mean - TRUE_GRADIENT) / math.sqrt(true_variance / repetitions)
    z_var = (variance - true_variance) / se_var
    return RowResult(row, repetitions, mean, variance, TRUE_GRADIENT, true_variance, z_mean, z_var, threshold)


def format_table(results: Sequence[RowResult]) -> str:
    """The table of `run_intro` as text."""
    head = (f"{'estimator':<30} {'n':>3} {'mean':>9} {'true mean':>9} {'z':>6}  "
            f"{'variance':>9} {'true var':>9} {'z':>6} {'manual var':>10}  within error")
    lines = [head, "-" * len(head)]
    for r in results:
        manual = f"{r.row.manual_variance:10.2f}" if r.row.manual_variance is not None else f"{'-':>10}"
        lines.append(
            f"{r.row.label:<30} {r.row.n:>3} {r.mean:9.3f} {r.true_mean:9.3f} {r.z_mean:6.2f}  "
            f"{r.variance:9.3f} {r.true_variance:9.3f} {r.z_variance:6.2f} {manual}  "
            f"{'yes' if r.within_error else 'NO'}"
        )
    return "\n".join(lines)


def run_intro(
    repetitions: int = 1000,
    seed: int = 0,
    rows: Sequence[Row] = ROWS,
    out: TextIO | None = None,
    progress_bar: bool = True,
    threshold: float = 3.0,
) -> list[RowResult]:
    """Print the estimator table of the manual's introduction example and return its rows.

    Args:
        repetitions: ``R``, the number of gradient estimates per row.
        seed: the torch seed, set once before the first row.
        rows: the estimators to run.
        out: where the table goes (default ``sys.stdout``); the progress bar goes to ``sys.stderr``.
        progress_bar: show a tqdm bar on ``sys.stderr`` (a one-line note instead without tqdm).
        threshold: a row is "within error" when both ``|z|`` are at most this.

    Examples:
        >>> import io
        >>> buf = io.StringIO()
        >>> res = run_intro(repetitions=20, rows=ROWS[:1], out=buf, progress_bar=False)
        >>> "true var" in buf.getvalue(), len(res)
        (True, 1)
    """
    out = sys.stdout if out is None else out
    torch.manual_seed(seed)
    # The manual's script draws two single estimates before its table; doing the same keeps the
    # random stream identical, so that with seed 0 and R = 1000 our rows are the manual's runs.
    for _ in range(2):
        f, _c = compute_f(Reparameterization("e", n_samples=1))
        storch.add_cost(f, "f")
        storch.backward()
    print("Introduction example (manual §1.2): a=5, b=-3, c=0.23, d=a+b, e ~ N(b+c, 1), f = d*e^2", file=out)
    print(f"Gradient of E[f] w.r.t. c; true value 2(a+b)(b+c) = {TRUE_GRADIENT:.2f}. "
          f"R = {repetitions} repetitions per row, seed {seed}.", file=out)
    print("True variances are exact (Gauss-Hermite quadrature of polynomial moments; see "
          "storch/demo/intro.py).", file=out)
    print(f"z = (estimate - truth) / standard error; 'within error' means both |z| <= {threshold:g}.", file=out)
    print("'manual var' is the value printed in the Storchastic manual; the manual divides by R, we divide "
          "by R - 1.", file=out)
    print(file=out)
    bar = None
    if progress_bar:
        from storch.demo import progress_bar as make_bar

        bar = make_bar(repetitions * len(rows), "intro")
    results = []
    try:
        for row in rows:
            if bar is not None:
                bar.set_postfix_str(f"{row.label} n={row.n}")
            results.append(run_row(row, repetitions, threshold, bar.update if bar is not None else None))
    finally:
        if bar is not None:
            bar.close()
    print(format_table(results), file=out)
    out.flush()
    return results
