"""Plate-aware versions of a few torch functions: ``cat``, ``gather``, ``expand_as``, ``grad``.

**Dimension arguments.** One rule holds for storch's functions and for torch functions applied to
storch tensors (``torch.cat``, ``t.sum(d)``, ``torch.gather``, …):

* an ``int`` dimension counts the dimensions of the tensor as its ``shape`` shows them: its plates
  first (newest first), then the dimensions of one sample (the distribution's batch and event
  dimensions). ``dim=i`` means ``t.shape[i]``, exactly as in torch and in Storchastic;
* a dimension that falls on a plate is an error that names the plate: plates are reduced or selected
  *by name* (`storch.reduce_plates`, ``storch.sum/mean/logsumexp(t, "z")``,
  `storch.ops.gather` with a plate name);
* a negative dimension counts from the right, so it indexes one sample's dimensions whatever the
  plates: ``dim=-1`` is the last dimension of a sample under any number of plates. Prefer it in code
  meant to run with and without plates;
* a function of several tensors first aligns them to the union of their plates (missing plates
  broadcast); a non-negative dimension then counts the dimensions of the aligned tensors, which are
  also those of the result: the union's plates, then one sample's dimensions.

For ``a`` of shape ``(5, 4, 2)`` whose first dimension is plate ``"p"``: ``storch.cat([a, a], 1)``
and ``torch.cat([a, a], 1)`` are ``(5, 8, 2)``, ``dim=2`` and ``dim=-1`` give ``(5, 4, 4)``, and
``dim=0`` is refused (it is plate ``"p"``), as ``a[k]`` for each sample ``k`` would have it with
``dim - 1``.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from storch._dispatch import align_tensor, expand_plain
from storch.plate import Plate, PlateLayout, merge_layouts
from storch.tensor import Tensor, _Disable, layout_of, plain, wrap, wrap_new

__all__ = ["cat", "gather", "expand_as", "grad", "event_dim"]


def event_dim(dim: int, ndim: int, layout: PlateLayout, who: str, shape: Sequence[int] = ()) -> int:
    """The non-negative position of dimension argument ``dim`` in a tensor of ``ndim`` dimensions
    whose first ones are the plates of ``layout``, checked to be one of a sample's dimensions.

    Args:
        dim: the dimension as given (counting plates first; negative: from the right).
        ndim: the number of dimensions, plates included.
        layout: the plates of the tensor.
        who: the function, for messages.
        shape: the tensor's shape, for messages.

    Raises:
        IndexError: if ``dim`` is out of range.
        ValueError: if ``dim`` falls on a plate; the message names the plate and the dimensions to use.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.zeros(5, 4, 2), 0, "p")
        >>> layout = storch.extend.layout_of(x)
        >>> event_dim(-1, 3, layout, "f"), event_dim(1, 3, layout, "f")
        (2, 1)
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{who}: a dimension must be an int, got {dim!r} ({type(dim).__name__}).")
    n = len(layout.sizes)
    where = f"a tensor of shape {tuple(shape)}" if shape else f"a tensor of {ndim} dimensions"
    if not -ndim <= dim < ndim:
        raise IndexError(f"{who}: dimension {dim} is out of range for {where} (valid: {-ndim}..{ndim - 1}).")
    pos = dim % ndim
    if pos < n:
        plate = layout.plates[pos]
        raise ValueError(
            f"{who} got dimension {dim}, which is plate {plate.name!r} (size {plate.size}) of {where} whose "
            f"first {n} dimensions are the plates {list(layout.names)}. Dimensions count the plates first, "
            f"as in torch.cat on storch tensors and in Storchastic: one sample's dimensions are "
            f"{n}..{ndim - 1}, or {n - ndim}..-1 from the right (which works under any plates). Select or "
            f"reduce a plate by its name (storch.gather(t, {plate.name!r}, index), storch.reduce_plates)."
        )
    return pos


def _union(tensors: Sequence[torch.Tensor]) -> tuple[list[PlateLayout], PlateLayout]:
    layouts = [layout_of(t) for t in tensors]
    plated = [lay for lay in layouts if lay.plates]
    return layouts, (merge_layouts(plated) if plated else layouts[0])


