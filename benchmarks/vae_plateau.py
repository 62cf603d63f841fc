"""Diagnostics of a Bernoulli VAE's training: does it leave the initial plateau, and why not.

Trains `storch-bench`'s ``bernoulli-vae`` with one estimator, as `storch-bench`
does (Adam, minibatches of the training set, dynamic binarisation where the data set has it), and
every ``--diag-every`` steps writes one CSV row of diagnostics:

* ``test_nelbo``: test −ELBO (10 samples per image, ``--eval-size`` fixed test images);
* ``recon``, ``kl``: its two parts, the reconstruction ``−E_q log p(x|z)`` and the exact
  ``KL(q(z|x) ‖ p(z))`` (the prior is a Bernoulli per latent, so the KL is a sum of closed forms);
* ``sat01``, ``sat05``: the fraction of the ``q(z_d|x)`` outside [0.01, 0.99] and [0.05, 0.95];
* ``entropy``: the mean entropy of a latent, ``H(q(z_d|x))`` in nats (``log 2 = 0.693`` at 1/2);
* ``active``: active units (Burda et al. 2016), the latents with ``Cov_x(E_q[z_d]) > 0.01``;
* ``dead1``, ``dead2``: the encoder's hidden ReLU units that are 0 on every image of the set
  (a dead unit passes no gradient to the layers below it);
* ``x_dep``: how much the encoder's output depends on the image: the standard deviation over images
  of the logits, averaged over the latents (0 when ``q(z|x)`` is the same for every ``x``);
* ``g_enc``, ``g_enc_rec``, ``g_enc_kl``: the norm of the estimator's gradient of the encoder's
  parameters, and its parts from the reconstruction cost and from the KL cost (one draw, the same
  samples for both parts: ``g_enc`` is the norm of their sum); ``g_enc_kl_exact``: the norm of the
  exact gradient of the KL (closed form); ``g_dec``: the decoder's gradient norm; all on a fixed
  minibatch of ``--batch-size`` training images, with a copy of the estimator (training is not
  changed by the probes);
* with ``--ref-every``: ``ref_cos``, the cosine between the mean of ``--ref-reps`` estimates of the
  encoder's gradient and a reference, the mean of ``--ref-reps`` DisARM estimates with
  ``--ref-pairs`` antithetic pairs each, on ``--ref-batch`` images; ``ref_z2``: the mean over the
  encoder's weights of ``(mean_est − mean_ref)² / (se_est² + se_ref²)``, about 1 for an unbiased
  estimator (much larger for a biased one); ``ref_norm``: the reference's norm;
* with ``--estimator auto`` (`storch.method.Auto` at a budget of ``--n-samples`` cost evaluations per
  datum): ``auto_choice``, the candidate it uses.

Run from the repository root; output to a CSV file, a checkpoint beside it (``.pt``) every row, so
that an interrupted run resumes where it stopped::

    python benchmarks/vae_plateau.py --estimator local-expectation --lr 1e-4 --batch-size 100 \\
        --steps 3000 --diag-every 100 --out runs/plateau/le.csv

``--latent-dim`` shrinks the latent layer (fewer points per sample for local expectation),
``--kl-warmup N`` multiplies the KL cost by ``min(1, step/N)`` (a KL warm-up), ``--analytic-kl``
trains with the KL in closed form (a cost without ``z``, exact gradient) instead of
``log q(z|x) − log p(z)`` at the samples (the diagnostics' ``g_enc_kl`` stays the estimator's
gradient of the sampled KL, for comparison), ``--init glorot`` starts from Glorot-uniform weights
and zero biases, ``--threads`` sets torch's threads (default 1).
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import storch
from storch import method as sm
from storch.bench.data import eval_subset, load_dataset
from storch.bench.estimators import ESTIMATORS, build_methods, samples_for_budget
from storch.bench.models import evaluate_bounds, make_model

FIELDS = ["step", "seconds", "test_nelbo", "recon", "kl", "sat01", "sat05", "entropy", "active", "dead1", "dead2",
          "x_dep", "g_enc", "g_enc_rec", "g_enc_kl", "g_enc_kl_exact", "g_dec", "ref_cos", "ref_z2", "ref_norm", "auto_choice"]


def encoder_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    return model.encoder, model.decoder


@torch.no_grad()
def latent_stats(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Saturation, entropy, active units, dead ReLUs and the exact KL of ``q(z|x)`` on the images ``x``."""
    enc = model.encoder
    h1 = F.relu(enc[0](x))
    h2 = F.relu(enc[2](h1))
    logits = enc[4](h2)
    p = torch.sigmoid(logits)
    prior = torch.sigmoid(model.prior_logits)
    ent = F.binary_cross_entropy_with_logits(logits, p, reduction="none")  # H(q_d) = −p log p − (1−p) log(1−p)
    kl = (p * (F.logsigmoid(logits) - torch.log(prior)) + (1 - p) * (F.logsigmoid(-logits) - torch.log1p(-prior)))
    return {
        "kl": float(kl.sum(-1).mean()),
        "sat01": float(((p < 0.01) | (p > 0.99)).float().mean()),
        "sat05": float(((p < 0.05) | (p > 0.95)).float().mean()),
        "entropy": float(ent.mean()),
        "active": int((p.var(0) > 0.01).sum()),
        "dead1": int((h1.amax(0) == 0).sum()),
        "dead2": int((h2.amax(0) == 0).sum()),
        "x_dep": float(logits.std(0).mean()),
    }


