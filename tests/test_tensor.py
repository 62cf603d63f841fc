"""storch tensor classes and plates: types, attributes, conversions, display."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Normal, OneHotCategorical

import storch
from storch.method import Expect, Reparameterization, ScoreFunction
from storch.plate import Plate, PlateClashError
from storch.tensor import CostTensor, IndependentTensor, StochasticTensor


# ----------------------------------------------------------------------------- classes


def test_storch_tensor_is_a_torch_tensor_subclass():
    assert issubclass(storch.Tensor, torch.Tensor)
    for cls in (StochasticTensor, CostTensor, IndependentTensor):
        assert issubclass(cls, storch.Tensor)
    t = storch.Tensor(torch.ones(3, 2), [Plate("a", 3)])
    assert isinstance(t, torch.Tensor)
    assert torch.is_tensor(t)
    assert t.plate_names == ["a"]
    assert t.event_shape == torch.Size([2])


def test_tensor_constructor_checks_plate_sizes():
    with pytest.raises(ValueError, match="leftmost"):
        storch.Tensor(torch.ones(2, 3), [Plate("a", 3)])
    with pytest.raises(TypeError):
        storch.Tensor([1.0, 2.0], [])


def test_tensor_constructor_does_not_retype_its_input():
    data = torch.ones(3)
    t = storch.Tensor(data, [Plate("a", 3)])
    assert type(data) is torch.Tensor
    assert type(t) is storch.Tensor
    assert t.data_ptr() == data.data_ptr()  # a view, no copy


def test_stochastic_tensor_attributes():
    mu = torch.zeros(2, requires_grad=True)
    distr = Normal(mu, 1.0)
    method = ScoreFunction("z", n_samples=5)
    z = method(distr)
    assert type(z) is StochasticTensor
    assert z.stochastic() and not z.is_cost()
    assert z.name == "z"
    assert z.n == 5
    assert z.distribution is distr
    assert z.method is method
    assert z.shape == (5, 2)
    assert z.plate_names == ["z"]
    assert z.plate.name == "z" and z.plate.size == 5 and z.plate.node is not None
    assert z.param_grads == {}


def test_stochastic_tensor_cannot_be_built_by_hand():
    with pytest.raises(TypeError, match="storch.method"):
        StochasticTensor(torch.ones(3))


def test_param_grads_filled_after_backward():
    mu = torch.tensor([0.5, -1.0], requires_grad=True)
    z = Reparameterization("z", n_samples=4)(Normal(mu, 1.0))
    storch.add_cost((z * z).sum(-1), "f")
    storch.backward()
    assert set(z.param_grads) == {"loc"}
    # d/dmu E[sum z^2] estimated by mean over samples of 2 z
    expected = (2 * z._tensor.detach()).mean(0)
    torch.testing.assert_close(z.param_grads["loc"], expected)
    torch.testing.assert_close(mu.grad, expected)


def test_param_grads_of_one_hot_categorical_probs():
    probs = torch.tensor([0.2, 0.3, 0.5], requires_grad=True)
    z = Expect("z")(OneHotCategorical(probs=probs))
    storch.add_cost((z * torch.tensor([1.0, 2.0, 4.0])).sum(-1), "f")
    storch.backward()
    assert "probs" in z.param_grads
    # E f = sum_k p_k f_k  =>  d/dp_k = f_k
    torch.testing.assert_close(z.param_grads["probs"], torch.tensor([1.0, 2.0, 4.0]))


def test_cost_tensor_from_add_cost():
    x = storch.denote_independent(torch.tensor([1.0, 2.0]), 0, "data")
    storch.add_cost(x * 3, "triple")
    (c,) = storch.registered_costs()
    assert type(c) is CostTensor
    assert c.is_cost() and not c.stochastic()
    assert c.name == "triple"
    assert c.plate_names == ["data"]
    torch.testing.assert_close(c._tensor, torch.tensor([3.0, 6.0]))


def test_independent_tensor_types():
    x = storch.denote_independent(torch.randn(4, 3), 0, "data")
    assert type(x) is IndependentTensor
    assert not x.stochastic()
    g = storch.gather_samples([torch.tensor(1.0), torch.tensor(2.0)], "gradients")
    assert type(g) is storch.tensor.IndependentTensor
    assert type(g) is IndependentTensor


def test_denote_independent_moves_dim_left():
    data = torch.arange(24.0).reshape(2, 3, 4)
    x = storch.denote_independent(data, 1, "data")
    assert x.shape == (3, 2, 4)
    assert x.plate_names == ["data"]
    torch.testing.assert_close(x._tensor, data.movedim(1, 0))
    with pytest.raises(ValueError, match="already"):
        storch.denote_independent(x, 1, "data")
    with pytest.raises(ValueError, match="already plate"):
        storch.denote_independent(x, 0, "other")


def test_results_of_ops_are_plain_storch_tensors():
    z = ScoreFunction("z", n_samples=3)(Normal(torch.zeros(2), 1.0))
    y = z * 2 + 1
    assert type(y) is storch.Tensor
    assert y.plates == z.plates
    assert not y.stochastic()


# ------------------------------------------------------------------------------ plates


def test_plate_attributes_and_repr():
    p = Plate("gradients", 1000)
    assert repr(p) == "('gradients', 1000, tensor(0.0010))"
    assert p.name == "gradients" and p.size == 1000
    torch.testing.assert_close(p.weight, torch.tensor(0.001))
    assert p.parents == ()
    assert not p.is_stochastic
    q = Plate("z", 2, parents=[p])
    assert q.parents == (p,)


def test_gather_samples_plate_repr_like_the_manual():
    g = storch.gather_samples([torch.tensor(float(i)) for i in range(1000)], "gradients")
    assert repr(g.plates) == "[('gradients', 1000, tensor(0.0010))]"


def test_plate_validation():
    with pytest.raises(ValueError):
        Plate("a", 0)
    with pytest.raises(TypeError):
        Plate("", 3)


def test_independent_plates_compare_by_name_and_size_node_plates_by_identity():
    assert Plate("data", 3) == Plate("data", 3)
    assert Plate("data", 3) != Plate("data", 4)
    z1 = ScoreFunction("z", n_samples=3)(Normal(0.0, 1.0))
    z2 = ScoreFunction("z", n_samples=3)(Normal(0.0, 1.0))
    assert z1.plate == z1.plate
    assert z1.plate != z2.plate


def test_nested_node_plate_parents():
    z1 = ScoreFunction("z1", n_samples=3)(Normal(torch.zeros(2), 1.0))
    z2 = ScoreFunction("z2", n_samples=4)(Normal(z1, 1.0))
    assert z2.plate.parents == (z1.plate,)
    assert z2.plate_names == ["z2", "z1"]
    assert z2.shape == (4, 3, 2)


def test_plate_with_tensor_weight_has_finite_repr():
    # Expect's plate weight is a storch tensor that carries the plate itself.
    x = Expect("x")(Bernoulli(torch.tensor([0.2, 0.5])))
    r = repr(x.plate)
    assert r.startswith("('x', 4, tensor([")
    assert "0.4000" in r and "0.1000" in r
    assert "plates: [('x', 4" in repr(x)


def test_weights_of_expect_are_probabilities():
    p = torch.tensor([0.2, 0.5])
    x = Expect("x")(Bernoulli(p))
    w = x.plate.weight
    expected = torch.tensor([0.8 * 0.5, 0.8 * 0.5, 0.2 * 0.5, 0.2 * 0.5])
    torch.testing.assert_close(w._tensor, expected)
    torch.testing.assert_close(x._tensor, torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]))


# ------------------------------------------------------------------------- conversions


def test_bool_item_tolist_on_multi_sample_tensor_raise_naming_the_plate():
    z = ScoreFunction("z", n_samples=3)(Normal(0.0, 1.0))
    for convert in (bool, float, int, lambda t: t.item(), lambda t: t.tolist()):
        with pytest.raises(ValueError, match="'z' \\(size 3\\)"):
            convert(z)
    with pytest.raises(ValueError, match="reduce_plates"):
        if z > 0:  # noqa: SIM108 - implicit bool()
            pass


def test_bool_item_tolist_allowed_on_size_one_plates():
    z = ScoreFunction("z", n_samples=1)(Normal(0.0, 1.0))
    x = storch.denote_independent(torch.tensor([2.0]), 0, "data")
    y = z * 0 + x
    assert sorted(y.plate_names) == ["data", "z"]
    assert y.item() == 2.0
    assert float(y) == 2.0
    assert bool(y > 1.0)
    assert y.tolist() == [[2.0]]
    assert z.tolist() == [z._tensor.item()]


def test_torchs_conversion_warning_points_at_the_callers_line():
    """float() of a tensor that requires grad warns in torch; the warning names the user's line,
    not storch's conversion wrapper."""
    mu = torch.tensor(0.5, requires_grad=True)
    x = Reparameterization("x", n_samples=1)(Normal(mu, 1.0))
    with pytest.warns(UserWarning, match="requires_grad=True to a scalar") as record:
        float(x * 1.0)
    assert [w.filename for w in record] == [__file__]


