"""Plates: named sample dimensions.

A *plate* is a left dimension of a `storch.Tensor` that indexes conditionally independent
samples: the samples of a stochastic node (``Method("z", n_samples=8)`` makes a plate ``z`` of size 8),
a minibatch (`storch.denote_independent`), or repeated estimates
(`storch.gather_samples`).
Each plate carries a *weight* used when it is reduced: ``1/n`` for i.i.d. samples, or a tensor for
importance or enumeration weights.

Layout rule: the plates of a tensor occupy its leftmost dimensions, newest plate first (a plate is
always created after the plates it depends on, so this is a reverse topological order). The
remaining dimensions are *event* dimensions and broadcast as in plain PyTorch.

Identity rule: the plate of a stochastic node is unique to that node. Two different nodes that use
the same plate name clash with an error instead of merging. Plates made by
`storch.denote_independent` or `storch.gather_samples` are
compared by name and size, so a
minibatch plate re-created in every training step is the same plate. The steps of a sequence decoded
step by step share a name by design (`storch.plate.AncestralPlate`): where two steps of one chain
meet,
the newer step is kept and the older tensor is re-indexed along the ancestry.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from storch.tensor import StochasticNode

__all__ = [
    "Plate", "AncestralPlate", "PlateLayout", "order_plates", "PlateClashError", "TooManyPlatesError",
    "layout_of_plates", "merge_layouts", "MAX_PLATES", "CUDA_MAX_DIMS", "CudaDimensionError", "ChainPlate",
]

_creation_counter = itertools.count()


class PlateClashError(ValueError):
    """Two different plates with the same name meet in one operation."""


def _not_ready(t: torch.Tensor, layout: "PlateLayout") -> torch.Tensor:  # pragma: no cover
    raise RuntimeError("storch.tensor has not been imported")


#: a storch view of a plain tensor with a layout: `storch.tensor.wrap`, set by `storch.tensor` when it
#: is imported (it imports this module, so this module cannot import it)
_as_storch = _not_ready

_uniform_weights: dict[int, torch.Tensor] = {}


def uniform_weight(size: int) -> torch.Tensor:
    """The (shared, read-only) weight ``1/size`` of i.i.d. samples.

    A CPU scalar, whatever ``torch.set_default_device`` says: a 0-dimensional CPU tensor combines
    with tensors on any device, a CUDA scalar does not combine with CPU tensors.
    """
    w = _uniform_weights.get(size)
    if w is None:
        w = _uniform_weights[size] = torch.tensor(1.0 / size, device="cpu")
    return w


class Plate:
    """A named sample dimension.

    Args:
        name: the plate name, e.g. ``"z"`` or ``"data"``.
        size: the number of samples along the dimension.
        weight: the weight of each sample when the plate is reduced; ``None`` means ``1/size``.
            A tensor weight may itself carry plates (e.g. enumeration weights ``p(x)``).
        parents: the plates this plate was created on top of (the plates of the distribution
            parameters of a stochastic node).
        node: the stochastic node that owns this plate, or ``None`` for an independent plate.

    Attributes:
        order: the creation order (newer plates have larger numbers).
        info: what the sampling method keeps about this plate's draw (``None`` if nothing).

    Two plates are equal when they have the same `storch.plate.Plate.identity`: a node's plate only equals
    itself, an independent plate equals every independent plate of its name and size.

    Examples:
        >>> p = Plate("gradients", 1000)
        >>> p
        ('gradients', 1000, tensor(0.0010))
        >>> p.name, p.size
        ('gradients', 1000)
        >>> p == Plate("gradients", 1000), p.identity      # independent: by name and size
        (True, ('gradients', 1000))
    """

    __slots__ = ("name", "size", "_weight", "_weight_plates", "parents", "node", "order", "info", "__weakref__")

    def __init__(
        self,
        name: str,
        size: int,
        weight: torch.Tensor | float | None = None,
        parents: Sequence["Plate"] = (),
        node: "StochasticNode | None" = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"A plate name must be a non-empty string, got {name!r}.")
        if int(size) < 1:
            raise ValueError(f"Plate {name!r} must have a positive size, got {size}.")
        self.name = name
        self.size = int(size)
        self.weight = uniform_weight(self.size) if weight is None else weight
        self.parents = tuple(parents)
        self.node = node
        self.order = next(_creation_counter)
        #: what the sampling method keeps about this plate's draw, for its estimator (e.g. the
        #: sampled set of a sampling without replacement, a beam step's scores); ``None`` if nothing
        self.info: object = None

    @property
    def n(self) -> int:
        """The plate size (the Storchastic manual's name for `size`)."""
        return self.size

    @property
    def weight(self) -> "torch.Tensor | float":
        """The weight of each sample when the plate is reduced (see the class docstring).

        A storch weight that carries this plate itself (one weight per sample, as for ``Expect``,
        ARM or importance sampling) is kept as its plain values and the *other* plates, and given
        back as a storch tensor on each read: stored as it is, it would hold this plate through its
        layout, a reference cycle that keeps the node's samples and distribution (GPU memory) alive
        until Python's cyclic garbage collector runs.
        """
        plates = self._weight_plates
        if plates is None:
            return self._weight
        return _as_storch(self._weight, layout_of_plates(tuple(self if p is None else p for p in plates)))

    @weight.setter
    def weight(self, value: "torch.Tensor | float") -> None:
        layout = getattr(value, "_layout", None)  # only storch tensors have one
        if layout is not None and any(p is self for p in layout.plates):
            # A plain copy, still in the autograd graph (clone saves nothing for its backward). Not a
            # view: a view keeps its base's Python object, and so the base's layout, alive from C++.
            with torch._C.DisableTorchFunctionSubclass():
                self._weight = value.clone()
            self._weight_plates = tuple(None if p is self else p for p in layout.plates)
        else:
            self._weight = value
            self._weight_plates = None

    def weight_vector(self) -> torch.Tensor | None:
        """The weight as a plain vector, one value per sample, when it depends on this plate alone
        (a plain 1-d tensor of this plate's size, or a storch weight whose only plate is this one);
        ``None`` for the uniform weight, a scalar, or a weight that also varies over other plates."""
        w = self._weight
        if self._weight_plates == (None,):
            return w if w.dim() == 1 else None
        if self._weight_plates is None and type(w) is torch.Tensor and w.dim() == 1 and w.shape[0] == self.size:
            return w
        return None

    @property
    def surrogate_order(self) -> int:
        """Where this plate's node comes in the surrogate recursion, which handles the plates of a
        cost newest first: its creation `order`, unless a subclass says otherwise (the joint
        evaluation plate of chained local expectations comes where its chain began, after every node
        drawn from its points)."""
        return self.order

    @property
    def is_stochastic(self) -> bool:
        """True if this plate holds the samples of a stochastic node."""
        return self.node is not None

    @property
    def has_uniform_weight(self) -> bool:
        """True if every sample has the same weight ``1/size`` (plain Monte Carlo)."""
        w = self.weight
        if isinstance(w, torch.Tensor):
            return w.dim() == 0 and type(w) is torch.Tensor
        return True

    @property
    def identity(self) -> "Plate | tuple[str, int]":
        """What makes two plates the same plate; ``==`` and ``hash`` compare it.

        * The plate of a stochastic node is identified by the object itself: two nodes' samples
          never merge, even with equal names and sizes (that is a `storch.plate.PlateClashError`).
        * An independent plate (no node: a minibatch from `storch.denote_independent`, the
          copies of `storch.gather_samples`) is identified by ``(name, size)``, so that the
          plate re-created in every step, or for every tensor of one minibatch, is one plate.
        """
        return self if self.node is not None else (self.name, self.size)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Plate):
            return NotImplemented
        # only two independent plates can be equal without being the same object (see identity)
        return self.node is None and other.node is None and self.name == other.name and self.size == other.size

    def __hash__(self) -> int:
        return hash((self.name, self.size))  # equal plates have equal (name, size), see identity

    def __repr__(self) -> str:
        w = self.weight
        if isinstance(w, torch.Tensor) and type(w) is not torch.Tensor:
            # a storch weight carries this plate: show its plain values, or repr would recurse
            with torch._C.DisableTorchFunctionSubclass():
                w = w.detach().view_as(w)
        return repr((self.name, self.size, w))


