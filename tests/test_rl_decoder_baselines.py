"""Baselines for the sequence decoders (``ScoreFunctionWOR(..., baseline_factory=...)``), and MAPO's
refusal of step-by-step decoding.

A reinforcement-learning setting: a policy over strings of ``STEPS`` tokens from {0, 1, 2} and EOS = 3
(logits from the previous token), rewarded for matching a target. Checked against exact gradients by
enumerating all ``4³`` strings (|mean − exact| ≤ 4.5 SE per coordinate):

* i.i.d. sequences (``MCDecoder``) with the leave-one-out ``"batch_average"`` and ``"moving_average"``;
* the unbiased estimator without replacement (``biased=False``) with ``"moving_average"`` (whatever
  its value: any baseline independent of the sample set keeps it unbiased) and with a baseline of
  the datum (a critic of the data, not of the sequences), also for the Hessian;
* a reward at the end and a reward after every step, with and without a minibatch plate;
* less variance with the baselines than without;
* the baselines that would bias an estimator are refused, with the reason.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Categorical, OneHotCategorical

import storch
from storch.method import MAPO, ScoreFunction
from storch.method.baseline import BatchAverageBaseline, Baseline, MovingAverageBaseline
from storch.method.score_function_wor import ScoreFunctionWOR
from storch.sampling.decoding import MCDecoder
from storch.testing import assert_unbiased, check_unbiased, replicate, replicated_gradients

pytestmark = pytest.mark.seed(4242)

V, EOS, STEPS = 4, 3, 3
THETA = torch.tensor([0.3, -0.2, 0.1, -0.6])  # base logits (EOS unlikely)
M = 0.8 * torch.randn(V, V, generator=torch.Generator().manual_seed(5))  # previous token → logits
PARAMS = [THETA, M]
TARGET = torch.nn.functional.one_hot(torch.tensor([2, 0, 1]), V).float()  # (STEPS, V)
OFFSETS = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.6, -0.8, 0.2, 0.0]])  # a minibatch of two contexts
R = 2000


def _vecmat(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-1) * m).sum(-2)


def decode(method, theta, m, offset=0.0) -> list[torch.Tensor]:
    """``STEPS`` one-hot tokens, each step's logits from the previous token."""
    x = method(OneHotCategorical(logits=theta + offset))
    xs = [x]
    for _ in range(1, STEPS):
        x = method(OneHotCategorical(logits=theta + offset + _vecmat(x, m)))
        xs.append(x)
    return xs


def reward_costs(xs, every_step: bool) -> dict[str, torch.Tensor]:
    """A cost at the end (``STEPS + 1`` minus the matches with the target), or one after every step
    (``1.5`` minus the match of that step's token): costs with a mean far from 0, where a baseline helps."""
    matches = [(x * TARGET[t]).sum(-1) for t, x in enumerate(xs)]
    if every_step:
        return {f"c{t}": 1.5 - match for t, match in enumerate(matches)}
    return {"reward": STEPS + 1.0 - sum(matches)}


def exact(every_step: bool = False, offsets=OFFSETS[:1]):
    """The exact expected cost (mean over ``offsets``) and its gradient, by enumerating the ``4³``
    strings; a string with a token other than EOS after EOS has probability 0."""
    theta, m = (p.clone().requires_grad_() for p in PARAMS)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=STEPS)))
    X = torch.nn.functional.one_hot(seqs, V).float()
    costs = sum(reward_costs([X[:, t] for t in range(STEPS)], every_step).values())
    total = 0.0
    for offset in offsets:
        log_p = torch.zeros(len(seqs))
        done = torch.zeros(len(seqs), dtype=torch.bool)
        valid = torch.ones(len(seqs), dtype=torch.bool)
        for t in range(STEPS):
            logits = theta + offset if t == 0 else theta + offset + _vecmat(X[:, t - 1], m)
            lp = torch.log_softmax(logits.expand(len(seqs), V), -1).gather(-1, seqs[:, t : t + 1]).squeeze(-1)
            valid &= ~done | (seqs[:, t] == EOS)
            log_p = log_p + torch.where(done, torch.zeros_like(lp), lp)
            done = done | (seqs[:, t] == EOS)
        p = torch.where(valid, log_p.exp(), torch.zeros_like(log_p))
        assert abs(p.sum().item() - 1.0) < 1e-5
        total = total + (p * costs).sum() / len(offsets)
    return total, torch.autograd.grad(total, (theta, m), create_graph=True)


def gradients(method, repeats=R, every_step=False, minibatch=False) -> list[torch.Tensor]:
    """``repeats`` independent gradient estimates of ``(θ, M)`` in one backward pass."""

    def model(theta, m):
        offset = storch.denote_independent(OFFSETS, 0, "data") if minibatch else 0.0
        for name, cost in reward_costs(decode(method, theta, m, offset), every_step).items():
            storch.add_cost(cost, name)

    return replicated_gradients(PARAMS, repeats, model)


