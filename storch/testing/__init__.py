"""A statistical harness for checking gradient estimators against exact gradients.

An estimator is *unbiased* if the mean of many independent estimates converges to the exact
gradient. `storch.testing.check_unbiased` draws the conclusion per coordinate: with ``R`` estimates,
mean
``m`` and standard error ``se = std / √R``, it requires ``|m − exact| ≤ z · se + tiny`` (``z = 4.5``
by default, so a correct estimator fails a coordinate with probability below 1e-5).

Independent estimates are cheapest in one backward pass: `storch.testing.replicate` copies a parameter
``R`` times along an independent plate. Each copy only influences its own replicate, so the
gradient of the copies, times ``R`` (the plate's weight is ``1/R``), holds ``R`` independent
estimates::

    leaf, theta = replicate(param, 2000)
    build_model(theta); storch.backward()
    estimates = leaf.grad * 2000

The random-graph tester builds on it: `storch.testing.graphs` draws random
stochastic computation graphs, `storch.testing.exact` computes their exact
derivatives without storch, and `storch.testing.fuzz` compares the two, shrinks
a failing graph and prints it as a script (``python -m storch.testing.fuzz``).

Examples:
    >>> import torch
    >>> rng = torch.Generator().manual_seed(0)
    >>> estimates = 1.0 + torch.randn(4000, 2, generator=rng)
    >>> check_unbiased(estimates, torch.tensor([1.0, 1.0])).passed
    True
    >>> check_unbiased(estimates, torch.tensor([1.0, 1.5])).passed
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from storch.compiler import skip_storch_frames
from storch.inference import backward
from storch.reductions import denote_independent
from storch.tensor import IndependentTensor

__all__ = [
    "UnbiasednessReport", "check_unbiased", "assert_unbiased", "replicate", "replicated_gradients",
    "repeated", "variance_with_stderr",
]


@dataclass
class UnbiasednessReport:
    """Per-coordinate comparison of estimates with the exact value."""

    mean: torch.Tensor
    stderr: torch.Tensor
    exact: torch.Tensor
    z: float
    tiny: float

    @property
    def zscores(self) -> torch.Tensor:
        return (self.mean - self.exact).abs() / self.stderr.clamp_min(1e-30)

    @property
    def passed(self) -> bool:
        return bool(((self.mean - self.exact).abs() <= self.z * self.stderr + self.tiny).all())

    def __str__(self) -> str:
        rows = ["coordinate        mean       exact      stderr   |diff|/se"]
        flat = [t.reshape(-1).tolist() for t in (self.mean, self.exact, self.stderr, self.zscores)]
        for i, (m, e, s, zz) in enumerate(zip(*flat)):
            rows.append(f"{i:>10d} {m:>11.5g} {e:>11.5g} {s:>11.3g} {zz:>11.2f}")
        return "\n".join(rows)


def check_unbiased(
    estimates: torch.Tensor, exact: torch.Tensor, z: float = 4.5, tiny: float = 1e-6
) -> UnbiasednessReport:
    """Compare ``R`` estimates (first dimension) with the exact value, per coordinate."""
    estimates = estimates.detach().double()
    exact = torch.as_tensor(exact).detach().double().expand(estimates.shape[1:])
    r = estimates.shape[0]
    if r < 2:
        raise ValueError("check_unbiased needs at least two estimates.")
    mean = estimates.mean(0)
    stderr = estimates.std(0) / r**0.5
    return UnbiasednessReport(mean, stderr, exact, z, tiny)


def assert_unbiased(
    estimates: torch.Tensor, exact: torch.Tensor, z: float = 4.5, tiny: float = 1e-6, label: str = ""
) -> UnbiasednessReport:
    """`storch.testing.check_unbiased`, raising ``AssertionError`` with the table if a coordinate
    fails."""
    report = check_unbiased(estimates, exact, z, tiny)
    if not report.passed:
        raise AssertionError(f"{label} estimates are biased beyond {z} standard errors:\n{report}")
    return report


def replicate(param: torch.Tensor, repeats: int, plate_name: str = "replicate") -> tuple[torch.Tensor, IndependentTensor]:
    """``repeats`` independent copies of ``param``: the leaf to read gradients from, and its plated view."""
    leaf = param.detach().unsqueeze(0).repeat((repeats,) + (1,) * param.dim()).requires_grad_()
    return leaf, denote_independent(leaf, 0, plate_name)


def replicated_gradients(
    params: list[torch.Tensor],
    repeats: int,
    model: Callable[..., None],
    create_graph: bool = False,
) -> list[torch.Tensor]:
    """Independent gradient estimates from one backward pass.

    ``model(*views)`` receives the replicated views of ``params``, samples and registers costs.
    Returns, per parameter, a tensor ``(repeats, *param.shape)`` of estimates (with their graph when
    ``create_graph``).
    """
    # independent plates with the same name and size are one plate, so all views share it
    leaves_views = [replicate(p, repeats) for p in params]
    model(*(view for _, view in leaves_views))
    backward(create_graph=create_graph)
    return [leaf.grad * repeats for leaf, _ in leaves_views]


def repeated(estimate: Callable[[], torch.Tensor], repeats: int) -> torch.Tensor:
    """Stack ``repeats`` calls of ``estimate()`` (each an independent estimate)."""
    return torch.stack([estimate().detach().clone() for _ in range(repeats)])


def variance_with_stderr(samples: torch.Tensor) -> tuple[float, float]:
    """Sample variance of 1-D ``samples`` and its standard error (from the fourth central moment)."""
    x = samples.detach().double().reshape(-1)
    r = x.numel()
    c = x - x.mean()
    var = (c**2).sum().item() / (r - 1)
    m4 = (c**4).mean().item()
    se2 = (m4 - var**2 * (r - 3) / (r - 1)) / r
    return var, max(se2, 0.0) ** 0.5


skip_storch_frames()  # imported after storch's __init__ registered the others (see storch.compiler)