class AncestralPlate(Plate):
    """The plate of one step of a sequence decoded step by step (beam search, ancestral sampling).

    Each step makes a new plate with the *same name*; sample ``b`` of this step extends sample
    ``parent_index[b]`` of the ``ancestor`` step. When tensors of two steps of one chain meet in an
    operation, the newer plate is kept and the older tensor is re-indexed along the chain (see
    `storch._dispatch.reindex_ancestral`), so a decoder combines its previous tokens and states
    with the new ones without bookkeeping. Plates of different chains still clash.

    Args:
        name: as for `storch.plate.Plate`.
        size: as for `storch.plate.Plate`.
        weight: as for `storch.plate.Plate`.
        parents: as for `storch.plate.Plate`.
        node: as for `storch.plate.Plate`.
        ancestor: the plate of the previous step (``None`` for the first step).
        parent_index: a plain ``LongTensor`` ``(size, *sizes of index_plates)``: for each sample of
            this plate (and each value of ``index_plates``) the position of its parent along
            ``ancestor``.
        index_plates: the other plates ``parent_index`` depends on (not ``ancestor``), in layout
            order; ``index_layout`` is this plate followed by them.
        info: anything the sampling method keeps about this step (e.g. beam scores).

    Examples:
        >>> import torch
        >>> first = AncestralPlate("seq", 2)
        >>> second = AncestralPlate("seq", 3, ancestor=first, parent_index=torch.tensor([1, 1, 0]))
        >>> second.descends_from(first), first.descends_from(second)
        (True, False)
    """

    __slots__ = ("ancestor", "parent_index", "index_plates", "chain_name")

    def __init__(
        self,
        name: str,
        size: int,
        weight: torch.Tensor | float | None = None,
        parents: Sequence[Plate] = (),
        node: "StochasticNode | None" = None,
        ancestor: "AncestralPlate | None" = None,
        parent_index: torch.Tensor | None = None,
        index_plates: Sequence[Plate] = (),
        info: object = None,
    ) -> None:
        super().__init__(name, size, weight, parents, node)
        if ancestor is not None:
            if ancestor.name != name and not self.renames_its_chain:
                raise ValueError(f"AncestralPlate {name!r}: its ancestor is named {ancestor.name!r}.")
            if parent_index is None:
                raise ValueError(f"AncestralPlate {name!r}: a plate with an ancestor needs parent_index.")
        self.index_plates = tuple(index_plates)
        sizes = (self.size,) + tuple(p.size for p in self.index_plates)
        if parent_index is not None and tuple(parent_index.shape) != sizes:
            raise ValueError(
                f"AncestralPlate {name!r}: parent_index of shape {tuple(parent_index.shape)} does not "
                f"match its plates {[name] + [p.name for p in self.index_plates]} of sizes {sizes}."
            )
        self.ancestor = ancestor
        self.parent_index = parent_index
        self.info = info
        #: what identifies the chain: the name of its first step (every step of a sequence shares it;
        #: a subclass whose steps are renamed, see `renames_its_chain`, keeps the first one's)
        self.chain_name: str = name if ancestor is None else ancestor.chain_name

    #: whether a step may have another name than its ancestor (the joint evaluation plates of chained
    #: local-expectation nodes take the name of their newest node); sequences keep one name
    renames_its_chain: bool = False

    def __eq__(self, other: object) -> bool:
        return self is other  # a step of a sequence is one node's plate: equal only to itself

    __hash__ = Plate.__hash__

    @property
    def index_layout(self) -> "PlateLayout":
        """The layout of ``parent_index``: this plate, then ``index_plates``."""
        return layout_of_plates((self,) + self.index_plates)

    def descends_from(self, other: Plate) -> bool:
        """True if ``other`` is a strict ancestor of this plate."""
        a = self.ancestor
        while a is not None:
            if a is other:
                return True
            a = a.ancestor
        return False


