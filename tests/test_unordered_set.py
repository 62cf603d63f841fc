"""Unordered sets (Kool, van Hoof & Welling 2020): the P^D(S) / leave-one-out math against brute-force
enumeration of ordered samples, UnorderedSet and UnorderedSetEstimator against exact gradients
(|mean − exact| ≤ 4.5 SE per coordinate) on one node, two nested nodes, a minibatch plate and
several variables, second derivatives, the baseline's variance reduction, and the (biased) relaxed
variants GumbelSoftmaxWOR / UnorderedSetGumbelSoftmax with their measured bias."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributions import Categorical, OneHotCategorical

import storch
from storch.method import GumbelSoftmax, ScoreFunction
from storch.method.unordered_set import UnorderedSetEstimator, UnorderedSetGumbelSoftmax
from storch.sampling.unordered_set import (
    GumbelSoftmaxWOR,
    UnorderedSet,
    log_complement_mass,
    log_leave_one_out_ratio,
    log_leave_two_out_ratio,
    log_set_probability,
    unordered_set_log_weights,
)
from storch.testing import assert_unbiased, check_unbiased, replicate, replicated_gradients

from problems import bernoulli, minibatch_categorical, nested_categorical, one_categorical, replicated_hessians

R = 2000


# ---------------------------------------------------------------- the math, against enumeration
def ordered_sum(p: list[float], subset: list[int], domain: list[int]) -> float:
    """P^domain(subset) by enumerating the orders of sampling subset from domain. The mass left at
    each draw is summed over the values not drawn yet (no cancellation), so this is accurate to
    rounding in float64 even for extreme probabilities."""
    total = 0.0
    for order in itertools.permutations(subset):
        prob, left = 1.0, list(domain)
        for s in order:
            prob *= p[s] / math.fsum(p[d] for d in left)
            left.remove(s)
        total += prob
    return total


def random_problems(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        size = int(torch.randint(2, 7, (1,), generator=g))
        k = int(torch.randint(1, size + 1, (1,), generator=g))
        scale = (0.1, 1.0, 3.0, 8.0, 20.0)[i % 5]  # from nearly uniform to extremely peaked
        p = (scale * torch.randn(size, generator=g, dtype=torch.float64)).softmax(-1).tolist()
        subset = torch.randperm(size, generator=g)[:k].tolist()
        yield p, subset, list(range(size))


def as_log(p: list[float], subset: list[int], domain: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rest = math.fsum(p[d] for d in domain if d not in subset)
    log_rest = math.log(rest) if rest > 0 else -math.inf
    return torch.tensor([math.log(p[s]) for s in subset], dtype=torch.float64), torch.tensor(log_rest, dtype=torch.float64)


def test_set_probability_and_ratios_match_enumeration():
    worst = {"P": 0.0, "R": 0.0, "R2": 0.0}
    for p, subset, domain in random_problems(150, seed=0):
        log_p, log_rest = as_log(p, subset, domain)
        exact = ordered_sum(p, subset, domain)
        got = log_set_probability(log_p, log_rest).exp().item()
        worst["P"] = max(worst["P"], abs(got / exact - 1))
        ratio = log_leave_one_out_ratio(log_p, log_rest).exp()
        ratio2 = log_leave_two_out_ratio(log_p, log_rest).exp()
        for i, s in enumerate(subset):
            d1 = [d for d in domain if d != s]
            s1 = [x for x in subset if x != s]
            p1 = ordered_sum(p, s1, d1)
            worst["R"] = max(worst["R"], abs(ratio[i].item() / (p1 / exact) - 1))
            for j, t in enumerate(subset):
                expected = 1.0 if i == j else ordered_sum(p, [x for x in s1 if x != t], [d for d in d1 if d != t]) / p1
                worst["R2"] = max(worst["R2"], abs(ratio2[i, j].item() / expected - 1))
    # measured: 1.3e-11, 1.3e-11, 4e-13 (trapezoid step 0.25 in log(−log u))
    assert max(worst.values()) < 1e-9, worst


def test_special_cases():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    # one element: P({s}) = p(s), R = 1/p(s), weight 1 (plain Monte Carlo)
    torch.testing.assert_close(log_set_probability(p[1:2].log()).exp(), p[1], rtol=1e-10, atol=0)
    torch.testing.assert_close(unordered_set_log_weights(p[1:2].log()).exp(), torch.ones(1, dtype=torch.float64))
    # the whole support: P = 1 and weights p(s)
    torch.testing.assert_close(log_set_probability(p.log()).exp(), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(unordered_set_log_weights(p.log()).exp(), p)
    # P^D(S) of all sets of size 2 sums to 1
    total = sum(log_set_probability(p[list(s)].log()).exp() for s in itertools.combinations(range(3), 2))
    torch.testing.assert_close(total, torch.tensor(1.0, dtype=torch.float64))
    # log p(D∖S)
    torch.testing.assert_close(log_complement_mass(p[:2].log()).exp(), p[2])
    assert torch.isneginf(log_complement_mass(p.log()))


def test_vectorised_over_plates_and_stable_in_float32():
    g = torch.Generator().manual_seed(1)
    logits = 6.0 * torch.randn(7, 3, 4, 8, generator=g)  # K = 8 values, plates (3, 4), then sets of 3
    log_p_all = logits.log_softmax(-1)
    index = torch.rand(7, 3, 4, 8, generator=g).argsort(-1)[..., :3]
    log_p = log_p_all.gather(-1, index).movedim(-1, 0)  # (3, 7, 3, 4)
    batched = log_leave_one_out_ratio(log_p)
    assert batched.shape == (3, 7, 3, 4)
    for b in [(0, 0, 0), (6, 2, 3), (3, 1, 2)]:
        single = log_leave_one_out_ratio(log_p[(slice(None),) + b])
        torch.testing.assert_close(batched[(slice(None),) + b], single)
    two = log_leave_two_out_ratio(log_p)
    assert two.shape == (3, 3, 7, 3, 4) and torch.isfinite(two).all()
    # float32 input, extreme probabilities (down to 1e-30 and up to 1 − 1e-7): finite, float32 out
    extreme = torch.tensor([[-1e-7, -70.0, -20.0], [-1.0, -2.0, -69.0]]).T  # (3 elements, 2 plates)
    w = unordered_set_log_weights(extreme)
    assert w.dtype == torch.float32 and torch.isfinite(w).all()
    assert torch.isfinite(log_leave_two_out_ratio(extreme)).all()


def test_weights_are_unbiased_for_indicators():
    # E[Σ_S p(s) R(S, s) 1[s = j]] = p(j): the weights of a sampled set, 20000 sets at once
    theta = torch.tensor([0.2, -0.4, 0.9, 0.0, 1.0, -2.0])
    n = 6000
    sampler = UnorderedSet("z", 3)
    _, state = sampler.draw(Categorical(logits=theta.expand(n, 6)), 1)
    w = sampler.weights(state)  # (3, n)
    estimates = torch.zeros(n, 6).scatter_add_(1, state.tokens.T, w.T)
    assert_unbiased(estimates, theta.softmax(-1), label="Σ_S p R 1[s=j]")


def test_weights_with_values_of_probability_zero():
    theta = torch.tensor([0.0, 1.0, -math.inf, -math.inf])
    sampler = UnorderedSet("z", 3)
    samples, state = sampler.draw(Categorical(logits=theta), 0)
    w = sampler.weights(state)
    p = theta.softmax(-1)
    # two values can occur; the set holds both and a dead filler of weight 0
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    torch.testing.assert_close(w[state.alive], p[samples[state.alive]])


# ---------------------------------------------------------------- unbiasedness: one node
CATEGORICAL = one_categorical(6)
THETA, VALUES, categorical_exact = CATEGORICAL.theta, CATEGORICAL.values, CATEGORICAL.exact


ONE_NODE = {
    "k2": lambda: UnorderedSetEstimator("z", k=2, use_baseline=False),
    "k2_baseline": lambda: UnorderedSetEstimator("z", k=2),
    "k3": lambda: UnorderedSetEstimator("z", k=3, use_baseline=False),
    "k3_baseline": lambda: UnorderedSetEstimator("z", k=3),
    "score_function_with_unordered_set": lambda: ScoreFunction("z", sampling_method=UnorderedSet("z", 3)),
}


@pytest.mark.parametrize(
    "name,one_hot",
    [(name, True) for name in ONE_NODE] + [("k2_baseline", False), ("k3", False)],
    ids=[f"{name}-onehot" for name in ONE_NODE] + ["k2_baseline-categorical", "k3-categorical"],
)
def test_one_categorical_node_unbiased(name, one_hot):
    (grads,) = replicated_gradients([THETA], R, CATEGORICAL.model(ONE_NODE[name](), one_hot))
    assert_unbiased(grads, categorical_exact(), label=name)


def test_k_covering_the_support_is_exact():
    def model(theta):
        z = UnorderedSetEstimator("z", k=8)(OneHotCategorical(logits=theta))
        assert z.n == 6
        storch.add_cost(((z * VALUES).sum(-1)) ** 2, "f")

    (grads,) = replicated_gradients([THETA], 4, model)
    torch.testing.assert_close(grads, categorical_exact().expand(4, 6), atol=1e-5, rtol=1e-5)


def test_cost_estimate_is_unbiased():
    # Σ_S p(s) R(S, s) f(s), one estimate per replicate
    _, view = replicate(THETA, 4000)
    z = UnorderedSetEstimator("z", k=3)(OneHotCategorical(logits=view))
    with torch.no_grad():
        estimates = storch.reduce_plates(((z * VALUES).sum(-1)) ** 2, "z")._tensor.unsqueeze(-1)
    exact = (THETA.softmax(-1) * VALUES**2).sum()
    assert_unbiased(estimates, exact.reshape(1), label="Σ_S p R f")


# ---------------------------------------------------------------- two nested nodes
NESTED_PROBLEM = nested_categorical(4, 5)


@pytest.mark.parametrize("second", ["unordered_set", "score_function"])
def test_two_nested_nodes(second):
    m1 = UnorderedSetEstimator("z1", k=2)
    m2 = UnorderedSetEstimator("z2", k=3) if second == "unordered_set" else ScoreFunction("z2", n_samples=2)
    NESTED_PROBLEM.assert_unbiased(NESTED_PROBLEM.model(m1, m2), R)


# ---------------------------------------------------------------- a minibatch plate
def test_categorical_under_a_minibatch_plate():
    problem = minibatch_categorical()
    (grads,) = replicated_gradients([problem.w], 1500, problem.model(UnorderedSetEstimator("z", k=3)))
    assert_unbiased(grads, problem.exact())


# ---------------------------------------------------------------- several variables
BERNOULLI = bernoulli(interaction=2.0)


@pytest.mark.parametrize("k", [3, 5])
def test_several_variables_sampled_jointly(k):
    # three Bernoulli variables in one node: the set holds k distinct joint values of 8
    (grads,) = replicated_gradients([BERNOULLI.phi], R, BERNOULLI.model(UnorderedSetEstimator("x", k=k)))
    assert_unbiased(grads, BERNOULLI.exact())


def test_two_independent_nodes_feeding_one_cost():
    theta_a = torch.tensor([0.3, -0.2, 1.1, 0.0])
    theta_b = torch.tensor([-0.5, 0.4, 0.2, 0.9, -1.0])
    table = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))

    def model(ta, tb):
        a = UnorderedSetEstimator("a", k=2)(OneHotCategorical(logits=ta))
        b = UnorderedSetEstimator("b", k=3)(OneHotCategorical(logits=tb))
        storch.add_cost(((a.unsqueeze(-1) * table) * b.unsqueeze(-2)).sum((-1, -2)) ** 2, "f")

    ga, gb = replicated_gradients([theta_a, theta_b], R, model)
    ta, tb = theta_a.clone().requires_grad_(), theta_b.clone().requires_grad_()
    ea, eb = torch.autograd.grad((ta.softmax(-1)[:, None] * tb.softmax(-1) * table**2).sum(), [ta, tb])
    assert_unbiased(ga, ea, label="a")
    assert_unbiased(gb, eb, label="b")


# ---------------------------------------------------------------- sequences (stochastic beam search)
SEQ_V, SEQ_EOS, SEQ_LEN = 3, 2, 3
SEQ_THETA = torch.tensor([0.3, -0.2, -0.6])
SEQ_M = torch.tensor([[0.5, -0.4, 0.2], [-0.3, 0.8, 0.1], [0.0, 0.0, 0.0]])
SEQ_VALUES = torch.tensor([1.0, -2.0, 0.5])


def _vecmat(x, m):
    return (x.unsqueeze(-1) * m).sum(-2)


def sequence_costs(xs):
    """A cost at step 2 (of the first two tokens) and one at step 3 (of all three)."""
    v = [(x * SEQ_VALUES).sum(-1) for x in xs]
    return (v[0] - v[1]) ** 2, v[0] * v[2] + v[1] ** 2


def sequence_exact():
    theta, m = SEQ_THETA.clone().requires_grad_(), SEQ_M.clone().requires_grad_()
    total = 0.0
    for seq in itertools.product(range(SEQ_V), repeat=SEQ_LEN):
        log_p, done, valid = 0.0, False, True
        for t, token in enumerate(seq):
            if done:  # after EOS only EOS, with probability 1
                valid &= token == SEQ_EOS
                continue
            logits = theta if t == 0 else theta + m[seq[t - 1]]
            log_p = log_p + logits.log_softmax(-1)[token]
            done = token == SEQ_EOS
        if valid:
            xs = [torch.nn.functional.one_hot(torch.tensor(x), SEQ_V).float() for x in seq]
            total = total + torch.exp(log_p) * sum(sequence_costs(xs))
    return torch.autograd.grad(total, [theta, m])


@pytest.mark.parametrize("k,use_baseline", [(3, False), (3, True), (5, True)])
def test_sequences_unbiased(k, use_baseline):
    method = UnorderedSetEstimator("seq", k=k, use_baseline=use_baseline, eos=SEQ_EOS)

    def model(theta, m):
        x = method(OneHotCategorical(logits=theta))
        xs = [x]
        for _ in range(SEQ_LEN - 1):
            x = method(OneHotCategorical(logits=theta + _vecmat(x, m)))  # the previous token's row
            xs.append(x)
        assert xs[-1].plates[0] is not xs[0].plates[0] and xs[-1].plate_names[0] == "seq"
        c2, c3 = sequence_costs(xs)
        storch.add_cost(c2, "step2")
        storch.add_cost(c3, "step3")

    g_theta, g_m = replicated_gradients([SEQ_THETA, SEQ_M], R, model)
    e_theta, e_m = sequence_exact()
    assert_unbiased(g_theta, e_theta, label="theta")
    assert_unbiased(g_m, e_m, label="M")


# ---------------------------------------------------------------- second order
@pytest.mark.parametrize("use_baseline", [False, True], ids=["plain", "baseline"])
def test_hessian_unbiased(use_baseline):
    model = BERNOULLI.model(UnorderedSetEstimator("x", k=3, use_baseline=use_baseline))
    assert_unbiased(replicated_hessians(BERNOULLI.phi, 4000, model), BERNOULLI.exact_hessian().reshape(-1))


# ---------------------------------------------------------------- variance
def test_baseline_reduces_variance():
    # an offset in the cost is pure noise without the baseline
    def run(use_baseline):
        method = UnorderedSetEstimator("z", k=3, use_baseline=use_baseline)

        def model(theta):
            z = method(OneHotCategorical(logits=theta))
            storch.add_cost(((z * VALUES).sum(-1)) ** 2 + 10.0, "f")

        return replicated_gradients([THETA], R, model)[0]

    plain, baseline = run(False), run(True)
    assert check_unbiased(plain, categorical_exact()).passed
    assert check_unbiased(baseline, categorical_exact()).passed
    # measured total variance: 39.5 without, 1.62 with the baseline
    assert baseline.var(0).sum() < plain.var(0).sum() / 10, (baseline.var(0).sum(), plain.var(0).sum())


def test_unordered_set_beats_sampling_with_replacement():
    # the same number of cost evaluations (3): distinct samples help on a peaked distribution
    theta = torch.tensor([3.0, 1.5, 0.0, -0.5, -1.0, 0.0])

    def run(method):
        def model(th):
            z = method(OneHotCategorical(logits=th))
            storch.add_cost(((z * VALUES).sum(-1)) ** 2, "f")

        return replicated_gradients([theta], R, model)[0]

    unordered = run(UnorderedSetEstimator("z", k=3))
    rloo = run(ScoreFunction("z", n_samples=3, baseline_factory="batch_average"))
    # measured total variance: 0.19 (unordered set) vs 1.4 (leave-one-out with replacement)
    assert unordered.var(0).sum() < rloo.var(0).sum() / 3, (unordered.var(0).sum(), rloo.var(0).sum())


# ---------------------------------------------------------------- relaxed: GumbelSoftmaxWOR
def test_relaxed_samples_tend_to_the_set_in_order():
    theta = torch.tensor([[1.0, 0.0, -1.0, 0.5, 0.2]] * 200, requires_grad=True)
    sampler = GumbelSoftmaxWOR("z", 3, initial_temperature=1e-3)
    y = sampler.sample(OneHotCategorical(logits=theta), (storch.plate.Plate("b", 200),), True)
    state = sampler._pending
    hard = torch.nn.functional.one_hot(state.tokens, 5).float()
    assert y.shape == (3, 200, 5) and y.requires_grad
    # away from near-ties of the perturbed values (gaps below 20τ stay soft), y is the set's one-hot
    ranked = torch.cat([state.perturbed, state.kappa.unsqueeze(0)], 0)
    clear = (ranked[:-1] - ranked[1:]).min(0).values > 0.02
    assert clear.sum() > 150
    assert (y - hard).abs().amax((0, 2))[clear].max() < 1e-3
    assert (state.perturbed[:-1] >= state.perturbed[1:]).all()  # the set in decreasing order
    # without pathwise gradients it is the discrete unordered set
    discrete = sampler.sample(OneHotCategorical(logits=theta), (storch.plate.Plate("b", 200),), False)
    assert not discrete.requires_grad and set(discrete.sum(-1).unique().tolist()) == {1.0}


def test_straight_through_forward_value_is_discrete_and_unbiased():
    _, view = replicate(THETA, 4000)
    z = UnorderedSetGumbelSoftmax("z", k=3, initial_temperature=0.5, straight_through=True)(OneHotCategorical(logits=view))
    assert torch.allclose(z._tensor, z._tensor.round(), atol=1e-6)  # one-hot up to rounding
    with torch.no_grad():
        f = ((z * VALUES).sum(-1)) ** 2
        estimates = storch.reduce_plates(f, "z")._tensor.unsqueeze(-1)
    assert_unbiased(estimates, (THETA.softmax(-1) * VALUES**2).sum().reshape(1), label="straight-through forward")


def relaxed_bias(make, repeats=5000):
    method = make()

    def model(theta):
        z = method(OneHotCategorical(logits=theta))
        storch.add_cost(((z * VALUES[:5]).sum(-1)) ** 2, "f")

    (grads,) = replicated_gradients([THETA[:5]], repeats, model)
    theta = THETA[:5].clone().requires_grad_()
    exact = torch.autograd.grad((theta.softmax(-1) * VALUES[:5] ** 2).sum(), theta)[0]
    return grads, exact


def test_k1_is_the_gumbel_softmax_estimator():
    # one element: weight 1 and y = softmax((log p + G)/τ), the Gumbel-softmax estimator
    wor, exact = relaxed_bias(lambda: UnorderedSetGumbelSoftmax("z", k=1, initial_temperature=0.5, annealing_rate=0.0))
    gs, _ = relaxed_bias(lambda: GumbelSoftmax("z", initial_temperature=0.5))
    diff = wor.mean(0) - gs.mean(0)
    se = (wor.var(0) / len(wor) + gs.var(0) / len(gs)).sqrt()
    assert (diff.abs() <= 4.5 * se).all(), (diff, se)
    assert not check_unbiased(wor, exact).passed  # and as biased (bias norm 0.62 at τ = 0.5)


def test_relaxed_set_bias_is_measured_and_shrinks_with_temperature():
    biases = {}
    for tau in (1.0, 0.1):
        grads, exact = relaxed_bias(
            lambda tau=tau: UnorderedSetGumbelSoftmax("z", k=2, initial_temperature=tau, annealing_rate=0.0)
        )
        biases[tau] = (grads.mean(0) - exact).norm().item()
    # measured (norm of mean − exact, |exact| = 1.56, 2·10⁴ replicates, Monte Carlo noise ≈ 0.005
    # at τ = 1 and 0.06 at τ = 0.1; the test uses 5000, noise 0.01 and 0.12): k = 2: 1.16 at τ = 1, 0.90 at τ = 0.5, 0.32 at τ = 0.1;
    # k = 3: 1.21, 1.01, 0.41; k = 5 (the whole support): 1.26, 1.07, 0.48
    assert biases[1.0] > 0.9, biases
    assert biases[0.1] < 0.6 * biases[1.0], biases


def test_relaxed_weights_are_differentiable_and_sum_to_one_on_the_whole_support():
    theta = torch.tensor([0.3, -0.2, 1.0], requires_grad=True)
    z = UnorderedSetGumbelSoftmax("z", k=3)(OneHotCategorical(logits=theta))
    w = z.plate.weight
    assert w.requires_grad
    torch.testing.assert_close(w._tensor.sum(), torch.tensor(1.0))
    (g,) = torch.autograd.grad(w._tensor.sum(), theta)
    assert torch.isfinite(g).all() and g.abs().max() < 1e-5  # Σ p(s) = 1 for every θ


def test_errors():
    with pytest.raises(ValueError, match="no relaxed form"):
        UnorderedSetGumbelSoftmax("z", k=2)(Categorical(logits=torch.zeros(4, requires_grad=True)))
    with pytest.raises(ValueError, match="variables per plate element"):
        UnorderedSetGumbelSoftmax("z", k=2)(OneHotCategorical(logits=torch.zeros(3, 4, requires_grad=True)))
    with pytest.raises(TypeError, match="finite, enumerable support"):
        UnorderedSetEstimator("z", k=2)(torch.distributions.Normal(torch.zeros(2, requires_grad=True), 1.0))
    with pytest.raises(ValueError, match="integration step"):
        UnorderedSet("z", 2, step=2.0)
    with pytest.raises(ValueError, match="temperatures must be positive"):
        GumbelSoftmaxWOR("z", 2, initial_temperature=0.0)
