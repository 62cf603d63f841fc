"""Gradient-estimation methods: errors, Infer, GumbelSoftmax, baselines, param_grads, and a
user-written estimator (the manual's ScoreFunctionLOO)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical, Poisson

import storch
from score_function_loo import ScoreFunctionLOO
from storch.method import Expect, GumbelSoftmax, Infer, Method, Reparameterization, ScoreFunction
from storch.method.baseline import BatchAverageBaseline, MovingAverageBaseline
from storch.sampling import Enumerate, MonteCarlo

# ------------------------------------------------------------------------------ errors


def test_reparameterization_without_rsample_raises():
    with pytest.raises(ValueError, match="Bernoulli has no rsample") as info:
        Reparameterization("b")(Bernoulli(0.3))
    assert "ScoreFunction" in str(info.value)


def test_expect_on_continuous_distribution_raises():
    with pytest.raises(ValueError, match="Normal has no finite support"):
        Expect("e")(Normal(0.0, 1.0))
    with pytest.raises(ValueError, match="Poisson has no finite support"):
        Expect("e")(Poisson(torch.tensor(2.0)))


def test_expect_past_budget_raises():
    with pytest.raises(ValueError, match=r"2\^5 = 32 joint configurations, more than the budget of 10") as info:
        Expect("b", budget=10)(Bernoulli(torch.full((5,), 0.3)))
    assert "budget=" in str(info.value)
    # within budget it works
    assert Expect("b", budget=32)(Bernoulli(torch.full((5,), 0.3))).shape == (32, 5)


def test_gumbel_softmax_on_unsupported_distributions_raises():
    with pytest.raises(ValueError, match="no relaxation for Normal"):
        GumbelSoftmax("g")(Normal(0.0, 1.0))
    with pytest.raises(ValueError, match="Use OneHotCategorical instead of Categorical"):
        GumbelSoftmax("g")(Categorical(logits=torch.zeros(3)))


def test_batch_average_with_one_sample_raises_not_nan():
    with pytest.raises(ValueError, match="at least 2 samples") as info:
        ScoreFunction("z", n_samples=1, baseline_factory="batch_average")
    assert "'z'" in str(info.value)
    with pytest.raises(ValueError, match="at least 2 samples"):
        BatchAverageBaseline().check_samples(1, "z")


def test_batch_average_with_one_sample_via_sampling_method_raises_at_backward():
    method = ScoreFunction("z", sampling_method=MonteCarlo("z", 1), baseline_factory="batch_average")
    p = torch.tensor(0.5, requires_grad=True)
    z = method(Bernoulli(p))
    storch.add_cost(z * 1.0, "c")
    with pytest.raises(ValueError, match="at least 2 samples"):
        storch.backward()
    assert p.grad is None or torch.isfinite(p.grad).all()
    assert storch.registered_costs() == ()


def test_method_called_with_non_distribution_raises_type_error():
    for method in (ScoreFunction("z"), Reparameterization("z"), Expect("z"), Infer("z"), GumbelSoftmax("z")):
        with pytest.raises(TypeError, match="Distribution"):
            method(torch.zeros(3))


def test_method_needs_a_plate_name():
    with pytest.raises(TypeError, match="plate name"):
        ScoreFunction(Normal(0.0, 1.0))


def test_unknown_baseline_and_bad_sample_count():
    with pytest.raises(ValueError, match="Unknown baseline"):
        ScoreFunction("z", n_samples=2, baseline_factory="nope")
    with pytest.raises(ValueError, match="at least 1"):
        MonteCarlo("z", 0)
    with pytest.raises(ValueError, match="positive"):
        GumbelSoftmax("g", initial_temperature=0.0)


def test_proposal_with_wrong_shape_raises():
    class BadProposal(Method):
        def proposal_dist(self, distr, amt_samples):
            return distr.sample((amt_samples,)).sum(-1)

    with pytest.raises(ValueError, match="proposal returned samples of shape"):
        BadProposal("z", n_samples=2)(Normal(torch.zeros(3), 1.0))


@pytest.mark.parametrize("make", [
    lambda d, n: d.sample(),  # no sample dimension: a 0-d tensor of a scalar distribution
    lambda d, n: d.sample((n,))[:, 0],  # a dimension missing
    lambda d, n: d.sample((n,)).unsqueeze(-1),  # a dimension too many
    lambda d, n: d.sample((n,))[:, :2],  # the right number of dimensions, a wrong size
])
def test_proposal_check_names_every_wrong_shape(make):
    """The samples' shape check (compared as sizes, no tuples built per draw) still refuses each wrong
    shape with its message, for scalar and batched distributions alike."""

    class BadProposal(Method):
        def proposal_dist(self, distr, amt_samples):
            return make(distr, amt_samples)

    for d in (Normal(torch.zeros(3, 2), 1.0), Normal(torch.tensor(0.0), 1.0)):
        expected = tuple(d.batch_shape)
        try:
            bad = make(d, 2)
        except IndexError:  # a scalar distribution has no dimension to drop or slice
            continue
        with pytest.raises(ValueError, match=re.escape(f"= (n, {expected}).")):
            BadProposal("z", n_samples=2)(d)
        assert tuple(bad.shape) != (2, *expected)
    good = ScoreFunction("z", n_samples=2)(Normal(torch.zeros(3, 2), 1.0))  # the right shape passes
    assert good.shape == (2, 3, 2)
    storch.reset()


def test_weighting_function_with_wrong_shape_raises():
    class BadWeights(Method):
        def weighting_function(self, distr, amt_samples):
            return torch.ones(amt_samples + 1)

    with pytest.raises(ValueError, match="one weight per sample"):
        BadWeights("z", n_samples=2)(Normal(0.0, 1.0))


# ------------------------------------------------------------------------------- Infer


def test_infer_picks_the_estimator_by_distribution():
    infer = Infer("z", n_samples=3)
    zn = infer(Normal(torch.zeros(2), 1.0))
    assert type(zn.method) is Reparameterization
    zb = infer(Bernoulli(torch.full((2,), 0.5)))
    assert type(zb.method) is ScoreFunction
    assert isinstance(zb.method.baseline, BatchAverageBaseline)
    assert isinstance(Infer("z", n_samples=1).score_function.baseline, MovingAverageBaseline)


def _normal_grad(method, seed=11):
    torch.manual_seed(seed)
    c = torch.tensor(0.23, requires_grad=True)
    e = method(Normal(c - 3.0, 1.0))
    storch.add_cost(2.0 * e * e, "f")
    storch.backward()
    return c.grad, e


def test_infer_normal_gradient_is_not_counted_twice():
    g_infer, e_infer = _normal_grad(Infer("e", n_samples=5))
    g_rep, e_rep = _normal_grad(Reparameterization("e", n_samples=5))
    torch.testing.assert_close(e_infer._tensor, e_rep._tensor)  # same samples
    assert torch.equal(g_infer, g_rep)
    # pathwise: d/dc mean(2 e^2) = mean(4 e)
    torch.testing.assert_close(g_rep, (4 * e_rep._tensor.detach()).mean())
    assert torch.equal(e_infer.param_grads["loc"], e_rep.param_grads["loc"])


def _bernoulli_grad(method, seed=12):
    torch.manual_seed(seed)
    theta = torch.tensor([0.2, -0.5], requires_grad=True)
    z = method(Bernoulli(logits=theta))
    storch.add_cost(((z - 0.4) ** 2).sum(-1) + z[..., 0], "f")
    storch.backward()
    return theta.grad


def test_infer_bernoulli_gradient_equals_score_function():
    g_infer = _bernoulli_grad(Infer("z", n_samples=4))
    g_sf = _bernoulli_grad(ScoreFunction("z", n_samples=4, baseline_factory="batch_average"))
    assert torch.equal(g_infer, g_sf)


# -------------------------------------------------------------------------- Score function


def test_score_function_without_baseline_matches_hand_computation():
    torch.manual_seed(3)
    theta = torch.tensor(0.3, requires_grad=True)
    z = ScoreFunction("z", n_samples=6)(Bernoulli(logits=theta))
    f = 4.0 * z + 1.0
    storch.add_cost(f, "f")
    storch.backward()
    x = z._tensor.detach()
    expected = ((4.0 * x + 1.0) * (x - torch.sigmoid(theta.detach()))).mean()
    torch.testing.assert_close(theta.grad, expected)


def test_batch_average_baseline_matches_hand_computation():
    torch.manual_seed(4)
    theta = torch.tensor(-0.2, requires_grad=True)
    z = ScoreFunction("z", n_samples=5, baseline_factory="batch_average")(Bernoulli(logits=theta))
    storch.add_cost(3.0 * z + 2.0, "f")
    storch.backward()
    x = z._tensor.detach()
    f = 3.0 * x + 2.0
    baseline = (f.sum() - f) / 4
    expected = ((f - baseline) * (x - torch.sigmoid(theta.detach()))).mean()
    torch.testing.assert_close(theta.grad, expected)


def test_moving_average_baseline_uses_the_value_from_before_the_batch():
    method = ScoreFunction("z", n_samples=3, baseline_factory=MovingAverageBaseline(0.5))
    baseline = method.baseline
    previous = torch.tensor(0.0)
    history = []
    for step in range(4):
        theta = torch.tensor(0.1 * step, requires_grad=True)
        z = method(Bernoulli(logits=theta))
        f = 5.0 * z + step
        storch.add_cost(f, "f")
        storch.backward()
        x = z._tensor.detach()
        fx = 5.0 * x + step
        # the gradient used the baseline from *before* this batch...
        expected = ((fx - previous) * (x - torch.sigmoid(theta.detach()))).mean()
        torch.testing.assert_close(theta.grad, expected)
        # ... and afterwards the average moved towards this batch's mean cost
        new = fx.mean() if step == 0 else 0.5 * previous + 0.5 * fx.mean()
        torch.testing.assert_close(baseline.averages["f"], new)
        history.append(float(new))
        previous = new
    assert len(set(history)) > 1


def test_score_function_log_prob_summed_over_event_and_batch_dims():
    probs = torch.tensor([[0.2, 0.7], [0.5, 0.4]], requires_grad=True)
    z = ScoreFunction("z", n_samples=3)(Bernoulli(probs))
    lp = storch.method.log_prob(z)
    assert lp.plate_names == ["z"] and lp.shape == (3,)
    torch.testing.assert_close(lp._tensor, Bernoulli(probs).log_prob(z._tensor).sum((1, 2)))


# --------------------------------------------------------------------------------- Expect


def test_expect_enumerates_non_plate_batch_dims_only():
    x = storch.denote_independent(torch.tensor([0.1, 0.5, 0.9]), 0, "xdata")
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    probs = torch.sigmoid(x.unsqueeze(-1) * w)  # plates xdata, event (2,)
    z = Expect("z")(Bernoulli(probs))
    assert z.plate_names[0] == "z" and z.n == 4
    assert z.shape == (4, 3, 2)
    weights = z.plate.weight
    torch.testing.assert_close(storch.sum(weights, "z")._tensor, torch.ones(3))
    storch.add_cost(z[..., 0] + 2 * z[..., 1], "c")
    estimate = storch.backward()
    p = torch.sigmoid(torch.tensor([0.1, 0.5, 0.9])[:, None] * torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(estimate, (p[:, 0] + 2 * p[:, 1]).mean())
    w0 = torch.tensor([1.0, 2.0], requires_grad=True)
    p0 = torch.sigmoid(torch.tensor([0.1, 0.5, 0.9])[:, None] * w0)
    (g,) = torch.autograd.grad((p0[:, 0] + 2 * p0[:, 1]).mean(), w0)
    torch.testing.assert_close(w.grad, g)


def test_enumerate_one_hot_categorical():
    probs = torch.tensor([[0.2, 0.8], [0.6, 0.4]], requires_grad=True)
    z = Expect("z")(OneHotCategorical(probs=probs))
    assert z.shape == (4, 2, 2)
    torch.testing.assert_close(z._tensor.sum(-1), torch.ones(4, 2))
    torch.testing.assert_close(z.plate.weight._tensor.sum(), torch.tensor(1.0))
    assert isinstance(z.method.sampling_method, Enumerate)


# ------------------------------------------------------------------------- GumbelSoftmax


def test_gumbel_softmax_samples():
    logits = torch.tensor([[0.5, -1.0, 0.2]], requires_grad=True)
    z = GumbelSoftmax("g", n_samples=4, initial_temperature=0.7)(OneHotCategorical(logits=logits))
    assert z.shape == (4, 1, 3)
    torch.testing.assert_close(z._tensor.sum(-1), torch.ones(4, 1))
    assert ((z._tensor > 0) & (z._tensor < 1)).all()  # relaxed, not one-hot
    storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0])).sum((-1, -2)), "c")
    storch.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0


def test_gumbel_softmax_straight_through_is_discrete_forward_with_gradient():
    logits = torch.tensor([0.5, -1.0, 0.2], requires_grad=True)
    z = GumbelSoftmax("g", n_samples=5, straight_through=True)(OneHotCategorical(logits=logits))
    vals = z._tensor.detach()
    assert set(vals.unique().tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(vals.sum(-1), torch.ones(5))
    storch.add_cost((z * torch.tensor([1.0, 2.0, 3.0])).sum(-1), "c")
    storch.backward()
    assert logits.grad.abs().sum() > 0
    p = torch.tensor(0.3, requires_grad=True)
    b = GumbelSoftmax("b", n_samples=6, straight_through=True)(Bernoulli(p))
    assert set(b._tensor.detach().unique().tolist()) <= {0.0, 1.0}


def test_gumbel_softmax_temperature_annealing_after_backward():
    method = GumbelSoftmax("g", n_samples=2, initial_temperature=2.0, min_temperature=0.5, annealing_rate=0.3)
    assert float(method.temperature) == 2.0
    for step in range(1, 7):
        logits = torch.zeros(3, requires_grad=True)
        z = method(OneHotCategorical(logits=logits))
        storch.add_cost((z * torch.arange(3.0)).sum(-1), "c")
        storch.backward()
        expected = max(0.5, 2.0 * math.exp(-0.3 * step))
        assert float(method.temperature) == pytest.approx(expected, rel=1e-6)
    assert float(method.temperature) == 0.5
    # no annealing by default
    fixed = GumbelSoftmax("h", n_samples=1, initial_temperature=0.8)
    z = fixed(Bernoulli(torch.tensor(0.5, requires_grad=True)))
    storch.add_cost(z * 1.0, "c")
    storch.backward()
    assert float(fixed.temperature) == pytest.approx(0.8)


# ---------------------------------------------------------------------------- param_grads


def test_param_grads_for_normal_node_with_plated_parameters():
    x = storch.denote_independent(torch.tensor([[1.0, 2.0], [0.5, -1.0], [2.0, 0.0], [-1.0, 1.0]]), 0, "pdata")
    w = torch.tensor([0.5, 1.5], requires_grad=True)
    loc = x * w
    z = Reparameterization("z", n_samples=3)(Normal(loc, 1.0))
    storch.add_cost((z * z).sum(-1), "c")
    storch.backward()
    g = z.param_grads["loc"]
    assert isinstance(g, storch.Tensor)
    assert g.plate_names == ["pdata"] and g.shape == (4, 2)
    # surrogate = mean_data mean_z sum z^2  =>  d/dloc[d] = mean_z 2 z[:, d] / 4
    zz = z._tensor.detach()
    zz = zz if z.plate_names == ["z", "pdata"] else zz.transpose(0, 1)
    torch.testing.assert_close(g._tensor, (2 * zz).mean(0) / 4)
    torch.testing.assert_close(w.grad, (g._tensor * x._tensor).sum(0))


def test_param_grads_are_per_node_and_per_backward():
    mu = torch.tensor(1.0, requires_grad=True)
    method = Reparameterization("z", n_samples=2)
    z1 = method(Normal(mu, 1.0))
    storch.add_cost(z1 * 1.0, "c")
    storch.backward()
    first = z1.param_grads["loc"]
    torch.testing.assert_close(first, torch.tensor(1.0))
    z2 = method(Normal(mu, 1.0))
    assert z2.param_grads == {}
    storch.add_cost(3.0 * z2, "c")
    storch.backward()
    torch.testing.assert_close(z2.param_grads["loc"], torch.tensor(3.0))
    torch.testing.assert_close(z1.param_grads["loc"], torch.tensor(1.0))


def test_param_grad_hooks_do_not_accumulate_on_leaf_parameters():
    # Normal(mu, ...) with a leaf parameter mu (an nn.Parameter used directly) is the common case.
    # A hook left on mu by every sampled node makes each later backward call all of them: the
    # step time grows linearly with the number of training steps, and old nodes' param_grads are
    # overwritten by later backward passes.
    mu = torch.zeros(3, requires_grad=True)
    method = Reparameterization("z", n_samples=2)
    for _ in range(50):
        z = method(Normal(mu, 1.0))
        storch.add_cost((z * z).sum(-1), "c")
        storch.backward()
    hooks = len(mu._backward_hooks or {})
    assert hooks <= 1, f"{hooks} param_grads hooks accumulated on a leaf parameter after 50 steps"


# ------------------------------------------------------------------ a user-written method


def _vae_like(method, seed=21):
    torch.manual_seed(seed)
    data = (torch.rand(5, 6) > 0.5).float()
    enc = torch.nn.Linear(6, 2 * 3)
    dec = torch.nn.Linear(2 * 3, 6)
    x = storch.denote_independent(data, 0, "loo_data")
    logits = enc(x).reshape(x.shape[:-1] + (2, 3))
    q = OneHotCategorical(logits=logits)
    z = method(q)
    recon = torch.sigmoid(dec(z.reshape(z.shape[:-2] + (6,))))
    storch.add_cost(storch.nn.b_binary_cross_entropy(recon, x), "reconstruction")
    prior = OneHotCategorical(probs=torch.ones(3) / 3)
    storch.add_cost(torch.distributions.kl_divergence(q, prior).sum(-1), "kl")
    estimate = storch.backward()
    return estimate, z, [p.grad.clone() for p in enc.parameters()], [p.grad.clone() for p in dec.parameters()]


def test_user_written_loo_estimator_runs_with_finite_gradients():
    estimate, z, enc_grads, dec_grads = _vae_like(ScoreFunctionLOO("z", n_samples=4))
    assert torch.isfinite(estimate)
    assert z.plate_names[0] == "z" and z.n == 4
    assert z.plate.weight.shape == (4,)
    for g in enc_grads + dec_grads:
        assert torch.isfinite(g).all()
    assert any(g.abs().sum() > 0 for g in enc_grads)
    assert "logits" in z.param_grads or "probs" in z.param_grads


def test_user_written_loo_equals_builtin_batch_average():
    est_loo, _, enc_loo, dec_loo = _vae_like(ScoreFunctionLOO("z", n_samples=4))
    est_sf, _, enc_sf, dec_sf = _vae_like(ScoreFunction("z", n_samples=4, baseline_factory="batch_average"))
    torch.testing.assert_close(est_loo, est_sf)
    for a, b in zip(enc_loo + dec_loo, enc_sf + dec_sf):
        torch.testing.assert_close(a, b)


def test_method_is_an_nn_module():
    method = ScoreFunction("z", n_samples=3, baseline_factory="batch_average")
    assert isinstance(method, torch.nn.Module)
    assert "plate_name='z'" in repr(method) and "n_samples=3" in repr(method)
    model = torch.nn.Module()
    model.method = method
    assert any(m is method for m in model.modules())


def test_manual_evaluate_loop_gathers_param_grads():
    """The manual's gradient-variance evaluation: param_grads['probs'] of a VAE-like node over
    repeated backward passes, gathered into a plate, then variance and mean per coordinate."""
    torch.manual_seed(8)
    data = (torch.rand(3, 4) > 0.5).float()
    enc = torch.nn.Linear(4, 2 * 3)
    dec = torch.nn.Linear(2 * 3, 4)

    def generative_story(method):
        x = storch.denote_independent(data, 0, "vae_data")
        q = OneHotCategorical(probs=enc(x).reshape(x.shape[:-1] + (2, 3)).softmax(-1))
        z = method(q)
        prior = OneHotCategorical(probs=torch.ones_like(q.probs) / 3)
        storch.add_cost(torch.distributions.kl_divergence(q, prior).sum(-1), "kl-div")
        recon = dec(z.reshape(z.shape[:-2] + (6,))).sigmoid()
        storch.add_cost(torch.nn.BCELoss(reduction="none")(recon, x).sum(-1), "reconstruction")
        return z

    z = generative_story(Expect("z"))
    storch.backward()
    expected_gradient = z.param_grads["probs"]
    assert expected_gradient.plate_names == ["vae_data"] and expected_gradient.shape == (3, 2, 3)

    gradients = []
    for _ in range(20):
        z = generative_story(ScoreFunction("z", n_samples=4, baseline_factory="batch_average"))
        elbo = storch.backward()
        assert torch.isfinite(elbo)
        gradients.append(z.param_grads["probs"])
    gradients = storch.gather_samples(gradients, "gradients")
    assert gradients.plate_names == ["gradients", "vae_data"]
    var = storch.variance(gradients, "gradients")
    assert var.plates == [] and var.shape == (2, 3)
    assert torch.isfinite(var._tensor).all() and (var._tensor >= 0).all()
    mean_gradient = storch.reduce_plates(gradients, "gradients")
    assert mean_gradient.plate_names == ["vae_data"]
    bias = storch.reduce_plates((mean_gradient - expected_gradient) ** 2).sum()
    assert bias.plates == [] and torch.isfinite(bias._tensor)
    # 20 RLOO estimates of a gradient: the mean is in the right ballpark of the exact one
    assert float(bias) < float(storch.reduce_plates(expected_gradient ** 2).sum()) + float(var.sum())


def test_param_grads_of_a_non_leaf_parameter_shared_by_two_nodes():
    """Both nodes report the gradient of the surrogate with respect to their (shared) parameter."""
    w = torch.tensor([0.3, -0.2], requires_grad=True)
    logits = w * 2.0  # non-leaf, shared by two nodes
    z1 = ScoreFunction("z1", n_samples=3)(torch.distributions.Bernoulli(logits=logits))
    z2 = ScoreFunction("z2", n_samples=2)(torch.distributions.Bernoulli(logits=logits))
    storch.add_cost((z1 * torch.tensor([1.0, 2.0])).sum(-1), "c1")
    storch.add_cost((z2 * 3.0).sum(-1), "c2")
    surrogate = storch.surrogate_loss()
    (expected,) = torch.autograd.grad(surrogate, logits, retain_graph=True)
    storch.backward()
    torch.testing.assert_close(z1.param_grads["logits"], expected)
    assert z2.param_grads["logits"] is z1.param_grads["logits"] or torch.equal(z1.param_grads["logits"], z2.param_grads["logits"])
    torch.testing.assert_close(w.grad, 2.0 * expected)
