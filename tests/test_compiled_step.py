"""``storch.compile_step``: a step traced once, then replayed as a graph of torch operations.

* A replayed step is the eager step, bit for bit, for the same seed (estimate, ``.grad``, buffers),
  over several steps, for the core estimators and for every method class that it accepts; the
  others are refused with :class:`storch.exceptions.CompileStepError` (pinned list, with reasons).
* Replayed estimates pass the unbiasedness test against the exact gradient.
* Checks survive the replay: ``torch.distributions`` validation and the finite-loss check raise the
  eager errors, and the step's gradients are not applied.
* What a replay cannot reproduce is refused by name: host reads (with the line), stateful
  estimators, tensors that require grad outside the given modules, storch tensors in or out.
* Estimators whose state lives in buffers and parameters updated in place within the step (annealed
  temperatures; RELAX, REBAR and LAX with their optimizer's step; the learned critics) are replayed;
  their own tests are ``tests/test_compiled_state_*.py``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Normal, OneHotCategorical

import problems  # tests/problems.py (on the path through conftest)
import storch
import storch._compile.checks
import storch.method as M
from storch.exceptions import CompileStepError, NonFiniteCostError
from storch.method import ARM, MVD, DisARM, Expect, LocalExpectation, Reparameterization, ScoreFunction
from storch.testing import assert_unbiased
from test_compile import DISCRETE  # noqa: E402  (tests/ is on the path through conftest)

#: the core discrete estimators of tests/test_compile.py (the moving-average baseline keeps its state
#: in buffers updated in place: replayed too)
STATELESS = dict(DISCRETE)


class SBN(nn.Module):
    """A small sigmoid belief network 8-[3] with a learned prior (sbn-linear in miniature)."""

    def __init__(self, method: M.Method) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.decoder = nn.Linear(8, 3), nn.Linear(3, 8)
        self.prior = nn.Parameter(torch.zeros(3))
        self.method = method

    def step(self, x: torch.Tensor) -> torch.Tensor:
        x = storch.denote_independent(x, 0, "data")
        q = Bernoulli(logits=self.encoder(x))
        z = self.method(q)
        log_px = Bernoulli(logits=self.decoder(z)).log_prob(x).sum(-1)
        log_pz = Bernoulli(logits=self.prior).log_prob(z).sum(-1)
        storch.add_cost(-(log_px + log_pz - q.log_prob(z).sum(-1)), "neg_elbo")
        return storch.backward()


DATA = (torch.rand(4, 8, generator=torch.Generator().manual_seed(1)) < 0.5).float()


def _steps(model: nn.Module, step, steps: int = 3, zero_grad: bool = True, data: torch.Tensor = DATA) -> list:
    """Per step (seeded): the estimate, the gradients that exist, and the parameters and buffers after it
    (an estimator's own optimizer updates its parameters and its state buffers within the step)."""
    out = []
    for i in range(steps):
        if zero_grad:
            model.zero_grad()
        torch.manual_seed(100 + i)
        estimate = step(data)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        out.append([estimate.clone()] + grads + state)
    return out


def _compare_with_eager(make, data: torch.Tensor = DATA, zero_grad: bool = True, **compile_options):
    """Run the step of two models from ``make()`` eagerly and under compile_step (with
    ``compile_options``), three steps each with the same seeds; require the same estimates and
    gradients. Returns the compiled step, the compiled model and its steps' results."""
    eager_model, compiled_model = make(), make()
    eager = _steps(eager_model, eager_model.step, zero_grad=zero_grad, data=data)
    compiled_step = storch.compile_step(compiled_model.step, compiled_model, **compile_options)
    compiled = _steps(compiled_model, compiled_step, zero_grad=zero_grad, data=data)
    _assert_identical(eager, compiled)
    return compiled_step, compiled_model, compiled


def _assert_identical(eager: list, compiled: list) -> None:
    """The same draws and values; up to rounding, since the trace records some operations in
    decomposed form (a linear layer on a 3-D input as a view and a matrix product) whose float
    rounding differs from the fused eager kernel by an ulp or so."""
    for e_step, c_step in zip(eager, compiled, strict=True):
        for e, c in zip(e_step, c_step, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(STATELESS))
def test_replayed_steps_equal_the_eager_steps(name):
    compiled_step, compiled_model, _ = _compare_with_eager(lambda: SBN(STATELESS[name]()))
    # one trace (the first step), then replays; a moving average makes its buffers in the first step
    assert compiled_step.traces == (2 if name == "score_function_moving_average" else 1)
    compiled_model.zero_grad()
    code = compiled_step.graph(DATA).code  # the graph as replayed: no renaming detach left
    assert "aten.addmm" in code and "aten.detach" not in code  # one trace (the first step), then replays


def test_gradients_accumulate_as_in_eager_mode_when_not_zeroed():
    """Without zero_grad the incoming .grad is an input of the graph: steps accumulate as eagerly."""
    compiled_step, _, _ = _compare_with_eager(lambda: SBN(ARM("z", n_samples=2)), zero_grad=False)
    assert compiled_step.traces == 2  # without .grad (the first step), then with it


class ZeroingSBN(SBN):
    """The step zeroes the gradients itself (as ``benchmarks/sbn_step.py`` does)."""

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.zero_grad(set_to_none=True)
        return super().step(x)


def test_zero_grad_inside_the_step_is_replayed():
    _compare_with_eager(lambda: ZeroingSBN(ScoreFunction("z", n_samples=2)), zero_grad=False)


def test_a_replay_draws_fresh_samples():
    model = SBN(ScoreFunction("z", n_samples=3))
    step = storch.compile_step(model.step, model)
    estimates = {float(step(DATA)) for _ in range(6)}
    assert len(estimates) > 1


class Replicated(nn.Module):
    """``repeats`` copies of a parameter on an independent plate, for one-pass unbiasedness tests."""

    def __init__(self, value: torch.Tensor, repeats: int) -> None:
        super().__init__()
        self.copies = nn.Parameter(value.detach().unsqueeze(0).repeat((repeats,) + (1,) * value.dim()))
        self.repeats = repeats

    def estimates(self) -> torch.Tensor:
        return self.copies.grad * self.repeats


@pytest.mark.parametrize("name", list(STATELESS))
def test_a_replayed_step_is_unbiased(name):
    """Each stateless discrete estimator, replayed (not the traced call), on tests/problems.py's
    Bernoulli problem: f = sum_i (x_i - t_i)^2, d/dphi exact."""
    problem = problems.bernoulli(interaction=0.0)
    holder = Replicated(problem.phi, 4000)
    method = STATELESS[name]()
    model = problem.model(method)

    def step():
        model(storch.denote_independent(holder.copies, 0, "replicate"))
        return storch.backward()

    compiled = storch.compile_step(step, holder, method)
    for _ in range(2):  # traces (a moving average makes its buffers in the first step: two traces)
        holder.zero_grad()
        compiled()
    traces = compiled.traces
    holder.zero_grad()
    compiled()  # a replay
    assert compiled.traces == traces <= 2
    assert_unbiased(holder.estimates(), problem.exact(), label=f"replayed {name}")


def test_a_replayed_reparameterized_step_equals_the_eager_step():
    class Gaussian(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = nn.Parameter(torch.tensor([0.5, -1.0]))

        def step(self, target):
            x = Reparameterization("x", n_samples=4)(Normal(self.mu, 1.0))
            storch.add_cost(((x - target) ** 2).sum(-1), "f")
            return storch.backward()

    _compare_with_eager(Gaussian, data=torch.tensor([1.0, 0.0]))


# ----------------------------------------------------------------------------- every method class
def _cv() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


#: every method class, in a configuration a model would use, with its distribution family
METHOD_CLASSES = {
    "ScoreFunction": (lambda: ScoreFunction("z", 2, baseline_factory="batch_average"), "bernoulli"),
    "Reparameterization": (lambda: Reparameterization("z", n_samples=2), "normal"),
    "Expect": (lambda: Expect("z"), "bernoulli"),
    "Infer": (lambda: M.Infer("z", n_samples=2), "bernoulli"),
    "GumbelSoftmax": (lambda: M.GumbelSoftmax("z", n_samples=2, annealing_rate=0.1), "one_hot"),
    "GumbelSparseMax": (lambda: M.GumbelSparseMax("z", n_samples=2, annealing_rate=0.1), "one_hot"),
    "GumbelEntmax": (lambda: M.GumbelEntmax("z", n_samples=2, annealing_rate=0.1), "bernoulli"),
    "ARM": (lambda: ARM("z", n_samples=2), "bernoulli"),
    "DisARM": (lambda: DisARM("z", n_samples=2), "bernoulli"),
    "DoubleControlVariate": (lambda: M.DoubleControlVariate("z", n_samples=2), "bernoulli"),
    "ARMS": (lambda: M.ARMS("z", n_samples=3), "bernoulli"),
    "ARSM": (lambda: M.ARSM("z", n_samples=2), "one_hot"),
    "CARMS": (lambda: M.CARMS("z", n_samples=3), "one_hot"),
    "CoupledCategorical": (lambda: M.CoupledCategorical("z", n_samples=2), "one_hot"),
    "CoupledCategoricalIW": (lambda: M.CoupledCategoricalIW("z", n_samples=2), "one_hot"),
    "ARMSMultiSample": (lambda: M.ARMSMultiSample("z", n_samples=2), "bernoulli"),
    "MVD": (lambda: MVD("z", n_samples=2), "normal"),
    "SPSA": (lambda: M.SPSA("z", n_samples=2), "normal"),
    "LocalExpectation": (lambda: LocalExpectation("z", n_samples=2), "bernoulli"),
    "StraightThrough": (lambda: M.StraightThrough("z", n_samples=2), "one_hot"),
    "GumbelRao": (lambda: M.GumbelRao("z", n_samples=2), "one_hot"),
    "ReinMax": (lambda: M.ReinMax("z", n_samples=2), "one_hot"),
    "GappedStraightThrough": (lambda: M.GappedStraightThrough("z", n_samples=2), "one_hot"),
    "VIMCO": (lambda: M.VIMCO("z", n_samples=3), "normal"),
    "ScoreFunctionWOR": (lambda: M.ScoreFunctionWOR("z", k=2), "one_hot"),
    "RaoBlackwellSF": (lambda: M.RaoBlackwellSF("z", k=2), "one_hot"),
    "LAX": (lambda: M.LAX("z", control_variate=_cv(), n_samples=2), "normal"),
    "RELAX": (lambda: M.RELAX("z", control_variate=_cv(), n_samples=2,
                              optimizer_factory=functools.partial(torch.optim.Adam, lr=1e-2, fused=True)), "bernoulli"),
    "REBAR": (lambda: M.REBAR("z", n_samples=2), "bernoulli"),
    "UnorderedSetEstimator": (lambda: M.UnorderedSetEstimator("z", k=2), "one_hot"),
    "UnorderedSetGumbelSoftmax": (lambda: M.UnorderedSetGumbelSoftmax("z", k=2), "one_hot"),
    "GSB": (lambda: M.GSB("z", n_samples=2), "normal"),
    "MAPO": (lambda: M.MAPO("z", n_samples=2, buffer_size=2, systematic_exploration=True), "one_hot"),
    "Auto": (lambda: M.Auto("z", budget=2), "bernoulli"),
}

#: the method classes compile_step refuses, and the words of the reason it gives
REFUSED = {
    # it resets the generator for its common random numbers (its declared StepState.host reason)
    "SPSA": r"SPSA\('z'\) keeps state between steps that a replay cannot follow: it reads the random generator's",
    # its plate's size, its memory's growth and its sampling path are read from its memory on the host
    "MAPO": r"MAPO\('z'\) keeps state between steps that a replay cannot follow: its plate holds the longest",
    # it chooses its candidate on the host, from the gradients and times of earlier steps
    "Auto": r"Auto\('z'\) keeps state between steps that a replay cannot follow: Auto chooses its candidate",
}


class MethodModel(nn.Module):
    """A method and the distribution parameters it trains, as module parameters."""

    def __init__(self, build, family: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.method = build()
        self.family = family
        size = 4 if family == "one_hot" else 3
        self.param = nn.Parameter(torch.randn(size) * 0.3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def distribution(self):
        if self.family == "bernoulli":
            return Bernoulli(logits=self.param)
        if self.family == "one_hot":
            return OneHotCategorical(logits=self.param)
        return Normal(self.param, torch.ones(()))

    def step(self, target: torch.Tensor) -> torch.Tensor:
        z = self.method(self.distribution())
        storch.add_cost((self.scale * (z - target[: z.shape[-1]]) ** 2).sum(-1), "f")
        return storch.backward()


def test_every_method_class_is_in_the_sweep():
    exported = {
        getattr(M, name) for name in M.__all__
        if isinstance(getattr(M, name), type) and issubclass(getattr(M, name), M.Method) and getattr(M, name) is not M.Method
    }
    assert {c.__name__ for c in exported} == set(METHOD_CLASSES)


@pytest.mark.parametrize("name", list(METHOD_CLASSES))
def test_every_method_class_is_replayed_exactly_or_refused(name):
    build, family = METHOD_CLASSES[name]
    target = torch.tensor([0.1, 0.6, 0.3, 0.9])
    compiled_model = MethodModel(build, family)
    compiled_step = storch.compile_step(compiled_model.step, compiled_model)
    if name in REFUSED:
        with pytest.raises(CompileStepError, match=REFUSED[name]):
            compiled_step(target)
        return
    eager_model = MethodModel(build, family)
    _assert_identical(_steps(eager_model, eager_model.step, steps=4, data=target),
                      _steps(compiled_model, compiled_step, steps=4, data=target))


# ----------------------------------------------------------------------------- checks at replay
class Probabilities(nn.Module):
    """A step whose Bernoulli probabilities come from the data (validated by torch.distributions)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def step(self, p: torch.Tensor) -> torch.Tensor:
        # validate_args explicitly: once torch.compile has run in a process (test_compile.py), torch
        # turns the default off
        z = ScoreFunction("z", n_samples=2)(Bernoulli(probs=p * self.scale * 2, validate_args=True))
        storch.add_cost(torch.log(p).sum() + z.sum(-1), "f")
        return storch.backward()


def test_distribution_validation_still_raises_in_a_replay_and_no_gradient_is_applied():
    model = Probabilities()
    step = storch.compile_step(model.step, model)
    step(torch.tensor([0.2, 0.4]))  # the trace
    step(torch.tensor([0.3, 0.1]))  # a replay
    before = model.scale.grad.clone()
    with pytest.raises(ValueError, match=r"Expected parameter probs .* Bernoulli.* constraint"):
        step(torch.tensor([0.3, 1.5]))  # probs 1.5
    assert torch.equal(model.scale.grad, before)  # unchanged: the failed step applied nothing


def test_a_non_finite_cost_in_a_replay_names_the_cost_and_applies_nothing():
    model = Probabilities()
    step = storch.compile_step(model.step, model)
    step(torch.tensor([0.2, 0.4]))
    before = model.scale.grad.clone()
    with pytest.raises(NonFiniteCostError, match=r"'f' at 2 of 2 values"):
        step(torch.tensor([0.0, 0.4]))
    assert torch.equal(model.scale.grad, before)


# ----------------------------------------------------------------------------- refused, by name
def test_a_host_read_in_the_step_is_refused_with_its_line():
    model = SBN(ScoreFunction("z", n_samples=2))

    def step(x):
        if x.sum() > 0:  # a branch on a value
            x = x * 1.0
        return model.step(x)

    with pytest.raises(CompileStepError, match=r"reads a tensor's value on the host at .*test_compiled_step.py:\d+ "
                                               r"\(step\): if x.sum\(\) > 0"):
        storch.compile_step(step, model)(DATA)
    assert storch.registered_costs() == ()


class Counting(ScoreFunction):
    """A method with an update of its own, which keeps a Python counter: stateful."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts = [0]

    def update_parameters(self, result_triples):
        super().update_parameters(result_triples)
        self.counts[0] += 1


def test_a_stateful_estimator_is_refused_before_anything_is_applied():
    model = MethodModel(lambda: Counting("z", n_samples=2), "bernoulli")
    with pytest.raises(CompileStepError, match=r"Counting\('z'\) keeps state between steps"):
        storch.compile_step(model.step, model)(torch.tensor([0.1, 0.6, 0.3, 0.9]))
    assert all(p.grad is None for p in model.parameters())
    assert model.method.counts == [0]  # not updated


def test_a_moving_average_baseline_is_replayed_with_its_updates():
    """Its averages are buffers updated in place in the step: every replay updates them as eagerly."""

    def make():
        return SBN(ScoreFunction("z", n_samples=2, baseline_factory="moving_average"))

    reference, after_one = make(), make()
    _steps(reference, reference.step)  # three eager steps
    _steps(after_one, after_one.step, steps=1)
    _, compiled_model, _ = _compare_with_eager(make)  # three compiled steps (estimates, grads as eager)
    average = compiled_model.method.baseline.averages["neg_elbo"]
    torch.testing.assert_close(average, reference.method.baseline.averages["neg_elbo"])
    assert not torch.equal(average, after_one.method.baseline.averages["neg_elbo"])  # replays moved it


def test_annealed_temperatures_and_trained_control_variates_keep_no_state_outside_buffers():
    assert not M.GumbelSoftmax("z", annealing_rate=1e-2).keeps_state_between_steps
    assert not M.GumbelSoftmax("z").keeps_state_between_steps
    assert not M.REBAR("z").keeps_state_between_steps
    assert not M.LAX("z", control_variate=_cv()).keeps_state_between_steps


def test_a_subclass_with_its_own_update_counts_as_stateful():
    assert Counting("z", n_samples=2).keeps_state_between_steps
    assert not ScoreFunction("z", n_samples=2).keeps_state_between_steps


def test_a_captured_tensor_that_requires_grad_is_refused():
    model = SBN(ScoreFunction("z", n_samples=2))
    outside = torch.tensor(1.0, requires_grad=True)

    def step(x):
        return model.step(x * outside)

    with pytest.raises(CompileStepError, match=r"shape \(\) that requires grad but is not a parameter"):
        storch.compile_step(step, model)(DATA)


def test_a_parameter_of_a_module_not_given_is_refused():
    model = SBN(ScoreFunction("z", n_samples=2))
    with pytest.raises(CompileStepError, match="is not a parameter of the modules given"):
        storch.compile_step(model.step, model.encoder)(DATA)


def test_storch_tensors_in_or_out_and_leftover_costs_are_refused():
    model = SBN(ScoreFunction("z", n_samples=2))
    plated = storch.denote_independent(DATA, 0, "data")
    with pytest.raises(CompileStepError, match="an argument is a storch tensor"):
        storch.compile_step(model.step, model)(plated)

    def returns_plated(x):
        model.step(x)
        return storch.denote_independent(x, 0, "data")

    with pytest.raises(CompileStepError, match="returns a storch tensor"):
        storch.compile_step(returns_plated, model)(DATA)

    def no_backward(x):
        storch.add_cost(storch.denote_independent(model.encoder(x), 0, "data").sum(-1), "left")

    with pytest.raises(CompileStepError, match=r"costs \['left'\] were registered by the step, which did not call storch.backward"):
        storch.compile_step(no_backward, model)(DATA)
    assert storch.registered_costs() == ()
    no_backward(DATA)  # eagerly: a cost left over
    with pytest.raises(CompileStepError, match=r"costs \['left'\] are registered before the step runs"):
        storch.compile_step(model.step, model)(DATA)
    storch.reset()


def test_bad_arguments_are_clear_errors():
    model = SBN(ScoreFunction("z", n_samples=2))
    with pytest.raises(TypeError, match="after the step come the nn.Modules it trains, got str"):
        storch.compile_step(model.step, "inductor")
    with pytest.raises(Exception, match="no_such_backend"):  # torch.compile's own error, before any step
        storch.compile_step(model.step, model, backend="no_such_backend")
    with pytest.raises(CompileStepError, match="requires grad"):
        storch.compile_step(model.step, model)(DATA.clone().requires_grad_())
    with pytest.raises(CompileStepError, match="not hashable"):
        storch.compile_step(lambda x, options: model.step(x), model)(DATA, bytearray(b"options"))


# ----------------------------------------------------------------------------- traces and buffers
def test_a_new_shape_or_a_new_value_is_a_new_trace():
    model = SBN(ScoreFunction("z", n_samples=2))

    def step(x, flip):
        return model.step(1 - x if flip else x)

    compiled = storch.compile_step(step, model)
    for x, flip in [(DATA, False), (DATA, False), (DATA[:3], False), (DATA, True), (DATA[:3], False)]:
        model.zero_grad()
        compiled(x, flip)
    assert compiled.traces == 3  # a smaller last minibatch, another value of the flag
    assert "rsub" in compiled.graph(DATA, True).code and "rsub" not in compiled.graph(DATA, False).code


class Normalised(nn.Module):
    """A step through BatchNorm (running statistics updated in place) and a step counter buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.BatchNorm1d(8)
        self.encoder = nn.Linear(8, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def step(self, x):
        self.steps += 1
        x = storch.denote_independent(self.norm(x), 0, "data")
        z = ARM("z", n_samples=2)(Bernoulli(logits=self.encoder(x)))
        storch.add_cost(((z - 0.5) ** 2).sum(-1), "f")
        return storch.backward()


def test_buffers_updated_in_place_are_updated_by_every_replay():
    eager_model = Normalised()
    _steps(eager_model, eager_model.step)
    _, compiled_model, _ = _compare_with_eager(Normalised)
    for e, c in zip(eager_model.buffers(), compiled_model.buffers(), strict=True):
        assert torch.equal(e, c)
    assert int(compiled_model.steps) == 3


def test_the_inductor_backend_computes_the_eager_step():
    """Generated kernels (C++ on the CPU): the same draws with fallback_random, values up to rounding."""
    import torch._inductor.config as inductor_config

    eager_model, compiled_model = SBN(ScoreFunction("z", n_samples=2)), SBN(ScoreFunction("z", n_samples=2))
    eager = _steps(eager_model, eager_model.step)
    with inductor_config.patch(fallback_random=True):
        compiled_step = storch.compile_step(compiled_model.step, compiled_model, backend="inductor")
        compiled = _steps(compiled_model, compiled_step)
    assert compiled_step.traces == 1
    for e_step, c_step in zip(eager, compiled, strict=True):
        for e, c in zip(e_step, c_step, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


def test_the_step_returns_its_result_structure():
    model = SBN(ScoreFunction("z", n_samples=2))

    def step(x):
        loss = model.step(x)
        return {"loss": loss, "pair": (loss * 2, None), "label": "elbo", "count": 3}

    compiled = storch.compile_step(step, model)
    for _ in range(2):
        out = compiled(DATA)
        assert set(out) == {"loss", "pair", "label", "count"}
        assert out["pair"][1] is None and out["label"] == "elbo" and out["count"] == 3
        assert torch.equal(out["pair"][0], out["loss"] * 2)
        assert not re.search("storch", type(out["loss"]).__module__)


class Counter(nn.Module):
    """A value computed before and after an update in place of a buffer: the replay must not merge
    the two computations (they are the same operation on the same tensor, a different value)."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.tensor([0.3, -0.2]))
        self.register_buffer("count", torch.ones(()))

    def step(self, target):
        before = self.count * 2.0
        self.count.add_(1.0)
        after = self.count * 2.0
        x = Reparameterization("x", n_samples=2)(Normal(self.mu, 1.0))
        storch.add_cost(((x - target) ** 2).sum(-1) * before + after, "f")
        return storch.backward()


def test_repeated_operations_are_not_merged_across_an_update_in_place():
    compiled_step, compiled_model, _ = _compare_with_eager(Counter, data=torch.tensor([1.0, 0.0]))
    assert int(compiled_model.count) == 4
    code = compiled_step.graph(torch.tensor([1.0, 0.0])).code
    assert code.count("aten.mul") >= 2  # both products are computed


class Categorical(nn.Module):
    """A step through torch's OneHotCategorical.sample (F.one_hot inside) and an F.one_hot of data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.logits = nn.Parameter(torch.randn(2, 3))

    def step(self, labels: torch.Tensor) -> torch.Tensor:
        z = ScoreFunction("z", n_samples=3, baseline_factory="batch_average")(OneHotCategorical(logits=self.logits))
        target = torch.nn.functional.one_hot(labels, 3).to(z.dtype)
        storch.add_cost(((z - target) ** 2).sum((-2, -1)), "f")
        return storch.backward()


def test_one_hot_categorical_steps_replay_without_host_reads():
    _compare_with_eager(Categorical, data=torch.tensor([2, 0]))


def test_the_range_check_of_f_one_hot_survives_the_replay():
    model = Categorical()
    step = storch.compile_step(model.step, model)
    step(torch.tensor([2, 0]))
    with pytest.raises(RuntimeError, match=r"F.one_hot: every class index must lie in \[0, 3\)"):
        step(torch.tensor([3, 0]))
    with pytest.raises(RuntimeError, match=r"F.one_hot: every class index must lie in \[0, 3\)"):
        storch.compile_step(model.step, model)(torch.tensor([3, 0]))  # in the traced call too


def test_fresh_tensors_written_in_place_are_not_merged():
    """Two equal computations whose results are then written differently stay two tensors."""

    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = nn.Parameter(torch.tensor([0.3, -0.2]))

        def step(self, target):
            a = target * 2.0
            b = target * 2.0
            a.add_(1.0)
            b.sub_(1.0)
            x = Reparameterization("x", n_samples=2)(Normal(self.mu, 1.0))
            storch.add_cost(((x - a) ** 2).sum(-1) + (b ** 2).sum(), "f")
            return storch.backward()

    _compare_with_eager(Written, data=torch.tensor([1.0, 0.0]))


def test_a_python_setting_changed_by_the_step_is_refused_and_one_changed_between_calls_retraces():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = nn.Parameter(torch.tensor([0.3, -0.2]))
            self.weight = 1.0  # a Python setting the step reads
            self.calls = 0

        def step(self, target):
            x = Reparameterization("x", n_samples=2)(Normal(self.mu, 1.0))
            storch.add_cost(self.weight * ((x - target) ** 2).sum(-1), "f")
            return storch.backward()

        def counting_step(self, target):
            self.calls += 1
            return self.step(target)

    model = Scaled()
    target = torch.tensor([1.0, 0.0])
    with pytest.raises(CompileStepError, match=r"changes the Python settings \['calls'\] of its module Scaled"):
        storch.compile_step(model.counting_step, model)(target)
    compiled = storch.compile_step(model.step, model)
    model.zero_grad()
    compiled(target)
    first = model.mu.grad.clone()
    model.weight = 2.0  # between calls: a new trace, not the old graph with the old weight
    model.zero_grad()
    torch.manual_seed(5)
    compiled(target)
    assert compiled.traces == 2
    model.train(False)  # .eval() too
    model.zero_grad()
    compiled(target)
    assert compiled.traces == 3
    assert not torch.equal(first, model.mu.grad)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["score_function", "arm"])
def test_replayed_steps_follow_the_eager_steps_on_each_device(name, device):
    _, _, compiled = _compare_with_eager(lambda: SBN(STATELESS[name]()).to(device), data=DATA.to(device))
    assert all(t.device.type == device for step in compiled for t in step)


@pytest.mark.parametrize(("device", "zero_grad"), [
    ("cpu", True), pytest.param("cuda", True, marks=CUDA), pytest.param("cuda", False, marks=CUDA),
])
def test_cuda_graphs_replay_the_eager_steps(device, zero_grad):
    """``mode="reduce-overhead"``: on a GPU replays run as CUDA graphs, whose memory the next replay
    reuses. The gradients and results a replay hands out are its own: still valid after the next
    replay, also when a step accumulates into the incoming ``.grad``. (On the CPU TorchInductor runs
    the graph without CUDA graphs; the replay takes the same path.)"""
    from torch._inductor import config as inductor_config

    data = DATA.to(device)
    with inductor_config.patch(fallback_random=True):  # eager mode's random numbers
        step, model, _ = _compare_with_eager(
            lambda: SBN(ARM("z", n_samples=2)).to(device), data=data, zero_grad=zero_grad,
            backend="inductor", mode="reduce-overhead",
        )
        assert step._cache and all(trace.cuda_graphs for trace in step._cache.values())
        if zero_grad:
            model.zero_grad()
        estimate = step(data)
        grad, kept = model.encoder.weight.grad, model.encoder.weight.grad.clone()
        if zero_grad:
            model.zero_grad()
        step(data)
    assert torch.equal(grad, kept) and torch.isfinite(estimate)  # neither overwritten by the replay


class Scales(nn.Module):
    """A Normal whose scale comes from the data (validated: it must be positive)."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.tensor([0.3, -0.2]))

    def step(self, scale: torch.Tensor) -> torch.Tensor:
        x = Reparameterization("x", n_samples=2)(Normal(self.mu, scale, validate_args=True))
        storch.add_cost(((x - 1.0) ** 2).sum(-1), "f")
        return storch.backward()


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_validation_in_a_replay_raises_on_each_device(device, deferred, monkeypatch):
    """On the CPU an assertion in the graph; on a GPU (and here, with ``deferred``, on the CPU too)
    an output read after the step."""
    if deferred:
        monkeypatch.setattr(storch._compile.checks, "ASSERTED_DEVICES", frozenset())
    model = Scales().to(device)
    step = storch.compile_step(model.step, model)
    step(torch.tensor([1.0, 2.0], device=device))
    before = model.mu.grad.clone()
    with pytest.raises(ValueError, match=r"Expected parameter scale .* Normal.* GreaterThan"):
        step(torch.tensor([1.0, -2.0], device=device))
    assert torch.equal(model.mu.grad, before)
    record = next(iter(step._cache.values())).record
    assert len(record.deferred) == (2 if deferred or device != "cpu" else 0)  # loc and scale
    assert all(check.error is ValueError for check in record.deferred)


def test_validation_survives_the_inductor_backend():
    """A graph given to torch.compile gets its checks as outputs (a compiler may drop assertions)."""
    model = Scales()
    step = storch.compile_step(model.step, model, backend="inductor")
    step(torch.tensor([1.0, 2.0]))
    step(torch.tensor([1.0, 3.0]))  # a replay through the compiled graph
    before = model.mu.grad.clone()
    with pytest.raises(ValueError, match=r"Expected parameter scale .* Normal.* GreaterThan"):
        step(torch.tensor([1.0, -2.0]))
    assert torch.equal(model.mu.grad, before)


def test_many_traces_are_warned_about_once():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = nn.Parameter(torch.zeros(()))

        def step(self, target):
            x = Reparameterization("x", n_samples=1)(Normal(self.mu.expand(target.shape), 1.0))
            storch.add_cost(((x - target) ** 2).sum(-1), "f")
            return storch.backward()

    model = Tiny()
    compiled = storch.compile_step(model.step, model)
    with pytest.warns(UserWarning, match=r"traced 9 graphs for one step") as caught:
        for n in range(1, storch.compiled_step.MAX_TRACES + 3):
            model.zero_grad()
            compiled(torch.zeros(n))
    assert compiled.traces == storch.compiled_step.MAX_TRACES + 2
    assert sum("graphs for one step" in str(w.message) for w in caught) == 1


def test_a_tensor_updated_in_place_outside_the_given_modules_is_refused():
    """A counter kept as a plain tensor attribute enters the graph as a constant: refused (a buffer
    of a given module is an input and is updated by every replay: test_buffers_...)."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = nn.Parameter(torch.tensor([0.3, -0.2]))
            self.count = torch.zeros(())  # not a buffer

        def step(self, target):
            self.count.add_(1.0)
            x = Reparameterization("x", n_samples=2)(Normal(self.mu, 1.0))
            storch.add_cost(((x - target) ** 2).sum(-1), "f")
            return storch.backward()

    model = Counting()
    with pytest.raises(CompileStepError, match=r"updates in place \(aten.add_.Tensor\) a tensor of shape \(\) "
                                               r"that is not an input"):
        storch.compile_step(model.step, model)(torch.tensor([1.0, 0.0]))



class Clipped(nn.Module):
    """A step that clips its parameter in place after the backward pass (a projection step)."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.tensor([0.3, -0.2]))

    def step(self, target: torch.Tensor) -> torch.Tensor:
        x = Reparameterization("x", n_samples=2)(Normal(self.mu, 1.0))
        storch.add_cost(((x - target) ** 2).sum(-1), "f")
        estimate = storch.backward()
        with torch.no_grad():
            self.mu.sub_(0.1 * self.mu.grad).clamp_(-0.25, 0.25)
        return estimate


def test_a_parameter_updated_in_place_within_the_step_is_updated_by_every_replay():
    eager, compiled = Clipped(), Clipped()
    step = storch.compile_step(compiled.step, compiled)
    _assert_identical(_steps(eager, eager.step, steps=4, data=torch.tensor([1.0, -1.0])),
                      _steps(compiled, step, steps=4, data=torch.tensor([1.0, -1.0])))
    assert step.traces == 1 and compiled.mu.abs().max() <= 0.25


def test_an_argument_updated_in_place_is_refused():
    model = SBN(ScoreFunction("z", n_samples=2))

    def step(x):
        x.mul_(1.0)  # the caller's data
        return model.step(x)

    with pytest.raises(CompileStepError, match=r"changes 1 of its arguments in place \(shapes \[\(4, 8\)\]"):
        storch.compile_step(step, model)(DATA.clone())


def test_the_scaling_page_lists_what_compiles_and_what_is_refused():
    """docs/scaling.md's lists are the sweep's: replayed = every class not refused, refused = REFUSED."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "scaling.md").read_text()
    section = page.split("### Which estimators compile", 1)[1].split("\n## ", 1)[0]
    replayed_text, refused_text = section.split("Refused:", 1)
    replayed = set(re.findall(r"`(\w+)`", replayed_text.split("same seed:", 1)[1]))
    refused = set(re.findall(r"^\| `(\w+)` \|", refused_text, flags=re.M))
    assert refused == set(REFUSED)
    assert replayed == set(METHOD_CLASSES) - set(REFUSED)
