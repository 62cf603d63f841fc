"""Storch tensors: ``torch.Tensor`` subclasses that carry plates.

* `storch.tensor.Tensor` — any tensor computed from plated values. It *is* a ``torch.Tensor``: it works with
  every torch function, ``nn.Module`` and optimizer; plates propagate through ``__torch_function__``
  (see `storch._dispatch`).
* `storch.tensor.StochasticTensor` — the samples of a stochastic node, returned by a
  `storch.method.Method`.
* `storch.tensor.CostTensor` — a cost registered with `storch.add_cost`.
* `storch.tensor.IndependentTensor` — a tensor with a new independent plate
  (`storch.denote_independent`, `storch.gather_samples`).

Examples:
    >>> import torch, storch
    >>> x = storch.denote_independent(torch.ones(3, 2), 0, "data")
    >>> y = x * 2 + 1
    >>> type(y).__name__, y.plates
    ('Tensor', [('data', 3, tensor(0.3333))])
"""

from __future__ import annotations

import operator
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.distributions import Distribution

from storch import _dispatch
from storch._dispatch import no_dispatch, torch_function
from storch.exceptions import IllegalStorchExposeError, IllegalStorchIndexError
from storch import plate as plate_module
from storch.plate import EMPTY_LAYOUT, Plate, PlateLayout, layout_of_plates

if TYPE_CHECKING:  # pragma: no cover
    from storch.method.method import Method

__all__ = ["Tensor", "StochasticTensor", "CostTensor", "IndependentTensor", "StochasticNode", "is_storch", "is_tensor"]

_Disable = no_dispatch  # the one way to turn storch's dispatch off (storch._dispatch.no_dispatch)
_T = torch.Tensor
# ``func(*args)`` with torch functions of subclasses disabled, in C (no context manager)
_call_plain = torch._C._disabled_torch_function_impl
_SHAPE, _NDIM, _DTYPE, _DEVICE = (getattr(_T, name).__get__ for name in ("shape", "ndim", "dtype", "device"))
# torch's check of a value before ``log_prob``, which `Tensor.size` answers with the aligned shape
_VALIDATE_SAMPLE = Distribution._validate_sample.__code__
_GRAD, _SET_GRAD = _T.grad.__get__, _T.grad.__set__
# storch._validation.size_to_validate, once imported (it builds on this module): `Tensor.size` calls it
# three times per log_prob, and an import statement costs more than the call
_SIZE_TO_VALIDATE: list = []


def _read_by_torch(frame: Any) -> bool:
    """Whether ``frame`` runs torch's own code (its tracing and fake tensors read ``.grad`` of every
    tensor they meet), not a user's."""
    module = frame.f_globals.get("__name__", "")
    return module == "torch" or module.startswith("torch.")


def alias(t: torch.Tensor) -> torch.Tensor:
    """A new plain-tensor object viewing ``t`` (storch or plain) and attached to its autograd graph."""
    with _Disable():
        return t.view_as(t)


def _retype(t: torch.Tensor, cls: type, layout: PlateLayout) -> "Tensor":
    """Give a freshly created plain tensor the storch class ``cls`` and ``layout`` (no copy)."""
    t.__class__ = cls
    t._layout = layout
    return t


def _single_value(method: Any, what: str, error: type = IllegalStorchExposeError) -> Any:
    """``method`` of torch.Tensor, refused with ``error`` when the tensor holds several samples."""

    def convert(self: "Tensor", *args: Any, **kwargs: Any) -> Any:
        self._check_single_sample(what, error)
        with warnings.catch_warnings(record=True) as caught, _Disable():
            warnings.simplefilter("always")
            value = method(self, *args, **kwargs)
        for w in caught:  # torch's warnings (e.g. a scalar from a tensor that requires grad), at the caller
            warnings.warn(w.message, w.category, stacklevel=2)
        return value

    convert.__name__ = method.__name__
    convert.__doc__ = f"{what} of a tensor whose plates all have size 1 (else `IllegalStorchExposeError`)."
    return convert


