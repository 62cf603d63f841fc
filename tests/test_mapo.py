"""MAPO (storch.method.mapo): unbiasedness without clipping against exact enumeration (empty and
non-empty buffers, baselines, factorised sequences, two nested nodes, a minibatch plate, second
derivatives), the measured bias of memory weight clipping, systematic exploration, the buffer's
updates and persistence, errors on bad input, and a tiny run of benchmarks/mapo_sparse.py."""

from __future__ import annotations

import copy
import os
import pickle
import sys

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Independent, Normal, OneHotCategorical

import storch
from storch.method import MAPO, ScoreFunction
from storch.method.mapo import MAPOMemory, MAPOState, sample_outside
from storch.testing import assert_unbiased, check_unbiased, replicated_gradients

from problems import minibatch_categorical, nested_categorical, one_categorical, replicated_hessians

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

R = 2000

# an 8-value categorical with a fixed cost per value
THETA = torch.tensor([0.5, -0.3, 1.2, 0.0, -1.0, 0.7, 0.2, -0.6])
COST = torch.tensor([1.0, -2.0, 0.5, 3.0, 2.0, -1.0, 4.0, 0.3])


def split_gradients(buffer: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(∇Σ_{y∈B} π f, ∇Σ_{y∉B} π f, π_B)`` at ``THETA``."""
    theta = THETA.clone().requires_grad_()
    terms = theta.softmax(-1) * COST
    inside = torch.zeros(8, dtype=torch.bool)
    inside[buffer] = True
    g_in = torch.autograd.grad(terms[inside].sum(), theta, retain_graph=True)[0]
    g_out = torch.autograd.grad(terms[~inside].sum(), theta)[0]
    return g_in, g_out, float(THETA.softmax(-1)[inside].sum())


def exact_gradient() -> torch.Tensor:
    g_in, g_out, _ = split_gradients([])
    return g_in + g_out


def categorical_model(method: MAPO, one_hot: bool = False):
    def model(theta):
        if one_hot:
            y = method(OneHotCategorical(logits=theta))
            storch.add_cost((y * COST).sum(-1), "f")
        else:
            y = method(Categorical(logits=theta))
            storch.add_cost(COST[y], "f")

    return model


def seeded(method: MAPO, values: list, repeats: int = R) -> MAPO:
    """``method`` with ``values`` in the buffer of every replicate (keys 0..repeats-1)."""
    if values:
        method.add_to_memory(torch.tensor(values), keys=torch.arange(repeats))
    return method


# ===================================================================== unbiasedness without clipping
@pytest.mark.parametrize("buffer", [[], [2], [0, 3, 5]], ids=["empty", "one", "three"])
@pytest.mark.parametrize("baseline", [None, "batch_average", "moving_average"])
def test_unbiased_categorical(buffer, baseline):
    method = seeded(MAPO("y", n_samples=3, buffer_size=4, baseline_factory=baseline), buffer)
    (grads,) = replicated_gradients([THETA], R, categorical_model(method))
    assert_unbiased(grads, exact_gradient(), label=f"MAPO buffer={buffer} baseline={baseline}")


def test_unbiased_one_hot_with_one_sample():
    method = seeded(MAPO("y", n_samples=1, buffer_size=2), [1, 6])
    (grads,) = replicated_gradients([THETA], R, categorical_model(method, one_hot=True))
    assert_unbiased(grads, exact_gradient())


def test_buffer_covering_the_support_is_exact():
    method = seeded(MAPO("y", n_samples=2, buffer_size=8), list(range(8)), repeats=50)
    (grads,) = replicated_gradients([THETA], 50, categorical_model(method))
    assert torch.allclose(grads, exact_gradient().expand_as(grads), atol=1e-5)


# a length-3 sequence over 3 tokens, factorised; the cost a fixed table of the 27 sequences
SEQ_THETA = torch.tensor([[0.3, -0.2, 0.5], [1.0, 0.0, -0.7], [-0.4, 0.6, 0.1]])
SEQ_TABLE = torch.linspace(-2.0, 3.0, 27)[
    torch.randperm(27, generator=torch.Generator().manual_seed(1))
].reshape(3, 3, 3)


def sequence_expectation(theta: torch.Tensor) -> torch.Tensor:
    p = theta.softmax(-1)
    joint = p[0][:, None, None] * p[1][None, :, None] * p[2][None, None, :]
    return (joint * SEQ_TABLE).sum()


@pytest.mark.parametrize("independent", [True, False], ids=["Independent", "batch_dims"])
@pytest.mark.parametrize("buffer", [[], [[0, 1, 2], [1, 1, 1], [2, 0, 0], [0, 1, 0]]], ids=["empty", "four"])
def test_unbiased_factorised_sequences(independent, buffer):
    method = seeded(MAPO("seq", n_samples=2, buffer_size=4, baseline_factory="batch_average"), buffer)

    def model(theta):
        distr = Independent(Categorical(logits=theta), 1) if independent else Categorical(logits=theta)
        seq = method(distr)
        assert seq.plate_names == ["seq", "replicate"] and seq.shape[-1] == 3
        storch.add_cost(SEQ_TABLE[seq[..., 0], seq[..., 1], seq[..., 2]], "f")

    (grads,) = replicated_gradients([SEQ_THETA], R, model)
    theta = SEQ_THETA.clone().requires_grad_()
    assert_unbiased(grads, torch.autograd.grad(sequence_expectation(theta), theta)[0])


def test_unbiased_bernoulli_bits():
    phi = torch.tensor([0.3, -0.5, 1.0])
    target = torch.tensor([0.49, 0.499, 0.8])
    method = seeded(MAPO("x", n_samples=2, buffer_size=3), [[1, 0, 1], [0, 0, 0]])

    def model(phi):
        x = method(Bernoulli(logits=phi))
        storch.add_cost(((x - target) ** 2).sum(-1), "f")

    (grads,) = replicated_gradients([phi], R, model)
    leaf = phi.clone().requires_grad_()
    p = leaf.sigmoid()
    exact = 0.0
    for bits in range(8):
        x = torch.tensor([(bits >> i) & 1 for i in range(3)], dtype=torch.float32)
        exact = exact + (p * x + (1 - p) * (1 - x)).prod() * ((x - target) ** 2).sum()
    assert_unbiased(grads, torch.autograd.grad(exact, leaf)[0])


def test_two_nested_nodes():
    problem = nested_categorical(4, 5)
    m1 = seeded(MAPO("z1", n_samples=2, buffer_size=3), [1])
    m2 = seeded(MAPO("z2", n_samples=2, buffer_size=3), [0, 3])  # one buffer per replicate, shared over z1
    problem.assert_unbiased(problem.model(m1, m2), R, "MAPO nested")


def test_minibatch_plate_has_a_buffer_per_datum():
    problem = minibatch_categorical()
    method = MAPO("z", n_samples=2, buffer_size=2)
    (grads,) = replicated_gradients([problem.w], R, problem.model(method))
    assert_unbiased(grads, problem.exact())
    n_data = method.store.buffer_tokens.shape[0] // R
    assert method.store.buffer_tokens.shape[0] == R * n_data and n_data > 1
    assert all(len(method.memory(k)[0]) >= 1 for k in (0, 1, R * n_data - 1))  # filled after one step


def test_second_derivatives_are_unbiased():
    problem = one_categorical(6)
    method = seeded(MAPO("z", n_samples=2, buffer_size=2, baseline_factory="batch_average"), [2, 4], 1500)
    hessians = replicated_hessians(problem.theta, 1500, problem.model(method, one_hot=False))
    theta = problem.theta.clone().requires_grad_()
    exact = torch.autograd.functional.hessian(problem.expectation, theta).reshape(-1)
    assert_unbiased(hessians, exact)


def test_variance_falls_with_the_buffer_mass():
    """At an equal number of cost evaluations (5), MAPO with the four most probable values in its
    buffer (π_B = 0.76) and one sample has about a third of the gradient variance of the score
    function with the RLOO baseline (measured 0.21 against 0.60, total over the coordinates)."""
    mapo = seeded(MAPO("y", n_samples=1, buffer_size=4), [2, 5, 0, 6])
    (g_mapo,) = replicated_gradients([THETA], R, categorical_model(mapo))
    storch.reset()
    sf = ScoreFunction("y", n_samples=5, baseline_factory="batch_average")

    def model(theta):
        y = sf(Categorical(logits=theta))
        storch.add_cost(COST[y], "f")

    (g_sf,) = replicated_gradients([THETA], R, model)
    assert g_mapo.var(0).sum() < 0.5 * g_sf.var(0).sum()


# ===================================================================== memory weight clipping
def test_clipping_bias_is_measured():
    """Buffer {4} of mass π_B = 0.034 < α = 0.1: the clipped estimator is unbiased for
    (w_B/π_B) ∇Σ_B πf + (1 − w_B)/(1 − π_B) ∇Σ_{∉B} πf, at distance 0.145 from the exact gradient
    (norm 0.574)."""
    repeats = 4000
    g_in, g_out, pi_b = split_gradients([4])
    assert 0.03 < pi_b < 0.04
    method = seeded(MAPO("y", n_samples=2, buffer_size=2, clip=0.1), [4], repeats)
    (grads,) = replicated_gradients([THETA], repeats, categorical_model(method))
    clipped = (0.1 / pi_b) * g_in + (0.9 / (1 - pi_b)) * g_out
    exact = g_in + g_out
    assert_unbiased(grads, clipped, label="clipped expectation")
    report = check_unbiased(grads, exact)
    assert not report.passed and float(report.zscores.max()) > 20
    bias = float((grads.mean(0) - exact).norm())
    assert 0.12 < bias < 0.17, bias
    assert abs(float((clipped - exact).norm()) - 0.1446) < 1e-3


def test_clipping_changes_nothing_when_the_buffer_mass_exceeds_alpha():
    _, _, pi_b = split_gradients([2, 5])
    assert pi_b > 0.1
    method = seeded(MAPO("y", n_samples=2, buffer_size=2, clip=0.1), [2, 5])
    (grads,) = replicated_gradients([THETA], R, categorical_model(method))
    assert_unbiased(grads, exact_gradient())


def test_clipped_weights():
    theta = THETA.clone().requires_grad_()
    method = MAPO("y", n_samples=4, buffer_size=2, clip=0.1)
    method.add_to_memory(torch.tensor([4, 7]))
    y = method(Categorical(logits=theta))
    p = THETA.softmax(-1)
    pi_b = float(p[4] + p[7])
    w = y.plate.weight._tensor
    torch.testing.assert_close(w[:2], torch.stack([p[4], p[7]]) * 0.1 / pi_b)
    torch.testing.assert_close(w[2:], torch.full((4,), 0.9 / 4))
    assert y.plate.info.buffer_mass.item() == pytest.approx(pi_b)


# ===================================================================== systematic exploration
def test_systematic_exploration_avoids_explored_values_and_drops_their_terms():
    """After a first step, each replicate's explored set E_r is excluded from its samples: the
    estimate is unbiased for ∇Σ_{y∉E_r} π f (and equals ∇E f where the cost on E_r is zero)."""
    repeats = 1500
    method = MAPO("y", n_samples=2, buffer_size=1, threshold=-1.5, systematic_exploration=True, max_explored=8)
    replicated_gradients([THETA], repeats, categorical_model(method))  # step 1: fills the sets
    explored = torch.zeros(repeats, 8, dtype=torch.bool)
    in_buffer = torch.zeros(repeats, 8, dtype=torch.bool)
    for r in range(repeats):
        explored[r, method.explored(r)] = True
        in_buffer[r, method.memory(r)[0]] = True
        assert not (explored[r] & in_buffer[r]).any()
        assert (method.memory(r)[1] < -1.5).all()  # only value 1 (cost −2) passes the threshold
    assert explored.any(1).float().mean() > 0.9 and in_buffer.any()

    sampled = []

    def model(theta):
        y = method(Categorical(logits=theta))
        sampled.append(y._tensor[y.plate.info.n_buffer:].T.clone())
        storch.add_cost(COST[y], "f")

    (grads,) = replicated_gradients([THETA], repeats, model)
    assert not explored.gather(1, sampled[0]).any()  # no replicate revisits its explored values
    theta = THETA.clone().requires_grad_()
    terms = theta.softmax(-1) * COST
    kept = torch.stack([torch.autograd.grad(terms[~explored[r]].sum(), theta, retain_graph=True)[0]
                        for r in range(repeats)])
    assert_unbiased(grads - kept, torch.zeros(8))


def test_exploration_that_covers_the_support_leaves_nothing_to_sample():
    method = MAPO("y", n_samples=2, buffer_size=1, systematic_exploration=True)
    theta = torch.zeros(3, requires_grad=True)
    for _ in range(6):
        y = method(Categorical(logits=theta))
        storch.add_cost(torch.tensor([1.0, 0.0, 2.0])[y], "f")
        storch.backward()
    assert len(method.memory()[0]) + len(method.explored()) == 3
    y = method(Categorical(logits=theta))
    assert float(y.plate.info.outside_mass) == 0.0
    assert torch.all(y.plate.weight._tensor[1:] == 0)


def test_sample_outside_is_the_conditional_distribution():
    torch.manual_seed(3)
    lp = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]]).log()
    excluded = torch.tensor([[[1, 1], [0, 1], [0, 0]]])
    tokens, outside = sample_outside(lp, excluded, torch.ones(1, 3, dtype=torch.bool), 20000)
    joint = lp[0, 0].exp()[:, None] * lp[0, 1].exp()[None, :]
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1, 1] = mask[0, 1] = mask[0, 0] = False
    assert outside.item() == pytest.approx(float(joint[mask].sum()))
    counts = torch.zeros(3, 3)
    counts.index_put_((tokens[:, 0, 0], tokens[:, 0, 1]), torch.ones(20000), accumulate=True)
    assert counts[~mask].sum() == 0
    expected = joint * mask / joint[mask].sum()
    assert (counts / 20000 - expected).abs().max() < 0.015


# ===================================================================== the buffer
def test_buffer_update_keeps_the_best_distinct_values():
    theta = torch.zeros(10, requires_grad=True)
    cost = torch.arange(10.0)
    method = MAPO("y", n_samples=6, buffer_size=3)
    seen: set[int] = set()
    for _ in range(5):
        y = method(Categorical(logits=theta))
        state: MAPOState = y.plate.info
        buffered = set(y._tensor[: state.n_buffer].tolist())
        assert buffered == set(method.memory()[0].tolist())
        assert not buffered & set(y._tensor[state.n_buffer:].tolist())  # samples come from outside
        assert y.n == state.n_buffer + 6  # the buffer's rows, then the samples
        assert float(y.plate.weight._tensor.sum()) == pytest.approx(1.0)
        seen |= set(y._tensor.tolist())
        storch.add_cost(cost[y], "f")
        storch.backward()
        values, costs = method.memory()
        assert values.tolist() == sorted(seen)[:3]  # the three cheapest values seen so far, best first
        torch.testing.assert_close(costs, cost[values].double())


def test_threshold_and_refreshed_costs():
    theta = torch.zeros(6, requires_grad=True)
    method = MAPO("y", n_samples=4, buffer_size=4, threshold=1.0)
    method.add_to_memory(torch.tensor([5]))  # not evaluated yet: cost −inf, kept
    assert method.memory()[1].tolist() == [float("-inf")]
    table = torch.tensor([0.0, 0.5, 2.0, 3.0, 4.0, 5.0])
    y = method(Categorical(logits=theta))
    assert int(y._tensor[0]) == 5
    storch.add_cost(table[y], "f")
    storch.backward()
    values, costs = method.memory()
    assert 5 not in values.tolist()  # evaluated at 5.0 ≥ threshold: dropped
    assert (costs < 1.0).all() and set(values.tolist()) <= {0, 1}


def test_no_update_without_update_parameters():
    method = MAPO("y", n_samples=3, buffer_size=2)
    y = method(Categorical(logits=torch.zeros(4, requires_grad=True)))
    storch.add_cost(y.float(), "f")
    storch.backward(update_parameters=False)
    assert len(method.memory()[0]) == 0


def test_keys_name_the_data_of_a_shuffled_minibatch():
    w = torch.zeros(4, 5, requires_grad=True)  # logits per datum
    cost = torch.tensor([3.0, 0.0, 2.0, 1.0, 4.0])
    method = MAPO("y", n_samples=5, buffer_size=1)
    ids = torch.tensor([7, 2, 9, 4])
    logits = storch.denote_independent(w, 0, "data")
    y = method(Categorical(logits=logits), key=ids)
    storch.add_cost(cost[y], "f")
    storch.backward()
    for i in ids.tolist():
        assert method.memory(i)[0].tolist() in ([1], [3], [0], [2], [4])
    assert len(method.memory(0)[0]) == 0  # position 0 is not a key here
    method.add_to_memory(torch.tensor([4]), costs=torch.tensor([-1.0]), keys=[2])
    y = method(Categorical(logits=storch.denote_independent(w[:2], 0, "data")), key=torch.tensor([9, 2]))
    assert y.plate.info.n_buffer == 1 and int(y._tensor[0, 1]) == 4  # datum 2's buffer, at position 1
    storch.reset()


def test_state_dict_copy_and_reset():
    method = MAPO("y", n_samples=3, buffer_size=2, systematic_exploration=True, max_explored=4)
    theta = torch.zeros(5, requires_grad=True)
    y = method(Categorical(logits=theta))
    storch.add_cost(y.float(), "f")
    storch.backward()
    other = MAPO("y", n_samples=3, buffer_size=2, systematic_exploration=True, max_explored=4)
    other.load_state_dict(method.state_dict())
    clone = copy.deepcopy(method)
    for m in (other, clone):
        assert m.memory()[0].tolist() == method.memory()[0].tolist()
        assert m.explored().tolist() == method.explored().tolist()
    method.reset()
    assert len(method.memory()[0]) == 0 and len(method.explored()) == 0
    assert len(clone.memory()[0]) == 2
    assert "buffer_size=2" in repr(method) and "systematic_exploration=True" in repr(method)


# ===================================================================== errors
def test_errors_on_bad_input():
    with pytest.raises(TypeError, match=r"MAPO\('y'\): Normal has no finite support .* ScoreFunction"):
        MAPO("y")(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match=r"MAPO\('y'\): clip is the memory weight clipping"):
        MAPO("y", clip=1.5)
    with pytest.raises(ValueError, match="clip"):
        MAPO("y", clip=0.0)
    with pytest.raises(ValueError, match="buffer_size must be at least 1"):
        MAPO("y", buffer_size=0)
    with pytest.raises(TypeError, match="n_samples must be a positive int"):
        MAPO("y", n_samples=2.5)
    with pytest.raises(ValueError, match="batch_average .* n_samples >= 2"):
        MAPO("y", n_samples=1, baseline_factory="batch_average")
    with pytest.raises(ValueError, match="threshold"):
        MAPO("y", threshold=float("nan"))
    with pytest.raises(TypeError, match="takes no sampling method"):
        MAPO("y", storch.sampling.MonteCarlo("y", 2))
    method = MAPO("y", n_samples=2, buffer_size=2)
    with pytest.raises(ValueError, match="do not fit in a buffer of buffer_size=2"):
        method.add_to_memory(torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="value indices"):
        method.add_to_memory(torch.tensor([0.5]))
    method(Categorical(logits=torch.zeros(4)))
    storch.reset()
    with pytest.raises(ValueError, match=r"variables with 4 values each, but this distribution's variables have 5"):
        method(Categorical(logits=torch.zeros(5)))
    with pytest.raises(ValueError, match=r"values of \(\) variables, but this distribution's values have \(3,\)"):
        method(Categorical(logits=torch.zeros(3, 4)))
    logits = storch.denote_independent(torch.zeros(3, 4), 0, "data")
    with pytest.raises(ValueError, match=r"one datum id per element of the independent plates \['data'\]"):
        method(Categorical(logits=logits), key=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="more than once"):
        method(Categorical(logits=logits), key=torch.tensor([1, 2, 1]))
    with pytest.raises(TypeError, match="integer datum ids"):
        method(Categorical(logits=logits), key=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(RuntimeError, match="call the MAPO method on the distribution"):
        method.sampling_method(Categorical(logits=torch.zeros(4)), (), False)


# ===================================================================== the sparse-reward example
def test_sparse_reward_example_tiny():
    """benchmarks/mapo_sparse.py at a tiny size: 4-token programs, 5 of 1296 hit 54."""
    import mapo_sparse

    hits = mapo_sparse.hitting_programs(4, 54)
    assert len(hits) == 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is ~10x faster on a loaded machine
    try:
        runs = [
            mapo_sparse.train(name, seed, budget=800, length=4, target=54, hits=hits)
            for name in ("mapo", "reinforce-moving-average") for seed in range(3)
        ]
    finally:
        torch.set_num_threads(threads)
    mapo = [r for r in runs if r.method == "mapo"]
    reinforce = [r for r in runs if r.method != "mapo"]
    assert all(r.evaluations >= 800 for r in runs)
    assert sum(r.solved_at is not None for r in mapo) >= 2
    assert sum(r.solved_at is not None for r in reinforce) <= 1
    assert "solved" in mapo_sparse.table(runs)


def test_a_baseline_that_needs_its_correction_is_refused_when_built():
    """The Q critic depends on the sample itself; MAPO's conditional score cannot add its
    expectation correction, so the pair is refused at construction, not after a backward pass."""
    with pytest.raises(ValueError, match="QCritic baseline depends on the node's own sample"):
        MAPO("y", n_samples=2, baseline_factory="q_critic")
    assert MAPO("y", n_samples=2, baseline_factory="critic").baseline is not None


# ===================================================================== the memory module
def _explored_method() -> MAPO:
    """A MAPO with systematic exploration after one step on a 5-value categorical."""
    method = MAPO("y", n_samples=3, buffer_size=2, systematic_exploration=True, max_explored=4)
    y = method(Categorical(logits=torch.zeros(5, requires_grad=True)))
    storch.add_cost(y.float(), "f")
    storch.backward()
    return method


def _same_memory(a: MAPO, b: MAPO) -> None:
    assert a.memory()[0].tolist() == b.memory()[0].tolist()
    assert a.memory()[1].tolist() == b.memory()[1].tolist()
    assert a.explored().tolist() == b.explored().tolist()
    for name, buffer in a.store.named_buffers():
        assert torch.equal(buffer, getattr(b.store, name)), name


def test_memory_is_one_module_of_buffers_kept_in_the_extra_state():
    method = _explored_method()
    assert isinstance(method.store, MAPOMemory)
    names = ["buffer_tokens", "buffer_costs", "buffer_valid", "explored_tokens", "explored_valid", "explored_next"]
    assert [name for name, _ in method.named_buffers()] == [f"store.{name}" for name in names]
    state = method.state_dict()
    assert list(state) == ["_extra_state"]  # the keys of before: old checkpoints load
    assert sorted(state["_extra_state"]) == sorted(names + ["var_shape", "n_values"])
    method.double()
    method.to(torch.float32)
    dtypes = {name: buffer.dtype for name, buffer in method.store.named_buffers()}
    assert dtypes["buffer_costs"] == torch.float64 and dtypes["buffer_tokens"] == torch.long
    assert dtypes["buffer_valid"] == torch.bool and dtypes["explored_next"] == torch.long
    method.reset()
    assert method.store.var_shape is None and method.store.n_values == -1
    assert method.store.buffer_tokens.shape == (0, 2, 0)


def test_old_format_state_dict_loads():
    # written by MAPO before MAPOMemory: one '_extra_state' dict with the memory's tensors
    old = {"_extra_state": {
        "var_shape": [], "n_values": 5,
        "buffer_tokens": torch.tensor([[[3], [1]]]), "buffer_costs": torch.tensor([[-1.0, 0.5]], dtype=torch.float64),
        "buffer_valid": torch.tensor([[True, True]]), "explored_tokens": torch.tensor([[[4], [0], [0], [0]]]),
        "explored_valid": torch.tensor([[True, False, False, False]]), "explored_next": torch.tensor([1]),
    }}
    method = MAPO("y", n_samples=3, buffer_size=2, systematic_exploration=True, max_explored=4)
    method.load_state_dict(old)
    assert method.memory()[0].tolist() == [3, 1] and method.memory()[1].tolist() == [-1.0, 0.5]
    assert method.explored().tolist() == [4]
    assert method.store.var_shape == () and method.store.n_values == 5
    y = method(Categorical(logits=torch.zeros(5)))
    assert y._tensor[:2].tolist() == [3, 1] and not bool((y._tensor[2:] == 4).any())
    storch.reset()


def test_pickling_carries_the_memory_also_from_before_the_memory_module():
    method = _explored_method()
    _same_memory(pickle.loads(pickle.dumps(method)), method)
    # a MAPO pickled before MAPOMemory held the tensors as attributes
    state = dict(method.__dict__)
    state["_modules"] = {k: v for k, v in state["_modules"].items() if k != "store"}
    state.update({f"_{old}": getattr(method.store, new).clone() for old, new in [
        ("buf_tokens", "buffer_tokens"), ("buf_costs", "buffer_costs"), ("buf_valid", "buffer_valid"),
        ("exp_tokens", "explored_tokens"), ("exp_valid", "explored_valid"), ("exp_next", "explored_next"),
    ]})
    state.update(_var_shape=method.store.var_shape, _n_values=method.store.n_values)
    old = MAPO.__new__(MAPO)
    old.__setstate__(state)
    _same_memory(old, method)
    assert old.store.var_shape == () and old.store.n_values == 5
