"""The manual's discrete VAE tutorial (§1.3): train with each estimator, measure gradient variance and bias.

Generative story (the manual's, with the posterior given by its logits)::

    x ~ data;  q = OneHotCategorical(logits=E_φ(x))  (L latent variables with K values each)
    z ~ q  (by the chosen method);  cost KL(q ‖ uniform prior);  x̂ = D_θ(z);  cost BCE(x̂, x)

By default the data are scikit-learn's 8×8 digits, binarized
(`storch.datasets.load_digits_binarized`),
with a 64-256-128-(2×10)-128-256-64 network; ``--mnist DIR`` uses binarized MNIST and the manual's
784-512-256-(2×10)-256-512-784 network.

The estimators: the score function without and with a leave-one-out baseline, Gumbel-softmax and
exact enumeration (``Expect``), as in the manual, and the estimators of the catalog (importance
sampling, ARM/DisARM, local expectations, REBAR/RELAX, straight-through variants, ...; see
`METHODS`). A catalog estimator whose module is not importable is listed as "not run".

Evaluation (the manual's ``evaluate``): on a fixed evaluation minibatch, the exact gradient of the
ELBO w.r.t. the posterior's parameters by ``storch.method.Expect("z")``, then ``S`` gradient samples
``z.param_grads["logits"]`` of the trained method, gathered with ``storch.gather_samples``. We report

* ``grad var``: ``storch.variance(gradients, "gradients").sum()`` (the per-element variance,
  averaged over the data plate, summed over the 2×10 elements: the total variance);
* ``bias² raw``: the manual's ``reduce_plates((mean_gradient − expected_gradient)²).sum()``. Its
  expectation is ``‖bias‖² + grad var / S``, so it is not zero for an unbiased estimator;
* ``bias²``: ``bias² raw − grad var / S``, an unbiased estimate of ``‖bias‖²`` (≈ 0 for unbiased methods).

The manual builds ``q = OneHotCategorical(probs=softmax(E_φ(x)))`` and compares gradients w.r.t.
``probs``. We use the logits, the same distribution, because torch computes the log-probabilities of
a ``probs``-built categorical from probabilities clamped to ``[ε, 1 − ε]`` (``ε ≈ 1.2e-7`` in
float32): once training drives a probability below ``ε``, the gradient through it is zero for
``Expect`` (which weights by ``exp(log p)``) but not for an estimator that uses the probabilities
themselves (``LocalExpectation``), and the comparison showed a spurious bias. We compare gradients
w.r.t. the encoder's output ``u = E_φ(x)``: the distribution stores the normalised logits
``u − logsumexp(u)``, and ``param_grads["logits"]`` is the gradient ``g`` w.r.t. those, which is only
defined up to a multiple of ``p`` per latent variable (estimators differ in that direction, which
the normalisation annihilates); ``g − p·Σ_k g_k`` is the gradient w.r.t. ``u``, the same for all.

The ``exact NELBO`` column is the negative ELBO on (a subset of) the training set computed exactly
with ``Expect`` (no sampling); ``train NELBO`` is the average of the values ``storch.backward()``
returned during the training steps since the previous evaluation (for relaxations such as
GumbelSoftmax that is the relaxed objective, not the ELBO).
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import torch
from torch import nn
from torch.distributions import OneHotCategorical

import storch
from storch.datasets import minibatches, random_subset
from storch.method import Expect, GumbelSoftmax, Method, ScoreFunction

__all__ = [
    "METHODS",
    "DiscreteVAE",
    "Evaluation",
    "MethodSpec",
    "VAEConfig",
    "digits_config",
    "evaluate",
    "exact_nelbo",
    "generative_story",
    "load_mnist_data",
    "mnist_config",
    "nelbo_subset",
    "quick_config",
    "run_vae",
    "train",
]


class DiscreteVAE(nn.Module):
    """Encoder ``E_φ`` and decoder ``D_θ`` with two hidden layers each and ``latents × categories`` logits.

    The manual's model is ``DiscreteVAE(784, (512, 256), 2, 10)``.

    Examples:
        >>> import torch
        >>> model = DiscreteVAE(64, (256, 128), 2, 10)
        >>> logits, probs = model.encode(torch.zeros(3, 64)), model.decode(torch.zeros(3, 20))
        >>> logits.shape, probs.shape
        (torch.Size([3, 20]), torch.Size([3, 64]))
        >>> bool(((probs > 0) & (probs < 1)).all())   # the decoder gives Bernoulli means per pixel
        True
    """

    def __init__(self, input_dim: int = 784, hidden: Sequence[int] = (512, 256), latents: int = 2,
                 categories: int = 10) -> None:
        super().__init__()
        h1, h2 = hidden
        self.input_dim, self.latents, self.categories = input_dim, latents, categories
        self.fc1 = nn.Linear(input_dim, h1)
        self.fc2 = nn.Linear(h1, h2)
        self.fc3 = nn.Linear(h2, latents * categories)
        self.fc4 = nn.Linear(latents * categories, h2)
        self.fc5 = nn.Linear(h2, h1)
        self.fc6 = nn.Linear(h1, input_dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.fc1(x).relu()
        h2 = self.fc2(h1).relu()
        return self.fc3(h2)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h3 = self.fc4(z).relu()
        h4 = self.fc5(h3).relu()
        return self.fc6(h4).sigmoid()


def generative_story(method: Method, model: DiscreteVAE, data: torch.Tensor) -> storch.StochasticTensor:
    """The manual's generative story; registers the costs ``"kl-div"`` and ``"reconstruction"``.

    Examples:
        >>> import torch, storch
        >>> model = DiscreteVAE(64, (32, 16), 2, 10)
        >>> z = generative_story(storch.method.ScoreFunction("z", n_samples=3), model, torch.zeros(5, 64))
        >>> [p.name for p in z.plates], tuple(z.shape)
        (['z', 'data'], (3, 5, 2, 10))
        >>> _ = storch.backward()
        >>> tuple(z.param_grads["logits"].shape)
        (5, 2, 10)
    """
    L, K = model.latents, model.categories
    x = storch.denote_independent(data.view(-1, model.input_dim), 0, "data")

    # Encode data. Shape: (data, L * K)
    q_logits = model.encode(x)
    # Shape: (data, L, K)
    q_logits = q_logits.reshape(-1, L, K)
    # Define variational posterior
    q = OneHotCategorical(logits=q_logits)
    # Sample from variational posterior. Shape: (amt_samples, data, L, K)
    z = method(q)

    prior = OneHotCategorical(probs=torch.ones_like(q.probs) / K)
    # Shape: (data)
    KL_div = torch.distributions.kl_divergence(q, prior).sum(-1)
    storch.add_cost(KL_div, "kl-div")

    z_in = z.reshape(z.shape[:-2] + (L * K,))
    # Shape: (amt_samples, data, input_dim)
    reconstruction = model.decode(z_in)
    bce = storch.nn.b_binary_cross_entropy(reconstruction, x)  # sums the pixels, keeps the plates
    storch.add_cost(bce, "reconstruction")
    return z


# ------------------------------------------------------------------ methods and settings


@dataclass(frozen=True)
class MethodSpec:
    """One estimator of the comparison: a key (``--methods``), a label, and how to build it.

    ``requires`` names the module and class the method comes from; `missing` says why it
    cannot be built (a method whose module is not importable is reported as not run, never dropped
    silently). ``not_applicable`` says why a method of the catalog does not fit this model (it is
    listed, not run).
    """

    key: str
    label: str
    make: Callable[[], Method]
    deterministic: bool = False  # exact methods need no repeated gradient samples
    requires: tuple[str, str] | None = None
    not_applicable: str | None = None

    def missing(self) -> str | None:
        """``None`` if the method can be run on this model, else why not."""
        if self.requires is not None:
            module, attr = self.requires
            try:
                mod = importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 -- any import failure means "not available"
                return f"not importable ({type(e).__name__}: {e})"
            if not hasattr(mod, attr):
                return f"not importable ({module} has no attribute {attr!r})"
        if self.not_applicable is not None:
            return f"not applicable: {self.not_applicable}"
        return None


def _catalog(key: str, label: str, module: str, attr: str, not_applicable: str | None = None,
             **kwargs) -> MethodSpec:
    """A method of the estimator catalog, imported when it is built: ``attr("z", **kwargs)``."""

    def make() -> Method:
        return getattr(importlib.import_module(module), attr)("z", **kwargs)

    return MethodSpec(key, label, make, requires=(module, attr), not_applicable=not_applicable)


def _tempered(p):
    return OneHotCategorical(logits=p.logits / 2)


def _importance_rloo() -> Method:
    from storch.sampling.importance import ImportanceSampling

    return ScoreFunction("z", sampling_method=ImportanceSampling("z", 10, _tempered), baseline_factory="batch_average")


class LatentMLP(nn.Module):
    """A control variate ``c_φ`` for RELAX: the (relaxed) ``L × K`` sample flattened, 32 tanh units, one output.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> c_phi, z = LatentMLP(2, 10), torch.rand(3, 5, 2, 10)
        >>> c_phi(z).shape, bool(torch.allclose(c_phi(z), c_phi.net(z.reshape(3, 5, 20))))  # L × K flattened
        (torch.Size([3, 5, 1]), True)
    """

    def __init__(self, latents: int, categories: int, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(latents * categories, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z.reshape(z.shape[:-2] + (-1,)))


def _relax() -> Method:
    from storch.method.relax import RELAX

    return RELAX("z", control_variate=LatentMLP(2, 10), n_samples=3, rebar=True)


_ONE_VARIABLE = "it handles one discrete variable per node; this model's node holds 2 categoricals per image"

# The manual's four estimators, then the catalog's, with about ten cost evaluations per datum and
# step where the method allows it (the "evals" column of the summary gives the real number: the
# size of the node's plate).
METHODS: dict[str, MethodSpec] = {
    spec.key: spec
    for spec in (
        MethodSpec("score", "ScoreFunction n=1, no baseline",
                   lambda: ScoreFunction("z", n_samples=1, baseline_factory=None)),
        MethodSpec("score-rloo", "ScoreFunction n=10, batch_average",
                   lambda: ScoreFunction("z", n_samples=10, baseline_factory="batch_average")),
        MethodSpec("gumbel", "GumbelSoftmax n=1 (tau=1)", lambda: GumbelSoftmax("z", n_samples=1)),
        MethodSpec("expect", "Expect (exact, 100 configs)", lambda: Expect("z"), deterministic=True),
        MethodSpec("importance", "ImportanceSampling n=10 r~p^1/2, RLOO", _importance_rloo,
                   requires=("storch.sampling.importance", "ImportanceSampling")),
        _catalog("wor", "ScoreFunctionWOR k=10", "storch.method.score_function_wor", "ScoreFunctionWOR", k=10),
        _catalog("wor-normalised", "ScoreFunctionWOR k=10, normalised", "storch.method.score_function_wor", "ScoreFunctionWOR",
                 k=10, biased=True),
        _catalog("unordered-set", "UnorderedSetEstimator k=10", "storch.method.unordered_set",
                 "UnorderedSetEstimator", k=10),
        _catalog("local-expectation", "LocalExpectation n=1", "storch.method.local_expectation", "LocalExpectation",
                 n_samples=1),
        _catalog("mvd", "MVD n=1", "storch.method.mvd", "MVD", n_samples=1),
        _catalog("spsa", "SPSA n=3 (c=0.1)", "storch.method.spsa", "SPSA", n_samples=3),
        _catalog("straight-through", "StraightThrough n=1", "storch.method.straight_through", "StraightThrough",
                 n_samples=1),
        _catalog("gumbel-rao", "GumbelRao n=1 (tau=1)", "storch.method.straight_through", "GumbelRao", n_samples=1),
        _catalog("reinmax", "ReinMax n=1 (tau=1)", "storch.method.straight_through", "ReinMax", n_samples=1),
        _catalog("rebar", "REBAR n=3", "storch.method.relax", "REBAR", n_samples=3),
        MethodSpec("relax", "RELAX n=3 (c_phi MLP + REBAR term)", _relax, requires=("storch.method.relax", "RELAX")),
        _catalog("lax", "LAX", "storch.method.relax", "LAX",
                 not_applicable="continuous distributions with rsample only; this model's latents are discrete"),
        _catalog("arm", "ARM", "storch.method.arm", "ARM", not_applicable="Bernoulli nodes only"),
        _catalog("disarm", "DisARM", "storch.method.arm", "DisARM", not_applicable="Bernoulli nodes only"),
        _catalog("rao-blackwell", "RaoBlackwellSF", "storch.method.rao_blackwell", "RaoBlackwellSF",
                 not_applicable=_ONE_VARIABLE, k=10),
        _catalog("unordered-set-gumbel", "UnorderedSetGumbelSoftmax", "storch.method.unordered_set",
                 "UnorderedSetGumbelSoftmax", not_applicable=_ONE_VARIABLE, k=10),
        _catalog("vimco", "VIMCO", "storch.method.vimco", "VIMCO", n_samples=10,
                 not_applicable="it estimates gradients of multi-sample bounds (iwae_bound); this model's "
                 "objective is the ELBO, on which VIMCO is the score function with a leave-one-out "
                 "baseline (score-rloo)"),
    )
}


@dataclass
class VAEConfig:
    """Data, model and schedule of one demo run (see `digits_config`, `mnist_config`)."""

    data_name: str
    train_data: torch.Tensor
    hidden: tuple[int, int] = (256, 128)
    latents: int = 2
    categories: int = 10
    epochs: int = 12
    batch_size: int = 32
    lr: float = 3e-3
    eval_every: int = 168  # training steps between evaluations (and one before training, one at the end)
    grad_samples: int = 100  # gradient samples per evaluation
    eval_batch: int = 64  # size of the fixed evaluation minibatch
    nelbo_subset: int = 2000  # images used for the exact NELBO (a fixed random subset)
    nelbo_chunk: int = 500
    methods: Sequence[str] = tuple(METHODS)
    device: str = "cpu"
    seed: int = 0


def digits_config(epochs: int = 3, seed: int = 0, **kw) -> VAEConfig:
    """The default: binarized 8×8 digits (1797 images), 64-256-128-(2×10)-128-256-64, batch 32.

    Three epochs per method, evaluated before training and every three epochs with 50 gradient
    samples, so that the ~15 estimators run in about two minutes on two CPU cores.
    """
    from storch.datasets import load_digits_binarized

    x, _ = load_digits_binarized()
    steps_per_epoch = math.ceil(x.shape[0] / 32)
    kw.setdefault("eval_every", 3 * steps_per_epoch)
    kw.setdefault("grad_samples", 50)
    return VAEConfig("binarized digits (sklearn, 1797 x 64)", x, epochs=epochs, seed=seed, **kw)


def quick_config(seed: int = 0, **kw) -> VAEConfig:
    """A smoke run of every method: 128 digits, one epoch (4 steps), 4 gradient samples per evaluation."""
    from storch.datasets import load_digits_binarized

    x, _ = load_digits_binarized()
    kw.setdefault("epochs", 1)
    kw.setdefault("grad_samples", 4)
    return VAEConfig("binarized digits, first 128 (quick)", x[:128], hidden=(64, 32), batch_size=32,
                     eval_every=4, eval_batch=8, nelbo_subset=64, seed=seed, **kw)


def load_mnist_data(directory: str) -> tuple[str, torch.Tensor]:
    """Binarized MNIST training images from ``directory`` (never downloads).

    Tries `storch.datasets.load_binarized_mnist` (Larochelle & Murray's fixed
    binarization)
    and falls back to `storch.datasets.load_mnist` with one Bernoulli draw per pixel
    (seed 0).
    """
    from storch.datasets import dynamic_binarize, load_binarized_mnist, load_mnist

    try:
        x, _ = load_binarized_mnist(directory, "train")
        return f"binarized MNIST (Larochelle & Murray), train {tuple(x.shape)}", x
    except FileNotFoundError as first:
        try:
            grey, _ = load_mnist(directory, "train")
        except FileNotFoundError as second:
            raise FileNotFoundError(f"--mnist {directory}: {first}\n{second}") from None
        x = dynamic_binarize(grey, generator=torch.Generator().manual_seed(0))
        return f"MNIST, Bernoulli-binarized once (seed 0), train {tuple(x.shape)}", x


def mnist_config(directory: str, epochs: int = 5, seed: int = 0, **kw) -> VAEConfig:
    """The manual's setting: 784-512-256-(2×10)-256-512-784, batch 64, Adam 1e-3, evaluate every 300 steps."""
    name, x = load_mnist_data(directory)
    return VAEConfig(name, x, hidden=(512, 256), epochs=epochs, batch_size=64, lr=1e-3, eval_every=300,
                     seed=seed, **kw)


