"""Storchastic 0.3.7's forms, run on storch: each is supported as it was, or refused with storch's form.

One section per form a migrating user meets (docs/migrating.md states each one):

* ``storch.is_tensor`` is true for any tensor, as in Storchastic (``storch.is_storch`` for storch tensors).
* ``GumbelEntmax(..., alpha=, adaptive=)``: ``α``-entmax, with ``α`` learned when adaptive.
* ``storch.add_cost(…, "loss")`` in a loop over nodes: one cost per call, as Storchastic summed them;
  a cost left over from a step that raised is still refused.
* Host reads of a tensor that holds several samples are refused, also ``torch.allclose``,
  ``torch.equal`` and use as an index; a single sample reads as its value.
* ``ScoreFunctionWOR``: a second ``method.sample`` on a distribution without the previous step's plate
  is refused with storch's form of a sequence step, which gives the sequence, exactly.
* ``storch.Tensor(t, parents, plates, name)``, Storchastic's constructor.
* ``z.grad`` on sampled tensors warns and names ``z.param_grads``; what ``param_grads`` holds.
* ``UnorderedSetGumbelSoftmax`` on several variables per plate element: refused, with the fixes, which run.
* Every "the same" of the guide's table of Storchastic's names, called in Storchastic's form.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np
import pytest
import torch
from torch.distributions import Bernoulli, Normal, OneHotCategorical

import storch
from storch.exceptions import IllegalStorchExposeError, IllegalStorchIndexError, StaleCostError
from storch.method import (
    Expect,
    GumbelEntmax,
    GumbelSoftmax,
    GumbelSparseMax,
    Infer,
    Reparameterization,
    ScoreFunction,
    UnorderedSetEstimator,
    UnorderedSetGumbelSoftmax,
)
from storch.method.gumbel_sparse import entmax15, sparsemax
from storch.method.score_function_wor import ScoreFunctionWOR
from storch.plate import PlateClashError


# ============================================================================ 1. storch.is_tensor
def test_is_tensor_is_true_for_any_tensor_as_in_storchastic():
    z = ScoreFunction("z", n_samples=2)(Bernoulli(torch.tensor(0.5)))
    assert storch.is_tensor(torch.ones(2)) and storch.is_tensor(z)
    assert not storch.is_tensor(2.0) and not storch.is_tensor([torch.ones(1)])
    assert storch.is_storch(z) and not storch.is_storch(torch.ones(2))


# ============================================================================ 2. GumbelEntmax alpha, adaptive
def _projected(method, logits: torch.Tensor, seed: int = 5) -> torch.Tensor:
    torch.manual_seed(seed)
    return method(OneHotCategorical(logits=logits))._tensor


def _perturbed(logits: torch.Tensor, n: int, seed: int = 5) -> torch.Tensor:
    """The Gumbel-perturbed scores the methods draw with the same seed (``gumbel_perturb``)."""
    from storch.method.gumbel_sparse import gumbel_perturb

    torch.manual_seed(seed)
    return gumbel_perturb(logits, n)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25, 3.0])
def test_gumbel_entmax_alpha_is_alpha_entmax_of_the_perturbed_scores(alpha):
    import entmax

    logits = torch.tensor([[0.3, -0.2, 1.0, 0.0], [1.5, 0.2, -1.0, 0.4]])
    y = _projected(GumbelEntmax("z", n_samples=3, alpha=alpha, initial_temperature=0.7), logits)
    scores = _perturbed(logits, 3) / 0.7
    expected = {1.5: entmax15, 2.0: sparsemax}.get(alpha, lambda s: entmax.entmax_bisect(s, alpha, dim=-1))(scores)
    torch.testing.assert_close(y, expected)
    if alpha in (1.5, 2.0):  # the closed forms are alpha-entmax at those alphas
        torch.testing.assert_close(y, entmax.entmax_bisect(scores, alpha, dim=-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.sum(-1), torch.ones(3, 2))


def test_gumbel_entmax_adaptive_starts_at_alpha_and_learns_it():
    method = GumbelEntmax("z", n_samples=2, adaptive=True)  # Storchastic's form
    assert [name for name, _ in method.named_parameters()] == ["alpha"]
    torch.testing.assert_close(method.entmax_alpha(), torch.tensor(1.5))
    logits = torch.tensor([0.3, -0.2, 1.0, 0.0])
    torch.testing.assert_close(_projected(method, logits), entmax15(_perturbed(logits, 2)), atol=1e-5, rtol=0)
    theta = logits.clone().requires_grad_(True)
    z = method(OneHotCategorical(logits=theta))
    storch.add_cost(((z * torch.arange(4.0)).sum(-1) - 1.0) ** 2, "f")
    storch.backward()
    assert method.alpha.grad is not None and torch.isfinite(method.alpha.grad) and method.alpha.grad != 0
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1)
    before = method.entmax_alpha().item()
    optimizer.step()
    assert method.entmax_alpha().item() != before and method.entmax_alpha().item() > 1.0


def test_gumbel_entmax_adaptive_alpha_gradient_is_the_pathwise_derivative():
    """d/dρ of the step's estimate with the Gumbel noise held fixed, by central differences."""
    logits = torch.tensor([[0.3, -0.2, 1.0, 0.0], [1.5, 0.2, -1.0, 0.4]], dtype=torch.float64)
    values = torch.tensor([0.0, 1.0, 3.0, -2.0], dtype=torch.float64)

    def estimate(method: GumbelEntmax) -> torch.Tensor:
        torch.manual_seed(3)
        z = method(OneHotCategorical(logits=logits))
        storch.add_cost(((z * values).sum(-1) - 0.5).pow(2).sum(-1), "f")
        return storch.backward()

    method = GumbelEntmax("z", n_samples=4, alpha=1.7, adaptive=True, initial_temperature=0.8).double()
    estimate(method)
    grad = method.alpha.grad.item()
    eps = 1e-4
    with torch.no_grad():
        method.alpha += eps
    up = estimate(method).item()
    with torch.no_grad():
        method.alpha -= 2 * eps
    down = estimate(method).item()
    assert abs(grad) > 1e-3
    assert abs(grad - (up - down) / (2 * eps)) < 1e-4 * max(1.0, abs(grad))


