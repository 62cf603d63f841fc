"""A chain's log-probabilities from its steps' parameters stacked (`storch._stacked_log_prob`).

The surrogate of a single-sample chain drawn by one score-function method needs ``log p_t(x_t)`` of
every step. For `Categorical`, `Bernoulli` and `Normal` steps of one shape (also inside `Independent`)
it computes them in one call on the concatenated parameters. That must change nothing: the same surrogate value, gradient
and Hessian as the step-by-step log-probabilities on the same draws, up to the last bit that torch's
vectorised kernels may round differently for another number of elements (float64 here: 1e-13); and everything
it does not apply to (another kind of distribution at a step, a parameter stored otherwise, the
model's own ``z.log_prob()``) falls back to the steps one by one.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Independent, Normal

import storch
import storch._stacked_log_prob
import storch.method.score_function
from tests.seeding import manual_seed

T = 5


class StepByStep(storch.method.ScoreFunction):
    """The same estimator with the log-probabilities computed step by step."""

    def chain_gradient_functions(self, nodes, plates):
        return None


@pytest.fixture
def stacked(monkeypatch):
    """Whether each chain's log-probabilities were computed stacked (``True``) or not (``None``)."""
    calls = []
    original = storch._stacked_log_prob.stacked_log_prob

    def spy(nodes, plates):
        out = original(nodes, plates)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(storch.method.score_function, "stacked_log_prob", spy)
    return calls


def _step(kind: str, h: torch.Tensor, W: torch.Tensor, t: int) -> torch.distributions.Distribution:
    """The distribution of step ``t`` from the state ``h`` (``kind`` as in the tests' parameters)."""
    logits = h @ W
    if kind == "categorical":
        return Categorical(logits=logits)
    if kind == "categorical-probs-at-2":  # one step stores probs only: the logits are not there to stack
        return Categorical(probs=logits.softmax(-1)) if t == 2 else Categorical(logits=logits)
    if kind == "bernoulli":
        return Bernoulli(logits=logits)
    if kind == "normal":
        return Normal(logits, torch.nn.functional.softplus(logits) + 0.1)
    if kind == "independent-normal":  # a Gaussian policy over a 3-dimensional action
        return Independent(Normal(logits, torch.nn.functional.softplus(logits) + 0.1), 1)
    if kind == "independent-bernoulli-twice":  # (3,) reinterpreted in two wrappers of one dimension
        return Independent(Independent(Bernoulli(logits=logits.unsqueeze(-1).expand(*logits.shape, 2)), 1), 1)
    if kind == "mixed":  # a Bernoulli step in a Categorical chain
        return Bernoulli(logits=logits) if t == 3 else Categorical(logits=logits)
    raise ValueError(kind)


def episodes(kind: str, W: torch.Tensor, method, own_log_prob_at: int | None = None, read_distribution_at=None):
    """``T`` decisions of three episodes; the next state is a function of the sample, a cost per step."""
    h = storch.denote_independent(torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -0.5], [0.3, 0.3, 0.3]], dtype=W.dtype), 0, "episodes")
    for t in range(T):
        x = method(_step(kind, h, W, t))
        if t == own_log_prob_at:
            x.log_prob()
        if t == read_distribution_at:
            x.distribution  # noqa: B018  (the node's copy without the previous step is made)
        value = x.to(W.dtype)
        if value.dim() == len(x.plates):  # a categorical sample: its one-hot code
            value = torch.nn.functional.one_hot(x, 3).to(W.dtype)
        while value.dim() > len(x.plates) + 1:  # the twice-wrapped Bernoulli's (3, 2) event
            value = value.sum(-1)
        h = torch.tanh(value + 0.1 * t)
        storch.add_cost((value * torch.tensor([1.0, -2.0, 0.5], dtype=W.dtype)).sum(-1) + 0.2 * t, f"r{t}")


def derivatives(kind: str, cls: type, baseline: str | None, **options):
    W = torch.tensor([[0.3, -0.2, 0.1], [-0.5, 0.4, 0.0], [0.1, 0.1, -0.3]], dtype=torch.float64, requires_grad=True)
    method = cls("x", baseline_factory=baseline)
    if baseline is not None:
        manual_seed(1)
        episodes(kind, W, method, **options)
        storch.backward()
    manual_seed(2)
    episodes(kind, W, method, **options)
    value = storch.surrogate_loss()
    storch.reset()
    (gradient,) = torch.autograd.grad(value, W, create_graph=True)
    hessian = torch.stack([torch.autograd.grad(g, W, retain_graph=True)[0] for g in gradient.reshape(-1)])
    return value.detach(), gradient.detach(), hessian


@pytest.mark.parametrize("baseline", [None, "moving_average"])
@pytest.mark.parametrize(
    "kind", ["categorical", "bernoulli", "normal", "independent-normal", "independent-bernoulli-twice"]
)
def test_stacked_log_probs_give_the_per_step_surrogate(kind, baseline, stacked):
    value, gradient, hessian = derivatives(kind, storch.method.ScoreFunction, baseline)
    assert stacked and all(stacked)
    expected = derivatives(kind, StepByStep, baseline)
    for got, want in zip((value, gradient, hessian), expected):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    assert hessian.abs().sum() > 0


@pytest.mark.parametrize(
    "kind, options",
    [
        ("categorical-probs-at-2", {}),  # a parameter not stored as the kind's own
        ("mixed", {}),  # another kind of distribution at one step
        ("categorical", {"own_log_prob_at": 2}),  # the surrogate reuses the model's z.log_prob()
    ],
)
def test_chains_it_does_not_apply_to_are_computed_step_by_step(kind, options, stacked):
    value, gradient, _ = derivatives(kind, storch.method.ScoreFunction, "moving_average", **options)
    assert stacked and not any(stacked)
    expected = derivatives(kind, StepByStep, "moving_average", **options)
    torch.testing.assert_close(value, expected[0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gradient, expected[1], rtol=1e-13, atol=1e-13)


def test_a_step_whose_distribution_was_read_is_stacked_too(stacked):
    """Reading ``z.distribution`` makes the node's copy without the previous step: its parameters then
    lack the step's dimension, which the stacking puts back."""
    value, gradient, _ = derivatives("categorical", storch.method.ScoreFunction, None, read_distribution_at=2)
    assert stacked and all(stacked)
    expected = derivatives("categorical", StepByStep, None, read_distribution_at=2)
    torch.testing.assert_close(value, expected[0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gradient, expected[1], rtol=1e-13, atol=1e-13)


def test_param_grads_of_stacked_steps_are_filled():
    manual_seed(0)
    W = torch.randn(3, 3, requires_grad=True)
    method = storch.method.ScoreFunction("x")
    h = storch.denote_independent(torch.eye(3), 0, "episodes")
    nodes = []
    for t in range(3):
        x = method(Categorical(logits=h @ W))
        nodes.append(x)
        h = torch.nn.functional.one_hot(x, 3).float()
        storch.add_cost((x == 1).float(), f"r{t}")
    storch.backward()
    for x in nodes:
        assert x.param_grads["logits"].shape == (3, 3) and x.param_grads["logits"].plain().abs().sum() > 0
