"""Checkpoints (issue 11, item 3): a method's ``state_dict`` is its whole state, and a run resumes exactly.

* RELAX, REBAR, LAX: ``state_dict`` holds the control-variate parameters and, under
  ``_extra_state``, the state of the method's own optimizer (built lazily at the first step);
  ``MovingAverageBaseline`` holds its averages there, ``GumbelSoftmax`` its annealing step count.
* Train N steps, save (model + method state dicts, the model's optimizer, torch's RNG state), train
  M more steps: gradients g1. Load into freshly built objects, restore the RNG, train the same M
  steps: gradients g2 == g1 bit for bit. Without the methods' extra state they differ (so the test
  would notice a state that a checkpoint loses).
* Every method class round-trips through ``torch.save`` / ``torch.load(weights_only=True)`` of its
  state dict and then trains exactly like the original; storch-bench's checkpoints are state dicts
  and a RELAX run resumes exactly.
"""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Normal

import storch
from storch.method import LAX, REBAR, RELAX, ScoreFunction
from storch.method.baseline import MovingAverageBaseline

D, H = 4, 3


class Model(nn.Module):
    """``x → q(z | x) → z → ‖dec(z) − x‖²`` over a minibatch, the method inside the model."""

    def __init__(self, method: storch.method.Method, continuous: bool = False) -> None:
        super().__init__()
        self.enc = nn.Linear(D, H)
        self.dec = nn.Linear(H, D)
        self.method = method
        self.continuous = continuous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = storch.denote_independent(x, 0, "data")
        h = self.enc(xs)
        q = Normal(h, 1.0) if self.continuous else Bernoulli(logits=h)
        z = self.method(q)
        return ((self.dec(z) - xs) ** 2).sum(-1)


def _adam(params):
    return torch.optim.Adam(params, lr=0.05)


BUILDERS = {
    "RELAX": lambda: Model(RELAX("z", control_variate=nn.Linear(H, 1), n_samples=2, optimizer_factory=_adam)),
    "REBAR": lambda: Model(REBAR("z", n_samples=2, optimizer_factory=_adam)),
    "LAX": lambda: Model(LAX("z", control_variate=nn.Linear(H, 1), n_samples=2, optimizer_factory=_adam), True),
    "ScoreFunction+moving_average": lambda: Model(
        ScoreFunction("z", n_samples=2, baseline_factory=MovingAverageBaseline(0.5))
    ),
}


def _model_params(model: Model) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not name.startswith("method.")]


def _train(model: Model, opt: torch.optim.Optimizer, steps: int) -> list[torch.Tensor]:
    """``steps`` steps on fresh random minibatches; the model's gradients and the method's
    parameters (and state) after each step, flattened."""
    trace = []
    for _ in range(steps):
        storch.reset()
        opt.zero_grad(set_to_none=True)
        x = torch.randn(5, D)
        storch.add_cost(model(x), "f")
        storch.backward()
        opt.step()
        grads = [p.grad.flatten() for p in _model_params(model)]
        method_state = [t.flatten() for t in model.method.state_dict().values() if isinstance(t, torch.Tensor)]
        averages = getattr(getattr(model.method, "baseline", None), "averages", {})
        trace.append(torch.cat(grads + method_state + [a.flatten() for a in averages.values()]).detach().clone())
    return trace


def _checkpoint(model: Model, opt: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, buffer)
    return buffer.getvalue()


def _resume(name: str, blob: bytes, drop_extra_state: bool = False) -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(12345)  # a different initialisation: everything must come from the checkpoint
    model = BUILDERS[name]()
    opt = torch.optim.Adam(_model_params(model), lr=0.01)
    state = torch.load(io.BytesIO(blob), weights_only=True)
    if drop_extra_state:
        missing = {k for k in state["model"] if k.endswith("_extra_state")}
        assert missing, "the method has no extra state"
        model.load_state_dict({k: v for k, v in state["model"].items() if k not in missing}, strict=False)
    else:
        model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return model, opt


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_resumed_run_continues_exactly(name):
    n_steps, m_steps = 4, 3
    torch.manual_seed(0)
    model = BUILDERS[name]()
    opt = torch.optim.Adam(_model_params(model), lr=0.01)
    _train(model, opt, n_steps)
    blob = _checkpoint(model, opt)
    g1 = _train(model, opt, m_steps)

    resumed, resumed_opt = _resume(name, blob)
    g2 = _train(resumed, resumed_opt, m_steps)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b), (a - b).abs().max()

    # the methods' extra state matters: without it the continuation differs
    lossy, lossy_opt = _resume(name, blob, drop_extra_state=True)
    g3 = _train(lossy, lossy_opt, m_steps)
    assert max((a - b).abs().max().item() for a, b in zip(g1, g3)) > 1e-6


