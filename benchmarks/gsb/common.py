"""Shared helpers of the GSB experiments (``toy.py``, ``logistic_regression.py``).

* Seeds as a plate: the ``S`` independent training runs of one estimator are one storch graph. The
  parameters have a leading dimension ``S`` that the model declares an independent plate ``"seed"``
  (:func:`seed_view`); every run draws its own samples, and Adam is elementwise, so the runs do not
  interact. storch averages over an independent plate (weight ``1/S``), so the gradients are multiplied
  by ``S`` before the step (:func:`rescale_grads`).
* Gradient variance: ``R`` independent estimates at the current parameters in one backward pass
  (:func:`storch.testing.replicated_gradients`, which adds a ``"replicate"`` plate in front of
  ``"seed"``); per run, the variance of one estimate per coordinate, averaged over all coordinates of
  all parameters, reported as ``log10`` (:func:`log10_mean_variance`).
* Output: tables printed and written as ``.txt``/``.json`` under ``benchmarks/gsb/results/``; plots as
  PNG with matplotlib's Agg backend when matplotlib is installed (``pip install -e '.[bench]'``),
  otherwise a line says the plots were skipped.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

import storch
from storch.testing import replicated_gradients
from storch.tensor import is_storch, layout_of

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SEED_PLATE = "seed"


def seed_view(param: torch.Tensor, plate: str = SEED_PLATE) -> torch.Tensor:
    """Declare the leading non-plate dimension of ``param`` (the runs) an independent plate."""
    dim = len(layout_of(param).plates) if is_storch(param) else 0
    return storch.denote_independent(param, dim, plate)


def rescale_grads(params: Sequence[torch.Tensor], factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def replicated_estimates(
    params: Sequence[torch.Tensor], repeats: int, model: Callable[..., None], n_seeds: int, chunk: int = 0
) -> list[torch.Tensor]:
    """``R`` independent gradient estimates per run: one tensor ``(R, S, ...)`` per parameter.

    ``model(*views)`` builds the graph and registers the costs (it calls :func:`seed_view` itself).
    ``chunk`` > 0 splits the ``R`` replicates into several backward passes (memory).
    """
    chunk = chunk if chunk > 0 else repeats
    parts: list[list[torch.Tensor]] = []
    done = 0
    while done < repeats:
        r = min(chunk, repeats - done)
        grads = replicated_gradients([p.detach() for p in params], r, model)
        parts.append([g.detach() * n_seeds for g in grads])  # undo the 1/S of the seed plate
        done += r
    return [torch.cat([p[i] for p in parts]) for i in range(len(params))]


def log10_mean_variance(estimates: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per run (dim 1): log10 of the mean over all coordinates of the variance over replicates (dim 0)."""
    flat = torch.cat([e.double().flatten(2) for e in estimates], dim=2)  # (R, S, coordinates)
    return flat.var(0).mean(-1).log10()


def max_abs_z(estimates: Sequence[torch.Tensor], exact: Sequence[torch.Tensor], floor: float = 1e-7) -> float:
    """Largest ``|mean − exact| / (sd/√R)`` over all coordinates of all runs (``storch.testing``'s statistic)."""
    worst = 0.0
    for e, g in zip(estimates, exact):
        e = e.double()
        r = e.shape[0]
        diff = (e.mean(0) - g.double()).abs()
        se = e.std(0) / math.sqrt(r)
        z = torch.where(diff > floor, diff / se.clamp_min(1e-30), torch.zeros_like(diff))
        worst = max(worst, float(z.max()))
    return worst


def mean_sd(values: Sequence[float] | torch.Tensor) -> tuple[float, float]:
    t = torch.as_tensor(values, dtype=torch.float64).flatten()
    if t.numel() == 0:
        return float("nan"), float("nan")
    sd = float(t.std()) if t.numel() > 1 else 0.0
    return float(t.mean()), sd


def fmt_ms(m: float, s: float, digits: int = 3) -> str:
    """``mean ± sd`` in a compact scientific or fixed form."""
    if not math.isfinite(m):
        return "nan"
    if m != 0 and (abs(m) < 1e-2 or abs(m) >= 1e4):
        return f"{m:.{digits - 1}e} ± {s:.1e}"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "argv": sys.argv[1:],
    }


def write_results(out_dir: Path, stem: str, text: str, data: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    txt, js = out_dir / f"{stem}.txt", out_dir / f"{stem}.json"
    txt.write_text(text + "\n")
    js.write_text(json.dumps(data, indent=1, default=float) + "\n")
    return [txt, js]


def pyplot() -> Optional[Any]:
    """matplotlib.pyplot with the Agg backend, or None (and a printed note) when matplotlib is missing."""
    if os.environ.get("GSB_BENCH_NO_PLOTS"):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: tables only, no plots (pip install -e '.[bench]' or make bench-gsb).")
        return None
    return plt


def band(ax: Any, x: Sequence[float], runs: torch.Tensor, label: str, color: Optional[str] = None, log: bool = False) -> None:
    """Mean ± sd over runs (dim 0 of ``runs``) as a line with a shaded band."""
    r = runs.double()
    if log:  # mean and sd of log10 values: a band that stays positive
        r = r.clamp_min(1e-300).log10()
    m = r.mean(0)
    s = r.std(0) if r.shape[0] > 1 else torch.zeros_like(m)
    lo, hi = m - s, m + s
    if log:
        m, lo, hi = 10**m, 10**lo, 10**hi
    (ln,) = ax.plot(list(x), m.tolist(), label=label, color=color, lw=1.2)
    ax.fill_between(list(x), lo.tolist(), hi.tolist(), color=ln.get_color(), alpha=0.2, lw=0)
