"""The dispatcher's one table of treatments, its scan of plate layouts, and its alignment plans.

* every function storch treats specially has one [`Treatment`][storch._dispatch.Treatment] entry, and
  ``register_operation`` writes exactly that entry (round trips restore it);
* ``scan_layouts`` finds plated tensors at the top level, in lists and tuples and among keywords, and
  the inline fast path of ``torch_function`` agrees with it (list members, keyword tensors and storch
  tensors without plates count like top-level arguments);
* ``_plan`` answers a typed ``Plan``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import storch
import storch.extend as extend
from storch import _dispatch
from storch._dispatch import DEFAULT, KINDS, Plan, Treatment, scan_layouts, treatment_of
from storch.extend import plain, register_operation
from storch.plate import AncestralPlate, layout_of_plates

T = torch.Tensor


def _plated(values, name: str = "p") -> storch.Tensor:
    """``values`` with its first dimension as the independent plate ``name``."""
    return storch.denote_independent(torch.as_tensor(values, dtype=torch.float32), 0, name)


def _list_handled(name: str, fn):
    """A function of a list of tensors that routes storch tensors through ``__torch_function__``."""

    def wrapper(ts):
        if torch.overrides.has_torch_function(tuple(ts)):
            return torch.overrides.handle_torch_function(wrapper, tuple(ts), ts)
        return fn(ts)

    wrapper.__name__ = name
    return wrapper


def _total(ts):
    out = ts[0]
    for t in ts[1:]:
        out = out + t
    return out


# ------------------------------------------------------------------------------------------ the table


@pytest.mark.parametrize(
    ("func", "kind"),
    [
        (torch.add, "elementwise"), (T.__add__, "elementwise"), (T.mul_, "elementwise"), (torch.where, "elementwise"),
        (F.mse_loss, "equal_shapes"), (F.binary_cross_entropy, "equal_shapes"),
        (torch.cat, "join"), (torch.stack, "join"),
        (T.size, "passthrough"), (T.shape.__get__, "passthrough"), (T.requires_grad.__set__, "passthrough"),
        (torch.sum, "aligned"), (T.exp, "aligned"),
    ],
)
def test_every_function_has_one_kind(func, kind) -> None:
    assert treatment_of(func).kind == kind


def test_derived_flags_follow_the_kind() -> None:
    assert treatment_of(F.mse_loss).elementwise and treatment_of(F.mse_loss).special
    assert treatment_of(torch.add).elementwise and not treatment_of(torch.add).special
    assert treatment_of(torch.cat).special and not treatment_of(torch.cat).elementwise
    assert treatment_of(T.dim).passthrough
    assert not (DEFAULT.passthrough or DEFAULT.elementwise or DEFAULT.special or DEFAULT.checks_dims)


def test_dimension_fields() -> None:
    assert treatment_of(torch.sum) == Treatment(dim_positions=(1,))
    assert treatment_of(T.transpose) == Treatment(dim_positions=(1, 2))
    assert treatment_of(torch.topk) == Treatment(dim_positions=(2,))
    assert treatment_of(torch.cat) == Treatment("join", dim_positions=(1,), implicit_dims=(0,))
    assert treatment_of(torch.stack) == Treatment("join", dim_positions=(1,), adds_dim=True, implicit_dims=(0,))
    assert treatment_of(T.unsqueeze) == Treatment(dim_positions=(1,), adds_dim=True)
    assert treatment_of(T.T.__get__) == Treatment(implicit_dims=(0, -1))
    assert treatment_of(T.mT.__get__) == Treatment(implicit_dims=(-2, -1))
    assert treatment_of(torch.all) == Treatment(may_drop_plates=True, dim_positions=(1,))
    # torch's checks of a whole tensor (argument validation) run on the plain tensor: plates and all
    assert treatment_of(torch._is_all_true) == treatment_of(torch._is_any_true) == Treatment("passthrough")
    x = storch.denote_independent(torch.tensor([[True, True], [True, False]]), 0, "data")
    assert type(torch._is_all_true(x)) is torch.Tensor and not torch._is_all_true(x).item()
    assert torch._is_any_true(x).item() and torch._is_all_true(x[..., 0]).item()
    assert all(t.checks_dims for t in map(treatment_of, (torch.sum, T.unsqueeze, T.T.__get__)))


def test_unknown_functions_get_the_default() -> None:
    def mine(t):
        return t

    assert treatment_of(mine) is DEFAULT
    assert DEFAULT == Treatment() and DEFAULT.kind == "aligned"


def test_treatments_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        treatment_of(torch.add).kind = "aligned"  # type: ignore[misc]


def test_every_entry_is_a_valid_treatment() -> None:
    for func, treat in _dispatch._TREATMENTS.items():
        assert callable(func)
        assert isinstance(treat, Treatment) and treat.kind in KINDS, (func, treat)


# ---------------------------------------------------------------------------------- register_operation


def _table_without(func) -> dict:
    return {f: t for f, t in _dispatch._TREATMENTS.items() if f is not func}


@pytest.mark.parametrize("kind", KINDS)
def test_register_writes_one_entry_and_round_trips(kind) -> None:
    def op(t):
        return t

    before = dict(_dispatch._TREATMENTS)
    assert register_operation(op, kind) is op
    assert treatment_of(op).kind == kind
    assert _table_without(op) == before  # nothing else changed
    register_operation(op)
    assert treatment_of(op) == DEFAULT


def test_register_dim_args_round_trip() -> None:
    def op(t, dim):
        return t

    register_operation(op, "elementwise", dim_args=(1,), adds_dim=True)
    assert treatment_of(op) == Treatment("elementwise", dim_positions=(1,), adds_dim=True)
    register_operation(op, "elementwise")  # registering replaces: the dimension arguments are gone
    assert treatment_of(op) == Treatment("elementwise")
    register_operation(op)
    assert treatment_of(op) == DEFAULT


def test_reregistering_a_builtin_keeps_its_own_defaults() -> None:
    """A function with an implicit dimension keeps its dimension arguments, and a reduction to a
    boolean keeps its may-drop flag, through a registration that does not name them."""
    cat, all_ = treatment_of(torch.cat), treatment_of(torch.all)
    try:
        register_operation(torch.cat)
        assert treatment_of(torch.cat) == dataclasses.replace(cat, kind="aligned")
        register_operation(torch.all, "elementwise")
        assert treatment_of(torch.all) == Treatment("elementwise", may_drop_plates=True)
    finally:
        register_operation(torch.cat, "join")
        register_operation(torch.all, dim_args=(1,))
    assert treatment_of(torch.cat) == cat and treatment_of(torch.all) == all_


def test_register_passthrough_returns_plain_results() -> None:
    def size_of(t):
        if torch.overrides.has_torch_function((t,)):
            return torch.overrides.handle_torch_function(size_of, (t,), t)
        return t + 0

    x = _plated([[1.0, 2.0]])
    register_operation(size_of, "passthrough")
    try:
        out = size_of(x)
    finally:
        register_operation(size_of)
    assert type(out) is torch.Tensor
    assert type(size_of(x)) is storch.Tensor


def test_register_error_messages_are_kept() -> None:
    with pytest.raises(ValueError, match=r"register_operation\(sin\): treat must be one of \('aligned', "):
        register_operation(torch.sin, "pointwise")
    assert treatment_of(torch.sin) is DEFAULT


# ------------------------------------------------------------------------------------------ the scan


def _scan(args, kwargs=None):
    with extend.no_dispatch():
        return scan_layouts(args, kwargs)


def test_scan_top_level_list_and_keywords() -> None:
    a, b = _plated([1.0, 2.0]), _plated([[1.0], [2.0]])
    q = _plated([1.0, 2.0, 3.0], "q")
    scan = _scan((a, [b]), {"other": torch.ones(4, 5, 6)})
    assert scan.first is a and scan.layout is a._layout
    assert scan.same and scan.ragged and scan.event_ndim == 3
    assert scan.layouts == [a._layout, b._layout]
    scan = _scan((1.0,), {"tensors": [a, q]})
    assert scan.first is a and not scan.same and len(scan.layouts) == 2
    scan = _scan((torch.ones(3), 2))
    assert scan.first is None and scan.layout is storch.plate.EMPTY_LAYOUT and scan.layouts == []


def test_scan_counts_storch_tensors_without_plates_as_plain() -> None:
    a = _plated([1.0, 2.0])
    unplated = storch.Tensor(torch.ones(3), [])
    scan = _scan((a, unplated))
    assert scan.first is a and scan.ragged and scan.event_ndim == 1


def test_list_members_are_padded_for_elementwise_functions() -> None:
    """A list member with fewer event dimensions, or a plain list member with more, is padded as a
    top-level argument is; before, list members were left out of the ragged check, and the plate
    broadcast against an event dimension of the same size (silently wrong values)."""
    total = _list_handled("total", _total)
    a = _plated([0.0, 1.0, 2.0])  # no event dimension
    b = a.unsqueeze(-1).expand(3, 3) * 0.0  # a's layout, one event dimension of the plate's size
    plain = torch.tensor([100.0, 200.0, 300.0])
    register_operation(total, "elementwise")
    try:
        assert total([a, b])._tensor.tolist() == (a + b)._tensor.tolist() == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
        out = total([a, plain])
        assert out.shape == (3, 3) and out._tensor.tolist() == (a + plain)._tensor.tolist()
        assert out._tensor.tolist() == [[100.0, 200.0, 300.0], [101.0, 201.0, 301.0], [102.0, 202.0, 302.0]]
    finally:
        register_operation(total)


def test_storch_tensor_without_plates_broadcasts_like_a_plain_tensor() -> None:
    a = _plated([0.0, 1.0, 2.0])
    q = _plated([0.0, 10.0, 20.0, 30.0], "q")
    values = torch.tensor([100.0, 200.0, 300.0])
    unplated = storch.Tensor(values.clone(), [])
    assert (a + unplated)._tensor.tolist() == (a + values)._tensor.tolist()
    assert (a + unplated).shape == (3, 3) and (unplated * a).shape == (3, 3)
    assert (a + q + unplated).shape == (4, 3, 3)


def test_join_of_tensors_given_by_keyword_is_aligned() -> None:
    a = _plated([[1.0], [2.0], [3.0]])
    q = _plated([[10.0], [20.0], [30.0], [40.0]], "q")
    out = torch.cat(tensors=[a, q], dim=-1)
    assert out.shape == (4, 3, 2) and set(out.plate_names) == {"p", "q"}
    assert torch.equal(out._tensor, torch.cat([a, q], -1)._tensor)
    with pytest.raises(ValueError, match="cat got dimension 0, which is plate 'p'"):
        torch.cat(tensors=[a, a], dim=0)


def test_keyword_input_dimension_is_checked() -> None:
    x = _plated([[1.0, 2.0, 3.0]] * 3)  # a 3-sample plate over a 3-vector: sum(0) fits by accident
    with pytest.raises(ValueError, match="sum got dimension 0, which is plate 'p'"):
        torch.sum(input=x, dim=0)
    assert torch.sum(input=x, dim=-1)._tensor.tolist() == [6.0] * 3


@pytest.mark.parametrize(
    "make",
    [
        lambda a, b, w: (a, b),  # shared plates, same dims: the inline path
        lambda a, b, w: (a, w),  # a plain tensor with more dims
        lambda a, b, w: (a, a.sum(-1)),  # fewer event dims
        lambda a, b, w: (a, _plated(torch.ones(4, 1), "q")),  # other plates
        lambda a, b, w: (w, a),  # the plain tensor first
    ],
)
def test_inline_scan_agrees_with_the_keyword_route(make) -> None:
    """``torch.add(x, other=y)`` goes through scan_layouts (a tensor keyword); ``torch.add(x, y)`` through
    the inline scan when it can: both give the same values and plates."""
    a = _plated(torch.arange(6.0).reshape(2, 3))
    b = _plated(torch.ones(2, 3))
    w = torch.arange(12.0).reshape(4, 3)
    x, y = make(a, b, w)
    positional, keyword = torch.add(x, y), torch.add(x, other=y)
    assert positional.shape == keyword.shape and positional.plate_names == keyword.plate_names
    assert torch.equal(positional._tensor, keyword._tensor)


def test_cat_and_stack_with_shared_plates() -> None:
    a, b = _plated(torch.ones(2, 3)), _plated(torch.zeros(2, 4))
    assert torch.cat([a, b], -1).shape == (2, 7)
    assert torch.stack([a, a * 2], -1).shape == (2, 3, 2)
    assert torch.cat([a, torch.ones(2)], -1).shape == (2, 5)  # a plain member gets the plates
    with pytest.raises(ValueError, match="stack got dimension 0, which is plate 'p'"):
        torch.stack([a, a], 0)


# ------------------------------------------------------------------------------------------ the plan


def test_plan_is_typed() -> None:
    p, q = storch.plate.Plate("p", 2), storch.plate.Plate("q", 3)
    plan = _dispatch._plan(layout_of_plates((p,)), layout_of_plates((q, p)))
    assert isinstance(plan, Plan) and not plan.ancestral
    assert plan.permutation is None and plan.index == (None, slice(None))
    plan = _dispatch._plan(layout_of_plates((p, q)), layout_of_plates((q, p)))
    assert plan.permutation == (1, 0) and plan.index == (slice(None), slice(None))


def test_plan_for_an_older_step_asks_to_reindex() -> None:
    first = AncestralPlate("seq", 2)
    second = AncestralPlate("seq", 3, ancestor=first, parent_index=torch.tensor([1, 1, 0]))
    plan = _dispatch._plan(layout_of_plates((first,)), layout_of_plates((second,)))
    assert plan == Plan(None, None, True) and plan.ancestral


# ------------------------------------------------------------------------------------------ no_dispatch


def test_one_way_to_turn_dispatch_off() -> None:
    assert extend.no_dispatch is _dispatch.no_dispatch is torch._C.DisableTorchFunctionSubclass
    x = _plated([1.0, 2.0])
    with extend.no_dispatch():
        assert type(x + 1) is torch.Tensor


# ------------------------------------------------------------------ einsum acts per sample
def test_einsum_without_ellipsis_acts_per_sample():
    from torch.distributions import Normal

    a = storch.method.Reparameterization("z", n_samples=3)(Normal(torch.zeros(2, 4), 1.0))  # (3, 2, 4)
    b = torch.randn(4, 5)
    v = torch.randn(4)
    out = torch.einsum("ij,jk->ik", a, b)
    assert out.plate_names == ["z"] and tuple(out.shape) == (3, 2, 5)
    torch.testing.assert_close(out._tensor, a._tensor @ b)
    implicit = torch.einsum("ij,jk", a, b)  # implicit output: i and k, alphabetical
    torch.testing.assert_close(implicit._tensor, out._tensor)
    dot = torch.einsum("ij,j->i", a, v)
    torch.testing.assert_close(dot._tensor, a._tensor @ v)
    in_a_list = torch.einsum("ij,jk->ik", [a, b])
    torch.testing.assert_close(in_a_list._tensor, out._tensor)
    storch.reset()


def test_einsum_of_two_plated_operands_gives_the_joint_grid():
    from torch.distributions import Normal

    a = storch.method.Reparameterization("a", n_samples=2)(Normal(torch.zeros(4), 1.0))
    c = storch.method.Reparameterization("c", n_samples=3)(Normal(torch.zeros(4), 1.0))
    out = torch.einsum("i,i->", a, c)
    assert sorted(out.plate_names) == ["a", "c"] and out.dim() == 2
    torch.testing.assert_close(out._tensor, (c._tensor[:, None, :] * a._tensor[None, :, :]).sum(-1))
    storch.reset()


# ------------------------------------------------------------ broadcasting without aligning
def _sample_and_data():
    """``a``: plates [z (3), data (4)], one event dimension of 2; ``b``: plate [data], the same event."""
    torch.manual_seed(0)
    b = _plated(torch.randn(4, 2), "data")
    a = storch.method.Reparameterization("z", n_samples=3)(torch.distributions.Normal(b, 1.0))
    return a, b


BROADCASTING = {  # function (as its treatment is keyed), call
    "add": (T.__add__, lambda a, b: b + a),
    "rsub": (T.__rsub__, lambda a, b: 1.0 - b),
    "eq": (T.__eq__, lambda a, b: (b == a).float()),
    "where": (torch.where, lambda a, b: torch.where(b > 0, b, a)),
    "masked_fill": (T.masked_fill, lambda a, b: b.masked_fill(a > 0, 7.0)),
    "clamp": (torch.clamp, lambda a, b: torch.clamp(b, min=a)),
    "lerp": (torch.lerp, lambda a, b: torch.lerp(b, a, 0.25)),
    "broadcast_tensors": (torch.broadcast_tensors, lambda a, b: torch.broadcast_tensors(b, a)[0] * 1.0),
}


def _count_alignments(monkeypatch) -> list:
    calls: list = []
    original = _dispatch.align_tensor
    monkeypatch.setattr(_dispatch, "align_tensor", lambda *args, **kw: calls.append(1) or original(*args, **kw))
    return calls


@pytest.mark.parametrize("name", list(BROADCASTING))
def test_broadcasting_functions_skip_aligning_when_only_leading_plates_are_missing(name, monkeypatch) -> None:
    """The data-only tensor meets the sample tensor as torch's broadcasting lays it out: the same
    values and plates as aligning it first, and no alignment."""
    func, call = BROADCASTING[name]
    assert treatment_of(func).broadcasts
    a, b = _sample_and_data()
    expected = call(plain(a), plain(b).unsqueeze(0))
    aligned = _count_alignments(monkeypatch)
    out = call(a, b)
    if name != "rsub":  # 1.0 - b has b's plates only
        assert out.plate_names == ["z", "data"] and not aligned
    assert torch.equal(plain(out), expected if name != "rsub" else expected[0])


def test_in_place_and_ragged_calls_are_still_aligned(monkeypatch) -> None:
    """In place the result keeps the written tensor's shape, and a tensor with fewer event dimensions
    gets size-1 event dimensions after its plates: those calls are aligned as before."""
    assert not treatment_of(T.add_).broadcasts and not treatment_of(T.__iadd__).broadcasts
    a, b = _sample_and_data()
    s = a.sum(-1)  # [z, data] without an event dimension, against b's [data] with one
    aligned = _count_alignments(monkeypatch)
    out = s + b
    assert aligned and out.plate_names == ["z", "data"] and tuple(out.shape) == (3, 4, 2)
    assert torch.equal(plain(out), plain(s)[..., None] + plain(b)[None])
    single = storch.method.Reparameterization("y", n_samples=1)(torch.distributions.Normal(b, 1.0))
    written = b.clone()
    written += single  # b's plates lack y (size 1): aligned, so the in-place write fits
    assert torch.equal(plain(written), plain(b)[None] + plain(single))


def test_reregistering_a_broadcasting_function_with_another_kind_drops_the_shortcut() -> None:
    old = treatment_of(torch.lerp)
    try:
        register_operation(torch.lerp, "aligned")
        assert not treatment_of(torch.lerp).broadcasts
        register_operation(torch.lerp, "elementwise")
        assert not treatment_of(torch.lerp).broadcasts  # a user's elementwise function: aligned
    finally:
        _dispatch._TREATMENTS[torch.lerp] = old
