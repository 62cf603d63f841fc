"""The demo (``python -m storch.demo``): the introduction table and a quick discrete-VAE run."""

import io
import math
import re

import pytest
import torch

from storch.demo import main
from storch.demo.intro import (
    ROWS,
    TRUE_GRADIENT,
    closed_form_variance,
    exact_variance,
    run_intro,
    run_row,
)

pytest.importorskip("sklearn")
pytest.importorskip("tqdm")

FLOAT = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b[-+]?(?:nan|inf)\b", re.IGNORECASE)


def _numbers(line):
    return [float(x) for x in FLOAT.findall(line)]


def test_exact_variances_match_closed_forms_and_spec():
    # SPEC §5: true variances 16, 1.6, 725.2, 16.1 and ≈15.0
    cases = [("reparameterization", 1, 16.0), ("reparameterization", 10, 1.6), ("score", 1, 725.2),
             ("score", 45, 16.1), ("score_loo", 20, 14.94)]
    for kind, n, spec in cases:
        quad = exact_variance(kind, n)
        assert quad == pytest.approx(closed_form_variance(kind, n), rel=1e-10)
        assert quad == pytest.approx(spec, abs=0.05)
    assert TRUE_GRADIENT == pytest.approx(-11.08)


def test_exact_variance_of_loo_matches_simulation():
    # brute-force check of the leave-one-out formula with n = 3 (vectorised, no storch involved)
    g = torch.Generator().manual_seed(1)
    n, reps = 3, 400_000
    eps = torch.randn(reps, n, generator=g, dtype=torch.float64)
    f = 2.0 * (-2.77 + eps) ** 2
    baseline = (f.sum(1, keepdim=True) - f) / (n - 1)
    grads = ((f - baseline) * eps).mean(1)
    true = exact_variance("score_loo", n)
    # the sample variance of this heavy-ish tailed estimator has a relative SE of about 1%
    assert grads.var().item() == pytest.approx(true, rel=0.05)


def test_reparameterization_within_sampling_error():
    torch.manual_seed(123)
    r = run_row(ROWS[0], 400)
    se = math.sqrt(16.0 / 400)
    assert abs(r.mean - TRUE_GRADIENT) <= 3 * se
    assert r.true_variance == pytest.approx(16.0)
    assert r.within_error


def test_intro_table_small_r():
    buf = io.StringIO()
    results = run_intro(repetitions=30, out=buf, progress_bar=False)
    text = buf.getvalue()
    assert "estimator" in text and "true mean" in text and "true var" in text and "within error" in text
    assert len(results) == len(ROWS)
    for r in results:
        assert math.isfinite(r.mean) and math.isfinite(r.variance) and r.variance > 0
    rows = [line for line in text.splitlines() if line.startswith(("Reparameterization", "ScoreFunction", "Infer"))]
    assert len(rows) == len(ROWS)
    for line in rows:
        assert all(math.isfinite(x) for x in _numbers(line))


def test_cli_quick(capsys):
    assert main(["--quick", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "true var" in out
    assert "Summary" in out
    for header in ("train NELBO", "exact NELBO", "grad var", "bias²"):
        assert header in out
    labels = ("ScoreFunction n=1, no baseline", "ScoreFunction n=10, batch_average", "GumbelSoftmax", "Expect")
    summary = out.split("Summary", 1)[1]
    for label in labels:
        (line,) = [s for s in summary.splitlines() if s.startswith(label)]
        numbers = _numbers(line.split(")", 1)[-1] if "(" in line else line[len(label):])
        assert len(numbers) >= 5 and all(math.isfinite(x) for x in numbers), line
    # the exact method has no gradient variance, the others do
    (expect_line,) = [s for s in summary.splitlines() if s.startswith("Expect")]
    assert _numbers(expect_line.split(")", 1)[1])[2] == 0.0


def test_cli_rejects_missing_mnist_directory(tmp_path, capsys):
    assert main(["--part", "vae", "--mnist", str(tmp_path / "nothing"), "--no-progress"]) == 2
    assert "never downloads" in capsys.readouterr().err
