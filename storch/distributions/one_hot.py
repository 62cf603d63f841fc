"""One-hot vectors from category indices, without reading the indices on the host."""

from __future__ import annotations

import torch


def one_hot(index: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``F.one_hot(index, n).to(dtype)`` for indices known to lie in ``[0, n)``.

    ``F.one_hot`` checks the range of ``index`` on the host (a device synchronisation on a GPU, and a
    value a traced step cannot read: `storch.compile_step`). The indices storch one-hot
    encodes come from sampling or ``argmax`` over ``n`` categories, so they are in range by
    construction; an out-of-range index here gives a row of zeros instead of an error.

    Examples:
        >>> one_hot(torch.tensor([2, 0]), 3, torch.float32).tolist()
        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    """
    return (index.unsqueeze(-1) == torch.arange(n, device=index.device)).to(dtype)
