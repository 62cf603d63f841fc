"""Cumulant registry: κ_n against the derivatives of the closed-form cumulant generating function.

K(t) = log E[e^{tz}] = Σ_n κ_n tⁿ/n!  (the log characteristic function at ω = −it), so κ_n = K⁽ⁿ⁾(0);
the n-th derivative at 0 is taken with autograd on the closed form of K, independently of the
registered formulas.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Chi2, Exponential, Gamma, Independent, Laplace, Normal, Uniform

from seeding import manual_seed
from storch.distributions import Dirac
from storch.method.cumulants import cumulant_terms, cumulants, register_cumulants, supported_distributions

ORDER = 8


def cgf_derivatives(cgf, order):
    """[K'(0), …, K⁽ᵒʳᵈᵉʳ⁾(0)] for a scalar function K of t, by repeated autograd (float64)."""
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    out, g = [], cgf(t)
    for _ in range(order):
        if g.requires_grad:
            (g,) = torch.autograd.grad(g, t, create_graph=True, allow_unused=True, materialize_grads=True)
        else:  # the previous derivative is constant: the rest vanish
            g = torch.zeros((), dtype=torch.float64)
        out.append(g.detach())
    return torch.stack(out)


CASES = {
    "normal": (lambda: Normal(torch.tensor(0.7, dtype=torch.float64), torch.tensor(1.3, dtype=torch.float64)),
               lambda t: 0.7 * t + 1.3**2 * t**2 / 2),
    "gamma": (lambda: Gamma(torch.tensor(2.5, dtype=torch.float64), torch.tensor(1.7, dtype=torch.float64)),
              lambda t: -2.5 * torch.log(1 - t / 1.7)),
    "chi2": (lambda: Chi2(torch.tensor(3.0, dtype=torch.float64)), lambda t: -1.5 * torch.log(1 - 2 * t)),
    "exponential": (lambda: Exponential(torch.tensor(0.8, dtype=torch.float64)), lambda t: -torch.log(1 - t / 0.8)),
    "laplace": (lambda: Laplace(torch.tensor(-0.4, dtype=torch.float64), torch.tensor(0.6, dtype=torch.float64)),
                lambda t: -0.4 * t - torch.log(1 - 0.36 * t**2)),
    "dirac": (lambda: Dirac(torch.tensor(2.5, dtype=torch.float64)), lambda t: 2.5 * t),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cumulants_are_cgf_derivatives(name):
    make, cgf = CASES[name]
    got = torch.stack(cumulants(make(), ORDER))
    expected = cgf_derivatives(cgf, ORDER)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_cumulants_match_sample_moments():
    """A check independent of any formula: mean, variance and third central moment of samples."""
    manual_seed(0)
    d = Gamma(torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64))
    x = d.sample((400_000,))
    k1, k2, k3 = cumulants(d, 3)
    assert abs(x.mean() - k1) < 5 * x.std() / 400_000**0.5
    assert abs(x.var() - k2) < 0.01
    assert abs(((x - x.mean()) ** 3).mean() - k3) < 0.01


def test_shapes_zero_terms_and_gradients():
    mu = torch.tensor([[0.1, 0.2, 0.3]], requires_grad=True)
    b = torch.tensor(0.5, requires_grad=True)
    d = Independent(Laplace(mu, b), 1)
    terms = cumulant_terms(d, 4)
    assert terms[2] is None  # odd cumulants above 1 vanish identically
    ks = cumulants(d, 4)
    assert all(k.shape == (1, 3) for k in ks)
    assert torch.equal(ks[2], torch.zeros(1, 3))
    (gb,) = torch.autograd.grad(ks[3].sum(), b)  # κ₄ = 2·3!·b⁴
    torch.testing.assert_close(gb, torch.tensor(3 * 2 * 6 * 4 * 0.5**3))
    assert cumulant_terms(Normal(0.0, 1.0), 3)[2] is None


def test_errors():
    with pytest.raises(ValueError, match="Uniform.*supported: .*Gamma.*Normal"):
        cumulants(Uniform(0.0, 1.0), 2)
    with pytest.raises(ValueError, match="at least 1"):
        cumulants(Normal(0.0, 1.0), 0)
    assert {"Normal", "Gamma", "Exponential", "Laplace", "Dirac", "Independent"} <= set(supported_distributions())


def test_register_new_family():
    class Shifted(Normal):
        pass

    assert cumulants(Shifted(0.0, 2.0), 2)[1].item() == 4.0  # inherits Normal's by the MRO

    @register_cumulants(Shifted)
    def _shifted(d, order):
        return [d.loc + 1.0] + [None] * (order - 1)

    try:
        assert cumulants(Shifted(0.0, 2.0), 2)[0].item() == 1.0
    finally:
        from storch.method import cumulants as module

        module._CUMULANTS.unregister(Shifted)
    assert math.isclose(cumulants(Shifted(0.0, 2.0), 1)[0].item(), 0.0)
