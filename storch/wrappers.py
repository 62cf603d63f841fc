"""Wrappers that run ordinary functions on plated tensors.

* `storch.wrappers.deterministic` — align the storch arguments, optionally expand or flatten the
  plates and name plate dimensions for ``dim``/``dims`` arguments, run the function on plain
  tensors, and give the outputs the plates back.
* `storch.wrappers.reduce` — the same for functions that reduce some plates away.
* `storch.wrappers.make_left_broadcastable` — for functions that accept exactly one batch dimension,
  such as ``nn.Conv2d`` on ``(N, C, H, W)`` or ``nn.LSTMCell`` on ``(N, F)`` with an ``(h, c)``
  state: the plates (and, with ``batch_dims``, the leading non-plate dimensions) are flattened into
  that batch dimension. Given an ``nn.Module`` it returns one, a `storch.wrappers.LeftBroadcastable`
  that holds the module (its parameters stay registered in the model it is assigned to).
* `storch.wrappers.stochastic` — check that a user function that samples returns storch tensors.
* `storch.wrappers.ignore_wrapping` — a block in which the wrappers above return their function's
  plain outputs; `storch.wrappers.is_iterable` — whether a value is a container (the manual's
  helper).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterable, Iterator
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

from storch._dispatch import align_tensor, expand_plain, no_dispatch, plate_dimension_error, relabels, union_of_layouts
from storch.exceptions import IllegalStorchExposeError
from storch.plate import EMPTY_LAYOUT, PlateLayout
from storch.tensor import Tensor, layout_of, wrap_new

__all__ = [
    "deterministic", "reduce", "make_left_broadcastable", "LeftBroadcastable", "stochastic", "ignore_wrapping",
    "is_iterable",
]

#: how many `storch.wrappers.ignore_wrapping` blocks are open (per thread / asyncio task)
_IGNORE_WRAPPING: contextvars.ContextVar[int] = contextvars.ContextVar("storch_ignore_wrapping", default=0)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """Apply ``fn`` to the tensors in ``value``, looking into lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return value


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, in the order in which ``_map`` visits them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


def _is_plated(t: torch.Tensor) -> bool:
    """Whether ``t`` is a storch tensor with at least one plate."""
    return isinstance(t, Tensor) and bool(t._layout.plates)


def _name(fn: Callable) -> Any:
    """How error messages name ``fn``."""
    return getattr(fn, "__name__", fn)


def _collect_layouts(args: tuple, kwargs: dict) -> PlateLayout:
    """The union of the plates of the storch tensors among the arguments."""
    layouts = [t._layout for t in _tensors_in((args, kwargs)) if _is_plated(t)]
    return union_of_layouts(layouts) if layouts else EMPTY_LAYOUT


class _PlateKeywords(NamedTuple):
    """The plates a wrapped function is told about by name, fixed when it is wrapped.

    Attributes:
        dim: a plate whose dimension index is passed as the function's ``dim`` keyword.
        dims: plates whose dimension indices are passed as the function's ``dims`` keyword.
        removed: plates the function reduces away; its outputs lack them.
    """

    dim: str | None = None
    dims: Sequence[str] | None = None
    removed: Sequence[str] = ()


class _Flattened(NamedTuple):
    """Arguments with their plates flattened into one first dimension, and what undoing that needs.

    Attributes:
        args: the positional arguments to call with.
        kwargs: the keyword arguments to call with.
        batch: the batch dimensions flattened together with the plates (``()`` for none).
    """

    args: tuple
    kwargs: dict
    batch: tuple[int, ...]


# ------------------------------------------------------------------------------------------ step 1: align


def _fresh_view(t: torch.Tensor) -> torch.Tensor:
    """A new view of a storch tensor, so the caller's own is never handed out (or retyped later);
    other tensors as they are. Must run with torch functions disabled."""
    return t.view_as(t) if isinstance(t, Tensor) else t