# ------------------------------------------------------------------ evaluation


@dataclass
class Evaluation:
    epoch: float
    step: int
    train_nelbo: float
    exact_nelbo: float
    grad_variance: float
    bias_raw: float
    grad_samples: int

    @property
    def bias(self) -> float:
        """``‖bias‖²`` estimate: ``bias² raw − grad var / S``."""
        return self.bias_raw - self.grad_variance / self.grad_samples


def _centred_grad(z: storch.StochasticTensor) -> torch.Tensor:
    """The gradient w.r.t. the encoder's logits ``E_φ(x)``, from the one w.r.t. the normalised logits.

    ``OneHotCategorical(logits=u)`` stores ``u − logsumexp(u)``; through that normalisation the
    gradient w.r.t. ``u`` is ``g − p·Σ_k g_k`` (``g`` w.r.t. the normalised logits, ``p`` the
    probabilities), which sums to zero over the K values.
    """
    g = z.param_grads["logits"]
    return g - z.distribution.probs.detach() * g.sum(-1, keepdim=True)


def evaluate(method: Method, model: DiscreteVAE, data: torch.Tensor, grad_samples: int) -> tuple[float, float, float]:
    """The manual's ``evaluate``: gradient variance and squared bias against ``Expect``.

    Returns ``(elbo, grad_variance, bias_raw)`` where ``elbo`` is the (negative ELBO) value of the
    last ``storch.backward()``. Leaves the model's ``.grad`` zeroed.

    Examples:
        >>> import torch, storch
        >>> _ = torch.manual_seed(0)
        >>> model = DiscreteVAE(64, (32, 16), 2, 10)
        >>> elbo, var, bias = evaluate(storch.method.Expect("z"), model, torch.zeros(4, 64), 2)
        >>> var < 1e-8 and bias < 1e-8
        True
    """
    # Compute expected gradient
    model.zero_grad()
    z = generative_story(Expect("z"), model, data)
    storch.backward()
    expected_gradient = _centred_grad(z)

    # Collect gradient samples
    gradients = []
    elbo = torch.tensor(float("nan"))
    for _ in range(grad_samples):
        model.zero_grad()
        z = generative_story(method, model, data)
        elbo = storch.backward()
        gradients.append(_centred_grad(z))
    model.zero_grad()

    gradients = storch.gather_samples(gradients, "gradients")
    mean_gradient = storch.reduce_plates(gradients, "gradients")
    bias_gradient = storch.reduce_plates((mean_gradient - expected_gradient) ** 2).sum()
    variance = storch.variance(gradients, "gradients").sum()
    return float(elbo), float(variance), float(bias_gradient)