def assert_gradients_unbiased(method, label, every_step=False, minibatch=False) -> None:
    _, exact_grads = exact(every_step, OFFSETS if minibatch else OFFSETS[:1])
    grads = gradients(method, every_step=every_step, minibatch=minibatch)
    for g, e, name in zip(grads, exact_grads, ["theta", "M"]):
        assert_unbiased(g.reshape(len(g), -1), e.detach().reshape(-1), label=f"{label} {name}")


def preset(method: ScoreFunctionWOR, every_step: bool, value: float) -> None:
    """Give the moving average a value (any value independent of the samples keeps it unbiased)."""
    names = [f"c{t}" for t in range(STEPS)] if every_step else ["reward"]
    method.baseline.set_extra_state({"averages": {name: torch.tensor(value) for name in names}})


class DataBaseline(Baseline):
    """A baseline of the datum only (a table over the ``data`` plate): a critic of the context, which
    depends on neither the sampled sequences nor their prefixes."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.values = values

    def compute_baseline(self, tensor, cost_node):
        return storch.denote_independent(self.values, 0, "data")


# ------------------------------------------------------------------ i.i.d. sequences (MCDecoder)
def mc(k: int, baseline) -> ScoreFunctionWOR:
    return ScoreFunctionWOR("seq", k, sampling_method=MCDecoder("seq", k, eos=EOS), baseline_factory=baseline)


@pytest.mark.parametrize("every_step, minibatch", [(False, False), (True, True)])
def test_mc_decoder_leave_one_out_unbiased(every_step, minibatch):
    assert_gradients_unbiased(mc(4, "batch_average"), "MCDecoder batch_average", every_step, minibatch)


def test_mc_decoder_moving_average_unbiased():
    method = mc(3, "moving_average")
    preset(method, every_step=False, value=1.0)
    assert_gradients_unbiased(method, "MCDecoder moving_average")


# ------------------------------------------------------------------ without replacement, biased=False
@pytest.mark.parametrize("every_step, minibatch, value", [(False, False, 1.0), (True, True, -0.5)])
def test_wor_moving_average_unbiased(every_step, minibatch, value):
    method = ScoreFunctionWOR("seq", k=3, eos=EOS, baseline_factory="moving_average")
    preset(method, every_step, value)
    assert_gradients_unbiased(method, f"WOR moving_average={value}", every_step, minibatch)


def test_wor_with_a_baseline_of_the_datum_unbiased():
    method = ScoreFunctionWOR("seq", k=3, eos=EOS, baseline_factory=DataBaseline(torch.tensor([2.5, 3.5])))
    assert_gradients_unbiased(method, "WOR data baseline", minibatch=True)


def test_wor_moving_average_hessian_unbiased():
    method = ScoreFunctionWOR("seq", k=3, eos=EOS, baseline_factory="moving_average")
    preset(method, every_step=False, value=2.0)
    leaf, theta = replicate(THETA, R)
    storch.add_cost(reward_costs(decode(method, theta, M), every_step=False)["reward"], "reward")
    storch.backward(create_graph=True)
    rows = [torch.autograd.grad(leaf.grad[:, i].sum(), leaf, retain_graph=True)[0] * R for i in range(V)]
    hessians = torch.stack(rows, 1)  # (R, V, V)

    def expected(theta0):
        saved = PARAMS[0]
        PARAMS[0] = theta0
        try:
            return exact()[0]
        finally:
            PARAMS[0] = saved

    exact_hessian = torch.autograd.functional.hessian(expected, THETA.clone())
    assert_unbiased(hessians.reshape(R, -1), exact_hessian.reshape(-1), label="WOR moving_average hessian")


def test_moving_average_follows_the_estimates_and_leaves_the_forward_value():
    method = ScoreFunctionWOR("seq", k=3, eos=EOS, baseline_factory="moving_average")
    plain_method = ScoreFunctionWOR("seq", k=3, eos=EOS)
    expected_cost = exact()[0].item()
    estimates = []
    for m in (method, plain_method):
        torch.manual_seed(0)
        leaf, theta = replicate(THETA, 500)
        storch.add_cost(reward_costs(decode(m, theta, M), every_step=False)["reward"], "reward")
        estimates.append(storch.backward().item())
    assert estimates[0] == pytest.approx(estimates[1])  # the baseline only changes the gradient
    average = method.baseline.averages["reward"].item()
    assert average == pytest.approx(estimates[0]) and abs(average - expected_cost) < 0.1


# ------------------------------------------------------------------ variance
def _total_variance(method, every_step=False) -> float:
    return sum(g.reshape(len(g), -1).var(0).sum().item() for g in gradients(method, every_step=every_step))


def test_baselines_reduce_the_variance():
    # measured (R = 2000, total variance over the 20 coordinates): MCDecoder k=4 4.9 without a
    # baseline, 0.39 with batch_average; WOR k=3 6.4 without, 0.51 with the moving average at the
    # expected cost (2.98)
    expected_cost = exact()[0].item()
    assert _total_variance(mc(4, "batch_average")) < 0.25 * _total_variance(mc(4, None))
    wor = ScoreFunctionWOR("seq", k=3, eos=EOS, baseline_factory="moving_average")
    preset(wor, every_step=False, value=expected_cost)
    plain_wor = ScoreFunctionWOR("seq", k=3, eos=EOS)
    assert _total_variance(wor) < 0.25 * _total_variance(plain_wor)


def test_leave_one_out_would_bias_the_estimator_without_replacement():
    """Why it is refused: forced onto the samples without replacement, the leave-one-out baseline
    moves the mean of 20000 estimates more than 4.5 standard errors away (measured: 11.5)."""
    method = ScoreFunctionWOR("seq", k=3, eos=EOS)
    method.baseline = BatchAverageBaseline()  # bypasses the refusal
    _, exact_grads = exact()
    grads = gradients(method, repeats=20000)
    flat = torch.cat([g.reshape(len(g), -1) for g in grads], 1)
    assert not check_unbiased(flat, torch.cat([e.detach().reshape(-1) for e in exact_grads])).passed


# ------------------------------------------------------------------ what is accepted and refused
def test_accepted_baselines():
    assert ScoreFunctionWOR("seq", k=3).baseline is None
    assert ScoreFunctionWOR("seq", k=3, baseline_factory="none").baseline is None
    assert isinstance(ScoreFunctionWOR("seq", k=3, baseline_factory=MovingAverageBaseline).baseline,
                      MovingAverageBaseline)
    custom = DataBaseline(torch.zeros(2))
    assert ScoreFunctionWOR("seq", k=3, baseline_factory=custom).baseline is custom
    assert type(mc(2, "batch_average").baseline).__name__ == "BatchAverageBaseline"
    method = mc(2, "moving_average")
    assert "baseline" in dict(method.named_children())  # a submodule: saved in state_dict


def test_leave_one_out_is_refused_without_replacement():
    with pytest.raises(ValueError, match="without replacement") as info:
        ScoreFunctionWOR("seq", k=3, baseline_factory="batch_average")
    message = str(info.value)
    for advice in ("baseline_factory='moving_average'", "biased=True", "UnorderedSetEstimator", "MCDecoder"):
        assert advice in message, advice


def test_a_second_baseline_is_refused_with_biased():
    with pytest.raises(ValueError, match="built-in baseline"):
        ScoreFunctionWOR("seq", k=3, biased=True, baseline_factory="moving_average")
    with pytest.raises(ValueError, match="built-in baseline"):
        ScoreFunctionWOR("seq", k=3, biased=True, use_baseline=False, baseline_factory="moving_average")


@pytest.mark.parametrize("name, reason", [("critic", "earlier tokens"), ("q_critic", "whole prefix")])
def test_critics_of_the_node_are_refused(name, reason):
    for method in (lambda: mc(3, name), lambda: ScoreFunctionWOR("seq", k=3, baseline_factory=name)):
        with pytest.raises(ValueError, match=reason):
            method()


def test_leave_one_out_needs_two_sequences_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="at least 2 samples"):
        mc(1, "batch_average")
    with pytest.raises(ValueError, match="Unknown baseline 'average'"):
        ScoreFunctionWOR("seq", k=3, baseline_factory="average")


# ------------------------------------------------------------------ MAPO per decoding step
def test_mapo_called_per_decoding_step_says_it_does_not_decode_step_by_step():
    mapo = MAPO("seq", n_samples=2)
    x = mapo(Categorical(logits=torch.zeros(3)))
    with pytest.raises(ValueError, match="does not support step-by-step decoding") as info:
        mapo(Categorical(logits=x.unsqueeze(-1) * torch.ones(3)))
    message = str(info.value)
    for advice in ("one MAPO node", "ScoreFunctionWOR", "MCDecoder", "UnorderedSetEstimator"):
        assert advice in message, advice
    assert "another name" not in message
    # another node of the same name is still a naming problem
    z = ScoreFunction("seq", n_samples=2)(Categorical(logits=torch.zeros(3)))
    with pytest.raises(ValueError, match="of another node; give this node another name"):
        MAPO("seq", n_samples=2)(Categorical(logits=z.unsqueeze(-1) * torch.ones(3)))