def test_gumbel_entmax_refuses_alpha_at_most_one():
    with pytest.raises(ValueError, match=r"GumbelEntmax\('z'\): alpha must be above 1.*GumbelSoftmax"):
        GumbelEntmax("z", alpha=1.0)


# ============================================================================ 3. one cost name, many costs
P = torch.tensor([0.3, 0.6, 0.8])
V = torch.tensor([1.0, -2.0, 0.5])


def _loop_over_nodes(p: torch.Tensor, names) -> None:
    """Storchastic's loop: one node per variable, a cost per node, under the names given."""
    for i, name in enumerate(names):
        z = Expect(f"z{i}")(Bernoulli(p[i]))
        storch.add_cost(V[i] * (z - 0.25 * i) ** 2, name)


def test_a_cost_name_given_in_a_loop_adds_a_cost_per_call_as_storchastic_summed_them():
    p = P.clone().requires_grad_(True)
    _loop_over_nodes(p, ["loss"] * 3)
    assert [c.name for c in storch.registered_costs()] == ["loss", "loss#2", "loss#3"]
    total = storch.backward()
    # exact: E[(z − c)²] = p (1 − c)² + (1 − p) c², summed over the nodes
    c = 0.25 * torch.arange(3.0)
    exact = (V * (P * (1 - c) ** 2 + (1 - P) * c**2)).sum()
    torch.testing.assert_close(total, exact)
    torch.testing.assert_close(p.grad, V * ((1 - c) ** 2 - c**2))
    # the same as three names
    q = P.clone().requires_grad_(True)
    _loop_over_nodes(q, ["a", "b", "c"])
    storch.backward()
    torch.testing.assert_close(p.grad, q.grad)


