"""The step-state protocol (``storch.state``): what an estimator keeps between steps, and how.

* Every estimator class of ``storch.method`` and ``storch.sampling`` and every baseline declares its
  ``step_state`` (the pinned table lists those that are not ``NONE``), and none inherits the
  ``HOST`` state assumed for an undeclared update.
* A class body that overrides ``update_parameters`` (a baseline's ``update``) without declaring
  ``step_state`` keeps ``HOST`` state: ``storch.compile_step`` refuses it with a message that says how
  to declare it, and applies nothing; declared ``IN_PLACE``, the same class is replayed with its update.
* A composite estimator combines its parts: the refusal names the estimator, the part and the reason.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli

import storch
import storch.method as M
import storch.sampling as S
from storch.exceptions import CompileStepError
from storch.extend import (
    DeclaresStepState,
    StateKind,
    StepState,
    check_replayable,
    step_state_of,
)
from storch.method.baseline import Baseline, BatchAverageBaseline, UpdatesItsBaseline
from storch.method.method import JointBoundRecords
from storch.sampling import MonteCarlo, SamplingMethod

#: the in-tree classes whose own declared state is not NONE (every other class: NONE)
NOT_NONE = {
    "Auto": StateKind.HOST,
    "MAPO": StateKind.HOST,
    "SPSA": StateKind.HOST,
    "GumbelSoftmax": StateKind.IN_PLACE,
    "_GumbelProjection": StateKind.IN_PLACE,
    "GumbelSparseMax": StateKind.IN_PLACE,
    "GumbelEntmax": StateKind.IN_PLACE,
    "LearnedControlVariate": StateKind.IN_PLACE,
    "RELAX": StateKind.IN_PLACE,
    "REBAR": StateKind.IN_PLACE,
    "LAX": StateKind.IN_PLACE,
    "DoubleControlVariate": StateKind.IN_PLACE,
    "MovingAverageBaseline": StateKind.IN_PLACE,
    "Critic": StateKind.IN_PLACE,
    "QCritic": StateKind.IN_PLACE,
    "GumbelSoftmaxWOR": StateKind.IN_PLACE,
}


def _import_all(package) -> None:
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


def _in_tree_classes() -> set[type]:
    """The classes of the protocol defined at the top level of a storch module (not in a doctest)."""
    _import_all(M)
    _import_all(S)
    return {c for c in _subclasses(DeclaresStepState)
            if c.__module__.startswith("storch.") and getattr(sys.modules[c.__module__], c.__name__, None) is c}


# ----------------------------------------------------------------------------- every class declares
def test_every_in_tree_estimator_class_declares_its_state():
    classes = _in_tree_classes()
    exported = {getattr(mod, name) for mod in (M, S) for name in mod.__all__}
    estimators = {c for c in exported if isinstance(c, type) and issubclass(c, (M.Method, SamplingMethod, Baseline))}
    assert estimators and estimators <= classes  # the sweep covers every exported estimator
    undeclared = [c.__qualname__ for c in classes if not c.step_state.declared]
    assert not undeclared, f"classes that override an update hook without declaring step_state: {undeclared}"
    kinds = {c.__name__: c.step_state.kind for c in classes if c.step_state.kind is not StateKind.NONE}
    assert kinds == NOT_NONE


def test_each_in_tree_update_override_is_declared_in_the_same_class_body():
    for cls in _in_tree_classes():
        for hook in cls.state_hooks:
            if hook in vars(cls):
                assert "step_state" in vars(cls), f"{cls.__qualname__} overrides {hook} without declaring step_state"


def test_host_states_say_what_the_host_decides():
    assert "plate holds the longest memory buffer" in M.MAPO.step_state.reason
    assert "random generator's state" in M.SPSA.step_state.reason
    assert all(c.step_state.reason == "" for c in _in_tree_classes() if c.step_state.replayable)


# ----------------------------------------------------------------------------- instances and parts
def test_an_instance_combines_its_class_with_its_parts():
    assert step_state_of(M.ScoreFunction("z", 2)) is StepState.NONE
    assert step_state_of(M.ScoreFunction("z", 2, baseline_factory="batch_average")) is StepState.NONE
    assert step_state_of(M.ScoreFunction("z", 2, baseline_factory="moving_average")) is StepState.IN_PLACE
    assert step_state_of(M.ScoreFunction("z", sampling_method=S.GumbelSoftmaxWOR("z", 2))).kind is StateKind.IN_PLACE
    assert step_state_of(M.MAPO("z", 2)).kind is StateKind.HOST


def test_keeps_state_between_steps_is_derived_from_the_protocol():
    assert M.MAPO("z", 2).keeps_state_between_steps and M.SPSA("z", 2).keeps_state_between_steps
    assert not M.ScoreFunction("z", 2, baseline_factory="moving_average").keeps_state_between_steps
    assert not M.GumbelSoftmax("z", annealing_rate=0.1).keeps_state_between_steps


# ----------------------------------------------------------------------------- class creation
class Counting(M.ScoreFunction):
    """An update of its own that keeps a Python counter, and no declaration."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts = [0]

    def update_parameters(self, result_triples) -> None:
        super().update_parameters(result_triples)
        self.counts[0] += 1


