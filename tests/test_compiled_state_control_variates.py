"""RELAX, REBAR and LAX under ``storch.compile_step``: the variance step is part of the replayed graph.

The control-variate parameters ``φ`` (network, ``log λ``, ``η``) are parameters of the method and its
optimizer's state (Adam's moments and step count, SGD's momentum) lives in buffers of the method; the
optimizer is bound to whatever tensors fill those slots, so the trace records its update on the graph's
inputs and every replay carries it out (``storch.method.learned_control_variate``, state protocol).

* Replayed steps equal eager steps from the same seed: estimates, the model's gradients, ``φ``, the
  optimizer's state and ``Σ‖ĝ‖²``, over five steps (two traces: the first step makes the state buffers).
* A replayed step, with a control variate trained by earlier replays, is unbiased (exact gradient by
  enumeration).
* An optimizer that reads its step count on the host (Adam without ``fused``/``capturable``) is refused
  by name before anything is applied; a new learning rate is a new trace; a replay that fails its
  finite-cost check leaves ``φ`` and the optimizer's state as they were; checkpoints after compiled
  steps equal those after eager ones.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli

import problems  # tests/problems.py (on the path through conftest)
import storch
import storch.method as M
from storch.exceptions import CompileStepError, NonFiniteCostError
from storch.testing import assert_unbiased
from test_compiled_step import DATA, SBN, MethodModel, _assert_identical, _cv, _steps

pytestmark = pytest.mark.seed(11)

TARGET = torch.tensor([0.1, 0.6, 0.3, 0.9])


def _fused_adam(lr: float):
    return functools.partial(torch.optim.Adam, lr=lr, fused=True)


#: (build the method, model family): "sbn" is the sigmoid belief network of test_compiled_step
TRAINED = {
    "REBAR": (lambda: M.REBAR("z", n_samples=2, lr=0.05), "sbn"),
    "RELAX": (lambda: M.RELAX("z", in_dim=3, n_samples=2, optimizer_factory=_fused_adam(0.05)), "sbn"),
    "RELAX+REBAR, SGD with momentum": (lambda: M.RELAX(
        "z", control_variate=_cv(), n_samples=2, rebar=True,
        optimizer_factory=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)), "sbn"),
    "LAX": (lambda: M.LAX("z", control_variate=_cv(), n_samples=2, lr=0.05), "normal"),
    "RELAX, categorical": (lambda: M.RELAX("z", in_dim=4, n_samples=3, optimizer_factory=_fused_adam(0.05)),
                           "one_hot"),
}


class RelaxedSBN(SBN):
    """test_compiled_step's SBN, whose costs also take relaxed values of ``z`` (REBAR evaluates them there)."""

    def step(self, x: torch.Tensor) -> torch.Tensor:
        x = storch.denote_independent(x, 0, "data")
        q = Bernoulli(logits=self.encoder(x), validate_args=False)
        z = self.method(q)
        log_px = Bernoulli(logits=self.decoder(z), validate_args=False).log_prob(x).sum(-1)
        log_pz = Bernoulli(logits=self.prior, validate_args=False).log_prob(z).sum(-1)
        storch.add_cost(-(log_px + log_pz - q.log_prob(z).sum(-1)), "neg_elbo")
        return storch.backward()


def _model(name: str) -> nn.Module:
    build, family = TRAINED[name]
    torch.manual_seed(0)  # the same control-variate network in every model
    return RelaxedSBN(build()) if family == "sbn" else MethodModel(build, family)


def _data(name: str) -> torch.Tensor:
    return DATA if TRAINED[name][1] == "sbn" else TARGET


@pytest.mark.parametrize("name", list(TRAINED))
def test_replayed_steps_train_the_control_variate_as_eager_steps_do(name):
    eager, compiled = _model(name), _model(name)
    compiled_step = storch.compile_step(compiled.step, compiled)
    trajectory = []

    def recorded(data: torch.Tensor) -> torch.Tensor:
        estimate = compiled_step(data)
        trajectory.append([p.detach().clone() for p in compiled.method.parameters()])
        return estimate

    _assert_identical(_steps(eager, eager.step, steps=5, data=_data(name)),
                      _steps(compiled, recorded, steps=5, data=_data(name)))
    assert compiled_step.traces == 2  # the first step makes the optimizer's state buffers
    assert dict(compiled.method.named_buffers()).keys() == dict(eager.method.named_buffers()).keys()
    assert any(n.startswith("_optimizer_state_") for n, _ in compiled.method.named_buffers())
    moved = [not torch.equal(a, b) for a, b in zip(trajectory[1], trajectory[4])]
    assert all(moved)  # the replays (calls 3 to 5) trained every control-variate parameter
    assert compiled.method.last_squared_gradient_norm > 0
    assert all(p.grad is None for p in compiled.method.parameters())  # cleared, as eagerly


def test_a_replayed_step_is_unbiased_with_a_control_variate_trained_by_replays():
    """RELAX with the REBAR term on tests/problems.py's Bernoulli problem, ``f = Σ (x − t)²``: six
    calls (two traces, then replays that train φ, λ, η), then the last call's estimates against
    the exact gradient by enumeration."""
    problem = problems.bernoulli(interaction=0.0)
    holder = Replicated(problem.phi, 3000)
    method = M.RELAX("x", control_variate=_cv(), n_samples=1, rebar=True, optimizer_factory=_fused_adam(0.05))
    model = problem.model(method)
    initial = [p.detach().clone() for p in method.parameters()]

    def step():
        model(storch.denote_independent(holder.copies, 0, "replicate"))
        return storch.backward()

    compiled = storch.compile_step(step, holder, method)
    for _ in range(6):
        holder.zero_grad()
        compiled()
    assert compiled.traces == 2
    assert all(not torch.equal(a, b) for a, b in zip(initial, method.parameters()))  # trained
    assert_unbiased(holder.copies.grad * holder.repeats, problem.exact(), label="replayed RELAX+REBAR")