def _storchastic_plates(cls_name: str, parents: Any, rest: tuple) -> Sequence[Plate]:
    """The plates of Storchastic's constructor form ``Tensor(data, parents, plates, name)``.

    ``parents`` (the storch tensors ``data`` was computed from) and ``name`` are not kept: torch's
    autograd graph already links a tensor to its inputs, and a `Tensor` has no name.
    """
    if len(rest) != 2 or not isinstance(rest[1], str) or not isinstance(parents, (list, tuple)):
        raise TypeError(
            f"storch.{cls_name}(data, plates) takes a tensor and its plates; Storchastic's form "
            f"storch.{cls_name}(data, parents, plates, name) needs a list of parents, a list of plates and a "
            f"str name, got {len(rest) + 2} arguments."
        )
    if not all(isinstance(p, torch.Tensor) for p in parents):
        raise TypeError(f"storch.{cls_name}(data, parents, plates, name): parents must be tensors.")
    return rest[0]


class Tensor(torch.Tensor):
    """A ``torch.Tensor`` whose leftmost dimensions are named plates.

    ``storch.Tensor(data, plates)`` wraps ``data`` (a view is taken; the input is left untouched)
    with ``plates`` on its leftmost dimensions, newest first; their sizes must match ``data.shape``.
    Storchastic's form ``storch.Tensor(data, parents, plates, name)`` is taken too; its parents
    and name are not kept (torch's autograd graph links the tensor to its inputs).

    Examples:
        >>> import torch, storch
        >>> samples = storch.Tensor(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), [storch.Plate("s", 3)])
        >>> samples.plate_names, tuple(samples.shape)
        (['s'], (3, 2))
        >>> event_sum = samples.sum(-1)                 # event dimensions reduce as for one sample
        >>> event_sum.plain().tolist(), storch.reduce_plates(event_sum, "s").item()
        ([3.0, 7.0, 11.0], 7.0)
        >>> (samples * torch.tensor([1.0, -1.0])).plain().tolist()   # a plain tensor is one sample's event
        [[1.0, -2.0], [3.0, -4.0], [5.0, -6.0]]

    Plates align automatically in every torch operation; see `storch._dispatch`.
    """

    _layout: PlateLayout = EMPTY_LAYOUT

    def __new__(cls, data: torch.Tensor, plates: Sequence[Plate] = (), *storchastic: Any) -> "Tensor":
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"storch.{cls.__name__} wraps a torch.Tensor, got {type(data).__name__}.")
        if storchastic:
            plates = _storchastic_plates(cls.__name__, plates, storchastic)
        layout = layout_of_plates(plates)
        if tuple(data.shape[: len(layout.sizes)]) != layout.sizes:
            raise ValueError(
                f"Tensor of shape {tuple(data.shape)} cannot carry plates {list(layout.names)} of "
                f"sizes {layout.sizes}: the plates must be its leftmost dimensions."
            )
        return _retype(alias(data), cls, layout)

    __torch_function__ = classmethod(torch_function)

    # ------------------------------------------------------ metadata, read directly
    # Shape queries carry no plates, but as Tensor methods they would each pay a trip through
    # __torch_function__ (~0.8 us, several per torch.distributions call). These read the plain
    # metadata with torch functions of subclasses disabled, in C (~0.2 us); modes still see them.
    def dim(self) -> int:
        return _call_plain(_T.dim, (), (self,))

    ndimension = dim  # (torch.distributions asks every Categorical's parameter)

    def size(self, *args: Any, **kwargs: Any) -> Any:
        """The shape, as ``torch.Tensor.size``; to torch's check of a value before ``log_prob``
        (``Distribution._validate_sample``), the shape once aligned with the distribution's plates
        (see ``storch._validation``)."""
        if kwargs:  # size(dim=0)
            return _call_plain(_T.size, (), (self, *args), kwargs)
        if not args and self._layout.sizes:
            caller = sys._getframe(1)
            if caller.f_code is _VALIDATE_SAMPLE:
                if not _SIZE_TO_VALIDATE:
                    from storch._validation import size_to_validate  # it builds on this module

                    _SIZE_TO_VALIDATE.append(size_to_validate)
                return _SIZE_TO_VALIDATE[0](self, caller.f_locals.get("self"))
        return _call_plain(_T.size, (), (self, *args))

    @property
    def shape(self) -> torch.Size:
        return _call_plain(_SHAPE, (), (self,))

    @property
    def ndim(self) -> int:
        return _call_plain(_NDIM, (), (self,))

    @property
    def dtype(self) -> torch.dtype:
        return _call_plain(_DTYPE, (), (self,))

    @property
    def device(self) -> torch.device:
        return _call_plain(_DEVICE, (), (self,))

    # ------------------------------------------------------------------ plates
    @property
    def plates(self) -> list[Plate]:
        """The plates of the leftmost dimensions, newest first."""
        return list(self._layout.plates)

    @property
    def plate_names(self) -> list[str]:
        return list(self._layout.names)

    @property
    def event_shape(self) -> torch.Size:
        """The shape of one sample: the dimensions right of the plates."""
        with _Disable():
            return self.shape[len(self._layout.sizes):]

    def plain(self) -> torch.Tensor:
        """The data as a plain ``torch.Tensor``: a view, plate dimensions included, in the same graph.

        What to reach for when a tensor holds several samples and you want their raw values (``.item()``
        and ``.tolist()`` refuse a tensor with a plate of size > 1), or to hand them to code that
        should not see plates. Operations on the result are plain torch: nothing aligns plates, and
        gradients flow back into ``t``.

        Examples:
            >>> import torch, storch
            >>> t = storch.Tensor(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [storch.Plate("s", 2)])
            >>> type(t.plain()).__name__, t.plain().tolist(), t.plain().sum(0).tolist()
            ('Tensor', [[1.0, 2.0], [3.0, 4.0]], [4.0, 6.0])
        """
        return alias(self)

    @property
    def _tensor(self) -> torch.Tensor:
        """Storchastic's name for ``t.plain()``."""
        return alias(self)

    def detach_tensor(self) -> torch.Tensor:
        """The data as a plain ``torch.Tensor``, detached from the graph, plate dimensions included.

        Storchastic's name; the same as ``t.plain().detach()``. For a detached storch tensor that keeps
        its plates, use ``t.detach()``.
        """
        return alias(self).detach()

    def stochastic(self) -> bool:
        """True if this is a stochastic node in the stochastic computation graph."""
        return False

    def is_cost(self) -> bool:
        return False

    # ------------------------------------------------------------- conversions
    def _check_single_sample(self, what: str, error: type = IllegalStorchExposeError) -> None:
        big = [f"{p.name!r} (size {p.size})" for p in self._layout.plates if p.size > 1]
        if big:
            raise error(
                f"{what} needs a single value, but this tensor holds several samples along plates "
                f"{', '.join(big)}. Reduce them first, e.g. storch.reduce_plates(t) for the weighted "
                "mean over all plates, or t.plain() for the raw values."
            )

    __bool__ = _single_value(torch.Tensor.__bool__, "bool()")
    item = _single_value(torch.Tensor.item, ".item()")
    tolist = _single_value(torch.Tensor.tolist, ".tolist()")
    __float__ = _single_value(torch.Tensor.__float__, "float()")
    __int__ = _single_value(torch.Tensor.__int__, "int()")
    __index__ = _single_value(torch.Tensor.__index__, "Use as an index (range(t), a list index, __index__)",
                              IllegalStorchIndexError)
    __complex__ = _single_value(torch.Tensor.__complex__, "complex()")
    __contains__ = _single_value(torch.Tensor.__contains__, "`x in t`")
    numpy = _single_value(torch.Tensor.numpy, ".numpy()")
    __array__ = _single_value(torch.Tensor.__array__, "numpy.asarray()")

    # ----------------------------------------------------------------- display
    _kind = "Deterministic"

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with _Disable():
            body = repr(self.detach().view_as(self))
            grad_fn = self.grad_fn
            if grad_fn is not None:
                body = f"{body[:-1]}, grad_fn=<{type(grad_fn).__name__}>)"
            elif self.requires_grad:
                body = f"{body[:-1]}, requires_grad=True)"
        return f"{self._kind} {body} plates: {list(self._layout.plates)}"

    def __format__(self, spec: str) -> str:
        if not spec:
            return repr(self)
        with _Disable():
            return torch.Tensor.__format__(self, spec)

    def __reduce_ex__(self, proto: int):
        raise TypeError(
            "storch tensors hold references to their stochastic nodes and cannot be pickled; "
            "save t.plain() (a plain tensor) and t.plate_names instead."
        )


