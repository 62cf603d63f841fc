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
