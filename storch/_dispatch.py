"""Plate alignment and operator dispatch for `storch.Tensor` (``__torch_function__``).

Every torch function, method or operator that receives a storch tensor comes through
`torch_function`. It

1. looks up how the function treats plates: its `storch._dispatch.Treatment` in the one
   table ``_TREATMENTS`` (functions not in the table get ``DEFAULT``, the ``"aligned"`` treatment);
2. scans the arguments for plate layouts (`storch._dispatch.scan_layouts`): the storch
   tensors at the top level, inside lists/tuples, and among the keyword values (also inside
   lists/tuples). A storch tensor with plates is *plated*; plain ``torch.Tensor`` arguments and storch
   tensors without plates are *plain*, and all their dimensions are event dimensions. The scan finds
   the first plated tensor, whether every plated tensor has its plates (*same*), and whether some
   plated tensor has fewer event dimensions than another tensor argument (*ragged*);
3. on the *fast path* (the same plates, and nothing the treatment asks for: not ragged for an
   elementwise function, no plain member for a join, equal shapes for a loss) calls the function
   directly;
4. otherwise aligns the arguments: plates are merged into their union (newest first), missing plates
   become size-1 dimensions, and for elementwise functions plated arguments with fewer event
   dimensions get size-1 event dimensions right after their plates, so that event dimensions
   broadcast as they would for a single sample. Plain arguments are left as they are: they broadcast
   against the event dimensions, right-aligned, as in PyTorch. Tensors carrying an older step of a
   sequence than another argument (`storch.plate.AncestralPlate`) are
   re-indexed along the beams' ancestry (`reindex_ancestral`; only on this slow path);
5. wraps tensor outputs as `storch.Tensor` with the union layout, after checking that the
   plate dimensions survived (a reduction or reshape over a plate dimension is an error that names the
   plate; see `storch.reduce_plates` for reducing plates on purpose).

A `storch._dispatch.Treatment` is one function's whole description:

* ``kind``: ``"aligned"`` (the default: plates aligned, event dimensions untouched), ``"elementwise"``
  (also pad event dimensions, as in step 4), ``"equal_shapes"`` (elementwise, then every tensor
  argument expanded to the common shape, for losses), ``"join"`` (``torch.cat``: every member gets
  the full plate dimensions, plain members too) or ``"passthrough"`` (metadata reads: called on the
  plain tensors, result returned as is);
* ``may_drop_plates``: a full reduction to a boolean may lose the plates and returns a plain tensor;
* ``dim_positions``, ``adds_dim``, ``implicit_dims``: the function takes dimension indices (at these
  positions of ``args``, or as keywords named ``dim``, ``axis``, …), counted on the result when
  ``adds_dim``; with none given, ``implicit_dims`` are the dimensions it acts on. An index that falls
  on a plate is refused with an error that names the plate.

`storch._dispatch.register_operation` (public as ``storch.extend``) writes one
entry of the table. ``with no_dispatch():`` runs torch on storch tensors as on plain tensors.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from storch.plate import (
    EMPTY_LAYOUT,
    AncestralPlate,
    ChainPlate,
    Plate,
    PlateLayout,
    layout_of_plates,
    merge_layouts,
    reraise_cuda_dimension_error,
)

#: ``with no_dispatch():`` runs operations on storch tensors as plain torch operations (the one way to
#: turn storch's ``__torch_function__`` off; ``storch.extend`` offers it to estimators).
no_dispatch = torch._C.DisableTorchFunctionSubclass
_call_plain = torch._C._disabled_torch_function_impl
_T = torch.Tensor
# The C accessors: storch.Tensor overrides ``dim``/``shape`` for its users (see storch.tensor); here,
# with torch functions already disabled, the C versions are cheaper than a Python method call.
_dim = _T.dim
_shape = _T.shape.__get__

# ------------------------------------------------------------------------------------------ treatments

KINDS = ("aligned", "elementwise", "equal_shapes", "join", "passthrough")


@dataclass(frozen=True, slots=True)
class Treatment:
    """How one function treats plates (see the module docstring).

    Attributes:
        kind: one of ``KINDS``.
        may_drop_plates: the result may lose the plates (a full reduction to a boolean); it is then
            returned as a plain tensor instead of refused.
        dim_positions: positions in ``args`` of arguments that are dimension indices.
        adds_dim: the dimension indices refer to the result, which has one more dimension.
        implicit_dims: the dimensions the function acts on when it is given none (``None``: it has no
            such default, or takes no dimensions).
        prepare: checks or rewrites the arguments before they are scanned (``None``: nothing): indexing
            refuses an index that would mix samples, ``torch.einsum`` gets an ellipsis for the plates.
        broadcasts: the function follows torch's broadcasting rules and writes a new tensor (the
            out-of-place elementwise functions and operators): where every plated argument's plates
            are the last ones of the union of plates and no argument is ragged, torch's own
            broadcasting lays the arguments out as aligning them would (the missing plates are
            leading size-1 dimensions), so they are passed as they are.
        passthrough: derived: ``kind == "passthrough"``.
        elementwise: derived: the kind pads event dimensions (``"elementwise"``, ``"equal_shapes"``).
        special: derived: the kind may need aligning with shared plates (``"equal_shapes"``, ``"join"``).
        checks_dims: derived: dimension arguments are checked against the plates.
    """

    kind: str = "aligned"
    may_drop_plates: bool = False
    dim_positions: tuple[int, ...] = ()
    adds_dim: bool = False
    implicit_dims: tuple[int, ...] | None = None
    prepare: Callable[[tuple], tuple] | None = None
    broadcasts: bool = False
    # derived once here, so that the dispatcher reads one flag per question
    passthrough: bool = field(init=False, repr=False, compare=False)
    elementwise: bool = field(init=False, repr=False, compare=False)
    special: bool = field(init=False, repr=False, compare=False)
    checks_dims: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        derived = {
            "passthrough": self.kind == "passthrough",
            "elementwise": self.kind in ("elementwise", "equal_shapes"),
            "special": self.kind in ("equal_shapes", "join"),
            "checks_dims": bool(self.dim_positions) or self.adds_dim or self.implicit_dims is not None,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)


DEFAULT = Treatment()

# Functions whose result never carries storch metadata: attribute access, hooks, size queries.
_PROPERTIES = (
    "shape", "dtype", "device", "requires_grad", "grad", "grad_fn", "is_leaf", "ndim", "layout",
    "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "_version", "output_nr", "_base",
    "itemsize", "nbytes", "_backward_hooks", "_grad", "_grad_fn", "is_nested", "_post_accumulate_grad_hooks",
    "retains_grad",
)
_SETTERS = ("requires_grad", "grad", "data", "_grad", "names", "_backward_hooks")
_PASSTHROUGH_METHODS = (
    "dim size numel register_hook backward requires_grad_ retain_grad data_ptr element_size is_contiguous "
    "stride __len__ storage_offset untyped_storage is_floating_point is_complex get_device numpy __array__ "
    "nelement ndimension is_shared is_pinned register_post_accumulate_grad_hook __reduce_ex__ __setstate__ "
    "storage __dlpack__ __dlpack_device__"
).split()

# Operators below the Python API (``torch.ops.aten.*``, ``torch.ops.prims.*``) are called from inside
# torch: kernels, decompositions and derivative formulas written in Python, such as the meta kernels
# that compute shapes on the ``meta`` device, also in the backward pass, where autograd hands them the
# saved storch tensors. They sum a broadcast gradient over a plate dimension on purpose, so they run on
# the plain tensors and return plain tensors.
_OPERATOR_TYPES: frozenset = frozenset([torch._ops.OpOverload, torch._ops.OpOverloadPacket])

# Full reductions to a boolean are harmless (no gradient) and torch.distributions uses them for
# argument validation: they may drop plates and then return a plain tensor.
_MAY_DROP_PLATES = (torch.all, _T.all, torch.any, _T.any)
# torch's own checks that every (any) element is true, at every argument validation of torch.distributions:
# they always reduce everything, plates included, to a plain boolean, so they run on the plain tensors
_WHOLE_TENSOR_CHECKS = (torch._is_all_true, torch._is_any_true)

# Functions that need their arguments to have exactly the same shape: expand to a common shape.
_EQUAL_SHAPES = (
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.mse_loss, F.l1_loss,
    F.smooth_l1_loss, F.huber_loss, F.kl_div, F.poisson_nll_loss, F.soft_margin_loss,
)
# Functions that join a sequence of tensors: every member gets the full plate dimensions.
_JOINS = (torch.cat, torch.concat, torch.concatenate, torch.stack)
# Elementwise functions act per sample: plated arguments get size-1 event dimensions after their
# plates until they have as many event dimensions as every other argument, plain tensors included.
# Every other function sees the plates aligned but its arguments' event dimensions untouched.
_ELEMENTWISE_NAMES = (
    "add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow "
    "float_power atan2 arctan2 hypot maximum minimum fmax fmin eq ne lt le gt ge greater less "
    "greater_equal less_equal not_equal logical_and logical_or logical_xor bitwise_and bitwise_or "
    "bitwise_xor where lerp addcmul addcdiv clamp clip copysign xlogy heaviside logaddexp "
    "logaddexp2 nextafter ldexp masked_fill isclose broadcast_tensors"
).split()
_OPERATORS = (
    "add radd iadd sub rsub isub mul rmul imul truediv rtruediv itruediv div rdiv floordiv "
    "rfloordiv mod rmod pow rpow ipow eq ne lt le gt ge and rand iand or ror ior xor rxor ixor"
).split()

# Functions that take dimension indices. An index that falls on a plate is an error even when the
# result happens to have the plates' sizes (a 3-sample node over a 3-valued variable: ``t.sum(0)``
# sums the samples). Keys: the positions of dimension arguments in ``args`` (keywords are found by
# name); ``stack`` and ``unsqueeze`` index the result, which has one more dimension.
_DIM_KEYWORDS = ("dim", "axis", "dims", "dim0", "dim1", "source", "destination", "start_dim", "end_dim")
_DIM_AT = {
    (1,): (
        "sum nansum mean nanmean prod std var std_mean var_mean amax amin max min argmax argmin "
        "logsumexp softmax log_softmax softmin cumsum cumprod cummax cummin logcumsumexp all any median "
        "nanmedian mode sort argsort unbind squeeze count_nonzero flip select index_select narrow "
        "gather scatter scatter_add scatter_reduce index_add index_copy index_fill unflatten "
        "cat concat concatenate glu"
    ),
    (2,): "topk kthvalue split chunk tensor_split norm renorm roll repeat_interleave diff normalize",
    (1, 2): "transpose swapaxes swapdims movedim moveaxis flatten",
}
_NEW_DIM = ("stack", "unsqueeze")
# Functions whose default (no dimension given) falls on dimension 0, or that always swap dimensions.
_IMPLICIT_DIMS: tuple[tuple[tuple[Callable, ...], tuple[int, ...]], ...] = (
    ((torch.stack, torch.cat, torch.concat, torch.concatenate, torch.unbind, _T.unbind), (0,)),
    ((torch.t, _T.t, _T.T.__get__), (0, -1)),
    ((_T.mT.__get__,), (-2, -1)),
)


# Functions that read tensor values back to the host as one Python value (a bool): with several samples
# the answer is ambiguous, so a plated argument with a plate of size > 1 is refused, as ``bool(t)`` is.
_HOST_READS = ("allclose", "equal", "is_nonzero")


def _refuse_host_read(name: str) -> Callable[[tuple], tuple]:
    """The ``prepare`` of a host read ``name``: refuse arguments that hold several samples."""

    def prepare(args: tuple) -> tuple:
        for a in args:
            if isinstance(a, Tensor):
                a._check_single_sample(f"torch.{name}")
        return args

    return prepare


def _named(names: Sequence[str], owners: Sequence[Any]) -> list[Callable]:
    """The callables called ``names`` on each of ``owners`` (those that exist)."""
    return [f for owner in owners for name in names if callable(f := getattr(owner, name, None))]


def _build_treatments() -> dict[Callable, Treatment]:
    """The table of every function storch treats other than ``DEFAULT``, from the lists above."""
    fields: dict[Callable, dict[str, Any]] = {}

    def mark(funcs: Sequence[Callable], **values: Any) -> None:
        for func in funcs:
            fields.setdefault(func, {}).update(values)

    mark(_named(_ELEMENTWISE_NAMES, (torch, _T)), kind="elementwise", broadcasts=True)
    mark(_named([n + "_" for n in _ELEMENTWISE_NAMES], (_T,)), kind="elementwise")  # in place: self's shape
    mark(_named([f"__{n}__" for n in _OPERATORS if not n.startswith("i")], (_T,)), kind="elementwise", broadcasts=True)
    mark(_named([f"__{n}__" for n in _OPERATORS if n.startswith("i")], (_T,)), kind="elementwise")
    mark(_EQUAL_SHAPES, kind="equal_shapes")
    mark(_JOINS, kind="join")
    mark(_MAY_DROP_PLATES, may_drop_plates=True)
    for positions, names in _DIM_AT.items():
        mark(_named(names.split(), (torch, _T, F)), dim_positions=positions)
    mark(_named(_NEW_DIM, (torch, _T, F)), dim_positions=(1,), adds_dim=True)
    for funcs, dims in _IMPLICIT_DIMS:
        mark(funcs, implicit_dims=dims)
    for name in _HOST_READS:
        mark(_named([name], (torch, _T)), prepare=_refuse_host_read(name))
    getters = [getattr(_T, name).__get__ for name in _PROPERTIES if hasattr(_T, name)]
    setters = [getattr(_T, name).__set__ for name in _SETTERS if hasattr(_T, name)]
    mark(getters + setters + _named(_PASSTHROUGH_METHODS, (_T,)) + list(_WHOLE_TENSOR_CHECKS), kind="passthrough")
    return {func: Treatment(**values) for func, values in fields.items()}


_TREATMENTS: dict[Callable, Treatment] = _build_treatments()


def treatment_of(func: Callable) -> Treatment:
    """How ``func`` treats plates: its entry of the table, or ``DEFAULT``."""
    return _TREATMENTS.get(func, DEFAULT)


def register_operation(
    func: Callable, treat: str = "aligned", *, dim_args: Sequence[int] = (), adds_dim: bool = False
) -> Callable:
    """Say how ``func`` treats plates when it receives storch tensors (public as ``storch.extend``).

    Functions torch adds, or your own functions that route through ``__torch_function__``
    (``torch.overrides.handle_torch_function``), are aligned by default: plated arguments get the
    union of their plates, event dimensions are left as they are, and the result is checked to keep
    its plate dimensions. Register a function to treat it otherwise:

    * ``"elementwise"``: acts per sample, with broadcasting: plated arguments with fewer event
      dimensions get size-1 event dimensions right after their plates (like ``torch.add``);
    * ``"equal_shapes"``: needs its tensor arguments to have the same shape (like
      ``F.binary_cross_entropy``): they are expanded to their common shape; also elementwise;
    * ``"join"``: joins a sequence of tensors (like ``torch.cat``): every member gets the full plate
      dimensions;
    * ``"passthrough"``: reads metadata and returns nothing that carries plates (like
      ``Tensor.size``): called on the plain tensors, result returned as is;
    * ``"aligned"``: the default; use it to undo an earlier registration.

    ``dim_args`` are the positions (in ``args``; keywords named ``dim``, ``axis``, … are found by
    name) of arguments that are dimension indices: an index that falls on a plate is refused with an
    error that names the plate. ``adds_dim=True`` says the indices refer to the result, which has one
    more dimension (``torch.stack``, ``unsqueeze``). Registering replaces the earlier treatment of
    ``func``. Returns ``func``, so it also works as a decorator through ``functools.partial``.

    Examples:
        >>> import torch, storch
        >>> from storch.extend import register_operation
        >>> def scaled_sum(t, dim):
        ...     if torch.overrides.has_torch_function((t,)):
        ...         return torch.overrides.handle_torch_function(scaled_sum, (t,), t, dim)
        ...     return 2 * t.sum(dim)
        >>> _ = register_operation(scaled_sum, dim_args=(1,))
        >>> x = storch.denote_independent(torch.ones(3, 4), 0, "data")
        >>> scaled_sum(x, -1).plain().tolist()
        [8.0, 8.0, 8.0]
        >>> scaled_sum(x, 0)
        Traceback (most recent call last):
        ...
        ValueError: scaled_sum got dimension 0, which is plate 'data' (size 3) of a tensor of shape (3, 4) ...
    """
    if not callable(func):
        raise TypeError(f"register_operation: func must be callable, got {type(func).__name__}.")
    if treat not in KINDS:
        raise ValueError(f"register_operation({_func_name(func)}): treat must be one of {KINDS}, got {treat!r}.")
    positions = tuple(dim_args)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in positions):
        raise ValueError(
            f"register_operation({_func_name(func)}): dim_args are the non-negative positions of "
            f"dimension arguments in args, got {dim_args!r}."
        )
    if treat == "passthrough" and (positions or adds_dim):
        raise ValueError(
            f"register_operation({_func_name(func)}): a passthrough function returns no plated "
            "result, so dim_args and adds_dim do not apply."
        )
    _TREATMENTS[func] = _registered(treatment_of(func), treat, positions, adds_dim)
    return func


def _registered(old: Treatment, kind: str, positions: tuple[int, ...], adds_dim: bool) -> Treatment:
    """``old`` with a new kind and dimension arguments.

    A function's own defaults are kept: whether it may drop plates, whether it broadcasts (while it
    stays elementwise), and, for a function that acts on an implicit dimension (``torch.cat``,
    ``Tensor.T``), its dimension arguments when none are given.
    """
    broadcasts = old.broadcasts and kind == "elementwise"
    if positions or adds_dim:
        return replace(old, kind=kind, dim_positions=positions, adds_dim=adds_dim, broadcasts=broadcasts)
    if old.implicit_dims is not None:
        return replace(old, kind=kind, broadcasts=broadcasts)
    return replace(old, kind=kind, dim_positions=(), adds_dim=False, broadcasts=broadcasts)


# storch.Tensor, set by storch.tensor once the class exists (it imports this module).
Tensor: type = torch.Tensor


def torch_function(cls: type, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
    """``storch.Tensor.__torch_function__``: align plates, call ``func``, wrap the result.

    This runs for every operation on a storch tensor, so the common case (one plate layout shared by
    all plated arguments, one tensor returned) is kept short: one lookup of the function's
    `storch._dispatch.Treatment`, and an inlined scan of the arguments that only
    recognises that case. At anything the case excludes (other plates, another number of dimensions,
    a plain member of a list or tuple, a tensor keyword) it hands the whole scan to
    `storch._dispatch.scan_layouts`, so the rules stay those of `scan_layouts`.
    """
    treat = _TREATMENTS.get(func, DEFAULT)
    if treat.passthrough or type(func) in _OPERATOR_TYPES:
        # in C: func(*args, **kwargs) with subclasses off (getters take no keywords, not even {})
        return _call_plain(func, types, args, kwargs) if kwargs else _call_plain(func, types, args)
    if treat.prepare is not None:  # indexing's check, einsum's ellipsis for the plates
        args = treat.prepare(args)
    with no_dispatch():
        # The common case, inline: every plated argument, at the top level or in a list or tuple, has
        # the plates and the number of dimensions of the first; no list member is plain; no keyword
        # holds a tensor. At anything else, scan_layouts scans the arguments again, by its rules.
        first = None  # the first plated argument
        layout = EMPTY_LAYOUT  # its layout
        plain_ndim = 0  # the most dimensions of a plain top-level tensor
        scan = None  # the result of scan_layouts, where the common case does not hold
        for a in args:
            if isinstance(a, Tensor):
                lay = a._layout
                if not lay.sizes:
                    plain_ndim = max(plain_ndim, _dim(a))
                elif first is None:
                    first, layout = a, lay
                elif (lay is not layout and lay.plates != layout.plates) or _dim(a) != _dim(first):
                    scan = scan_layouts(args, kwargs)
                    break
            elif isinstance(a, _T):
                n = _dim(a)
                if n > plain_ndim:
                    plain_ndim = n
            elif type(a) is list or type(a) is tuple:
                for b in a:
                    if isinstance(b, _T):
                        if first is None and isinstance(b, Tensor) and b._layout.sizes:
                            first, layout = b, b._layout
                        elif not (
                            isinstance(b, Tensor) and b._layout.sizes and _dim(b) == _dim(first)
                            and (b._layout is layout or b._layout.plates == layout.plates)
                        ):
                            scan = scan_layouts(args, kwargs)
                            break
                if scan is not None:
                    break
        if kwargs:
            if scan is None:
                for a in kwargs.values():
                    if isinstance(a, _T) or ((type(a) is list or type(a) is tuple) and _holds_tensor(a)):
                        scan = scan_layouts(args, kwargs)
                        break
        else:
            kwargs = {}
        if scan is None:
            same = True
            ragged = plain_ndim > 0 and first is not None and plain_ndim > _dim(first) - len(layout.sizes)
        else:
            first, layout, same, ragged = scan.first, scan.layout, scan.same, scan.ragged
        if first is not None:
            if treat.checks_dims:
                _check_dim_args(func, treat, args, kwargs)
            if not same or (ragged and treat.elementwise) or (treat.special and _needs_special(treat, args, kwargs)):
                args, kwargs, layout = _align_call(treat, args, kwargs, scan)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as error:
            reraise_cuda_dimension_error(error, layout.plates, _func_name(func))
            raise
        if type(out) is _T:
            return _wrap_tensor(out, layout, func, treat, args)
        return _wrap_output(out, layout, func, treat, args)


def _holds_tensor(values: Sequence) -> bool:
    """Whether a list or tuple argument holds a tensor."""
    for v in values:
        if isinstance(v, _T):
            return True
    return False


class Scan(NamedTuple):
    """The plate layouts among the arguments of one call (see `storch._dispatch.scan_layouts`).

    Attributes:
        first: the first plated storch tensor, or ``None`` if no argument has plates.
        layout: its layout (``EMPTY_LAYOUT`` without plates).
        same: every plated tensor has the plates of ``layout``.
        ragged: some plated tensor has fewer event dimensions than ``event_ndim``.
        event_ndim: the most event dimensions of a tensor argument (a plain tensor's dimensions are
            all event dimensions).
        layouts: the layouts of the plated tensors, in argument order.
    """

    first: torch.Tensor | None
    layout: PlateLayout
    same: bool
    ragged: bool
    event_ndim: int
    layouts: list[PlateLayout]


_new_scan = tuple.__new__  # builds a Scan without NamedTuple's generated __new__ (a tenth of a µs per call)


def scan_layouts(args: Sequence, kwargs: dict | None = None) -> Scan:
    """The plate layouts among ``args`` and ``kwargs``, and how the arguments' dimensions compare.

    It looks at the top-level arguments, the members of list and tuple arguments, and the keyword
    values (also the members of list and tuple values). A storch tensor with plates is plated; a
    plain tensor or a storch tensor without plates is plain, and all its dimensions are event
    dimensions (one sample's worth). Must run with torch functions disabled.

    Examples:
        >>> import torch, storch
        >>> from storch._dispatch import no_dispatch, scan_layouts
        >>> a = storch.denote_independent(torch.ones(3), 0, "data")
        >>> b = storch.denote_independent(torch.ones(3, 5), 0, "data")
        >>> with no_dispatch():
        ...     scan = scan_layouts(([a, b], -1), {})
        >>> scan.first is a, scan.same, scan.ragged, scan.event_ndim
        (True, True, True, 1)
    """
    first = None
    layout = EMPTY_LAYOUT
    same = True
    layouts: list[PlateLayout] = []
    event_ndim = 0
    fewest = -1  # the fewest event dimensions of a plated tensor (-1: none seen yet)
    for a in (*args, *kwargs.values()) if kwargs else args:
        for b in a if (type(a) is list or type(a) is tuple) else (a,):
            if isinstance(b, Tensor) and b._layout.sizes:
                lay = b._layout
                event = _dim(b) - len(lay.sizes)
                if first is None:
                    first, layout = b, lay
                elif lay is not layout and lay.plates != layout.plates:
                    same = False
                layouts.append(lay)
                if fewest < 0 or event < fewest:
                    fewest = event
            elif isinstance(b, _T):
                event = _dim(b)
            else:
                continue
            if event > event_ndim:
                event_ndim = event
    return _new_scan(Scan, (first, layout, same, 0 <= fewest < event_ndim, event_ndim, layouts))


def _keyword_subject(kwargs: dict) -> Any:
    """The argument whose dimensions dimension arguments count, in a call with keywords only.

    That is the first argument (``args[0]``, or its first plated member for a join) when there are
    positional arguments; with keywords only, it is ``input`` (or ``tensors`` for a join).
    """
    return kwargs.get("input", kwargs.get("tensors"))


def _needs_special(treat: Treatment, args: tuple, kwargs: dict) -> bool:
    """Whether a function of the special kinds needs aligning although its plated arguments share plates.

    Losses that want equal shapes need it unless their tensor arguments already have one shape (as
    in ``Distribution.log_prob`` after ``broadcast_all``); joins need it unless every member is a
    storch tensor with plates (a plain member gets the plates expanded).
    """
    if treat.kind == "equal_shapes":
        shape = None
        for a in (args + tuple(kwargs.values())) if kwargs else args:
            if isinstance(a, _T) and _dim(a) > 0:
                if shape is None:
                    shape = _shape(a)
                elif _shape(a) != shape:
                    return True
        return False
    members = args[0] if args else _keyword_subject(kwargs)
    if not (type(members) is list or type(members) is tuple):
        members = args
    for b in members:
        if not (isinstance(b, Tensor) and b._layout.sizes):
            return True
    return False


def _dim_values(value: Any) -> list[int]:
    """The dimension indices in one argument: an int or a sequence of ints (bools are flags)."""
    if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    return []


def _check_dim_args(func: Callable, treat: Treatment, args: tuple, kwargs: dict) -> None:
    """Refuse a dimension argument that indexes a plate of the (first) input tensor."""
    subject = args[0] if args else _keyword_subject(kwargs)
    layout = None
    if type(subject) is list or type(subject) is tuple:  # cat / stack: dims count the members aligned
        plated = [b for b in subject if isinstance(b, Tensor) and b._layout.sizes]
        if not plated:
            return
        subject = plated[0]
        layout = union_of_layouts([b._layout for b in plated])
    if not isinstance(subject, Tensor) or not subject._layout.sizes:
        return  # dimensions of a plain tensor (e.g. the table of a gather with a plated index)
    if layout is None:
        layout = subject._layout
    values: list[int] = []
    n_args = len(args)
    for i in treat.dim_positions:
        if i < n_args:
            values += _dim_values(args[i])
    if kwargs:
        for key in _DIM_KEYWORDS:
            if key in kwargs:
                values += _dim_values(kwargs[key])
    n_plates = len(layout.sizes)
    ndim = n_plates + _dim(subject) - len(subject._layout.sizes) + (1 if treat.adds_dim else 0)
    if not values and treat.implicit_dims is not None and ndim >= 2:
        values = list(treat.implicit_dims)
    for d in values:
        if -ndim <= d < ndim and d % ndim < n_plates:
            raise plate_index_error(func, d, d % ndim, subject, layout)


def _einsum_per_sample(args: tuple) -> tuple:
    """``torch.einsum``'s arguments with an ellipsis for the plates, so that it acts per sample.

    An equation without ``...`` names every dimension of its operands, and a plated operand has its
    plates besides (torch would refuse it: "the number of subscripts ... does not match"). Each
    operand's subscripts and the output get a leading ``...``, which the plates fill (the operands'
    plates are aligned first, as for every function); a plain operand's ellipsis is empty. An implicit
    output (no ``->``) is made explicit first: the letters that appear once, in alphabetical order.
    An equation that already has ``...`` is left as it is (its ellipsis covers the plates).

    Examples:
        >>> _einsum_per_sample(("ij,jk", "A", "B"))[0]  # no plated operand: unchanged
        'ij,jk'
    """
    if not args or not isinstance(args[0], str) or "..." in args[0]:
        return args
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not any(isinstance(o, Tensor) and o._layout.sizes for o in operands):
        return args
    lhs, arrow, out = args[0].replace(" ", "").partition("->")
    terms = lhs.split(",")
    if not arrow:
        letters = "".join(terms)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return (",".join("..." + t for t in terms) + "->..." + out,) + args[1:]


def _check_plated_indexing(t: Tensor, index: Any) -> None:
    """Refuse ``t[index]`` where torch's indexing would mix the samples of ``t``'s plates.

    Indexing counts dimensions plates first, as every dimension argument does, so an index on one
    of the first ``len(plates)`` positions selects or permutes samples; and a tensor index that
    carries plates is applied by torch to every sample at once (an outer product over the plate),
    not sample by sample.
    """
    items = index if isinstance(index, tuple) else (index,)
    n = len(t._layout.sizes)
    for item in items:
        if isinstance(item, Tensor) and item._layout.sizes:
            raise ValueError(
                f"Indexing a tensor with plates {list(t._layout.names)} by a tensor with plates "
                f"{list(item._layout.names)}: torch's indexing would apply every sample's index to "
                "every sample (mixing the samples), and storch does not index sample by sample. Use "
                "torch.gather(t, -1, index.unsqueeze(-1)).squeeze(-1) (per sample), or a one-hot "
                "product (t * torch.nn.functional.one_hot(index, n)).sum(-1)."
            )
    for position, item in enumerate(items):
        if item is Ellipsis:
            break
        if position < n and not (isinstance(item, slice) and item == slice(None)):
            plate = t._layout.plates[position]
            raise ValueError(
                f"Indexing a tensor of shape {tuple(t.shape)} with plates {list(t._layout.names)} at "
                f"position {position} selects samples of plate {plate.name!r} (size {plate.size}): "
                "indices count dimensions plates first, as for every dimension argument. Index one "
                "sample's dimensions from the right, e.g. t[..., i], and reduce or select plates by "
                f"name (storch.reduce_plates(t, {plate.name!r}), storch.gather(t, {plate.name!r}, index))."
            )


def _prepare_indexing(args: tuple) -> tuple:
    """``Tensor.__getitem__``'s arguments, checked by `_check_plated_indexing` on a plated tensor."""
    if isinstance(args[0], Tensor) and args[0]._layout.sizes:
        _check_plated_indexing(args[0], args[1])
    return args


