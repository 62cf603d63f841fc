"""The demo (``python -m storch.demo``): the introduction table and a quick discrete-VAE run."""

import io
import math
import re
import sys

import pytest
import torch

import storch
from seeding import generator, manual_seed
import storch.demo
from storch.demo import main, vae
from storch.demo.intro import (
    ROWS,
    TRUE_GRADIENT,
    closed_form_variance,
    exact_variance,
    run_intro,
    run_row,
)


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
    g = generator(1)
    n, reps = 3, 400_000
    eps = torch.randn(reps, n, generator=g, dtype=torch.float64)
    f = 2.0 * (-2.77 + eps) ** 2
    baseline = (f.sum(1, keepdim=True) - f) / (n - 1)
    grads = ((f - baseline) * eps).mean(1)
    true = exact_variance("score_loo", n)
    # the sample variance of this heavy-ish tailed estimator has a relative SE of about 1%
    assert grads.var().item() == pytest.approx(true, rel=0.05)


def test_reparameterization_within_sampling_error():
    # 4.5 standard errors (mean and variance): passes at any seed with probability > 1 − 1e-4
    manual_seed(123)
    r = run_row(ROWS[0], 400, threshold=4.5)
    se = math.sqrt(16.0 / 400)
    assert abs(r.mean - TRUE_GRADIENT) <= 4.5 * se
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
    assert "evals" in summary.splitlines()[1]
    assert _numbers(expect_line.split(")", 1)[1])[-1] == 100.0  # evaluations per datum: the whole support
    # every method of the comparison is in the summary: run (with numbers) or listed with the reason
    runnable, missing = vae.available(list(vae.METHODS))
    assert {"score", "score-rloo", "gumbel", "expect"} <= set(runnable)
    for key in runnable:
        label = vae.METHODS[key].label
        (line,) = [s for s in summary.splitlines() if s.startswith(label + " ")]
        numbers = _numbers(line[len(label):])
        assert len(numbers) >= 7 and all(math.isfinite(x) for x in numbers), line
        assert numbers[-1] >= 1  # cost evaluations per datum and step
    for key, reason in missing.items():
        (line,) = [s for s in summary.splitlines() if s.startswith(vae.METHODS[key].label + " ")]
        assert line.rstrip().endswith(reason)
        assert reason.startswith(("not importable", "not applicable"))


def test_unimportable_method_is_listed_not_dropped():
    spec = vae.MethodSpec("ghost", "Ghost estimator", lambda: None, requires=("storch.method.no_such_module", "Ghost"))
    assert spec.missing().startswith("not importable (ModuleNotFoundError")
    absent = vae.MethodSpec("ghost2", "Ghost", lambda: None, requires=("storch.method.score_function", "Ghost"))
    assert "has no attribute 'Ghost'" in absent.missing()
    assert vae.METHODS["arm"].missing() in (
        "not applicable: Bernoulli nodes only",
        *(m for m in [vae.METHODS["arm"].missing()] if m.startswith("not importable")),
    )
    saved = dict(vae.METHODS)
    try:
        vae.METHODS["ghost"] = spec
        buf = io.StringIO()
        vae.run_vae(vae.quick_config(methods=("score", "ghost"), grad_samples=2), out=buf, progress_bar=False)
        summary = buf.getvalue().split("Summary", 1)[1]
        assert any(line.startswith("Ghost estimator") and "not importable" in line for line in summary.splitlines())
        assert any(line.startswith("ScoreFunction n=1") for line in summary.splitlines())
    finally:
        vae.METHODS.clear()
        vae.METHODS.update(saved)


class _FixedEncoder(vae.DiscreteVAE):
    """The demo's model with the encoder replaced by fixed logits ``u`` (a leaf), to read ``∂/∂u``."""

    def __init__(self, u):
        super().__init__(64, (16, 8), u.shape[1], u.shape[2])
        self.u = u

    def encode(self, x):
        return storch.denote_independent(self.u.reshape(self.u.shape[0], -1), 0, "data")


def test_evaluated_gradient_is_the_gradient_wrt_the_encoder_logits():
    # the comparison uses g - p * sum(g) from param_grads["logits"]; it must equal autograd's gradient
    # w.r.t. the encoder output, also when a probability is below float32 eps (the clamping of
    # probs-built categoricals made Expect's gradient through it zero, see storch/demo/vae.py)
    torch.manual_seed(3)
    u = torch.randn(3, 2, 10)
    u[0, 1, 4] = -25.0  # probability ~1e-11 < 1.2e-7
    u.requires_grad_()
    model = _FixedEncoder(u)
    data = (torch.rand(3, 64) < 0.5).float()
    z = vae.generative_story(storch.method.Expect("z"), model, data)
    storch.backward()
    g = vae._centred_grad(z)
    g = g._tensor if hasattr(g, "_tensor") else g
    assert torch.allclose(g, u.grad, atol=1e-6, rtol=1e-4)
    assert float(g.sum(-1).abs().max()) < 1e-5


def test_unbiased_catalog_estimators_show_no_bias_in_the_demo_evaluation():
    # an unbiased estimator of the catalog, evaluated as in the demo, has bias² ≈ 0 against Expect
    le = pytest.importorskip("storch.method.local_expectation")
    manual_seed(0)
    model = vae.DiscreteVAE(64, (32, 16), 2, 10)
    with torch.no_grad():
        model.fc3.bias[3] = -25.0  # a posterior probability below float32 eps
    data = (torch.rand(4, 64) < 0.4).float()
    _, var, bias_raw = vae.evaluate(le.LocalExpectation("z", n_samples=1), model, data, 20)
    assert var > 0
    assert abs(bias_raw - var / 20) < 5 * var / 20 + 1e-9


def test_the_exact_nelbo_is_measured_on_a_fixed_random_subset_not_a_prefix():
    """A prefix of a sorted split (binarized MNIST's test split is sorted by digit) is one class."""
    data = torch.arange(100.0).unsqueeze(1)  # sorted, like that split
    config = vae.quick_config()
    config.nelbo_subset = 20
    subset = vae.nelbo_subset(data, config)
    assert subset.shape == (20, 1) and len(set(subset.squeeze(1).tolist())) == 20
    assert subset.max().item() >= 40  # a prefix would stop at 19
    assert torch.equal(vae.nelbo_subset(data, config), subset)  # the same subset in every run
    config.nelbo_subset = 500
    assert torch.equal(vae.nelbo_subset(data, config), data)  # all of a smaller set


def test_cli_rejects_missing_mnist_directory(tmp_path, capsys):
    assert main(["--part", "vae", "--mnist", str(tmp_path / "nothing"), "--no-progress"]) == 2
    assert "never downloads" in capsys.readouterr().err


def test_the_demo_without_tqdm_says_so_in_one_line(monkeypatch, capsys):
    for name in ("tqdm", "tqdm.auto"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    storch.demo._note_no_tqdm.cache_clear()
    buf = io.StringIO()
    run_intro(repetitions=4, rows=ROWS[:1], out=buf, progress_bar=True)
    vae.run_vae(vae.quick_config(methods=("score-rloo",), epochs=1), out=buf, progress_bar=True)
    text = buf.getvalue()
    assert "Introduction example" in text and f"== {vae.METHODS['score-rloo'].label} ==" in text
    assert capsys.readouterr().err == storch.demo.NO_TQDM + "\n"  # one line, once, and no traceback
    assert 'pip install "storch[demo]"' in storch.demo.NO_TQDM
    storch.demo._note_no_tqdm.cache_clear()