def _failing_step(fail: bool) -> torch.Tensor:
    p = P.clone().requires_grad_(True)
    for i in range(2):
        z = ScoreFunction(f"z{i}", n_samples=3)(Bernoulli(p[i]))
        storch.add_cost(V[i] * z, "loss")
        if fail and i == 0:
            raise RuntimeError("the model failed after its first cost")
    storch.backward()
    return p.grad


def test_a_cost_left_over_from_a_failed_step_is_still_refused_under_a_repeated_name():
    with pytest.raises(RuntimeError, match="first cost"):
        _failing_step(fail=True)
    with pytest.raises(StaleCostError, match=r"'loss', 'loss#2', 'loss#3'.*named 'z0'.*storch.reset\(\)"):
        _failing_step(fail=False)
    assert storch.registered_costs() == ()
    grad = _failing_step(fail=False)  # the registry was cleared: the next step is right
    assert grad.shape == (3,) and grad[2] == 0


# ============================================================================ 4. host reads
READS = {
    "bool": bool,
    "int": int,
    "float": float,
    "complex": complex,
    "item": lambda t: t.item(),
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "np.asarray": np.asarray,
    "in": lambda t: 1.0 in t,
    "torch.allclose": lambda t: torch.allclose(t, t),
    "torch.equal": lambda t: torch.equal(t, t),
    "Tensor.allclose": lambda t: t.allclose(torch.ones(())),
    "Tensor.equal": lambda t: t.equal(t),
    "torch.is_nonzero": torch.is_nonzero,
    "range": lambda t: range(t.long()),
    "operator.index": lambda t: operator.index(t.long()),
    "slice": lambda t: [1, 2, 3][t.long():],
}


def _samples(n: int) -> storch.Tensor:
    return ScoreFunction("s", n_samples=n)(Bernoulli(torch.tensor(1.0)))


@pytest.mark.parametrize("read", READS)
def test_a_host_read_of_several_samples_is_refused_naming_the_node(read):
    s = _samples(2)
    with pytest.raises(IllegalStorchExposeError, match=r"plates 's' \(size 2\)\. Reduce them first.*reduce_plates"):
        READS[read](s)


@pytest.mark.parametrize("read", ["range", "operator.index", "slice"])
def test_an_index_of_several_samples_is_also_a_type_error(read):
    with pytest.raises(TypeError) as caught:
        READS[read](_samples(2))
    assert isinstance(caught.value, IllegalStorchIndexError)


@pytest.mark.parametrize("read", READS)
def test_a_host_read_of_a_single_sample_is_its_value(read):
    one = _samples(1)
    value = READS[read](one)
    plain = READS[read](one._tensor)
    if isinstance(value, np.ndarray):
        np.testing.assert_array_equal(value, plain)
    else:
        assert value == plain


# ============================================================================ 5. ScoreFunctionWOR sequences
L1 = torch.tensor([0.4, -0.3, 0.1])
L2 = torch.tensor([-0.2, 0.5, 0.0])
F = torch.tensor([[0.0, 1.0, 4.0], [2.0, -1.0, 0.5], [1.5, 3.0, -2.0]])  # f(first token, second token)


def test_a_second_sample_call_without_the_previous_plate_is_refused_with_storchs_form():
    m = ScoreFunctionWOR("z", 3, biased=True, use_baseline=False)
    z1 = m.sample(OneHotCategorical(logits=L1))
    z2 = m.sample(OneHotCategorical(logits=L2))  # Storchastic 0.3.7: step 2 of z1's beam
    with pytest.raises(PlateClashError, match=r"same ScoreFunctionWOR\('z'\).*storch.expand_as\(logits, z_prev\)"):
        z1 + z2