for _func, _prepare in ((torch.Tensor.__getitem__, _prepare_indexing), (torch.einsum, _einsum_per_sample)):
    _TREATMENTS[_func] = replace(treatment_of(_func), prepare=_prepare)


#: functions that join tensors along a dimension (stacking is not a reduction: their error says so)
_JOINS = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack", "row_stack"})


def plate_index_error(
    func: Callable, dim: int, position: int, t: torch.Tensor, layout: PlateLayout | None = None
) -> ValueError:
    """The error for a dimension argument that falls on a plate (of ``layout``, by default ``t``'s;
    for ``cat`` and ``stack``, the union of the inputs' plates)."""
    name = _func_name(func)
    layout = t._layout if layout is None else layout
    plate = layout.plates[position]
    n = len(layout.sizes)
    if name in _JOINS:
        return ValueError(
            f"{name} got dimension {dim}, which is plate {plate.name!r} (size {plate.size}) of its inputs "
            f"aligned to the union of their plates {list(layout.names)}: {name} joins the events of each "
            "sample, never plates (each input keeps its plates; storch broadcasts them to the union). "
            f"Count dim from the right, over one sample's dimensions (e.g. {name}(tensors, dim=-1))."
        )
    return ValueError(
        f"{name} got dimension {dim}, which is plate {plate.name!r} (size {plate.size}) of a tensor of "
        f"shape {tuple(t.shape)} whose first {n} dimensions are the plates {list(layout.names)}. "
        "Dimension arguments must index event dimensions: count from the right (e.g. dim=-1), as for "
        "a single sample. To reduce a plate on purpose use storch.reduce_plates(t, "
        f"{plate.name!r}) (weighted) or storch.sum/mean(t, {plate.name!r})."
    )