_dispatch.Tensor = Tensor


class StochasticNode:
    """What the surrogate loss needs to know about a sampled node; owned by its `storch.tensor.Plate`.

    The plate holds the node (``plate.node``); the node refers back to its plate, and to its layout
    (the plate and the parents' plates), only weakly. So no reference cycle ties a step's samples and
    distribution to their plate: they are freed as soon as the last tensor carrying the plate goes,
    without waiting for Python's cyclic garbage collector (on a GPU, that is device memory). It
    keeps a plain view of the samples, not the user's `storch.tensor.StochasticTensor`, for the
    same reason.
    """

    __slots__ = (
        "name", "method", "_distribution", "_step_dim", "samples", "param_grads", "parents", "own_log_prob", "_plate",
        "_layout",
    )

    def __init__(
        self,
        name: str,
        method: "Method",
        distribution: Distribution,
        samples: torch.Tensor,
        layout: PlateLayout,
        plate: Plate,
    ) -> None:
        self.name = name
        self.method = method
        self.distribution = distribution
        self.samples = samples
        self.param_grads: dict[str, torch.Tensor] = {}
        parents = layout.plates[1:]  # other nodes' plates: no cycle
        same = plate.parents  # the plate's own tuple where it holds these plates: one object fewer per node
        if len(same) == len(parents) and all(map(operator.is_, same, parents)):
            parents = same
        self.parents: tuple[Plate, ...] = parents
        #: ``(distribution.log_prob(samples), its version)`` (plain), once `StochasticTensor.log_prob`
        #: computed it with gradients enabled; see `shared_log_prob`
        self.own_log_prob: tuple[torch.Tensor, int] | None = None
        self._plate = weakref.ref(plate)
        self._layout = weakref.ref(layout)

    @property
    def distribution(self) -> Distribution:
        """The distribution of the samples; its tensors carry the plates the samples carry besides the node's.

        A step of a single-sample chain was drawn from a distribution that still carries the chain's
        previous step as a size-1 plate (`step_of_chain`); the copy without it is made on the first read
        (a rollout whose surrogate needs only the log-probabilities never makes it).
        """
        if self._step_dim is not None:
            from storch.util import without_plate  # it builds on this module

            ancestor = self.plate.ancestor  # type: ignore[attr-defined]
            self._distribution, self._step_dim = without_plate(self._distribution, ancestor), None
        return self._distribution

    @distribution.setter
    def distribution(self, distribution: Distribution) -> None:
        self._distribution, self._step_dim = distribution, None

    def step_of_chain(self, distribution: Distribution, dim: int) -> None:
        """Keep ``distribution``, which still carries the previous step of the node's chain (its plate's
        ``ancestor``) as a size-1 plate at dimension ``dim`` of the drawn samples, which the node's samples
        dropped; `distribution` gives its copy without that plate when first read."""
        self._distribution, self._step_dim = distribution, dim

    def drawn_distribution(self) -> tuple[Distribution, Plate | None]:
        """The distribution the surrogate's log-probabilities come from, and the chain's previous step
        that it still carries as a size-1 plate (``None`` once `distribution`'s copy is made, or for a
        node that is no chain step)."""
        if self._step_dim is None:
            return self._distribution, None
        return self._distribution, self.plate.ancestor  # type: ignore[attr-defined]

    def distribution_if_made(self) -> Distribution | None:
        """`distribution` if it was read or needs no copy; ``None`` for a chain step's copy not made yet."""
        return self._distribution if self._step_dim is None else None

    def own_samples_log_prob(self) -> torch.Tensor:
        """``log p(samples)`` (plain; call with storch dispatch disabled): for a chain step whose
        distribution's copy was not made, computed from the distribution it was drawn from, on the
        samples with the previous step's size-1 dimension put back (the same values, no copy)."""
        from storch.util import log_prob_of_own_samples  # it builds on this module

        dim = self._step_dim
        if dim is None:
            return log_prob_of_own_samples(self._distribution, self.samples)
        return log_prob_of_own_samples(self._distribution, self.samples.unsqueeze(dim)).select(dim, 0)

    @property
    def plate(self) -> Plate:
        """The node's plate (alive while any tensor carries it, which is whenever the node is used)."""
        plate = self._plate()
        if plate is None:  # pragma: no cover - only reachable through a node kept without its plate
            raise RuntimeError(f"The plate of node {self.name!r} no longer exists: no tensor carries it.")
        return plate

    @property
    def layout(self) -> PlateLayout:
        """The plates of the samples: the node's plate, then its parents' plates."""
        layout = self._layout()
        if layout is None:  # every tensor with exactly this layout is gone: the interned one again
            layout = layout_of_plates((self.plate,) + self.parents)
            self._layout = weakref.ref(layout)
        return layout

    @property
    def parent_layout(self) -> PlateLayout:
        """The plates of the node's distribution: its samples' plates without its own."""
        return layout_of_plates(self.parents)

    def shared_log_prob(self, view: bool = True) -> torch.Tensor | None:
        """A new plain view of ``distribution.log_prob(samples)`` as
        `storch.tensor.StochasticTensor.log_prob` computed it, for the
        surrogate loss to reuse; ``None`` if it was not computed with gradients enabled, or was
        written in place since (a user's ``lp.mul_(2)`` would change the gradient). ``view=False``: the
        node's own tensor itself, for a caller that only computes new tensors from it (no view in
        the graph); it must not be retyped or written."""
        if self.own_log_prob is None:
            return None
        log_p, version = self.own_log_prob
        if log_p._version != version:
            return None
        return alias(log_p) if view else log_p

    def stochastic_tensor(self) -> "StochasticTensor":
        """A `storch.tensor.StochasticTensor` view of the samples (shares the node's
        ``param_grads``)."""
        return StochasticTensor._from_node(alias(self.samples), self)


