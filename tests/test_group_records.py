"""GroupRecords (storch.method.groups): a record lives as long as the samples it was kept for."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributions import Normal

import storch
from storch.extend import node_of
from storch.method.groups import GroupRecords


def test_record_is_found_for_its_samples_and_forgotten_with_them():
    records = GroupRecords("MyMethod", "uniforms")
    x = storch.method.ScoreFunction("x", n_samples=2)(Normal(torch.zeros(()), 1.0))
    records.keep(node_of(x).samples, "u")
    assert records.of(x) == "u"
    storch.reset()
    del x
    gc.collect()
    assert records._records == {}


def test_a_record_is_not_given_to_other_samples():
    records = GroupRecords("MyMethod", "uniforms")
    x = storch.method.ScoreFunction("x", n_samples=2)(Normal(torch.zeros(()), 1.0))
    y = storch.method.ScoreFunction("y", n_samples=2)(Normal(torch.zeros(()), 1.0))
    records.keep(node_of(x).samples, "u")
    with pytest.raises(RuntimeError, match="no uniforms recorded"):
        records.of(y)
    storch.reset()


def test_group_weights_are_made_once_and_usable_after_inference_mode():
    """The weight vector of a group layout is shared between steps (no tensor made per step); one
    first asked for under ``torch.inference_mode`` (an evaluation pass) still enters a later backward."""
    from torch.distributions import Bernoulli

    from storch.method.groups import _GROUP_WEIGHTS, group_weights

    _GROUP_WEIGHTS.clear()
    with torch.inference_mode():
        first = group_weights(3, [0.25, 0.75])
    assert group_weights(3, [0.25, 0.75]) is first and not first.is_inference()
    assert torch.equal(first, (torch.tensor([0.25, 0.75]) / 3).repeat(3))
    logits = torch.tensor([0.3, -0.2], requires_grad=True)
    with torch.inference_mode():
        storch.method.ARM("b", n_samples=2)(Bernoulli(logits=logits.detach()))
    storch.reset()
    b = storch.method.ARM("b", n_samples=2)(Bernoulli(logits=logits))
    storch.add_cost(b.sum(-1), "f")
    storch.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