_NO_OTHER_PARENT = torch.zeros(1, dtype=torch.long)  # the parent_index of a step of a single-sample chain


class _Chain:
    """What the steps of one single-sample chain share (compared by identity)."""

    __slots__ = ("__weakref__",)


class ChainPlate(AncestralPlate):
    """The plate of a single-sample node, a step of a *chain* of single-sample nodes.

    A node drawn with one sample (plain Monte Carlo, ``n_samples=1``) from a distribution that carries
    the newest step of a chain does not add a plate: its plate *replaces* that step, as the next step
    of the chain. A rollout of ``T`` decisions, each drawn from a state computed from the previous
    one, so carries one plate however long it is, and torch's limit of 64 dimensions does not bound
    ``T``. The steps keep their nodes' names (``renames_its_chain``); where tensors of two steps
    meet, the newer is kept and the older relabelled (one sample each: nothing to re-index).

    The node sees its distribution without the step it extends (that size-1 dimension dropped, on a
    copy of the distribution made when first read), so its samples and distribution look like any
    other node's. In the
    surrogate loss every step is its own node, processed newest first, and the costs that reach a
    step are summed before its node's term is formed: a reward after each of ``T`` decisions costs
    ``O(T)`` (the reward to go; see `storch.inference`).

    A node whose distribution carries an older step (a *sibling* of a later node) starts a chain of
    its own: a chain never branches.

    Examples:
        >>> root = ChainPlate("a0")
        >>> step = ChainPlate("a1", ancestor=root)
        >>> step.size, step.chain_name, step.descends_from(root), root.descends_from(step)
        (1, 'a0', True, False)
    """

    __slots__ = ("depth", "chain", "_extended_by")
    renames_its_chain = True

    def __init__(
        self,
        name: str,
        parents: Sequence[Plate] = (),
        node: "StochasticNode | None" = None,
        ancestor: "ChainPlate | None" = None,
    ) -> None:
        if ancestor is not None and not isinstance(ancestor, ChainPlate):
            raise TypeError(f"ChainPlate {name!r}: its ancestor must be a ChainPlate, got {type(ancestor).__name__}.")
        index = None if ancestor is None else _NO_OTHER_PARENT
        super().__init__(name, 1, None, parents, node, ancestor=ancestor, parent_index=index)
        self._extended_by: "weakref.ref | None" = None
        if ancestor is None:
            self.depth = 0
            self.chain = _Chain()
        else:
            self.depth = ancestor.depth + 1
            self.chain = ancestor.chain
            ancestor._extended_by = weakref.ref(self)

    def next_step(self, name: str, parents: tuple[Plate, ...]) -> "ChainPlate":
        """The plate of the node that extends this step: ``ChainPlate(name, parents, ancestor=self)``,
        its attributes set directly (a chain's next step is made at every decision of a rollout; the
        checks of the constructors are about arguments this step fixes). ``parents`` is a tuple."""
        if type(self) is not ChainPlate:  # a subclass's own constructor runs
            return type(self)(name, parents, ancestor=self)
        step = object.__new__(ChainPlate)
        step.name, step.size, step._weight, step._weight_plates = name, 1, uniform_weight(1), None
        step.parents, step.node, step.order, step.info = parents, None, next(_creation_counter), None
        step.ancestor, step.parent_index, step.index_plates = self, _NO_OTHER_PARENT, ()
        step.chain_name, step.depth, step.chain, step._extended_by = self.chain_name, self.depth + 1, self.chain, None
        self._extended_by = weakref.ref(step)
        return step

    @property
    def is_tip(self) -> bool:
        """Whether no node has extended this step yet (a new single-sample node drawn from it would)."""
        newer = self._extended_by
        return newer is None or newer() is None

    def descends_from(self, other: Plate) -> bool:
        return isinstance(other, ChainPlate) and other.chain is self.chain and other.depth < self.depth