class Ticking(M.ScoreFunction):
    """An update of its own that changes only a buffer, in place: declared ``IN_PLACE``."""

    step_state = StepState.IN_PLACE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("ticks", torch.zeros(()))

    def update_parameters(self, result_triples) -> None:
        super().update_parameters(result_triples)
        self.ticks.add_(1)


def test_an_undeclared_update_counts_as_host_state_decided_at_class_creation():
    state = Counting.step_state
    assert state.kind is StateKind.HOST and not state.declared
    assert "Counting overrides update_parameters without declaring its step_state" in state.reason
    assert "step_state = StepState.IN_PLACE" in state.reason


def test_declarations_are_inherited_and_a_new_undeclared_override_is_host_again():
    class Quiet(Ticking):
        pass

    class Loud(Ticking):
        def update_parameters(self, result_triples) -> None:
            super().update_parameters(result_triples)

    assert Quiet.step_state is StepState.IN_PLACE
    assert Loud.step_state.kind is StateKind.HOST and "Loud overrides update_parameters" in Loud.step_state.reason


def test_a_class_without_its_own_declaration_takes_the_most_restrictive_state_of_its_bases():
    class Joint(JointBoundRecords, M.GumbelSoftmax):
        pass

    class SPSAWithBaseline(UpdatesItsBaseline, M.SPSA):
        pass

    assert Joint.step_state is StepState.IN_PLACE  # NONE (the mixin) and IN_PLACE (the temperature)
    assert SPSAWithBaseline.step_state == M.SPSA.step_state  # a NONE mixin does not hide SPSA's HOST state


def test_bad_declarations_are_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"Bad.step_state must be a storch.extend.StepState"):
        class Bad(M.ScoreFunction):
            step_state = "in place"
    with pytest.raises(ValueError, match="say what the host keeps or decides"):
        StepState.host(" ")
    with pytest.raises(ValueError, match="only HOST state has a reason"):
        StepState(StateKind.IN_PLACE, "buffers")


# ----------------------------------------------------------------------------- compile_step
class Model(nn.Module):
    def __init__(self, method: M.Method) -> None:
        super().__init__()
        self.method = method
        self.logits = nn.Parameter(torch.tensor([0.3, -0.2, 0.1]))

    def step(self, target: torch.Tensor) -> torch.Tensor:
        z = self.method(Bernoulli(logits=self.logits))
        storch.add_cost(((z - target) ** 2).sum(-1), "f")
        return storch.backward()


TARGET = torch.tensor([0.1, 0.6, 0.9])


def test_compile_step_refuses_an_undeclared_update_with_the_fix_and_applies_nothing():
    model = Model(Counting("z", n_samples=2))
    with pytest.raises(CompileStepError, match=r"Counting\('z'\) keeps state between steps that a replay cannot "
                                               r"follow: Counting overrides update_parameters without declaring"):
        storch.compile_step(model.step, model)(TARGET)
    assert model.logits.grad is None and model.method.counts == [0]


def test_a_declared_in_place_update_is_compiled_and_replayed():
    eager, compiled = Model(Ticking("z", n_samples=2)), Model(Ticking("z", n_samples=2))
    step = storch.compile_step(compiled.step, compiled)
    for i in range(3):
        for model, run in ((eager, eager.step), (compiled, step)):
            model.zero_grad()
            torch.manual_seed(i)
            run(TARGET)
        torch.testing.assert_close(compiled.logits.grad, eager.logits.grad)
    assert step.traces == 1
    assert float(compiled.method.ticks) == float(eager.method.ticks) == 3.0  # every replay ticked


class CountingBaseline(BatchAverageBaseline):
    """A baseline whose ``update`` keeps a Python counter, undeclared."""

    def update(self) -> None:
        self.seen = getattr(self, "seen", 0) + 1


class CountingProposal(MonteCarlo):
    """A proposal whose ``update_parameters`` keeps a Python counter, undeclared."""

    def update_parameters(self, result_triples) -> None:
        self.seen = getattr(self, "seen", 0) + 1


def test_a_refusal_names_the_part_that_keeps_host_state():
    with_baseline = M.ScoreFunction("z", 2, baseline_factory=CountingBaseline())
    with pytest.raises(CompileStepError, match=r"ScoreFunction\('z'\) keeps state between steps that a replay "
                                               r"cannot follow, in its part `baseline` \(CountingBaseline\): "
                                               r"CountingBaseline overrides update without declaring"):
        storch.compile_step(Model(with_baseline).step, with_baseline)(TARGET)
    with_proposal = M.ScoreFunction("z", sampling_method=CountingProposal("z", 2))
    with pytest.raises(CompileStepError, match=r"in its part `sampling_method` \(CountingProposal\)"):
        check_replayable(with_proposal)


def test_an_object_outside_the_protocol_counts_as_host_state():
    with pytest.raises(CompileStepError, match=r"object declares no step_state"):
        check_replayable(object())