def test_conversions_without_plates_work_normally():
    t = storch.Tensor(torch.tensor([1.0, 2.0]))
    assert t.tolist() == [1.0, 2.0]
    assert t.sum().item() == 3.0


def test_raw_tensor_view():
    z = ScoreFunction("z", n_samples=3)(Normal(torch.zeros(2), 1.0))
    raw = z._tensor
    assert type(raw) is torch.Tensor
    assert raw.shape == (3, 2)
    assert raw.data_ptr() == z.data_ptr()


def test_repr_mentions_kind_and_plates():
    z = ScoreFunction("z", n_samples=2)(Normal(0.0, 1.0))
    assert repr(z).startswith("Stochastic tensor(")
    assert "plates: [('z', 2, tensor(0.5000))]" in repr(z)
    y = z * 1
    assert repr(y).startswith("Deterministic tensor(")
    x = storch.denote_independent(torch.ones(2), 0, "data")
    assert repr(x).startswith("Independent tensor(")


def test_storch_tensors_cannot_be_pickled():
    import pickle

    z = ScoreFunction("z", n_samples=2)(Normal(0.0, 1.0))
    with pytest.raises(TypeError, match=r"t\.plain\(\)"):
        pickle.dumps(z)


def test_plate_name_clash_between_two_nodes_raises_naming_both():
    z1 = ScoreFunction("z", n_samples=3)(Normal(torch.zeros(2), 1.0))
    z2 = ScoreFunction("z", n_samples=3)(Normal(torch.zeros(2), 1.0))
    with pytest.raises(PlateClashError, match="'z'") as info:
        z1 + z2
    assert isinstance(info.value, ValueError)
    assert str(info.value).count("stochastic node 'z'") == 2