def test_learned_control_variate_state_dict_holds_its_optimizer():
    torch.manual_seed(0)
    model = BUILDERS["RELAX"]()
    assert model.method.state_dict()["_extra_state"] == {"optimizer": None}  # before the first step
    opt = torch.optim.SGD(_model_params(model), lr=0.01)
    _train(model, opt, 2)
    extra = model.method.state_dict()["_extra_state"]["optimizer"]
    assert set(extra["state"]) == {0, 1, 2} and extra["state"][0]["step"].item() == 2.0
    assert extra["param_groups"][0]["lr"] == 0.05  # the optimizer_factory's
    # a deep copy: the saved state does not move on with the next step
    saved = extra["state"][0]["exp_avg"].clone()
    _train(model, opt, 1)
    assert torch.equal(extra["state"][0]["exp_avg"], saved)
    # loading a fresh method's state resets the optimizer
    model.method.load_state_dict(BUILDERS["RELAX"]().method.state_dict())
    assert model.method._optimizer is None


def test_extra_state_errors_name_the_method():
    method = RELAX("z", control_variate=nn.Linear(H, 1))
    state = dict(method.state_dict(), _extra_state={"opt": None})
    with pytest.raises(ValueError, match=r"RELAX\('z'\).*'optimizer'"):
        method.load_state_dict(state)
    with pytest.raises(ValueError, match="MovingAverageBaseline.*averages"):
        MovingAverageBaseline().load_state_dict({"_extra_state": 3})


def test_moving_average_follows_the_dtype_and_state_of_its_module():
    torch.manual_seed(0)
    model = BUILDERS["ScoreFunction+moving_average"]()
    _train(model, torch.optim.SGD(_model_params(model), lr=0.01), 2)
    baseline = model.method.baseline
    assert baseline.averages["f"].dtype == torch.float32
    model.double()
    assert baseline.averages["f"].dtype == torch.float64
    restored = MovingAverageBaseline(0.5)
    restored.load_state_dict(baseline.state_dict())
    assert torch.equal(restored.averages["f"], baseline.averages["f"])


def test_every_method_round_trips_its_state_dict_and_trains_on_identically():
    """``state_dict`` → ``torch.save`` → ``torch.load(weights_only=True)`` → ``load_state_dict`` into
    a freshly built method, for every method class; both then take the same step."""
    from test_construction import METHODS, Model as HoldingModel, _assert_same_state, _step

    for name, (build, distr) in METHODS.items():
        torch.manual_seed(0)
        original = HoldingModel(build())
        _step(original, distr)
        _step(original, distr)
        buffer = io.BytesIO()
        torch.save(original.state_dict(), buffer)
        buffer.seek(0)
        torch.manual_seed(1)
        fresh = HoldingModel(build())
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        _assert_same_state(dict(fresh.state_dict()), dict(original.state_dict()))
        rng = torch.get_rng_state()
        storch.reset()
        _step(original, distr)
        torch.set_rng_state(rng)
        storch.reset()
        _step(fresh, distr)
        # Auto's record holds the seconds it measured, which differ between the two runs
        timed = "method._extra_state" if name == "Auto" else None
        torch.testing.assert_close({k: v for k, v in fresh.state_dict().items() if k != timed},
                                   {k: v for k, v in original.state_dict().items() if k != timed}, msg=name)
        assert torch.equal(fresh.scale, original.scale), name


def test_bench_checkpoint_is_state_dicts_and_relax_resumes_exactly(tmp_path):
    from storch.bench import train
    from storch.bench.data import load_dataset

    digits = load_dataset("digits")
    cfg = dict(steps=6, eval_every=3, eval_size=30, eval_k=4, eval_elbo_k=2, var_every=None, batch_size=10,
               latent_dim=8, checkpoint_every=3, estimator="relax")
    quiet = dict(progress=False, log=lambda *_: None)
    full = train.run(cfg, tmp_path / "full", data=digits, **quiet)
    train.run({**cfg, "steps": 3}, tmp_path / "part", data=digits, **quiet)
    state = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)  # no pickled objects
    assert state["world_size"] == 1 and state["ranks"][0]["methods"]["z"]["_extra_state"]["optimizer"] is not None
    resumed = train.resume(tmp_path / "part", steps=6, **quiet)
    for key in ("train_nelbo", "valid_nelbo", "test_nelbo", "test_nll"):
        assert full[key] == resumed[key], key
    assert json.loads((tmp_path / "part" / "config.json").read_text())["steps"] == 6


def test_a_moving_average_pickled_with_its_old_dict_of_averages_loads():
    """Before the averages were buffers a baseline pickled them as a dict attribute."""
    baseline = MovingAverageBaseline(0.5)
    state = baseline.__getstate__()
    state.pop("_slots")
    state["averages"] = {"f": torch.tensor(2.5)}
    old = MovingAverageBaseline.__new__(MovingAverageBaseline)
    old.__setstate__(state)
    assert old.averages["f"] == 2.5
    assert pickle.loads(pickle.dumps(old)).averages["f"] == 2.5
