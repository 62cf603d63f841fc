"""Devices and dtypes (issue 9, item 9; issue 11, item 4): estimators run on the ``meta`` device, in
float64 and, where a GPU is available, on CUDA (those tests skip without one).

On ``meta`` tensors have shapes but no values. The model's parameters live there, shapes flow
through sampling, the surrogate and the backward pass, and every gradient has its parameter's
shape, device and dtype. Tensors storch creates (plate weights, baselines, constants) follow the
device and floating dtype of the node, so float64 parameters get float64 gradients.

The regression: on ``meta``, autograd computes the shapes of the backward pass with kernels
written in Python (``torch._refs``), which call operators (``torch.ops.prims.*``) on the saved
storch tensors; the plate dispatch took those internal calls for user code, wrapped gradients in
plates and refused ``sum_to_size`` over a plate: a false plate error in ``storch.backward``.

torch's own argument validation reads values (``OneHotCategorical`` does not even pass
``validate_args`` to its inner ``Categorical``), so these tests switch it off, as a model on
``meta`` must.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Bernoulli, Distribution, Normal, OneHotCategorical

import problems  # tests/problems.py (on the path through conftest)
import storch
from storch.method import (
    ARM, GSB, MVD, REBAR, RELAX, SPSA, VIMCO, DisARM, Expect, GumbelRao, GumbelSoftmax, IndeCateR, Infer,
    LocalExpectation, RaoBlackwellSF, ReinMax, Reparameterization, ScoreFunction, ScoreFunctionWOR,
    StraightThrough, UnorderedSetEstimator,
)
from storch.sampling import ImportanceSampling


@pytest.fixture(autouse=True)
def no_value_validation():
    old = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    yield
    Distribution.set_default_validate_args(old)


DISTRIBUTIONS = {
    "bernoulli": lambda p: Bernoulli(logits=p),
    "categorical": lambda p: OneHotCategorical(logits=p),
    "normal": lambda p: Normal(p, 1.0),
}

# the core estimators: (method factory, distribution)
CORE = {
    "reparameterization": (lambda dev: Reparameterization("x", n_samples=4), "normal"),
    "score_function": (lambda dev: ScoreFunction("x", n_samples=4), "categorical"),
    "score_function_bernoulli": (lambda dev: ScoreFunction("x", n_samples=4), "bernoulli"),
    "batch_average": (lambda dev: ScoreFunction("x", n_samples=4, baseline_factory="batch_average"), "categorical"),
    "batch_average_bernoulli": (
        lambda dev: ScoreFunction("x", n_samples=4, baseline_factory="batch_average"), "bernoulli"
    ),
    "moving_average": (lambda dev: ScoreFunction("x", n_samples=4, baseline_factory="moving_average"), "categorical"),
    "moving_average_bernoulli": (
        lambda dev: ScoreFunction("x", n_samples=4, baseline_factory="moving_average"), "bernoulli"
    ),
    "expect": (lambda dev: Expect("x"), "categorical"),
    "expect_bernoulli": (lambda dev: Expect("x"), "bernoulli"),
    "arm": (lambda dev: ARM("x", n_samples=2), "bernoulli"),
    "disarm": (lambda dev: DisARM("x", n_samples=2), "bernoulli"),
    "local_expectation": (lambda dev: LocalExpectation("x", n_samples=2), "bernoulli"),
    "local_expectation_categorical": (lambda dev: LocalExpectation("x", n_samples=2), "categorical"),
    "gumbel_softmax": (lambda dev: GumbelSoftmax("x", n_samples=3), "categorical"),
    "gumbel_softmax_bernoulli": (lambda dev: GumbelSoftmax("x", n_samples=3), "bernoulli"),
    "gumbel_softmax_straight_through": (
        lambda dev: GumbelSoftmax("x", n_samples=3, straight_through=True), "categorical"
    ),
}

# the other estimators, on meta and CUDA (their float64 values are checked in their own test files)
OTHERS = {
    "indecater": (lambda dev: IndeCateR("x", n_samples=2), "categorical"),
    "infer": (lambda dev: Infer("x", n_samples=2), "bernoulli"),
    "mvd": (lambda dev: MVD("x", n_samples=2), "normal"),
    "mvd_bernoulli": (lambda dev: MVD("x", n_samples=2), "bernoulli"),
    "spsa": (lambda dev: SPSA("x", n_samples=2), "normal"),
    "gsb": (lambda dev: GSB("x", n_samples=2), "normal"),
    "straight_through": (lambda dev: StraightThrough("x", n_samples=2), "categorical"),
    "gumbel_rao": (lambda dev: GumbelRao("x", n_samples=2), "categorical"),
    "reinmax": (lambda dev: ReinMax("x", n_samples=2), "categorical"),
    "vimco": (lambda dev: VIMCO("x", n_samples=3), "bernoulli"),
    "score_function_wor": (lambda dev: ScoreFunctionWOR("x", k=2), "categorical"),
    "unordered_set": (lambda dev: UnorderedSetEstimator("x", k=2), "categorical"),
    # a method with parameters of its own moves with the model
    "rebar": (lambda dev: REBAR("x", n_samples=2).to(dev), "bernoulli"),
    "relax": (lambda dev: RELAX("x", control_variate=torch.nn.Linear(3, 1), n_samples=2).to(dev), "bernoulli"),
    "importance": (
        lambda dev: ScoreFunction(
            "x",
            sampling_method=ImportanceSampling(
                "x", 4, lambda p: OneHotCategorical(logits=torch.zeros_like(p.logits))
            ),
            baseline_factory="batch_average",
        ),
        "categorical",
    ),
}

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SETTINGS = [
    ("meta", torch.float32),
    ("meta", torch.float64),
    ("cpu", torch.float64),
    pytest.param("cuda", torch.float32, marks=CUDA, id="cuda-float32"),
    pytest.param("cuda", torch.float64, marks=CUDA, id="cuda-float64"),
]


def _setting_id(setting) -> str:
    return setting.id if hasattr(setting, "id") else f"{setting[0]}-{str(setting[1])[6:]}"


def _step(make, dist: str, device: str, dtype: torch.dtype, minibatch: bool) -> torch.Tensor:
    """One training step of a small model whose parameters live on ``device``; returns them."""
    param = torch.zeros(3, device=device, dtype=dtype, requires_grad=True)
    p = storch.denote_independent(param.expand(5, 3), 0, "data") if minibatch else param
    method = make(device)
    x = method(DISTRIBUTIONS[dist](p))
    n_plates = 1 + minibatch
    assert x.device.type == device and x.dtype == dtype
    assert x.dim() == n_plates + 1 and tuple(x.shape[1:]) == ((5, 3) if minibatch else (3,))
    cost = (x * torch.arange(3.0, device=device, dtype=dtype)).sum(-1)
    storch.add_cost(cost, "f")
    estimate = storch.backward()
    assert estimate.shape == () and estimate.device.type == device and estimate.dtype == dtype
    return param


def _check_grad(param: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    grad = param.grad
    assert grad is not None
    assert type(grad) is torch.Tensor  # a plain gradient, no plates leaked into autograd
    assert grad.shape == param.shape and grad.device.type == device and grad.dtype == dtype


@pytest.mark.parametrize("minibatch", [False, True], ids=["single", "minibatch"])
@pytest.mark.parametrize("device,dtype", SETTINGS, ids=[_setting_id(s) for s in SETTINGS])
@pytest.mark.parametrize("name", list(CORE))
def test_core_estimators(name: str, device: str, dtype: torch.dtype, minibatch: bool) -> None:
    make, dist = CORE[name]
    _check_grad(_step(make, dist, device, dtype, minibatch), device, dtype)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("minibatch", [False, True], ids=["single", "minibatch"])
@pytest.mark.parametrize("name", list(OTHERS))
def test_other_estimators(name: str, minibatch: bool, device: str) -> None:
    make, dist = OTHERS[name]
    _check_grad(_step(make, dist, device, torch.float32, minibatch), device, torch.float32)


@CUDA
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_gradient_equals_the_exact_one(device: str) -> None:
    """Expect on a GPU gives the exact gradient ``c·σ(φ)(1 − σ(φ))`` (float64), as on the CPU (the
    cost is averaged over the data plate, so the 4 copies of φ share one gradient)."""
    phi = torch.tensor([-0.7, 0.2, 1.3], dtype=torch.float64, device=device, requires_grad=True)
    c = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, device=device)
    z = Expect("z")(Bernoulli(logits=storch.denote_independent(phi.expand(4, 3), 0, "data")))
    storch.add_cost((z * c).sum(-1), "f")
    storch.backward()
    s = torch.sigmoid(phi.detach())
    torch.testing.assert_close(phi.grad, c * s * (1 - s), rtol=1e-12, atol=1e-12)


@CUDA
def test_cuda_score_function_is_unbiased() -> None:
    """A score function with the leave-one-out baseline on a GPU, against the exact gradient."""
    from storch.testing import assert_unbiased, replicated_gradients

    problem = problems.bernoulli(interaction=0.0)  # tests/problems.py; exact gradient on the CPU
    on_gpu = problems.BernoulliBits(problem.phi.cuda(), problem.target.cuda(), problem.interaction)
    score_function = ScoreFunction("z", n_samples=2, baseline_factory="batch_average")

    def method(distribution: Distribution) -> torch.Tensor:
        z = score_function(distribution)
        assert z.device.type == "cuda"
        return z

    [estimates] = replicated_gradients([on_gpu.phi], 4000, on_gpu.model(method))
    assert estimates.device.type == "cuda"
    assert_unbiased(estimates, problem.exact().cuda(), label="ScoreFunction on CUDA")


def test_rao_blackwell_on_meta() -> None:
    param = torch.zeros(5, 3, device="meta", requires_grad=True)
    x = RaoBlackwellSF("x", 2)(OneHotCategorical(logits=storch.denote_independent(param, 0, "data")))
    storch.add_cost((x * 2.0).sum(-1), "f")
    storch.backward()
    _check_grad(param, "meta", torch.float32)


def test_expect_backward_on_meta_has_no_false_plate_error() -> None:
    """The reported failure: ``sum_to_size`` over plate 'x' in the backward pass was refused."""
    logits = torch.zeros(3, device="meta", requires_grad=True)
    x = Expect("x")(Bernoulli(logits=logits))
    storch.add_cost((x * torch.arange(3.0, device="meta")).sum(-1), "f")
    storch.backward()
    _check_grad(logits, "meta", torch.float32)


def test_internal_operators_see_plain_tensors() -> None:
    """Operators (``torch.ops``) run inside torch's kernels: they reduce plates without an error."""
    x = storch.denote_independent(torch.ones(4, 3), 0, "data")
    total = torch.ops.aten.sum.default(x)
    assert type(total) is torch.Tensor and total.item() == 12.0
    with pytest.raises(ValueError, match="plate 'data'"):
        x.sum(0)  # the public API still refuses to reduce a plate by accident
    assert type(x * 2) is storch.Tensor