def _wrap_tensor(out: torch.Tensor, layout: PlateLayout, func: Callable, treat: Treatment, args: tuple) -> Any:
    """Make a fresh plain result a storch tensor with ``layout``, after checking its plate dims."""
    sizes = layout.sizes
    if sizes and out.shape[: len(sizes)] != sizes:
        if treat.may_drop_plates:
            return out
        raise plate_dimension_error(func, out.shape, layout)
    for a in args:
        if a is out:  # a plain input returned unchanged: do not retype the user's tensor
            out = out.view_as(out)
            break
    out.__class__ = Tensor
    out._layout = layout
    return out


def _wrap_output(out: Any, layout: PlateLayout, func: Callable, treat: Treatment, args: tuple) -> Any:
    """Wrap the tensors in a non-tensor result (tuples, named tuples, lists); pass others through."""
    if type(out) is _T:
        return _wrap_tensor(out, layout, func, treat, args)
    if isinstance(out, Tensor):
        return out  # in-place operation or identity on a storch tensor: keeps its own layout
    if isinstance(out, (tuple, list)):
        return type(out)([_wrap_output(o, layout, func, treat, args) for o in out])  # also torch.return_types
    return out


def _func_name(func: Callable) -> str:
    """The name users know ``func`` by (``T`` for the getter of ``Tensor.T``)."""
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a property getter
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def plate_dimension_error(func: Callable, shape: torch.Size, layout: PlateLayout) -> ValueError:
    """The error for an operation whose result lost or reshaped a plate dimension."""
    name = _func_name(func)
    n = len(layout.sizes)
    plates = ", ".join(f"{p.name!r} (size {p.size})" for p in layout.plates)
    if len(shape) < n:
        head = (
            f"Got an input tensor with too few dimensions. We expected {n} plate dimensions "
            f"({plates}) but {name} returned a tensor of shape {tuple(shape)}, with only "
            f"{len(shape)} dimensions."
        )
        bad = len(shape)
    else:
        bad = next(i for i, (s, p) in enumerate(zip(shape, layout.sizes)) if s != p)
        head = (
            f"{name} returned a tensor of shape {tuple(shape)} whose dimension {bad} has size "
            f"{shape[bad]}, but plate {layout.names[bad]!r} needs size {layout.sizes[bad]} there "
            f"(plates: {plates})."
        )
    violated = layout.names[bad] if bad < n else layout.names[-1]
    return ValueError(
        f"{head} Violated at dimension {bad} (plate {violated!r}). Reducing, indexing or reshaping a "
        "plate dimension loses the per-sample values storch needs to estimate gradients. Reduce "
        "event dimensions with negative dims (e.g. t.sum(-1)); reduce plates on purpose with "
        f"storch.reduce_plates(t, {violated!r}) (weighted) or storch.sum/mean(t, {violated!r}); for "
        "functions that need one batch dimension use storch.deterministic(fn, flatten_plates=True) "
        "or storch.make_left_broadcastable(fn)."
    )


