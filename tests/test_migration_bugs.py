"""Bugs a user migrating from Storchastic meets, each of which runs in Storchastic.

* RELAX / REBAR / LAX on a scalar node (``batch_shape ()``) with ``in_dim=1``: the default network
  sees each sample as a vector of length 1, for any ``n_samples``, and the gradient stays unbiased.
* Dimension arguments: one rule for storch's functions and torch's functions on storch tensors
  (``storch.ops``: plates first, as ``t.shape`` shows them; a plate is refused; negative from the
  right). Each function is compared with the torch function applied to every sample.
* ``Independent`` distributions find their base distribution's registry entries:
  ``Independent(base, 0)`` behaves as ``base`` everywhere, and ``Independent(base, 1)`` is accepted
  with the base's result or refused with the reason, registry by registry.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Bernoulli, Beta, Independent, Normal, OneHotCategorical

import storch
from storch.method import (
    GSB,
    MVD,
    SPSA,
    GumbelSoftmax,
    LocalExpectation,
    ScoreFunction,
    StraightThrough,
    UnorderedSetEstimator,
    UnorderedSetGumbelSoftmax,
)
from storch.method.relax import LAX, REBAR, RELAX, ControlVariateNetwork
from storch.registry import ReinterpretedDimsError, TypeRegistry, independent_base
from storch.testing import assert_unbiased, replicated_gradients

R = 3000


# ====================================================================== 2. RELAX on a scalar node
P0 = torch.tensor(0.3)
TARGET = 0.45
#: d/dp E[(x − t)²] for x ~ Bernoulli(p): (1 − t)² − t²
EXACT_SCALAR = torch.tensor((1 - TARGET) ** 2 - TARGET**2)

SCALAR_METHODS = {
    "relax": lambda n: RELAX("x", in_dim=1, n_samples=n),
    "relax_rebar": lambda n: RELAX("x", in_dim=1, n_samples=n, rebar=True),
    "rebar": lambda n: REBAR("x", n_samples=n),
}


@pytest.mark.parametrize("n", [1, 3, 50])
def test_relax_in_dim_1_on_a_scalar_node_runs_for_any_n_samples(n):
    p = torch.tensor(0.5, requires_grad=True)
    x = RELAX("x", in_dim=1, n_samples=n)(Bernoulli(p))
    assert x.shape == (n,)
    storch.add_cost((x - TARGET) ** 2, "f")
    storch.backward()
    assert p.grad is not None and torch.isfinite(p.grad)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", list(SCALAR_METHODS))
def test_scalar_node_gradient_is_unbiased(name, n):
    method = SCALAR_METHODS[name](n)

    def model(p):
        x = method(Bernoulli(p))
        storch.add_cost((x - TARGET) ** 2, "f")

    (grads,) = replicated_gradients([P0], R, model)
    assert_unbiased(grads, EXACT_SCALAR, label=f"{name} n={n}")


@pytest.mark.parametrize("n", [1, 3])
def test_lax_in_dim_1_on_a_scalar_normal_is_unbiased(n):
    method = LAX("z", in_dim=1, n_samples=n)
    mu0 = torch.tensor(0.4)

    def model(mu):
        z = method(Normal(mu, 1.0))
        storch.add_cost(z**2, "f")  # d/dμ E[z²] = 2μ

    (grads,) = replicated_gradients([mu0], R, model)
    assert_unbiased(grads, 2 * mu0, label=f"LAX n={n}")


def test_relax_in_dim_on_a_batch_shaped_node_is_unbiased():
    probs0 = torch.tensor([0.3, 0.6, 0.85])
    method = RELAX("x", in_dim=3, n_samples=2)

    def model(probs):
        x = method(Bernoulli(probs))
        storch.add_cost(((x - TARGET) ** 2).sum(-1), "f")

    (grads,) = replicated_gradients([probs0], R, model)
    assert_unbiased(grads, EXACT_SCALAR.expand(3), label="RELAX in_dim=3")


def test_control_variate_network_pads_a_scalar_sample_and_names_a_wrong_in_dim():
    net = ControlVariateNetwork(1)
    x = storch.denote_independent(torch.rand(5), 0, "x")  # five scalar samples
    assert net(x).shape == (5,)
    with pytest.raises(ValueError, match=r"sample shape \(\) after its plates \['x'\].*in_dim=1"):
        ControlVariateNetwork(3)(x)
    batch = storch.denote_independent(torch.rand(5, 3), 0, "x")
    assert ControlVariateNetwork(3)(batch).shape == (5,)
    with pytest.raises(ValueError, match=r"sample shape \(3,\) .*here in_dim=\(3,\)"):
        ControlVariateNetwork(5)(batch)  # the plate's size 5 is never taken for in_dim


# ====================================================================== 3. dimension arguments
def _plated(shape, name="p"):
    """A storch tensor whose first dimension is plate ``name``."""
    return storch.denote_independent(torch.randn(shape), 0, name)


def _per_sample(fn, *tensors):
    """``fn`` applied to each sample of the plate of the first dimension, stacked."""
    return torch.stack([fn(*(t._tensor[k] if isinstance(t, storch.Tensor) else t for t in tensors))
                        for k in range(tensors[0].shape[0])])


def _sample_dim(dim):
    """The dimension of one sample that ``dim`` (plates first, one plate) names."""
    return dim - 1 if dim >= 0 else dim


@pytest.mark.parametrize("dim", [1, 2, -1, -2])
def test_cat_counts_plates_first_like_torch_cat(dim):
    a, b = _plated((5, 4, 2)), _plated((5, 4, 2))
    out = storch.cat([a, b], dim)
    assert out.plate_names == ["p"]
    expected = _per_sample(lambda x, y: torch.cat([x, y], _sample_dim(dim)), a, b)
    torch.testing.assert_close(out._tensor, expected)
    torch.testing.assert_close(torch.cat([a, b], dim)._tensor, out._tensor)  # storch.cat agrees with torch.cat


def test_cat_shapes_of_the_issue():
    a = _plated((5, 4, 2))
    assert storch.cat([a, a], 1).shape == torch.cat([a, a], 1).shape == (5, 8, 2)
    assert storch.cat([a, a], 2).shape == torch.cat([a, a], 2).shape == (5, 4, 4)
    with pytest.raises(ValueError, match=r"storch.cat got dimension 0, which is plate 'p'.* 1\.\.2, or -2\.\.-1"):
        storch.cat([a, a], 0)
    with pytest.raises(IndexError, match="dimension 3 is out of range"):
        storch.cat([a, a], 3)


def test_cat_with_a_plain_member_and_with_different_plates():
    a = _plated((5, 4, 2))
    c = torch.randn(4, 2)  # one sample's worth
    out = storch.cat([a, c], 1)
    torch.testing.assert_close(out._tensor, _per_sample(lambda x: torch.cat([x, c], 0), a))
    torch.testing.assert_close(torch.cat([a, c], 1)._tensor, out._tensor)
    z = _plated((3, 2), "z")
    x = _plated((4, 2), "q")
    for dim in (2, -1):  # two plates in the union, then the sample's dimension
        joined = storch.cat([z, x], dim)
        assert joined.plate_names == ["q", "z"] and joined.shape == (4, 3, 4)
        torch.testing.assert_close(joined._tensor, torch.cat([z, x], dim)._tensor)
        for i in range(4):
            for j in range(3):
                torch.testing.assert_close(joined._tensor[i, j], torch.cat([z._tensor[j], x._tensor[i]]))


@pytest.mark.parametrize("dim", [1, 2, -1, -2])
def test_gather_with_an_int_dim_is_torch_gather_per_sample(dim):
    a = _plated((5, 4, 3))
    index = storch.denote_independent(torch.randint(0, 3, (5, 4, 3)), 0, "p")
    out = storch.gather(a, dim, index)
    expected = _per_sample(lambda x, i: torch.gather(x, _sample_dim(dim), i), a, index)
    torch.testing.assert_close(out._tensor, expected)
    plain_index = torch.zeros(2, 3, dtype=torch.long)  # one sample's index, repeated over the plate
    shared = storch.gather(a, -2, plain_index)
    torch.testing.assert_close(shared._tensor, _per_sample(lambda x: torch.gather(x, 0, plain_index), a))
    with pytest.raises(ValueError, match="storch.gather got dimension 0, which is plate 'p'"):
        storch.gather(a, 0, index)


def test_gather_along_a_plate_takes_it_by_name_or_plate():
    a = _plated((5, 4))
    idx = storch.denote_independent(torch.tensor([4, 0, 2]), 0, "sel")
    for dim in ("p", a.plates[0]):
        out = storch.gather(a, dim, idx)
        assert out.plate_names == ["sel"]
        torch.testing.assert_close(out._tensor, a._tensor[[4, 0, 2]])


def test_expand_as_expands_each_sample_like_torch():
    a = _plated((5, 2))
    target = torch.zeros(4, 2)
    out = storch.expand_as(a, target)
    assert out.shape == (5, 4, 2)
    torch.testing.assert_close(out._tensor, _per_sample(lambda x: x.expand_as(target), a))
    other = _plated((3, 4, 2), "q")
    both = storch.expand_as(a, other)
    assert both.plate_names == ["q", "p"] and both.shape == (3, 5, 4, 2)
    torch.testing.assert_close(both._tensor[1, 2], a._tensor[2].expand(4, 2))
    plain = storch.expand_as(torch.tensor([1.0, 2.0]), a)
    torch.testing.assert_close(plain._tensor, torch.tensor([1.0, 2.0]).expand(5, 2))


@pytest.mark.parametrize("op", ["sum", "mean", "logsumexp"])
@pytest.mark.parametrize("dim", [1, 2, -1, [1, -1]])
def test_storch_reductions_count_plates_first(op, dim):
    a = _plated((5, 4, 3))
    out = getattr(storch, op)(a, dim)
    sample_dims = [_sample_dim(d) for d in dim] if isinstance(dim, list) else _sample_dim(dim)
    expected = _per_sample(lambda x: getattr(torch, op)(x, sample_dims), a)
    torch.testing.assert_close(out._tensor, expected)
    torch.testing.assert_close(getattr(a, op)(dim)._tensor, expected)  # the tensor method agrees


def test_storch_reductions_take_plates_by_name_only():
    a = _plated((5, 4))
    torch.testing.assert_close(storch.sum(a, "p"), a._tensor.sum(0))
    with pytest.raises(ValueError, match=r"storch.sum got dimension 0, which is plate 'p'.*by its name"):
        storch.sum(a, 0)
    with pytest.raises(ValueError, match="which is plate 'p'"):
        storch.mean(a, [-2])


def test_denote_independent_and_reduce_mean_count_plates_first():
    a = _plated((5, 4, 3))
    d = storch.denote_independent(a, 2, "d")  # sample dimension 1 becomes a plate
    assert d.plate_names == ["d", "p"]
    torch.testing.assert_close(d._tensor, a._tensor.movedim(2, 0))
    with pytest.raises(ValueError, match="already plate 'p'"):
        storch.denote_independent(a, 0, "d")
    from storch.util import reduce_mean

    for keep in ([1], [-1], [0, 2]):
        out = reduce_mean(a, keep)
        sample_keep = [_sample_dim(k) for k in keep if k != 0]
        expected = _per_sample(lambda x: x.mean([d for d in range(2) if d not in {k % 2 for k in sample_keep}]), a)
        torch.testing.assert_close(out._tensor, expected)


# ====================================================================== 4. Independent distributions
def _gradient(make_method, make_distr, cost, params, seed=3):
    storch.reset()
    torch.manual_seed(seed)
    for p in params:
        p.grad = None
    x = make_method()(make_distr())
    storch.add_cost(cost(x), "f")
    storch.backward()
    return [p.grad.clone() for p in params]


def _same_gradient(make_method, make_base, cost, params, n):
    bare = _gradient(make_method, make_base, cost, params)
    wrapped = _gradient(make_method, lambda: Independent(make_base(), n), cost, params)
    for a, b in zip(bare, wrapped):
        torch.testing.assert_close(a, b)


def test_unordered_set_on_independent_zero_is_the_bare_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], requires_grad=True)
    _same_gradient(
        lambda: UnorderedSetEstimator("z", k=2), lambda: OneHotCategorical(probs=probs),
        lambda z: (z * torch.arange(4.0)).sum(-1) ** 2, [probs], 0,
    )


PROBS3 = torch.tensor([0.2, 0.6, 0.7], requires_grad=True)
MU = torch.tensor([0.3, -0.5], requires_grad=True)
AB = torch.tensor([2.0, 3.0], requires_grad=True)
PROBS4 = torch.tensor([0.1, 0.2, 0.3, 0.4], requires_grad=True)


def _bits():
    return Bernoulli(PROBS3)


def _bit_cost(x):
    return ((x - TARGET) ** 2).sum(-1)


def _normal():
    return Normal(MU, 1.0)


def _square(z):
    return (z**2).sum(-1)


#: registry -> (method, base distribution, cost, parameters), for the cases that accept Independent(base, 1)
ACCEPTED = {
    "WOR support": (lambda: UnorderedSetEstimator("z", k=3), _bits, _bit_cost, [PROBS3]),
    "cumulants": (lambda: GSB("z", n_samples=2), _normal, _square, [MU]),
    "one-hot view": (lambda: StraightThrough("z", n_samples=4), _bits, _bit_cost, [PROBS3]),
    "SPSA wrapper": (lambda: SPSA("z", n_samples=4), _normal, _square, [MU]),
    "critic inputs": (lambda: ScoreFunction("z", n_samples=4, baseline_factory="critic"), _bits, _bit_cost, [PROBS3]),
    "GSB representation": (lambda: GSB("z", n_samples=2), lambda: Beta(AB, AB.flip(0)), _square, [AB]),
    "relaxation": (lambda: GumbelSoftmax("z", n_samples=4), _bits, _bit_cost, [PROBS3]),
    "relaxation (RELAX)": (lambda: RELAX("z", in_dim=3, n_samples=4), _bits, _bit_cost, [PROBS3]),
}

#: registry -> (method, base distribution, cost, parameters), for the cases that refuse Independent(base, 1)
REFUSED = {
    "local-expectation coordinates": (lambda: LocalExpectation("z", n_samples=2), _bits, _bit_cost, [PROBS3]),
    "GSB rule": (lambda: GSB("z", n_samples=2), _bits, _bit_cost, [PROBS3]),
    "measure-valued decomposition": (lambda: MVD("z", n_samples=2), _normal, _square, [MU]),
}


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("registry", list(ACCEPTED))
def test_independent_is_served_by_its_base_entry(registry, n):
    _same_gradient(*ACCEPTED[registry], n)


@pytest.mark.parametrize("registry", list(REFUSED))
def test_independent_with_reinterpreted_dims_is_refused_with_the_reason(registry):
    make_method, make_base, cost, params = REFUSED[registry]
    _same_gradient(make_method, make_base, cost, params, 0)  # Independent(base, 0) is base
    storch.reset()
    name = registry.split(" (")[0]
    with pytest.raises(ReinterpretedDimsError, match=rf"The {name} registry serves Independent\(.*, "
                                                     r"reinterpreted_batch_ndims=1\).*Pass the base distribution"):
        make_method()(Independent(make_base(), 1))


def test_relaxed_wor_values_are_the_bases_and_gumbel_softmax_wor_refuses_as_for_the_base():
    from storch.sampling.unordered_set import _RELAXED_VALUES

    y = torch.rand(3, 2)
    base = Bernoulli(torch.full((2,), 0.5))
    torch.testing.assert_close(_RELAXED_VALUES.lookup(Independent(base, 1))(y), _RELAXED_VALUES.lookup(base)(y))
    _same_gradient(lambda: UnorderedSetGumbelSoftmax("z", k=2), lambda: OneHotCategorical(probs=PROBS4),
                   lambda z: (z * torch.arange(4.0)).sum(-1) ** 2, [PROBS4], 0)
    two = OneHotCategorical(probs=PROBS4.expand(2, 4))
    for distr in (two, Independent(two, 1)):  # two variables per sample: refused either way, with the reason
        storch.reset()
        with pytest.raises(ValueError, match=r"has \(2,\) variables per plate element; it relaxes one"):
            UnorderedSetGumbelSoftmax("z", k=2)(distr)


def test_registry_unwraps_nested_independents_and_keeps_an_own_entry():
    reg: TypeRegistry = TypeRegistry("test")
    reg.register(Bernoulli)(lambda d: d.probs)
    base = Bernoulli(torch.full((2, 3), 0.25))
    nested = Independent(Independent(base, 1), 1)
    assert independent_base(nested) == (base, 2)
    found = reg.resolve(nested)
    assert found.registered is Bernoulli and found.distribution is base and found.reinterpreted == 2
    torch.testing.assert_close(found.value(nested), base.probs)  # the function sees the base
    assert reg.lookup(nested) is reg.lookup(Independent(base, 1))  # one adapted entry per type
    reg.register(Independent)(lambda d: "own")
    assert reg.lookup(nested)(nested) == "own"  # an entry for Independent itself wins
    assert TypeRegistry("empty").lookup(nested) is None
    assert math.isclose(reg.lookup(base)(base)[0, 0].item(), 0.25)
