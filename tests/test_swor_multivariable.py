"""Sequence steps with several variables per beam (ScoreFunctionWOR, MCDecoder, UnorderedSetEstimator).

Step 1 samples ``z`` (one categorical variable of 5 values); step 2 samples ``y = (y0, y1)``, two
categorical variables of 3 values whose logits depend on ``z``: the step's batch shape is
``(beams, 2)``. The two variables are one token of 9 joint values, so the sequences ``(z, y0, y1)``
range over 45 values. Checked against exact enumeration of those 45: unbiased first-order
gradients (|mean − exact| ≤ 4.5 SE per coordinate), the inclusion identity
``E[Σ_S p(s)/q_κ(s) 1[s = j]] = p(j)``, distinct sequences, the prefix log-probabilities, exactness
when the beam covers every sequence, and the refusal of ``eos`` on a step with several variables.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, OneHotCategorical

import storch
from storch.method import UnorderedSetEstimator
from storch.method.score_function_wor import ScoreFunctionWOR
from storch.sampling.decoding import MCDecoder
from storch.sampling.swor import SampleWithoutReplacement
from storch.testing import assert_unbiased, replicate, replicated_gradients

pytestmark = pytest.mark.seed(31)

V1, D2, V2 = 5, 2, 3  # z ∈ {0..4}; y = (y0, y1), each ∈ {0, 1, 2}
N_SEQ = V1 * V2**D2  # 45 sequences
_g = torch.Generator().manual_seed(11)
THETA = torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4])  # logits of z
W = 0.5 * torch.randn(V1, D2, V2, generator=_g)  # z → logits of (y0, y1)
C = torch.tensor([[0.2, -0.5, 0.3], [0.0, 0.6, -0.6]])  # offsets of y's logits
U = torch.tensor([1.0, -2.0, 0.5, 0.0, 1.5])  # value of z
OFFSETS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.5, -1.0, 0.0, 1.0, 0.2]])  # a minibatch of two

ALL = torch.tensor(list(itertools.product(range(V1), range(V2), range(V2))))  # (45, 3): z, y0, y1


def costs(z_value: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``c1(z)`` and ``c2(z, y)`` from ``u(z)`` (``z_value``) and the float values of ``y`` (``(..., 2)``)."""
    y0, y1 = y[..., 0], y[..., 1]
    c1 = z_value**2 / 4
    c2 = z_value * (y0 - 1.0) + (y0 * y1 - 1.5) ** 2 - y1
    return c1, c2


def decode(method, theta, w, offset=0.0, one_hot_z: bool = True, one_hot_y: bool = False):
    """The two steps; returns ``z``, ``u(z)``, ``y`` (float values ``(..., 2)``)."""
    logits = theta + offset
    if one_hot_z:
        z = method(OneHotCategorical(logits=logits))
        z_onehot = z
    else:
        z = method(Categorical(logits=logits))
        z_onehot = (z.unsqueeze(-1) == torch.arange(V1)).float()
    y_logits = (z_onehot.unsqueeze(-1).unsqueeze(-1) * w).sum(-3) + C  # (..., 2, 3): two variables
    if one_hot_y:
        y = method(OneHotCategorical(logits=y_logits))
        y_value = (y * torch.arange(V2, dtype=torch.float)).sum(-1)
    else:
        y = method(Categorical(logits=y_logits))
        y_value = y.float()
    return z, (z_onehot * U).sum(-1), y, y_value


def joint_log_prob(theta: torch.Tensor, w: torch.Tensor, seqs: torch.Tensor, offset=0.0) -> torch.Tensor:
    """``log p(z, y0, y1)`` of the rows of ``seqs`` (``(n, 3)``)."""
    lz = torch.log_softmax(theta + offset, -1)[seqs[:, 0]]
    ly = torch.log_softmax(w + C, -1)[seqs[:, 0]]  # (n, 2, 3)
    return lz + ly.gather(-1, seqs[:, 1:].unsqueeze(-1)).squeeze(-1).sum(-1)


