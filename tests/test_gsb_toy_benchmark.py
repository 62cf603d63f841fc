"""What the GSB toy benchmark (benchmarks/gsb/toy_problems.py, paper section 6.1) relies on, beyond its
smoke run (tests/test_gsb_benchmarks.py):

* at d = 100 and order 10, GSB's orders ≥ 3 use random-sign probes (``D^{n−1} > max_exact_batch``); on the
  toy's separable costs the mixed partials vanish, so the probes are *exact*, not merely unbiased;
* on toy 2 (``f = Σ_j exp(−ε z_j)``, ``x = εμ``) GSB at order N is an unbiased estimate of the truncated
  series ``T_N = ∇[k Σ_{n≤N} (−x)ⁿ/n] · (1+x)^{−k}``, whose relative bias ``(T_N − ∇L)/∇L`` is exactly
  ``−(−x)^N`` for the μ gradient (geometric series: even N shrinks |∇μ| by ``x^N``) and at most ``x^{N+1}/((N+1) log(1+x))`` for the k gradient; at the end of
  the benchmark's training (k ≈ 3.55, μ ≈ 1.46, x ≈ 0.72) order 10 leaves ≈ 3.5 % on ∇μ (and 0.5 % on ∇k).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import storch
from storch.method.gsb import GSB
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gsb"))

import toy_problems  # noqa: E402

EPS = toy_problems.EPS


def _gsb_gradient(problem: int, a: torch.Tensor, m: torch.Tensor, order: int, seed: int, **options) -> list:
    a, m = a.detach().clone().requires_grad_(), m.detach().clone().requires_grad_()
    storch.reset()
    torch.manual_seed(seed)
    z = GSB("z", n_samples=3, order=order, **options)(toy_problems.distribution(a, m))
    storch.add_cost(toy_problems.cost(problem, z), "f")
    storch.backward()
    storch.reset()
    return [a.grad, m.grad]


def test_probes_are_exact_on_the_separable_toy_costs():
    """Same samples (same seed): all-probe GSB (max_exact_batch=1) equals exact pure derivatives (5³ = 125
    copies ≤ 256) on both toys; a coupling term (mixed partial) makes them differ, so the check can fail."""
    a, m = torch.linspace(-0.5, 0.5, 5), torch.linspace(0.2, -0.3, 5)
    for problem in (1, 2):
        exact = _gsb_gradient(problem, a, m, order=4, seed=1)
        probed = _gsb_gradient(problem, a, m, order=4, seed=1, max_exact_batch=1)
        for e, p in zip(exact, probed):
            assert torch.allclose(e, p, rtol=1e-5, atol=1e-7), (problem, e, p)

    def coupled(a_, m_, max_exact_batch):
        a_, m_ = a_.detach().clone().requires_grad_(), m_.detach().clone().requires_grad_()
        storch.reset()
        torch.manual_seed(1)
        z = GSB("z", n_samples=3, order=2, max_exact_batch=max_exact_batch)(toy_problems.distribution(a_, m_))
        storch.add_cost(toy_problems.cost(1, z) + z[..., 0] * z[..., 1], "f")
        storch.backward()
        storch.reset()
        return m_.grad

    assert not torch.allclose(coupled(a, m, 256), coupled(a, m, 1), rtol=1e-3)


def _truncated_series(a: torch.Tensor, m: torch.Tensor, order: int) -> torch.Tensor:
    """``(1+x)^{−k}`` (held constant) times ``k Σ_{n≤N} (−x)ⁿ/n``: its gradient is GSB's expectation."""
    k, x = F.softplus(a), EPS * F.softplus(m)
    series = k * sum((-x) ** n / n for n in range(1, order + 1))
    return (series * ((1 + x) ** -k).detach()).sum()


def _grads(fn, a: torch.Tensor, m: torch.Tensor) -> list:
    a, m = a.detach().clone().requires_grad_(), m.detach().clone().requires_grad_()
    return list(torch.autograd.grad(fn(a, m), [a, m]))


def test_toy2_truncation_bias_at_the_end_of_training():
    k, mu = 3.55, 1.46  # where the benchmark's GSB runs end (2000 Adam steps, lr 1e-3, d = 1)
    a = torch.tensor([toy_problems.inverse_softplus(k)], dtype=torch.float64)
    m = torch.tensor([toy_problems.inverse_softplus(mu)], dtype=torch.float64)
    x = EPS * mu
    exact = _grads(lambda a_, m_: toy_problems.exact_loss(2, a_, m_), a, m)

    # closed forms: the μ gradient's relative bias is −(−x)^N, the k gradient's is below the printed bound
    for order in (6, 10):
        trunc = _grads(lambda a_, m_: _truncated_series(a_, m_, order), a, m)
        assert torch.allclose((trunc[1] - exact[1]) / exact[1], torch.tensor(-((-x) ** order), dtype=torch.float64))
        rel_k = ((trunc[0] - exact[0]) / exact[0]).abs().item()
        assert rel_k <= toy_problems.truncation_bound(x, order)
    assert abs(x**10) > 0.03  # order 10 leaves > 3 % on ∇μ here

    # GSB estimates T_N without bias, and at N = 6 (x⁶ ≈ 0.13) the bias against the exact gradient shows
    order, repeats = 6, 4000
    a32, m32 = a.float(), m.float()

    def model(a_, m_):
        z = GSB("z", n_samples=1, order=order)(toy_problems.distribution(a_, m_))
        storch.add_cost(toy_problems.cost(2, z), "f")

    estimates = replicated_gradients([a32, m32], repeats, model)
    trunc = _grads(lambda a_, m_: _truncated_series(a_, m_, order), a32, m32)
    for est, t, name in zip(estimates, trunc, ("a", "m")):
        assert_unbiased(est, t, label=f"toy 2 GSB order {order} vs T_{order}, param {name}")
    biased = check_unbiased(estimates[1], exact[1].float())
    assert not biased.passed, str(biased)
    assert biased.zscores.min() > 6, str(biased)
