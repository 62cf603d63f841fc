"""``storch.make_left_broadcastable`` on an ``nn.Module`` returns an ``nn.Module`` (``LeftBroadcastable``).

A model that assigns the wrapped cell (``self.cell = storch.make_left_broadcastable(nn.GRUCell(4, 8))``)
must register, train, save, copy and move the cell's parameters, and the wrapper must compute what
the bare module computes on each sample. Functions stay functions.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import storch
from storch.method import Reparameterization
from storch.wrappers import LeftBroadcastable

N_SAMPLES, BATCH, FEATURES, HIDDEN = 3, 2, 4, 8


class Policy(nn.Module):
    """A recurrent policy that holds its cell wrapped for plates (module level: pickled by reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = storch.make_left_broadcastable(nn.GRUCell(FEATURES, HIDDEN), batch_dims=1)
        self.readout = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        return self.readout(self.cell(x, h))


def _plated_input(mu: torch.Tensor | None = None) -> torch.Tensor:
    """``(N_SAMPLES, BATCH, FEATURES)`` on the sample plate ``z``."""
    mu = torch.zeros(BATCH, FEATURES) if mu is None else mu
    return Reparameterization("z", n_samples=N_SAMPLES)(Normal(mu, 1.0))


def _per_sample(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The bare module applied to each sample of the plate ``z`` separately."""
    with torch.no_grad():
        return torch.stack([module(x._tensor[i]) for i in range(x.shape[0])])


def test_a_module_gives_a_module_and_a_function_a_function():
    wrapped = storch.make_left_broadcastable(nn.GRUCell(FEATURES, HIDDEN))
    assert isinstance(wrapped, LeftBroadcastable) and isinstance(wrapped, nn.Module)
    decorated = storch.make_left_broadcastable(batch_dims=1)(nn.GRUCell(FEATURES, HIDDEN))
    assert isinstance(decorated, LeftBroadcastable) and decorated.batch_dims == 1

    def double(t):
        return 2 * t

    fn = storch.make_left_broadcastable(double)
    assert not isinstance(fn, nn.Module) and fn.__name__ == "double" and fn.__wrapped__ is double
    x = storch.denote_independent(torch.ones(3, 2), 0, "data")
    assert fn(x).plate_names == ["data"] and fn(x)._tensor.tolist() == [[2.0, 2.0]] * 3


def test_parameters_are_registered_in_the_parent_module():
    policy = Policy()
    names = [name for name, _ in policy.named_parameters()]
    assert names == [
        "cell.module.weight_ih", "cell.module.weight_hh", "cell.module.bias_ih", "cell.module.bias_hh",
        "readout.weight", "readout.bias",
    ]
    assert policy.cell.module.weight_ih is dict(policy.named_parameters())["cell.module.weight_ih"]
    # attributes the wrapper lacks are the wrapped module's
    assert policy.cell.hidden_size == HIDDEN and policy.cell.weight_ih is policy.cell.module.weight_ih
    with pytest.raises(AttributeError, match="no_such_attribute"):
        policy.cell.no_such_attribute


def test_an_optimizer_step_changes_the_wrapped_parameters():
    policy = Policy()
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    x = _plated_input()
    h = policy.cell(x)  # two steps, so that weight_hh gets a gradient too
    out = policy(x, h)
    storch.add_cost((out**2).sum(-1).sum(-1), "f")
    storch.backward()
    optimizer.step()
    for name, p in policy.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert not torch.equal(p.detach(), before[name]), name


def test_outputs_equal_the_module_applied_per_sample():
    torch.manual_seed(1)
    cell = nn.GRUCell(FEATURES, HIDDEN)
    x = _plated_input(torch.randn(BATCH, FEATURES))
    out = storch.make_left_broadcastable(cell, batch_dims=1)(x)
    assert out.plate_names == ["z"] and out.shape == (N_SAMPLES, BATCH, HIDDEN)
    torch.testing.assert_close(out._tensor.detach(), _per_sample(cell, x))
    # the minibatch as a plate (batch_dims=0), and a tuple state (LSTMCell)
    data = storch.denote_independent(torch.randn(BATCH, FEATURES), 0, "data")
    noise = Reparameterization("eps", n_samples=N_SAMPLES)(Normal(torch.zeros(FEATURES), 1.0))
    lstm = nn.LSTMCell(FEATURES, HIDDEN)
    h, c = storch.make_left_broadcastable(lstm)(noise + data)
    assert h.plate_names == ["eps", "data"] and c.shape == (N_SAMPLES, BATCH, HIDDEN)
    with torch.no_grad():
        expected = [lstm(noise._tensor[i] + data._tensor) for i in range(N_SAMPLES)]
    torch.testing.assert_close(h._tensor.detach(), torch.stack([e[0] for e in expected]))
    torch.testing.assert_close(c._tensor.detach(), torch.stack([e[1] for e in expected]))


def test_state_dict_round_trip():
    policy = Policy()
    state = policy.state_dict()
    assert list(state) == [
        "cell.module.weight_ih", "cell.module.weight_hh", "cell.module.bias_ih", "cell.module.bias_hh",
        "readout.weight", "readout.bias",
    ]
    fresh = Policy()
    fresh.load_state_dict(state)
    x = _plated_input()
    torch.testing.assert_close(fresh(x)._tensor, policy(x)._tensor)
    # the bare module's checkpoint loads into the wrapped module, and back
    bare = nn.GRUCell(FEATURES, HIDDEN)
    fresh.cell.module.load_state_dict(bare.state_dict())
    torch.testing.assert_close(fresh.cell.module.weight_hh, bare.weight_hh)
    bare.load_state_dict(policy.cell.module.state_dict())
    torch.testing.assert_close(bare.weight_hh, policy.cell.module.weight_hh)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_the_parameters(how):
    policy = Policy()
    if how == "deepcopy":
        other = copy.deepcopy(policy)
    elif how == "pickle":
        other = pickle.loads(pickle.dumps(policy))
    else:
        buffer = io.BytesIO()
        torch.save(policy, buffer)
        buffer.seek(0)
        other = torch.load(buffer, weights_only=False)
    assert isinstance(other.cell, LeftBroadcastable) and other.cell.batch_dims == 1
    assert len(list(other.parameters())) == len(list(policy.parameters())) == 6
    for (name, p), (_, q) in zip(policy.named_parameters(), other.named_parameters()):
        assert p is not q and torch.equal(p, q), name
    x = _plated_input()
    torch.testing.assert_close(other(x)._tensor, policy(x)._tensor)


def test_to_float64():
    policy = Policy().to(torch.float64)
    assert all(p.dtype == torch.float64 for p in policy.parameters())
    x = _plated_input(torch.zeros(BATCH, FEATURES, dtype=torch.float64))
    out = policy.cell(x)
    assert out.dtype == torch.float64 and out.plate_names == ["z"]
    torch.testing.assert_close(out._tensor.detach(), _per_sample(policy.cell.module, x))


def test_repr_names_the_module_and_batch_dims():
    text = repr(storch.make_left_broadcastable(nn.GRUCell(FEATURES, HIDDEN), batch_dims=1))
    assert text.startswith("LeftBroadcastable(") and "batch_dims=1" in text and "GRUCell(4, 8)" in text