def test_higher_order_derivatives_on_meta() -> None:
    """``create_graph`` and ``torch.autograd.grad`` go through the same backward kernels."""
    enc = torch.nn.Linear(4, 3).to("meta")
    data = storch.denote_independent(torch.zeros(6, 4, device="meta"), 0, "data")
    z = ScoreFunction("z", n_samples=3, baseline_factory="batch_average")(OneHotCategorical(logits=enc(data)))
    x = Reparameterization("x", n_samples=2)(Normal(z, 1.0))
    storch.add_cost(((x - 1.0) ** 2).sum(-1), "f")
    (grad,) = torch.autograd.grad(storch.surrogate_loss(), enc.weight, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), enc.bias)
    assert type(grad) is torch.Tensor and grad.shape == enc.weight.shape and grad.device.type == "meta"
    assert second.shape == enc.bias.shape and second.device.type == "meta"


def test_relaxations_do_not_validate_again_on_meta() -> None:
    """A user who turns validation off on a distribution gets no validation from storch's relaxation."""
    Distribution.set_default_validate_args(True)
    logits = torch.zeros(3, device="meta", requires_grad=True)
    for method in (GumbelSoftmax("x", n_samples=2), StraightThrough("y", n_samples=2)):
        x = method(Bernoulli(logits=logits, validate_args=False))
        storch.add_cost((x * 2.0).sum(-1), f"f_{method.plate_name}")
    storch.backward()
    _check_grad(logits, "meta", torch.float32)


