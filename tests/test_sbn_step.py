"""The hand-written sbn-linear reference steps of ``benchmarks/sbn_step.py`` compute storch's estimators.

REINFORCE, RLOO, ARM and DisARM, hand-written in plain PyTorch, must give the same value and the
same gradients as the storch steps on the same random draws (seeded identically), on a small
random binary batch (no MNIST needed).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import common  # noqa: E402
import sbn_step  # noqa: E402


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    return torch.bernoulli(torch.full((6, sbn_step.X_DIM), 0.3), generator=g)


def test_handwritten_equals_storch(batch):
    rows = sbn_step.check_estimators(batch, seeds=(0, 1))
    assert [r[0] for r in rows] == list(sbn_step.ESTIMATORS)
    for name, dv, dg, gmax, ok in rows:
        assert ok, f"{name}: value difference {dv:.3e}, gradient difference {dg:.3e} (max |grad| {gmax:.3g})"
        assert gmax > 1e-3, f"{name}: gradients are (nearly) zero, the check would be vacuous"


@pytest.mark.parametrize("name", ["REINFORCE", "ARM"])
def test_check_is_sensitive_to_the_draws(batch, name):
    """Different seeds give different gradients: the agreement above is not vacuous."""
    data = batch.double()
    model, _ = sbn_step.make_model(0, train_mean=data.mean(0), dtype=torch.float64)
    method = sbn_step.make_method(name)
    torch.manual_seed(0)
    sbn_step.storch_grad(model, data, method)
    g_s = model.encoder.weight.grad.clone()
    torch.manual_seed(1)
    sbn_step.hw_grad(name)(model, data)
    assert (g_s - model.encoder.weight.grad).abs().max() > 1e-3


@pytest.mark.parametrize("name", sbn_step.ESTIMATORS)
def test_floor_variant_computes_the_handwritten_step(batch, name):
    """The benchmark's floor (the hand-written step on a do-nothing tensor subclass) does the same
    work as the hand-written step: same draws, same gradients, and its tensors are the subclass."""
    data = batch.double()
    grads = []
    for grad in (sbn_step.hw_grad(name), sbn_step.floor_grad(name)):
        model, _ = sbn_step.make_model(0, train_mean=data.mean(0), dtype=torch.float64)
        torch.manual_seed(3)
        value = grad(model, data)
        assert type(value) is torch.Tensor
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().max() > 1e-3
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert type(common.floor_view(data) * 2 + 1) is common.FloorTensor