def new_node(
    method: "Method", distribution: Distribution, samples: torch.Tensor, plate: Plate, parents: Sequence[Plate]
) -> "StochasticTensor":
    """Make the plain ``samples`` (``(plate.size, *sizes of parents, *event)``) a stochastic node on
    ``plate`` over the ``parents`` plates, owned by ``method``; returns its
    `storch.tensor.StochasticTensor`.

    ``plate`` becomes the node's plate (``plate.node``); its weight is left as it is.
    """
    layout = layout_of_plates((plate,) + tuple(parents))
    node = StochasticNode(plate.name, method, distribution, samples, layout, plate)
    plate.node = node
    return node.stochastic_tensor()


class StochasticTensor(Tensor):
    """Samples of a stochastic node.

    Attributes:
        name: the node's name (also the name of its plate).
        n: the number of samples (the size of its plate).
        distribution: the distribution the samples were drawn from.
        method: the `storch.method.Method` that estimates gradients for this node.
        param_grads: after `storch.backward`, the gradient of the surrogate loss with respect
            to each distribution parameter that requires grad, by parameter name.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Normal
        >>> mu = torch.tensor(0.5, requires_grad=True)
        >>> z = storch.method.Reparameterization("z", n_samples=4)(Normal(mu, 1.0))
        >>> z.name, z.n, type(z.distribution).__name__, z.plate_names
        ('z', 4, 'Normal', ['z'])
        >>> storch.add_cost(z * 2.0, "f"); _ = storch.backward()
        >>> z.param_grads["loc"]
        tensor(2.)
    """

    _kind = "Stochastic"
    _node: StochasticNode

    @classmethod
    def _from_node(cls, samples: torch.Tensor, node: StochasticNode) -> "StochasticTensor":
        t = _retype(samples, cls, node.layout)
        t._node = node
        return t

    def __new__(cls, *args: Any, **kwargs: Any) -> "StochasticTensor":
        raise TypeError(
            "StochasticTensor objects are made by sampling with a storch.method.Method, e.g. "
            "storch.method.ScoreFunction('z', n_samples=8)(distribution)."
        )

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._node.name

    @property
    def n(self) -> int:
        return self._node.plate.size

    @property
    def plate(self) -> Plate:
        return self._node.plate

    @property
    def distribution(self) -> Distribution:
        return self._node.distribution

    @property
    def method(self) -> "Method":
        return self._node.method

    @property
    def param_grads(self) -> dict[str, torch.Tensor]:
        return self._node.param_grads

    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        """torch's gradient of these samples (``None`` unless ``retain_grad()`` asked for it), with a
        warning that names ``param_grads`` when it is ``None``: Storchastic's ``z.grad`` was the dict
        of the distribution parameters' gradients, which storch calls ``z.param_grads``."""
        with _Disable():
            value = _GRAD(self)
        if value is None and not _read_by_torch(sys._getframe(1)):
            warnings.warn(
                f"z.grad of the samples of node {self.name!r} is torch's gradient of the samples, None "
                f"here. The gradients of its distribution's parameters (Storchastic's z.grad dict) are "
                f"z.param_grads (keys {sorted(self.param_grads)}); for the samples' own gradient, call "
                "z.retain_grad() before storch.backward().",
                UserWarning,
                stacklevel=2,
            )
        return value

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        with _Disable():
            _SET_GRAD(self, value)

    def log_prob(self) -> Tensor:
        """``log p(z)`` of these samples under their distribution, per element and with their plates:
        the values of ``self.distribution.log_prob(self)``.

        Computed once per node, and shared with the surrogate loss: an estimator that needs
        ``log p(z)`` of the node's samples (`ScoreFunction`, `VIMCO`, `RELAX`, …) reuses this tensor
        instead of computing it again, as a hand-written step reuses its ``log q(z)``. So in a
        model whose cost contains the samples' own log-probability (the ``log q(z|x)`` of a negative
        ELBO), ``z.log_prob()`` is the cheaper way to write ``q.log_prob(z)``: the same values and
        gradients, one log-probability per step instead of two. (Computed with gradients disabled,
        it is not kept, so that the surrogate loss still gets its gradient.) The samples were drawn
        from the distribution, so torch's check that they lie in its support (a pass over the values,
        as long as the log-probability of a Bernoulli) is skipped for them.

        Relaxed samples (`GumbelSoftmax` and its sparse variants without ``straight_through``,
        `REBAR` and ``RELAX(rebar=True)`` at their relaxed points: estimators whose
        ``relaxes_samples`` is true) lie between the values of a discrete distribution's support,
        where ``q.log_prob`` is not defined (torch's validation refuses them; storch's message names
        the node). For them it returns the continuous extension of ``log p`` that the relaxations'
        papers evaluate an ELBO's ``log q`` with (Maddison et al. 2017, Concrete; Jang et al. 2017,
        Gumbel-softmax; Tucker et al. 2017, REBAR; Grathwohl et al. 2018, RELAX):
        ``z·log p + (1 − z)·log(1 − p)`` for a Bernoulli, ``Σ_k z_k log p_k`` for a
        OneHotCategorical (``storch.distributions.relaxation.continuous_log_prob``),
        equal to ``q.log_prob(z)`` at discrete values and differentiable in ``z`` (pathwise) and in
        the parameters. It is not shared with the surrogate loss.

        Examples:
            >>> import torch, storch
            >>> from torch.distributions import Bernoulli
            >>> logits = torch.tensor([0.3, -1.2], requires_grad=True)
            >>> q = Bernoulli(logits=logits)
            >>> z = storch.method.ScoreFunction("z", n_samples=3)(q)
            >>> torch.equal(z.log_prob().plain(), q.log_prob(z).plain()), z.log_prob().plate_names
            (True, ['z'])
        """
        node = self._node
        if getattr(node.method, "relaxes_samples", False):
            return _continuous_log_prob(node)
        log_p = node.shared_log_prob()
        if log_p is None:
            with no_dispatch():  # the node's own samples: in the support, so torch's check of them is skipped
                log_p = node.own_samples_log_prob()
            if torch.is_grad_enabled():
                node.own_log_prob = (log_p, log_p._version)
                log_p = alias(log_p)  # the user's own object: the node's copy is never retyped
        return wrap_new(log_p, node.layout)

    def stochastic(self) -> bool:
        return True


