"""Building methods and samplers (issue 9, items 7 and 13).

* Sample counts (``n_samples``, ``k``, ``budget``, ...) are checked by one helper,
  :func:`storch.sampling.method.check_count`: ``2.5`` is an error naming the class, the plate and the
  argument, never truncated to 2; integer-like values (NumPy integers, 0-dim integer tensors) work.
* ``ScoreFunction("z", 8)``, the manual's spelling, means ``n_samples=8``; any other non-sampler in
  that slot is a clear ``TypeError``; methods with other signatures take or refuse a count clearly.
* Every method pickles, deep-copies and round-trips through ``torch.save``/``torch.load``, also
  after training steps and while a node it sampled is still alive, and the copy still trains.
* ``storch.make_left_broadcastable(nn.LSTMCell(...))`` runs a recurrent cell over plated inputs with
  a tuple ``(h, c)`` state (the sequence tutorial, docs/tutorials/sequences.md).
"""

from __future__ import annotations

import copy
import functools
import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch
import storch.method as M
from storch.method import (
    ARM, DisARM, Expect, GSB, GumbelRao, GumbelSoftmax, Infer, LAX, LocalExpectation, MVD, REBAR, RELAX,
    RaoBlackwellSF, ReinMax, Reparameterization, ScoreFunction, ScoreFunctionWOR, SPSA, StraightThrough,
    UnorderedSetEstimator, UnorderedSetGumbelSoftmax, VIMCO, DoubleControlVariate,
)
from storch.method.cumulants import cumulants
from storch.method.rao_blackwell import SumAndSampleRest
from storch.sampling import (
    Enumerate, GumbelSoftmaxWOR, ImportanceSampling, MCDecoder, MonteCarlo, SampleWithoutReplacement, UnorderedSet,
)
from storch.sampling.method import check_count

# =============================================================================== A: counts

BAD_TYPES = [2.5, 2.0, True, "2", None, torch.tensor(2.0), torch.tensor([2]), np.float64(3.0)]


def test_check_count_accepts_integers_and_integer_likes():
    for value in (3, np.int64(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.uint8)):
        n = check_count(value, "n_samples", "ScoreFunction('z')")
        assert n == 3 and type(n) is int
    assert check_count(2, "n_samples", "VIMCO('z')", minimum=2) == 2


@pytest.mark.parametrize("value", BAD_TYPES, ids=repr)
def test_check_count_refuses_non_integers(value):
    with pytest.raises(TypeError, match=r"^ScoreFunction\('z'\): n_samples must be a positive int, got "):
        check_count(value, "n_samples", "ScoreFunction('z')")


def test_check_count_message_and_range():
    with pytest.raises(TypeError) as info:
        check_count(2.5, "n_samples", "ScoreFunction('z')")
    assert str(info.value) == "ScoreFunction('z'): n_samples must be a positive int, got 2.5 (float)."
    for value in (0, -3, np.int64(0)):
        with pytest.raises(ValueError, match=r"ScoreFunction\('z'\): n_samples must be at least 1, got"):
            check_count(value, "n_samples", "ScoreFunction('z')")


def _cv() -> nn.Module:
    return nn.Linear(3, 1)


