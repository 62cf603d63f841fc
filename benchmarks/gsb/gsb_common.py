"""Shared pieces of the GSB reproductions: estimator factories, gradient log-variance, tables, plots.

Used by ``toy_problems.py`` and ``bayes_logreg.py`` (run from the repository root). Plots need
matplotlib (``pip install -e ".[bench]"``); without it the scripts print and save their tables and say
that the plots were skipped.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script from anywhere: import the checkout's storch
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import storch  # noqa: E402
from storch.testing import replicated_gradients  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def make_method(name: str, plate: str, n_samples: int, order: int) -> storch.method.Method:
    """The estimator called ``name``: ``gsb`` (truncated at ``order``), ``pathwise`` or ``score``.

    ``pathwise`` is :class:`storch.method.Reparameterization` (torch's ``Gamma.rsample`` is the implicit
    reparameterization gradient, ``Laplace.rsample`` the inverse-CDF one); ``score`` the score function
    without baseline (the paper uses no control variates).
    """
    if name == "gsb":
        return storch.method.GSB(plate, n_samples=n_samples, order=order)
    if name == "pathwise":
        return storch.method.Reparameterization(plate, n_samples=n_samples)
    if name == "score":
        return storch.method.ScoreFunction(plate, n_samples=n_samples)
    raise ValueError(f"unknown estimator {name!r}: use gsb, pathwise or score")


def gradient_log_variance(params: Sequence[torch.Tensor], repeats: int, model: Callable[..., None]) -> float:
    """``log10`` of the per-parameter gradient variance, averaged over all parameter coordinates.

    ``repeats`` independent estimates come from one backward pass
    (:func:`storch.testing.replicated_gradients`); ``model(*params)`` samples and registers costs.
    """
    storch.reset()
    estimates = replicated_gradients(list(params), repeats, model)
    storch.reset()
    variances = torch.cat([g.reshape(repeats, -1).var(0) for g in estimates])
    return math.log10(max(variances.mean().item(), 1e-300))


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    return t.mean().item(), (t.std().item() if t.numel() > 1 else 0.0)


def fmt(values: Sequence[float], digits: int = 4) -> str:
    m, s = mean_sd(values)
    return f"{m:.{digits}g} ± {s:.2g}"


class Timer:
    """Accumulates wall time of the optimisation steps (not of the measurements)."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def __enter__(self) -> "Timer":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self._t0
        self.count += 1

    @property
    def ms(self) -> float:
        return 1000 * self.total / max(self.count, 1)


def write_results(stem: str, text: str, data: dict) -> None:
    """``results/<stem>.txt`` (the printed tables) and ``results/<stem>.json`` (raw numbers)."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, stem + ".txt"), "w") as f:
        f.write(text)
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump(data, f, indent=1)


def pyplot():
    """matplotlib's pyplot with the Agg backend, or ``None`` (and a message) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed: plots skipped (pip install -e ".[bench]")')
        return None
    return plt


def plot_curves(ax, steps: Sequence[int], runs: dict[str, list[list[float]]], ylabel: str, title: str,
                log: bool = False) -> None:
    """Mean ± sd over seeds of one metric per estimator, on one matplotlib axis."""
    for label, curves in runs.items():
        t = torch.tensor(curves, dtype=torch.float64)
        m = t.mean(0)
        s = t.std(0) if t.shape[0] > 1 else torch.zeros_like(m)
        ax.plot(steps, m.tolist(), label=label)
        ax.fill_between(steps, (m - s).tolist(), (m + s).tolist(), alpha=0.2)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def save_figure(fig, name: str) -> Optional[str]:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path
