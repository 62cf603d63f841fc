"""benchmarks/gsb/toy_closed_form.py: its eq. 25 estimator is unbiased beyond the series' radius, and it runs."""

from __future__ import annotations

import os
import sys

import torch

from seeding import manual_seed
from storch.method.gsb import GSB
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gsb"))

import toy_closed_form as toy  # noqa: E402

# a = log k, b = log μ per run (2 runs × 3 coordinates); ε μ up to 0.49·e^1.2 ≈ 1.6 > 1: the
# truncated series diverges for the last coordinate of each run
A = torch.tensor([[0.0, 0.5, -0.3], [0.2, 0.0, 0.4]])
B = torch.tensor([[0.0, -0.7, 1.2], [0.3, 0.9, 1.1]])


def _estimates(make, repeats=4000):
    def model(a, b):
        toy.model(a, b, make(), toy.cost2)

    manual_seed(0)
    ga, gb = replicated_gradients([A, B], repeats, model)
    s = A.shape[0]  # the seed plate averages the runs: undo its 1/S
    return torch.cat([ga.flatten(1), gb.flatten(1)], 1) * s


def _exact():
    ga, gb = toy.exact_grads(A, B, toy.exact2)
    return torch.cat([ga.flatten(), gb.flatten()]).float()


def test_eq25_closed_form_is_unbiased_beyond_the_radius_of_convergence():
    assert float((toy.EPS * B.exp()).max()) > 1.5
    assert_unbiased(_estimates(lambda: toy.GSBExponential("z", 3, toy.EPS)), _exact(), label="GSB eq. 25")


def test_truncated_series_is_biased_there_and_fine_inside():
    est = _estimates(lambda: GSB("z", n_samples=3, order=8), repeats=1000)
    report = check_unbiased(est, _exact())
    inside = (toy.EPS * B.exp() < 0.6).flatten().repeat(2)  # (a, b) coordinates with εμ < 0.6
    z = report.zscores.flatten()
    assert z[~inside].max() > 50, report  # diverging terms: far beyond any noise
    assert z[inside].max() < 4.5, report  # relative truncation bias ≤ 0.6^8 ≈ 2 %: within the noise


def test_quick_mode_runs_and_writes_its_tables(tmp_path, capsys):
    assert toy.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("GSB order 2 (exact)", "GSB eq. 25 (closed form)", "GSB order 8 (truncated)", "pathwise", "score"):
        assert label in out
    assert (tmp_path / "toy_closed_form_quick.txt").read_text().count("Problem ") == 4
    assert (tmp_path / "toy_closed_form_quick.json").exists()