class PlateLayout:
    """The ordered plates of a tensor (newest first) and their sizes.

    Layouts are shared between tensors: the output of an operation whose inputs share a layout
    reuses that layout object, which lets the dispatcher skip alignment by an identity check.
    """

    __slots__ = ("plates", "sizes", "names", "_dropped", "__weakref__")

    def __init__(self, plates: Sequence[Plate] = ()) -> None:
        self.plates: tuple[Plate, ...] = tuple(plates)
        self.sizes: tuple[int, ...] = tuple(p.size for p in self.plates)
        self.names: tuple[str, ...] = tuple(p.name for p in self.plates)
        self._dropped: dict[int, PlateLayout] = {}  # position -> this layout without that plate

    def __len__(self) -> int:
        return len(self.plates)

    def __iter__(self):
        return iter(self.plates)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, PlateLayout):
            return NotImplemented
        return self.plates == other.plates

    def __hash__(self) -> int:
        return hash(self.plates)

    def index(self, plate: Plate | str) -> int:
        """Position of ``plate`` (a `storch.plate.Plate` or a plate name) in this layout."""
        if isinstance(plate, str):
            try:
                return self.names.index(plate)
            except ValueError:
                raise ValueError(
                    f"No plate named {plate!r} on this tensor; its plates are {list(self.names)}."
                    + _earlier_chain_step(self, plate)
                ) from None
        for i, p in enumerate(self.plates):
            if p == plate:
                return i
        raise ValueError(f"Plate {plate!r} is not on this tensor; its plates are {list(self.names)}.")

    def position(self, plate: Plate) -> int:
        """Position of ``plate`` in this layout, found by identity first (see
        `storch.plate.PlateLayout.index`)."""
        for i, p in enumerate(self.plates):
            if p is plate:
                return i
        return self.index(plate)

    def without_position(self, i: int) -> "PlateLayout":
        """This layout without its ``i``-th plate (cached: the surrogate reduces plates in a loop)."""
        layout = self._dropped.get(i)
        if layout is None:
            layout = self._dropped[i] = layout_of_plates(self.plates[:i] + self.plates[i + 1:])
        return layout

    def without(self, plates: Iterable[Plate]) -> "PlateLayout":
        """A layout with the given plates removed."""
        drop = list(plates)
        return layout_of_plates([p for p in self.plates if not any(p == d for d in drop)])

    def __repr__(self) -> str:
        return f"PlateLayout({list(self.plates)})"