# ------------------------------------------------------------------------------------- dtype
@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_plate_weights_follow_the_node(device: str, dtype: torch.dtype) -> None:
    """Group weights (ARM, DisARM, LocalExpectation, MVD) are made on the node's device and dtype."""
    logits = torch.zeros(3, device=device, dtype=dtype, requires_grad=True)
    for method in (ARM("a", n_samples=2), DisARM("b", n_samples=2), LocalExpectation("c", n_samples=2)):
        weight = method(Bernoulli(logits=logits)).plate.weight
        assert weight.device.type == device and weight.dtype == dtype
    loc = torch.zeros(3, device=device, dtype=dtype)
    weight = MVD("d", n_samples=2)(Normal(loc, 1.0)).plate.weight
    assert weight.device.type == device and weight.dtype == dtype


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=CUDA)])
def test_moving_average_follows_the_cost(device: str) -> None:
    method = ScoreFunction("x", n_samples=2, baseline_factory="moving_average")
    logits = torch.zeros(3, device=device, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        x = method(Bernoulli(logits=logits))
        storch.add_cost((x * 2.0).sum(-1), "f")
        storch.backward()
        average = method.baseline.averages["f"]
        assert average.device.type == device and average.dtype == torch.float64
    _check_grad(logits, device, torch.float64)


def test_float64_gradient_is_exact() -> None:
    """Expect in float64: the exact gradient c·σ(φ)(1 − σ(φ)) to float64 precision."""
    phi = torch.tensor([-0.7, 0.2, 1.3], dtype=torch.float64, requires_grad=True)
    c = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    x = Expect("x")(Bernoulli(logits=phi))
    storch.add_cost((x * c).sum(-1), "f")
    estimate = storch.backward()
    s = torch.sigmoid(phi.detach())
    assert estimate.dtype == torch.float64
    torch.testing.assert_close(estimate, (c * s).sum(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(phi.grad, c * s * (1 - s), rtol=1e-13, atol=1e-13)


def test_float64_importance_weights() -> None:
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    uniform = OneHotCategorical(probs=torch.full((3,), 1 / 3, dtype=torch.float64))
    z = ScoreFunction("z", sampling_method=ImportanceSampling("z", 4, uniform))(OneHotCategorical(logits=theta))
    assert z.plate.weight.dtype == torch.float64
    storch.add_cost((z * torch.arange(3.0, dtype=torch.float64)).sum(-1), "f")
    storch.backward()
    _check_grad(theta, "cpu", torch.float64)


def test_print_costs_on_meta_prints_no_values(capsys: pytest.CaptureFixture) -> None:
    logits = torch.zeros(3, device="meta", requires_grad=True)
    x = storch.method.ScoreFunction("x", n_samples=4)(Bernoulli(logits=logits))
    storch.add_cost(x.sum(-1), "f")
    storch.backward(print_costs=True)
    assert capsys.readouterr().out == "f: (meta)\n"
    assert logits.grad.shape == (3,) and logits.grad.is_meta


@CUDA
def test_group_weights_are_copied_to_the_gpu_once() -> None:
    """ARM's group weights reach the GPU without a host-to-device copy (a wait) in every step."""
    logits = torch.zeros(3, device="cuda", requires_grad=True)
    method = ARM("a", n_samples=2)
    first = storch.extend.plain(method(Bernoulli(logits=logits)).plate.weight).clone()
    storch.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = storch.extend.plain(method(Bernoulli(logits=logits, validate_args=False)).plate.weight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert second.device.type == "cuda" and torch.equal(first, second)
