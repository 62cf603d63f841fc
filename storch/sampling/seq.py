"""``storch.sampling.seq``: the manual's module for sequence decoding (§9.2).

Storchastic 0.3.7 kept its sequence decoders and their plate in ``storch/sampling/seq.py``. In
storch they live elsewhere, and this module gives them the manual's names:

* `storch.sampling.seq.AncestralPlate` — `storch.plate.AncestralPlate`, the plate of one decoding
  step (the same class; its constructor is storch's, see docs/migrating.md);
* `SequenceDecoding` and `IterDecoding` — both `storch.sampling.swor.SequenceSampler`, the base
  class of proposals that draw sets and extend them step by step (storch's hooks are
  ``draw``/``extend``/``weights`` instead of Storchastic's ``decode``/``decode_step``); subclasses
  include `storch.sampling.swor.SampleWithoutReplacement` and `storch.sampling.seq.MCDecoder`;
* `storch.sampling.seq.MCDecoder` — `storch.sampling.decoding.MCDecoder`, ancestral sampling of
  ``k`` independent sequences.

The helpers `right_expand_as`, `left_expand_as` and `expand_with_ignore_as`
are defined here. With storch tensors they align the plates of both arguments first (as every
storch operation does) and expand them to full size; "leading" and "trailing" then refer to the
event dimensions, after the plates.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from storch.extend import AncestralPlate, layout_of, merge_layouts
from storch.sampling.decoding import MCDecoder
from storch.sampling.swor import SequenceSampler
from storch.wrappers import deterministic

__all__ = [
    "AncestralPlate", "SequenceDecoding", "IterDecoding", "MCDecoder",
    "right_expand_as", "left_expand_as", "expand_with_ignore_as",
]

#: The manual's name for `storch.sampling.swor.SequenceSampler` (the same
# class).
SequenceDecoding = SequenceSampler

#: The manual's name for the base class of decoders that sample variable by variable; in storch
#: that is `storch.sampling.swor.SequenceSampler` too (the same class).
IterDecoding = SequenceSampler


def _on_events(
    fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], tensor: torch.Tensor, expand_as: torch.Tensor
) -> torch.Tensor:
    """``fn(t, e, n)`` with ``t`` and ``e`` laid out over the same ``n`` leading plate dimensions.

    Plain tensors (no plates anywhere) go to ``fn`` as they are with ``n = 0``. Otherwise the
    plates of both arguments are aligned and expanded to full size (a plain argument, which has
    only event dimensions, is expanded over them), and the result gets the plates back.
    """
    layouts = [layout_of(t) for t in (tensor, expand_as)]
    if not any(lay.plates for lay in layouts):
        return fn(tensor, expand_as, 0)
    union = merge_layouts([lay for lay in layouts if lay.plates])
    sizes = union.sizes
    n = len(sizes)
    plated = [bool(lay.plates) for lay in layouts]

    def over_plates(t: torch.Tensor) -> torch.Tensor:
        return t.reshape((1,) * n + tuple(t.shape)).expand(sizes + tuple(t.shape))

    def run(t: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return fn(t if plated[0] else over_plates(t), e if plated[1] else over_plates(e), n)

    return deterministic(run, expand_plates=True)(tensor, expand_as)


def _extra_dims(t: torch.Tensor, e: torch.Tensor, name: str) -> int:
    diff = e.dim() - t.dim()
    if diff < 0:
        raise ValueError(
            f"{name}: the tensor has more dimensions ({t.dim()}, shape {tuple(t.shape)}) than the one "
            f"it is expanded as ({e.dim()}, shape {tuple(e.shape)})."
        )
    return diff


def right_expand_as(tensor: torch.Tensor, expand_as: torch.Tensor) -> torch.Tensor:
    """Add trailing dimensions to ``tensor`` and expand them to those of ``expand_as``.

    ``tensor`` of shape ``(a, b)`` and ``expand_as`` of shape ``(a, b, c, d)`` give ``(a, b, c, d)``:
    ``tensor``'s dimensions line up with the first ones of ``expand_as`` (unlike torch's
    ``expand_as``, which lines them up on the right). With storch tensors the plates are aligned
    and expanded first, and the dimensions are the event dimensions. A view, as with ``expand``.

    Examples:
        >>> import torch
        >>> right_expand_as(torch.tensor([1, 2]), torch.zeros(2, 3))
        tensor([[1, 1, 1],
                [2, 2, 2]])
    """

    def fn(t: torch.Tensor, e: torch.Tensor, n: int) -> torch.Tensor:
        diff = _extra_dims(t, e, "right_expand_as")
        shape = tuple(t.shape) + tuple(e.shape[t.dim():])
        return t[(...,) + (None,) * diff].expand(shape)

    return _on_events(fn, tensor, expand_as)


def left_expand_as(tensor: torch.Tensor, expand_as: torch.Tensor) -> torch.Tensor:
    """Add leading dimensions to ``tensor`` and expand them to those of ``expand_as``.

    ``tensor`` of shape ``(c,)`` and ``expand_as`` of shape ``(a, b, c)`` give ``(a, b, c)``; the
    leading sizes are taken from ``expand_as``, the others stay ``tensor``'s (so ``tensor`` need
    not match ``expand_as``'s trailing sizes). With storch tensors the plates are aligned and
    expanded first, and the new dimensions go in front of the event dimensions (after the plates).

    Examples:
        >>> import torch
        >>> left_expand_as(torch.arange(3), torch.zeros(2, 5)).tolist()
        [[0, 1, 2], [0, 1, 2]]
    """

    def fn(t: torch.Tensor, e: torch.Tensor, n: int) -> torch.Tensor:
        diff = _extra_dims(t, e, "left_expand_as")
        plates, event = tuple(t.shape[:n]), tuple(t.shape[n:])
        return t.reshape(plates + (1,) * diff + event).expand(plates + tuple(e.shape[n : n + diff]) + event)

    return _on_events(fn, tensor, expand_as)


def expand_with_ignore_as(tensor: torch.Tensor, expand_as: torch.Tensor, ignore_dim: Union[str, int]) -> torch.Tensor:
    """Expand ``tensor`` like ``expand_as`` except in one dimension, where it keeps its own size.

    As the manual documents it: ``tensor`` of size ``a × b``, ``expand_as`` of size ``d × a × c``
    and ``ignore_dim=-1`` give ``d × a × b``. The dimensions line up on the right as in torch's
    ``expand_as`` (missing leading dimensions are added); every dimension but ``ignore_dim`` must
    be ``1`` in ``tensor`` or equal to ``expand_as``'s. (Storchastic 0.3.7's code added the missing
    dimensions on the right instead, contrary to its docstring; use `right_expand_as` for
    that.)

    With storch tensors the plates are aligned and expanded to full size first. ``ignore_dim`` is
    then either a plate name (a plate dimension always has the plate's size, so the result is
    the same as without ignoring it) or an int indexing the dimensions of the aligned
    ``expand_as``, plates first; a negative int counts event dimensions from the right.

    Examples:
        >>> import torch
        >>> t = torch.arange(8).reshape(4, 2)
        >>> out = expand_with_ignore_as(t, torch.zeros(3, 4, 7), -1)
        >>> out.shape, bool((out == t).all())          # 3 copies of t
        (torch.Size([3, 4, 2]), True)
    """
    if isinstance(ignore_dim, bool) or not isinstance(ignore_dim, (str, int)):
        raise TypeError(
            f"expand_with_ignore_as: ignore_dim must be a dimension (int) or a plate name (str), got "
            f"{ignore_dim!r} ({type(ignore_dim).__name__})."
        )
    if isinstance(ignore_dim, str):
        names = [p.name for t in (tensor, expand_as) for p in layout_of(t).plates]
        if ignore_dim not in names:
            raise ValueError(
                f"expand_with_ignore_as: no plate named {ignore_dim!r} on the arguments; their plates are "
                f"{sorted(set(names))}."
            )

    def fn(t: torch.Tensor, e: torch.Tensor, n: int) -> torch.Tensor:
        diff = _extra_dims(t, e, "expand_with_ignore_as")
        t = t.reshape(tuple(t.shape[:n]) + (1,) * diff + tuple(t.shape[n:]))  # right-aligned events
        if isinstance(ignore_dim, str):
            dim = merge_layouts([layout_of(tensor), layout_of(expand_as)]).index(ignore_dim)
        else:
            dim = ignore_dim
        if not -e.dim() <= dim < e.dim():
            raise IndexError(
                f"expand_with_ignore_as: ignore_dim={ignore_dim} is out of range for a tensor of shape "
                f"{tuple(e.shape)}."
            )
        shape = list(e.shape)
        shape[dim] = t.shape[dim]
        return t.expand(shape)

    return _on_events(fn, tensor, expand_as)