def _earlier_chain_step(layout: PlateLayout, name: str) -> str:
    """The explanation when ``name`` is an earlier step of a single-sample chain on ``layout``."""
    for plate in layout.plates:
        step = plate.ancestor if isinstance(plate, ChainPlate) else None
        while step is not None:
            if step.name == name:
                return (
                    f" {name!r} is an earlier node of the single-sample chain whose newest node is "
                    f"{plate.name!r}: its plate was taken over by the chain's later nodes, so reduce "
                    f"{plate.name!r} instead (one sample: the same value)."
                )
            step = step.ancestor
    return ""


EMPTY_LAYOUT = PlateLayout()
#: the interned layouts, by the ids of their plates: a weak reference to each, removed by its callback
#: when the layout dies (what ``weakref.WeakValueDictionary`` does, without its Python-level methods:
#: a new step of a rollout interns its node's layout at every decision)
_interned: dict[tuple[int, ...], "_InternedRef"] = {}


class _InternedRef(weakref.ref):
    """A weak reference to an interned layout that knows its key (one object per entry)."""

    __slots__ = ("key",)


def _forget_interned(ref: _InternedRef) -> None:
    if _interned.get(ref.key) is ref:  # (not a newer layout interned under the same plates)
        del _interned[ref.key]


def layout_of_plates(plates: Sequence[Plate]) -> PlateLayout:
    """The shared `storch.plate.PlateLayout` object for ``plates`` (in the given order).

    Interning layouts lets tensors that carry the same plates share one layout object, so the
    dispatcher's identity check takes the fast path. A layout keeps its plates alive, so an entry
    keyed by plate ids is dropped before any of those ids can be reused.
    """
    if not plates:
        return EMPTY_LAYOUT
    key = tuple(map(id, plates))
    ref = _interned.get(key)
    layout = None if ref is None else ref()
    if layout is None:
        if len(plates) > MAX_PLATES:
            raise TooManyPlatesError(plates)
        layout = PlateLayout(plates)
        ref = _interned[key] = _InternedRef(layout, _forget_interned)
        ref.key = key
    return layout


#: torch handles tensors of at most 64 dimensions (reductions and argument checks refuse more), and
#: every plate is a dimension
MAX_PLATES = 64


class TooManyPlatesError(ValueError):
    """More than `MAX_PLATES` plates would meet in one tensor."""

    def __init__(self, plates: Sequence["Plate"], detail: str = "") -> None:
        names = ", ".join(repr(p.name) for p in list(plates)[:6])
        head = f"{detail} " if detail else f"{len(plates)} plates would meet in one tensor ({names}, ...), but "
        super().__init__(
            f"{head}torch handles tensors of at most {MAX_PLATES} dimensions and every plate is one. Every "
            "stochastic node adds its plate to everything computed from it, so a chain of N nodes gives "
            "its last values N plates (only single-sample nodes drawn one from the other share one). "
            "Draw several variables in one node (a distribution with a batch dimension), or decode a "
            "sequence with one ancestral plate per chain (storch.sampling's decoders), which does not "
            "grow with its length."
        )