#: (id, owner shown in errors, argument name, constructor taking the count)
COUNTED = [
    # methods: n_samples
    *[(cls.__name__, cls.__name__, "n_samples", functools.partial(lambda c, v: c("z", n_samples=v), cls))
      for cls in (ScoreFunction, Reparameterization, GumbelSoftmax, Infer, StraightThrough, GumbelRao, ReinMax,
                  ARM, DisARM, MVD, SPSA, LocalExpectation, GSB, REBAR, DoubleControlVariate)],
    ("ARMS", "ARMS", "n_samples", lambda v: M.ARMS("z", n_samples=v)),
    ("ARMSMultiSample", "ARMSMultiSample", "n_samples", lambda v: M.ARMSMultiSample("z", n_samples=v)),
    ("ARSM", "ARSM", "n_samples", lambda v: M.ARSM("z", n_samples=v)),
    ("CARMS", "CARMS", "n_samples", lambda v: M.CARMS("z", n_samples=v)),
    ("VIMCO", "VIMCO", "n_samples", lambda v: VIMCO("z", n_samples=v)),
    ("LAX", "LAX", "n_samples", lambda v: LAX("z", _cv(), n_samples=v)),
    ("RELAX", "RELAX", "n_samples", lambda v: RELAX("z", _cv(), n_samples=v)),
    # methods: other counts
    ("Expect.budget", "Expect", "budget", lambda v: Expect("z", budget=v)),
    ("ScoreFunctionWOR.k", "ScoreFunctionWOR", "k", lambda v: ScoreFunctionWOR("z", k=v)),
    ("UnorderedSetEstimator.k", "UnorderedSetEstimator", "k", lambda v: UnorderedSetEstimator("z", k=v)),
    ("UnorderedSetGumbelSoftmax.k", "UnorderedSetGumbelSoftmax", "k", lambda v: UnorderedSetGumbelSoftmax("z", k=v)),
    ("RaoBlackwellSF.k", "RaoBlackwellSF", "k", lambda v: RaoBlackwellSF("z", k=v)),
    ("RaoBlackwellSF.n_sampled", "RaoBlackwellSF", "n_sampled", lambda v: RaoBlackwellSF("z", k=2, n_sampled=v)),
    ("GumbelRao.n_relaxed", "GumbelRao", "n_relaxed", lambda v: GumbelRao("z", n_relaxed=v)),
    ("GSB.max_exact_batch", "GSB", "max_exact_batch", lambda v: GSB("z", max_exact_batch=v)),
    # samplers
    ("MonteCarlo", "MonteCarlo", "n_samples", lambda v: MonteCarlo("z", v)),
    ("ImportanceSampling", "ImportanceSampling", "n_samples", lambda v: ImportanceSampling("z", v, Normal(0.0, 2.0))),
    ("Enumerate", "Enumerate", "budget", lambda v: Enumerate("z", v)),
    ("SampleWithoutReplacement", "SampleWithoutReplacement", "k", lambda v: SampleWithoutReplacement("z", v)),
    ("UnorderedSet", "UnorderedSet", "k", lambda v: UnorderedSet("z", v)),
    ("GumbelSoftmaxWOR", "GumbelSoftmaxWOR", "k", lambda v: GumbelSoftmaxWOR("z", v)),
    ("MCDecoder", "MCDecoder", "k", lambda v: MCDecoder("z", v)),
    ("SumAndSampleRest.k", "SumAndSampleRest", "k", lambda v: SumAndSampleRest("z", v)),
    ("SumAndSampleRest.n_sampled", "SumAndSampleRest", "n_sampled", lambda v: SumAndSampleRest("z", 2, v)),
]


@pytest.mark.parametrize("owner,arg,build", [c[1:] for c in COUNTED], ids=[c[0] for c in COUNTED])
def test_non_integer_counts_are_errors_naming_class_plate_and_argument(owner, arg, build):
    for value in (2.5, 2.0, True, "2", None):
        with pytest.raises(TypeError) as info:
            build(value)
        message = str(info.value)
        assert message.startswith(f"{owner}('z'): "), message
        assert f"{arg} must be a positive int, got {value!r} ({type(value).__name__})" in message, message
    with pytest.raises(ValueError, match=rf"^{owner}\('z'\): {arg} must be at least|n_samples >= 2"):
        build(0)


@pytest.mark.parametrize("owner,arg,build", [c[1:] for c in COUNTED], ids=[c[0] for c in COUNTED])
def test_integer_like_counts_are_accepted_as_ints(owner, arg, build):
    for value in (3, np.int64(3), torch.tensor(3)):
        built = build(value)
        stored = getattr(built, arg, None)
        if stored is None:  # counts kept by the proposal (n_samples of a method, budget of Expect)
            stored = getattr(built.sampling_method, arg)
        assert stored == 3 and type(stored) is int, (owner, arg, stored)


