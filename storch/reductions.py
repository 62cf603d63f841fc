"""Creating and reducing plates.

* `storch.reductions.denote_independent` and `storch.reductions.gather_samples` create independent
  plates;
* `storch.reductions.reduce_plates` and `storch.reductions.variance` reduce plates *with their
  weights* (use these for estimates);
* `storch.reductions.sum`, `storch.reductions.mean` and `storch.reductions.logsumexp` reduce named
  dimensions *without* weights.

Reducing a plate with a plain torch reduction (``t.mean(0)``) is an error, because it silently
discards the per-sample values the gradient estimators need.

Plates are given *by name* (or as `storch.plate.Plate` objects); ``int`` dimensions follow
the rule of `storch.ops` for every dimension argument: they count the tensor's
``shape``, plates first, must fall on one of a sample's dimensions (an ``int`` on a plate is an
error that names it: give the plate's name instead), and count from the right when negative.
``denote_independent``'s ``dim`` counts the same way.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from storch import _tracing
from storch._dispatch import align_tensor, expand_plain
from storch.ops import event_dim
from storch.plate import Plate, layout_of_plates, merge_layouts, uniform_weight
from storch.tensor import IndependentTensor, Tensor, _Disable, layout_of, wrap, wrap_new

__all__ = [
    "denote_independent", "gather_samples", "reduce_plates", "variance", "sum", "mean", "logsumexp",
    "PlateRef",
]

PlateRef = Union[str, Plate, int]


def denote_independent(tensor: torch.Tensor, dim: int, plate_name: str) -> IndependentTensor:
    """Declare dimension ``dim`` of ``tensor`` a plate of independent values (e.g. a minibatch).

    The dimension moves to the left of the event dimensions and becomes the newest plate; its
    weight is ``1/size``, so `storch.reductions.reduce_plates` averages over it.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.zeros(5, 784), 0, "data")
        >>> type(x).__name__, x.plates, tuple(x.shape)
        ('IndependentTensor', [('data', 5, tensor(0.2000))], (5, 784))
    """
    layout = layout_of(tensor)
    n_plates = len(layout.plates)
    ndim = tensor.dim()
    if not -ndim <= dim < ndim:
        raise IndexError(f"denote_independent: dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}.")
    dim = dim % ndim
    if dim < n_plates:
        raise ValueError(
            f"denote_independent: dim {dim} of a tensor of shape {tuple(tensor.shape)} is already plate "
            f"{layout.names[dim]!r}; choose an event dimension (>= {n_plates})."
        )
    if plate_name in layout.names:
        raise ValueError(f"denote_independent: the tensor already has a plate named {plate_name!r}.")
    plate = Plate(plate_name, tensor.shape[dim])
    with _Disable():
        moved = torch.movedim(tensor, dim, 0)
    layout = layout_of_plates((plate,) + layout.plates)
    if moved is tensor:  # (torch makes a new view even for dim 0; the caller's object is never retyped)
        return wrap(moved, layout, IndependentTensor)  # type: ignore[return-value]
    return wrap_new(moved, layout, IndependentTensor)  # type: ignore[return-value]


def gather_samples(
    samples: Sequence[torch.Tensor], plate_name: str, weight: torch.Tensor | None = None
) -> IndependentTensor:
    """Stack independent samples of a value into a new plate ``plate_name``.

    Plates of the samples are aligned first. The new plate has weight ``1/len(samples)`` unless
    ``weight`` is given.

    Examples:
        >>> import torch, storch
        >>> g = storch.gather_samples([torch.tensor(1.0), torch.tensor(3.0)], "gradients")
        >>> g.plates, storch.reduce_plates(g, "gradients").item()
        ([('gradients', 2, tensor(0.5000))], 2.0)
    """
    if not samples:
        raise ValueError("gather_samples needs at least one sample.")
    tensors = [s if isinstance(s, torch.Tensor) else torch.as_tensor(s) for s in samples]
    layouts = [layout_of(t) for t in tensors]
    union = merge_layouts(layouts)
    plate = Plate(plate_name, len(tensors), _sample_weights(weight, len(tensors), plate_name))
    with _Disable():
        if union.plates:
            tensors = [
                align_tensor(t, union, expand=True) if lay.plates else expand_plain(t, union)
                for t, lay in zip(tensors, layouts)
            ]
        stacked = torch.stack(tensors, 0)
    return wrap_new(stacked, layout_of_plates((plate,) + union.plates), IndependentTensor)  # type: ignore[return-value]


def _sample_weights(weight: object, n: int, plate_name: str) -> torch.Tensor | None:
    """``gather_samples``' weight as a scalar or a vector of ``n`` weights (``None``: ``1/n``)."""
    if weight is None:
        return None
    try:
        w = torch.as_tensor(weight, dtype=torch.get_default_dtype())
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"gather_samples({plate_name!r}): weight must be a number, a sequence or a tensor of "
            f"{n} weights, got {type(weight).__name__}: {error}"
        ) from None
    if w.dim() > 1 or (w.dim() == 1 and w.shape[0] != n):
        raise ValueError(
            f"gather_samples({plate_name!r}): weight must be a scalar or hold one weight per sample "
            f"({n}), got shape {tuple(w.shape)}."
        )
    return w


