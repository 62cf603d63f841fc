"""Utilities: the magic box, distribution parameters, graph inspection, Gumbel sampling, splitting."""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import torch
from torch.distributions import Distribution
from torch.distributions.utils import lazy_property

from storch.distributions.relaxation import conditional_gumbel_rsample, relaxation_for
from storch._dispatch import union_of_layouts
from storch.plate import EMPTY_LAYOUT, Plate, PlateLayout, layout_of_plates, order_plates
from storch.tensor import CostTensor, StochasticTensor, Tensor, _Disable, layout_of, wrap, wrap_new

__all__ = [
    "magic_box", "get_distr_parameters", "has_parameters_requiring_grad", "distribution_layout",
    "DistributionFacts", "distribution_facts",
    "has_differentiable_path", "has_backwards_path", "walk_backward_graph", "print_graph", "topological_sort", "split",
    "rsample_gumbel", "rsample_gumbel_softmax", "conditional_gumbel_rsample", "tensor_stats",
    "reduce_mean", "log_prob_of_own_samples", "restore_lazy_plates", "forget_lazy_plain_values", "lazy_plates_kept",
    "floating_dtype",
    "with_nested", "elementwise",
]


def magic_box(l: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """The DiCE magic box ``□(l) = exp(l − stopgrad(l))``: 1 in the forward pass, ``∇□(l) = □(l) ∇l``.

    Foerster et al. 2018, "DiCE: The Infinitely Differentiable Monte-Carlo Estimator". Derivatives of
    any order of ``□(l) · f`` are score-function estimates of the derivatives of ``E[f]``.

    For a storch tensor ``l`` the box is kept on it: asked again for the same, unchanged ``l`` (an
    estimator's control-variate term ``(1 − □(l))·a``, then the surrogate's ``□(l)·S``) it is the
    same tensor, one node of the autograd graph instead of two with the same values.

    Examples:
        >>> import torch
        >>> l = torch.tensor(0.3, requires_grad=True)
        >>> m = magic_box(l); m.item()
        1.0
        >>> torch.autograd.grad(m, l)[0].item()
        1.0
    """
    if isinstance(l, Tensor):  # plates kept as they are: computed on the plain values
        key = (l.__dict__.get("_magic_box"), torch.is_grad_enabled())
        with _Disable():  # version reads and the box's arithmetic: no trip through storch's dispatch
            kept, key = key[0], (l._version, key[1])
            if kept is not None and kept[0] == key and kept[1]._version == kept[2]:
                return kept[1]  # an estimator's (1 − □(l))·a and the surrogate's □(l)·S share one box
            box = torch.exp(l - l.detach())
            version = box._version
        box = wrap_new(box, l._layout)
        l._magic_box = (key, box, version)
        return box
    return torch.exp(l - l.detach())


def elementwise(op: Callable[[Any, Any], torch.Tensor], a: Any, b: Any) -> Any:
    """``op(a, b)`` for an elementwise ``op`` (``operator.mul``, ``operator.add``, …) in storch's own
    code, on the plain values when no alignment is needed: ``a`` and ``b`` are storch tensors with
    the same plates and the same number of dimensions, or one of them is a Python number or a plain
    tensor with no more dimensions than the other's event dimensions (torch's broadcasting then
    lines them up as storch's dispatch would). The result has the plates of the storch operand,
    without the trip through ``__torch_function__``. Anything else goes through the dispatch, which
    aligns the plates.

    Examples:
        >>> import operator, torch, storch
        >>> x = storch.denote_independent(torch.tensor([1.0, 2.0]), 0, "data")
        >>> y = elementwise(operator.mul, x, x)
        >>> y.plain().tolist(), y.plate_names, elementwise(operator.sub, 1.0, x).plate_names
        ([1.0, 4.0], ['data'], ['data'])
    """
    a_storch, b_storch = isinstance(a, Tensor), isinstance(b, Tensor)
    if a_storch and b_storch:
        layout = a._layout
        fast = (b._layout is layout or b._layout.plates == layout.plates) and a.dim() == b.dim()
    elif a_storch or b_storch:
        plated, other = (a, b) if a_storch else (b, a)
        layout = plated._layout
        fast = isinstance(other, (int, float)) or (
            type(other) is torch.Tensor and other.dim() <= plated.dim() - len(layout.sizes)
        )
    else:
        return op(a, b)
    if not fast:
        return op(a, b)
    with _Disable():
        out = op(a, b)
    return wrap_new(out, layout)


def _named_parameters(d: Distribution) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters the user gave to ``d`` (lazily derived ones that were never computed are skipped)."""
    found = False
    for name in d.arg_constraints:
        if name in d.__dict__:
            value = d.__dict__[name]
        else:
            attr = getattr(type(d), name, None)
            if isinstance(attr, lazy_property) or attr is None or isinstance(attr, property):
                continue
            value = getattr(d, name)
        if isinstance(value, torch.Tensor):
            found = True
            yield name, value
    if not found:  # wrappers such as OneHotCategorical and Independent keep their parameters inside
        for value in d.__dict__.values():
            if isinstance(value, Distribution):
                yield from _named_parameters(value)


def has_parameters_requiring_grad(d: Distribution) -> bool:
    """Whether ``get_distr_parameters(d)`` is not empty: some parameter of ``d`` requires a gradient
    (stops at the first one, builds no dict).

    Examples:
        >>> import torch
        >>> from torch.distributions import Normal
        >>> has_parameters_requiring_grad(Normal(torch.zeros(2, requires_grad=True), 1.0))
        True
        >>> has_parameters_requiring_grad(Normal(torch.zeros(2), 1.0))
        False
    """
    for _, value in _named_parameters(d):  # found as get_distr_parameters finds them (dispatch on)
        with _Disable():  # a plain attribute read, not a trip through storch's dispatch
            if value.requires_grad:
                return True
    return False


def get_distr_parameters(d: Distribution, filter_requires_grad: bool = True) -> dict[str, torch.Tensor]:
    """The parameter tensors of a distribution, by name (e.g. ``{"loc": ..., "scale": ...}``).

    Examples:
        >>> import torch
        >>> from torch.distributions import Normal
        >>> mu = torch.zeros(2, requires_grad=True)
        >>> sorted(get_distr_parameters(Normal(mu, torch.ones(2))))
        ['loc']
    """
    params = dict(_named_parameters(d))
    if filter_requires_grad:
        with _Disable():  # a plain attribute read, not a trip through storch's dispatch
            params = {k: v for k, v in params.items() if v.requires_grad}
    return params


class DistributionFacts(NamedTuple):
    """What a method checks of a distribution before it draws, read in one pass over the
    distribution's attributes and those of the distributions it wraps (see `distribution_facts`).

    Attributes:
        layouts: the plate layouts of its tensors, in the order `distribution_layout` meets them
            (their union is the distribution's layout).
        requires_grad: whether some parameter requires a gradient (`has_parameters_requiring_grad`).
        integer_parameters: ``(distribution, parameter, dtype)`` of each parameter stored on it, or on
            a distribution it wraps, that is not floating point although its constraint is not
            discrete (``Normal(torch.tensor(0), 1.0)``'s ``loc``).
    """

    layouts: list[PlateLayout]
    requires_grad: bool
    integer_parameters: list[tuple[str, str, torch.dtype]]

    @property
    def layout(self) -> PlateLayout:
        """The union of `layouts` (raises `storch.plate.PlateClashError` where two plates clash)."""
        return union_of_layouts(self.layouts) if self.layouts else EMPTY_LAYOUT


def distribution_facts(d: Distribution) -> DistributionFacts:
    """`DistributionFacts` of ``d``: its plates, whether a parameter requires a gradient, its integer
    parameters (one pass where `distribution_layout`, `has_parameters_requiring_grad` and the integer
    check would each walk the distribution).

    Only the parameters stored on a distribution are read: lazily derived ones (``Bernoulli.logits``
    of ``Bernoulli(probs=...)``) are not computed, and normalised ones (``Categorical`` divides its
    ``probs`` by their sum) are floating point already.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> x = storch.denote_independent(torch.zeros(3, requires_grad=True), 0, "data")
        >>> facts = distribution_facts(Normal(x, torch.tensor(1)))
        >>> facts.layout.names, facts.requires_grad, facts.integer_parameters
        (('data',), True, [('Normal', 'scale', torch.int64)])
    """
    layouts: list[PlateLayout] = []
    integer: list[tuple[str, str, torch.dtype]] = []
    requires_grad = False
    stack = [d]
    with _Disable():  # dtype and requires_grad reads of storch tensors: no trip through storch's dispatch
        while stack:
            dist = stack.pop()
            own = dist.__dict__
            for name, constraint in dist.arg_constraints.items():
                value = own.get(name)
                if isinstance(value, torch.Tensor):
                    dtype = value.dtype
                    if not (dtype.is_floating_point or dtype.is_complex) and not _is_discrete(constraint):
                        integer.append((type(dist).__name__, name, dtype))
                    if dist is d and value.requires_grad:
                        requires_grad = True
            for value in own.values():
                if isinstance(value, Tensor) and value._layout.plates:
                    layouts.append(value._layout)
                elif isinstance(value, Distribution):  # what it wraps (Independent's base, OneHotCategorical's)
                    stack.append(value)
    if not requires_grad:  # (parameters that are not stored on ``d`` itself, as get_distr_parameters finds them)
        requires_grad = has_parameters_requiring_grad(d)
    return DistributionFacts(layouts, requires_grad, integer)


def _is_discrete(constraint: Any) -> bool:
    """Whether a parameter constraint holds integers (``Binomial.total_count``); unknown: ``False``."""
    try:
        return bool(constraint.is_discrete)
    except NotImplementedError:  # constraints.dependent without is_discrete
        return False


def distribution_layout(d: Distribution) -> PlateLayout:
    """The union of the plates carried by the tensors inside a distribution."""
    layouts = []
    stack = [d]
    while stack:
        dist = stack.pop()
        for value in dist.__dict__.values():
            if isinstance(value, Tensor) and value._layout.plates:
                layouts.append(value._layout)
            elif isinstance(value, Distribution):
                stack.append(value)
    if not layouts:
        return EMPTY_LAYOUT
    return union_of_layouts(layouts)


def with_nested(d: Distribution) -> list[Distribution]:
    """``d`` and the distributions nested in it (``OneHotCategorical``'s ``Categorical``, an
    ``Independent``'s base), outermost first."""
    found = [d]
    for value in d.__dict__.values():
        if isinstance(value, Distribution):
            found.extend(with_nested(value))
    return found


def floating_dtype(d: Distribution, samples: torch.Tensor) -> torch.dtype:
    """The floating dtype of a node: its samples' dtype, else that of the distribution's parameters.

    Tensors storch creates for a node (plate weights, constants) use it, so that float64 (or
    half-precision) parameters are not mixed with float32 constants. Falls back to the default dtype
    for a distribution with integer samples and no floating parameter.

    Examples:
        >>> import torch
        >>> from torch.distributions import Categorical
        >>> q = Categorical(logits=torch.zeros(3, dtype=torch.float64))
        >>> floating_dtype(q, q.sample((2,)))
        torch.float64
    """
    if samples.is_floating_point():
        return samples.dtype
    for _, value in _named_parameters(d):
        if value.is_floating_point():
            return value.dtype
    return torch.get_default_dtype()


@functools.lru_cache(maxsize=None)
def _lazy_property_names(cls: type) -> tuple[str, ...]:
    """The names of the ``lazy_property`` attributes of a distribution class (computed once per class)."""
    return tuple(name for name in dir(cls) if isinstance(getattr(cls, name, None), lazy_property))


def _refcount_held_by_a_dict_only() -> int:
    """``sys.getrefcount`` of a value that a dict holds and a local variable names, nothing else (what
    `restore_lazy_plates` sees of a value only the distribution caches; measured here, not assumed,
    since interpreters count borrowed references differently)."""
    cache = {"value": object()}
    value = cache.get("value")
    return sys.getrefcount(value)


_HELD_BY_THE_CACHE_ONLY = _refcount_held_by_a_dict_only()


def restore_lazy_plates(d: Distribution, layout: PlateLayout | None = None) -> None:
    """Give the plates back to parameters that ``d`` computed lazily while dispatch was off.

    ``torch.distributions`` computes some parameters on first use and caches them on the object
    (``Bernoulli(logits=…).probs``, ``Categorical(probs=…).logits``, ``MultivariateNormal``'s
    matrices). storch samples and scores with its dispatch disabled, so a parameter first computed
    there would be cached as a plain tensor whose plate dimensions later broadcast as event
    dimensions (``q.probs * logits`` a data × data grid). Each such cached value gets the plates of
    its own distribution's parameters back (nothing is recomputed): the cached object itself where
    nothing else holds it, else a view.

    ``layout``: ``distribution_layout(d)`` where the caller has it already (a method that just drew
    ``d`` with dispatch off, which adds no plated tensor to it); it is used for ``d`` only, not for
    the distributions nested in it.
    """
    known = layout
    for dist in with_nested(d):
        layout = known if dist is d else None
        cached = dist.__dict__
        for name in _lazy_property_names(type(dist)):
            value = cached.get(name)
            if type(value) is not torch.Tensor:
                continue
            if layout is None:
                layout = distribution_layout(dist)
            sizes = layout.sizes
            if sizes and tuple(value.shape[: len(sizes)]) == sizes:
                if sys.getrefcount(value) <= _HELD_BY_THE_CACHE_ONLY:
                    wrap_new(value, layout)  # nobody else holds the object: retyped, no view (one per draw)
                    continue
                if torch.is_grad_enabled():  # (the context manager costs more than the view, per decision)
                    dist.__dict__[name] = wrap(value, layout)
                    continue
                with torch.enable_grad():  # a view: under torch.no_grad it would drop the value's graph
                    dist.__dict__[name] = wrap(value, layout)


def forget_lazy_plain_values(d: Distribution, layout: PlateLayout | None = None) -> None:
    """Forget the parameters that ``d`` computed lazily while dispatch was off, where its parameters
    carry plates (the plain values `restore_lazy_plates` would plate): read again, they are computed
    with their plates.

    For a draw whose samples carry no gradient (a score-function draw): nothing in the graph of the
    costs depends on what the draw computed (``Categorical(logits=...).probs`` for the multinomial),
    so nothing is lost, and nothing keeps the value and its autograd node alive as long as the node, or
    gives it a gradient hook at the backward pass (one tensor, its storch state and a hook fewer per
    decision of a rollout). ``layout`` as for `restore_lazy_plates`.
    """
    known = layout
    for dist in with_nested(d):
        layout = known if dist is d else None
        cached = dist.__dict__
        for name in _lazy_property_names(type(dist)):
            if type(cached.get(name)) is not torch.Tensor:
                continue
            if layout is None:
                layout = distribution_layout(dist)
            if layout.sizes:
                del cached[name]


@contextlib.contextmanager
def lazy_plates_kept(d: Distribution) -> Iterator[None]:
    """Compute with ``d`` while dispatch is off and leave no plain parameter cached on it.

    A ``lazy_property`` that ``d`` (or a distribution nested in it) first computes inside the block
    is cached as a plain tensor. On exit each such value gets its plates back (as
    `storch.util.restore_lazy_plates` does) or, where its shape does not
    start with the plates' sizes, is forgotten, to be computed again with dispatch on. So the user's
    later ``q.logits`` or ``q.log_prob(z)`` sees the same plates whichever order they come in. A value
    first computed while autograd is off (``torch.no_grad()``, as when a sampler scores its draws) is
    always forgotten: cached, it would give every later ``q.log_prob(z)`` no gradient.
    """
    dists = with_nested(d)
    before = [set(dist.__dict__) for dist in dists]
    tracked = torch.is_grad_enabled()
    try:
        yield
    finally:
        if not tracked:  # computed without autograd (under torch.no_grad): cached, it would cut the gradient
            _forget_new_lazies(dists, before, keep_plated=False)
        restore_lazy_plates(d)
        _forget_new_lazies(dists, before, keep_plated=True)


def _forget_new_lazies(dists: list[Distribution], before: list[set], keep_plated: bool) -> None:
    """Drop the lazy properties cached since ``before`` (only the plain ones when ``keep_plated``)."""
    for dist, names in zip(dists, before):
        lazy = _lazy_property_names(type(dist))
        for name in [n for n in dist.__dict__ if n not in names and n in lazy]:
            if not keep_plated or type(dist.__dict__[name]) is torch.Tensor:
                del dist.__dict__[name]


def without_plate(d: Distribution, plate: Plate) -> Distribution:
    """A copy of ``d`` (and of the distributions nested in it) whose tensors no longer carry the size-1
    ``plate``: that dimension is dropped from each tensor that carries it (a view) and from the batch
    shape. ``d`` itself is left as it is.

    A step of a single-sample chain (`storch.plate.ChainPlate`) keeps such a
    copy of its distribution: its own plate replaced the step its distribution carried, so that its
    samples and distribution have the same plates, as any node's.
    """
    if plate.size != 1:
        raise ValueError(f"without_plate: plate {plate.name!r} has size {plate.size}; only a size-1 plate can be dropped.")
    result = copy_distribution(d)
    dropped: dict[int, Tensor] = {}  # id of a tensor -> its view without the plate (one per tensor:
    for dist in with_nested(result):  # ``Categorical._param`` is its ``logits``)
        position = None
        layout = distribution_layout(dist)
        for i, p in enumerate(layout.plates):
            if p is plate:
                position = i
        values = dist.__dict__
        for name, value in list(values.items()):
            if isinstance(value, Tensor) and any(p is plate for p in value._layout.plates):
                squeezed = dropped.get(id(value))
                if squeezed is None:
                    i = value._layout.position(plate)
                    with _Disable():
                        squeezed = dropped[id(value)] = wrap_new(value.select(i, 0), value._layout.without_position(i))
                values[name] = squeezed
        if position is not None and len(dist._batch_shape) > position:
            shape = tuple(dist._batch_shape)
            dist._batch_shape = torch.Size(shape[:position] + shape[position + 1:])
    return result


def copy_distribution(d: Distribution) -> Distribution:
    """A shallow copy of ``d`` and of the distributions nested in it (their tensors are shared)."""
    c = copy.copy(d)
    for name, value in c.__dict__.items():
        if isinstance(value, Distribution):
            c.__dict__[name] = copy_distribution(value)
    return c


def log_prob_of_own_samples(d: Distribution, samples: torch.Tensor) -> torch.Tensor:
    """``d.log_prob(samples)`` for samples that ``d`` (or an enumeration of its support) produced.

    Such samples are in the support by construction, so argument validation of this one call is
    skipped on this distribution object only (restored afterwards; torch's global default is
    untouched). It costs about as much as the log-probability itself.
    """
    dists = with_nested(d)
    saved = [dist.__dict__.get("_validate_args", None) for dist in dists]
    try:
        for dist in dists:
            dist._validate_args = False
        with lazy_plates_kept(d):
            return d.log_prob(samples)
    finally:
        for dist, old in zip(dists, saved):
            if old is None:
                del dist.__dict__["_validate_args"]
            else:
                dist._validate_args = old


def walk_backward_graph(tensor: torch.Tensor) -> Iterator[object]:
    """Every autograd node reachable backwards from ``tensor`` (breadth first)."""
    start = tensor.grad_fn
    if start is None:
        return
    seen = {start}
    queue = [start]
    while queue:
        node = queue.pop(0)
        yield node
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)


def has_differentiable_path(output: torch.Tensor, input: torch.Tensor) -> bool:  # noqa: A002
    """True if gradients flow from ``output`` back to ``input`` through the autograd graph.

    Examples:
        >>> import torch
        >>> a = torch.ones(2, requires_grad=True); b = torch.ones(2, requires_grad=True)
        >>> has_differentiable_path((a * 2).sum(), a), has_differentiable_path((a * 2).sum(), b)
        (True, False)
    """
    if not (output.requires_grad and input.requires_grad):
        return False
    target = input.grad_fn
    for node in walk_backward_graph(output):
        if node is target:
            return True
        if target is None and getattr(node, "variable", None) is input:
            return True
    return False


def has_backwards_path(output: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[bool]:
    """`storch.util.has_differentiable_path` for several inputs."""
    return [has_differentiable_path(output, i) for i in inputs]


def topological_sort(costs: Iterable[torch.Tensor]) -> list[StochasticTensor]:
    """The stochastic nodes upstream of ``costs``, parents before children.

    Storch reads the graph of stochastic nodes from the plates: every node owns a plate, and a value
    computed from a node's samples carries that plate.
    """
    plates: dict[int, Plate] = {}
    for cost in costs:
        for plate in layout_of(cost).plates:
            stack = [plate]
            while stack:
                p = stack.pop()
                if p.node is not None and id(p) not in plates:
                    plates[id(p)] = p
                    stack.extend(p.parents)
    return [p.node.stochastic_tensor() for p in order_plates(list(plates.values()))]  # type: ignore[union-attr]


def print_graph(costs: Iterable[torch.Tensor]) -> None:
    """Print the stochastic nodes and costs, with their plates and methods."""
    costs = list(costs)
    for node in topological_sort(costs):
        parents = [p.name for p in node.plate.parents]
        print(
            f"node {node.name!r}: {type(node.distribution).__name__}, "
            f"{type(node.method).__name__}, n={node.n}, parent plates {parents}"
        )
    for i, cost in enumerate(costs):
        name = cost.name if isinstance(cost, CostTensor) else f"cost {i}"
        print(f"cost {name!r}: plates {list(layout_of(cost).names)}")


def split(
    tensor: Tensor,
    plate: Plate | str,
    *,
    amt_slices: int | None = None,
    slices: Sequence[slice] | None = None,
    create_plates: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Split a tensor along a plate into detached pieces (for estimators, logging and debugging).

    Args:
        amt_slices: split into this many (nearly) equal pieces; or
        slices: explicit slices of the plate.
        create_plates: give each piece a fresh independent plate with the same name and the piece's
            size; otherwise the pieces are plain tensors.
    """
    layout = layout_of(tensor)
    idx = layout.index(plate)
    size = layout.sizes[idx]
    if (amt_slices is None) == (slices is None):
        raise ValueError("split: give exactly one of amt_slices or slices.")
    if slices is None:
        bounds = torch.linspace(0, size, amt_slices + 1).round().long().tolist()  # type: ignore[operator]
        slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    pieces = []
    with _Disable():
        for s in slices:
            raw = tensor.detach()[(slice(None),) * idx + (s,)]
            if create_plates:
                plates = list(layout.plates)
                old = plates[idx]
                plates[idx] = Plate(old.name, raw.shape[idx], parents=old.parents)
                pieces.append(wrap_new(raw.clone(), layout_of_plates(plates)))
            else:
                pieces.append(raw.clone())
    return tuple(pieces)


def rsample_gumbel(distr: Distribution, n: int) -> torch.Tensor:
    """``n`` samples of the perturbed log-probabilities ``log p + G`` (G standard Gumbel)."""
    logits = distr.logits
    g = -torch.log(-torch.log(torch.rand((n,) + tuple(logits.shape), dtype=logits.dtype, device=logits.device)))
    return logits + g


def rsample_gumbel_softmax(
    distr: Distribution, n: int, temperature: torch.Tensor | float, straight_through: bool = False
) -> torch.Tensor:
    """``n`` Gumbel-softmax (Concrete) samples of a discrete distribution.

    With ``straight_through`` the forward value is the discrete sample and the gradient is that of
    the relaxed sample.
    """
    relaxation = relaxation_for(distr)
    if relaxation is None:
        raise ValueError(
            f"No Gumbel-softmax relaxation is registered for {type(distr).__name__}; supported: "
            "OneHotCategorical, Bernoulli (register one with storch.distributions.relaxation.register_relaxation)."
        )
    # a CPU scalar combines with parameters on any device (also under torch.set_default_device)
    t = temperature if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature), device="cpu")
    soft = relaxation.relaxed(distr, t).rsample((n,))
    if not straight_through:
        return soft
    hard = relaxation.hard(soft)
    return hard + (soft - soft.detach())


def tensor_stats(tensor: torch.Tensor) -> str:
    """A one-line summary: shape, plates, mean, std, min, max."""
    with _Disable():
        t = tensor.detach().float()
        return (
            f"shape={tuple(t.shape)} plates={list(layout_of(tensor).names)} mean={t.mean():.4g} "
            f"std={t.std() if t.numel() > 1 else 0.0:.4g} min={t.min():.4g} max={t.max():.4g}"
        )


def reduce_mean(tensor: torch.Tensor, keep_dims: Sequence[int]) -> torch.Tensor:
    """Mean over every dimension of one sample except ``keep_dims``; plate dimensions are always kept.

    ``keep_dims`` count the tensor's ``shape``, plates first, and from the right when negative (the
    rule of `storch.ops`); naming a plate dimension among them changes nothing, since
    plates are only reduced by name (`storch.reduce_plates`).

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.arange(24.0).reshape(2, 3, 4), 0, "data")
        >>> reduce_mean(x, [-2]).shape, reduce_mean(torch.ones(3, 4), [0]).shape
        (torch.Size([2, 3]), torch.Size([3]))
    """
    ndim = tensor.dim()
    for k in keep_dims:
        if not -ndim <= k < ndim:
            raise IndexError(
                f"reduce_mean: keep_dims entry {k} is out of range for a tensor of shape {tuple(tensor.shape)}."
            )
    keep = {k % ndim for k in keep_dims} | set(range(len(layout_of(tensor).sizes)))
    dims = [d for d in range(ndim) if d not in keep]
    return tensor.mean(dim=dims) if dims else tensor