def exact_nelbo(model: DiscreteVAE, data: torch.Tensor, chunk: int = 500) -> float:
    """The negative ELBO averaged over ``data``, exactly (``Expect`` over all K^L configurations).

    Examples:
        >>> import torch
        >>> model = DiscreteVAE(64, (32, 16), 2, 10)
        >>> 0 < exact_nelbo(model, torch.zeros(10, 64), chunk=4) < 100
        True
    """
    total = 0.0
    with torch.no_grad():
        for start in range(0, data.shape[0], chunk):
            part = data[start:start + chunk]
            try:
                generative_story(Expect("z"), model, part)
                total += float(storch.surrogate_loss()) * part.shape[0]
            finally:
                storch.reset()
    return total / data.shape[0]


# ------------------------------------------------------------------ training


@dataclass
class RunResult:
    spec: MethodSpec
    evaluations: list[Evaluation] = field(default_factory=list)
    last_epoch_train_nelbo: float = float("nan")
    seconds: float = 0.0
    evals: int = 0  # cost evaluations per datum and step: the size of the node's plate

    @property
    def final(self) -> Evaluation:
        return self.evaluations[-1]

    @property
    def mean_variance(self) -> float:
        return sum(e.grad_variance for e in self.evaluations) / len(self.evaluations)

    @property
    def mean_bias(self) -> float:
        return sum(e.bias for e in self.evaluations) / len(self.evaluations)

    @property
    def mean_bias_raw(self) -> float:
        return sum(e.bias_raw for e in self.evaluations) / len(self.evaluations)


