"""Plate reductions (storch.reduce), plate-aware ops (storch.ops) and storch.util."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Normal, OneHotCategorical

import storch
from storch.method import Expect, Reparameterization, ScoreFunction
from storch.plate import Plate
from storch.util import (
    conditional_gumbel_rsample,
    get_distr_parameters,
    has_differentiable_path,
    magic_box,
    print_graph,
    rsample_gumbel,
    rsample_gumbel_softmax,
    split,
    topological_sort,
)


def raw(t, *names):
    """The values of ``t`` with its plates permuted into the order ``names``."""
    assert sorted(t.plate_names) == sorted(names), (t.plate_names, names)
    perm = [t.plate_names.index(n) for n in names]
    return t._tensor.permute(*perm, *range(len(perm), t.dim()))


def _z(name="z", n=3, shape=(2,)):
    return ScoreFunction(name, n_samples=n)(Normal(torch.zeros(shape), 1.0))


# ------------------------------------------------------------------------ reduce_plates


def test_reduce_plates_defaults_to_all_plates():
    z = _z()
    x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0, "rdata")
    h = x + z
    r = storch.reduce_plates(h)
    assert isinstance(r, storch.Tensor) and r.plates == [] and r.shape == (2,)
    torch.testing.assert_close(r._tensor, h._tensor.mean((0, 1)))


def test_reduce_plates_by_name_and_by_plate():
    z = _z()
    x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0, "rdata")
    h = x * z
    r = storch.reduce_plates(h, "z")
    assert r.plate_names == ["rdata"]
    torch.testing.assert_close(r._tensor, raw(h, "rdata", "z").mean(1))
    r2 = storch.reduce_plates(h, [z.plate])
    torch.testing.assert_close(r2._tensor, r._tensor)
    with pytest.raises(ValueError, match="No plate named 'nope'"):
        storch.reduce_plates(h, "nope")


def test_reduce_plates_on_plain_tensors():
    t = torch.tensor([1.0, 2.0])
    assert storch.reduce_plates(t) is t
    with pytest.raises(ValueError, match="no plates"):
        storch.reduce_plates(t, "z")


def test_reduce_plates_uses_expect_weights():
    p = torch.tensor([0.2, 0.7], requires_grad=True)
    x = Expect("x")(Bernoulli(p))
    f = x[..., 0] * 3.0 + x[..., 1]
    r = storch.reduce_plates(f)
    torch.testing.assert_close(r._tensor, torch.tensor(0.2 * 3.0 + 0.7))
    # detached weights by default: no gradient through p(x)
    assert not r.requires_grad
    r2 = storch.reduce_plates(f, detach_weights=False)
    (g,) = torch.autograd.grad(r2, p)
    torch.testing.assert_close(g, torch.tensor([3.0, 1.0]))


def test_reduce_plates_with_custom_gather_weights():
    w = torch.tensor([0.1, 0.6, 0.3])
    g = storch.gather_samples([torch.tensor(10.0), torch.tensor(20.0), torch.tensor(40.0)], "is", weight=w)
    torch.testing.assert_close(storch.reduce_plates(g)._tensor, torch.tensor(1.0 + 12.0 + 12.0))


# ------------------------------------------------------------------------------ variance


def test_variance_on_a_fixed_list():
    g = storch.gather_samples([torch.tensor(v) for v in (1.0, 2.0, 4.0, 8.0)], "gradients")
    # mean 3.75; squared deviations 7.5625 + 3.0625 + 0.0625 + 18.0625 = 28.75; unbiased: / 3
    var = storch.variance(g, "gradients")
    assert var.plates == []
    torch.testing.assert_close(var._tensor, torch.tensor(28.75 / 3))
    torch.testing.assert_close(storch.reduce_plates(g, "gradients")._tensor, torch.tensor(3.75))
    torch.testing.assert_close(torch.sqrt(var)._tensor, torch.tensor(28.75 / 3).sqrt())


def test_variance_of_vectors_and_remaining_plates():
    samples = [torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0]), torch.tensor([5.0, 3.0])]
    g = storch.gather_samples(samples, "gradients")
    var = storch.variance(g, "gradients")
    torch.testing.assert_close(var._tensor, torch.tensor([4.0, 3.0]))
    # with another plate: variance per value of it, then reduced (mean) unless plates says otherwise
    x = storch.denote_independent(torch.tensor([1.0, 2.0]), 0, "vdata")
    g2 = storch.gather_samples([x * 1.0, x * 2.0, x * 3.0], "gradients")
    assert g2.plate_names == ["gradients", "vdata"]
    per_data = storch.variance(g2, "gradients", plates=[])
    assert per_data.plate_names == ["vdata"]
    torch.testing.assert_close(per_data._tensor, torch.tensor([1.0, 4.0]))
    torch.testing.assert_close(storch.variance(g2, "gradients")._tensor, torch.tensor(2.5))


def test_weighted_variance_is_second_central_moment():
    w = torch.tensor([0.25, 0.75])
    g = storch.gather_samples([torch.tensor(0.0), torch.tensor(4.0)], "is", weight=w)
    # mean 3; E(x - 3)^2 = 0.25 * 9 + 0.75 * 1 = 3
    torch.testing.assert_close(storch.variance(g, "is")._tensor, torch.tensor(3.0))


def test_variance_needs_a_storch_tensor():
    with pytest.raises(ValueError):
        storch.variance(torch.ones(3), "x")


# ------------------------------------------------------------------------- gather_samples


def test_gather_samples_of_plated_tensors():
    z = _z()
    g = storch.gather_samples([z, z * 2, z * 3], "reps")
    assert type(g) is storch.IndependentTensor
    assert g.plate_names == ["reps", "z"] and g.shape == (3, 3, 2)
    torch.testing.assert_close(g._tensor, torch.stack([z._tensor, 2 * z._tensor, 3 * z._tensor]))
    assert g.plates[0].size == 3
    torch.testing.assert_close(g.plates[0].weight, torch.tensor(1 / 3))


def test_gather_samples_aligns_different_plates():
    z = _z()
    x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]), 0, "gdata")
    g = storch.gather_samples([z, x, torch.ones(2)], "reps")
    assert g.plate_names[0] == "reps" and sorted(g.plate_names[1:]) == ["gdata", "z"]
    vals = raw(g, "reps", "gdata", "z")
    assert vals.shape == (3, 4, 3, 2)
    torch.testing.assert_close(vals[0], z._tensor[None].expand(4, 3, 2))
    torch.testing.assert_close(vals[1], x._tensor[:, None].expand(4, 3, 2))
    torch.testing.assert_close(vals[2], torch.ones(4, 3, 2))


def test_gather_samples_of_numbers_and_empty_list():
    g = storch.gather_samples([1.0, 2.0], "nums")
    torch.testing.assert_close(g._tensor, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least one"):
        storch.gather_samples([], "none")


# --------------------------------------------------------------------- sum / mean / lse


def test_sum_mean_logsumexp_by_plate_name():
    z = _z()
    x = storch.denote_independent(torch.arange(8.0).reshape(4, 2), 0, "sdata")
    h = x + z
    values = raw(h, "sdata", "z")
    s = storch.sum(h, "z")
    assert s.plate_names == ["sdata"]
    torch.testing.assert_close(s._tensor, values.sum(1))
    m = storch.mean(h, "sdata")
    assert m.plate_names == ["z"]
    torch.testing.assert_close(m._tensor, values.mean(0))
    lse = storch.logsumexp(h, "z")
    torch.testing.assert_close(lse._tensor, torch.logsumexp(values, 1))
    both = storch.sum(h, ["z", "sdata"])
    assert both.plates == [] and both.shape == (2,)
    torch.testing.assert_close(both._tensor, values.sum((0, 1)))
    # a Plate object and an event dimension (negative int) work too
    s2 = storch.sum(h, [z.plate, -1])
    assert s2.plate_names == ["sdata"] and s2.shape == (4,)
    torch.testing.assert_close(s2._tensor, values.sum((1, 2)))


def test_sum_ignores_weights_unlike_reduce_plates():
    p = torch.tensor(0.2)
    x = Expect("x")(Bernoulli(p))
    torch.testing.assert_close(storch.sum(x, "x")._tensor, torch.tensor(1.0))
    torch.testing.assert_close(storch.mean(x, "x")._tensor, torch.tensor(0.5))
    torch.testing.assert_close(storch.reduce_plates(x)._tensor, torch.tensor(0.2))


# ------------------------------------------------------------- cat / gather / expand_as / grad


def test_storch_cat_counts_plates_first():
    z = _z()
    x = storch.denote_independent(torch.zeros(4, 2), 0, "cdata")
    c = storch.cat([z, x], 2)  # dims count the union's two plates first, as torch.cat does
    assert torch.equal(c._tensor, storch.cat([z, x], -1)._tensor)
    assert c.event_shape == (4,)
    vals = raw(c, "cdata", "z")
    torch.testing.assert_close(vals[..., :2], z._tensor[None].expand(4, 3, 2))
    torch.testing.assert_close(vals[..., 2:], torch.zeros(4, 3, 2))
    c2 = storch.cat([z, torch.ones(1)], -1)
    assert c2.plate_names == ["z"] and c2.shape == (3, 3)


def test_storch_gather_selects_samples_along_a_plate():
    z = _z()
    idx = storch.denote_independent(torch.tensor([0, 2, 1, 1]), 0, "sel")
    out = storch.gather(z, "z", idx)
    assert out.plate_names == ["sel"], "the gathered plate must be replaced by the index's plates"
    assert out.shape == (4, 2)
    torch.testing.assert_close(out._tensor, z._tensor[[0, 2, 1, 1]])


def test_storch_gather_with_index_on_the_same_plate_reorders_samples():
    z = _z()
    perm = storch.Tensor(torch.tensor([2, 0, 1]), [z.plate])
    out = storch.gather(z, "z", perm)
    assert out.plate_names == ["z"] and out.shape == (3, 2)
    torch.testing.assert_close(out._tensor, z._tensor[[2, 0, 1]])


def test_storch_expand_as():
    z = _z()
    e = storch.expand_as(torch.tensor([1.0, 2.0]), z)
    assert e.plate_names == ["z"] and e.shape == (3, 2)
    torch.testing.assert_close(e._tensor, torch.tensor([[1.0, 2.0]] * 3))
    plain = storch.expand_as(torch.tensor([1.0]), torch.zeros(2, 3))
    assert type(plain) is torch.Tensor and plain.shape == (2, 3)


def test_storch_grad_returns_plated_gradients():
    mu = torch.tensor([1.0, -1.0], requires_grad=True)
    y = Reparameterization("y", n_samples=3)(Normal(mu, 1.0))
    out = storch.sum((y ** 2).sum(-1), "y")
    gy, gmu = storch.grad(out, [y, mu], retain_graph=True)
    assert isinstance(gy, storch.Tensor) and gy.plate_names == ["y"]
    torch.testing.assert_close(gy._tensor, 2 * y._tensor.detach())
    assert type(gmu) is torch.Tensor
    torch.testing.assert_close(gmu, (2 * y._tensor.detach()).sum(0))
    (only,) = storch.grad(out, mu)
    torch.testing.assert_close(only, gmu)


def test_order_plates():
    a = Plate("a", 2)
    b = Plate("b", 3, parents=[a])
    c = Plate("c", 4, parents=[b])
    assert storch.order_plates([c, a, b]) == [a, b, c]
    assert storch.order_plates([a, c, b], reverse=True) == [c, b, a]
    z1 = _z("z1")
    z2 = ScoreFunction("z2", n_samples=2)(Normal(z1, 1.0))
    assert [p.name for p in storch.order_plates(z2.plates)] == ["z1", "z2"]


# ---------------------------------------------------------------------------- magic box


def test_magic_box_forward_first_and_second_derivative():
    l = torch.tensor(0.7, requires_grad=True)  # noqa: E741
    m = magic_box(l * l)
    assert m.item() == 1.0
    (g,) = torch.autograd.grad(m, l, create_graph=True)
    torch.testing.assert_close(g, torch.tensor(2 * 0.7))  # d box(l^2) = box * 2l
    (h,) = torch.autograd.grad(g, l)
    torch.testing.assert_close(h, torch.tensor(2 + (2 * 0.7) ** 2))  # box * (2 + (2l)^2)


def test_magic_box_times_cost_is_score_function():
    theta = torch.tensor(0.3, requires_grad=True)
    x = torch.tensor(1.0)
    lp = Bernoulli(logits=theta).log_prob(x)
    sur = magic_box(lp) * 5.0
    assert sur.item() == 5.0
    (g,) = torch.autograd.grad(sur, theta)
    torch.testing.assert_close(g, 5.0 * (1 - torch.sigmoid(theta.detach())))


# ---------------------------------------------------------------------- graph utilities


def test_get_distr_parameters():
    mu = torch.zeros(2, requires_grad=True)
    d = Normal(mu, torch.ones(2))
    params = get_distr_parameters(d)
    assert list(params) == ["loc"] and params["loc"] is mu
    assert set(get_distr_parameters(d, filter_requires_grad=False)) == {"loc", "scale"}
    probs = torch.tensor([0.2, 0.8], requires_grad=True)
    oh = get_distr_parameters(OneHotCategorical(probs=probs))
    assert "probs" in oh  # (torch normalises probs, so it is a function of the argument)
    torch.testing.assert_close(oh["probs"], probs)
    assert has_differentiable_path(oh["probs"], probs)
    logits = torch.zeros(3, requires_grad=True)
    assert "logits" in get_distr_parameters(OneHotCategorical(logits=logits))
    assert get_distr_parameters(Bernoulli(probs=torch.tensor(0.3))) == {}


def test_has_differentiable_path():
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    mid = a * 3
    out = (mid * 2).sum()
    assert has_differentiable_path(out, a)
    assert has_differentiable_path(out, mid)
    assert not has_differentiable_path(out, b)
    assert not has_differentiable_path(out.detach(), a)
    z = Reparameterization("z", n_samples=2)(Normal(a, 1.0))
    assert has_differentiable_path(storch.sum((z * z).sum(-1), "z"), a)
    s = ScoreFunction("s", n_samples=2)(Normal(b, 1.0))
    assert not has_differentiable_path(storch.sum(s.sum(-1), "s") * a.sum(), b)


def _two_node_graph():
    mu = torch.zeros(2, requires_grad=True)
    z1 = ScoreFunction("z1", n_samples=2)(Normal(mu, 1.0))
    z2 = Reparameterization("z2", n_samples=3)(Normal(z1, 1.0))
    storch.add_cost((z2 ** 2).sum(-1), "c")
    return z1, z2, storch.registered_costs()


def test_topological_sort_two_nodes():
    z1, z2, costs = _two_node_graph()
    nodes = topological_sort(costs)
    assert [n.name for n in nodes] == ["z1", "z2"]
    assert all(type(n) is storch.StochasticTensor for n in nodes)
    torch.testing.assert_close(nodes[1]._tensor, z2._tensor)
    assert nodes[0].method is z1.method


def test_print_graph_two_nodes(capsys):
    _, _, costs = _two_node_graph()
    print_graph(costs)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3
    assert out[0].startswith("node 'z1'") and "ScoreFunction" in out[0] and "n=2" in out[0]
    assert out[1].startswith("node 'z2'") and "Reparameterization" in out[1] and "['z1']" in out[1]
    assert out[2].startswith("cost 'c'") and "'z2'" in out[2] and "'z1'" in out[2]


def test_split():
    z1 = _z("z1", n=5)
    h = z1 * 2
    pieces = split(h, "z1", amt_slices=2)
    assert len(pieces) == 2
    assert sum(p.shape[0] for p in pieces) == 5
    torch.testing.assert_close(torch.cat([p._tensor for p in pieces]), h._tensor.detach())
    assert all(p.plate_names == ["z1"] and p.plates[0].size == p.shape[0] for p in pieces)
    assert not any(p.requires_grad for p in pieces)
    a, b = split(h, "z1", slices=[slice(0, 1), slice(1, 5)], create_plates=False)
    assert type(a) is torch.Tensor and a.shape == (1, 2) and b.shape == (4, 2)
    with pytest.raises(ValueError, match="exactly one"):
        split(h, "z1")


# ----------------------------------------------------------------------- Gumbel sampling


def test_rsample_gumbel_shapes():
    d = OneHotCategorical(logits=torch.randn(4, 5))
    assert rsample_gumbel(d, 3).shape == (3, 4, 5)


def test_rsample_gumbel_softmax_shapes_and_straight_through_values():
    logits = torch.randn(4, 5, requires_grad=True)
    d = OneHotCategorical(logits=logits)
    soft = rsample_gumbel_softmax(d, 6, 0.5)
    assert soft.shape == (6, 4, 5)
    torch.testing.assert_close(soft.sum(-1), torch.ones(6, 4))
    assert ((soft > 0) & (soft < 1)).all()
    st = rsample_gumbel_softmax(d, 6, 0.5, straight_through=True)
    assert st.shape == (6, 4, 5)
    assert set(st.detach().unique().tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(st.detach().sum(-1), torch.ones(6, 4))
    (g,) = torch.autograd.grad((st * torch.arange(5.0)).sum(), logits)
    assert g.abs().sum() > 0  # the relaxed sample's gradient
    bern = Bernoulli(logits=torch.randn(4))
    sb = rsample_gumbel_softmax(bern, 6, 0.5)
    assert sb.shape == (6, 4) and ((sb > 0) & (sb < 1)).all()
    stb = rsample_gumbel_softmax(bern, 6, 0.5, straight_through=True)
    assert set(stb.unique().tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(stb, (sb * 0 + stb).round())
    with pytest.raises(ValueError, match="No Gumbel-softmax relaxation"):
        rsample_gumbel_softmax(Normal(0.0, 1.0), 2, 1.0)


def test_straight_through_matches_argmax_of_its_relaxed_sample():
    torch.manual_seed(5)
    d = OneHotCategorical(logits=torch.randn(3, 4))
    torch.manual_seed(6)
    soft = rsample_gumbel_softmax(d, 5, 0.7)
    torch.manual_seed(6)
    st = rsample_gumbel_softmax(d, 5, 0.7, straight_through=True)
    torch.testing.assert_close(st.argmax(-1), soft.argmax(-1))
    torch.testing.assert_close(st.detach(), torch.nn.functional.one_hot(soft.argmax(-1), 4).float())


def test_conditional_gumbel_rsample_categorical_argmax_equals_hard_sample():
    probs = torch.softmax(torch.randn(200, 5), -1)
    hard = OneHotCategorical(probs=probs).sample()
    for tau in (0.1, 1.0, 3.0):
        z = conditional_gumbel_rsample(hard, probs, False, tau)
        assert z.shape == probs.shape
        torch.testing.assert_close(z.sum(-1), torch.ones(200))
        assert torch.equal(z.argmax(-1), hard.argmax(-1))


def test_conditional_gumbel_rsample_bernoulli_rounds_to_hard_sample():
    probs = torch.rand(500).clamp(0.02, 0.98)
    hard = Bernoulli(probs).sample()
    for tau in (0.1, 1.0, 3.0):
        z = conditional_gumbel_rsample(hard, probs, True, tau)
        assert ((z >= 0) & (z <= 1)).all()
        assert torch.equal(z.round(), hard)


def test_conditional_gumbel_rsample_is_reparameterised():
    probs = torch.tensor([[0.2, 0.5, 0.3]], requires_grad=True)
    hard = torch.tensor([[0.0, 1.0, 0.0]])
    z = conditional_gumbel_rsample(hard, probs, False, 0.5)
    (g,) = torch.autograd.grad((z * torch.tensor([1.0, 2.0, 3.0])).sum(), probs)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    assert storch.conditional_gumbel_rsample is conditional_gumbel_rsample


# --------------------------------------------------------------------------- storch.nn


def test_b_binary_cross_entropy_reduces_event_dims_only():
    z = ScoreFunction("z", n_samples=3)(Bernoulli(torch.full((4,), 0.5)))
    target = storch.denote_independent(torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]), 0, "bdata")
    recon = torch.sigmoid(z * 2.0 - 1.0)
    loss = storch.nn.b_binary_cross_entropy(recon, target)
    assert sorted(loss.plate_names) == ["bdata", "z"] and loss.event_shape == ()
    r, t = recon._tensor[:, None], target._tensor[None]
    expected = -(t * r.log() + (1 - t) * (1 - r).log()).sum(-1)
    torch.testing.assert_close(raw(loss, "z", "bdata"), expected)
    mean = storch.nn.b_binary_cross_entropy(recon, target, reduction="mean")
    torch.testing.assert_close(raw(mean, "z", "bdata"), expected / 4)
    none = storch.nn.b_binary_cross_entropy(recon, target, reduction="none")
    assert none.event_shape == (4,)
    with pytest.raises(ValueError, match="reduction"):
        storch.nn.b_binary_cross_entropy(recon, target, reduction="bogus")


@pytest.mark.parametrize("case", ["same plates", "number", "plain, fewer dims", "other plates", "plain, more dims"])
def test_elementwise_equals_the_dispatched_operation(case):
    """``storch.util.elementwise`` gives the values and plates of the dispatched operation, with or
    without its shortcut (other plates and a plain tensor with more dimensions go through dispatch)."""
    import operator

    from storch.util import elementwise

    x = storch.denote_independent(torch.arange(6.0).reshape(2, 3), 0, "data")
    other = {
        "same plates": storch.denote_independent(torch.ones(2, 3) * 2.0, 0, "data"),
        "number": 2.0,
        "plain, fewer dims": torch.tensor([1.0, 2.0, 3.0]),
        "other plates": storch.denote_independent(torch.ones(4, 3), 0, "other"),
        "plain, more dims": torch.ones(5, 3),
    }[case]
    for op in (operator.add, operator.mul, operator.sub):
        for a, b in ((x, other), (other, x)):
            expected, got = op(a, b), elementwise(op, a, b)
            assert got.plate_names == expected.plate_names
            assert torch.equal(got._tensor, expected._tensor)


def test_lazy_parameter_computed_while_sampling_gets_its_plates_without_a_view():
    """A parameter that a differentiable draw computed lazily (``RelaxedBernoulli(logits=...)``'s ``probs``, which
    the relaxed samples depend on) and nobody else holds is given its plates in place: the cached
    object itself, no view of it."""
    from torch.distributions import RelaxedBernoulli

    logits = storch.denote_independent(torch.randn(4, 3, requires_grad=True), 0, "data") * 1.0
    # validation stated: without it, torch's sampling path keeps a second reference (then a view is right)
    q = RelaxedBernoulli(torch.tensor(0.5), logits=logits, validate_args=True)
    z = storch.method.Reparameterization("z")(q)
    assert z.requires_grad
    probs = q.base_dist.__dict__["probs"]  # (RelaxedBernoulli samples its LogitRelaxedBernoulli)
    assert type(probs) is storch.Tensor and probs.plate_names == ["data"]
    assert probs._base is None and type(probs.grad_fn).__name__ == "SigmoidBackward0"
    torch.testing.assert_close(probs.plain(), torch.sigmoid(logits.plain()))
    storch.reset()


def test_lazy_parameter_held_by_the_users_code_is_not_retyped():
    """A lazily computed parameter that a user's code also holds while it is a plain tensor: the user's
    object stays plain, and the distribution caches a storch view of it."""
    from torch.distributions import Categorical

    from storch._dispatch import no_dispatch
    from storch.util import restore_lazy_plates

    logits = storch.denote_independent(torch.randn(4, 3, requires_grad=True), 0, "data") * 1.0
    q = Categorical(logits=logits)
    with no_dispatch():
        kept = q.probs
    restore_lazy_plates(q)
    assert type(kept) is torch.Tensor
    probs = q.__dict__["probs"]
    assert type(probs) is storch.Tensor and probs.plate_names == ["data"] and probs._base is kept


def test_lazy_parameter_held_by_a_users_sampler_stays_plain_and_is_not_cached():
    """A score-function draw whose sampling function kept ``distr.probs``: the user's object stays plain
    and the distribution does not cache it (read again, it is computed with its plates)."""
    from torch.distributions import Categorical

    kept = []

    def sample(distr, plates, n):
        kept.append(distr.probs)
        return distr.sample((n,))

    method = ScoreFunction("z")
    method.sampling_method.set_mc_sample(sample)
    logits = storch.denote_independent(torch.randn(4, 3, requires_grad=True), 0, "data") * 1.0
    q = Categorical(logits=logits)
    method(q)
    assert type(kept[0]) is torch.Tensor and "probs" not in q.__dict__
    assert q.probs.plate_names == ["data"]
    storch.reset()


def test_lazy_parameter_of_a_draw_without_gradient_is_forgotten_and_computed_again_with_plates():
    """A score-function draw's ``Categorical(logits=...).probs`` (the multinomial's input, which no cost
    depends on) is not kept on the distribution: read again it is computed with its plates and its
    gradient path to the logits, and the gradient a cost sends through it reaches ``param_grads``."""
    from torch.distributions import Categorical

    leaf = torch.randn(4, 3, requires_grad=True)
    logits = storch.denote_independent(leaf, 0, "data") * 1.0
    q = Categorical(logits=logits)
    z = ScoreFunction("z")(q)
    assert "probs" not in q.__dict__
    probs = q.probs
    assert type(probs) is storch.Tensor and probs.plate_names == ["data"] and q.__dict__["probs"] is probs
    torch.testing.assert_close(probs.plain(), torch.softmax(leaf, -1))
    storch.add_cost((probs * torch.tensor([1.0, 2.0, 3.0])).sum(-1) + z.float(), "c")
    storch.backward()
    assert set(z.param_grads) == {"logits", "probs"}
    torch.testing.assert_close(z.param_grads["probs"].plain(), torch.tensor([1.0, 2.0, 3.0]).expand(4, 3) / 4)


def test_magic_box_of_a_storch_tensor_is_made_once_while_it_is_unchanged():
    """An estimator's ``(1 − □(l))·a`` and the surrogate's ``□(l)·S`` share one box (one autograd
    node); a box is made again when ``l`` or the box was written in place, or the grad mode changed."""
    from storch.util import magic_box

    l = storch.denote_independent(torch.tensor([0.3, -0.2], requires_grad=True) * 1.0, 0, "data")  # noqa: E741
    box = magic_box(l)
    assert magic_box(l) is box and box.plate_names == ["data"]
    with torch.no_grad():
        unboxed = magic_box(l)
    assert unboxed is not box and not unboxed.requires_grad
    assert magic_box(l) is not unboxed and magic_box(l).requires_grad
    again = magic_box(l)
    with torch.no_grad():
        again.mul_(1.0)
    assert magic_box(l) is not again
    with torch.no_grad():
        l.mul_(2.0)
    fresh = magic_box(l)
    assert fresh is not again and torch.equal(fresh.plain().detach(), torch.ones(2))


def test_has_parameters_requiring_grad_agrees_with_get_distr_parameters():
    """The short-circuit test a draw uses agrees with ``bool(get_distr_parameters(d))``: plain and plated
    parameters, with and without gradients, parameters kept inside a wrapping distribution."""
    from torch.distributions import Categorical, Independent

    from storch.util import has_parameters_requiring_grad

    grad = torch.zeros(3, 2, requires_grad=True)
    plated = storch.denote_independent(torch.zeros(3, 2, requires_grad=True), 0, "data") * 1.0
    plated_const = storch.denote_independent(torch.zeros(3, 2), 0, "data")
    cases = [
        Normal(grad, 1.0), Normal(torch.zeros(3, 2), 1.0), Normal(torch.zeros(3, 2), grad.exp()),
        Normal(plated, 1.0), Normal(plated_const, 1.0), Bernoulli(logits=plated), Bernoulli(probs=torch.tensor(0.3)),
        OneHotCategorical(logits=grad), OneHotCategorical(logits=torch.zeros(3)), Categorical(logits=plated),
        Independent(Normal(grad, 1.0), 1), Independent(Normal(torch.zeros(3, 2), 1.0), 1),
    ]
    for d in cases:
        assert has_parameters_requiring_grad(d) == bool(get_distr_parameters(d)), d
    assert [has_parameters_requiring_grad(d) for d in cases] == [
        True, False, True, True, False, True, False, True, False, True, True, False
    ]
    storch.reset()


def test_restore_lazy_plates_with_the_known_layout_gives_each_nested_distribution_its_own():
    """``restore_lazy_plates(d, layout)`` (the layout a draw already found) plates the lazily computed
    parameters as ``restore_lazy_plates(d)`` does, the nested distribution's by its own layout."""
    from torch.distributions import Independent

    from storch._dispatch import no_dispatch
    from storch.util import distribution_layout, restore_lazy_plates

    logits = storch.denote_independent(torch.randn(4, 3, requires_grad=True), 0, "data") * 1.0
    results = []
    for known in (False, True):
        q = Independent(Bernoulli(logits=logits), 1)
        with no_dispatch():
            q.sample((2,))  # computes the nested Bernoulli's probs, plain
        inner = q.base_dist
        assert type(inner.__dict__["probs"]) is torch.Tensor
        restore_lazy_plates(q, distribution_layout(q) if known else None)
        probs = inner.__dict__["probs"]
        assert type(probs) is storch.Tensor and probs.plate_names == ["data"]
        results.append(probs.plain())
    assert torch.equal(results[0], results[1])
    storch.reset()
