"""Issue 9: the failures a user cannot see become correct results or clear errors.

Each test reproduces one defect found by using storch as a new user would: memory kept alive by a
step, a lazily computed distribution parameter that lost its plates, costs leaking from a failed
step into the next, plates reduced by dimension index, non-finite costs, bad arguments.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, OneHotCategorical

import storch
from storch import _dispatch


# ------------------------------------------------------------------ 1. nothing of a step survives it
def _vae_step(enc: torch.nn.Module, dec: torch.nn.Module, data: torch.Tensor, create_graph: bool):
    x = storch.denote_independent(data, 0, "data")
    q = OneHotCategorical(logits=enc(x).reshape(-1, 4, 10))
    method = storch.method.ScoreFunction("z", n_samples=4, baseline_factory="batch_average")
    z = method(q)
    rec = dec(z.reshape(z.shape[:-2] + (40,)))
    storch.add_cost(((rec - x) ** 2).sum(-1), "rec")
    storch.backward(create_graph=create_graph)
    for p in list(enc.parameters()) + list(dec.parameters()):
        p.grad = None
    return [weakref.ref(method), weakref.ref(z.plate), weakref.ref(z.distribution), weakref.ref(x.plates[0])]


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_training_step_keeps_nothing_alive(create_graph):
    enc, dec = torch.nn.Linear(64, 40), torch.nn.Linear(40, 64)
    data = torch.rand(32, 64)
    refs = [r for _ in range(20) for r in _vae_step(enc, dec, data, create_graph)]
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} objects of finished steps are still alive: {alive[:4]}"
    # the dispatcher's layout caches drop their entries with the layouts they were keyed by
    assert len(_dispatch._union_cache) == 0 and len(_dispatch._plan_cache) == 0


def test_layout_caches_still_hit_while_layouts_live():
    a = storch.denote_independent(torch.ones(3, 2), 0, "a")
    b = storch.denote_independent(torch.ones(4, 2), 0, "b")
    first, second = a + b, a * b
    assert first._layout is second._layout  # the cached union, shared by both results
    assert len(_dispatch._union_cache) >= 1


# ------------------------------------------------------------------ 4. a plate reduced by index
def _three_by_three():
    return storch.method.ScoreFunction("z", n_samples=3)(OneHotCategorical(logits=torch.zeros(3, requires_grad=True)))


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.sum(0), lambda t: t.sum(dim=0), lambda t: torch.sum(t, 0), lambda t: t.mean(-2),
        lambda t: t.softmax(0), lambda t: torch.nn.functional.log_softmax(t, dim=0), lambda t: t.max(0),
        lambda t: t.norm(2, 0), lambda t: t.transpose(0, 1), lambda t: t.T, lambda t: t.t(), lambda t: t.mT,
        lambda t: t.flip(0), lambda t: t.movedim(1, 0), lambda t: t.unsqueeze(0), lambda t: torch.stack([t, t, t]),
        lambda t: torch.cat([t, t], 0), lambda t: t.cumsum(0), lambda t: t.logsumexp(0),
    ],
)
def test_a_dimension_argument_on_a_plate_is_refused_even_when_sizes_coincide(op):
    z = _three_by_three()  # plate 'z' of size 3 over a 3-valued one-hot: shape (3, 3)
    with pytest.raises(ValueError, match=r"dimension -?\d+, which is plate 'z' \(size 3\).*storch.reduce_plates\(t, 'z'\)"):
        op(z * torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.sum(-1), lambda t: t.sum(1), lambda t: t.softmax(-1), lambda t: torch.stack([t, t, t], -1),
        lambda t: torch.cat([t, t], -1), lambda t: t.unsqueeze(1), lambda t: torch.max(t, t), lambda t: t.norm(2, -1),
    ],
)
def test_event_dimensions_are_still_fine(op):
    z = _three_by_three()
    out = op(z)
    assert out.plate_names == ["z"] and out.shape[0] == 3


def test_dimension_of_a_plain_table_indexed_by_a_plated_tensor_is_not_a_plate():
    idx = storch.denote_independent(torch.tensor([[0, 1], [2, 0]]), 0, "data")
    out = torch.gather(torch.arange(6.0).reshape(3, 2), 0, idx)  # dim 0 of the plain table
    assert out.plate_names == ["data"] and out._tensor.tolist() == [[0.0, 3.0], [4.0, 1.0]]