def _align(t: torch.Tensor, union: PlateLayout, expand: bool, unwrap: bool) -> torch.Tensor:
    """One argument laid out for the plates ``union``.

    A plated storch tensor gets a dimension for every plate of ``union`` (size 1 where it lacks the
    plate, unless ``expand``) and is returned as a plain view, or as a storch tensor on ``union``
    when not ``unwrap``. Other tensors are passed as they are (a storch tensor without plates as a
    fresh view).
    """
    plated = _is_plated(t)
    with no_dispatch():
        if plated:
            t = align_tensor(t, union, expand=expand)
        t = _fresh_view(t)
    return wrap_new(t, union) if plated and not unwrap else t


# ---------------------------------------------------------------------------------------- step 2: flatten


def _flatten_plates(t: torch.Tensor, union: PlateLayout) -> torch.Tensor:
    """One argument expanded over every plate of ``union`` (plain tensors too), with those plates
    flattened into one first dimension: ``(*plate sizes, *rest)`` -> ``(prod(plate sizes), *rest)``."""
    with no_dispatch():
        t = align_tensor(t, union, expand=True) if _is_plated(t) else expand_plain(t, union)
        return t.reshape((math.prod(union.sizes),) + tuple(t.shape[len(union.sizes):]))


def _batch_error(fn: Callable, t: torch.Tensor, union: PlateLayout, batch_dims: int, batch: tuple | None) -> ValueError:
    """The error for a flattened argument ``t`` without the batch shape ``batch`` of the arguments before it."""
    earlier = f", but an earlier argument had batch shape {batch}." if batch is not None else "."
    return ValueError(
        f"{_name(fn)}: with batch_dims={batch_dims} every tensor argument needs the same {batch_dims} batch "
        f"dimension(s) after its plates {list(union.names)}; got shape {tuple(t.shape[1:])} after the plates"
        + earlier
    )


def _batch_shape(fn: Callable, tensors: Iterable[torch.Tensor], union: PlateLayout, batch_dims: int) -> tuple:
    """The ``batch_dims`` dimensions after the flattened plates, which every tensor must share.

    Returns ``()`` if there are no tensors.

    Raises:
        ValueError: if a tensor has too few dimensions or another batch shape than the ones before it.
    """
    batch = None
    with no_dispatch():
        for t in tensors:
            shape = tuple(t.shape[1:1 + batch_dims])
            if t.dim() < 1 + batch_dims or (batch is not None and shape != batch):
                raise _batch_error(fn, t, union, batch_dims, batch)
            batch = shape if batch is None else batch
    return () if batch is None else batch