def test_cumulant_order_is_checked_too():
    with pytest.raises(TypeError, match=r"cumulants: the order must be a positive int, got 2.5 \(float\)"):
        cumulants(Normal(0.0, 1.0), 2.5)
    assert len(cumulants(Normal(0.0, 1.0), np.int64(2))) == 2


def test_n_samples_is_not_truncated_anywhere():
    """The issue's case: n_samples=2.5 used to give 2 samples silently."""
    with pytest.raises(TypeError, match=r"ScoreFunction\('z'\): n_samples must be a positive int, got 2.5"):
        ScoreFunction("z", n_samples=2.5)
    with pytest.raises(TypeError, match=r"ARM\('b'\): n_samples must be a positive int, got 2.0 \(float\)"):
        ARM("b", n_samples=2.0)


# ------------------------------------------------------ the sampling_method slot: ScoreFunction("z", 8)

#: methods whose second positional argument is ``sampling_method``
SLOT = [ScoreFunction, Reparameterization, GumbelSoftmax, Infer, StraightThrough, GumbelRao, ReinMax]


@pytest.mark.parametrize("cls", SLOT, ids=lambda c: c.__name__)
def test_positional_int_in_the_sampling_method_slot_is_n_samples(cls):
    for value in (8, np.int64(8), torch.tensor(8)):
        method = cls("z", value)
        assert method.n_samples == 8 and type(method.sampling_method) is MonteCarlo
        assert method.sampling_method.n_samples == 8
    assert cls("z", 8, n_samples=8).n_samples == 8  # the same value twice is fine
    for other in (1, 4):  # an explicit n_samples=1 is told apart from the default
        with pytest.raises(ValueError, match=rf"{cls.__name__}\('z'\): n_samples is given twice, as the second "
                                             rf"argument \(8\) and as n_samples={other}"):
            cls("z", 8, n_samples=other)


@pytest.mark.parametrize("cls", SLOT, ids=lambda c: c.__name__)
def test_other_objects_in_the_sampling_method_slot_are_type_errors(cls):
    name = cls.__name__
    for value in ("8", True, nn.Linear(2, 2), Normal(0.0, 1.0), [8]):
        with pytest.raises(TypeError, match=rf"^{name}\('z'\): the second argument, sampling_method, must be a "
                                            r"storch.sampling.SamplingMethod \(or the number of samples as an int"):
            cls("z", value)
    with pytest.raises(TypeError, match=rf"^{name}\('z'\): n_samples \(given as the second argument\) must be a "
                                        r"positive int, got 2.5 \(float\)"):
        cls("z", 2.5)
    with pytest.raises(ValueError, match="at least 1"):
        cls("z", 0)


def test_manual_spelling_runs_and_estimates():
    p = torch.tensor([0.3, 0.6], requires_grad=True)
    x = ScoreFunction("x", 8)(Bernoulli(p))  # used to fail: "'int' object is not callable"
    assert x.shape == (8, 2) and x.plates[0].size == 8
    storch.add_cost(x.sum(-1), "f")
    storch.backward()
    assert p.grad is not None and torch.isfinite(p.grad).all()


def test_positional_count_reaches_the_sub_methods_and_baseline_checks():
    infer = Infer("z", 3)
    assert infer.reparameterization.n_samples == 3 and infer.score_function.n_samples == 3
    assert type(infer.score_function.baseline).__name__ == "BatchAverageBaseline"
    with pytest.raises(ValueError, match="at least 2 samples"):  # checked at construction, as with n_samples=1
        ScoreFunction("z", 1, baseline_factory="batch_average")
    assert ScoreFunction("z", 2, baseline_factory="batch_average").n_samples == 2
    # a real sampling method is still taken as one
    assert ScoreFunction("z", MonteCarlo("z", 5)).n_samples == 5