#: CUDA kernels take tensors of at most 25 dimensions (torch's ``MAX_DIMS`` of its GPU iterators)
CUDA_MAX_DIMS = 25
_CUDA_DIMS_MESSAGE = "CUDA Tensors cannot have more than 25 dimensions"


class CudaDimensionError(TooManyPlatesError):
    """A CUDA kernel refused a tensor of more than `CUDA_MAX_DIMS` dimensions, plates included."""

    def __init__(self, plates: Sequence["Plate"], where: str) -> None:
        ValueError.__init__(
            self,
            f"{where}: a CUDA kernel refused a tensor of more than {CUDA_MAX_DIMS} dimensions; it carries "
            f"{len(plates)} plates ({', '.join(repr(p.name) for p in list(plates)[:6])}"
            f"{', ...' if len(plates) > 6 else ''}) besides its own dimensions. On the CPU a tensor may "
            f"hold {MAX_PLATES} plates, on a GPU plates and event dimensions together at most "
            f"{CUDA_MAX_DIMS}. Every stochastic node adds its plate to everything computed from it: draw "
            "several variables in one node (a distribution with a batch dimension), or decode a sequence "
            "with one ancestral plate per chain (storch.sampling's decoders).",
        )


def reraise_cuda_dimension_error(error: RuntimeError, plates: Sequence["Plate"], where: str) -> None:
    """Raise `storch.plate.CudaDimensionError` from ``error`` if it is CUDA's dimension limit;
    else return."""
    if _CUDA_DIMS_MESSAGE in str(error):
        raise CudaDimensionError(plates, where) from error


def _describe(plate: Plate) -> str:
    kind = f"stochastic node {plate.node.name!r}" if plate.node is not None else "independent plate"
    return f"{plate.name!r} (size {plate.size}, {kind})"


def merge_layouts(layouts: Iterable[PlateLayout]) -> PlateLayout:
    """The union of several layouts, newest plate first.

    Two steps of one ancestral chain (`storch.plate.AncestralPlate`, a sequence decoded step by
    step) merge
    into the newer one, plus the plates its parent indices depend on.

    Raises:
        PlateClashError: if two different plates share a name.
    """
    merged, pairs = _merge_once(layouts)
    if not pairs:
        return merged
    done: set[tuple[int, int]] = set()
    while pairs:
        # a re-indexed older tensor also depends on the plates of the parent indices on the way
        extra = []
        for newer, older in pairs:
            if (id(newer), id(older)) not in done:
                done.add((id(newer), id(older)))
                if not isinstance(newer, ChainPlate):  # (a chain's steps have no index plates)
                    extra += [layout_of_plates(s.index_plates) for s in _chain(newer, older) if s.index_plates]
        if not extra:
            break
        merged, pairs = _merge_once([merged] + extra)
    return merged


def _merge_once(layouts: Iterable[PlateLayout]) -> tuple[PlateLayout, list[tuple["AncestralPlate", Plate]]]:
    """The union, and the (newer, older) pairs of ancestral plates that merged into the newer."""
    merged: list[Plate] = []
    by_chain: dict[str, Plate] = {}  # a plate's name, or the name of its chain's first step
    pairs: list[tuple[AncestralPlate, Plate]] = []
    renamed = False
    for layout in layouts:
        for plate in layout.plates:
            key = _chain_key(plate)
            renamed = renamed or key != plate.name
            seen = by_chain.get(key)
            if seen is None:
                by_chain[key] = plate
                merged.append(plate)
            elif not (seen is plate or seen == plate):
                newer = _newer_of_one_chain(seen, plate)
                if newer is not None:  # two steps of one chain: the newest step is kept
                    if newer is plate:
                        merged[next(i for i, p in enumerate(merged) if p is seen)] = plate
                        by_chain[key] = plate
                    pairs.append((newer, seen if newer is plate else plate))
                    continue
                _raise_clash(seen, plate)
    if renamed:  # steps of a renamed chain are keyed by their chain: names must still be unique
        by_name: dict[str, Plate] = {}
        for plate in merged:
            seen = by_name.setdefault(plate.name, plate)
            if seen is not plate:
                _raise_clash(seen, plate)
    merged.sort(key=lambda p: p.order, reverse=True)
    return layout_of_plates(merged), pairs