_ROW_HEAD = (f"{'epoch':>6} {'step':>6} {'train NELBO':>11} {'exact NELBO':>11} {'grad var':>10} "
             f"{'bias² raw':>10} {'bias²':>10}")


def _row(e: Evaluation) -> str:
    return (f"{e.epoch:6.2f} {e.step:6d} {e.train_nelbo:11.3f} {e.exact_nelbo:11.3f} {e.grad_variance:10.3e} "
            f"{e.bias_raw:10.3e} {e.bias:10.3e}")


def nelbo_subset(data: torch.Tensor, config: VAEConfig) -> torch.Tensor:
    """The images of the exact NELBO: ``config.nelbo_subset`` of ``data`` drawn at random (seeded with
    ``config.seed``, the same in every run), never a prefix, which can be far from representative
    (the binarized MNIST test split is sorted by digit)."""
    return random_subset(data, config.nelbo_subset, torch.Generator().manual_seed(config.seed + 2))  # type: ignore[return-value]


def train(spec: MethodSpec, config: VAEConfig, out: TextIO, progress_bar: bool = True) -> RunResult:
    """Train a fresh model (seeded with ``config.seed``) with one method, printing evaluation rows."""
    device = torch.device(config.device)
    data = config.train_data.to(device)
    torch.manual_seed(config.seed)
    model = DiscreteVAE(data.shape[1], config.hidden, config.latents, config.categories).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    method = spec.make().to(device)
    gen = torch.Generator().manual_seed(config.seed)
    eval_idx = torch.randperm(data.shape[0], generator=gen, device="cpu")[: config.eval_batch].to(device)
    eval_data = data[eval_idx]
    shuffle = torch.Generator().manual_seed(config.seed + 1)
    nelbo_data = nelbo_subset(data, config)
    grad_samples = 2 if spec.deterministic else config.grad_samples

    steps_per_epoch = math.ceil(data.shape[0] / config.batch_size)
    total = steps_per_epoch * config.epochs
    result = RunResult(spec)
    bar = None
    if progress_bar:
        from storch.demo import progress_bar as make_bar

        bar = make_bar(total, spec.key)

    def log(text: str) -> None:
        if bar is not None:
            bar.clear()
        print(text, file=out, flush=True)
        if bar is not None:
            bar.refresh()

    since: list[float] = []

    def do_eval(step: int) -> None:
        if bar is not None:
            bar.set_postfix_str("evaluating")
        elbo, var, bias = evaluate(method, model, eval_data, grad_samples)
        train_nelbo = sum(since) / len(since) if since else elbo
        ev = Evaluation(step / steps_per_epoch, step, train_nelbo,
                        exact_nelbo(model, nelbo_data, config.nelbo_chunk), var, bias, grad_samples)
        result.evaluations.append(ev)
        since.clear()
        log(_row(ev))

    log(f"\n== {spec.label} ==")
    log(_ROW_HEAD)
    start = time.perf_counter()
    step = 0
    try:
        do_eval(0)
        for epoch in range(config.epochs):
            epoch_values = []
            for batch in minibatches(data, config.batch_size, generator=shuffle):
                optimizer.zero_grad()
                z = generative_story(method, model, batch)
                result.evals = z.n
                value = float(storch.backward())
                optimizer.step()
                step += 1
                since.append(value)
                epoch_values.append(value)
                if bar is not None:
                    bar.update()
                    if step % 10 == 0:
                        bar.set_postfix(nelbo=f"{sum(epoch_values) / len(epoch_values):.2f}")
                if step % config.eval_every == 0 and step != total:
                    do_eval(step)
            result.last_epoch_train_nelbo = sum(epoch_values) / max(len(epoch_values), 1)
        do_eval(step)
    finally:
        if bar is not None:
            bar.close()
    result.seconds = time.perf_counter() - start
    return result


