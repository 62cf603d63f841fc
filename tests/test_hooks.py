"""Hooks instead of flags and type tests (issue 12, item 3).

* the Monte Carlo delegate: a proposal draws and weights plain Monte Carlo samples through the
  estimator that owns it (``SamplingMethod.delegate``), with no detection of overridden methods;
  explicit ``set_mc_sample`` hooks take precedence; methods still pickle and deep-copy;
* ``Method.handles_joint_bound`` / ``Method.on_joint_bound``: how ``iwae_bound`` learns that a
  method estimates a multi-sample bound jointly (VIMCO is one such method, not a special case);
* RELAX's REBAR term is a ``RelaxedCostTerm`` strategy instead of a flag tested in five places;
* typed fields: ``Plate.info``, ``SamplingMethod.n_samples``, GSB's hidden leaves.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch.distributions import Bernoulli, Normal, OneHotCategorical

import storch
from storch.method import REBAR, RELAX, Method, ScoreFunction, iwae_bound
from storch.method.method import log_prob
from storch.method.relax import NO_RELAXED_COST, REBAR_TERM
from storch.plate import Plate
from storch.sampling import Enumerate, MonteCarlo


class AlwaysOne(Method):
    """Score function whose Monte Carlo proposal draws the value 1 and weights it 2 (for testing)."""

    def proposal_dist(self, distr, amt_samples):
        return torch.ones((amt_samples,) + tuple(distr.batch_shape))

    def weighting_function(self, distr, amt_samples):
        return torch.full((amt_samples,), 2.0)

    def gradient_function(self, tensor):
        return log_prob(tensor)


def test_the_proposal_draws_through_its_delegate():
    method = AlwaysOne("x", n_samples=3)
    assert method.sampling_method.delegate is method
    assert method.sampling_method.mc_sample is None  # nothing installed behind the user's back
    x = method(Bernoulli(torch.tensor([0.2, 0.7])))
    assert x._tensor.tolist() == [[1.0, 1.0]] * 3
    assert x.plates[0].weight._tensor.tolist() == [2.0, 2.0, 2.0]
    storch.reset()


def test_an_explicit_mc_hook_takes_precedence_over_the_delegate():
    method = AlwaysOne("x", n_samples=2)
    method.sampling_method.set_mc_sample(lambda distr, plates, n: torch.zeros((n,) + tuple(distr.batch_shape)))
    assert method(Bernoulli(torch.tensor([0.5])))._tensor.tolist() == [[0.0], [0.0]]
    storch.reset()


def test_a_method_is_not_a_submodule_of_its_proposal():
    method = AlwaysOne("x", n_samples=2)
    assert [name for name, _ in method.named_modules()] == ["", "sampling_method"]
    assert "delegate" not in dict(method.sampling_method.named_children())


@pytest.mark.parametrize("clone", ["deepcopy", "pickle"])
def test_methods_with_a_delegate_copy_and_keep_it(clone):
    method = AlwaysOne("x", n_samples=2)
    if clone == "deepcopy":
        other = copy.deepcopy(method)
    else:
        buffer = io.BytesIO()
        torch.save(method, buffer)
        buffer.seek(0)
        other = torch.load(buffer, weights_only=False)
        assert pickle.loads(pickle.dumps(method)).sampling_method.delegate is not method
    assert other is not method and other.sampling_method.delegate is other
    assert other(Bernoulli(torch.tensor([0.5])))._tensor.tolist() == [[1.0], [1.0]]
    storch.reset()


def test_a_proposal_without_delegate_samples_the_distribution():
    sampler = MonteCarlo("z", 4)
    assert sampler.delegate is None
    torch.manual_seed(0)
    x = sampler(Normal(torch.zeros(2), 1.0), (), False)
    torch.manual_seed(0)
    assert torch.equal(x, Normal(torch.zeros(2), 1.0).sample((4,)))


def test_n_samples_is_a_field_of_every_proposal():
    assert ScoreFunction("z", n_samples=5).n_samples == 5
    assert ScoreFunction("z", sampling_method=Enumerate("z")).n_samples == 1  # not fixed in advance
    assert Enumerate("z").n_samples == 1


# ---------------------------------------------------------------- joint bounds
class JointScore(ScoreFunction):
    """A score function that declares it handles multi-sample bounds (and records the call)."""

    handles_joint_bound = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds = []

    def on_joint_bound(self, cost_name, plate, log_w, later=()):
        self.bounds.append((cost_name, plate.name, tuple(log_w.shape), tuple(later)))


def test_iwae_bound_asks_the_method_not_its_type():
    mu = torch.tensor(0.3, requires_grad=True)
    method = JointScore("z", n_samples=4)
    z = method(Normal(mu, 1.0))
    bound = iwae_bound(-(z - 1.0) ** 2, z, name="bound")
    assert method.bounds == [("bound", "z", (4,), ())]
    assert bound.plates == []
    storch.backward()
    assert mu.grad is not None and torch.isfinite(mu.grad)


def test_iwae_bound_refuses_a_method_that_does_not_handle_it():
    z = ScoreFunction("z", n_samples=4)(Normal(torch.tensor(0.3, requires_grad=True), 1.0))
    with pytest.raises(ValueError, match="credits each sample with its own cost"):
        iwae_bound(-(z - 1.0) ** 2, z)
    storch.reset()


# ---------------------------------------------------------------- RELAX's REBAR term
def test_the_rebar_term_is_a_strategy_not_a_flag():
    relax = RELAX("z", control_variate=torch.nn.Linear(3, 1), n_samples=2)
    rebar = REBAR("z", n_samples=2)
    both = RELAX("z", control_variate=torch.nn.Linear(3, 1), n_samples=2, rebar=True)
    assert relax.relaxed_cost is NO_RELAXED_COST and not relax.rebar and relax.group_size == 1
    assert rebar.relaxed_cost is REBAR_TERM and rebar.rebar and rebar.group_size == 3
    assert both.relaxed_cost is REBAR_TERM and both.eta is not None and relax.eta is None
    assert "rebar=True" in repr(both) and "rebar=False" in repr(relax)
    with pytest.raises(AttributeError):
        relax.rebar = True  # read-only: the term is chosen at construction
    z = rebar(OneHotCategorical(logits=torch.zeros(3, requires_grad=True)))
    assert z.shape == (6, 3) and z.plates[0].weight._tensor.tolist() == [0.5, 0.0, 0.0, 0.5, 0.0, 0.0]
    storch.reset()


# ---------------------------------------------------------------- typed fields
def test_plate_info_is_a_declared_field():
    plate = Plate("z", 3)
    assert plate.info is None
    plate.info = {"beam scores": [1.0]}
    assert plate.info == {"beam scores": [1.0]}
    with pytest.raises(AttributeError):
        plate.something_else = 1  # slots: no attribute can be stuck onto a plate


def test_cost_names_are_typed_fields():
    p = torch.tensor(0.5, requires_grad=True)
    x = storch.method.Expect("x")(Bernoulli(p))
    storch.add_cost(x * 2.0, "twice")
    [cost] = storch.registered_costs()
    assert type(cost) is storch.CostTensor and cost.name == "twice"
    storch.reset()


def test_gsb_hidden_leaves_are_kept_by_the_rule_not_on_the_samples():
    from storch.extend import node_of
    from storch.method import GSB
    from storch.method.gsb import leaf_of

    mu = torch.tensor(0.2, requires_grad=True)
    z = GSB("z", n_samples=3)(Normal(mu, 1.0))
    samples = node_of(z).samples
    assert not hasattr(samples, "_gsb_leaf")  # nothing stuck onto the tensor
    leaf = leaf_of(z)
    assert leaf.requires_grad and leaf.grad_fn is None and leaf.shape == samples.shape
    with pytest.raises(RuntimeError, match="no differentiable leaf"):
        leaf_of(ScoreFunction("y", n_samples=2)(Normal(mu, 1.0)))  # not drawn by GSB's rule
    storch.reset()
