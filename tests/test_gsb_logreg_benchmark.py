"""benchmarks/gsb/logistic_regression.py: quick mode runs; its closed forms (KL, pure derivatives) are right."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.distributions import Laplace

from seeding import manual_seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gsb"))

import logistic_regression as lr  # noqa: E402

import storch  # noqa: E402
from storch.method.derivatives import pure_derivatives  # noqa: E402


def test_laplace_kl_matches_monte_carlo_for_several_prior_scales():
    manual_seed(0)
    mu, b = torch.tensor([0.0, 0.7, -1.3, 0.05]), torch.tensor([0.1, 0.5, 2.0, 0.3])
    for s in (0.5, 1.0, 3.0):
        q, p = Laplace(mu, b), Laplace(torch.zeros(4), torch.full((4,), s))
        w = q.sample((400_000,))
        mc = (q.log_prob(w) - p.log_prob(w)).mean(0)
        kl = lr.laplace_kl(mu, b, s)
        assert torch.allclose(kl, mc, atol=0.01), (s, kl, mc)
    assert torch.allclose(lr.laplace_kl(torch.zeros(2), torch.ones(2)), torch.zeros(2), atol=1e-7)  # q = p


def test_logsigmoid_derivatives_match_autograd():
    t = torch.linspace(-6, 6, 25, dtype=torch.float64, requires_grad=True)
    g = F.logsigmoid(t)
    closed = lr.logsigmoid_derivatives(t.detach(), 6)
    for n in range(6):
        (g,) = torch.autograd.grad(g.sum(), t, create_graph=True)
        assert torch.allclose(closed[n], g.detach(), atol=1e-10), n


def test_closed_form_pure_derivatives_match_storch_exact_ones():
    torch.manual_seed(0)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 2, (7,)).double() * 2 - 1
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    f = 3.0 * lr.log_likelihood(w, x, y)
    library = pure_derivatives(f, w, 4, n_plate_dims=1, max_exact_batch=4**3)
    closed = lr.pure_derivatives_closed_form(w.detach(), x, y, 3.0, 4)
    for n in range(4):
        assert torch.allclose(closed[n], library[n], rtol=1e-9, atol=1e-9), n


def test_closed_form_gsb_equals_storch_gsb_exact_on_the_same_samples():
    torch.manual_seed(1)
    x, y = torch.randn(9, 3), torch.randint(0, 2, (9,)).float() * 2 - 1
    mu, rho = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    torch.manual_seed(5)
    library = lr.storch_estimator(lambda: storch.method.GSB("w", n_samples=6, order=4, max_exact_batch=27))(
        mu, rho, x, y, 2.0)
    torch.manual_seed(5)
    closed = lr.closed_form_gsb(4, n_samples=6)(mu, rho, x, y, 2.0)
    assert torch.allclose(library, closed, rtol=1e-4, atol=1e-5), (library, closed)


def test_quick_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("gsb_common.RESULTS", str(tmp_path))
    out = lr.main(["--quick", "--steps", "2", "--true-samples", "1000", "--repeats", "2", "--train-repeats", "2"])
    assert set(out["training"]) == set(lr.TRAINED)
    rows = out["study"]["init"]["rows"]
    assert {"pathwise", "score", "GSB N=4 probes", "GSB N=8 closed"} <= set(rows)
    assert torch.isfinite(torch.tensor([r["log10_var"] for r in rows.values()])).all()
    for runs in out["training"].values():
        assert all(torch.isfinite(torch.tensor(r["logvar"] + r["elbo"])).all() for r in runs)
    text = capsys.readouterr().out
    assert "truncation bias" in text and "GSB N=8 probes" in text
    assert (tmp_path / "logreg_sources_quick.txt").exists() and (tmp_path / "logreg_sources_quick.json").exists()