class Replicated(nn.Module):
    """``repeats`` copies of a parameter on an independent plate (one estimate per copy)."""

    def __init__(self, value: torch.Tensor, repeats: int) -> None:
        super().__init__()
        self.copies = nn.Parameter(value.detach().unsqueeze(0).repeat((repeats,) + (1,) * value.dim()))
        self.repeats = repeats


# ----------------------------------------------------------------------------- refusals and settings
def test_an_optimizer_that_reads_its_step_count_on_the_host_is_refused_before_anything_is_applied():
    plain_adam = functools.partial(torch.optim.Adam, lr=0.01)
    model = RelaxedSBN(M.RELAX("z", in_dim=3, n_samples=2, optimizer_factory=plain_adam))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CompileStepError, match=r"RELAX\('z'\) trains its control variate within the step, and its "
                                               r"optimizer Adam is built with neither fused=True nor capturable=True"):
        storch.compile_step(model.step, model)(DATA)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert not any(n.startswith("_optimizer_state_") for n, _ in model.method.named_buffers())
    assert storch.registered_costs() == ()
    model.step(DATA)  # eagerly it trains as before


def test_a_fixed_control_variate_needs_no_optimizer():
    torch.manual_seed(0)
    eager = RelaxedSBN(M.RELAX("z", in_dim=3, n_samples=2, train_control_variate=False))
    torch.manual_seed(0)
    compiled = RelaxedSBN(M.RELAX("z", in_dim=3, n_samples=2, train_control_variate=False))
    step = storch.compile_step(compiled.step, compiled)
    _assert_identical(_steps(eager, eager.step, data=DATA), _steps(compiled, step, data=DATA))
    assert step.traces == 1 and compiled.method._optimizer is None


def test_a_new_learning_rate_is_a_new_trace_and_takes_effect():
    model = RelaxedSBN(M.REBAR("z", n_samples=2, lr=0.05))
    step = storch.compile_step(model.step, model)
    for _ in range(3):
        step(DATA)
    assert step.traces == 2
    for group in model.method.optimizer.param_groups:
        group["lr"] = 0.0
    frozen = [p.detach().clone() for p in model.method.parameters()]
    step(DATA)
    assert step.traces == 3  # the learning rate is baked into a graph: a new one is a new graph
    step(DATA)
    assert all(torch.equal(a, b) for a, b in zip(frozen, model.method.parameters()))


class Guarded(nn.Module):
    """REBAR on Bernoulli logits, with a cost that is infinite when the data hold a zero."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.tensor([0.3, -0.2, 0.5]))
        self.method = M.REBAR("z", n_samples=2, lr=0.05)

    def step(self, data: torch.Tensor) -> torch.Tensor:
        z = self.method(Bernoulli(logits=self.logits))
        storch.add_cost(((z - data) ** 2).sum(-1) - torch.log(data).sum(), "f")
        return storch.backward()


def test_a_replay_that_fails_its_checks_leaves_the_control_variate_and_its_optimizer_as_they_were():
    model = Guarded()
    step = storch.compile_step(model.step, model)
    good = torch.tensor([0.2, 0.5, 0.9])
    for _ in range(3):
        step(good)
    before = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    with pytest.raises(NonFiniteCostError, match=r"'f'"):
        step(torch.tensor([0.2, 0.0, 0.9]))
    after = [t.detach() for t in (*model.parameters(), *model.buffers())]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    step(good)  # and it trains on
    assert not torch.equal(before[1], model.method.log_temperature.detach())


# ----------------------------------------------------------------------------- optimizer and checkpoints
def test_the_default_optimizer_is_fused_adam_and_its_state_lives_in_buffers():
    model = RelaxedSBN(M.REBAR("z", n_samples=2, lr=0.05))
    model.step(DATA)
    optimizer = model.method.optimizer
    assert type(optimizer) is torch.optim.Adam and optimizer.param_groups[0]["fused"] is True
    assert M.learned_control_variate.replay_refusal(optimizer) is None
    buffers = dict(model.method.named_buffers())
    for i, param in enumerate(optimizer.param_groups[0]["params"]):
        for key, value in optimizer.state[param].items():
            assert buffers[f"_optimizer_state_{i}_{key}"] is value


def test_a_checkpoint_after_compiled_steps_equals_one_after_eager_steps():
    eager, compiled = _model("RELAX"), _model("RELAX")
    step = storch.compile_step(compiled.step, compiled)
    _steps(eager, eager.step, steps=4)
    _steps(compiled, step, steps=4)
    e_state, c_state = eager.method.state_dict(), compiled.method.state_dict()
    torch.testing.assert_close(c_state, e_state, rtol=1e-5, atol=1e-6)
    assert c_state["_extra_state"]["optimizer"]["state"][0]["step"].item() == 4.0
    resumed = _model("RELAX")
    resumed.load_state_dict(compiled.state_dict())
    resumed_step = storch.compile_step(resumed.step, resumed)
    for i in range(2):  # the same draws: the runs continue alike
        torch.manual_seed(200 + i)
        expected = step(DATA)
        torch.manual_seed(200 + i)
        torch.testing.assert_close(resumed_step(DATA), expected)
    torch.testing.assert_close(dict(resumed.named_parameters()), dict(compiled.named_parameters()))
    torch.testing.assert_close(dict(resumed.named_buffers()), dict(compiled.named_buffers()))
