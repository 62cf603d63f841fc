"""What a new step of a single-sample chain costs in the rollout: nothing is merged, planned or cached
again for a layout that only differs from a known one by the chain's newer step."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical

import storch
from storch import _dispatch
from storch.plate import merge_layouts


def _two_steps():
    obs = storch.denote_independent(torch.randn(5, 3), 0, "episodes")
    method = storch.method.ScoreFunction("a")
    head = torch.nn.Linear(3, 2)
    first = method(Categorical(logits=head(obs)))
    second = method(Categorical(logits=head(obs) + first.unsqueeze(-1).float()))
    return obs, first, second


def test_a_new_chain_step_meets_its_inputs_without_a_merge():
    obs, first, second = _two_steps()
    newer, older, data = second._layout, first._layout, obs._layout
    cached = len(_dispatch._union_cache)
    for layouts in ([newer, older], [older, newer], [newer, data], [data, older, newer]):
        union = _dispatch.union_of_layouts(layouts)
        assert union is newer and union == merge_layouts(layouts)
    assert len(_dispatch._union_cache) == cached  # found without merging: nothing cached
    with _dispatch.no_dispatch():
        relabelled = _dispatch.align_tensor(first, newer)
    assert relabelled is first  # the older step's values, at the same place: nothing moved
    total = first.float() + second.float()
    assert total.plates == second.plates and torch.equal(total._tensor, (first._tensor + second._tensor).float())
    storch.reset()


def test_a_layout_that_lists_its_plates_out_of_order_is_still_merged():
    obs, first, _ = _two_steps()
    shuffled = storch.Tensor(torch.zeros(5, 1), [obs.plates[0], first.plates[0]])  # oldest first
    union = _dispatch.union_of_layouts([shuffled._layout, obs._layout])
    assert union is not shuffled._layout and [p.name for p in union.plates] == ["a", "episodes"]
    storch.reset()


def test_two_layouts_one_chain_step_apart_give_the_merge_s_union():
    """The union of two layouts that differ by a chain step (a recurrent state, one step older, meets
    the new step's input) is found without merging, and is what a merge gives: the newer step, the
    first of two equal independent plates, the plates newest first."""
    from storch.plate import ChainPlate, Plate, PlateLayout, layout_of_plates

    data, data_again = Plate("episodes", 4), Plate("episodes", 4)  # equal, two objects
    older = ChainPlate("a", (data,))
    newer = ChainPlate("a", (data,), ancestor=older)
    cases = [
        [layout_of_plates((newer, data)), layout_of_plates((older, data))],
        [layout_of_plates((older, data)), layout_of_plates((newer, data))],
        [layout_of_plates((newer, data_again)), layout_of_plates((older, data))],
        [layout_of_plates((older, data)), layout_of_plates((newer, data_again))],
        [PlateLayout((data, newer)), PlateLayout((data, older))],  # oldest first: merged, sorted
    ]
    for layouts in cases:
        union, merged = _dispatch.union_of_layouts(layouts), merge_layouts(layouts)
        assert [id(p) for p in union.plates] == [id(p) for p in merged.plates], layouts


def test_the_averages_of_many_decisions_fold_as_one_at_a_time():
    """MovingAverageBaseline updates the averages of a rollout's decisions together: the same values
    as updating each alone (the first update sets it, a non-finite mean is skipped)."""
    from storch.method.baseline import MovingAverageBaseline

    together = MovingAverageBaseline(0.9)
    alone = {name: MovingAverageBaseline(0.9) for name in "abc"}
    rounds = ({"a": 1.0, "b": float("inf"), "c": 2.0}, {"a": 3.0, "b": 4.0, "c": float("nan")}, {"a": -1.0, "b": 0.5})
    for means in rounds:
        for name, value in means.items():
            together._pending[name] = torch.tensor(value)
            alone[name]._pending[name] = torch.tensor(value)
            alone[name].update()
        together.update()
    expected = {name: b.averages[name].item() for name, b in alone.items() if name in b.averages}
    assert {name: v.item() for name, v in together.averages.items()} == pytest.approx(expected)
    assert {k: expected[k] for k in "ac"} == pytest.approx({"a": 0.9 * (0.9 * 1.0 + 0.1 * 3.0) - 0.1, "c": 2.0})


@pytest.mark.parametrize("again", ["r3", "r98"], ids=["an early name", "a recent name"])
def test_a_cost_name_registered_long_ago_is_still_seen(again):
    """The registry's names are checked in O(1) per cost, and still against every name: a name given
    again, long ago or recently, is registered as another cost of that name (``name#2``)."""
    for t in range(100):
        storch.add_cost(torch.tensor(float(t)), f"r{t}")
    storch.add_cost(torch.tensor(1.0), again)
    names = [c.name for c in storch.registered_costs()]
    assert len(names) == 101 and names[-1] == f"{again}#2" and len(set(names)) == 101


def test_a_cell_on_tensors_only_gives_the_general_wrappers_result():
    """make_left_broadcastable's path for tensor arguments: the plates flattened and given back, a
    tuple output too, a plain argument expanded, and ignore_wrapping's flattened outputs."""
    from storch.wrappers import ignore_wrapping

    x = storch.denote_independent(torch.randn(4, 3), 0, "data")
    z = storch.method.Reparameterization("z", n_samples=2)(torch.distributions.Normal(x, 1.0))
    pair = storch.make_left_broadcastable(lambda a, b: (a + b, a.shape[0] * torch.ones(a.shape[0], 1)))
    s, n = pair(z, torch.ones(3))
    assert s.plate_names == ["z", "data"] and torch.equal(s._tensor, z._tensor + 1)
    assert n.plate_names == ["z", "data"] and torch.equal(n._tensor, torch.full((2, 4, 1), 8.0))
    with ignore_wrapping():
        flat, _ = pair(z, x)
    assert type(flat) is torch.Tensor and flat.shape == (8, 3)
    storch.reset()


def test_a_chain_step_keeps_one_view_of_each_tensor_of_its_distribution():
    """The node's distribution without the step it extended: a tensor held twice (``Categorical``'s
    ``_param`` is its ``logits``) is one view in the copy too."""
    _, _, second = _two_steps()
    copy = second.distribution
    assert copy._param is copy.logits and copy.logits.plate_names == ["episodes"]
    assert copy.batch_shape == (5,)
    storch.reset()


def test_arguments_that_carry_every_plate_are_flattened_without_an_expand():
    """An argument already of the plates' full size is only reshaped: no expand in the graph (each
    such view is an autograd node per decision)."""
    from storch.util import walk_backward_graph

    cell = storch.make_left_broadcastable(torch.nn.GRUCell(3, 3))
    obs = storch.denote_independent(torch.randn(5, 3, requires_grad=True), 0, "episodes")
    h = cell(obs, obs * 2)
    kinds = {type(node).__name__ for node in walk_backward_graph(h)}
    assert "ExpandBackward0" not in kinds and h.plate_names == ["episodes"]


def test_next_step_is_the_constructor_s_step():
    """`ChainPlate.next_step` (the rollout's fast path) makes the plate the constructor makes."""
    from storch.plate import AncestralPlate, ChainPlate, Plate

    data = Plate("episodes", 3)
    root = ChainPlate("a", (data,))
    built = ChainPlate("a", (data,), ancestor=root)
    fast = root.next_step("a", (data,))
    slots = {name for cls in ChainPlate.__mro__ for name in getattr(cls, "__slots__", ()) if name != "__weakref__"}
    assert slots >= set(ChainPlate.__slots__) | set(AncestralPlate.__slots__) | {"name", "order", "_weight"}
    for name in slots - {"order"}:
        a, b = getattr(built, name), getattr(fast, name)
        assert a is b or (isinstance(a, torch.Tensor) and torch.equal(a, b)) or a == b, name
    assert fast.order > built.order and root._extended_by() is fast and not root.is_tip and fast.is_tip
    assert fast.descends_from(root) and fast.weight == built.weight and fast.has_uniform_weight


def test_interned_layouts_are_shared_while_alive_and_forgotten_when_they_die():
    import gc

    from storch import plate as plate_module
    from storch.plate import Plate, layout_of_plates

    a, b = Plate("x", 2), Plate("y", 3)
    layout = layout_of_plates((a, b))
    assert layout_of_plates([a, b]) is layout and layout_of_plates((b, a)) is not layout
    key = (id(a), id(b))
    assert plate_module._interned[key]() is layout
    del layout
    gc.collect()
    assert key not in plate_module._interned  # the dead layout's entry went with it
    again = layout_of_plates((a, b))
    assert plate_module._interned[key]() is again and layout_of_plates((a, b)) is again