def _align_call(treat: Treatment, args: tuple, kwargs: dict, scan: Scan | None) -> tuple[tuple, dict, PlateLayout]:
    """All storch arguments of one call (``scan``: their layouts, ``None`` to scan them here) aligned
    to the union of their plates, and that union."""
    if scan is None:
        scan = scan_layouts(args, kwargs)
    union = union_of_layouts(scan.layouts)
    if treat.broadcasts and not scan.ragged and _plates_are_trailing(scan.layouts, union):
        return args, kwargs, union  # torch's broadcasting inserts the missing (leading) plates itself
    expand = treat.kind == "join"
    pad_to = scan.event_ndim if treat.elementwise else None
    new_args = tuple(_convert_argument(a, union, pad_to, expand) for a in args)
    if kwargs:
        kwargs = {k: _convert_argument(v, union, pad_to, expand) for k, v in kwargs.items()}
    if treat.kind == "equal_shapes":
        new_args, kwargs = _broadcast_tensor_args(new_args, kwargs)
    return new_args, kwargs, union


def _plates_are_trailing(layouts: list[PlateLayout], union: PlateLayout) -> bool:
    """Whether each layout's plates are the last plates of ``union``, in its order (so that only
    leading plates are missing, which broadcasting inserts as size-1 dimensions on the left)."""
    plates = union.plates
    n = len(plates)
    for lay in layouts:
        if lay is not union and lay.plates != plates[n - len(lay.plates):]:
            return False
    return True