def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` with every input expanded to the union of the plates.

    ``dim`` follows the rule of this module: it counts the dimensions of the inputs aligned to the
    union of their plates, plates first (so ``dim=0`` is a plate and refused when there are plates);
    a negative ``dim`` counts one sample's dimensions from the right. ``storch.cat`` and
    ``torch.cat`` on storch tensors give the same result. Plain ``torch.Tensor`` inputs hold one
    sample's dimensions and are repeated over the plates.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.arange(6.0).reshape(3, 2), 0, "data")
        >>> y = storch.cat([x, torch.tensor([9.0])], -1)   # the plain tensor is repeated over "data"
        >>> y.shape, y.plain().tolist()
        (torch.Size([3, 3]), [[0.0, 1.0, 9.0], [2.0, 3.0, 9.0], [4.0, 5.0, 9.0]])
        >>> storch.cat([x, x], 1).shape == torch.cat([x, x], 1).shape == (3, 4)
        True
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("storch.cat needs at least one tensor.")
    layouts, union = _union(tensors)
    if not union.plates:
        with _Disable():
            out = torch.cat([plain(t) if isinstance(t, Tensor) else t for t in tensors], dim=dim)
        return wrap_new(out, union) if any(isinstance(t, Tensor) for t in tensors) else out
    with _Disable():
        parts = [
            align_tensor(t, union, expand=True) if lay.plates else expand_plain(t, union)
            for t, lay in zip(tensors, layouts)
        ]
        pos = event_dim(dim, parts[0].dim(), union, "storch.cat", parts[0].shape)
        out = torch.cat(parts, dim=pos)
    return wrap_new(out, union)


def gather(input: torch.Tensor, dim: Union[str, Plate, int], index: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """Select values of ``input`` with an integer ``index``: samples along a plate, or per sample.

    * ``dim`` a plate (its name or the `storch.plate.Plate`), as in Storchastic: ``index``
      holds, for each entry of its plates, which sample of plate ``dim`` to take; the result has the
      plates of ``index`` (plus those of ``input`` other than ``dim``) and ``input``'s sample shape.
    * ``dim`` an ``int``: ``torch.gather`` applied to each sample, after aligning ``input`` and
      ``index`` to the union of their plates. ``dim`` follows the rule of this module (plates first;
      negative from the right) and must fall on one of a sample's dimensions; a sample of ``index``
      has as many dimensions as a sample of ``input`` (as in ``torch.gather``), and the result has
      the union's plates and the sample shape of ``index``.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0, "data")
        >>> storch.gather(x, -1, torch.tensor([1])).plain().tolist()   # element 1 of each sample
        [[2.0], [4.0]]
        >>> storch.gather(x, "data", torch.tensor(1)).tolist()          # sample 1 of the plate
        [3.0, 4.0]
    """
    if isinstance(dim, int) and not isinstance(dim, bool):
        return _gather_per_sample(input, dim, index)
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


def _gather_per_sample(input: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """``torch.gather(input[s], d, index[s])`` for every sample ``s`` of the union of the plates."""
    layouts, union = _union([input, index])
    n = len(union.sizes)
    with _Disable():
        src = align_tensor(input, union, expand=True) if layouts[0].plates else expand_plain(input, union)
        idx = align_tensor(index, union, expand=True) if layouts[1].plates else expand_plain(index, union)
        if src.dim() != idx.dim():
            raise ValueError(
                f"storch.gather(dim={dim}): a sample of the index has shape {tuple(idx.shape[n:])} and one of "
                f"the input {tuple(src.shape[n:])}; torch.gather needs as many dimensions in both."
            )
        pos = event_dim(dim, src.dim(), union, "storch.gather", src.shape)
        out = torch.gather(src, pos, idx)
    return wrap_new(out, union) if union.plates or isinstance(input, Tensor) else out


def expand_as(tensor: torch.Tensor, expand_as: torch.Tensor) -> torch.Tensor:
    """Expand ``tensor`` to the plates and the sample shape of ``expand_as``.

    Per sample, this is ``torch.Tensor.expand_as``: one sample of ``tensor`` lines up on the right with
    one sample of ``expand_as`` (a plain tensor is one sample). The result has the union of both
    plates (at full size) and ``expand_as``'s sample shape.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.zeros(3, 2), 0, "data")
        >>> storch.expand_as(torch.ones(2), x).plates[0].name
        'data'
        >>> storch.expand_as(x, torch.zeros(4, 2)).shape   # each sample (2,) expanded to (4, 2)
        torch.Size([3, 4, 2])
    """
    layouts, union = _union([tensor, expand_as])
    if not union.plates:
        with _Disable():
            out = plain(tensor).expand_as(plain(expand_as))
        return wrap_new(out, union) if isinstance(tensor, Tensor) or isinstance(expand_as, Tensor) else out
    n = len(union.sizes)
    with _Disable():
        target = tuple(expand_as.shape[len(layouts[1].sizes):])
        own = tensor.dim() - len(layouts[0].sizes)
        if own > len(target):
            raise ValueError(
                f"storch.expand_as: a sample of the tensor has shape {tuple(tensor.shape[len(layouts[0].sizes):])}, "
                f"more dimensions than a sample of expand_as, {target}."
            )
        t = align_tensor(tensor, union, len(target)) if layouts[0].plates else tensor
        out = t.expand(union.sizes + target)
    return wrap_new(out, union) if n else out


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