def test_methods_with_other_signatures_take_or_refuse_a_positional_count_clearly():
    # the second argument is the count itself
    for cls in (ARM, DisARM, MVD, SPSA, LocalExpectation, GSB, VIMCO, REBAR, DoubleControlVariate, M.ARMS,
                M.ARMSMultiSample):
        assert cls("z", 3).n_samples == 3, cls
        with pytest.raises(TypeError, match=rf"^{cls.__name__}\('z'\): n_samples must be a positive int, got "
                                            r"a MonteCarlo module \(MonteCarlo\)"):
            cls("z", MonteCarlo("z", 3))
    assert Expect("z", 8).sampling_method.budget == 8  # Expect(plate, budget)
    assert ScoreFunctionWOR("z", 3).k == 3 and UnorderedSetEstimator("z", 3).k == 3
    assert UnorderedSetGumbelSoftmax("z", 3).k == 3 and RaoBlackwellSF("z", 3).sampling_method.k == 3
    # RELAX and LAX take the control variate second
    for cls in (RELAX, LAX):
        with pytest.raises(TypeError, match=rf"{cls.__name__}\('z'\): the second argument, control_variate, must be "
                                            r"an nn.Module .* got int\. The number of samples is the third "
                                            rf"argument: {cls.__name__}\('z', c_phi, n_samples=8\)"):
            cls("z", 8)
        assert cls("z", _cv(), 4).n_samples == 4


# =============================================================================== B: copies and pickles


def _bernoulli() -> Bernoulli:
    return Bernoulli(logits=torch.tensor([0.3, -0.2, 0.5], requires_grad=True))


def _one_hot() -> OneHotCategorical:
    return OneHotCategorical(logits=torch.tensor([0.1, -0.3, 0.4, 0.0], requires_grad=True))


def _normal() -> Normal:
    return Normal(torch.tensor([0.2, -0.1, 0.4], requires_grad=True), torch.tensor(1.0))


#: every method class of storch.method, built as a model would build it, with a distribution it supports
METHODS = {
    "ScoreFunction": (lambda: ScoreFunction("z", 2, baseline_factory="moving_average"), _bernoulli),
    "Reparameterization": (lambda: Reparameterization("z", n_samples=2), _normal),
    "Expect": (lambda: Expect("z"), _bernoulli),
    "Infer": (lambda: Infer("z", n_samples=2), _bernoulli),
    "GumbelSoftmax": (lambda: GumbelSoftmax("z", n_samples=2, annealing_rate=1e-2), _one_hot),
    "GumbelSparseMax": (lambda: M.GumbelSparseMax("z", n_samples=2, annealing_rate=1e-2), _one_hot),
    "GumbelEntmax": (lambda: M.GumbelEntmax("z", n_samples=2), _bernoulli),
    "ARM": (lambda: ARM("z", n_samples=2), _bernoulli),
    "DisARM": (lambda: DisARM("z", n_samples=2), _bernoulli),
    "DoubleControlVariate": (lambda: DoubleControlVariate("z", n_samples=2), _bernoulli),
    "ARMS": (lambda: M.ARMS("z", n_samples=3), _bernoulli),
    "ARSM": (lambda: M.ARSM("z", n_samples=2), _one_hot),
    "CARMS": (lambda: M.CARMS("z", n_samples=3), _one_hot),
    "CoupledCategorical": (lambda: M.CoupledCategorical("z", n_samples=2), _one_hot),
    "CoupledCategoricalIW": (lambda: M.CoupledCategoricalIW("z", n_samples=2), _one_hot),
    "ARMSMultiSample": (lambda: M.ARMSMultiSample("z", n_samples=2), _bernoulli),
    "MVD": (lambda: MVD("z", n_samples=2), _normal),
    "SPSA": (lambda: SPSA("z", n_samples=2), _normal),
    "LocalExpectation": (lambda: LocalExpectation("z", n_samples=2), _bernoulli),
    "StraightThrough": (lambda: StraightThrough("z", n_samples=2), _one_hot),
    "GumbelRao": (lambda: GumbelRao("z", n_samples=2), _one_hot),
    "ReinMax": (lambda: ReinMax("z", n_samples=2), _one_hot),
    "GappedStraightThrough": (lambda: M.GappedStraightThrough("z", n_samples=2, gap="p"), _one_hot),
    "VIMCO": (lambda: VIMCO("z", n_samples=3), _normal),
    "ScoreFunctionWOR": (lambda: ScoreFunctionWOR("z", k=2), _one_hot),
    "RaoBlackwellSF": (lambda: RaoBlackwellSF("z", k=2), _one_hot),
    "LAX": (lambda: LAX("z", control_variate=_cv(), n_samples=2), _normal),
    "RELAX": (lambda: RELAX("z", control_variate=_cv(), n_samples=2,
                            optimizer_factory=functools.partial(torch.optim.Adam, lr=1e-2)), _bernoulli),
    "REBAR": (lambda: REBAR("z", n_samples=2), _bernoulli),
    "UnorderedSetEstimator": (lambda: UnorderedSetEstimator("z", k=2), _one_hot),
    "UnorderedSetGumbelSoftmax": (lambda: UnorderedSetGumbelSoftmax("z", k=2), _one_hot),
    "GSB": (lambda: GSB("z", n_samples=2), _normal),
    "MAPO": (lambda: M.MAPO("z", n_samples=2, buffer_size=2, systematic_exploration=True), _one_hot),
    "Auto": (lambda: M.Auto("z", budget=4, candidates=["ScoreFunction + batch_average", "DisARM"], visits=1), _bernoulli),
}


