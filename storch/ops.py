"""Plate-aware versions of a few torch functions: ``cat``, ``gather``, ``expand_as``, ``grad``."""

from __future__ import annotations

from typing import Sequence

import torch

from storch._dispatch import align_tensor, expand_plain
from storch.plate import merge_layouts
from storch.tensor import Tensor, _Disable, layout_of, plain, wrap, wrap_new

__all__ = ["cat", "gather", "expand_as", "grad"]


def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` with every input expanded to the union of the plates.

    ``dim`` counts event dimensions from the left when non-negative (``dim=0`` is the first event
    dimension), and from the right when negative, so code written for one sample keeps working.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.arange(6.0).reshape(3, 2), 0, "data")
        >>> y = storch.cat([x, torch.tensor([9.0])], 0)   # the plain tensor is repeated over "data"
        >>> y.shape, y._tensor.tolist()
        (torch.Size([3, 3]), [[0.0, 1.0, 9.0], [2.0, 3.0, 9.0], [4.0, 5.0, 9.0]])
    """
    layouts = [layout_of(t) for t in tensors]
    union = merge_layouts([lay for lay in layouts if lay.plates]) if any(lay.plates for lay in layouts) else layouts[0]
    n = len(union.sizes)
    with _Disable():
        parts = [
            align_tensor(t, union, expand=True) if lay.plates else expand_plain(t, union)
            for t, lay in zip(tensors, layouts)
        ]
        out = torch.cat(parts, dim=dim + n if dim >= 0 else dim)
    return wrap_new(out, union)


def gather(input: torch.Tensor, dim: str, index: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """Select samples along the plate ``dim`` of ``input`` with an integer storch ``index``.

    ``index`` holds, for each entry of its plates, which sample of plate ``dim`` to take; the result
    has the plates of ``index`` (plus those of ``input`` other than ``dim``) and ``input``'s event
    shape.
    """
    in_layout = layout_of(input)
    pos = in_layout.index(dim)
    plate = in_layout.plates[pos]
    union = merge_layouts([in_layout, layout_of(index)])
    with _Disable():
        src = align_tensor(input, union, expand=True) if in_layout.plates else input
        n = len(union.sizes)
        event = tuple(src.shape[n:])
        idx = align_tensor(index, union, expand=True) if isinstance(index, Tensor) else expand_plain(index, union)
        idx = idx.reshape(idx.shape[:n] + (1,) * len(event)).expand(idx.shape[:n] + event)
        upos = union.index(plate)
        src = src.expand(union.sizes[:upos] + (plate.size,) + union.sizes[upos + 1:] + event)
        out = torch.gather(src, upos, idx.long())
        if not any(p == plate for p in layout_of(index).plates):
            # one sample of ``dim`` per entry of the index: the plate is gone (its entries are equal)
            out = out.select(upos, 0)
            union = union.without([plate])
    return wrap_new(out, union)


def expand_as(tensor: torch.Tensor, expand_as: torch.Tensor) -> torch.Tensor:
    """Expand ``tensor`` to the plates and shape of ``expand_as``.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.zeros(3, 2), 0, "data")
        >>> storch.expand_as(torch.ones(2), x).plates[0].name
        'data'
    """
    union = merge_layouts([lay for lay in (layout_of(tensor), layout_of(expand_as)) if lay.plates])
    with _Disable():
        t = align_tensor(tensor, union) if layout_of(tensor).plates else tensor
        out = t.expand_as(expand_as)
    return wrap_new(out, union) if union.plates else out


def grad(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` for storch tensors: each gradient gets the plates of its input."""
    ins = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    if grad_outputs is not None:
        grad_outputs = [plain(g) if isinstance(g, torch.Tensor) else g for g in grad_outputs]
    with _Disable():  # else torch.autograd.grad dispatches to storch and gives every result the union of plates
        grads = torch.autograd.grad(
            [plain(o) for o in outs], ins, grad_outputs=grad_outputs, retain_graph=retain_graph,
            create_graph=create_graph, only_inputs=only_inputs, allow_unused=allow_unused,
        )
    return tuple(
        None if g is None else (wrap(g, i._layout) if isinstance(i, Tensor) else g)
        for g, i in zip(grads, ins)
    )