def _continuous_log_prob(node: StochasticNode) -> Tensor:
    """``log p`` of a node's relaxed samples, continuously extended (see `StochasticTensor.log_prob`)."""
    from storch.distributions.relaxation import continuous_log_prob
    from storch.util import lazy_plates_kept  # util builds on this module

    with no_dispatch(), lazy_plates_kept(node.distribution):
        log_p = continuous_log_prob(node.distribution, node.samples)
    return wrap_new(log_p, node.layout)


class CostTensor(Tensor):
    """A cost node: one value per combination of its plates (no event dimensions).

    `storch.add_cost` registers a cost under a name and keeps storch's own view of it as a
    ``CostTensor``; `storch.backward` estimates the gradient of the sum of the expected costs.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> p = torch.tensor(0.25, requires_grad=True)
        >>> x = storch.method.Expect("x")(Bernoulli(p))          # x = 0 (weight 0.75) and x = 1 (0.25)
        >>> storch.add_cost(3.0 * x + 1.0, "cost")
        >>> [(type(c).__name__, c.name, c.plain().tolist()) for c in storch.registered_costs()]
        [('CostTensor', 'cost', [1.0, 4.0])]
        >>> storch.backward().item(), p.grad.item()                # E[3x + 1] = 1.75, d/dp = 3
        (1.75, 3.0)
    """

    _kind = "Cost"
    #: the name the cost was registered under (see `storch.tensor.CostTensor.name`)
    _name: str = "cost"

    def __new__(cls, data: torch.Tensor, plates: Sequence[Plate] = (), name: Any = "cost", *storchastic: Any) -> "CostTensor":
        if storchastic:  # Storchastic's CostTensor(data, parents, plates, name)
            plates, name = _storchastic_plates(cls.__name__, plates, (name, *storchastic)), storchastic[-1]
        t = super().__new__(cls, data, plates)
        t._name = name
        return t

    @classmethod
    def _retype_as(cls, t: torch.Tensor, layout: PlateLayout, name: str) -> "CostTensor":
        """Make the fresh plain tensor ``t`` (held by nobody else) a cost named ``name`` (no copy)."""
        cost = _retype(t, cls, layout)
        cost._name = name
        return cost  # type: ignore[return-value]

    @property
    def name(self) -> str:  # type: ignore[override]
        """The name the cost was registered under."""
        return self._name

    def is_cost(self) -> bool:
        return True


