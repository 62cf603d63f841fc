"""The estimators of the benchmark: a name, the latents they apply to, their cost evaluations per
sample, and how to build them for one latent layer.

An equal ``--budget B`` gives every estimator ``B`` cost evaluations per datum and step: ``n`` samples
(or antithetic pairs, or local-expectation groups, ...) of the top latent layer with ``n = B // e``,
where ``e`` is the evaluations one sample costs (the size of its evaluation group, times the
evaluations of the lower layers, which are sampled once per upper sample: ``min_samples`` each).
Enumeration (``expect``) costs the joint support ``K^D`` whatever ``n``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from storch import method as sm
from storch.bench.models import Latent

__all__ = [
    "ESTIMATORS",
    "BudgetError",
    "Estimator",
    "applicable",
    "build_methods",
    "estimator_evals",
    "samples_for_budget",
]

BOTH = ("bernoulli", "categorical")


class BudgetError(ValueError):
    """The budget is too small for (or does not fit) the estimator."""


class ControlVariateNet(nn.Module):
    """``c_φ`` for RELAX: the (relaxed) latent flattened, ``hidden`` tanh units, one output."""

    def __init__(self, latent: Latent, hidden: int = 50):
        super().__init__()
        self.event_dims = len(latent.shape)
        self.net = nn.Sequential(nn.Linear(math.prod(latent.shape), hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z.reshape(z.shape[: z.dim() - self.event_dims] + (-1,)))


@dataclass(frozen=True)
class Estimator:
    name: str
    help: str
    build: Callable[[str, int, argparse.Namespace, Latent], sm.Method]
    evals: Callable[[Latent], int] = lambda lat: 1
    kinds: Sequence[str] = BOTH
    objectives: Sequence[str] = ("elbo",)
    min_samples: int = 1
    #: samples of a lower layer per upper sample (default ``min_samples``). Auto's lower layers get 2, as
    #: RLOO's and DisARM's 2 evaluations: room for a baseline or an antithetic pair (at 1 no candidate has
    #: an effective baseline)
    lower_samples: int | None = None
    exact: bool = False
    max_samples: Callable[[Latent], int] | None = None
    options: Sequence[str] = ()  # the CLI options it reads (shown by `list`, part of the run's label)
    #: lower layers add their points to the top layer's group (chained local expectations: each layer's
    #: ``evals - 1`` changes), instead of multiplying them
    additive_layers: bool = False
    #: its objective's value comes from relaxed samples (not in the discrete support): the objective it
    #: trains, and reports, is a relaxed −ELBO, not the −ELBO at hard samples. The straight-through
    #: variants (hard forward values) and REBAR/RELAX (relaxed samples in the control variate only)
    #: are not relaxed in this sense
    relaxed: bool = False


def _local_expectation_evals(lat: Latent) -> int:
    from storch.method.local_expectation import local_expectation_group_size

    return local_expectation_group_size(lat.dummy())


def _mvd_evals(lat: Latent) -> int:
    return 1 + lat.variables * (lat.categories - 1)


def _auto_cost(args) -> str:
    """Auto's clock: the process's CPU time on the CPU (what ``--seconds`` budgets, and what a busy machine
    does not inflate), wall time on a GPU (the host's CPU time leaves out the device's work)."""
    return "cpu" if str(getattr(args, "device", None) or "cpu") == "cpu" else "time"


def _opt(args, name, default):
    v = getattr(args, name, None)
    return default if v is None else v


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in [
    Estimator("score-function", "REINFORCE, optional baseline (--baseline none|moving_average|batch_average)",
              lambda p, n, a, lat: sm.ScoreFunction(p, n_samples=n, baseline_factory=_opt(a, "baseline", "none")),
              options=("baseline",)),
    Estimator("rloo", "score function with the leave-one-out baseline (= --baseline batch_average), n >= 2",
              lambda p, n, a, lat: sm.ScoreFunction(p, n_samples=n, baseline_factory="batch_average"),
              min_samples=2),
    Estimator("arm", "ARM (Yin & Zhou 2019); n antithetic pairs, 2 evaluations each",
              lambda p, n, a, lat: sm.ARM(p, n_samples=n), evals=lambda lat: 2, kinds=("bernoulli",)),
    Estimator("disarm", "DisARM (Dong et al. 2020); n antithetic pairs, 2 evaluations each",
              lambda p, n, a, lat: sm.DisARM(p, n_samples=n), evals=lambda lat: 2, kinds=("bernoulli",)),
    Estimator("coupled-categorical", "stick-breaking DisARM (Dong, Mnih & Tucker 2021); n antithetic pairs, 2 evaluations each",
              lambda p, n, a, lat: sm.CoupledCategorical(p, n_samples=n), evals=lambda lat: 2, kinds=("categorical",)),
    Estimator("arsm", "ARSM (Yin et al. 2019); one Dirichlet draw per sample, C(C-1)/2+1 evaluations (all variables "
              "swapped at once)",
              lambda p, n, a, lat: sm.ARSM(p, n_samples=n),
              evals=lambda lat: 1 + lat.categories * (lat.categories - 1) // 2, kinds=("categorical",)),
    Estimator("carms", "CARMS (Dimitriev & Zhou 2021); n >= 2 mutually antithetic categorical samples, Dirichlet copula",
              lambda p, n, a, lat: sm.CARMS(p, n_samples=n), min_samples=2, kinds=("categorical",)),
    Estimator("arms", "ARMS (Dimitriev & Zhou 2021); n >= 2 mutually antithetic samples, Dirichlet copula",
              lambda p, n, a, lat: sm.ARMS(p, n_samples=n), min_samples=2, kinds=("bernoulli",)),
    Estimator("double-cv", "double control variates (Titsias & Shi 2022): RLOO + a Taylor control variate, n >= 2",
              lambda p, n, a, lat: sm.DoubleControlVariate(p, n_samples=n), min_samples=2),
    Estimator("vimco", "VIMCO (Mnih & Rezende 2016) for --objective iwae, K = n >= 2",
              lambda p, n, a, lat: sm.VIMCO(p, n_samples=n), objectives=("iwae",), min_samples=2),
    Estimator("vimco-joint", "the joint score function of the iwae bound (VIMCO without baselines)",
              lambda p, n, a, lat: sm.VIMCO(p, n_samples=n, baseline=False), objectives=("iwae",)),
    Estimator("gumbel-softmax", "Gumbel-softmax / Concrete relaxation (--temperature), biased",
              lambda p, n, a, lat: sm.GumbelSoftmax(p, n_samples=n, initial_temperature=_opt(a, "temperature", 1.0)),
              objectives=("elbo", "iwae"), options=("temperature",), relaxed=True),
    Estimator("st-gumbel-softmax", "straight-through Gumbel-softmax (--temperature), biased",
              lambda p, n, a, lat: sm.GumbelSoftmax(p, n_samples=n, straight_through=True,
                                                    initial_temperature=_opt(a, "temperature", 1.0)),
              objectives=("elbo", "iwae"), options=("temperature",)),
    Estimator("straight-through", "straight-through (Bengio et al. 2013), biased",
              lambda p, n, a, lat: sm.StraightThrough(p, n_samples=n), objectives=("elbo", "iwae")),
    Estimator("gumbel-rao", "Gumbel-Rao (Paulus et al. 2021, --temperature), biased",
              lambda p, n, a, lat: sm.GumbelRao(p, n_samples=n, temperature=_opt(a, "temperature", 1.0)),
              objectives=("elbo", "iwae"), options=("temperature",)),
    Estimator("reinmax", "ReinMax (Liu et al. 2023, --temperature), biased",
              lambda p, n, a, lat: sm.ReinMax(p, n_samples=n, temperature=_opt(a, "temperature", 1.0)),
              objectives=("elbo", "iwae"), options=("temperature",)),
    Estimator("gapped-straight-through", "gapped straight-through, GST-1.0 (Fan et al. 2022, --temperature), biased",
              lambda p, n, a, lat: sm.GappedStraightThrough(p, n_samples=n, temperature=_opt(a, "temperature", 1.0)),
              objectives=("elbo", "iwae"), options=("temperature",)),
    Estimator("relax", "RELAX (Grathwohl et al. 2018), MLP control variate on the relaxed latent",
              lambda p, n, a, lat: sm.RELAX(p, control_variate=ControlVariateNet(lat), n_samples=n)),
    Estimator("rebar", "REBAR (Tucker et al. 2017), learned eta and temperature; 3 evaluations per sample",
              lambda p, n, a, lat: sm.REBAR(p, n_samples=n), evals=lambda lat: 3),
    Estimator("local-expectation", "local expectations / IndeCateR; chained layers add their points",
              lambda p, n, a, lat: sm.LocalExpectation(p, n_samples=n), evals=_local_expectation_evals,
              additive_layers=True),
    Estimator("mvd", "measure-valued derivative; 1 + D*(K-1) evaluations per sample",
              lambda p, n, a, lat: sm.MVD(p, n_samples=n), evals=_mvd_evals),
    Estimator("spsa", "SPSA finite differences (--spsa-c), biased; 3 evaluations per perturbation",
              lambda p, n, a, lat: sm.SPSA(p, n_samples=n, c=_opt(a, "spsa_c", 0.1)), evals=lambda lat: 3,
              options=("spsa_c",)),
    Estimator("expect", "exact enumeration of the K^D joint configurations (small latents only, --latent-dim)",
              lambda p, n, a, lat: sm.Expect(p, budget=max(10000, lat.support)), evals=lambda lat: lat.support,
              exact=True),
    Estimator("auto", "storch.method.Auto: the catalog's unbiased estimators at the budget, the one with the lowest "
              "measured second moment x seconds per step (CPU seconds on --device cpu) chosen and re-checked "
              "(record in auto.json, its choices in plots.png)",
              lambda p, n, a, lat: sm.Auto(p, budget=n, relaxed=True, include=("DoubleControlVariate",),
                                           cost=_auto_cost(a)),
              lower_samples=2),
    Estimator("wor", "score function with k = n samples without replacement (unbiased)",
              lambda p, n, a, lat: sm.ScoreFunctionWOR(p, k=n), max_samples=lambda lat: lat.support),
    Estimator("unordered-set", "unordered set estimator (Kool et al. 2020) with its baseline, k = n >= 2",
              lambda p, n, a, lat: sm.UnorderedSetEstimator(p, k=n), min_samples=2,
              max_samples=lambda lat: lat.support),
]}

NOT_INCLUDED = {
    "reparameterization / lax / gsb (continuous rules)": "need continuous latents with rsample; all models here are discrete",
    "gsb (discrete rule)": "on Bernoulli/categorical latents GSB is local-expectation",
    "rao-blackwell": "handles one discrete variable per node; the models have 20-200 variables per layer",
    "unordered-set-gumbel": "one categorical variable per node only",
    "importance sampling (ScoreFunction + ImportanceSampling)": "needs a proposal per model; not wired up",
    "infer": "falls back to the score function with a baseline on discrete latents",
}


def applicable(est: Estimator, latents: Sequence[Latent], objective: str) -> str | None:
    """None if ``est`` applies, else the reason."""
    for lat in latents:
        if lat.kind not in est.kinds:
            return f"{est.name} applies to {' and '.join(est.kinds)} latents, not {lat.kind} ({lat.name})"
    if objective not in est.objectives:
        return f"{est.name} applies to --objective {' or '.join(est.objectives)}, not {objective}"
    return None


def _lower_samples(est: Estimator) -> int:
    return est.min_samples if est.lower_samples is None else est.lower_samples


def estimator_evals(est: Estimator, latents: Sequence[Latent]) -> int:
    """Cost evaluations per datum for one sample of the top layer (lower layers at ``min_samples``)."""
    if est.exact:
        return math.prod(lat.support for lat in latents)
    e = est.evals(latents[0])
    for lat in latents[1:]:
        if est.additive_layers:
            e += est.evals(lat) - 1
        else:
            e *= _lower_samples(est) * est.evals(lat)
    return e


def samples_for_budget(est: Estimator, latents: Sequence[Latent], budget: int | None,
                       n_samples: int | None = None) -> tuple[int, int]:
    """``(n, evaluations per datum)``: ``n`` from ``budget`` if given, else ``n_samples`` (default the
    estimator's minimum). Raises `BudgetError` when the budget is too small or ``n`` invalid."""
    per_sample = estimator_evals(est, latents)
    if est.exact:
        if budget is not None and budget < per_sample:
            raise BudgetError(f"{est.name} evaluates all {per_sample} joint configurations per datum; "
                              f"--budget {budget} is too small")
        if per_sample > 1_000_000:
            raise BudgetError(f"{est.name}: {per_sample:.3g} joint configurations per datum is too many to "
                              "enumerate; use a smaller --latent-dim")
        return 1, per_sample
    if budget is not None:
        n = budget // per_sample
        if n < est.min_samples:
            raise BudgetError(f"--budget {budget} is too small for {est.name}: it needs {per_sample} cost "
                              f"evaluations per sample and at least {est.min_samples} sample(s), i.e. a budget "
                              f">= {per_sample * est.min_samples}")
    else:
        n = n_samples if n_samples is not None else est.min_samples
        if n < est.min_samples:
            raise BudgetError(f"{est.name} needs --n-samples >= {est.min_samples}, got {n}")
    if est.max_samples is not None:
        top = est.max_samples(latents[0])
        if n > top:
            if budget is None:
                raise BudgetError(f"{est.name}: n = {n} exceeds the {top} values of the latent")
            n = top
    return n, n * per_sample


def build_methods(est: Estimator, latents: Sequence[Latent], n: int, args) -> dict[str, sm.Method]:
    """One method per latent layer: ``n`` samples at the top, ``lower_samples`` (default ``min_samples``)
    below."""
    return {lat.name: est.build(lat.name, n if i == 0 else _lower_samples(est), args, lat)
            for i, lat in enumerate(latents)}
