"""Sampling without replacement (Gumbel-top-k, stochastic beam search) and ScoreFunctionWOR.

Unbiasedness against exact gradients from enumeration (|mean − exact| ≤ 4.5 SE per coordinate), the
bias of the normalised variant, and the set itself (distinct values, the whole support when k covers
it, the first element distributed as p).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
from storch.method import ScoreFunction
from storch.method.score_function_wor import ScoreFunctionWOR
from storch.sampling.swor import SampleWithoutReplacement, log_inclusion_probability
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from problems import bernoulli, nested_categorical, one_categorical, replicated_hessians

pytestmark = pytest.mark.seed(2024)

R = 3000


# ---------------------------------------------------------------- the sampled set
CATEGORICAL = one_categorical(5, theta=torch.tensor([0.2, -0.4, 0.9, 0.0, 1.0]))
THETA, VALUES, categorical_exact = CATEGORICAL.theta, CATEGORICAL.values, CATEGORICAL.exact


def test_samples_are_distinct_per_plate_combination():
    logits = torch.randn(50, 6)
    s = SampleWithoutReplacement("z", k=4).sample(Categorical(logits=logits), (storch.plate.Plate("b", 50),), False)
    assert s.shape == (4, 50)
    assert all(len(set(s[:, b].tolist())) == 4 for b in range(50))


def test_k_at_least_support_gives_the_whole_support_with_weights_p():
    theta = torch.tensor([0.3, -1.0, 2.0])
    z = ScoreFunctionWOR("z", k=5)(Categorical(logits=theta))
    assert z.n == 3 and sorted(z._tensor.tolist()) == [0, 1, 2]
    weights = z.plate.weight._tensor
    torch.testing.assert_close(weights, theta.softmax(-1)[z._tensor])


def test_joint_values_of_several_variables_are_distinct():
    # three Bernoulli variables: 8 joint values, sets of 5 distinct joint configurations
    z = ScoreFunctionWOR("z", k=5)(Bernoulli(logits=torch.tensor([0.1, -0.5, 2.0])))
    assert z.shape == (5, 3)
    assert len({tuple(row) for row in z._tensor.tolist()}) == 5


def test_first_element_is_distributed_as_p():
    # the largest perturbed value is a Gumbel-max sample
    n = 20000
    s = SampleWithoutReplacement("z", k=3).sample(Categorical(logits=THETA.expand(n, 5)), (storch.plate.Plate("b", n),), False)
    freq = torch.bincount(s[0], minlength=5).double() / n
    p = THETA.softmax(-1).double()
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4.5 * se).all(), (freq, p)


def test_log_inclusion_probability():
    log_p, kappa = torch.tensor([-0.5, -3.0, -60.0]), torch.tensor(0.2)
    expected = torch.log(-torch.expm1(-torch.exp(log_p.double() - 0.2)))  # accurate in float64
    torch.testing.assert_close(log_inclusion_probability(log_p, kappa).double(), expected, rtol=1e-5, atol=0)


def test_importance_weights_estimate_the_mean_unbiasedly():
    # E[Σ_S p(s)/q_κ(s) f(s)] = Σ_s p(s) f(s), for f = one-hot indicators (the inclusion identity)
    n = 20000
    sampler = SampleWithoutReplacement("z", k=2)
    _, state = sampler.draw(Categorical(logits=THETA.expand(n, 5)), 1)
    w = sampler.weights(state)  # (2, n)
    est = torch.zeros(n, 5).scatter_add_(1, state.tokens.T, w.T)
    assert_unbiased(est, THETA.softmax(-1), label="Σ_S p/q 1[s=j]")


def test_errors():
    with pytest.raises(TypeError, match="finite, enumerable support"):
        ScoreFunctionWOR("z", k=2)(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match="k must be at least 1"):
        SampleWithoutReplacement("z", k=0)


# ---------------------------------------------------------------- unbiasedness, one node
ONE_NODE = {
    "wor_k1": lambda: ScoreFunctionWOR("z", k=1),
    "wor_k2": lambda: ScoreFunctionWOR("z", k=2),
    "wor_k4": lambda: ScoreFunctionWOR("z", k=4),
    "score_function_with_swor_proposal": lambda: ScoreFunction("z", sampling_method=SampleWithoutReplacement("z", 3)),
}


@pytest.mark.parametrize("name", list(ONE_NODE))
@pytest.mark.parametrize("one_hot", [True, False], ids=["onehot", "categorical"])
def test_one_categorical_node_unbiased(name, one_hot):
    (grads,) = replicated_gradients([THETA], R, CATEGORICAL.model(ONE_NODE[name](), one_hot))
    assert_unbiased(grads, categorical_exact(), label=name)


BERNOULLI = bernoulli(interaction=2.0)


@pytest.mark.parametrize("k", [2, 5])
def test_several_variables_sampled_jointly_unbiased(k):
    (grads,) = replicated_gradients([BERNOULLI.phi], R, BERNOULLI.model(ScoreFunctionWOR("x", k=k)))
    assert_unbiased(grads, BERNOULLI.exact(), label=f"joint k={k}")


def test_hessian_unbiased():
    hessians = replicated_hessians(BERNOULLI.phi, 3000, BERNOULLI.model(ScoreFunctionWOR("x", k=3)))
    assert_unbiased(hessians, BERNOULLI.exact_hessian().reshape(-1), label="hessian")


# ---------------------------------------------------------------- two nested nodes, minibatch plate
NESTED_PROBLEM = nested_categorical(3, 3)


@pytest.mark.parametrize(
    "make",
    [
        (lambda: ScoreFunctionWOR("z1", k=2), lambda: ScoreFunctionWOR("z2", k=2)),
        (lambda: ScoreFunctionWOR("z1", k=2), lambda: ScoreFunction("z2", n_samples=2)),
        (lambda: ScoreFunction("z1", n_samples=2), lambda: ScoreFunctionWOR("z2", k=2)),
    ],
    ids=["wor_wor", "wor_sf", "sf_wor"],
)
def test_two_nested_nodes_unbiased(make):
    m1, m2 = (f() for f in make)
    NESTED_PROBLEM.assert_unbiased(NESTED_PROBLEM.model(m1, m2), R)


def test_minibatch_plate_unbiased():
    X = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -1.0], [0.3, 0.3, 0.3], [-1.0, 0.5, 0.0]])
    W = torch.tensor([[0.5, -0.2, 0.0], [0.1, 0.4, 0.3], [-0.3, 0.8, -0.6]])
    method = ScoreFunctionWOR("z", k=2)

    def model(w):
        x = storch.denote_independent(X, 0, "data")
        z = method(OneHotCategorical(logits=(x.unsqueeze(-1) * w).sum(-2)))
        assert z.plate_names == ["z", "data", "replicate"]
        storch.add_cost(((z * VALUES[:3]).sum(-1) - x.sum(-1)) ** 2, "f")

    (grads,) = replicated_gradients([W], R, model)
    w = W.clone().requires_grad_()
    p = (X @ w).softmax(-1)  # (4, 3)
    f = (VALUES[:3][None, :] - X.sum(-1, keepdim=True)) ** 2
    exact = torch.autograd.grad((p * f).sum(-1).mean(), w)[0]
    assert_unbiased(grads, exact, label="minibatch")


# ---------------------------------------------------------------- the normalised (biased) variant
def _categorical_estimates(k, biased, repeats=R):
    return replicated_gradients([THETA], repeats, CATEGORICAL.model(ScoreFunctionWOR("z", k=k, biased=biased)))[0]


def test_biased_variant_is_exact_when_k_covers_the_support():
    for biased in (False, True):
        grads = _categorical_estimates(5, biased, repeats=20)
        torch.testing.assert_close(grads, categorical_exact().expand(20, 5), rtol=1e-4, atol=1e-5)


def test_biased_variant_with_k1_gives_zero_gradient():
    # one sample: normalised weight 1 and the built-in baseline equals its own cost
    grads = _categorical_estimates(1, True, repeats=50)
    assert grads.abs().max() < 1e-6


def test_biased_variant_bias_shrinks_with_k():
    # measured bias ‖mean − exact‖ (3000 estimates; ‖exact‖ = 1.21): k=2 ≈ 0.45, k=3 ≈ 0.18, k=4 ≈ 0.06
    exact = categorical_exact()
    bias = {}
    for k in (2, 3, 4):
        report = check_unbiased(_categorical_estimates(k, True), exact)
        bias[k] = (report.mean - report.exact).norm().item()
        assert not report.passed, f"k={k}: the normalised estimator should be measurably biased"
    assert bias[2] > bias[3] > bias[4]


def test_biased_variant_has_lower_variance():
    unbiased = _categorical_estimates(3, False).var(0).sum()
    biased = _categorical_estimates(3, True).var(0).sum()
    assert biased < 0.5 * unbiased, (biased, unbiased)


# ---------------------------------------------------------------- ancestral plates (re-indexing)
from storch.plate import AncestralPlate, Plate, PlateClashError  # noqa: E402


def _chain3():
    first = AncestralPlate("seq", 2)
    second = AncestralPlate("seq", 3, ancestor=first, parent_index=torch.tensor([1, 0, 1]))
    third = AncestralPlate("seq", 2, ancestor=second, parent_index=torch.tensor([2, 0]))
    return first, second, third


def test_older_step_is_reindexed_to_the_newer_one():
    first, second, third = _chain3()
    old = storch.Tensor(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [first])  # event dim 2
    new = storch.Tensor(torch.zeros(3, 2), [second])
    out = old + new
    assert out.plates == [second]
    assert out._tensor.tolist() == [[3.0, 4.0], [1.0, 2.0], [3.0, 4.0]]
    # two steps back: third's beams extend second's beams 2 and 0, whose parents are 1 and 1
    newest = storch.Tensor(torch.zeros(2), [third])
    assert (old.sum(-1) + newest)._tensor.tolist() == [7.0, 7.0]
    assert (newest + old.sum(-1))._tensor.tolist() == [7.0, 7.0]  # argument order does not matter


def test_reindexing_with_per_plate_parent_indices_and_gradients():
    data = Plate("data", 2)
    first = AncestralPlate("seq", 2)
    # the parent of each beam depends on the data point
    second = AncestralPlate(
        "seq", 2, ancestor=first, parent_index=torch.tensor([[0, 1], [0, 0]]), index_plates=[data]
    )
    leaf = torch.tensor([10.0, 20.0], requires_grad=True)
    old = storch.Tensor(leaf, [first])  # does not carry the data plate
    new = storch.Tensor(torch.zeros(2, 2), [second, data])
    out = old * 1.0 + new
    assert out.plate_names == ["seq", "data"] and out.plates[0] is second
    assert out._tensor.tolist() == [[10.0, 20.0], [10.0, 10.0]]
    out._tensor.sum().backward()
    assert leaf.grad.tolist() == [3.0, 1.0]


def test_reindexing_in_cat_and_with_other_plates():
    other = Plate("data", 4)  # older than the sequence: laid out after it
    first, second, _ = _chain3()
    old = storch.Tensor(torch.arange(8.0).reshape(2, 4), [first, other])
    new = storch.Tensor(torch.zeros(3, 1), [second])
    joined = torch.cat([old.unsqueeze(-1), new], -1)
    assert joined.plate_names == ["seq", "data"] and joined.plates[0] is second
    assert joined._tensor[..., 0].tolist() == [[4.0, 5.0, 6.0, 7.0], [0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]


def test_plates_of_different_chains_still_clash():
    a, b = AncestralPlate("seq", 2), AncestralPlate("seq", 2)
    with pytest.raises(PlateClashError, match="Two different plates are named 'seq'"):
        storch.Tensor(torch.zeros(2), [a]) + storch.Tensor(torch.zeros(2), [b])


def test_same_step_keeps_the_fast_path():
    first, second, _ = _chain3()
    x = storch.Tensor(torch.ones(3, 2), [second])
    assert (x * 2 + x)._layout is x._layout


# ---------------------------------------------------------------- sequences: a length-3 toy problem
# vocabulary {0, 1, 2} + EOS = 3; logits from a tiny recurrent function of the prefix
V, EOS, STEPS = 4, 3, 3
_g = torch.Generator().manual_seed(7)
SEQ_PARAMS = [
    torch.tensor([0.3, -0.2, 0.1, -0.4]),  # θ0: base logits
    0.8 * torch.randn(4, 4, generator=_g),  # M: previous token → logits
    torch.randn(4, 2, generator=_g),  # A: token → state
    torch.randn(2, 4, generator=_g),  # B: state → logits
]
U = torch.tensor([1.0, -2.0, 0.5, 0.0])
WV = torch.tensor([0.5, 1.5, -1.0, 0.3])
OFFSETS = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, -1.0, 0.0, 1.0]])  # per data point (minibatch shape)


def _vecmat(x, m):
    return (x.unsqueeze(-1) * m).sum(-2)


def step_costs(xs):
    """A cost per prefix length: c1(x1), c2(x1, x2), c3(x1, x2, x3)."""
    c1 = (xs[0] * U).sum(-1)
    c2 = ((xs[1] * WV).sum(-1) - (xs[0] * U).sum(-1)) ** 2 / 4
    c3 = (xs[0] * U).sum(-1) * (xs[2] * WV).sum(-1) + ((xs[1] * WV).sum(-1)) ** 2
    return [c1, c2, c3]


def decode(method, theta0, m, a, b, offset=0.0):
    """Decode STEPS tokens; the state h of step t − 1 is re-indexed when it meets x_t."""
    x = method(OneHotCategorical(logits=theta0 + offset))
    xs, h = [x], torch.tanh(_vecmat(x, a))
    for _ in range(1, STEPS):
        x = method(OneHotCategorical(logits=theta0 + offset + _vecmat(x, m) + _vecmat(h, b)))
        xs.append(x)
        h = torch.tanh(h + _vecmat(x, a))
    return xs


def sequence_exact(which=(2,), offsets=OFFSETS[:1]):
    """Exact E[Σ_{t ∈ which} c_t] (mean over offsets) and its gradient, by enumerating all 4³ token
    strings; strings with a non-EOS token after EOS have probability 0."""
    params = [p.clone().requires_grad_() for p in SEQ_PARAMS]
    theta0, m, a, b = params
    seqs = torch.tensor(list(itertools.product(range(V), repeat=STEPS)))
    X = torch.nn.functional.one_hot(seqs, V).float()
    total = 0.0
    for offset in offsets:
        log_p = torch.zeros(len(seqs))
        done = torch.zeros(len(seqs), dtype=torch.bool)
        valid = torch.ones(len(seqs), dtype=torch.bool)
        for t in range(STEPS):
            logits = theta0 + offset if t == 0 else theta0 + offset + _vecmat(X[:, t - 1], m) + _vecmat(h, b)
            lp = torch.log_softmax(logits.expand(len(seqs), V), -1).gather(-1, seqs[:, t : t + 1]).squeeze(-1)
            valid &= ~done | (seqs[:, t] == EOS)
            log_p = log_p + torch.where(done, torch.zeros_like(lp), lp)
            h = torch.tanh(_vecmat(X[:, 0], a)) if t == 0 else torch.tanh(h + _vecmat(X[:, t], a))
            done = done | (seqs[:, t] == EOS)
        p = torch.where(valid, log_p.exp(), torch.zeros_like(log_p))
        assert abs(p.sum().item() - 1.0) < 1e-5
        costs = step_costs([X[:, t] for t in range(STEPS)])
        total = total + sum((p * costs[t]).sum() for t in which) / len(offsets)
    return total.detach(), torch.autograd.grad(total, params)


N_SEQUENCES = 40  # 3·3·4 strings without an early EOS, 3 ending at step 2, 1 at step 1


def _sequence_gradients(method, repeats, which=(2,), minibatch=False):
    def model(*params):
        offset = storch.denote_independent(OFFSETS, 0, "data") if minibatch else 0.0
        xs = decode(method, *params, offset=offset)
        costs = step_costs(xs)
        for t in which:
            storch.add_cost(costs[t], f"c{t + 1}")

    return replicated_gradients(SEQ_PARAMS, repeats, model)


SEQUENCE_CASES = {
    "k1": dict(k=1),
    "k3": dict(k=3),
    "k6": dict(k=6),
    "k3_costs_at_every_step": dict(k=3, which=(0, 1, 2)),
    "k3_minibatch": dict(k=3, minibatch=True),
}


@pytest.mark.parametrize("name", list(SEQUENCE_CASES))
def test_sequence_unbiased(name):
    case = dict(SEQUENCE_CASES[name])
    method = ScoreFunctionWOR("seq", k=case.pop("k"), eos=EOS)
    which = case.get("which", (2,))
    grads = _sequence_gradients(method, 2000, **case)
    _, exact = sequence_exact(which, OFFSETS if case.get("minibatch") else OFFSETS[:1])
    for g, e, label in zip(grads, exact, ["theta0", "M", "A", "B"]):
        assert_unbiased(g.reshape(len(g), -1), e.reshape(-1), label=f"{name} {label}")


def test_mc_decoder_unbiased():
    from storch.sampling.decoding import MCDecoder

    method = ScoreFunctionWOR("seq", k=2, sampling_method=MCDecoder("seq", 2, eos=EOS))
    grads = _sequence_gradients(method, 2000, which=(0, 1, 2))
    _, exact = sequence_exact((0, 1, 2))
    for g, e, label in zip(grads, exact, ["theta0", "M", "A", "B"]):
        assert_unbiased(g.reshape(len(g), -1), e.reshape(-1), label=f"MCDecoder {label}")


def test_sequence_beams_are_distinct_and_finished_sequences_stay_finished():
    method = ScoreFunctionWOR("seq", k=5, eos=EOS)
    leaf, view = storch.testing.replicate(SEQ_PARAMS[0], 300)
    xs = decode(method, view, *SEQ_PARAMS[1:])
    tokens = torch.stack([x.argmax(-1) for x in xs], -1)  # x1, x2 re-indexed to the last step
    assert tokens.plate_names == ["seq", "replicate"] and tokens.plates[0] is xs[-1].plates[0]
    raw = tokens._tensor  # (5, 300, 3)
    for r in range(300):
        assert len({tuple(s) for s in raw[:, r].tolist()}) == 5
    after_eos = (raw[..., :-1] == EOS) & (raw[..., 1:] != EOS)
    assert not after_eos.any()
    # the last step's log-probability is that of the whole sequence (sum over steps, EOS after EOS: 0)
    state = method.sampling_method.state_of(xs[-1])
    flat = raw.reshape(-1, STEPS)
    torch.testing.assert_close(state.log_prob.detach().reshape(-1), sequence_log_prob(flat), rtol=1e-5, atol=1e-5)


def sequence_log_prob(seqs):
    theta0, m, a, b = SEQ_PARAMS
    X = torch.nn.functional.one_hot(seqs, V).float()
    log_p, done = torch.zeros(len(seqs)), torch.zeros(len(seqs), dtype=torch.bool)
    for t in range(STEPS):
        logits = theta0 if t == 0 else theta0 + _vecmat(X[:, t - 1], m) + _vecmat(h, b)
        lp = torch.log_softmax(logits.expand(len(seqs), V), -1).gather(-1, seqs[:, t : t + 1]).squeeze(-1)
        log_p = log_p + torch.where(done, torch.zeros_like(lp), lp)
        h = torch.tanh(_vecmat(X[:, 0], a)) if t == 0 else torch.tanh(h + _vecmat(X[:, t], a))
        done = done | (seqs[:, t] == EOS)
    return log_p


def test_sequence_exact_when_k_covers_all_sequences():
    expected, exact = sequence_exact((0, 1, 2))
    for biased in (False, True):
        method = ScoreFunctionWOR("seq", k=N_SEQUENCES, eos=EOS, biased=biased)
        grads = _sequence_gradients(method, 3, which=(0, 1, 2))
        for g, e in zip(grads, exact):
            torch.testing.assert_close(g, e.expand_as(g), rtol=1e-4, atol=1e-5)
    # the plates hold every prefix: 4, then 13 live prefixes of 16 beams, then all 40 sequences
    method = ScoreFunctionWOR("seq", k=N_SEQUENCES, eos=EOS)
    xs = decode(method, *SEQ_PARAMS)
    assert [x.n for x in xs] == [4, 16, 40]
    for x in xs:
        torch.testing.assert_close(x.plate.weight._tensor.sum(), torch.tensor(1.0))


def test_sequence_biased_variant_bias_shrinks_with_k():
    # measured ‖mean − exact‖ over all 30 coordinates (‖exact‖ = 0.65, 2000 estimates, noise ≈ 0.03):
    # k=2 ≈ 0.28, k=4 ≈ 0.11, k=8 ≈ 0.06, k=16 ≈ 0.014 (the unbiased variant: within noise)
    _, exact = sequence_exact()
    exact_flat = torch.cat([e.reshape(-1) for e in exact])
    bias = {}
    for k in (2, 4, 8):
        grads = _sequence_gradients(ScoreFunctionWOR("seq", k=k, eos=EOS, biased=True), 2000)
        flat = torch.cat([g.reshape(len(g), -1) for g in grads], 1)
        report = check_unbiased(flat, exact_flat)
        bias[k] = (report.mean - report.exact).norm().item()
        if k < 8:
            assert not report.passed, f"k={k}: the normalised estimator should be measurably biased"
    assert bias[2] > bias[4] > bias[8], bias


def test_sequence_errors():
    method = ScoreFunctionWOR("seq", k=2, eos=EOS)
    z = ScoreFunction("seq", n_samples=2)(OneHotCategorical(logits=torch.zeros(4)))
    with pytest.raises(ValueError, match="not an earlier step of a sequence"):
        method(OneHotCategorical(logits=z * 1.0))
    x = method(OneHotCategorical(logits=torch.zeros(4)))
    with pytest.raises(ValueError, match="one categorical variable per beam"):
        method(OneHotCategorical(logits=(x.unsqueeze(-2) * torch.ones(3, 1))))


def test_sequence_hessian_unbiased():
    # second derivatives with respect to θ0 (the other parameters fixed), k = 3
    method = ScoreFunctionWOR("seq", k=3, eos=EOS)
    repeats = 2000
    leaf, view = storch.testing.replicate(SEQ_PARAMS[0], repeats)
    xs = decode(method, view, *SEQ_PARAMS[1:])
    storch.add_cost(step_costs(xs)[2], "f")
    storch.backward(create_graph=True)
    rows = [torch.autograd.grad(leaf.grad[:, i].sum(), leaf, retain_graph=True)[0] * repeats for i in range(V)]
    hessians = torch.stack(rows, 1)

    def expectation(theta0):
        saved = SEQ_PARAMS[0]
        SEQ_PARAMS[0] = theta0
        try:
            return _expected_cost()
        finally:
            SEQ_PARAMS[0] = saved

    exact = torch.autograd.functional.hessian(expectation, SEQ_PARAMS[0].clone())
    assert_unbiased(hessians.reshape(repeats, -1), exact.reshape(-1), label="sequence hessian")


def _expected_cost():
    seqs = torch.tensor(list(itertools.product(range(V), repeat=STEPS)))
    valid = ~((seqs[:, :-1] == EOS) & (seqs[:, 1:] != EOS)).any(-1)
    p = torch.where(valid, sequence_log_prob(seqs).exp(), torch.zeros(len(seqs)))
    X = torch.nn.functional.one_hot(seqs, V).float()
    return (p * step_costs([X[:, t] for t in range(STEPS)])[2]).sum()