def closed_form_kl(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``KL(q(z|x) ‖ p(z))`` per image, summed over the latents, in closed form (differentiable; on a
    storch tensor with the ``data`` plate it is a cost that does not depend on ``z``)."""
    logits = model.encoder(x)
    p = torch.sigmoid(logits)
    prior = torch.sigmoid(model.prior_logits)
    kl = p * (F.logsigmoid(logits) - torch.log(prior)) + (1 - p) * (F.logsigmoid(-logits) - torch.log1p(-prior))
    return kl.sum(-1)


def exact_kl(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`closed_form_kl`, mean over the images."""
    return closed_form_kl(model, x).mean()


def flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def estimate(model, methods, x, terms: tuple[str, ...], scale: dict[str, float] | None = None):
    """One gradient estimate of the mean over ``x`` of the named cost terms (a fresh copy of ``methods``)."""
    methods = copy.deepcopy(methods)
    storch.reset()
    model.zero_grad(set_to_none=True)
    xs = storch.denote_independent(x, 0, "data")
    out = model.story(xs, lambda i, name, q: methods[name](q))
    for name in terms:
        storch.add_cost(out[name] * (scale or {}).get(name, 1.0), name)
    storch.backward()
    enc, dec = encoder_parts(model)
    g = flat_grad(enc.parameters()), flat_grad(dec.parameters())
    model.zero_grad(set_to_none=True)
    return g


def gradient_norms(model, methods, x, seed: int) -> dict[str, float]:
    """The estimator's encoder gradient, split into its reconstruction and KL parts (same samples)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        g_rec, g_dec = estimate(model, methods, x, ("reconstruction",))
        torch.manual_seed(seed)
        g_kl, _ = estimate(model, methods, x, ("kl",))
    model.zero_grad(set_to_none=True)
    exact_kl(model, x).backward()
    g_kl_exact = flat_grad(model.encoder.parameters())
    model.zero_grad(set_to_none=True)
    return {"g_enc": float((g_rec + g_kl).norm()), "g_enc_rec": float(g_rec.norm()), "g_enc_kl": float(g_kl.norm()),
            "g_enc_kl_exact": float(g_kl_exact.norm()), "g_dec": float(g_dec.norm())}


def reference_agreement(model, methods, x, reps: int, pairs: int, seed: int) -> dict[str, float]:
    """The estimator's mean encoder gradient against a many-pair DisARM mean on the images ``x``."""
    lat = model.latents[0]
    ref_methods = {lat.name: sm.DisARM(lat.name, n_samples=pairs)}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        est = torch.stack([estimate(model, methods, x, ("reconstruction", "kl"))[0] for _ in range(reps)])
        ref = torch.stack([estimate(model, ref_methods, x, ("reconstruction", "kl"))[0] for _ in range(reps)])
    me, mr = est.mean(0), ref.mean(0)
    se2 = est.var(0) / reps + ref.var(0) / reps
    ok = se2 > 0
    z2 = float(((me - mr)[ok] ** 2 / se2[ok]).mean()) if ok.any() else float("nan")
    cos = float(F.cosine_similarity(me, mr, dim=0))
    return {"ref_cos": cos, "ref_z2": z2, "ref_norm": float(mr.norm())}


def glorot_init(model: nn.Module) -> None:
    """Glorot-uniform weights and zero biases (the default of TensorFlow/Keras dense layers), the
    decoder's output bias kept at the logit of the pixel means."""
    out_bias = model.decoder[-1].bias.detach().clone()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    with torch.no_grad():
        model.decoder[-1].bias.copy_(out_bias)


def build(args):
    data = load_dataset(args.data, args.data_dir)
    torch.manual_seed(args.seed)
    model = make_model(args.model, data.input_dim, data.train_mean, args.latent_dim, None)
    est = ESTIMATORS[args.estimator]
    n, _ = samples_for_budget(est, model.latents, None, args.n_samples)
    methods = build_methods(est, model.latents, n, argparse.Namespace(baseline=None, temperature=None, spsa_c=None))
    if args.init == "glorot":
        glorot_init(model)
    for m in methods.values():
        if isinstance(m, sm.Auto):
            m.build(model.latents[0].dummy())
    return data, model, methods


def train(args) -> None:
    torch.set_num_threads(args.threads)
    data, model, methods = build(args)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.auto_optimizer:  # Auto clears Adam's state when its first round ends
        for m in methods.values():
            if isinstance(m, sm.Auto):
                m.optimizer = opt
    g = torch.Generator().manual_seed(12345)
    test_x = eval_subset(data.test, args.eval_size)
    diag_x = data.binarize(eval_subset(data.train, args.eval_size), g)
    probe_x = diag_x[: args.batch_size]
    batch_gen = torch.Generator().manual_seed(args.seed + 1)
    bin_gen = torch.Generator().manual_seed(args.seed + 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ckpt = out.with_suffix(".pt")
    step, seconds, rows = 0, 0.0, []
    if ckpt.is_file() and not args.overwrite:
        s = torch.load(ckpt, weights_only=False)
        model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])
        for name, m in methods.items():
            m.load_state_dict(s["methods"][name])
        step, seconds, rows = s["step"], s["seconds"], s["rows"]
        batch_gen.set_state(s["batch_gen"]), bin_gen.set_state(s["bin_gen"]), torch.set_rng_state(s["rng"])
        print(f"resumed at step {step}", flush=True)

    def diagnose():
        row = {"step": step, "seconds": round(seconds, 1)}
        with torch.random.fork_rng():
            torch.manual_seed(10_007 + step)
            nelbo, _ = evaluate_bounds(model, test_x, 10)
        row["test_nelbo"] = nelbo
        row.update(latent_stats(model, diag_x))
        row["recon"] = nelbo - latent_stats(model, test_x)["kl"]
        row.update(gradient_norms(model, methods, probe_x, seed=20_011 + step))
        if args.ref_every and step % args.ref_every == 0:
            row.update(reference_agreement(model, methods, diag_x[: args.ref_batch], args.ref_reps, args.ref_pairs,
                                           seed=30_011 + step))
        for m in methods.values():
            if isinstance(m, sm.Auto):
                row["auto_choice"] = m.choice
        rows.append(row)
        with open(out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "methods": {k: m.state_dict() for k, m in methods.items()}, "step": step, "seconds": seconds,
                    "rows": rows, "batch_gen": batch_gen.get_state(), "bin_gen": bin_gen.get_state(),
                    "rng": torch.get_rng_state()}, ckpt)

    if not rows:
        diagnose()
    perm, pos = torch.randperm(data.train.shape[0], generator=batch_gen), 0
    while step < args.steps:
        if pos + args.batch_size > perm.numel():
            perm, pos = torch.randperm(data.train.shape[0], generator=batch_gen), 0
        x = data.binarize(data.train[perm[pos:pos + args.batch_size]], bin_gen)
        pos += args.batch_size
        t0 = time.perf_counter()
        storch.reset()
        opt.zero_grad(set_to_none=True)
        xs = storch.denote_independent(x, 0, "data")
        terms = model.story(xs, lambda i, name, q: methods[name](q))
        warm = min(1.0, (step + 1) / args.kl_warmup) if args.kl_warmup else 1.0
        storch.add_cost(terms["reconstruction"], "reconstruction")
        kl = closed_form_kl(model, xs) if args.analytic_kl else terms["kl"]
        storch.add_cost(kl * warm, "kl")
        storch.backward()
        opt.step()
        seconds += time.perf_counter() - t0
        step += 1
        if step == args.reset_optimizer_at:  # Adam's moments forgotten (what earlier steps left in them)
            opt.state.clear()
        if step % args.diag_every == 0 or step == args.steps:
            diagnose()


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default="bernoulli-vae", choices=("bernoulli-vae",),
      help="the MLP VAE with Bernoulli latents (the diagnostics read its encoder's three layers)")
    a("--estimator", default="local-expectation", choices=sorted(ESTIMATORS))
    a("--n-samples", type=int, default=None)
    a("--data", default="binarized-mnist")
    a("--data-dir", default=None)
    a("--latent-dim", type=int, default=None)
    a("--lr", type=float, default=1e-3)
    a("--batch-size", type=int, default=50)
    a("--steps", type=int, default=1000)
    a("--seed", type=int, default=0)
    a("--init", default="torch", choices=("torch", "glorot"),
      help="torch: PyTorch's nn.Linear default (as storch-bench); glorot: Glorot-uniform weights, zero biases")
    a("--analytic-kl", action="store_true",
      help="train with the KL in closed form (a cost without z) instead of log q(z|x) - log p(z) at the samples")
    a("--kl-warmup", type=int, default=0, help="multiply the KL cost by min(1, step/N) (0: no warm-up)")
    a("--auto-optimizer", action="store_true",
      help="give Auto the optimizer (Auto(optimizer=...)): its state is cleared when the first round ends")
    a("--reset-optimizer-at", type=int, default=0,
      help="clear Adam's moment estimates after this step (0: never); e.g. after Auto's first round, to see "
           "whether its measurement steps hold it on the plateau through Adam's second moment")
    a("--diag-every", type=int, default=100)
    a("--eval-size", type=int, default=1000)
    a("--ref-every", type=int, default=0, help="the reference comparison every N steps (0: never)")
    a("--ref-batch", type=int, default=10)
    a("--ref-reps", type=int, default=20)
    a("--ref-pairs", type=int, default=50)
    a("--threads", type=int, default=1)
    a("--out", required=True)
    a("--overwrite", action="store_true", help="start again even if a checkpoint exists")
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse(sys.argv[1:]))