def _resolve(tensor: torch.Tensor, ref: PlateRef, who: str) -> tuple[int, Plate | None]:
    """The dimension index (and plate, if any) a plate name or Plate refers to, or the position of
    an ``int`` dimension, which must be one of a sample's dimensions."""
    layout = layout_of(tensor)
    if isinstance(ref, int) and not isinstance(ref, bool):
        return event_dim(ref, tensor.dim(), layout, who, tuple(tensor.shape)), None
    idx = layout.index(ref)
    return idx, layout.plates[idx]


def _reduce_dims(tensor: torch.Tensor, dims: PlateRef | Sequence[PlateRef], op: str) -> torch.Tensor:
    refs = [dims] if isinstance(dims, (str, Plate, int)) else list(dims)
    layout = layout_of(tensor)
    resolved = [_resolve(tensor, r, f"storch.{op}") for r in refs]
    idx = sorted({d for d, _ in resolved})
    removed = [p for _, p in resolved if p is not None]
    new_layout = layout.without(removed) if removed else layout
    with _Disable():
        if op == "sum":
            out = torch.sum(tensor, dim=idx)
        elif op == "mean":
            out = torch.mean(tensor, dim=idx)
        else:
            out = torch.logsumexp(tensor, dim=idx)
    if not isinstance(tensor, Tensor):
        return out
    return wrap_new(out, new_layout)


def sum(tensor: torch.Tensor, dims: PlateRef | Sequence[PlateRef]) -> torch.Tensor:  # noqa: A001
    """Sum over plates (by name or `storch.reductions.Plate`) and/or dimensions, ignoring plate weights.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.arange(6.).reshape(3, 2), 0, "data")
        >>> storch.sum(x, "data").tolist()
        [6.0, 9.0]
    """
    return _reduce_dims(tensor, dims, "sum")


def mean(tensor: torch.Tensor, dims: PlateRef | Sequence[PlateRef]) -> torch.Tensor:
    """Unweighted mean over plates and/or dimensions. For estimates use
    `storch.reductions.reduce_plates`.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.arange(6.).reshape(3, 2), 0, "data")
        >>> storch.mean(x, ["data", -1]).item()
        2.5
    """
    return _reduce_dims(tensor, dims, "mean")


def logsumexp(tensor: torch.Tensor, dims: PlateRef | Sequence[PlateRef]) -> torch.Tensor:
    """``log Σ exp`` over plates and/or dimensions (e.g. importance-weighted bounds).

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.zeros(4), 0, "k")
        >>> round(storch.logsumexp(x, "k").item(), 4)   # log 4
        1.3863
    """
    return _reduce_dims(tensor, dims, "logsumexp")


def plate_weight(plate: Plate, detach: bool) -> torch.Tensor | None:
    """The weight tensor of a plate, or ``None`` if it is the uniform ``1/size``."""
    w = plate.weight
    if w is uniform_weight(plate.size):  # identity check: no device sync to read the value
        return None
    if isinstance(w, torch.Tensor) and detach:
        w = w.detach()
    if type(w) is torch.Tensor and w.dim() == 1:  # one weight per sample of this plate
        if w.shape[0] != plate.size:
            raise ValueError(
                f"Plate {plate.name!r} of size {plate.size} has a weight vector of size {w.shape[0]}."
            )
        w = wrap(w, layout_of_plates((plate,)))
    return w  # type: ignore[return-value]


def reduce_plate(tensor: Tensor, plate: Plate, detach_weights: bool = True) -> torch.Tensor:
    """Weighted sum of ``tensor`` over one plate: ``Σ_i w_i t_i`` (a mean for uniform weights).

    A value of weight zero does not enter the sum even when it is infinite or NaN (an enumerated
    value of probability 0 whose cost is ``inf``): ``0 · ∞`` would poison the sum. Finite values of
    weight zero stay in, so the derivative with respect to their weight is kept.
    """
    vector = plate.weight_vector()
    if vector is not None:
        return _reduce_by_vector(tensor, plate, vector.detach() if detach_weights else vector)
    w = plate_weight(plate, detach_weights)
    if w is None:
        return _reduce_one(tensor, plate, torch.mean)
    ignored = (w == 0) & ~torch.isfinite(tensor)
    weighted = torch.where(ignored, torch.zeros((), dtype=tensor.dtype, device=tensor.device), tensor) * w
    return _reduce_one(weighted, plate, torch.sum)