def test_every_method_class_is_covered():
    exported = {
        getattr(M, name) for name in M.__all__
        if isinstance(getattr(M, name), type) and issubclass(getattr(M, name), M.Method) and getattr(M, name) is not M.Method
    }
    assert {c.__name__ for c in exported} == set(METHODS)


class Model(nn.Module):
    """A model holding a method, as in the issue (module level: torch.save pickles it by reference)."""

    def __init__(self, method: M.Method) -> None:
        super().__init__()
        self.method = method
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, distr):
        z = self.method(distr)
        target = torch.arange(z.shape[-1], dtype=torch.float32) / z.shape[-1]
        return z, (self.scale * (z - target) ** 2).sum(-1)


def _step(model: Model, distr_factory) -> storch.Tensor:
    """One training step; the sampled node is returned (kept alive by the caller)."""
    z, cost = model(distr_factory())
    storch.add_cost(cost, "f")
    storch.backward()
    return z


def _round_trip(model: Model) -> Model:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _assert_same_state(a, b) -> None:
    """Tensors equal by ``assert_close``, other leaves (the labels and reasons in `Auto`'s record) by ``==``."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_state(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("name", list(METHODS))
def test_methods_pickle_deepcopy_and_save_after_training_steps(name):
    build, distr = METHODS[name]
    model = Model(build())
    pickle.loads(pickle.dumps(model))  # before any step
    copy.deepcopy(model)
    z = _step(model, distr)
    z = _step(model, distr)  # a second step, with the node of the first one freed
    # the last node is still alive (its draws, records and graph too): copies leave them out
    copies = [copy.deepcopy(model), _round_trip(model), pickle.loads(pickle.dumps(model)), copy.deepcopy(model.method)]
    del z
    for other in copies:
        method = other.method if isinstance(other, Model) else other
        assert type(method) is type(model.method) and method is not model.method
        assert method.n_samples == model.method.n_samples
        assert method.sampling_method is not model.method.sampling_method
        # the state kept between steps travels with the copy
        _assert_same_state(dict(method.state_dict()), dict(model.method.state_dict()))
        storch.reset()
        model_of_copy = other if isinstance(other, Model) else Model(other)
        z2 = _step(model_of_copy, distr)  # the copy still trains
        assert z2.plates[0].name == "z"
    # and the original is unaffected
    _step(model, distr)


def test_copied_learned_control_variate_keeps_its_trained_state_and_optimizer():
    build, distr = METHODS["RELAX"]
    model = Model(build())
    for _ in range(3):
        _step(model, distr)
    loaded = _round_trip(model)
    method = loaded.method
    torch.testing.assert_close(method.network.weight, model.method.network.weight)
    assert method._optimizer is not None and method._optimizer is not model.method._optimizer
    opt_params = [p for group in method._optimizer.param_groups for p in group["params"]]
    assert all(any(p is q for q in method.control_variate_parameters()) for p in opt_params)
    assert len(method._optimizer.state) == len(model.method._optimizer.state) > 0
    assert method._draws == {} and method._snapshots == []
    before = method.network.weight.detach().clone()
    original = model.method.network.weight.detach().clone()
    _step(loaded, distr)
    assert not torch.equal(before, method.network.weight)  # its own optimizer stepped the loaded copy
    assert torch.equal(original, model.method.network.weight)  # and not the original


@pytest.mark.parametrize("name", ["RELAX", "REBAR", "LAX"])
def test_learned_control_variates_copy_in_the_middle_of_a_step(name):
    """Between the forward pass and storch.backward the draws hold tensors with autograd history."""
    build, distr = METHODS[name]
    model = Model(build())
    _step(model, distr)
    z, cost = model(distr())
    assert model.method._draws  # the live node's draws
    clone = copy.deepcopy(model)
    saved = _round_trip(model)
    assert clone.method._draws == {} and saved.method._draws == {}
    storch.add_cost(cost, "f")
    storch.backward()  # the original finishes its step
    storch.reset()
    _step(saved, distr)


def test_relax_without_rebar_frees_its_draws():
    """The draw used to hold the samples themselves (its own key), so it was never freed."""
    model = Model(RELAX("z", control_variate=_cv(), n_samples=2))
    for _ in range(3):
        z = _step(model, _bernoulli)
        del z
    import gc

    gc.collect()
    assert model.method._draws == {}


def test_the_mc_hooks_are_bound_methods():
    for name in ("ARM", "GumbelSoftmax", "REBAR", "MVD"):
        method = METHODS[name][0]()
        sampler = method.sampling_method
        assert sampler.delegate is method
        for hook in (sampler.mc_sample, sampler.mc_weighting_function):
            assert hook is None or getattr(hook, "__self__", None) is method


# =============================================================================== C: recurrent cells


def _sequence(n: int = 3, batch: int = 2, steps: int = 4, features: int = 4):
    """A plated input sequence ``(n, N, T, F)`` on sample plate ``z``, and its mean parameter."""
    mu = torch.randn(batch, steps, features).requires_grad_()
    return mu, Reparameterization("z", n_samples=n)(Normal(mu, 1.0))


def test_bare_lstm_cell_refuses_a_plated_batched_input():
    """Why the sequence tutorial wraps the cell: nn.LSTMCell checks input.dim() in Python."""
    _, xs = _sequence()
    with pytest.raises(ValueError, match="Expected input to be 1D or 2D, got 3D"):
        nn.LSTMCell(4, 5)(xs[..., 0, :])


@pytest.mark.parametrize("initial", ["none", "plain", "plated"])
def test_lstm_cell_over_a_plated_sequence_with_batch_dims(initial):
    n, batch, steps, features, hidden = 3, 2, 4, 4, 5
    mu, xs = _sequence(n, batch, steps, features)
    cell = nn.LSTMCell(features, hidden)
    rnn = storch.make_left_broadcastable(cell, batch_dims=1)
    if initial == "none":
        state = None
    elif initial == "plain":
        state = (torch.zeros(batch, hidden), torch.randn(batch, hidden))
    else:  # a state that already carries the plate, e.g. from an encoder over the samples
        state = tuple(storch.denote_independent(torch.randn(n, batch, hidden), 0, "z2") for _ in range(2))
    # reference: the bare cell on the plain flattened tensors
    raw = xs._tensor.detach()
    if state is None:
        ref = None
    elif initial == "plain":
        ref = tuple(s.expand(n, batch, hidden).reshape(n * batch, hidden) for s in state)
    for t in range(steps):
        out = rnn(xs[..., t, :], state)
        assert isinstance(out, tuple) and len(out) == 2
        h, c = out
        expected_plates = ["z2", "z"] if initial == "plated" else ["z"]
        for s in (h, c):
            assert isinstance(s, storch.Tensor)
            assert s.plate_names == expected_plates
            lead = (n, n) if initial == "plated" else (n,)
            assert s.shape == lead + (batch, hidden)
        if initial != "plated":
            with torch.no_grad():
                ref = cell(raw[:, :, t, :].reshape(n * batch, features), ref)
            torch.testing.assert_close(h._tensor.detach(), ref[0].reshape(n, batch, hidden))
            torch.testing.assert_close(c._tensor.detach(), ref[1].reshape(n, batch, hidden))
        state = (h, c)
    storch.add_cost((state[0] ** 2).sum(-1).sum(-1) + state[1].sum(-1).sum(-1), "f")
    storch.backward()
    for grad in (mu.grad, cell.weight_ih.grad, cell.weight_hh.grad):
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert mu.grad.shape == (batch, steps, features)


def test_lstm_cell_with_the_minibatch_as_a_plate():
    """batch_dims=0 (the default): the minibatch is a plate, flattened with the sample plate."""
    data = storch.denote_independent(torch.randn(2, 4), 0, "data")
    mu = torch.zeros(4, requires_grad=True)
    cell = nn.LSTMCell(4, 5)
    rnn = storch.make_left_broadcastable(cell)
    state = None
    for t in range(3):
        x_t = Reparameterization(f"x{t}", n_samples=3)(Normal(data + mu, 1.0))
        state = rnn(x_t, state)
        assert state[0].plate_names[-1] == "data" and f"x{t}" in state[0].plate_names
        assert state[0].shape[-2:] == (2, 5) and state[1].shape == state[0].shape
    storch.add_cost(state[0].sum(-1), "f")
    storch.backward()
    assert mu.grad is not None and mu.grad.abs().sum() > 0 and cell.weight_ih.grad is not None


def test_readme_sequence_example_with_beam_search():
    """The sequence tutorial's recurrent decoder: a wrapped LSTMCell over the beams of ScoreFunctionWOR."""
    n_data, vocab, emb_dim, hidden, k = 2, 4, 3, 5, 2
    cell = storch.make_left_broadcastable(nn.LSTMCell(emb_dim, hidden))
    embed, readout = nn.Embedding(vocab, emb_dim), nn.Linear(hidden, vocab)
    method = ScoreFunctionWOR("seq", k=k)
    context = storch.denote_independent(torch.randn(n_data, vocab), 0, "data")
    token = method(Categorical(logits=context))
    state = None
    for _ in range(2):
        state = cell(embed(token), state)
        assert state[0].plate_names == ["seq", "data"] and state[0].shape == (k, n_data, hidden)
        assert state[1].plate_names == ["seq", "data"]
        token = method(Categorical(logits=readout(state[0]) + context))
    storch.add_cost((token == 1).float(), "ones")
    storch.backward()
    assert readout.weight.grad is not None and torch.isfinite(readout.weight.grad).all()


def test_batch_dims_mismatch_and_bad_value_are_clear_errors():
    _, xs = _sequence(3, 2, 1, 4)
    rnn = storch.make_left_broadcastable(nn.LSTMCell(4, 5), batch_dims=1)
    with pytest.raises(ValueError, match=r"batch_dims=1 .* same 1 batch dimension"):
        rnn(xs[..., 0, :], (torch.zeros(7, 5), torch.zeros(7, 5)))
    with pytest.raises(ValueError, match="batch_dims must be an int >= 0"):
        storch.make_left_broadcastable(nn.LSTMCell(4, 5), batch_dims=-1)
    decorated = storch.make_left_broadcastable(batch_dims=1)(nn.LSTMCell(4, 5))
    assert decorated(xs[..., 0, :])[0].shape == (3, 2, 5)
