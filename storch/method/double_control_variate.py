"""Double control variates: a leave-one-out baseline with a Taylor control variate on top of it.

Titsias & Shi, "Double Control Variates for Gradient Estimation in Discrete Latent Variable Models"
(AISTATS 2022, arXiv:2111.05300). With ``K ≥ 2`` i.i.d. samples ``x_k ~ q_θ``, costs ``f_k = f(x_k)``,
the gradients of the cost at the samples ``g_k = ∇_x f(x_k)`` and the mean ``μ(θ) = E_q[x]``:

    ḡ_{−k} = (1/(K−1)) Σ_{j≠k} g_j          leave-one-out average gradient
    c_k    = α ḡ_{−k}ᵀ (x_k − μ)             the second (global) control variate
    ĝ = (1/K) Σ_k [f_k + c_k − (1/(K−1)) Σ_{j≠k} (f_j + c_j)] ∇θ log q(x_k)
        − α ḡᵀ ∇θ μ

with ``ḡ = (1/K) Σ_k ḡ_{−k} = (1/K) Σ_k g_k``. The first control variate is the leave-one-out
baseline of RLOO; the second is a first-order Taylor term of the cost, which corrects both the
sample's learning signal and, through ``c_j`` (``j ≠ k``), the baseline itself (a control variate
for the control variate). For a cost that is linear in ``x`` and ``α = −1`` every ``f_k + c_k`` is
the same number, the score terms vanish, and ``ĝ = ḡᵀ ∇θ μ`` is the exact gradient.

**Why it is unbiased.** ``E[(x_k − μ) ∇θ log q(x_k)] = ∇θ E[x_k] = ∇θ μ`` (``μ`` held fixed), and
``ḡ_{−k}`` depends on the other samples only, so ``E[c_k ∇θ log q(x_k)] = α E[ḡ_{−k}]ᵀ ∇θ μ``,
which the last term removes. For ``j ≠ k``, ``x_j`` enters ``c_j ∇θ log q(x_k)`` only through
``x_j − μ`` (``ḡ_{−j}`` leaves ``x_j`` out), whose mean is 0. What is left is RLOO, which is unbiased.

**Surrogate.** Gradient function ``l = log q(x)`` (the samples detached); baseline
``b_k = (1/(K−1)) Σ_{j≠k} (f_j + c_j) − c_k`` (detached); and the correction
``−α ḡ_{−k}ᵀ (μ(θ) − stopgrad μ(θ))`` per sample (forward value 0). Reading ``□(l)`` as
``q_θ(x)/q_θ₀(x)``, the expected surrogate equals ``E_θ f`` for every ``θ``, so derivatives of
**every order** are unbiased (``backward(create_graph=True)``; ``α`` and ``g`` are constants of it).

**Where g comes from.** The samples are detached from ``θ`` and made an autograd leaf, so the
cost's graph reaches them; ``g_k`` is one vector-Jacobian product of the downstream estimate ``S``
(`storch.inference`) with respect to that leaf
(`storch.method.derivatives.pure_derivatives`).
When a later node depends on ``x``, ``S`` holds its surrogate and ``g_k`` is the derivative of its
estimate of ``E[f | x_k]``. A cost that does not depend differentiably on the samples (``detach``,
``argmax``, indexing by them, integer ``Categorical`` indices) is refused: use
``ScoreFunction(..., baseline_factory="batch_average")`` there.

**The coefficient α.** ``ĝ = A + α B`` is affine in ``α`` (``A``: the RLOO estimate, ``B``: the
Taylor direction), so ``E‖ĝ‖²`` is least at ``α* = −E[Aᵀ B] / E[‖B‖²]``. The authors' code trains
``α`` by gradient steps on ``‖ĝ‖²`` (the gradient with respect to the logits); with ``adapt=True``
this module uses that minimiser directly: ``A`` and ``B`` are the estimates with respect to the
distribution's parameter tensors, their products are averaged over earlier steps (decay ``β``) in
buffers, and each step uses ``α`` from before it (from ``alpha`` until the first update), so ``α``
never depends on the samples it multiplies.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributions import Distribution

from storch import distributed
from storch.extend import (
    CostTensor,
    PlateLayout,
    StepState,
    StochasticTensor,
    Tensor,
    align_to,
    get_distr_parameters,
    layout_of,
    layout_of_plates,
    log_prob_of_own_samples,
    magic_box,
    no_dispatch,
    node_of,
    plain,
    restore_lazy_plates,
    with_nested,
    wrap_new,
)
from storch.method.derivatives import NoDifferentiablePath, pure_derivatives
from storch.method.groups import GroupRecords
from storch.method.method import Method
from storch.reductions import reduce_plates
from storch.reductions import sum as plate_sum

__all__ = ["DoubleControlVariate"]


@dataclass(frozen=True)
class _Draw:
    """What the proposal kept for one node: the leaf the cost is differentiated by, and the
    distribution's parameter tensors (for the α statistics)."""

    leaf: torch.Tensor
    theta: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _Taylor:
    """The Taylor pieces of one (node, cost): ``(c_k − mean_{j≠k} c_j) / α``, laid out like the
    cost's learning signal, and the correction's tangent ``ḡ_{−k}ᵀ (μ − stopgrad μ)`` per sample."""

    signal: torch.Tensor
    tangent: torch.Tensor