def exact(which=(0, 1), offsets=OFFSETS[:1]):
    """Exact ``E[Σ_{t ∈ which} c_t]`` (mean over offsets) and its gradient in ``(θ, W)``."""
    theta, w = THETA.clone().requires_grad_(), W.clone().requires_grad_()
    c = costs(U[ALL[:, 0]], ALL[:, 1:].float())
    total = 0.0
    for offset in offsets:
        p = joint_log_prob(theta, w, ALL, offset).exp()
        assert abs(p.sum().item() - 1.0) < 1e-5
        total = total + sum((p * c[t]).sum() for t in which) / len(offsets)
    return total.detach(), torch.autograd.grad(total, (theta, w))


def gradients(make_method, repeats, which=(0, 1), minibatch=False, **kw):
    method = make_method()

    def model(theta, w):
        offset = storch.denote_independent(OFFSETS, 0, "data") if minibatch else 0.0
        _, z_value, _, y_value = decode(method, theta, w, offset, **kw)
        c = costs(z_value, y_value)
        for t in which:
            storch.add_cost(c[t], f"c{t + 1}")

    return replicated_gradients([THETA, W], repeats, model)


CASES = {
    "wor_k4_onehot": dict(make=lambda: ScoreFunctionWOR("seq", k=4)),
    "wor_k4_categorical": dict(make=lambda: ScoreFunctionWOR("seq", k=4), one_hot_z=False),
    "wor_k4_onehot_y": dict(make=lambda: ScoreFunctionWOR("seq", k=4), one_hot_y=True),
    "wor_k1": dict(make=lambda: ScoreFunctionWOR("seq", k=1)),
    "wor_k7_last_cost_only": dict(make=lambda: ScoreFunctionWOR("seq", k=7), which=(1,)),
    "wor_k12": dict(make=lambda: ScoreFunctionWOR("seq", k=12)),
    "wor_k3_minibatch": dict(make=lambda: ScoreFunctionWOR("seq", k=3), minibatch=True),
    "mc_decoder_k3": dict(make=lambda: ScoreFunctionWOR("seq", k=3, sampling_method=MCDecoder("seq", 3))),
    "unordered_set_k4": dict(make=lambda: UnorderedSetEstimator("seq", k=4), one_hot_z=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_two_variables_per_step_unbiased(name):
    case = dict(CASES[name])
    make = case.pop("make")
    grads = gradients(make, 3000, **case)
    _, ex = exact(case.get("which", (0, 1)), OFFSETS if case.get("minibatch") else OFFSETS[:1])
    for g, e, label in zip(grads, ex, ["theta", "W"]):
        assert_unbiased(g.reshape(len(g), -1), e.reshape(-1), label=f"{name} {label}")


def _decode_replicated(method, repeats, **kw):
    _, theta = replicate(THETA, repeats)
    z, _, y, _ = decode(method, theta, W, **kw)
    z_index = z.argmax(-1) if kw.get("one_hot_z", True) else z
    seq = torch.cat([z_index.unsqueeze(-1), y], -1)  # z re-indexed to y's beams
    assert seq.plates[0] is y.plates[0] and seq.plate_names == ["seq", "replicate"]
    return z, y, seq._tensor  # (k, repeats, 3)


@pytest.mark.parametrize("k", [6, 20])
def test_sequences_are_distinct_and_log_probs_are_joint(k):
    method = ScoreFunctionWOR("seq", k=k)
    repeats = 300
    z, y, raw = _decode_replicated(method, repeats)
    assert z.n == min(k, V1) and y.n == k and tuple(y.shape) == (k, repeats, D2)
    for r in range(repeats):
        assert len({tuple(s) for s in raw[:, r].tolist()}) == k
    state = method.sampling_method.state_of(y)
    flat = raw.reshape(-1, 3)
    torch.testing.assert_close(
        state.log_prob.detach().reshape(-1), joint_log_prob(THETA, W, flat), rtol=1e-5, atol=1e-5
    )
    # the beams of step 1 that the sequences extend: parent_index points at their z
    z_raw = z._tensor.argmax(-1)  # (min(k, 5), repeats)
    torch.testing.assert_close(z_raw.gather(0, state.parent_index), raw[..., 0])


def test_inclusion_identity_over_the_product_space():
    # E[Σ_S p(s)/q_κ(s) 1[s = j]] = p(j) for each of the 45 sequences: the weights of the step
    # with two variables are those of a Gumbel-top-k sample of the sequences
    repeats = 20000
    method = ScoreFunctionWOR("seq", k=5)
    _, y, raw = _decode_replicated(method, repeats)
    weight = y.plate.weight._tensor  # (5, repeats)
    code = raw[..., 0] * V2**D2 + raw[..., 1] * V2 + raw[..., 2]
    est = torch.zeros(repeats, N_SEQ, dtype=weight.dtype).scatter_add_(1, code.T, weight.T)
    p = joint_log_prob(THETA, W, ALL).exp()
    assert_unbiased(est, p, label="Σ_S p/q 1[s=j]")


def test_first_sequence_is_distributed_as_p():
    # the largest perturbed sequence is a Gumbel-max sample of the joint distribution
    repeats = 20000
    _, _, raw = _decode_replicated(ScoreFunctionWOR("seq", k=3), repeats)
    code = raw[0, :, 0] * V2**D2 + raw[0, :, 1] * V2 + raw[0, :, 2]
    freq = torch.nn.functional.one_hot(code, N_SEQ).double()
    assert_unbiased(freq, joint_log_prob(THETA, W, ALL).exp(), label="first sequence")


@pytest.mark.parametrize("biased", [False, True], ids=["unbiased", "normalised"])
def test_exact_when_the_beam_covers_every_sequence(biased):
    total, ex = exact()
    grads = gradients(lambda: ScoreFunctionWOR("seq", k=N_SEQ, biased=biased), 3)
    for g, e in zip(grads, ex):
        torch.testing.assert_close(g, e.expand_as(g), rtol=1e-4, atol=1e-5)
    method = ScoreFunctionWOR("seq", k=N_SEQ, biased=biased)
    z, _, y, _ = decode(method, THETA, W)
    assert (z.n, y.n) == (V1, N_SEQ)
    torch.testing.assert_close(y.plate.weight._tensor.sum(), torch.tensor(1.0))
    assert torch.isneginf(method.sampling_method.state_of(y).kappa).all()


def test_a_third_step_after_the_two_variable_step():
    # y (two variables) feeds a third step with one variable; all re-indexed to the last beams
    method = ScoreFunctionWOR("seq", k=8)
    leaf, theta = replicate(THETA, 50)
    z, z_value, y, y_value = decode(method, theta, W)
    x = method(Categorical(logits=torch.stack([y_value[..., 0], y_value[..., 1], z_value], -1)))
    seq = torch.cat([z.argmax(-1).unsqueeze(-1), y, x.unsqueeze(-1)], -1)
    assert seq.plates[0] is x.plates[0] and tuple(seq.shape) == (8, 50, 4)
    for r in range(50):
        assert len({tuple(s) for s in seq._tensor[:, r].tolist()}) == 8
    storch.add_cost(costs(z_value, y_value)[1] + x.float(), "f")
    storch.backward()
    assert torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0


# ---------------------------------------------------------------- eos: refused with several variables
def test_eos_refused_on_a_first_step_with_several_variables():
    for method in (
        ScoreFunctionWOR("z", k=2, eos=1),
        ScoreFunctionWOR("z", k=2, sampling_method=MCDecoder("z", 2, eos=1)),
    ):
        with pytest.raises(ValueError, match=r"eos=1 .* batch shape \(3,\), of which \(3,\) are not plates"):
            method(Bernoulli(logits=torch.zeros(3)))
    with pytest.raises(ValueError, match="Decode one variable per step"):
        SampleWithoutReplacement("z", 2, eos=0).sample(Categorical(logits=torch.zeros(2, 4)), (), False)


@pytest.mark.parametrize("sampler", ["wor", "mc"])
def test_eos_refused_on_a_later_step_with_several_variables(sampler):
    sm = None if sampler == "wor" else MCDecoder("seq", 3, eos=2)
    method = ScoreFunctionWOR("seq", k=3, eos=2, sampling_method=sm)
    z = method(OneHotCategorical(logits=THETA))
    with pytest.raises(ValueError, match=r"eos=2 .* this sequence step has batch shape \(3, 2\).*2 variables per beam"):
        method(Categorical(logits=(z.unsqueeze(-1).unsqueeze(-1) * W).sum(-3)))