def test_node_cannot_reuse_a_parent_plate_name():
    z1 = ScoreFunction("z", n_samples=3)(Normal(torch.zeros(2), 1.0))
    with pytest.raises(ValueError, match="already carry a plate named 'z'"):
        ScoreFunction("z", n_samples=2)(Normal(z1, 1.0))


def test_minibatch_plates_of_the_same_name_and_size_merge():
    a = storch.denote_independent(torch.ones(4, 2), 0, "data")
    b = storch.denote_independent(torch.full((4, 2), 2.0), 0, "data")
    c = a + b
    assert c.plate_names == ["data"]
    assert c.shape == (4, 2)
    d = storch.denote_independent(torch.ones(5, 2), 0, "data")
    with pytest.raises(PlateClashError):
        a + d


def _elbo_gradients(monkeypatch, own: bool, grad_mode_for_log_q: bool = True) -> tuple[list[torch.Tensor], int]:
    """The gradient of a one-layer SBN's negative ELBO by the score function, with ``log q(z)`` written
    as ``z.log_prob()`` (``own``) or ``q.log_prob(z)``; and how many Bernoulli log-probabilities the
    step computed (calls of ``Bernoulli.log_prob``'s ``binary_cross_entropy_with_logits``)."""
    from torch.distributions import bernoulli

    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return torch.nn.functional.binary_cross_entropy_with_logits(*args, **kwargs)

    monkeypatch.setattr(bernoulli, "binary_cross_entropy_with_logits", counted)
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(6, 3), torch.nn.Linear(3, 6)
    x = storch.denote_independent((torch.rand(4, 6) < 0.5).float(), 0, "data")
    q = Bernoulli(logits=enc(x))
    z = ScoreFunction("z", n_samples=2)(q)
    with torch.set_grad_enabled(grad_mode_for_log_q):
        log_q = (z.log_prob() if own else q.log_prob(z)).sum(-1)
    if not grad_mode_for_log_q:
        log_q = q.log_prob(z).sum(-1)
    log_px = Bernoulli(logits=dec(z)).log_prob(x).sum(-1)
    storch.add_cost(log_q - log_px, "neg_elbo")
    storch.backward()
    return [p.grad for p in (*enc.parameters(), *dec.parameters())], len(calls)


