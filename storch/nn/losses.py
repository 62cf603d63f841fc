"""Plate-aware losses: reductions act on event dimensions only, never on plates."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from storch.tensor import layout_of

__all__ = ["b_binary_cross_entropy"]


def _reduce_event(loss: torch.Tensor, n_plates: int, reduction: str) -> torch.Tensor:
    dims = tuple(range(n_plates, loss.dim()))
    if reduction == "none" or not dims:
        return loss
    if reduction == "sum":
        return loss.sum(dims)
    if reduction == "mean":
        return loss.mean(dims)
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}.")


def b_binary_cross_entropy(
    input: torch.Tensor,  # noqa: A002
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    reduction: str = "sum",
) -> torch.Tensor:
    """Binary cross entropy that keeps the plates: ``reduction`` sums/averages event dimensions only.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([[1., 0.], [0., 1.]]), 0, "data")
        >>> p = storch.denote_independent(torch.full((2, 2), 0.5), 0, "data")
        >>> loss = storch.nn.b_binary_cross_entropy(p, x)
        >>> loss.plates[0].name, [round(v, 4) for v in loss.plain().tolist()]
        ('data', [1.3863, 1.3863])
    """
    loss = F.binary_cross_entropy(input, target, weight=weight, reduction="none")
    n = max(len(layout_of(input).sizes), len(layout_of(target).sizes), len(layout_of(loss).sizes))
    return _reduce_event(loss, n, reduction)