def _convert_argument(a: Any, union: PlateLayout, pad_to: int | None, expand: bool) -> Any:
    """One argument laid out for ``union``: a tensor, or each member of a list or tuple."""
    if type(a) is list or type(a) is tuple:
        return type(a)([_convert(b, union, pad_to, expand) for b in a])
    return _convert(a, union, pad_to, expand)


def _convert(a: Any, union: PlateLayout, pad_to: int | None, expand: bool) -> Any:
    """One value laid out for ``union`` (see `storch._dispatch.align_tensor`)."""
    if isinstance(a, Tensor) and a._layout.sizes:
        return align_tensor(a, union, pad_to, expand)
    if expand and isinstance(a, _T):
        return expand_plain(a, union)
    return a


class _LayoutCache:
    """A small cache keyed by the identities of plate layouts, holding nothing alive.

    An entry is keyed by the ``id``s of its layouts and removed as soon as any of them dies (a
    weak-reference callback), so an id reused by a new layout is never mistaken for the old one and
    the cache never keeps a step's plates, nodes or methods alive. A cached layout is held weakly
    too: it is alive while some tensor carries it, and recomputed otherwise.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], Any]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, layouts: tuple[PlateLayout, ...]) -> Any:
        hit = self._entries.get(tuple(map(id, layouts)))
        if hit is not None and all(r() is lay for r, lay in zip(hit[0], layouts)):
            return hit[1]
        return None

    def put(self, layouts: tuple[PlateLayout, ...], value: Any) -> None:
        key = tuple(map(id, layouts))
        entries = self._entries

        def forget(_: weakref.ref, key: tuple[int, ...] = key) -> None:
            entries.pop(key, None)

        entries[key] = (tuple(weakref.ref(lay, forget) for lay in layouts), value)

    def clear(self) -> None:
        self._entries.clear()


_union_cache = _LayoutCache()  # layouts -> weak reference to their union
_plan_cache = _LayoutCache()  # (source layout, union) -> Plan


def union_of_layouts(layouts: list[PlateLayout]) -> PlateLayout:
    """The union of layouts (see `storch.plate.merge_layouts`), cached for repeated
    calls."""
    first = layouts[0]
    if all(lay is first or lay.plates == first.plates for lay in layouts):
        return first
    if len(layouts) == 2:  # a recurrent state (one chain step older) meets the new step's input: no cache to miss
        second = layouts[1]
        if _ahead_of(first, second, True):
            return first
        if _ahead_of(second, first, False):
            return second
    covering = _covering(layouts)
    if covering is not None:
        return covering
    key = tuple(layouts)
    ref = _union_cache.get(key)
    union = ref() if ref is not None else None
    if union is None:
        union = merge_layouts(layouts)
        _union_cache.put(key, weakref.ref(union))
    return union


def _ahead_of(newer: PlateLayout, older: PlateLayout, first: bool) -> bool:
    """Whether ``newer`` is the union of the two layouts: ``older`` `relabels` to it (the same plates
    at the same positions, some replaced by newer steps of their single-sample chains) and it lists
    its plates newest first. ``first``: ``newer`` comes first in the union, so an independent plate
    equal to ``older``'s counts as it; else it must be the same object (a merge keeps the first of
    two equal plates)."""
    if not relabels(older, newer):
        return False
    previous = None
    for p, q in zip(newer.plates, older.plates):
        if previous is not None and previous.order < p.order:
            return False
        if not first and p is not q and type(p) is not ChainPlate:
            return False
        previous = p
    return True


def _covering(layouts: list[PlateLayout]) -> PlateLayout | None:
    """The layout among ``layouts`` that holds every plate of the others, or a newer step of the same
    single-sample chain in its place, if it lists its plates newest first: then it is their union,
    found without merging (a new chain step or a new node meets its own inputs: a miss of the
    cache, which is keyed by the layouts)."""
    n = max(len(lay) for lay in layouts)
    for big in layouts:
        if len(big) == n and _covers(big, layouts):
            return big
    return None


def _covers(big: PlateLayout, layouts: list[PlateLayout]) -> bool:
    """Whether ``big`` holds the plates of ``layouts`` (see `_covering`) and lists its own newest first."""
    plates = big.plates
    equal = big is layouts[0]  # a merge keeps the first of two equal independent plates
    for lay in layouts:
        if lay is not big:
            for p in lay.plates:
                if not _holds(plates, p, equal):
                    return False
    for newer, older in zip(plates, plates[1:]):
        if newer.order < older.order:
            return False
    return True


def _holds(plates: tuple[Plate, ...], p: Plate, equal: bool) -> bool:
    """Whether ``plates`` hold ``p`` (itself, an equal plate where ``equal``, or a newer step of its chain)."""
    for q in plates:
        if q is p or (equal and q == p):
            return True
        if type(q) is ChainPlate and type(p) is ChainPlate and q.chain is p.chain and q.depth > p.depth:
            return True
    return False


def relabels(src: PlateLayout, union: PlateLayout) -> bool:
    """Whether ``src`` holds ``union``'s plates at the same positions, up to older steps of single-sample
    chains in place of newer ones (one sample per step, at the same place: relabelled, nothing moves)."""
    a, b = src.plates, union.plates
    if len(a) != len(b):
        return False
    for p, u in zip(a, b):
        if not (p is u or p == u or (
            type(p) is ChainPlate and type(u) is ChainPlate and p.chain is u.chain and p.depth < u.depth
        )):
            return False
    return True


class Plan(NamedTuple):
    """How to lay out a tensor with one layout for a larger one (see `storch._dispatch._plan`).

    Attributes:
        permutation: the order in which to permute the tensor's plate dimensions, or ``None`` if
            they are in order already.
        index: the index that inserts size-1 dimensions for the plates the tensor lacks (``None``
            when ``ancestral``).
        ancestral: the tensor carries older steps of a sequence than the union: re-index it along
            the ancestry first (`storch._dispatch.reindex_ancestral`), then plan
            again.
    """

    permutation: tuple[int, ...] | None
    index: tuple | None
    ancestral: bool = False


_REINDEX_FIRST = Plan(None, None, True)


def _plan(src: PlateLayout, union: PlateLayout) -> Plan:
    """How to lay out a tensor with plates ``src`` for ``union``: a permutation and an index."""
    hit = _plan_cache.get((src, union))
    if hit is not None:
        return hit
    positions = []
    for u in union.plates:
        positions.append(next((i for i, p in enumerate(src.plates) if p is u or p == u), None))
    present = [p for p in positions if p is not None]
    if len(present) != len(src.plates):
        missing = [p for p in src.plates if not any(p == u for u in union.plates)]
        if not all(_has_descendant(p, union) for p in missing):  # only older steps of a sequence may be missing
            names = [p.name for p in missing]
            raise RuntimeError(f"internal error: plates {names} are missing from the union {union}")
        plan = _REINDEX_FIRST
    else:
        perm = tuple(present) if present != sorted(present) else None
        plan = Plan(perm, tuple(slice(None) if p is not None else None for p in positions))
    _plan_cache.put((src, union), plan)
    return plan


def align_tensor(
    t: torch.Tensor, union: PlateLayout, event_ndim: int | None = None, expand: bool = False
) -> torch.Tensor:
    """View of storch tensor ``t`` laid out for ``union``; must run with torch functions disabled.

    Plates of ``union`` that ``t`` lacks become size-1 dimensions (or are expanded with
    ``expand=True``); with ``event_ndim`` given, size-1 event dimensions are inserted after the plates
    so that ``t`` has ``event_ndim`` event dimensions.
    """
    src = t._layout
    n_src = len(src.sizes)
    pad = 0 if event_ndim is None else max(0, event_ndim - (_dim(t) - n_src))
    if src is union or src.plates == union.plates or relabels(src, union):
        if pad:
            t = t[(slice(None),) * n_src + (None,) * pad]
    else:
        plan = _plan(src, union)
        if plan.ancestral:  # t carries older steps of a sequence than union: re-index it first
            t, src = reindex_ancestral(t, src, union)
            n_src = len(src.sizes)
            plan = _plan(src, union)
        if plan.permutation is not None:
            t = t.permute(*plan.permutation, *range(n_src, _dim(t)))
        t = t[plan.index + (None,) * pad] if pad else t[plan.index]
    if expand and _shape(t)[: len(union.sizes)] != union.sizes:  # (no view where nothing is expanded)
        t = t.expand(*union.sizes, *_shape(t)[len(union.sizes):])
    return t


# ------------------------------------------------------------------ ancestral plates (sequences)
# ``_plan`` answers ``ancestral`` when a tensor carries an older step of a sequence than the union it
# is aligned to (see storch.plate.AncestralPlate); only then does ``align_tensor`` re-index it.


def _has_descendant(plate: Plate, union: PlateLayout) -> bool:
    return isinstance(plate, AncestralPlate) and any(
        isinstance(u, AncestralPlate) and u.chain_name == plate.chain_name and u.descends_from(plate)
        for u in union.plates
    )


def _as_layout(t: torch.Tensor, layout: PlateLayout) -> torch.Tensor:
    """A storch view of plain ``t`` with ``layout`` (for aligning it; torch functions disabled)."""
    v = t.view_as(t)
    v.__class__ = Tensor
    v._layout = layout
    return v


def reindex_ancestral(t: torch.Tensor, src: PlateLayout, union: PlateLayout) -> tuple[torch.Tensor, PlateLayout]:
    """Re-index ``t`` (plates ``src``) from older steps of its ancestral chains to the steps in ``union``.

    Sample ``b`` of the newer step gets the values of its ancestor along the chain: one
    ``take_along_dim`` per step, along the older plate's dimension with the newer plate's parent
    indices. Returns a plain tensor and its new layout (a subset of ``union``'s plates). Must run with
    torch functions disabled.

    Examples:
        >>> import torch, storch
        >>> from storch.plate import AncestralPlate, layout_of_plates
        >>> first = AncestralPlate("seq", 2)
        >>> second = AncestralPlate("seq", 3, ancestor=first, parent_index=torch.tensor([1, 1, 0]))
        >>> old = storch.Tensor(torch.tensor([10.0, 20.0]), [first])
        >>> new = storch.Tensor(torch.zeros(3), [second])
        >>> (old + new).plain().tolist()
        [20.0, 20.0, 10.0]
    """
    newest = {p.chain_name: p for p in union.plates if isinstance(p, AncestralPlate)}
    for plate in src.plates:
        target = newest.get(plate.chain_name) if isinstance(plate, AncestralPlate) else None
        if target is None or target is plate:
            continue
        if isinstance(target, ChainPlate):  # one sample per step, at the same place: relabel only
            src = layout_of_plates(tuple(target if p is plate else p for p in src.plates))
            continue
        steps = []
        step = target
        while step is not plate:
            steps.append(step)
            step = step.ancestor
        for step in reversed(steps):
            t, src = _reindex_step(t, src, step)
    return t, src


def _reindex_step(t: torch.Tensor, src: PlateLayout, step: AncestralPlate) -> tuple[torch.Tensor, PlateLayout]:
    """Gather ``t`` along ``step.ancestor``'s dimension with ``step.parent_index``."""
    old = step.ancestor
    i = next(j for j, p in enumerate(src.plates) if p is old)
    rest = layout_of_plates([p for p in src.plates if p is not old])
    if not step.index_plates:  # one parent per sample: a contiguous index_select along the plate
        y = t.index_select(i, step.parent_index)  # type: ignore[arg-type]
        new = merge_layouts([rest, layout_of_plates((step,))])
        j = next(k for k, p in enumerate(new.plates) if p is step)
        return (y if j == i else y.movedim(i, j)), new
    index_rest = layout_of_plates(step.index_plates)
    rest_union = merge_layouts([rest, index_rest])
    x = align_tensor(_as_layout(t.movedim(i, -1), rest), rest_union)  # (*rest_union, *event, old)
    idx = align_tensor(_as_layout(step.parent_index.movedim(0, -1), index_rest), rest_union)
    n_event = _dim(x) - len(rest_union.sizes) - 1
    idx = idx.reshape(tuple(idx.shape[:-1]) + (1,) * n_event + (idx.shape[-1],))
    y = torch.take_along_dim(x, idx, -1)  # (*rest_union, *event, step)
    new = merge_layouts([rest_union, layout_of_plates((step,))])
    j = next(k for k, p in enumerate(new.plates) if p is step)
    return y.movedim(-1, j), new


def expand_plain(t: torch.Tensor, union: PlateLayout) -> torch.Tensor:
    n = len(union.sizes)
    if n == 0:
        return t
    return t[(None,) * n].expand(*union.sizes, *_shape(t))


def _broadcast_shape(shapes: list[torch.Size]) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` for a few shapes, without its Python-reference overhead."""
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        for i, size in enumerate(s, ndim - len(s)):
            if size != 1:
                if out[i] not in (1, size):
                    raise RuntimeError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[i] = size
    return tuple(out)


def _broadcast_tensor_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Expand the top-level tensor arguments to their common broadcast shape."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor) and _dim(v) > 0]
    if len(tensors) < 2:
        return args, kwargs
    shape = _broadcast_shape([_shape(t) for t in tensors])
    new_args = tuple(a.expand(shape) if isinstance(a, torch.Tensor) else a for a in args)
    new_kwargs = {
        k: (v.expand(shape) if isinstance(v, torch.Tensor) and _dim(v) > 0 else v)
        for k, v in kwargs.items()
    }
    return new_args, new_kwargs
