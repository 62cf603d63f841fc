"""Wrappers that run ordinary functions on plated tensors.

* [`deterministic`][storch.wrappers.deterministic] — align the storch arguments, optionally expand or flatten the
plates and
  name plate dimensions for ``dim``/``dims`` arguments, run the function on plain tensors, and give
  the outputs the plates back.
* [`reduce`][storch.wrappers.reduce] — the same for functions that reduce some plates away.
* [`make_left_broadcastable`][storch.wrappers.make_left_broadcastable] — for functions that accept exactly one batch
dimension, such as
  ``nn.Conv2d`` on ``(N, C, H, W)`` or ``nn.LSTMCell`` on ``(N, F)`` with an ``(h, c)`` state: the
  plates (and, with ``batch_dims``, the leading non-plate dimensions) are flattened into that batch
  dimension. Given an ``nn.Module`` it returns one, a
  [`LeftBroadcastable`][storch.wrappers.LeftBroadcastable] that holds the module (its parameters stay
  registered in the model it is assigned to).
* [`stochastic`][storch.wrappers.stochastic] — check that a user function that samples returns storch tensors.
* [`ignore_wrapping`][storch.wrappers.ignore_wrapping] — a block in which the wrappers above return their function's
plain
  outputs; [`is_iterable`][storch.wrappers.is_iterable] — whether a value is a container (the manual's helper).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Sequence

import torch
from torch import nn

from storch._dispatch import align_tensor, expand_plain, plate_dimension_error
from storch.exceptions import IllegalStorchExposeError
from storch.plate import EMPTY_LAYOUT, PlateLayout, merge_layouts
from storch.tensor import Tensor, _Disable, layout_of, wrap_new

__all__ = [
    "deterministic", "reduce", "make_left_broadcastable", "LeftBroadcastable", "stochastic", "ignore_wrapping",
    "is_iterable",
]

#: how many [`ignore_wrapping`][storch.wrappers.ignore_wrapping] blocks are open (per thread / asyncio task)
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


def _collect_layouts(args: tuple, kwargs: dict) -> PlateLayout:
    layouts: list[PlateLayout] = []
    _map(lambda t: layouts.append(t._layout) if isinstance(t, Tensor) and t._layout.plates else None, (args, kwargs))
    return merge_layouts(layouts) if layouts else EMPTY_LAYOUT


def _call(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    *,
    unwrap: bool,
    expand_plates: bool,
    flatten_plates: bool,
    dim: str | None,
    dims: Sequence[str] | None,
    removed: Sequence[str],
    batch_dims: int = 0,
) -> Any:
    union = _collect_layouts(args, kwargs)
    expand = expand_plates or flatten_plates
    n = len(union.sizes)
    flat = math.prod(union.sizes)
    merge_batch = flatten_plates and n > 0 and batch_dims > 0
    batch: list[tuple[int, ...]] = []  # the batch shape (first batch_dims non-plate dims) when merged

    def merge(t: torch.Tensor) -> torch.Tensor:
        """``(flat, *B, *rest)`` -> ``(flat·prod(B), *rest)``, with ``B`` the same for every tensor."""
        shape = tuple(t.shape[1 : 1 + batch_dims])
        if t.dim() < 1 + batch_dims or (batch and shape != batch[0]):
            raise ValueError(
                f"{getattr(fn, '__name__', fn)}: with batch_dims={batch_dims} every tensor argument needs the "
                f"same {batch_dims} batch dimension(s) after its plates {list(union.names)}; got shape "
                f"{tuple(t.shape[1:])} after the plates"
                + (f", but an earlier argument had batch shape {batch[0]}." if batch else ".")
            )
        if not batch:
            batch.append(shape)
        return t.reshape((flat * math.prod(shape),) + tuple(t.shape[1 + batch_dims :]))

    def prepare(t: torch.Tensor) -> torch.Tensor:
        plated = isinstance(t, Tensor) and bool(t._layout.plates)
        with _Disable():
            if plated:
                t = align_tensor(t, union, expand=expand)
            elif expand and n:
                t = expand_plain(t, union) if flatten_plates else t
            if flatten_plates and n:
                t = t.reshape((flat,) + tuple(t.shape[n:]))
                if merge_batch:
                    t = merge(t)
            if isinstance(t, Tensor):  # never hand out (or retype below) the caller's storch tensor
                t = t.view_as(t)
        if not unwrap and plated and not flatten_plates:
            return wrap_new(t, union)  # t is a fresh view here
        return t

    new_args = _map(prepare, args)
    new_kwargs = _map(prepare, kwargs)
    if dim is not None:
        new_kwargs["dim"] = union.index(dim)
    if dims is not None:
        new_kwargs["dims"] = [union.index(d) for d in dims]
    with _Disable():
        out = fn(*new_args, **new_kwargs)
    if _IGNORE_WRAPPING.get():
        return out  # ignore_wrapping(): the function's own outputs, plates not given back
    out_layout = union.without([union.plates[union.index(r)] for r in removed]) if removed else union

    def finish(t: torch.Tensor) -> torch.Tensor:
        if flatten_plates and n:
            b = batch[0] if merge_batch and batch else ()
            lead = flat * math.prod(b)
            if t.dim() == 0 or t.shape[0] != lead:
                merged = f" and the batch dimensions {b}" if b else ""
                raise ValueError(
                    f"{getattr(fn, '__name__', fn)} returned shape {tuple(t.shape)} after the plates "
                    f"{list(union.names)}{merged} were flattened into a first dimension of size {lead}; it "
                    "must keep that dimension."
                )
            with _Disable():
                t = t.reshape(union.sizes + b + tuple(t.shape[1:]))
        if type(t) is not torch.Tensor:
            with _Disable():
                t = t.view_as(t)
        sizes = out_layout.sizes
        if sizes and tuple(t.shape[: len(sizes)]) != sizes:
            raise plate_dimension_error(fn, t.shape, out_layout)
        return wrap_new(t, out_layout)

    return _map(finish, out)


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

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _call(
            fn, args, kwargs, unwrap=unwrap, expand_plates=expand_plates,
            flatten_plates=flatten_plates, dim=dim, dims=dims, removed=(),
        )

    return wrapper


def reduce(fn: Callable, plates: str | Sequence[str]) -> Callable:
    """Like [`deterministic`][storch.wrappers.deterministic], for a function that reduces the plates named in
    ``plates``.

    The plate's dimension index is passed as ``fn``'s ``dim`` keyword (``dims`` for several).

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([[1., 2.], [3., 4.]]), 0, "data")
        >>> storch.reduce(torch.logsumexp, "data")(x).plates
        []
    """
    names = [plates] if isinstance(plates, str) else list(plates)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _call(
            fn, args, kwargs, unwrap=True, expand_plates=False, flatten_plates=False,
            dim=names[0] if len(names) == 1 else None, dims=names if len(names) > 1 else None,
            removed=names,
        )

    return wrapper


def _left_broadcast(fn: Callable, args: tuple, kwargs: dict, batch_dims: int) -> Any:
    """Call ``fn`` with the plates (and ``batch_dims`` batch dimensions) flattened into one first
    dimension, and give its outputs the plates back."""
    return _call(
        fn, args, kwargs, unwrap=True, expand_plates=False, flatten_plates=True, dim=None, dims=None,
        removed=(), batch_dims=batch_dims,
    )


class LeftBroadcastable(nn.Module):
    """An ``nn.Module`` run on plated inputs: what
    [`make_left_broadcastable`][storch.wrappers.make_left_broadcastable] returns for a module.

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
            [`make_left_broadcastable`][storch.wrappers.make_left_broadcastable]).
        batch_dims: as for [`make_left_broadcastable`][storch.wrappers.make_left_broadcastable].

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
    [`LeftBroadcastable`][storch.wrappers.LeftBroadcastable] that holds the module, so that a model
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
    its storch inputs (for example the output of a [`storch.method.Method`][storch.method.Method]).

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
        out = fn(*args, **kwargs)

        def check(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, Tensor):
                raise IllegalStorchExposeError(
                    f"{getattr(fn, '__name__', fn)} is marked @storch.stochastic but returned a plain "
                    f"torch.Tensor of shape {tuple(t.shape)}; return storch tensors (sample with a "
                    "storch.method.Method)."
                )
            lost = [p.name for p in union.plates if not any(p == q for q in layout_of(t).plates)]
            if lost:
                raise IllegalStorchExposeError(
                    f"{getattr(fn, '__name__', fn)} returned a tensor without the input plates {lost}."
                )
            return t

        return _map(check, out)

    return wrapper


@contextlib.contextmanager
def ignore_wrapping() -> Iterator[None]:
    """A block in which the storch wrappers return their function's outputs as they are.

    Inside ``with storch.wrappers.ignore_wrapping():`` a function wrapped by
    [`deterministic`][storch.wrappers.deterministic],
    [`reduce`][storch.wrappers.reduce] or [`make_left_broadcastable`][storch.wrappers.make_left_broadcastable] still
    receives its arguments aligned (and
    expanded or flattened) over their plates, but its outputs are returned unchanged: plain
    ``torch.Tensor`` objects without plates (with ``flatten_plates``, still flattened). This is the
    manual's (Storchastic 0.3.7's) ``ignore_wrapping``, which sampling methods use to compute on
    aligned tensors without creating storch tensors. Blocks nest, and each thread and asyncio
    task has its own. Torch operations applied directly to storch tensors are not affected: they
    return storch tensors as always (unwrap one with [`storch.tensor.plain`][storch.tensor.plain]).

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
