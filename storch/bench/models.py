"""The models of the ARM / DisARM papers and the GSB paper's appendix B.

Every model describes its latent layers (`Latent`) and one generative story,
`BenchModel.story`, written once for both uses:

* training: ``sample(i, name, q)`` is the storch method of layer ``i`` and the inputs carry the
  ``data`` plate, so each term keeps the plates of the nodes it depends on and is registered with
  `storch.add_cost`;
* evaluation: ``sample`` draws ``K`` plain samples ancestrally and the same terms give the
  importance weights ``log w = log p(x, z) − log q(z | x)`` (shape ``(K, B)``).

Log-densities are written as ``z·logits − softplus(logits)`` (Bernoulli) and ``Σ z·log_softmax``
(one-hot categorical), so that relaxed samples (Gumbel-softmax) give the usual relaxed objective.

Models (``x`` of dimension ``D`` taken from the data; latent sizes by default as in the papers):

* ``sbn-linear``: D-[200], q(z|x) = Bern(Linear(x)), p(x|z) = Bern(Linear(z)), learned prior logits.
* ``sbn-nonlinear``: D-200-200-[200], tanh hidden layers in encoder and decoder.
* ``sbn-two-layer``: D-[200]-[200], q(z1|x), q(z2|z1), p(z1|z2), p(x|z1), learned prior on z2.
* ``sbn-categorical``: D-[20 x 10 one-hot], the GSB paper's "one layer" belief network with
  categorical latents (Table 2): linear encoder and decoder, learned prior logits.
* ``bernoulli-vae``: MLP D-512-256-[200 Bernoulli]-256-512-D (ReLU), uniform prior Bern(1/2).
* ``categorical-vae``: MLP D-512-256-[20 x 10 one-hot]-256-512-D (ReLU), uniform categorical prior.

The decoder's output bias starts at the logit of the training pixel means.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Bernoulli, Distribution, OneHotCategorical

import storch

__all__ = ["MODELS", "BenchModel", "Latent", "bernoulli_log_prob", "categorical_log_prob", "make_model"]

MODELS = {
    "sbn-linear": "D-[200] linear sigmoid belief network (ARM/DisARM), learned prior",
    "sbn-nonlinear": "D-200-200-[200] sigmoid belief network, tanh hidden layers",
    "sbn-two-layer": "D-[200]-[200] two stochastic layers (ELBO only)",
    "sbn-categorical": "D-[20 x 10 one-hot] linear belief network with categorical latents (GSB Table 2), learned prior",
    "bernoulli-vae": "MLP D-512-256-[200 Bernoulli], uniform prior",
    "categorical-vae": "MLP D-512-256-[20 x 10 one-hot categorical] (GSB paper), uniform prior",
}


def bernoulli_log_prob(logits: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``log Bern(z; logits)`` per coordinate, also for relaxed ``z`` in [0, 1]."""
    return z * logits - F.softplus(logits)