def _merge_batch(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """``(flat, *batch, *rest)`` -> ``(flat·prod(batch), *rest)``."""
    with no_dispatch():
        return t.reshape((t.shape[0] * math.prod(batch),) + tuple(t.shape[1 + len(batch):]))


def _flatten_arguments(fn: Callable, args: tuple, kwargs: dict, union: PlateLayout, batch_dims: int) -> _Flattened:
    """The arguments with the plates of ``union`` (then ``batch_dims`` batch dimensions) flattened into
    one first dimension, as plain tensors."""
    args, kwargs = _map(functools.partial(_flatten_plates, union=union), (args, kwargs))
    batch = _batch_shape(fn, _tensors_in((args, kwargs)), union, batch_dims) if batch_dims else ()
    if batch_dims:
        args, kwargs = _map(functools.partial(_merge_batch, batch=batch), (args, kwargs))
    return _Flattened(args, kwargs, batch)


# ------------------------------------------------------------------------------------------- step 3: call


def _with_plate_keywords(kwargs: dict, union: PlateLayout, keywords: _PlateKeywords) -> dict:
    """``kwargs`` with the plates named in ``keywords.dim``/``keywords.dims`` as their dimension indices."""
    if keywords.dim is not None:
        kwargs = {**kwargs, "dim": union.index(keywords.dim)}
    if keywords.dims is not None:
        kwargs = {**kwargs, "dims": [union.index(d) for d in keywords.dims]}
    return kwargs


def _invoke(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with storch's torch function disabled."""
    with no_dispatch():
        return fn(*args, **kwargs)


# -------------------------------------------------------------------------------- step 4: restore, check


def _unflatten(t: torch.Tensor, fn: Callable, union: PlateLayout, batch: tuple[int, ...]) -> torch.Tensor:
    """An output ``(flat·prod(batch), *rest)`` back to ``(*plate sizes, *batch, *rest)``.

    Raises:
        ValueError: if ``fn`` did not keep the flattened first dimension.
    """
    lead = math.prod(union.sizes) * math.prod(batch)
    if t.dim() == 0 or t.shape[0] != lead:
        merged = f" and the batch dimensions {batch}" if batch else ""
        raise ValueError(
            f"{_name(fn)} returned shape {tuple(t.shape)} after the plates {list(union.names)}{merged} were "
            f"flattened into a first dimension of size {lead}; it must keep that dimension."
        )
    with no_dispatch():
        return t.reshape(union.sizes + batch + tuple(t.shape[1:]))


def _output_layout(union: PlateLayout, removed: Sequence[str]) -> PlateLayout:
    """The plates of the outputs: those of the arguments less the ``removed`` ones."""
    return union.without([union.plates[union.index(r)] for r in removed]) if removed else union


def _restore_plates(t: torch.Tensor, fn: Callable, layout: PlateLayout) -> Tensor:
    """An output of ``fn`` as a storch tensor on the plates ``layout``, which lead its dimensions.

    Raises:
        ValueError: if the first dimensions of ``t`` are not the plates of ``layout``.
    """
    if type(t) is not torch.Tensor:
        with no_dispatch():
            t = t.view_as(t)
    sizes = layout.sizes
    if sizes and tuple(t.shape[: len(sizes)]) != sizes:
        raise plate_dimension_error(fn, t.shape, layout)
    return wrap_new(t, layout)


# ----------------------------------------------------------------------------------------- the two calls


def _call_aligned(
    fn: Callable, args: tuple, kwargs: dict, keywords: _PlateKeywords, expand: bool, unwrap: bool
) -> Any:
    """Call ``fn`` on arguments aligned to their union of plates, and give its outputs the plates back.

    Args:
        fn: the function.
        args: its positional arguments.
        kwargs: its keyword arguments.
        keywords: the plates passed to ``fn`` by name, and those it removes.
        expand: expand the storch arguments to the full size of every plate.
        unwrap: pass plain tensors instead of storch tensors.
    """
    if not kwargs and keywords.dim is None and keywords.dims is None and _tensors_only(args):
        return _call_aligned_tensors(fn, args, keywords.removed, expand, unwrap)
    union = _collect_layouts(args, kwargs)
    args, kwargs = _map(functools.partial(_align, union=union, expand=expand, unwrap=unwrap), (args, kwargs))
    out = _invoke(fn, args, _with_plate_keywords(kwargs, union, keywords))
    if _IGNORE_WRAPPING.get():
        return out  # ignore_wrapping(): the function's own outputs, plates not given back
    return _map(functools.partial(_restore_plates, fn=fn, layout=_output_layout(union, keywords.removed)), out)


def _tensors_only(args: tuple) -> bool:
    """Whether every argument is a tensor (an environment's step on an action, a model on a sample)."""
    for a in args:
        if not isinstance(a, torch.Tensor):
            return False
    return True


def _call_aligned_tensors(
    fn: Callable, args: tuple, removed: Sequence[str], expand: bool, unwrap: bool
) -> Any:
    """`_call_aligned` for tensor arguments without keywords, without its walks through nested arguments
    (called at every step of a rollout whose environment is wrapped in `storch.wrappers.deterministic`)."""
    layouts = [a._layout for a in args if _is_plated(a)]
    union = union_of_layouts(layouts) if layouts else EMPTY_LAYOUT
    out = _invoke(fn, tuple(_align(a, union, expand, unwrap) for a in args), {})
    if _IGNORE_WRAPPING.get():
        return out  # ignore_wrapping(): the function's own outputs, plates not given back
    layout = _output_layout(union, removed)
    if type(out) is torch.Tensor:
        return _restore_plates(out, fn, layout)
    if type(out) is tuple and all(type(o) is torch.Tensor for o in out):  # e.g. (observation, reward)
        return tuple(_restore_plates(o, fn, layout) for o in out)
    return _map(functools.partial(_restore_plates, fn=fn, layout=layout), out)


def _call_flattened(fn: Callable, args: tuple, kwargs: dict, keywords: _PlateKeywords, batch_dims: int) -> Any:
    """Call ``fn`` with all plates (and ``batch_dims`` batch dimensions) flattened into one first
    dimension of every argument, and give its outputs the plates back.

    Without plates this is ``_call_aligned`` with the arguments passed as they are.
    """
    union = _collect_layouts(args, kwargs)
    if not union.sizes:
        return _call_aligned(fn, args, kwargs, keywords, expand=True, unwrap=True)
    flat = _flatten_arguments(fn, args, kwargs, union, batch_dims)
    out = _invoke(fn, flat.args, _with_plate_keywords(flat.kwargs, union, keywords))
    if _IGNORE_WRAPPING.get():
        return out  # ignore_wrapping(): the function's own outputs, still flattened
    out = _map(functools.partial(_unflatten, fn=fn, union=union, batch=flat.batch), out)
    return _map(functools.partial(_restore_plates, fn=fn, layout=_output_layout(union, keywords.removed)), out)


def deterministic(
    fn: Callable | None = None,
    *,
    unwrap: bool = True,
    expand_plates: bool = False,
    flatten_plates: bool = False,
    dim: str | None = None,
    dims: Sequence[str] | None = None,
) -> Callable:
    """Run ``fn`` on plate-aligned plain tensors and give its outputs the plates back.

    Args:
        fn: the function; without it, a decorator is returned.
        unwrap: pass plain ``torch.Tensor`` views (default) instead of storch tensors.
        expand_plates: expand every argument to the full size of every plate (instead of size-1
            dimensions for plates it lacks).
        flatten_plates: flatten all plate dimensions into one first dimension (implies
            ``expand_plates``); the outputs are unflattened.
        dim: a plate name passed to ``fn`` as its ``dim`` keyword (the plate's dimension index).
        dims: plate names passed to ``fn`` as its ``dims`` keyword.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([[1., 2.], [3., 4.]]), 0, "data")
        >>> softmax_over_data = storch.deterministic(torch.softmax, dim="data")
        >>> softmax_over_data(x).plates[0].name
        'data'
    """
    if fn is None:
        return functools.partial(
            deterministic, unwrap=unwrap, expand_plates=expand_plates, flatten_plates=flatten_plates,
            dim=dim, dims=dims,
        )

    keywords = _PlateKeywords(dim, dims)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if flatten_plates:
            return _call_flattened(fn, args, kwargs, keywords, batch_dims=0)
        return _call_aligned(fn, args, kwargs, keywords, expand=expand_plates, unwrap=unwrap)

    return wrapper


def reduce(fn: Callable, plates: str | Sequence[str]) -> Callable:
    """Like `storch.wrappers.deterministic`, for a function that reduces the plates named in
    ``plates``.

    The plate's dimension index is passed as ``fn``'s ``dim`` keyword (``dims`` for several).

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([[1., 2.], [3., 4.]]), 0, "data")
        >>> storch.reduce(torch.logsumexp, "data")(x).plates
        []
    """
    names = [plates] if isinstance(plates, str) else list(plates)
    keywords = _PlateKeywords(names[0] if len(names) == 1 else None, names if len(names) > 1 else None, names)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _call_aligned(fn, args, kwargs, keywords, expand=False, unwrap=True)

    return wrapper


def _left_broadcast(fn: Callable, args: tuple, kwargs: dict, batch_dims: int) -> Any:
    """Call ``fn`` with the plates (and ``batch_dims`` batch dimensions) flattened into one first
    dimension, and give its outputs the plates back."""
    if not kwargs and not batch_dims and _plated_tensors_only(args):
        return _call_flattened_tensors(fn, args)
    return _call_flattened(fn, args, kwargs, _PlateKeywords(), batch_dims)


def _plated_tensors_only(args: tuple) -> bool:
    """Whether every argument is a tensor and one at least has plates (a recurrent cell's step)."""
    plated = False
    for a in args:
        if not isinstance(a, torch.Tensor):
            return False
        plated = plated or _is_plated(a)
    return plated


def _call_flattened_tensors(fn: Callable, args: tuple) -> Any:
    """`_call_flattened` for tensor arguments only, without its walk through nested arguments (called
    once per decision by a policy's cell: the walk was a third of the wrapper's cost)."""
    plated = [_is_plated(a) for a in args]
    union = union_of_layouts([a._layout for a, p in zip(args, plated) if p])
    sizes = union.sizes
    n, lead = len(sizes), math.prod(sizes)
    with no_dispatch():  # `_flatten_plates` of each argument and `_invoke`, in one block
        flat = []
        for a, p in zip(args, plated):
            base = _flat_base(a, union, lead) if p else None
            if base is not None:  # a recurrent state, this wrapper's own output: its flat tensor, no new view
                flat.append(base)
                continue
            t = align_tensor(a, union, expand=True) if p else expand_plain(a, union)
            flat.append(t.reshape((lead,) + t.shape[n:]))
        out = fn(*flat)
        if _IGNORE_WRAPPING.get():
            return out  # ignore_wrapping(): the function's own outputs, still flattened
        if type(out) is torch.Tensor and out.dim() > 0 and out.shape[0] == lead:  # `_unflatten`, `_restore_plates`
            return wrap_new(out.reshape(sizes + out.shape[1:]), union)
    if type(out) is torch.Tensor:
        return _restore_plates(_unflatten(out, fn, union, ()), fn, union)
    out = _map(functools.partial(_unflatten, fn=fn, union=union, batch=()), out)
    return _map(functools.partial(_restore_plates, fn=fn, layout=union), out)


def _flat_base(t: torch.Tensor, union: PlateLayout, lead: int) -> torch.Tensor | None:
    """The tensor that ``t`` views with its plates flattened into one first dimension of size ``lead``,
    where ``t`` is laid out as ``union`` (up to an older chain step, which sits at the same place) and
    views a contiguous tensor of exactly that flattened shape, at the same memory, in its autograd graph:
    the output of an earlier call of the wrapper (a recurrent cell's state, which
    `_call_flattened_tensors` returns reshaped) is one. Passing that tensor instead of flattening ``t``
    again gives the function the same values and the same gradients, without a view and its autograd
    node per call. ``None`` otherwise. Call with torch functions disabled."""
    base = t._base
    if base is None or type(base) is not torch.Tensor:
        return None
    n = len(union.sizes)
    if base.dim() != t.dim() - n + 1 or base.shape[0] != lead or base.shape[1:] != t.shape[n:]:
        return None
    src = t._layout
    if not (src is union or src.plates == union.plates or relabels(src, union)):
        return None
    if t.data_ptr() != base.data_ptr() or not (t.is_contiguous() and base.is_contiguous()):
        return None
    grad_fn = t.grad_fn
    if grad_fn is None:  # no graph: the same values are all that counts, unless the base has a graph
        return None if base.requires_grad else base
    base_fn = base.grad_fn
    return base if base_fn is not None and grad_fn.next_functions[0][0] is base_fn else None


class LeftBroadcastable(nn.Module):
    """An ``nn.Module`` run on plated inputs: what
    `storch.wrappers.make_left_broadcastable` returns for a module.

    It holds the wrapped module as its submodule ``module``, so assigned as an attribute of a model
    (``self.cell = storch.make_left_broadcastable(nn.GRUCell(4, 8))``) its parameters are the
    model's: ``model.parameters()`` lists them, an optimizer trains them, and ``.to()``,
    ``.double()``, ``copy.deepcopy`` and pickling treat them as any submodule's.

    State dict keys are the wrapped module's under the prefix ``module.`` (as
    ``nn.parallel.DistributedDataParallel`` does): ``module.weight_ih``, ... A checkpoint of the
    bare module loads with ``wrapper.module.load_state_dict(state)``, and ``wrapper.module`` is the
    module itself. Attributes the wrapper does not have are read from the wrapped module
    (``wrapper.hidden_size``).

    Args:
        module: the module; it must accept exactly one batch dimension (see
            `storch.wrappers.make_left_broadcastable`).
        batch_dims: as for `storch.wrappers.make_left_broadcastable`.

    Examples:
        >>> import torch, storch
        >>> class Policy(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.cell = storch.make_left_broadcastable(torch.nn.GRUCell(4, 8), batch_dims=1)
        >>> policy = Policy()
        >>> [name for name, _ in policy.named_parameters()]
        ['cell.module.weight_ih', 'cell.module.weight_hh', 'cell.module.bias_ih', 'cell.module.bias_hh']
        >>> x = storch.denote_independent(torch.randn(3, 2, 4), 0, "z")  # plate z, then (N, F)
        >>> h = policy.cell(x)                     # the GRUCell sees (3·2, 4)
        >>> h.shape, h.plate_names, policy.cell.hidden_size
        (torch.Size([3, 2, 8]), ['z'], 8)
    """

    def __init__(self, module: nn.Module, batch_dims: int = 0) -> None:
        super().__init__()
        self.module = module
        self.batch_dims = batch_dims

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's ``forward`` with the plates flattened into its batch dimension."""
        return _left_broadcast(self.module, args, kwargs, self.batch_dims)

    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and submodules first (``nn.Module``), then the wrapped module's attributes."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module" or name.startswith("__"):
                raise
            return getattr(super().__getattr__("module"), name)

    def extra_repr(self) -> str:
        return f"batch_dims={self.batch_dims}" if self.batch_dims else ""


def make_left_broadcastable(fn: Callable | None = None, *, batch_dims: int = 0) -> Callable:
    """Wrap a function that takes exactly one batch dimension, e.g. ``nn.Conv2d`` on ``(N, C, H, W)``.

    All plates are flattened into the first dimension before the call and restored afterwards, so a
    ``(Z, N, C, H, W)`` input with plates ``z`` and ``data`` reaches the convolution as
    ``(Z·N, C, H, W)``. Plain tensor arguments are expanded over the plates first; tensors inside
    tuples, lists and dicts (an ``(h, c)`` state) are handled too, and so are tuple outputs.

    Given an ``nn.Module``, it returns an ``nn.Module``: a
    `storch.wrappers.LeftBroadcastable` that holds the module, so that a model
    which assigns it (``self.cell = storch.make_left_broadcastable(nn.GRUCell(4, 8))``) registers,
    trains, moves and saves the module's parameters (state dict keys under the prefix ``module.``).
    Given a function, it returns a function.

    Args:
        fn: the function or module; without it, a decorator is returned.
        batch_dims: how many non-plate dimensions after the plates are batch dimensions of ``fn``
            too, flattened together with the plates (``0``: none, the plates are the batch). With
            ``batch_dims=1`` a ``(Z, N, F)`` input on plate ``z`` reaches ``fn`` as ``(Z·N, F)``;
            every tensor argument must then have the same ``N`` after its plates (a plain ``(N, H)``
            state is expanded over the plates).

    Examples:
        >>> import torch, storch
        >>> conv = storch.make_left_broadcastable(torch.nn.Conv2d(1, 2, 3))
        >>> x = storch.denote_independent(torch.randn(4, 1, 8, 8), 0, "data")
        >>> conv(x).shape
        torch.Size([4, 2, 6, 6])
        >>> isinstance(conv, torch.nn.Module), len(list(conv.parameters()))
        (True, 2)

        A recurrent cell on samples of a minibatch: ``nn.LSTMCell`` itself accepts only ``(N, F)``
        inputs, wrapped it takes the sample plate in front.

        >>> from torch.distributions import Normal
        >>> cell = storch.make_left_broadcastable(torch.nn.LSTMCell(3, 5), batch_dims=1)
        >>> x = storch.method.Reparameterization("z", n_samples=4)(Normal(torch.zeros(2, 3), 1.0))
        >>> h, c = cell(x, (torch.zeros(2, 5), torch.zeros(2, 5)))   # x: (4, 2, 3) on plate z
        >>> h.shape, [p.name for p in h.plates], c.shape
        (torch.Size([4, 2, 5]), ['z'], torch.Size([4, 2, 5]))
    """
    if isinstance(batch_dims, bool) or not isinstance(batch_dims, int) or batch_dims < 0:
        raise ValueError(f"make_left_broadcastable: batch_dims must be an int >= 0, got {batch_dims!r}.")
    if fn is None:
        return functools.partial(make_left_broadcastable, batch_dims=batch_dims)
    if isinstance(fn, nn.Module):
        return LeftBroadcastable(fn, batch_dims)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _left_broadcast(fn, args, kwargs, batch_dims)

    return wrapper


def stochastic(fn: Callable) -> Callable:
    """Mark ``fn`` as a function that samples: it must return storch tensors that keep the plates of
    its storch inputs (for example the output of a `storch.method.Method`).

    Raises:
        IllegalStorchExposeError: if a tensor output is a plain ``torch.Tensor`` or lost an input plate.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> @storch.stochastic
        ... def noisy(mu):
        ...     return storch.method.Reparameterization("eps", n_samples=2)(Normal(mu, 1.0))
        >>> x = storch.denote_independent(torch.zeros(3), 0, "data")
        >>> [p.name for p in noisy(x).plates]
        ['eps', 'data']
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        union = _collect_layouts(args, kwargs)
        return _map(functools.partial(_check_sampled, fn=fn, union=union), fn(*args, **kwargs))

    return wrapper


def _check_sampled(t: torch.Tensor, fn: Callable, union: PlateLayout) -> torch.Tensor:
    """An output ``t`` of the `storch.wrappers.stochastic` function ``fn``, checked to be a
    storch tensor on every plate of its inputs' ``union``.

    Raises:
        IllegalStorchExposeError: if ``t`` is a plain ``torch.Tensor`` or lost an input plate.
    """
    if not isinstance(t, Tensor):
        raise IllegalStorchExposeError(
            f"{_name(fn)} is marked @storch.stochastic but returned a plain torch.Tensor of shape "
            f"{tuple(t.shape)}; return storch tensors (sample with a storch.method.Method)."
        )
    lost = [p.name for p in union.plates if not any(p == q for q in layout_of(t).plates)]
    if lost:
        raise IllegalStorchExposeError(f"{_name(fn)} returned a tensor without the input plates {lost}.")
    return t


@contextlib.contextmanager
def ignore_wrapping() -> Iterator[None]:
    """A block in which the storch wrappers return their function's outputs as they are.

    Inside ``with storch.wrappers.ignore_wrapping():`` a function wrapped by
    `storch.wrappers.deterministic`,
    `storch.wrappers.reduce` or `storch.wrappers.make_left_broadcastable` still
    receives its arguments aligned (and
    expanded or flattened) over their plates, but its outputs are returned unchanged: plain
    ``torch.Tensor`` objects without plates (with ``flatten_plates``, still flattened). This is the
    manual's (Storchastic 0.3.7's) ``ignore_wrapping``, which sampling methods use to compute on
    aligned tensors without creating storch tensors. Blocks nest, and each thread and asyncio
    task has its own. Torch operations applied directly to storch tensors are not affected: they
    return storch tensors as always (unwrap one with `storch.tensor.plain`).

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0, "data")
        >>> double = storch.deterministic(lambda t: 2 * t)
        >>> type(double(x)).__name__
        'Tensor'
        >>> with ignore_wrapping():
        ...     out = double(x)
        >>> type(out) is torch.Tensor, out.tolist()
        (True, [[2.0, 4.0], [6.0, 8.0]])
    """
    token = _IGNORE_WRAPPING.set(_IGNORE_WRAPPING.get() + 1)
    try:
        yield
    finally:
        _IGNORE_WRAPPING.reset(token)


def is_iterable(a: Any) -> bool:
    """Whether ``a`` is a container whose elements the wrappers look into (the manual's helper).

    True for iterables (lists, tuples, dicts, sets, generators, ...) except tensors (plain or
    storch), strings and torch storages, as in Storchastic 0.3.7, and bytes.

    Examples:
        >>> import torch
        >>> is_iterable([1, 2]), is_iterable((torch.zeros(2),)), is_iterable({"a": 1})
        (True, True, True)
        >>> is_iterable(torch.zeros(2)), is_iterable("ab"), is_iterable(3)
        (False, False, False)
    """
    return (
        isinstance(a, Iterable)
        and not isinstance(a, (torch.Tensor, str, bytes, bytearray))
        and not isinstance(a, (torch.TypedStorage, torch.UntypedStorage))
    )