def _drop_grad(t: torch.Tensor) -> None:
    t.grad = None  # the leaf's gradient from the surrogate is never used: do not keep it


def _sum_trailing(t: torch.Tensor, n_lead: int) -> torch.Tensor:
    """``t`` summed over its dimensions after the first ``n_lead`` (plain tensors)."""
    return t.sum(tuple(range(n_lead, t.dim()))) if t.dim() > n_lead else t


def _parameter_tensors(distr: Distribution) -> tuple[torch.Tensor, ...]:
    """The distribution's parameter tensors that require grad, none computed from another: where a
    distribution keeps the one it was given (torch's ``_param``: ``probs`` or ``logits`` of
    ``Bernoulli``, ``Categorical``, ...), only that one, since the other is a function of it and
    counting both would count the gradient twice in the α statistics."""
    params = list(get_distr_parameters(distr).values())
    given = [d.__dict__["_param"] for d in with_nested(distr) if isinstance(d.__dict__.get("_param"), torch.Tensor)]
    chosen = [p for p in params if any(p is g for g in given)]
    return tuple(chosen or params)


def _leave_one_out(t: torch.Tensor) -> torch.Tensor:
    """``(Σ_j t_j − t_k) / (K − 1)`` along the first dimension (plain tensors, ``K ≥ 2``)."""
    return (t.sum(0, keepdim=True) - t) / (t.shape[0] - 1)


