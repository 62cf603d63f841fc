"""The GSB reproductions in benchmarks/gsb/ still run (quick mode), and their closed forms are right."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.distributions import Gamma, Laplace

from seeding import manual_seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gsb"))

import bayes_logreg  # noqa: E402
import toy_problems  # noqa: E402


def test_laplace_kl_matches_monte_carlo():
    manual_seed(0)
    mu, b = torch.tensor([0.0, 0.7, -1.3]), torch.tensor([0.1, 0.5, 2.0])
    q, p = Laplace(mu, b), Laplace(torch.zeros(3), torch.full((3,), bayes_logreg.PRIOR_SCALE))
    w = q.sample((400_000,))
    mc = (q.log_prob(w) - p.log_prob(w)).mean(0)
    assert torch.allclose(bayes_logreg.laplace_kl(mu, b), mc, atol=0.01), (bayes_logreg.laplace_kl(mu, b), mc)


@pytest.mark.parametrize("problem", [1, 2])
def test_toy_exact_losses_match_monte_carlo(problem):
    manual_seed(0)
    a, m = torch.tensor([0.3, -0.4]), torch.tensor([0.1, 0.8])
    z = toy_problems.distribution(a, m).sample((400_000,))
    mc = toy_problems.cost(problem, z).mean()
    exact = toy_problems.exact_loss(problem, a, m)
    assert abs(mc - exact) < 0.01 * exact, (mc, exact)


def test_toy_truncation_bound_is_an_upper_bound():
    x, order = 0.6, 4
    exact = torch.log1p(torch.tensor(x, dtype=torch.float64))
    truncated = sum((-1) ** (n + 1) * x**n / n for n in range(1, order + 1))
    assert abs(truncated - exact) / exact <= toy_problems.truncation_bound(x, order)


def test_quick_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("gsb_common.RESULTS", str(tmp_path))
    toy = toy_problems.main(["--quick", "--steps", "4", "--dims", "1", "3", "--seeds", "1"])
    assert set(toy) == {(p, d, e) for p in (1, 2) for d in (1, 3) for e in ("gsb", "pathwise", "score")}
    logreg = bayes_logreg.main(["--quick", "--steps", "2"])
    assert set(logreg) == set(bayes_logreg.ESTIMATORS)
    out = capsys.readouterr().out
    assert "toy 2" in out and "GSB N=8" in out
    assert (tmp_path / "toy_quick.txt").exists() and (tmp_path / "logreg_quick.json").exists()
    for runs in list(toy.values()) + list(logreg.values()):
        assert all(torch.isfinite(torch.tensor(r["logvar"])).all() for r in runs)
