"""A whole training step under ``torch.compile`` (issue 11, item 1; see ``storch.compiler``).

The step (sample, ``add_cost``, ``backward``) is given to plain ``torch.compile`` (default backend).
storch's own frames run eagerly, so for the same seed the compiled step gives the eager step's
estimate and gradients exactly, for every core and multi-evaluation estimator, over several steps
(state such as a moving-average baseline carries over); compiled models pass the unbiasedness
test against the exact gradient for each of these estimators and for Reparameterization and MVD on
a Normal. On a GPU (skipped without one) the compiled steps match the eager ones up to rounding.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Normal

import problems  # tests/problems.py (on the path through conftest)
import storch
from storch.method import ARM, MVD, DisARM, Expect, LocalExpectation, Reparameterization, ScoreFunction
from storch.testing import assert_unbiased, replicated_gradients

@pytest.fixture(autouse=True, scope="module")
def _forget_compiled_code():
    yield
    torch._dynamo.reset()  # drop this module's compiled frames (and their guards) before the others


DISCRETE = {
    "score_function": lambda: ScoreFunction("z", n_samples=3),
    "score_function_moving_average": lambda: ScoreFunction("z", n_samples=2, baseline_factory="moving_average"),
    "score_function_batch_average": lambda: ScoreFunction("z", n_samples=3, baseline_factory="batch_average"),
    "expect": lambda: Expect("z"),
    "arm": lambda: ARM("z", n_samples=2),
    "disarm": lambda: DisARM("z", n_samples=2),
    "local_expectation": lambda: LocalExpectation("z", n_samples=2),
    "mvd": lambda: MVD("z", n_samples=2),
}


class SBN(nn.Module):
    """A small sigmoid belief network 8-[3] (the sbn-linear model in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.decoder = nn.Linear(8, 3), nn.Linear(3, 8)

    def step(self, x: torch.Tensor, method: storch.method.Method) -> torch.Tensor:
        x = storch.denote_independent(x, 0, "data")
        q = Bernoulli(logits=self.encoder(x))
        z = method(q)
        log_px = Bernoulli(logits=self.decoder(z)).log_prob(x).sum(-1)
        storch.add_cost(-log_px + q.log_prob(z).sum(-1), "neg_elbo")
        return storch.backward()


def _run(step, model: SBN, method, data: torch.Tensor, steps: int = 3):
    out = []
    for i in range(steps):
        model.zero_grad()
        torch.manual_seed(100 + i)
        estimate = step(data, method)
        out.append((estimate.detach().clone(), [p.grad.detach().clone() for p in model.parameters()]))
    return out


def _compare_compiled_to_eager(name: str, device: str = "cpu", exact: bool = True) -> None:
    data = (torch.rand(4, 8, generator=torch.Generator().manual_seed(1)) < 0.5).float().to(device)
    eager_model, compiled_model = SBN().to(device), SBN().to(device)
    eager = _run(eager_model.step, eager_model, DISCRETE[name](), data)
    compiled = _run(torch.compile(compiled_model.step), compiled_model, DISCRETE[name](), data)
    for (e_est, e_grads), (c_est, c_grads) in zip(eager, compiled):
        assert c_est.device.type == device
        for e, c in zip([e_est] + e_grads, [c_est] + c_grads):
            if exact:
                assert torch.equal(e, c)
            else:  # generated GPU kernels may round differently from eager ones
                torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(DISCRETE))
def test_a_compiled_step_equals_the_eager_step(name):
    _compare_compiled_to_eager(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(DISCRETE))
def test_a_compiled_step_on_cuda_equals_the_eager_step(name):
    """On a GPU the draws are the same (same seed, same device generator); the estimate and
    gradients agree up to the rounding of the kernels TorchInductor generates."""
    _compare_compiled_to_eager(name, "cuda", exact=False)


def test_a_compiled_reparameterized_step_equals_the_eager_step():
    mu = torch.tensor([0.5, -1.0], requires_grad=True)

    def step():
        x = Reparameterization("x", n_samples=4)(Normal(mu, 1.0))
        storch.add_cost(((x - 1.0) ** 2).sum(-1), "f")
        return storch.backward()

    results = []
    for f in (step, torch.compile(step)):
        mu.grad = None
        torch.manual_seed(3)
        results.append((f(), mu.grad.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", list(DISCRETE))
def test_a_compiled_model_is_unbiased(name):
    """Each discrete estimator, compiled, on the shared Bernoulli problem (tests/problems.py)."""
    problem = problems.bernoulli(interaction=0.0)  # f = sum_i (x_i - t_i)^2
    model = torch.compile(problem.model(DISCRETE[name]()))
    [estimates] = replicated_gradients([problem.phi], 4000, model)  # seeded by conftest
    assert_unbiased(estimates, problem.exact(), label=f"compiled {name}")


@pytest.mark.parametrize("name", ["reparameterization", "mvd"])
def test_a_compiled_continuous_model_is_unbiased(name):
    """Reparameterization and MVD on a Normal, compiled: d/dmu E[sum_i (x_i - 1)^2] = 2 (mu - 1)."""
    mu = torch.tensor([0.5, -1.0])
    method = Reparameterization("x", n_samples=2) if name == "reparameterization" else MVD("x", n_samples=1)

    def model(copies):
        x = method(Normal(copies, 1.0))
        storch.add_cost(((x - 1.0) ** 2).sum(-1), "f")

    [estimates] = replicated_gradients([mu], 4000, torch.compile(model))
    assert_unbiased(estimates, 2 * (mu - 1), label=f"compiled {name}")


def test_storch_frames_are_registered_as_skipped():
    assert storch.compiler.REGISTERED
    storch.compiler.skip_storch_frames()  # storch modules imported since (e.g. storch.bench)
    assert storch.compiler.skip_storch_frames() == 0  # everything imported is already marked
    step_code = storch.method.method.Method.forward.__code__
    assert step_code in storch.compiler._DONE


def test_compiling_docstring_examples_end_without_dynamo_cleanup_errors():
    """storch.compile's docstring example compiles a function in doctest's namespace, which doctest
    clears afterwards; dynamo deletes its globals there at interpreter exit. The root conftest.py
    keeps them, so the run ends without "Exception ignored ... KeyError: '__builtins_dict___1'"."""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "storch/compiler.py", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=300, cwd=root, check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Exception ignored" not in output and "KeyError" not in output, output[-3000:]