def format_summary(results: Sequence[RunResult], missing: dict[str, str] | None = None) -> str:
    """The summary table; ``missing`` (key: reason) lists methods that could not be built."""
    head = (f"{'method':<40} {'exact NELBO':>11} {'train NELBO':>11} {'mean grad var':>13} "
            f"{'mean bias²':>11} {'mean bias² raw':>14} {'time s':>7} {'evals':>5}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.spec.label:<40} {r.final.exact_nelbo:11.3f} {r.last_epoch_train_nelbo:11.3f} "
                     f"{r.mean_variance:13.3e} {r.mean_bias:11.3e} {r.mean_bias_raw:14.3e} {r.seconds:7.1f} "
                     f"{r.evals:5d}")
    for key, reason in (missing or {}).items():
        lines.append(f"{METHODS[key].label:<40} {reason}")
    return "\n".join(lines)


def available(keys: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Split method keys into those that can be built and those that cannot (with the reason).

    Examples:
        >>> available(["score", "expect"])
        (['score', 'expect'], {})
    """
    ok, missing = [], {}
    for key in keys:
        reason = METHODS[key].missing()
        if reason is None:
            ok.append(key)
        else:
            missing[key] = reason
    return ok, missing


def run_vae(config: VAEConfig, out: TextIO | None = None, progress_bar: bool = True) -> list[RunResult]:
    """Train the discrete VAE with each method in ``config.methods`` and print the tables.

    Examples:
        >>> import io
        >>> buf = io.StringIO()
        >>> res = run_vae(quick_config(methods=("score-rloo",), epochs=1), out=buf, progress_bar=False)
        >>> "Summary" in buf.getvalue(), len(res)
        (True, 1)
    """
    out = sys.stdout if out is None else out
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    n, d = config.train_data.shape
    print(f"Discrete VAE (manual §1.3) on {config.data_name}", file=out)
    print(f"model {d}-{config.hidden[0]}-{config.hidden[1]}-({config.latents}x{config.categories} one-hot)-"
          f"{config.hidden[1]}-{config.hidden[0]}-{d}; Adam lr={config.lr:g}, batch {config.batch_size}, "
          f"{config.epochs} epoch(s), seed {config.seed}", file=out)
    print(f"every {config.eval_every} steps: {config.grad_samples} gradient samples w.r.t. the encoder logits (from z.param_grads['logits']) "
          f"on a fixed batch of {config.eval_batch} images vs Expect; exact NELBO on "
          f"{min(n, config.nelbo_subset)} training images drawn at random.", file=out)
    print("grad var = total variance (sum over elements, mean over data); bias² raw = |mean - exact|² "
          "as in the manual; bias² = raw - var/S (≈0 when unbiased). See storch/demo/vae.py.", file=out)
    keys, missing = available(config.methods)
    for key, reason in missing.items():
        print(f"{METHODS[key].label} ({key}): {reason}", file=out)
    results = [train(METHODS[key], config, out, progress_bar) for key in keys]
    print("\nSummary (exact NELBO at the end; train NELBO = mean over the last epoch; means over all "
          "evaluations; evals = cost evaluations per datum and step)", file=out)
    print(format_summary(results, missing), file=out)
    out.flush()
    return results