def test_storchs_form_of_the_sequence_is_exact_when_the_beam_holds_every_sequence():
    l1, l2 = L1.clone().requires_grad_(True), L2.clone().requires_grad_(True)
    m = ScoreFunctionWOR("z", 9, biased=True, use_baseline=False)
    z1 = m.sample(OneHotCategorical(logits=l1))
    z2 = m.sample(OneHotCategorical(logits=storch.expand_as(l2, z1)))
    assert tuple(z2.shape) == (9, 3) and z2.plates[0] is (z1 + z2).plates[0]
    pairs = torch.stack([z1.argmax(-1), z2.argmax(-1)], -1)._tensor.tolist()
    assert sorted(map(tuple, pairs)) == list(itertools.product(range(3), range(3)))  # every sequence once
    cost = (z1.unsqueeze(-1) * z2.unsqueeze(-2) * F).sum((-1, -2))
    storch.add_cost(cost, "f")
    estimate = storch.backward()
    e1, e2 = L1.clone().requires_grad_(True), L2.clone().requires_grad_(True)
    exact = (e1.softmax(-1)[:, None] * e2.softmax(-1)[None, :] * F).sum()
    exact.backward()
    torch.testing.assert_close(estimate, exact.detach())
    torch.testing.assert_close(l1.grad, e1.grad)
    torch.testing.assert_close(l2.grad, e2.grad)


# ============================================================================ 6. the constructor
def test_storchastics_tensor_constructor_is_taken():
    t = storch.Tensor(torch.ones(2), [], [], "test")  # Storchastic's (data, parents, plates, name)
    assert type(t) is storch.Tensor and t.plates == [] and torch.equal(t._tensor, torch.ones(2))
    z = ScoreFunction("z", n_samples=3)(Bernoulli(torch.tensor(0.5)))
    u = storch.Tensor(z._tensor * 2, [z], z.plates, "double")
    assert u.plate_names == ["z"] and torch.equal((u - 2 * z)._tensor, torch.zeros(3))
    c = storch.CostTensor(torch.ones(()), [], [], "cost")
    assert c.name == "cost" and c.plates == []
    with pytest.raises(TypeError, match=r"Storchastic's form storch.Tensor\(data, parents, plates, name\)"):
        storch.Tensor(torch.ones(2), [], [])
    with pytest.raises(TypeError, match="parents must be tensors"):
        storch.Tensor(torch.ones(2), ["x"], [], "test")


# ============================================================================ 7. z.grad, param_grads
def test_reading_grad_of_a_sampled_tensor_warns_and_names_param_grads():
    u = torch.tensor([0.2, 0.3, 0.5], requires_grad=True)
    z = Expect("z")(OneHotCategorical(probs=u))
    storch.add_cost((z * torch.tensor([0.0, 1.0, 2.0])).sum(-1), "f")
    storch.backward()
    with pytest.warns(UserWarning, match=r"node 'z'.*z.param_grads \(keys \['probs'\]\)"):
        assert z.grad is None
    # what Storchastic's z.grad["probs"] held: the gradient with respect to the tensor passed (u)
    torch.testing.assert_close(u.grad, torch.tensor([-1.3, -0.3, 0.7]))
    # storch's: with respect to torch's normalised probs p, as free coordinates: f(x) itself
    torch.testing.assert_close(z.param_grads["probs"], torch.tensor([0.0, 1.0, 2.0]))
    # they differ by a multiple of (1, 1, 1): the same gradient on the simplex
    torch.testing.assert_close(z.param_grads["probs"] - (u * z.param_grads["probs"]).sum(), u.grad)


def test_grad_of_a_sampled_tensor_is_torchs_when_retained():
    mu = torch.tensor(0.5, requires_grad=True)
    x = Reparameterization("x", n_samples=3)(Normal(mu, 1.0))
    x.retain_grad()
    storch.add_cost(x * 2.0, "f")
    storch.backward()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0 / 3))
    x.grad = None
    with pytest.warns(UserWarning, match="param_grads"):
        assert x.grad is None


