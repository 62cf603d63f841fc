"""Learned critics under ``storch.compile_step``: a replayed step trains the critic as an eager step does.

Each cost's head holds the network, the target statistics, the last loss and its optimizer's state as
parameters and buffers updated in place (``storch.method.critic``, state protocol). The first call,
in which the critic builds its network (sized by its first input), runs eagerly
(``storch._tracing.EagerStepNeeded``); the next is traced and the others replay the graph.

* Replayed steps equal eager steps from the same seed: estimates, the model's gradients, the networks,
  the target statistics and the optimizers' state, for the value and the Q critic.
* A replayed step with a critic trained by earlier replays is unbiased (exact gradient by enumeration).
* An optimizer that reads its step count on the host is refused by name before anything is applied;
  a checkpoint after compiled steps equals one after eager steps.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import problems  # tests/problems.py (on the path through conftest)
import storch
import storch.method as M
from storch.exceptions import CompileStepError
from storch.method.critic import Critic, QCritic
from storch.testing import assert_unbiased
from test_compiled_step import DATA, SBN, _assert_identical, _steps

pytestmark = pytest.mark.seed(19)

KINDS = {
    "critic": lambda: M.ScoreFunction("z", n_samples=2, baseline_factory=Critic(lr=3e-2)),
    "q_critic": lambda: M.ScoreFunction("z", n_samples=2, baseline_factory=QCritic(lr=3e-2)),
}


def _model(kind: str) -> SBN:
    torch.manual_seed(0)
    return SBN(KINDS[kind]())


@pytest.mark.parametrize("kind", list(KINDS))
def test_replayed_steps_train_the_critic_as_eager_steps_do(kind):
    eager, compiled = _model(kind), _model(kind)
    compiled_step = storch.compile_step(compiled.step, compiled)
    networks = []

    def recorded(data: torch.Tensor) -> torch.Tensor:
        estimate = compiled_step(data)
        networks.append([p.detach().clone() for p in compiled.method.baseline.parameters()])
        return estimate

    _assert_identical(_steps(eager, eager.step, steps=5), _steps(compiled, recorded, steps=5))
    assert compiled_step.traces == 1  # the first call builds the network, eagerly; then one trace
    baseline = compiled.method.baseline
    assert int(baseline.head("neg_elbo").updates) == 5
    assert all(not torch.equal(a, b) for a, b in zip(networks[1], networks[4]))  # the replays trained it
    torch.testing.assert_close(baseline.last_losses["neg_elbo"], eager.method.baseline.last_losses["neg_elbo"])
    assert not baseline.keeps_state_between_steps and not compiled.method.keeps_state_between_steps


def test_the_traced_step_reads_nothing_on_the_host():
    model = _model("critic")
    step = storch.compile_step(model.step, model)
    step(DATA)
    code = step.graph(DATA).code
    assert "_fused_adam_" in code and "_local_scalar_dense" not in code
    assert code.count("aten.copy_") >= 3  # μ, E[S²] and the last loss, in place


class Replicated(nn.Module):
    """``repeats`` copies of each parameter on an independent plate (one estimate per copy)."""

    def __init__(self, values: list[torch.Tensor], repeats: int) -> None:
        super().__init__()
        self.copies = nn.ParameterList(
            [nn.Parameter(v.detach().unsqueeze(0).repeat((repeats,) + (1,) * v.dim())) for v in values]
        )
        self.repeats = repeats


@pytest.mark.parametrize("kind", ["critic", "q_critic"])
def test_a_replayed_step_is_unbiased_with_a_critic_trained_by_replays(kind):
    """Two nested categorical nodes (tests/problems.py), each with its critic: six calls (the eager
    first, a trace, replays that train the critics), then the last call's estimates against the exact
    gradients by enumeration."""
    problem = problems.nested_categorical(3, 3)
    holder = Replicated(list(problem.params), 2000)
    baseline = Critic if kind == "critic" else QCritic
    m1 = M.ScoreFunction("z1", n_samples=1, baseline_factory=baseline(lr=3e-2))
    m2 = M.ScoreFunction("z2", n_samples=2, baseline_factory=baseline(lr=3e-2))
    model = problem.model(m1, m2)

    def step():
        model(*(storch.denote_independent(c, 0, "replicate") for c in holder.copies))
        return storch.backward()

    compiled = storch.compile_step(step, holder, m1, m2)
    for _ in range(6):
        holder.zero_grad()
        compiled()
    assert compiled.traces == 1 and int(m2.baseline.head("f").updates) == 6
    for copies, exact, name in zip(holder.copies, problem.exact(), ("theta1", "theta2")):
        assert_unbiased(copies.grad * holder.repeats, exact, label=f"replayed {kind} {name}")


def test_an_optimizer_that_reads_its_step_count_on_the_host_is_refused_before_anything_is_applied():
    plain_adam = functools.partial(torch.optim.Adam, lr=1e-2)
    torch.manual_seed(0)
    model = SBN(M.ScoreFunction("z", n_samples=2, baseline_factory=Critic(optimizer_factory=plain_adam)))
    step = storch.compile_step(model.step, model)
    step(DATA)  # eager: the critic builds its network
    model.zero_grad()
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    with pytest.raises(CompileStepError, match=r"the Critic of cost 'neg_elbo' trains within the step, and its "
                                               r"optimizer Adam is built with neither fused=True nor capturable"):
        step(DATA)
    assert all(torch.equal(a, b) for a, b in zip(state, (*model.parameters(), *model.buffers()), strict=True))
    assert all(p.grad is None for p in model.parameters())


def _assert_state_close(got: dict, expected: dict) -> None:
    """State dicts equal: tensors up to rounding, other values (sizes, dtype names) exactly."""
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    expected_leaves, expected_spec = torch.utils._pytree.tree_flatten(expected)
    assert got_spec == expected_spec
    for a, b in zip(got_leaves, expected_leaves, strict=True):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert a == b


def test_a_checkpoint_after_compiled_steps_equals_one_after_eager_steps():
    eager, compiled = _model("q_critic"), _model("q_critic")
    step = storch.compile_step(compiled.step, compiled)
    _steps(eager, eager.step, steps=4)
    _steps(compiled, step, steps=4)
    _assert_state_close(compiled.method.state_dict(), eager.method.state_dict())
    resumed = _model("q_critic")
    resumed.load_state_dict(compiled.state_dict())
    resumed_step = storch.compile_step(resumed.step, resumed)
    for i in range(2):  # the same draws: the runs continue alike
        torch.manual_seed(300 + i)
        expected = step(DATA)
        torch.manual_seed(300 + i)
        torch.testing.assert_close(resumed_step(DATA), expected)
    assert resumed_step.traces == 2  # no eager step (the networks exist); the first trace makes last_loss
    torch.testing.assert_close(dict(resumed.named_parameters()), dict(compiled.named_parameters()))
    torch.testing.assert_close(dict(resumed.named_buffers()), dict(compiled.named_buffers()))