def _reduce_by_vector(tensor: Tensor, plate: Plate, w: torch.Tensor) -> Tensor:
    """`storch.reductions.reduce_plate` for a plain weight vector, one weight per sample of ``plate``
    (groups of
    ARM, DisARM, LocalExpectation, MVD; importance weights): the same arithmetic on the plain
    values, with ``w`` laid along the plate's dimension, instead of six aligned operations."""
    layout = tensor._layout
    i = layout.position(plate)
    with _Disable():
        w = w.reshape((plate.size,) + (1,) * (tensor.dim() - i - 1))
        # read on the host (no device sync); a traced step (storch.compile_step) must not branch on it
        if w.is_cpu and not _tracing.active() and _no_zero(w):
            weighted = tensor * w  # no weight of zero, so nothing to leave out
        else:
            ignored = (w == 0) & ~torch.isfinite(tensor)
            weighted = torch.where(ignored, torch.zeros((), dtype=tensor.dtype, device=tensor.device), tensor) * w
        out = weighted.sum(i)
    return wrap_new(out, layout.without_position(i))


def _no_zero(w: torch.Tensor) -> bool:
    """Whether the CPU vector ``w`` holds no zero (``bool(w.all())``; a short one is read as a list,
    a tenth of the cost of a reduction)."""
    if w.numel() <= 64:
        return 0.0 not in w.tolist()
    return bool(w.all())


def _reduce_one(tensor: Tensor, plate: Plate, op) -> Tensor:
    """``op`` (``torch.sum`` or ``torch.mean``) over one plate of a storch tensor."""
    layout = tensor._layout
    i = layout.position(plate)
    with _Disable():
        out = op(tensor, i)
    return wrap_new(out, layout.without_position(i))


def reduce_plates(
    tensor: torch.Tensor,
    plates: PlateRef | Sequence[PlateRef] | None = None,
    detach_weights: bool = True,
) -> torch.Tensor:
    """Reduce plates by their weighted sum (the Monte Carlo / exact estimate of the mean).

    Args:
        tensor: the tensor to reduce.
        plates: plate names or `storch.reductions.Plate` objects; ``None`` reduces all plates.
        detach_weights: detach weights that require grad (e.g. enumeration weights ``p(x)``).

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([1., 2., 6.]), 0, "data")
        >>> storch.reduce_plates(x)
        Deterministic tensor(3.) plates: []
    """
    if not isinstance(tensor, Tensor):
        if plates:
            raise ValueError(f"reduce_plates: a plain torch.Tensor has no plates, asked for {plates!r}.")
        return tensor
    layout = tensor._layout
    if plates is None:
        targets = list(layout.plates)
    else:
        refs = [plates] if isinstance(plates, (str, Plate)) else list(plates)
        targets = [layout.plates[layout.index(r)] for r in refs]  # type: ignore[arg-type]
    for plate in sorted(targets, key=lambda p: p.order, reverse=True):
        tensor = reduce_plate(tensor, plate, detach_weights)  # type: ignore[assignment]
    return tensor


def variance(
    tensor: torch.Tensor,
    variance_plate: str | Plate,
    plates: PlateRef | Sequence[PlateRef] | None = None,
    detach_weights: bool = True,
) -> torch.Tensor:
    """Sample variance of ``tensor`` along ``variance_plate``, per element.

    With uniform weights this is the unbiased sample variance (divisor ``n - 1``); with general
    weights it is the weighted second central moment. Afterwards the plates in ``plates`` are
    reduced (``None``: all remaining plates). For a vector-valued quantity, ``.sum()`` of the result
    is the total variance (the trace of the covariance).

    Examples:
        >>> import torch, storch
        >>> g = storch.gather_samples([torch.tensor(x) for x in (1., 2., 3., 4.)], "gradients")
        >>> round(storch.variance(g, "gradients").item(), 4)
        1.6667
    """
    if not isinstance(tensor, Tensor):
        raise ValueError("variance needs a storch.Tensor with the plate to compute the variance over.")
    plate = tensor._layout.plates[tensor._layout.index(variance_plate)]
    if plate.size < 2:
        raise ValueError(
            f"variance over plate {plate.name!r} needs at least 2 samples, but it has {plate.size}: "
            "the variance of a single sample cannot be estimated."
        )
    centered = tensor - reduce_plate(tensor, plate, detach_weights)
    var = reduce_plate(centered * centered, plate, detach_weights)
    if plate.has_uniform_weight and plate.size > 1:
        var = var * (plate.size / (plate.size - 1))
    if plates is None:
        return reduce_plates(var, None, detach_weights)
    return reduce_plates(var, plates, detach_weights)

