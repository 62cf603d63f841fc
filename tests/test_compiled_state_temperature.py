"""Annealed temperatures under ``storch.compile_step``: the schedule lives in buffers updated in place.

``GumbelSoftmax`` and its subclasses keep ``t`` (``annealing_steps``) and ``τ_t = max(τ_min, τ_0 e^{−r t})``
(``temperature``) in buffers that ``anneal`` updates with tensor operations, so the traced step records
the update and every replay anneals as an eager step does:

* replayed steps equal eager steps from the same seed (estimates, ``.grad``, temperature, step count),
  over more steps than it takes to reach ``τ_min``, with one trace;
* a replayed step estimates the gradient of the relaxed objective at the temperature the schedule has
  reached (exact value by quadrature over the logistic noise), not at the temperature of the trace;
* the step count survives ``state_dict`` (``_extra_state``) and the method declares no state between steps.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli

import storch
import storch.method as M
from storch.testing import assert_unbiased, check_unbiased
from test_gapped_straight_through import RelaxedModel  # noqa: E402  (tests/ is on the path through conftest)

pytestmark = pytest.mark.seed(7)

TARGET = torch.tensor([0.1, 0.6, 0.3, 0.9])
ANNEALED = {
    "GumbelSoftmax": lambda: M.GumbelSoftmax("z", n_samples=2, annealing_rate=0.4, min_temperature=0.5),
    "GumbelSoftmax-straight-through": lambda: M.GumbelSoftmax(
        "z", n_samples=2, straight_through=True, annealing_rate=0.4, min_temperature=0.5),
    "GumbelSparseMax": lambda: M.GumbelSparseMax("z", n_samples=2, annealing_rate=0.4, min_temperature=0.5),
    "GumbelEntmax": lambda: M.GumbelEntmax("z", n_samples=2, annealing_rate=0.4, min_temperature=0.5),
}


def _run(model: RelaxedModel, step, steps: int) -> list[list[torch.Tensor]]:
    """Per step (seeded): the estimate, the gradients, the temperature and the step count after it."""
    out = []
    for i in range(steps):
        model.zero_grad()
        torch.manual_seed(100 + i)
        estimate = step(TARGET)
        out.append([estimate.clone(), model.logits.grad.clone(), model.scale.grad.clone(),
                    model.method.temperature.clone(), model.method.annealing_steps.clone()])
    return out


@pytest.mark.parametrize("name", list(ANNEALED))
def test_replayed_steps_anneal_as_eager_steps_do(name):
    eager, compiled = RelaxedModel(ANNEALED[name]()), RelaxedModel(ANNEALED[name]())
    compiled_step = storch.compile_step(compiled.step, compiled)
    expected, got = _run(eager, eager.step, 6), _run(compiled, compiled_step, 6)
    for e_step, c_step in zip(expected, got, strict=True):
        for e, c in zip(e_step, c_step, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    assert compiled_step.traces == 1  # the buffers exist from the start: every later call is a replay
    assert compiled.method.steps == 6
    taus = [float(step[3]) for step in got]
    assert taus[0] == pytest.approx(math.exp(-0.4)) and taus[-1] == pytest.approx(0.5)  # reaches τ_min
    assert not compiled.method.keeps_state_between_steps


def test_the_traced_graph_updates_the_schedule_in_place():
    model = RelaxedModel(ANNEALED["GumbelSoftmax"]())
    code = storch.compile_step(model.step, model).graph(TARGET).code
    assert "aten.add_" in code and "aten.copy_" in code  # t += 1; τ ← max(τ_min, τ_0 e^{−r t})
    assert "_local_scalar_dense" not in code  # no value read back


def test_the_step_count_survives_a_checkpoint_after_compiled_steps():
    model = RelaxedModel(ANNEALED["GumbelSoftmax"]())
    step = storch.compile_step(model.step, model)
    for _ in range(3):
        step(TARGET)
    state = model.method.state_dict()
    assert state["_extra_state"] == {"steps": 3} and "annealing_steps" not in state
    fresh = ANNEALED["GumbelSoftmax"]()
    fresh.load_state_dict(state)
    assert fresh.steps == 3 and torch.equal(fresh.temperature, model.method.temperature)


def test_a_fixed_temperature_stays_fixed_in_replays():
    model = RelaxedModel(M.GumbelSoftmax("z", n_samples=2, initial_temperature=0.7))
    step = storch.compile_step(model.step, model)
    for _ in range(3):
        step(TARGET)
    assert model.method.steps == 0 and float(model.method.temperature) == pytest.approx(0.7)


# ----------------------------------------------------------------------------- unbiasedness
PHI = torch.tensor([0.3, -0.5, 1.0])
BITS_TARGET = torch.tensor([0.49, 0.499, 0.8])


def relaxed_gradient(phi: torch.Tensor, target: torch.Tensor, tau: float, n: int = 400_000) -> torch.Tensor:
    """``∇_φ E_u Σ_d (x_d − t_d)²`` for ``x = σ((φ + log u − log(1 − u)) / τ)``, ``u ~ U(0, 1)``: the
    pathwise derivative ``2 (x − t) x (1 − x) / τ`` averaged by the midpoint rule in ``u``."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    x = torch.sigmoid((phi.double()[:, None] + u.log() - (-u).log1p()) / tau)
    return (2 * (x - target.double()[:, None]) * x * (1 - x) / tau).mean(-1).float()


class Copies(nn.Module):
    """``repeats`` copies of the logits on an independent plate: one estimate per copy per step."""

    def __init__(self, repeats: int) -> None:
        super().__init__()
        self.copies = nn.Parameter(PHI.unsqueeze(0).repeat(repeats, 1))
        self.repeats = repeats


def test_a_replayed_step_estimates_the_relaxed_gradient_at_the_annealed_temperature():
    """Three calls (the trace at τ_0 = 1, replays at e^{−1} and at τ_min = 0.2): the last call's estimates
    are unbiased for the relaxed objective's gradient at 0.2, and biased for the one at τ_0."""
    holder = Copies(6000)
    method = M.GumbelSoftmax("x", n_samples=1, annealing_rate=1.0, min_temperature=0.2)

    def step():
        x = method(Bernoulli(logits=storch.denote_independent(holder.copies, 0, "replicate")))
        storch.add_cost(((x - BITS_TARGET) ** 2).sum(-1), "f")
        return storch.backward()

    compiled = storch.compile_step(step, holder, method)
    for _ in range(3):
        holder.zero_grad()
        compiled()
    assert compiled.traces == 1 and float(method.temperature) == pytest.approx(0.2)
    estimates = holder.copies.grad * holder.repeats
    assert_unbiased(estimates, relaxed_gradient(PHI, BITS_TARGET, 0.2), label="replayed GumbelSoftmax at τ = 0.2")
    assert not check_unbiased(estimates, relaxed_gradient(PHI, BITS_TARGET, 1.0)).passed  # not frozen at τ_0