def categorical_log_prob(logits: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``log Cat(z; logits)`` of a one-hot (or relaxed) ``z``, summed over the categories."""
    return (z * logits.log_softmax(-1)).sum(-1)


@dataclass(frozen=True)
class Latent:
    name: str
    kind: str  # "bernoulli" or "categorical"
    variables: int  # D independent variables per datum
    categories: int  # K values each (2 for Bernoulli)

    @property
    def shape(self) -> tuple:
        return (self.variables,) if self.kind == "bernoulli" else (self.variables, self.categories)

    @property
    def support(self) -> int:
        """Joint configurations per datum, ``K^D``."""
        return self.categories ** self.variables

    def dummy(self) -> Distribution:
        """A distribution of this layer's shape for one datum (to count evaluation points)."""
        if self.kind == "bernoulli":
            return Bernoulli(logits=torch.zeros(self.variables))
        return OneHotCategorical(logits=torch.zeros(self.variables, self.categories))


Sampler = Callable[[int, str, Distribution], torch.Tensor]


def _init_output_bias(layer: nn.Linear, train_mean: torch.Tensor | None) -> None:
    if train_mean is not None:
        with torch.no_grad():
            m = train_mean.clamp(1e-3, 1 - 1e-3)
            layer.bias.copy_(torch.log(m) - torch.log1p(-m))


class BenchModel(nn.Module, ABC):
    """Base class: ``latents`` (top first, in sampling order), `story` and its helpers."""

    latents: list[Latent]
    iwae_ok = True  # one stochastic layer: the importance-weighted bound applies

    @abstractmethod
    def story(self, x: torch.Tensor, sample: Sampler) -> dict[str, torch.Tensor]:
        """The negative ELBO as named terms (one value per sample and datum); ``−Σ terms = log w``."""

    def forward(self, x: torch.Tensor, sample: Sampler) -> dict[str, torch.Tensor]:
        """`story`, so that a ``DistributedDataParallel`` wrapper sees the forward pass."""
        return self.story(x, sample)

    @abstractmethod
    def encoder_weight(self) -> torch.Tensor:
        """The encoder's first layer weight (its gradient's variance is reported)."""

    def point_width(self) -> int:
        """Floats the story computes for one datum at one evaluation point of the estimator.

        The latent sample and every layer computed from it (for one stochastic layer, the decoder);
        the encoder runs once per datum, not per point. `storch.bench.memory` scales it to the
        memory of a training step.
        """
        return math.prod(self.latents[0].shape) + _linear_widths(self.decoder)

    # -------------------------------------------------------------- shared pieces
    def _one_layer(self, x, sample, q_logits, prior_logits, decode) -> dict[str, torch.Tensor]:
        lat = self.latents[0]
        if lat.kind == "bernoulli":
            q = Bernoulli(logits=q_logits)
            z = sample(0, lat.name, q)
            log_q = bernoulli_log_prob(q_logits, z).sum(-1)
            log_pz = bernoulli_log_prob(prior_logits, z).sum(-1)
            z_flat = z
        else:
            q_logits = q_logits.reshape(q_logits.shape[:-1] + (lat.variables, lat.categories))
            q = OneHotCategorical(logits=q_logits)
            z = sample(0, lat.name, q)
            log_q = categorical_log_prob(q_logits, z).sum(-1)
            log_pz = categorical_log_prob(prior_logits, z).sum(-1)
            z_flat = z.reshape(z.shape[:-2] + (lat.variables * lat.categories,))
        log_px = bernoulli_log_prob(decode(z_flat), x).sum(-1)
        return {"reconstruction": -log_px, "kl": log_q - log_pz}


def _linear_widths(module: nn.Module) -> int:
    """The output features of every `nn.Linear` in ``module`` (itself included)."""
    return sum(m.out_features for m in module.modules() if isinstance(m, nn.Linear))


class SBNLinear(BenchModel):
    """One stochastic layer with linear maps and learned prior logits: Bernoulli latents
    (``sbn-linear``, D-[200]) or, with ``categories``, one-hot categorical ones (``sbn-categorical``,
    D-[20 x 10], the GSB paper's one-layer categorical model)."""

    def __init__(self, input_dim: int, latent_dim: int = 200, categories: int | None = None, train_mean=None, **_):
        super().__init__()
        lat = Latent("z", "bernoulli", latent_dim, 2) if categories is None else Latent("z", "categorical", latent_dim, categories)
        self.latents = [lat]
        width = math.prod(lat.shape)
        self.encoder = nn.Linear(input_dim, width)
        self.decoder = nn.Linear(width, input_dim)
        self.prior_logits = nn.Parameter(torch.zeros(lat.shape))
        _init_output_bias(self.decoder, train_mean)

    def story(self, x, sample):
        return self._one_layer(x, sample, self.encoder(x), self.prior_logits, self.decoder)

    def encoder_weight(self):
        return self.encoder.weight


def _sbn_categorical(input_dim: int, latent_dim: int = 20, categories: int = 10, train_mean=None, **_) -> SBNLinear:
    return SBNLinear(input_dim, latent_dim, categories, train_mean=train_mean)


class SBNNonlinear(BenchModel):
    def __init__(self, input_dim: int, latent_dim: int = 200, hidden: int = 200, train_mean=None, **_):
        super().__init__()
        self.latents = [Latent("z", "bernoulli", latent_dim, 2)]
        self.encoder = nn.Sequential(nn.Linear(input_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                     nn.Linear(hidden, latent_dim))
        self.decoder = nn.Sequential(nn.Linear(latent_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                     nn.Linear(hidden, input_dim))
        self.prior_logits = nn.Parameter(torch.zeros(latent_dim))
        _init_output_bias(self.decoder[-1], train_mean)

    def story(self, x, sample):
        return self._one_layer(x, sample, self.encoder(x), self.prior_logits, self.decoder)

    def encoder_weight(self):
        return self.encoder[0].weight


class SBNTwoLayer(BenchModel):
    iwae_ok = False

    def __init__(self, input_dim: int, latent_dim: int = 200, train_mean=None, **_):
        super().__init__()
        self.latents = [Latent("z1", "bernoulli", latent_dim, 2), Latent("z2", "bernoulli", latent_dim, 2)]
        self.q1 = nn.Linear(input_dim, latent_dim)  # q(z1 | x)
        self.q2 = nn.Linear(latent_dim, latent_dim)  # q(z2 | z1)
        self.p1 = nn.Linear(latent_dim, latent_dim)  # p(z1 | z2)
        self.px = nn.Linear(latent_dim, input_dim)  # p(x | z1)
        self.prior_logits = nn.Parameter(torch.zeros(latent_dim))  # p(z2)
        _init_output_bias(self.px, train_mean)

    def story(self, x, sample):
        l1 = self.q1(x)
        z1 = sample(0, "z1", Bernoulli(logits=l1))
        l2 = self.q2(z1)
        z2 = sample(1, "z2", Bernoulli(logits=l2))
        log_px = bernoulli_log_prob(self.px(z1), x).sum(-1)
        kl1 = bernoulli_log_prob(l1, z1).sum(-1) - bernoulli_log_prob(self.p1(z2), z1).sum(-1)
        kl2 = bernoulli_log_prob(l2, z2).sum(-1) - bernoulli_log_prob(self.prior_logits, z2).sum(-1)
        return {"reconstruction": -log_px, "kl_z1": kl1, "kl_z2": kl2}

    def encoder_weight(self):
        return self.q1.weight

    def point_width(self) -> int:
        """Both latents and the layers after ``z1`` (``q(z2|z1)``, ``p(z1|z2)``, ``p(x|z1)``), counted at
        every point (an upper bound: ``q(z2|z1)`` only runs at the points of ``z1``)."""
        return 2 * self.q2.out_features + _linear_widths(nn.ModuleList([self.q2, self.p1, self.px]))


class _MLPVAE(BenchModel):
    def __init__(self, input_dim: int, latent: Latent, hidden=(512, 256), train_mean=None):
        super().__init__()
        self.latents = [latent]
        h1, h2 = hidden
        width = latent.variables * (1 if latent.kind == "bernoulli" else latent.categories)
        self.encoder = nn.Sequential(nn.Linear(input_dim, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(),
                                     nn.Linear(h2, width))
        self.decoder = nn.Sequential(nn.Linear(width, h2), nn.ReLU(), nn.Linear(h2, h1), nn.ReLU(),
                                     nn.Linear(h1, input_dim))
        # uniform prior: logits 0 (Bern(1/2), or 1/K for each category); a buffer, not learned
        self.register_buffer("prior_logits", torch.zeros(latent.shape))
        _init_output_bias(self.decoder[-1], train_mean)

    def story(self, x, sample):
        return self._one_layer(x, sample, self.encoder(x), self.prior_logits, self.decoder)

    def encoder_weight(self):
        return self.encoder[0].weight


class BernoulliVAE(_MLPVAE):
    def __init__(self, input_dim: int, latent_dim: int = 200, train_mean=None, **_):
        super().__init__(input_dim, Latent("z", "bernoulli", latent_dim, 2), train_mean=train_mean)


class CategoricalVAE(_MLPVAE):
    def __init__(self, input_dim: int, latent_dim: int = 20, categories: int = 10, train_mean=None, **_):
        super().__init__(input_dim, Latent("z", "categorical", latent_dim, categories), train_mean=train_mean)


_CLASSES = {"sbn-linear": SBNLinear, "sbn-nonlinear": SBNNonlinear, "sbn-two-layer": SBNTwoLayer,
            "sbn-categorical": _sbn_categorical, "bernoulli-vae": BernoulliVAE, "categorical-vae": CategoricalVAE}


def make_model(name: str, input_dim: int, train_mean=None, latent_dim: int | None = None,
               categories: int | None = None) -> BenchModel:
    """Build model ``name`` for inputs of dimension ``input_dim`` (``latent_dim``/``categories``
    override the papers' sizes, e.g. to make enumeration feasible)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    kw = {"train_mean": train_mean}
    if latent_dim is not None:
        kw["latent_dim"] = latent_dim
    if categories is not None:
        if name not in ("categorical-vae", "sbn-categorical"):
            raise ValueError("--categories applies to the categorical models (sbn-categorical, categorical-vae) only")
        kw["categories"] = categories
    return _CLASSES[name](input_dim, **kw)


# ------------------------------------------------------------------ the two uses of the story


def storch_story(model: nn.Module, batch: torch.Tensor, methods, objective: str = "elbo"):
    """Register the training costs of one minibatch; returns the bound (iwae) or None.

    ``model`` is a `BenchModel` or a ``DistributedDataParallel`` wrapping one (called, so that
    DDP prepares its gradient all-reduce).
    """
    inner: BenchModel = getattr(model, "module", model)
    x = storch.denote_independent(batch, 0, "data")
    nodes = {}

    def sample(i, name, q):
        z = methods[name](q)
        nodes[name] = z
        return z

    terms = model(x, sample)
    if objective == "iwae":
        log_w = -sum(terms.values())
        return storch.method.iwae_bound(log_w, nodes[inner.latents[0].name])
    for name, t in terms.items():
        storch.add_cost(t, name)
    return None


@torch.no_grad()
def log_weights(model: BenchModel, x: torch.Tensor, k: int) -> torch.Tensor:
    """``log p(x, z_k) − log q(z_k | x)`` for ``k`` ancestral samples, shape ``(k, B)`` (plain torch)."""

    def sample(i, name, q):
        return q.sample((k,)) if i == 0 else q.sample()

    terms = model.story(x, sample)
    return -sum(terms.values())


@torch.no_grad()
def estimator_nelbo(model: BenchModel, x: torch.Tensor, methods, chunk: int) -> float:
    """The −ELBO as the estimator's own samples give it, in nats per datum: its training objective.

    ``methods`` (one per latent layer, as in `storch_story`) draw the samples; for a relaxation
    (Gumbel-softmax) they are relaxed, so this is the *relaxed* −ELBO, which `evaluate_bounds` (hard
    samples) does not give. It is the forward value of the surrogate loss (no backward pass, no
    method state updated), on chunks of ``chunk`` data (the training step's memory).
    """
    total, n = 0.0, x.shape[0]
    for start in range(0, n, chunk):
        xb = x[start:start + chunk]
        storch.reset()
        try:
            storch_story(model, xb, methods, "elbo")
            total += float(storch.surrogate_loss()) * xb.shape[0]
        finally:
            storch.reset()
    return total / n


@torch.no_grad()
def evaluate_bounds(model: BenchModel, x: torch.Tensor, k: int, chunk: int = 100):
    """Mean −ELBO (over the ``k`` samples) and −log p(x) by the ``k``-sample bound, in nats per datum."""
    nelbo, nll, n = 0.0, 0.0, x.shape[0]
    for start in range(0, n, chunk):
        xb = x[start:start + chunk]
        lw = log_weights(model, xb, k)
        nelbo -= float(lw.mean(0).sum())
        nll -= float((torch.logsumexp(lw, 0) - math.log(k)).sum())
    return nelbo / n, nll / n