class DoubleControlVariate(Method):
    """The score function with double control variates (Titsias & Shi 2022): RLOO plus a Taylor term.

    ``ĝ = (1/K) Σ_k [f_k + c_k − mean_{j≠k}(f_j + c_j)] ∇log q(x_k) − α ḡᵀ ∇μ`` with
    ``c_k = α ḡ_{−k}ᵀ (x_k − μ)``, ``ḡ_{−k}`` the mean of ``∇_x f`` at the other samples and
    ``μ = E_q[x]`` (the module docstring has the derivation). Unbiased for derivatives of every
    order. It needs the cost to be differentiable in the samples, and ``x`` to be floating point with
    a ``mean``: ``Bernoulli``, ``OneHotCategorical``, and continuous distributions (index-valued
    ``Categorical`` is refused: use ``OneHotCategorical``). It owns its sampling (the samples become
    the autograd leaf of ``∇_x f``), so it is a method, not a baseline for
    `storch.method.ScoreFunction`; with ``α = 0`` it is
    ``ScoreFunction(..., baseline_factory="batch_average")``.

    State: two scalar buffers (running ``E[AᵀB]`` and ``E[‖B‖²]``, see the module docstring),
    updated in place after each backward pass, so ``state_dict`` holds them,
    `storch.compile_step` replays the update, and under ``torch.distributed`` with
    ``sync`` the ranks average each step's statistics first (one all-reduce of three numbers), so
    every replica uses the same ``α``. The method has no ``nn.Parameter``.

    Args:
        plate_name: node / plate name.
        n_samples: ``K ≥ 2`` i.i.d. samples (the leave-one-out baseline needs two).
        alpha: the coefficient ``α``: with ``adapt=False`` fixed (``-1.0``: the first-order Taylor
            value, exact for linear costs; ``0.0``: plain RLOO); with ``adapt=True`` the value used
            until the first update.
        adapt: set ``α`` after each backward pass to the variance-minimising value of the running
            statistics.
        decay: ``β`` in ``[0, 1)`` of those running averages.
        sync: average the statistics across ranks before each update (no effect in one process).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> phi = torch.tensor([0.3, -0.5], requires_grad=True)
        >>> w = torch.tensor([1.0, -2.0])
        >>> method = DoubleControlVariate("x", n_samples=4, adapt=False)
        >>> x = method(Bernoulli(logits=phi))
        >>> storch.add_cost((x * w).sum(-1), "f")   # a linear cost: the exact gradient
        >>> _ = storch.backward()
        >>> p = torch.sigmoid(phi.detach())
        >>> torch.allclose(phi.grad, p * (1 - p) * w)
        True
    """

    def __init__(
        self,
        plate_name: str,
        n_samples: int = 2,
        alpha: float = -1.0,
        adapt: bool = True,
        decay: float = 0.9,
        sync: bool = True,
    ) -> None:
        super().__init__(plate_name, None, n_samples)
        if self.n_samples < 2:
            raise ValueError(
                f"DoubleControlVariate({plate_name!r}): the leave-one-out baseline needs n_samples >= 2, "
                f"got {self.n_samples}. Use n_samples >= 2, or ScoreFunction with "
                "baseline_factory='moving_average' for a single sample."
            )
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"DoubleControlVariate({plate_name!r}): decay must be in [0, 1), got {decay}.")
        self.initial_alpha = float(alpha)
        self.adapt = bool(adapt)
        self.decay = float(decay)
        self.sync = bool(sync)
        self.register_buffer("cross", torch.zeros(()))  # running E[Aᵀ B]
        self.register_buffer("norm", torch.zeros(()))  # running E[‖B‖²] (0: no update yet)
        self._draws = GroupRecords("DoubleControlVariate", "differentiable leaf")
        self._pending: dict[tuple[int, str], tuple[weakref.ref, tuple, tuple]] = {}

    # ---------------------------------------------------------------- α
    @property
    def alpha(self) -> torch.Tensor:
        """``α`` for the next step (a 0-dim tensor; read on the host only by the caller)."""
        if not self.adapt:
            return torch.tensor(self.initial_alpha, dtype=self.norm.dtype, device=self.norm.device)
        ratio = -self.cross / self.norm.clamp_min(torch.finfo(self.norm.dtype).tiny)
        return torch.where(self.norm > 0, ratio, torch.full_like(ratio, self.initial_alpha))

    # ---------------------------------------------------------------- sampling
    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        """``n`` samples, detached from ``θ`` and made an autograd leaf (the cost's gradient)."""
        theta = _parameter_tensors(distr)
        samples = distr.sample((amt_samples,))
        if not samples.is_floating_point():
            raise ValueError(
                f"DoubleControlVariate({self.plate_name!r}): the samples of {type(distr).__name__} are "
                f"{samples.dtype} values, and the Taylor control variate needs the cost's gradient with "
                "respect to them. Use OneHotCategorical instead of Categorical, or ScoreFunction with "
                "baseline_factory='batch_average'."
            )
        leaf = samples.detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(_drop_grad)
        with torch.enable_grad():
            view = leaf.view_as(leaf)
        self._draws.keep(view, _Draw(leaf, theta))
        return view

    # ---------------------------------------------------------------- estimator
    def gradient_function(self, tensor: StochasticTensor) -> torch.Tensor:
        """``log q(x)`` of the detached samples, summed over the non-plate dimensions."""
        node = node_of(tensor)
        n_lead = len(node.layout.sizes)
        with no_dispatch():
            lp = log_prob_of_own_samples(node.distribution, node.samples.detach())
            lp = _sum_trailing(lp, n_lead)
        return wrap_new(lp, node.layout)

    def estimator(self, tensor: StochasticTensor, cost: CostTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``l = log q(x)`` and ``(1 − □(l)) · b − α ḡ_{−k}ᵀ (μ − stopgrad μ)``."""
        score = self.gradient_function(tensor)
        n = node_of(tensor).samples.shape[0]
        detached = cost.detach()
        loo = (plate_sum(detached, tensor.plate) - detached) / (n - 1)
        if not torch.is_grad_enabled():  # no derivative asked for: the forward value is RLOO's
            return score, (1.0 - magic_box(score)) * loo
        alpha = self.alpha.to(plain(detached).dtype)
        taylor = self._taylor(tensor, cost)
        box = magic_box(score)
        if self.adapt:
            self._remember(tensor, cost, box * cost + (1.0 - box) * loo, taylor.signal * score - taylor.tangent)
        baseline = loo - alpha * taylor.signal
        return score, (1.0 - box) * baseline - alpha * taylor.tangent

    def _taylor(self, tensor: StochasticTensor, cost: CostTensor) -> _Taylor:
        node = node_of(tensor)
        layout: PlateLayout = node.layout
        n_lead = len(layout.sizes)
        g = self._cost_gradient(tensor, cost)
        mean = self._mean(tensor)
        with no_dispatch():
            x = node.samples.detach()
            g_loo = _leave_one_out(g)
            c = _sum_trailing(g_loo * (x - mean.detach()), n_lead)  # c_k / α
            signal = c - _leave_one_out(c)
            tangent = _sum_trailing(g_loo * (mean - mean.detach()), n_lead)
        signal = wrap_new(signal, layout)
        missing = [p for p in layout.plates if p.name not in layout_of(cost).names]
        if missing:  # the cost already summed over these plates of the node
            signal = plate_sum(signal, missing)
        return _Taylor(signal, wrap_new(tangent, layout))

    def _cost_gradient(self, tensor: StochasticTensor, cost: CostTensor) -> torch.Tensor:
        """``∂S/∂x`` at every sample (plain, shaped like the samples); the cost's plates that the node
        lacks are averaged with their weights."""
        layout = node_of(tensor).layout
        foreign = [p for p in layout_of(cost).plates if p.name not in layout.names]
        target = reduce_plates(cost, foreign) if foreign else cost
        try:
            (g,) = pure_derivatives(plain(target), self._draws.of(tensor).leaf, 1, len(layout.sizes))
        except NoDifferentiablePath:
            raise ValueError(
                f"DoubleControlVariate({tensor.name!r}): the cost {cost.name!r} does not depend differentiably "
                f"on the samples of plate {tensor.name!r}, and the Taylor control variate needs ∇_x f. Make the "
                "cost differentiable in them (no detach, argmax, comparison or indexing by them), or use "
                "ScoreFunction(..., baseline_factory='batch_average') for this node."
            ) from None
        return g

    def _mean(self, tensor: StochasticTensor) -> torch.Tensor:
        """``μ(θ) = E_q[x]``: plain, laid out ``(*parent plates, *batch, *event)`` like one sample,
        with its graph to θ."""
        node = node_of(tensor)
        distr = node.distribution
        try:
            mean = distr.mean
        except NotImplementedError:
            raise ValueError(
                f"DoubleControlVariate({tensor.name!r}): {type(distr).__name__} has no mean, which the Taylor "
                "control variate needs (E[x − μ] = 0). Use ScoreFunction(..., baseline_factory='batch_average')."
            ) from None
        finally:
            restore_lazy_plates(distr)
        if not isinstance(mean, Tensor):  # no plated parameters
            return mean
        with no_dispatch():
            return align_to(mean, layout_of_plates(node.layout.plates[1:]), expand=True)

    # ---------------------------------------------------------------- α statistics
    def _remember(self, tensor: StochasticTensor, cost: CostTensor, rloo: torch.Tensor, taylor: torch.Tensor) -> None:
        """Keep this (node, cost)'s ``A`` (the RLOO estimate) and ``B`` (the Taylor direction), the
        gradients of its surrogate pieces with respect to the distribution's parameter tensors."""
        draw = self._draws.of(tensor)
        theta = [t for t in draw.theta if t.requires_grad]
        total_a, total_b = plain(reduce_plates(rloo)), plain(reduce_plates(taylor))
        if not theta or not (total_a.requires_grad and total_b.requires_grad):
            return
        with no_dispatch():
            a = torch.autograd.grad(total_a, theta, retain_graph=True, allow_unused=True)
            b = torch.autograd.grad(total_b, theta, retain_graph=True, allow_unused=True)
        samples = node_of(tensor).samples
        self._pending = {k: v for k, v in self._pending.items() if v[0]() is not None}
        self._pending[(id(samples), cost.name)] = (weakref.ref(samples), a, b)

    def _step_statistics(self, result_triples: Sequence[tuple]) -> torch.Tensor:
        """``[Σ Aᵀ B, Σ ‖B‖², 1]`` of this step's nodes (``A``, ``B`` summed over costs), or zeros."""
        used = {id(node_of(t).samples) for t, *_ in result_triples}
        per_node: dict[int, list[torch.Tensor | None]] = {}
        for (key, _), (_, a, b) in self._pending.items():
            if key in used:
                totals = per_node.setdefault(key, [None] * (2 * len(a)))
                for i, g in enumerate(a + b):
                    if g is not None:
                        totals[i] = g.detach() if totals[i] is None else totals[i] + g.detach()
        stats = torch.zeros(3, dtype=self.norm.dtype, device=self.norm.device)
        for totals in per_node.values():
            half = len(totals) // 2
            for a, b in zip(totals[:half], totals[half:]):
                if b is not None:
                    a_dot_b = (plain(a) * plain(b)).sum() if a is not None else b.new_zeros(())
                    stats = stats + torch.stack([a_dot_b, plain(b).pow(2).sum(), b.new_ones(())]).to(stats)
        return stats

    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        """Fold this step's ``Aᵀ B`` and ``‖B‖²`` into the running averages (no host read)."""
        super().update_parameters(result_triples)
        if not self.adapt:
            return
        try:
            stats = self._step_statistics(result_triples)
        finally:
            self._pending = {}
        if self.sync and distributed.syncing():
            distributed.all_reduce_mean_([stats])
        with torch.no_grad():
            seen, beta = stats[2] > 0, self.decay
            first = self.norm <= 0
            for buffer, value in ((self.cross, stats[0]), (self.norm, stats[1])):
                later = beta * buffer + (1 - beta) * value
                buffer.copy_(torch.where(seen, torch.where(first, value, later), buffer))

    #: the statistics ``cross`` and ``norm`` are buffers that `update_parameters` updates in place with tensor
    #: operations (no host read): a compiled step replays that
    step_state = StepState.IN_PLACE

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the current step's pending statistics (weak references)."""
        state = super().__getstate__()
        state["_pending"] = {}
        return state

    def _apply(self, fn: Any, recurse: bool = True):  # type: ignore[override]
        """``.to(device)``, ``.double()``: the buffers follow; pending statistics are dropped."""
        self._pending = {}
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        adapt = "" if self.adapt else ", adapt=False"
        return f"{super().extra_repr()}, alpha={self.initial_alpha}{adapt}, decay={self.decay}"