def test_own_log_prob_equals_the_distributions_and_is_shared_with_the_surrogate(monkeypatch):
    """``z.log_prob()`` has the values and plates of ``q.log_prob(z)``; the score function reuses it
    (one log q per step instead of two) and the gradients are the same."""
    q = Bernoulli(logits=torch.tensor([[0.3, -1.2]], requires_grad=True))
    z = ScoreFunction("z", n_samples=3)(q)
    own, theirs = z.log_prob(), q.log_prob(z)
    assert own.plate_names == theirs.plate_names == ["z"]
    assert torch.equal(own._tensor, theirs._tensor)
    storch.reset()
    (shared, n_shared), (separate, n_separate) = _elbo_gradients(monkeypatch, True), _elbo_gradients(monkeypatch, False)
    for a, b in zip(shared, separate, strict=True):
        torch.testing.assert_close(a, b)
    assert (n_shared, n_separate) == (2, 3)  # log p(x|z) and one log q(z) / also the surrogate's log q(z)


def test_own_log_prob_taken_without_gradients_is_not_reused(monkeypatch):
    """Taken under ``torch.no_grad()`` (for logging, say) it has no graph: the surrogate computes its own."""
    gradients, calls = _elbo_gradients(monkeypatch, True, grad_mode_for_log_q=False)
    reference, _ = _elbo_gradients(monkeypatch, False)
    for a, b in zip(gradients, reference, strict=True):
        torch.testing.assert_close(a, b)
    assert calls == 4  # the logged log q, the model's log q and log p(x|z), the surrogate's log q


def test_own_log_prob_written_in_place_is_not_reused():
    """A user who scales ``z.log_prob()`` in place changes their cost, not the estimator's ``log q``:
    the surrogate computes its own, and the gradient is the one of the scaled cost."""
    logits = torch.tensor([0.4, -0.3], requires_grad=True)

    def gradient(in_place: bool) -> torch.Tensor:
        logits.grad = None
        torch.manual_seed(3)
        z = ScoreFunction("z", n_samples=4)(Bernoulli(logits=logits))
        log_q = z.log_prob()
        if in_place:
            log_q.mul_(2.0)
        else:
            log_q = 2.0 * log_q
        storch.add_cost(log_q.sum(-1), "c")
        storch.backward()
        return logits.grad.clone()

    torch.testing.assert_close(gradient(in_place=True), gradient(in_place=False))


def test_own_log_prob_hands_out_new_objects():
    """The object ``z.log_prob()`` returns is the caller's: storch never retypes it (a cost built
    from it stays a storch tensor after the surrogate loss is formed)."""
    z = ScoreFunction("z", n_samples=2)(Normal(torch.tensor(0.5, requires_grad=True), 1.0))
    first, second = z.log_prob(), z.log_prob()
    assert first is not second and torch.equal(first._tensor, second._tensor)
    storch.add_cost(first, "c")
    storch.backward()
    assert isinstance(first, storch.Tensor) and first.plate_names == ["z"]


def test_own_log_prob_skips_the_support_check_of_the_nodes_own_samples(monkeypatch):
    """``z.log_prob()`` scores samples drawn from the distribution: torch's support check of them is
    skipped (it costs as much as the log-probability), the values are ``q.log_prob(z)``'s, and a
    value from elsewhere is still checked."""
    checks = []
    original = Bernoulli._validate_sample
    monkeypatch.setattr(Bernoulli, "_validate_sample", lambda self, value: (checks.append(1), original(self, value))[1])
    # validation stated, not torch's process-wide default (an earlier torch.compile in the process turns that off)
    q = Bernoulli(logits=torch.tensor([0.3, -1.2], requires_grad=True), validate_args=True)
    z = ScoreFunction("z", n_samples=3)(q)
    own = z.log_prob()
    assert checks == []
    assert torch.equal(own._tensor, q.log_prob(z)._tensor) and checks == [1]
    with pytest.raises(ValueError, match="support"):
        q.log_prob(torch.full((2,), 0.5))
    storch.reset()