class IndependentTensor(Tensor):
    """A tensor whose leftmost plate indexes independent values (a minibatch, repeated estimates).

    Made by `storch.denote_independent` and
    `storch.gather_samples`. Its plate is
    compared by name and size, so a minibatch plate re-created in every step is the same plate, and
    its weight is ``1/size``: `storch.reduce_plates` averages over it.

    Examples:
        >>> import torch, storch
        >>> x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 5.0]]), 0, "data")
        >>> type(x).__name__, x.plates[0].name, x.plates[0].size
        ('IndependentTensor', 'data', 2)
        >>> storch.reduce_plates(x.sum(-1), "data").item()           # (3 + 8) / 2
        5.5
        >>> x.plates[0] == storch.denote_independent(torch.zeros(2, 7), 0, "data").plates[0]
        True
    """

    _kind = "Independent"


def is_storch(t: Any) -> bool:
    """True for a `storch.Tensor`."""
    return isinstance(t, Tensor)


def is_tensor(t: Any) -> bool:
    """True for any tensor, plain ``torch.Tensor`` or `storch.Tensor` (Storchastic's
    ``storch.is_tensor``); `storch.tensor.is_storch` is true for storch tensors only.

    Examples:
        >>> import torch, storch
        >>> storch.is_tensor(torch.ones(2)), storch.is_storch(torch.ones(2)), storch.is_tensor(2.0)
        (True, False, False)
    """
    return isinstance(t, torch.Tensor)