def _chain_key(plate: Plate) -> str:
    return plate.chain_name if isinstance(plate, AncestralPlate) else plate.name


def _independent(plate: Plate) -> bool:
    """A plate of ``denote_independent`` (data, replicates): no node, no chain of steps."""
    return plate.node is None and type(plate) is Plate


def _raise_clash(seen: Plate, plate: Plate) -> None:
    if _independent(seen) and _independent(plate):
        raise PlateClashError(
            f"Two independent plates are named {plate.name!r}, of sizes {seen.size} and {plate.size}: "
            "tensors of two different batches met in one operation (denote_independent makes one plate "
            "of a name and a size). Give one of them another name (storch.denote_independent(t, dim, "
            f"'{plate.name}2')), or compute both from the same batch."
        )
    if (seen.node is not None and _independent(plate)) or (plate.node is not None and _independent(seen)):
        node, independent = (seen, plate) if seen.node is not None else (plate, seen)
        raise PlateClashError(
            f"A stochastic node and an independent plate are both named {plate.name!r}: {_describe(node)} "
            f"and {_describe(independent)}. Give the node another plate name (e.g. Method('{plate.name}_z')) "
            "or the independent plate another name (storch.denote_independent(t, dim, name))."
        )
    raise PlateClashError(
        f"Two different plates are named {plate.name!r}: {_describe(seen)} and "
        f"{_describe(plate)}. Samples of different stochastic nodes never merge, also when their "
        "sizes match (Storchastic merged them): a plate identifies its node, and storch applies a "
        "node's gradient estimator when it reduces that node's plate, so one merged plate would "
        "silently drop the other node's estimator. Give the nodes different plate names (e.g. "
        "Method('z1') and Method('z2')), or if one tensor is left over from an earlier step, "
        f"recompute it in this step.{_sequence_hint(seen, plate)}"
    )


def _sequence_hint(a: Plate, b: Plate) -> str:
    """For two beams drawn by one sequence method, how storch continues a sequence (else ``""``)."""
    method = getattr(a.node, "method", None)
    if not (isinstance(a, AncestralPlate) and isinstance(b, AncestralPlate)) or method is None:
        return ""
    if getattr(b.node, "method", None) is not method:
        return ""
    return (
        f" Both were drawn by the same {type(method).__name__}({a.name!r}) as separate sets: storch "
        "continues a sequence (Storchastic's second method.sample call) only when the step's "
        "distribution carries the previous step's plate. Build the step's parameters from the previous "
        "step's tensors, or put the plate on parameters that do not depend on it: "
        "OneHotCategorical(logits=storch.expand_as(logits, z_prev))."
    )


def _newer_of_one_chain(a: Plate, b: Plate) -> "AncestralPlate | None":
    """The newer of two plates of one ancestral chain (see `storch.plate.AncestralPlate`), else
    ``None``."""
    if isinstance(a, AncestralPlate) and isinstance(b, AncestralPlate):
        if b.descends_from(a):
            return b
        if a.descends_from(b):
            return a
    return None


def _chain(newer: AncestralPlate, older: Plate) -> list[AncestralPlate]:
    """The steps from ``newer`` back to (not including) its ancestor ``older``, newest first."""
    out = []
    a: AncestralPlate | None = newer
    while a is not None and a is not older:
        out.append(a)
        a = a.ancestor
    return out


def order_plates(plates: Sequence[Plate], reverse: bool = False) -> list[Plate]:
    """Order plates topologically: parents before children (``reverse=True``: children first).

    Plates are created after their parents, so creation order is a topological order.

    Examples:
        >>> a = Plate("data", 4); b = Plate("z", 2, parents=[a])
        >>> [p.name for p in order_plates([b, a])]
        ['data', 'z']
    """
    return sorted(plates, key=lambda p: p.order, reverse=reverse)