# ============================================================================ 8. several variables per element
def test_unordered_set_gumbel_softmax_on_twenty_variables_names_the_fixes_which_run():
    x = storch.denote_independent(torch.randn(4, 5), 0, "data")
    w = torch.randn(5, 200, requires_grad=True)

    def q():
        return OneHotCategorical(logits=(x @ w).unflatten(-1, (20, 10)))  # the discrete VAE's 20 × 10

    with pytest.raises(ValueError, match=(
        r"GumbelSoftmaxWOR\('z'\) \(the sampler of UnorderedSetGumbelSoftmax\): OneHotCategorical has \(20,\) "
        r"variables per plate element.*10\^20.*UnorderedSetEstimator\(name, k=3\).*GumbelSoftmax\(name, n_samples=3\)"
    )):
        UnorderedSetGumbelSoftmax("z", k=3)(q())
    storch.reset()
    for method in (UnorderedSetEstimator("z", k=3), GumbelSoftmax("z", n_samples=3)):
        z = method(q())
        assert z.plate_names == ["z", "data"] and tuple(z.shape) == (3, 4, 20, 10)
        storch.add_cost((z * torch.arange(10.0)).sum((-1, -2)), "f")
        storch.backward()
        assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
        w.grad = None


# ============================================================================ the guide's "the same"
def test_storchastics_names_of_the_guides_table_run_in_storchastics_form():
    p = torch.tensor([0.3, 0.6], requires_grad=True)
    # IllegalStorchExposeError: the same class at both paths, a ValueError as torch's own
    assert storch.IllegalStorchExposeError is storch.exceptions.IllegalStorchExposeError
    assert issubclass(storch.IllegalStorchExposeError, ValueError)
    # GumbelSparseMax and GumbelEntmax with Storchastic's keywords
    for method in (
        GumbelSparseMax("a", sampling_method=None, n_samples=2, straight_through=False, initial_temperature=1.0,
                        min_temperature=1e-4, annealing_rate=0.0),
        GumbelEntmax("b", sampling_method=None, alpha=1.5, adaptive=False, n_samples=2, straight_through=True,
                     initial_temperature=1.0, min_temperature=1e-4, annealing_rate=0.0),
    ):
        z = method(Bernoulli(p))
        assert tuple(z.shape) == (2, 2)
    # detach_tensor
    z = ScoreFunction("c", n_samples=2)(Bernoulli(p))
    assert type(z.detach_tensor()) is torch.Tensor and not z.detach_tensor().requires_grad
    # Infer(name, distribution_type, sampling_method, n), positionally
    y = Infer("d", Normal, None, 4)(Normal(p, 1.0))
    assert tuple(y.shape) == (4, 2)
    # ScoreFunctionWOR(name, k, biased, use_baseline), positionally
    s = ScoreFunctionWOR("e", 2, True, True)(OneHotCategorical(logits=p))
    storch.add_cost((s * torch.tensor([1.0, 3.0])).sum(-1), "g")
    storch.add_cost((z + y.mean(-1, keepdim=True)).sum(-1), "h")
    # backward's keywords, and param_grads' key
    storch.backward(debug=False, create_graph=False, update_estimator_params=True)
    assert "logits" in s.param_grads and "probs" in z.param_grads


def test_plates_are_ordered_newest_first():
    a = Reparameterization("p", n_samples=2)(Normal(torch.zeros(1), 1.0))
    b = Reparameterization("q", n_samples=3)(Normal(torch.zeros(1), 1.0))
    assert (a + b).plate_names == ["q", "p"] and tuple((a + b).shape) == (3, 2, 1)
    assert (b + a).plate_names == ["q", "p"]  # the order of creation, not of the operands


def test_gumbel_entmax_positional_arguments_are_storchs():
    method = GumbelEntmax("z", None, 2)  # Storchastic: alpha=2 (sparsemax); storch: n_samples=2
    assert method.n_samples == 2 and method.alpha == 1.5 and not method.adaptive
    with pytest.raises(TypeError):
        GumbelEntmax("z", None, 1.5, True, 3)  # alpha as n_samples: not a count
