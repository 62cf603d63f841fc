"""The discrete-VAE benchmark model and its training step hand-written in plain PyTorch.

This module imports nothing but ``torch``, so that three programs can share it and use
identical layers:

* ``benchmarks/run.py`` (our venv): hand-written step vs. our ``storch`` step;
* ``benchmarks/storchastic_step.py`` (``.venv-storchastic``): hand-written step vs.
  Storchastic 0.3.7.

Model (SPEC section 6): 784-512-256-(20x10)-256-512-784 with ReLU hidden layers and a sigmoid
output, the architecture of the manual's discrete-VAE tutorial with 20 categorical latent
variables of 10 classes.

Estimator implemented by :func:`handwritten_step` (the score function with ``n`` samples and
the leave-one-out "batch average" baseline, Kool et al. 2019):

    q = OneHotCategorical(softmax(encode(x)))            # 20 independent categoricals
    z_j ~ q, j = 1..n  (no gradient)                     # shape (n, B, 20, 10)
    KL  = sum_latents KL(q || Uniform(10))               # shape (B,), does not depend on z
    f_j = KL + sum_pixels BCE(decode(z_j), x)            # shape (n, B)
    b_j = (sum_{m != j} f_m) / (n - 1)                   # leave-one-out baseline
    surrogate = mean_{j, batch} [ stopgrad(f_j - b_j) * log q(z_j) + f_j ]

Its gradient is an unbiased estimate of the gradient of E_q[f]: the encoder gets the
score-function term plus the pathwise gradient of the KL (through ``f_j``), the decoder the
gradient of the reconstruction cost. The KL is not multiplied by the score: it enters
``f_j - b_j`` but cancels there, since every sample has the same KL.

The step deliberately builds ``q`` and the KL with ``torch.distributions`` (as the storch and
Storchastic versions do, following the manual) so that the ratio of step times measures the
framework overhead and not the cost of ``torch.distributions``. :func:`handwritten_step_raw`
is the same estimator with raw tensor ops, reported for information as a lower bound.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import OneHotCategorical, kl_divergence

LATENTS = 20
CLASSES = 10
IN_DIM = 784


class DiscreteVAE(nn.Module):
    """784-512-256-(latents x classes)-256-512-784 VAE with a one-hot categorical latent."""

    def __init__(self, latents: int = LATENTS, classes: int = CLASSES, in_dim: int = IN_DIM):
        super().__init__()
        self.latents = latents
        self.classes = classes
        self.in_dim = in_dim
        self.fc1 = nn.Linear(in_dim, 512)
        self.fc2 = nn.Linear(512, 256)
        self.fc3 = nn.Linear(256, latents * classes)
        self.fc4 = nn.Linear(latents * classes, 256)
        self.fc5 = nn.Linear(256, 512)
        self.fc6 = nn.Linear(512, in_dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (..., latents * classes)."""
        h1 = self.fc1(x).relu()
        h2 = self.fc2(h1).relu()
        return self.fc3(h2)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Bernoulli means of shape (..., in_dim) from a flattened latent (..., latents * classes)."""
        h3 = self.fc4(z).relu()
        h4 = self.fc5(h3).relu()
        return self.fc6(h4).sigmoid()


def make_model_and_optimizer(seed: int = 0, lr: float = 1e-3):
    """A fresh model and its Adam optimizer, with a fixed initialisation."""
    torch.manual_seed(seed)
    model = DiscreteVAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optimizer


def make_data(batch: int, seed: int = 1, in_dim: int = IN_DIM) -> torch.Tensor:
    """Random binary data of shape (batch, in_dim) (pixels ~ Bernoulli(0.5))."""
    g = torch.Generator().manual_seed(seed)
    return torch.bernoulli(torch.full((batch, in_dim), 0.5), generator=g)


def leave_one_out_baseline(f: torch.Tensor) -> torch.Tensor:
    """b_j = mean of the other samples' costs along dim 0 (needs n >= 2)."""
    n = f.shape[0]
    if n < 2:
        raise ValueError("the leave-one-out baseline needs at least 2 samples")
    return (f.sum(0, keepdim=True) - f) / (n - 1)


def handwritten_surrogate(model: DiscreteVAE, x: torch.Tensor, n_samples: int = 8):
    """The surrogate loss of the estimator above and the costs f, shape (n, B).

    ``x`` has shape (B, 784). Differentiating the surrogate gives the gradient estimate.
    """
    logits = model.encode(x).reshape(x.shape[0], model.latents, model.classes)
    q = OneHotCategorical(probs=logits.softmax(dim=-1))
    prior = OneHotCategorical(probs=torch.ones_like(q.probs) / model.classes)
    kl = kl_divergence(q, prior).sum(-1)                                  # (B,)
    with torch.no_grad():
        z = q.sample((n_samples,))                                        # (n, B, L, K)
    log_q = q.log_prob(z).sum(-1)                                         # (n, B)
    recon = model.decode(z.reshape(z.shape[:-2] + (model.latents * model.classes,)))
    bce = F.binary_cross_entropy(recon, x.expand_as(recon), reduction="none").sum(-1)  # (n, B)
    f = kl + bce                                                          # (n, B)
    baseline = leave_one_out_baseline(f.detach())
    surrogate = ((f.detach() - baseline) * log_q + f).mean()
    return surrogate, f


def handwritten_step(model: DiscreteVAE, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                     n_samples: int = 8) -> torch.Tensor:
    """One Adam step of the score-function discrete VAE in plain PyTorch.

    ``x`` has shape (B, 784). Returns the (detached) estimate of the expected cost,
    mean over samples and batch.
    """
    optimizer.zero_grad()
    surrogate, f = handwritten_surrogate(model, x, n_samples)
    surrogate.backward()
    optimizer.step()
    return f.detach().mean()


def handwritten_step_raw(model: DiscreteVAE, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                         n_samples: int = 8) -> torch.Tensor:
    """:func:`handwritten_step` with raw tensor ops instead of ``torch.distributions``."""
    optimizer.zero_grad()
    B, L, K = x.shape[0], model.latents, model.classes
    logits = model.encode(x).reshape(B, L, K)
    log_p = logits.log_softmax(dim=-1)
    p = log_p.exp()
    kl = (p * (log_p + math.log(K))).sum((-2, -1))                        # (B,)
    with torch.no_grad():
        idx = torch.multinomial(p.reshape(B * L, K), n_samples, replacement=True)  # (B*L, n)
        z = F.one_hot(idx.t().reshape(n_samples, B, L), K).to(x.dtype)   # (n, B, L, K)
    log_q = (z * log_p).sum((-2, -1))                                     # (n, B)
    recon = model.decode(z.reshape(n_samples, B, L * K))
    bce = F.binary_cross_entropy(recon, x.expand_as(recon), reduction="none").sum(-1)
    f = kl + bce
    baseline = leave_one_out_baseline(f.detach())
    surrogate = ((f.detach() - baseline) * log_q + f).mean()
    surrogate.backward()
    optimizer.step()
    return f.detach().mean()
