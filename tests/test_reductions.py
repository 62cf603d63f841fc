"""``storch.reductions.reduce_plate``: the weighted sum over one plate, on every kind of weight."""

from __future__ import annotations

import math

import pytest
import torch

import storch
from storch.plate import Plate
from storch.reductions import reduce_plate


def _tensor_with_plate_second(values: torch.Tensor, plate: Plate) -> storch.Tensor:
    """``values`` of shape (2, plate.size, 3) with plates [data, plate] (the weighted plate second)."""
    return storch.Tensor(values, [Plate("data", 2), plate])


@pytest.mark.parametrize("kind", ["plain vector", "storch vector", "storch vector with more plates"])
def test_weighted_sum_over_a_plate_that_is_not_the_first(kind):
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    plate = Plate("z", 3)
    if kind == "plain vector":
        plate.weight = w
    elif kind == "storch vector":
        plate.weight = storch.Tensor(w, [plate])
    else:  # a weight that also carries the data plate takes the general (aligned) path
        plate.weight = storch.Tensor(w.expand(2, 3).contiguous(), [Plate("data", 2), plate])
    values = torch.arange(18, dtype=torch.float64).reshape(2, 3, 3)
    out = reduce_plate(_tensor_with_plate_second(values, plate), plate)
    assert out.plate_names == ["data"]
    torch.testing.assert_close(out._tensor, (values * w[:, None]).sum(1), rtol=0, atol=1e-12)


def test_an_infinite_value_of_weight_zero_is_left_out_and_a_finite_one_keeps_its_derivative():
    plate = Plate("z", 3)
    w = torch.tensor([0.0, 0.4, 0.6], dtype=torch.float64, requires_grad=True)
    plate.weight = w
    values = torch.tensor([[math.inf, 1.0, 2.0], [3.0, 4.0, 5.0]], dtype=torch.float64)
    t = storch.Tensor(values, [Plate("data", 2), plate])
    out = reduce_plate(t, plate, detach_weights=False)
    torch.testing.assert_close(out._tensor, torch.tensor([1.6, 4.6], dtype=torch.float64))
    out._tensor.sum().backward()
    # d/dw_0: the finite value 3.0 counts, the infinite one of weight zero does not
    torch.testing.assert_close(w.grad, torch.tensor([3.0, 5.0, 7.0], dtype=torch.float64))


def test_detached_weights_get_no_gradient():
    plate = Plate("z", 2)
    w = torch.tensor([0.25, 0.75], requires_grad=True)
    plate.weight = w
    t = storch.Tensor(torch.ones(2, requires_grad=True) * 2.0, [plate])
    out = reduce_plate(t, plate)  # detach_weights=True by default
    assert out.item() == 2.0
    out.backward()
    assert w.grad is None


def test_a_non_finite_value_of_positive_weight_is_kept():
    """Only values of weight zero are left out: a NaN or infinity with a positive weight reaches the
    result (and storch.backward's finite check), whatever path the reduction takes."""
    plate = Plate("z", 2)
    plate.weight = torch.tensor([0.5, 0.5])
    out = reduce_plate(storch.Tensor(torch.tensor([1.0, math.inf]), [plate]), plate)
    assert out.item() == math.inf
    out = reduce_plate(storch.Tensor(torch.tensor([1.0, math.nan]), [plate]), plate)
    assert math.isnan(out.item())
