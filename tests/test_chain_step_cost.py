"""What a new step of a single-sample chain costs in the rollout: nothing is merged, planned or cached
again for a layout that only differs from a known one by the chain's newer step."""

from __future__ import annotations

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