def layout_of(t: Any) -> PlateLayout:
    """The plate layout of ``t`` (empty for plain tensors and other values)."""
    return t._layout if isinstance(t, Tensor) else EMPTY_LAYOUT


def node_of(t: torch.Tensor) -> StochasticNode:
    """The `storch.tensor.StochasticNode` of the samples ``t`` (a
    `storch.tensor.StochasticTensor`)."""
    if not isinstance(t, StochasticTensor):
        raise TypeError(
            f"node_of: expected the samples of a stochastic node (a storch.StochasticTensor returned "
            f"by a storch.method.Method), got {type(t).__name__}."
        )
    return t._node


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` view of ``t`` (itself if it is already plain)."""
    return alias(t) if isinstance(t, Tensor) else t


def wrap(t: torch.Tensor, layout: PlateLayout, cls: type = Tensor) -> Tensor:
    """A storch view of ``t`` with the given layout; ``t`` itself is left untouched."""
    return _retype(alias(t), cls, layout)


def wrap_new(t: torch.Tensor, layout: PlateLayout, cls: type = Tensor) -> Tensor:
    """Wrap a plain tensor that nobody else holds (no view is taken)."""
    return _retype(t, cls, layout)


plate_module._as_storch = wrap  # Plate.weight gives weights that carry other plates back as storch tensors

