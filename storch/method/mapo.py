"""MAPO: Memory Augmented Policy Optimization (Liang, Norouzi, Berant, Le & Lao 2018, NeurIPS,
"Memory Augmented Policy Optimization for Program Synthesis and Semantic Parsing", arXiv 1807.02322).

Keep a memory buffer ``B`` of low-cost values (sequences) found so far, one per datum. With
``π_B = Σ_{y∈B} π(y)`` the policy's mass on the buffer, the expectation splits into a part that is
enumerated and a part that is sampled from the policy restricted to the rest of the support:

    E_π[f] = Σ_{y∈B} π(y) f(y) + (1 − π_B) · E_{y∼π(·|y∉B)}[f(y)]
    ∇E_π[f] ≈ Σ_{y∈B} f(y) ∇π(y) + (1 − π_B)/n · Σ_{j≤n} f(y_j) ∇log π(y_j),   y_j ∼ π(·|y∉B) i.i.d.

(paper eq. 5: ``π_B E_{π⁺}[f ∇log π] + (1 − π_B) E_{π⁻}[f ∇log π]``). Components: the plate holds
the buffer's values and ``n`` samples of the complement; weights ``π(y)`` on the buffer and
``(1 − π_B)/n`` on the samples, detached; gradient function ``l(y) = log π(y)``; control variate
(optional) a baseline ``b`` through the score of the *conditional* ``π⁻(y) = π(y)/(1 − π_B)`` of the
samples: ``(1 − □(log π(y) − log(1 − π_B))) · b``, whose every derivative has expectation zero under
``π⁻``. Since ``stopgrad(π(y)) □(log π(y))`` has the derivatives of ``π(y)``, and ``B`` is fixed
during a step (it only depends on earlier steps), every derivative of the surrogate is unbiased.

Memory weight clipping (paper §3.2): ``w_B = max(π_B, α)`` replaces ``π_B`` (weights
``w_B π(y)/π_B`` on the buffer, ``(1 − w_B)/n`` on the samples), so a buffer of tiny probability
still pulls the policy towards it. The expectation of the clipped estimator is
``(w_B/π_B) ∇Σ_B π f + (1 − w_B)/(1 − π_B) ∇Σ_{∉B} π f``: biased whenever ``π_B < α``.

Systematic exploration (paper §3.3): the values sampled so far (the *explored* set ``E``, kept per
datum) are excluded from later samples too, so that sampling visits new values; the estimate then
drops ``Σ_{y∈E} π(y) f(y)``, which is zero when the cost is zero on explored values outside the
buffer (sparse rewards with ``cost = −reward``), and a bias otherwise.

Sampling from ``π`` restricted to a finite set's complement is exact and needs no enumeration of
the support: for ``D`` independent variables (a factorised sequence), position ``t`` is drawn from
``π_t(v) · (1 − Σ_{b∈B alive, b_t=v} Π_{s>t} π_s(b_s))``, the mass of the complement below the
prefix (a walk down the trie of the excluded values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Independent

from storch.extend import (
    AncestralPlate,
    CostTensor,
    Plate,
    PlateLayout,
    StepState,
    StochasticTensor,
    align_to,
    check_replayable,
    distribution_layout,
    floating_dtype,
    get_distr_parameters,
    is_tracing,
    layout_of,
    layout_of_plates,
    magic_box,
    new_node,
    no_dispatch,
    note_sampled,
    plain,
    restore_lazy_plates,
    wrap,
    wrap_new,
)
from storch.method.baseline import Baseline, BaselineFactory, make_baseline
from storch.method.method import DEFAULT_N_SAMPLES, Method
from storch.reductions import reduce_plates
from storch.sampling.method import SamplingMethod, check_count
from storch.sampling.swor import WORSupport, wor_support

__all__ = ["MAPO", "MAPOMemory", "MAPOState", "sample_outside"]


# ----------------------------------------------------------------------- sampling outside a set
def sample_outside(
    log_probs: torch.Tensor, excluded: torch.Tensor, valid: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` i.i.d. draws of ``D`` independent categorical variables conditioned on the joint value
    not being one of ``excluded``, and the probability of that event.

    Args:
        log_probs: ``(F, D, V)`` log-probabilities of the ``V`` values of each of the ``D`` variables,
            for ``F`` independent problems (detached).
        excluded: ``(F, X, D)`` value indices of the excluded joint values (distinct per problem).
        valid: ``(F, X)`` which rows of ``excluded`` are entries.
        n: the number of draws.

    Returns:
        ``(tokens, outside)``: ``(n, F, D)`` value indices and ``(F,)`` the mass ``1 − π(excluded)``
            (float64; exactly 0 when the excluded values cover the support). Where nothing is left to
            sample, the tokens are drawn from the unrestricted distribution.

    Examples:
        >>> import torch
        >>> lp = torch.full((1, 2, 3), 1 / 3).log()          # two variables, three values each
        >>> excluded = torch.tensor([[[0, 0], [0, 1], [0, 2]]])  # every sequence starting with 0
        >>> tokens, outside = sample_outside(lp, excluded, torch.ones(1, 3, dtype=torch.bool), 200)
        >>> bool((tokens[..., 0] != 0).all()), round(outside.item(), 4)
        (True, 0.6667)
    """
    n_prob, n_var, n_val = log_probs.shape
    lp = log_probs.detach().double()
    p = lp.exp()
    n_excl = excluded.shape[1]
    if n_excl == 0 or not bool(valid.any()):
        tokens = Categorical(probs=p, validate_args=False).sample((n,))
        return tokens, p.new_ones(n_prob)
    # log π_s(b_s) of each entry at each position; entries of probability 0 exclude nothing
    entry_lp = lp.unsqueeze(1).expand(n_prob, n_excl, n_var, n_val).gather(-1, excluded.unsqueeze(-1)).squeeze(-1)
    positive = valid & (entry_lp > -math.inf).all(-1)
    entry_lp = torch.where(positive.unsqueeze(-1), entry_lp, torch.zeros_like(entry_lp))
    inclusive = entry_lp.flip(-1).cumsum(-1).flip(-1)  # Σ_{s≥t}
    suffix = torch.cat([inclusive[..., 1:], torch.zeros_like(inclusive[..., :1])], -1)  # Σ_{s>t}
    # number of positive-probability completions after position t: Π_{s>t} |{v: π_s(v) > 0}|
    support = (p > 0).sum(-1).double()  # (F, D)
    incl_count = support.flip(-1).cumprod(-1).flip(-1)
    completions = torch.cat([incl_count[..., 1:], torch.ones_like(incl_count[..., :1])], -1)
    alive = positive.unsqueeze(0).expand(n, n_prob, n_excl).double()
    tokens = torch.empty((n, n_prob, n_var), dtype=torch.long, device=lp.device)
    outside = None
    suffix_mass = suffix.exp()
    for t in range(n_var):
        # per draw and value v: the mass and the number of excluded completions of prefix + v
        index = excluded[..., t].unsqueeze(0).expand(n, n_prob, n_excl)
        mass_in = lp.new_zeros((n, n_prob, n_val)).scatter_add_(-1, index, alive * suffix_mass[..., t])
        count_in = lp.new_zeros((n, n_prob, n_val)).scatter_add_(-1, index, alive)
        covered = count_in >= completions[:, t].reshape(1, n_prob, 1) - 0.5
        rest = p[:, t].unsqueeze(0) * (1.0 - mass_in).clamp_min(0.0)
        rest = torch.where(covered, torch.zeros_like(rest), rest)
        total = rest.sum(-1, keepdim=True)
        if outside is None:
            outside = total[0, :, 0]
        probs = torch.where(total > 0, rest / total.clamp_min(1e-300), p[:, t].unsqueeze(0).expand_as(rest))
        token = Categorical(probs=probs, validate_args=False).sample()  # (n, F)
        tokens[..., t] = token
        alive = alive * (excluded[..., t].unsqueeze(0) == token.unsqueeze(-1)).double()
    return tokens, outside  # type: ignore[return-value]


# ----------------------------------------------------------------------- the memory
#: the memory's tensors, in the order of the ``_extra_state`` dict (the names of its keys)
_MEMORY_TENSORS = (
    "buffer_tokens", "buffer_costs", "buffer_valid", "explored_tokens", "explored_valid", "explored_next",
)
#: the attributes that held them on MAPO objects pickled before ``MAPOMemory``
_OLD_ATTRIBUTES = dict(zip(("_buf_tokens", "_buf_costs", "_buf_valid", "_exp_tokens", "_exp_valid", "_exp_next"),
                           _MEMORY_TENSORS))


class MAPOMemory(nn.Module):
    """The memory of a `storch.method.mapo.MAPO` method: per key (datum), a buffer of the best
    values found and their costs, and the values explored (with ``systematic_exploration``).

    The tensors are buffers of this module, so ``.to()``, ``copy.deepcopy`` and pickling carry them
    with the method, and they keep their dtypes under ``.double()`` or ``.half()``. They are not
    persistent: the method's ``state_dict`` holds them in its ``_extra_state`` entry
    (`storch.method.mapo.MAPOMemory.state`), as before this module existed (as
    `storch.method.baseline.MovingAverageBaseline` keeps its averages), so
    checkpoints of either version load. The buffers are each rank's own: inside a model wrapped in
    ``DistributedDataParallel``, call
    `storch.distributed.exclude_methods_from_ddp` first.

    Attributes:
        buffer_tokens: ``(K, buffer_size, D)`` the buffered values' indices (long), ``D`` variables.
        buffer_costs: ``(K, buffer_size)`` their costs (float64; ``inf`` on empty slots).
        buffer_valid: ``(K, buffer_size)`` which slots hold a value.
        explored_tokens: ``(K, E, D)`` the explored values (``E`` is ``max_explored``, or 0).
        explored_valid: ``(K, E)`` which slots hold a value.
        explored_next: ``(K,)`` the slot the next explored value of each key goes to (a ring).
        var_shape: the shape of the variables of one value; ``None`` until the first value.
        n_values: the number of values of each variable; ``-1`` until a distribution tells.

    Args:
        buffer_size: the most values the buffer of one key holds.

    Examples:
        >>> memory = MAPOMemory(buffer_size=4)
        >>> memory.buffer_costs.shape, memory.var_shape
        (torch.Size([0, 4]), None)
        >>> memory.shape_values((3,), explored=0, device=torch.device("cpu"))   # values of 3 variables
        >>> memory.grow(2)                                                      # keys 0, 1 and 2
        >>> memory.buffer_tokens.shape, memory.explored_next.tolist()
        (torch.Size([3, 4, 3]), [0, 0, 0])
    """

    def __init__(self, buffer_size: int) -> None:
        super().__init__()
        self.buffer_size = buffer_size
        self.clear()

    def clear(self) -> None:
        """Forget every value: no keys, the variables' shape and number of values unknown (on the CPU)."""
        b = self.buffer_size
        self.var_shape: Optional[tuple[int, ...]] = None
        self.n_values = -1
        self.register_buffer("buffer_tokens", torch.zeros((0, b, 0), dtype=torch.long), persistent=False)
        self.register_buffer("buffer_costs", torch.zeros((0, b), dtype=torch.float64), persistent=False)
        self.register_buffer("buffer_valid", torch.zeros((0, b), dtype=torch.bool), persistent=False)
        self.register_buffer("explored_tokens", torch.zeros((0, 0, 0), dtype=torch.long), persistent=False)
        self.register_buffer("explored_valid", torch.zeros((0, 0), dtype=torch.bool), persistent=False)
        self.register_buffer("explored_next", torch.zeros((0,), dtype=torch.long), persistent=False)

    @property
    def n_vars(self) -> int:
        """The number of variables ``D`` of one value (1 while unknown)."""
        return 1 if self.var_shape is None else math.prod(self.var_shape)

    def shape_values(self, var_shape: tuple[int, ...], explored: int, device: torch.device) -> None:
        """Empty memory for values of variables of shape ``var_shape``, with ``explored`` slots per key
        for explored values, on ``device`` (the costs and flags stay where they are)."""
        d = math.prod(var_shape)
        self.var_shape = tuple(var_shape)
        self.buffer_tokens = torch.zeros((0, self.buffer_size, d), dtype=torch.long, device=device)
        self.buffer_costs = self.buffer_costs.to(device)
        self.buffer_valid = self.buffer_valid.to(device)
        self.explored_tokens = torch.zeros((0, explored, d), dtype=torch.long, device=device)
        self.explored_valid = torch.zeros((0, explored), dtype=torch.bool, device=device)
        self.explored_next = self.explored_next.to(device)

    def grow(self, max_key: int) -> None:
        """Make room for the keys up to ``max_key`` (at least doubling), with empty buffers; after
        `storch.method.mapo.MAPOMemory.shape_values`."""
        k = self.buffer_tokens.shape[0]
        if max_key < k:
            return
        grow = max(max_key + 1, 2 * k) - k
        b, d, e = self.buffer_size, self.n_vars, self.explored_tokens.shape[1]
        dev = self.buffer_tokens.device
        self.buffer_tokens = torch.cat([self.buffer_tokens, torch.zeros((grow, b, d), dtype=torch.long, device=dev)])
        self.buffer_costs = torch.cat(
            [self.buffer_costs, torch.full((grow, b), math.inf, dtype=torch.float64, device=dev)]
        )
        self.buffer_valid = torch.cat([self.buffer_valid, torch.zeros((grow, b), dtype=torch.bool, device=dev)])
        self.explored_tokens = torch.cat(
            [self.explored_tokens, torch.zeros((grow, e, d), dtype=torch.long, device=dev)]
        )
        self.explored_valid = torch.cat([self.explored_valid, torch.zeros((grow, e), dtype=torch.bool, device=dev)])
        self.explored_next = torch.cat([self.explored_next, torch.zeros((grow,), dtype=torch.long, device=dev)])

    def state(self) -> dict:
        """The memory (copies) as the dict that MAPO's ``state_dict`` holds under ``_extra_state``."""
        state: dict[str, Any] = {
            "var_shape": list(self.var_shape) if self.var_shape is not None else [-1],
            "n_values": self.n_values,
        }
        return {**state, **{name: getattr(self, name).clone() for name in _MEMORY_TENSORS}}

    def load(self, state: Any, owner: str) -> None:
        """Restore the memory from a dict written by `storch.method.mapo.MAPOMemory.state`.

        Raises:
            ValueError: if ``state`` is not such a dict (the message names ``owner``).
        """
        keys = ("var_shape", "n_values") + _MEMORY_TENSORS
        if not isinstance(state, dict) or any(k not in state for k in keys):
            raise ValueError(
                f"{owner}.load_state_dict: the '_extra_state' entry must be the dict "
                f"written by get_extra_state, with keys {list(keys)}."
            )
        var_shape = list(state["var_shape"])
        self.var_shape = None if var_shape == [-1] else tuple(int(s) for s in var_shape)
        self.n_values = int(state["n_values"])
        for name in _MEMORY_TENSORS:
            setattr(self, name, state[name].clone())

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """``.to(device)`` moves the memory; the tokens stay integers and the costs float64."""
        dtypes = {name: getattr(self, name).dtype for name in _MEMORY_TENSORS}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            setattr(self, name, getattr(self, name).to(dtype))
        return self


# ----------------------------------------------------------------------- the sampled set
@dataclass
class MAPOState:
    """What MAPO keeps about one node (on its plate, ``plate.info``); rows: buffer first, then samples.

    Attributes:
        tokens: ``(rows, *P, D)`` value indices of each row (``P`` the plates of the distribution,
            ``D`` the number of variables of a joint value).
        log_prob: ``(rows, *P)`` ``log π(y)`` (differentiable; 0 on unused buffer rows).
        weight: ``(rows, *P)`` the plate weights (detached).
        row_valid: ``(rows, *P)`` whether the row is used (buffers of other data may be longer).
        n_buffer: the number of buffer rows (the first ``n_buffer`` rows).
        keys: ``(*P)`` the memory key of each element of the plates.
        buffer_mass: ``(*P)`` ``π_B`` (float64, detached).
        outside_mass: ``(*P)`` the mass sampled from, ``1 − π_B`` (``1 − π_B − π_E`` with
            systematic exploration; float64, detached).
        log_outside: ``(*P)`` ``log(1 − π_B)`` (or ``log(1 − π_B − π_E)``), differentiable, when a
            baseline needs the score of the conditional distribution; else ``None``.
    """

    tokens: torch.Tensor
    log_prob: torch.Tensor
    weight: torch.Tensor
    row_valid: torch.Tensor
    n_buffer: int
    keys: torch.Tensor
    buffer_mass: torch.Tensor
    outside_mass: torch.Tensor
    log_outside: Optional[torch.Tensor] = None


class _OutsideMemory(SamplingMethod):
    """MAPO's proposal: the memory buffer and ``n_samples`` draws from outside it (drawn by MAPO)."""

    def __init__(self, plate_name: str, n_samples: int) -> None:
        super().__init__(plate_name)
        self.n_samples = n_samples

    def sample(self, distr: Distribution, plates: Sequence[Plate], requires_grad: bool) -> torch.Tensor:
        raise RuntimeError(
            f"MAPO({self.plate_name!r}): its proposal reads the method's memory buffer; call the MAPO "
            "method on the distribution, MAPO(...)(distribution), not its sampling method."
        )

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}"


def _sequence_support(distr: Distribution, owner: str) -> tuple[WORSupport, torch.Tensor]:
    """The support of one value of ``distr`` and the log-probabilities ``(*batch, *vars, V)``;
    ``Independent`` is unwrapped (its reinterpreted dimensions are variables of the joint value)."""
    base = distr
    while isinstance(base, Independent):
        base = base.base_dist
    try:
        support = wor_support(base)
    except TypeError:
        raise TypeError(
            f"{owner}: {type(distr).__name__} has no finite support MAPO can enumerate. MAPO keeps a "
            "buffer of values and samples the policy outside it, so it needs Categorical, "
            "OneHotCategorical or Bernoulli variables (several of them, as batch dimensions or under "
            "Independent, form one joint value, e.g. a factorised sequence). Use ScoreFunction or "
            "Reparameterization for this distribution, or register its support with "
            "storch.sampling.swor.register_wor_support."
        ) from None
    return support, support.log_probs


def _log_mass_outside(lp: torch.Tensor, excluded: torch.Tensor, excl_valid: torch.Tensor) -> torch.Tensor:
    """``log(1 − π(X))`` per element ``(F,)``: the differentiable log-mass outside the excluded
    sequences ``X`` (the buffer), whose conditional score the baselines go through."""
    if not excluded.shape[1]:
        return lp.new_zeros((lp.shape[0],))
    lp_x = _gather_log_prob(lp, excluded.transpose(0, 1))
    mass_x = torch.where(excl_valid.transpose(0, 1), lp_x.exp(), torch.zeros_like(lp_x)).sum(0)
    return torch.log((1.0 - mass_x).clamp_min(1e-30))


def _plate_taken_error(owner: str, plate: Plate, method: "MAPO") -> ValueError:
    """The error for a distribution whose parameters already carry this node's plate name: a call
    per decoding step (MAPO's own earlier sample), or another node of the same name."""
    node = plate.node
    if node is None or not isinstance(node.method, MAPO):
        return ValueError(
            f"{owner}: the distribution's parameters already carry a plate named {plate.name!r}, of "
            "another node; give this node another name."
        )
    same = "this MAPO" if node.method is method else "another MAPO of the same name"
    return ValueError(
        f"{owner}: the distribution's parameters carry the plate {plate.name!r} of an earlier sample of "
        f"{same}: MAPO was called once per decoding step, and MAPO does not support step-by-step "
        "decoding. It sums its memory buffer of whole sequences exactly and samples outside it, which "
        "needs the probability of every buffered sequence before the first token is drawn. Decode the "
        "whole sequence in one MAPO node (a factorised Independent(Categorical(logits=(L, V)), 1), or a "
        "Categorical over candidate sequences scored by the model), or, to decode step by step, use "
        "ScoreFunctionWOR (sampling without replacement; sampling_method=MCDecoder for i.i.d. "
        "sequences) or UnorderedSetEstimator, called once per step with the same plate name."
    )


def _gather_log_prob(lp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``Σ_d lp[f, d, tokens[r, f, d]]``: ``lp`` ``(F, D, V)``, ``tokens`` ``(R, F, D)`` → ``(R, F)``."""
    expanded = lp.unsqueeze(0).expand((tokens.shape[0],) + tuple(lp.shape))
    return expanded.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).sum(-1)


class MAPO(Method):
    """Memory Augmented Policy Optimization (Liang et al. 2018): a buffer of low-cost values summed
    exactly, the rest of the support sampled.

    Per datum (element of the distribution's independent plates, e.g. a minibatch ``data`` plate;
    one buffer when there are none) the method keeps the ``buffer_size`` lowest-cost distinct values
    seen so far (with cost ``< threshold``, if given). A call returns the buffer's values followed by
    ``n_samples`` values drawn from the policy restricted to the complement of the buffer, on one
    plate (``|B| + n_samples`` cost evaluations; buffers of other data that are shorter are padded
    with rows of weight 0). After each `storch.backward`, the sampled values and their
    costs (the sum of the costs that carry this node, other plates averaged) update the buffer, and
    the buffer's costs are refreshed. Without clipping the estimator is unbiased for derivatives of
    every order, for any buffer; the buffer's part is exact and the sampled part is scaled by
    ``1 − π_B``, so the variance falls as the policy concentrates on the buffer.

    Supported: ``Categorical``, ``OneHotCategorical``, ``Bernoulli`` (any distribution registered
    with `storch.sampling.swor.register_wor_support`); non-plate batch
    dimensions and
    ``Independent`` dimensions are the variables of one joint value, so a factorised sequence
    ``Independent(Categorical(logits=(L, V)), 1)`` is one node whose values are sequences. An
    autoregressive sequence model decoded step by step is not supported: sampling the complement
    of the buffer at step ``t`` needs the probability of the buffer's completions, which the model
    has not computed yet; enumerate a finite set of candidate sequences instead (a ``Categorical``
    whose logits are the model's sequence log-probabilities). Stochastic plates among the
    distribution's plates (a parent node's samples) share the datum's buffer.

    Args:
        plate_name: node / plate name.
        n_samples: draws from outside the buffer (``int`` also as the second positional argument).
        buffer_size: the most values the buffer of one datum holds.
        clip: memory weight clipping ``α`` in ``(0, 1)``: ``w_B = max(π_B, α)`` (biased, see below);
            ``None`` (default): unbiased.
        threshold: only values of cost ``< threshold`` enter the buffer; ``None``: the best
            ``buffer_size`` values found, whatever their cost.
        baseline_factory: ``None`` (default), ``"batch_average"`` (leave-one-out among the samples,
            ``n_samples ≥ 2``), ``"moving_average"`` or a `storch.method.baseline.Baseline`;
            it multiplies the score of the conditional distribution ``π(·|y ∉ B)`` of the samples,
            so it keeps the estimator unbiased.
        systematic_exploration: also exclude the values sampled in earlier steps (per datum, up to
            ``max_explored`` of them, oldest forgotten first) from the samples; drops
            ``Σ_{y∈E} π(y) f(y)`` from the estimate, which is exact only when the cost is zero on
            explored values outside the buffer (sparse rewards, ``cost = −reward``).
        max_explored: the size of the explored set per datum.

    Call it as ``MAPO("y", n_samples=4)(distribution)``, or ``(distribution, key=ids)`` with an
    integer tensor ``ids`` that names the data of the independent plates (their sizes, in the order
    of the distribution's plates) when minibatches are shuffled: by default a datum's buffer is that
    of its position in the plates. `storch.method.mapo.MAPO.add_to_memory` seeds buffers,
    `storch.method.mapo.MAPO.memory` reads one,
    `storch.method.mapo.MAPO.reset` forgets them all; the buffers are part of ``state_dict()``.

    Measured (``tests/test_mapo.py``; an 8-value categorical with a fixed cost per value, exact
    gradient norm 0.574): without clipping, every coordinate of the mean of 2000 estimates lies
    within 4.5 standard errors of the exact gradient, with an empty buffer and buffers of one and
    three values, without a baseline and with either baseline (largest z-scores 1–3); also on
    length-3 factorised sequences over 3 tokens (buffer of 4), three Bernoulli bits, two nested
    nodes, a minibatch plate, and for the Hessian. With ``clip=0.1`` and a buffer of mass
    ``π_B = 0.034`` the mean of 4000 estimates matches the clipped expectation above (z < 4.5) and
    is 0.145 from the exact gradient (relative bias 0.25; more than 20 standard errors); at
    ``π_B = 0.084`` the bias is 0.017, and at ``π_B ≥ α`` none. At 5 cost evaluations, a buffer of
    the four most probable values (``π_B = 0.76``) and one sample give a gradient variance of 0.21
    against 0.60 for the score function with 5 samples and the leave-one-out baseline.
    ``benchmarks/mapo_sparse.py``: on a sparse-reward program search (one program in 993 hits, SGD)
    clipped MAPO solves 10 of 10 seeds within 4000 cost evaluations, REINFORCE with a baseline none.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Categorical
        >>> theta = torch.zeros(6, requires_grad=True)
        >>> cost = torch.tensor([3.0, 1.0, 4.0, -1.0, 5.0, 9.0])
        >>> mapo = MAPO("y", n_samples=2, buffer_size=2)
        >>> mapo.add_to_memory(torch.tensor([3]))            # a known good value, summed exactly
        >>> y = mapo(Categorical(logits=theta))
        >>> y.shape, int(y.plain()[0]), bool((y.plain()[1:] != 3).all())   # buffer row, then samples
        (torch.Size([3]), 3, True)
        >>> storch.add_cost(cost[y], "f")
        >>> _ = storch.backward()
        >>> tokens, costs = mapo.memory()
        >>> int(tokens[0]), float(costs[0])                  # still the best value found
        (3, -1.0)
    """

    def __init__(
        self,
        plate_name: str,
        n_samples: int = DEFAULT_N_SAMPLES,
        buffer_size: int = 8,
        clip: Optional[float] = None,
        threshold: Optional[float] = None,
        baseline_factory: BaselineFactory = None,
        systematic_exploration: bool = False,
        max_explored: int = 1024,
    ) -> None:
        owner = f"MAPO({plate_name!r})"
        if isinstance(n_samples, SamplingMethod):
            raise TypeError(
                f"{owner}: the second argument is n_samples (an int); MAPO draws its own samples "
                "outside its memory buffer, so it takes no sampling method."
            )
        n = check_count(n_samples, "n_samples", owner)
        super().__init__(plate_name, _OutsideMemory(plate_name, n))
        self.buffer_size = check_count(buffer_size, "buffer_size", owner)
        self.max_explored = check_count(max_explored, "max_explored", owner)
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0.0 < float(clip) < 1.0:
                raise ValueError(
                    f"{owner}: clip is the memory weight clipping α, a number in (0, 1) (the paper uses "
                    f"0.1), or None for the unbiased estimator; got {clip!r}."
                )
            clip = float(clip)
        self.clip = clip
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
                raise ValueError(
                    f"{owner}: threshold is a number (values of cost < threshold enter the buffer) or "
                    f"None (the best buffer_size values); got {threshold!r}."
                )
            threshold = float(threshold)
        self.threshold = threshold
        if not isinstance(systematic_exploration, bool):
            raise TypeError(f"{owner}: systematic_exploration must be True or False, got {systematic_exploration!r}.")
        self.systematic_exploration = systematic_exploration
        self.leave_one_out = isinstance(baseline_factory, str) and baseline_factory == "batch_average"
        self.baseline: Optional[Baseline] = None if self.leave_one_out else make_baseline(baseline_factory)
        if self.baseline is not None and self.baseline.needs_correction:
            raise ValueError(
                f"{owner}: the {type(self.baseline).__name__} baseline depends on the node's own sample and "
                "needs its expectation correction, which MAPO's conditional score cannot apply (the "
                "gradient would be biased). Use baseline_factory='critic', 'moving_average' or "
                "'batch_average' with MAPO, or the Q critic with ScoreFunction."
            )
        if self.leave_one_out and n < 2:
            raise ValueError(
                f"{owner}: the batch_average baseline averages the other samples' costs and needs "
                f"n_samples >= 2; got n_samples={n}. Use n_samples >= 2, or "
                "baseline_factory='moving_average'."
            )
        self.store = MAPOMemory(self.buffer_size)

    # ------------------------------------------------------------------ memory
    def _init_memory(self, var_shape: tuple[int, ...], n_values: int, device: torch.device) -> None:
        owner = f"MAPO({self.plate_name!r})"
        if self.store.var_shape is None:
            explored = self.max_explored if self.systematic_exploration else 0
            self.store.shape_values(var_shape, explored, device)
        elif tuple(var_shape) != self.store.var_shape:
            raise ValueError(
                f"{owner}: the memory holds values of {self.store.var_shape} variables, but this "
                f"distribution's values have {tuple(var_shape)}. One MAPO method keeps the memory of "
                "one kind of value; use another MAPO for other values, or call method.reset() to forget it."
            )
        if n_values >= 0:
            if self.store.n_values >= 0 and n_values != self.store.n_values:
                raise ValueError(
                    f"{owner}: the memory holds values of variables with {self.store.n_values} values each, but "
                    f"this distribution's variables have {n_values}. Use another MAPO for them, or call "
                    "method.reset() to forget the memory."
                )
            if self.store.n_values < 0 and self._largest_buffered() >= n_values:
                raise ValueError(
                    f"{owner}: the memory holds value indices up to {self._largest_buffered()}, "
                    f"but the distribution's variables have only {n_values} values."
                )
            self.store.n_values = n_values
        if self.store.buffer_tokens.device != device:
            self._apply(lambda t: t.to(device))

    def _largest_buffered(self) -> int:
        """The largest value index in any buffer (-1 when they are all empty)."""
        valid = self.store.buffer_valid
        return int(self.store.buffer_tokens[valid].max()) if valid.any() else -1

    def _key_list(self, keys: Any) -> torch.Tensor:
        owner = f"MAPO({self.plate_name!r})"
        k = torch.as_tensor(keys, device=self.store.buffer_tokens.device).reshape(-1)
        if k.is_floating_point() or k.dtype == torch.bool or (k.numel() and int(k.min()) < 0):
            raise ValueError(f"{owner}: memory keys are non-negative integers, got {keys!r}.")
        return k.long()

    def add_to_memory(self, values: torch.Tensor, costs: Optional[torch.Tensor] = None, keys: Any = 0) -> None:
        """Put known values into the buffers of ``keys`` (e.g. demonstrations, or for a test).

        Args:
            values: ``(m, *var_shape)`` value indices (class indices for ``Categorical`` and
                ``OneHotCategorical``, 0/1 for ``Bernoulli``; a factorised sequence's tokens).
            costs: ``(m,)`` their costs, used to rank them until they are evaluated; default
                ``−∞`` (kept until the next evaluation ranks them).
            keys: the buffers (an int or a sequence of ints; default 0, the buffer used without
                independent plates).
        """
        owner = f"MAPO({self.plate_name!r})"
        values = torch.as_tensor(values)
        if values.is_floating_point() or values.dim() < 1 or (values.numel() and int(values.min()) < 0):
            raise ValueError(
                f"{owner}: add_to_memory takes value indices (non-negative integers) of shape "
                f"(m, *var_shape), got {tuple(values.shape)} {values.dtype}."
            )
        m = values.shape[0]
        if m > self.buffer_size:
            raise ValueError(f"{owner}: {m} values do not fit in a buffer of buffer_size={self.buffer_size}.")
        if self.store.n_values >= 0 and values.numel() and int(values.max()) >= self.store.n_values:
            raise ValueError(
                f"{owner}: value index {int(values.max())} out of range: the variables have "
                f"{self.store.n_values} values."
            )
        self._init_memory(tuple(values.shape[1:]), -1, self.store.buffer_tokens.device)
        values = values.reshape(m, -1).long().to(self.store.buffer_tokens.device)
        if costs is None:
            costs = torch.full((m,), -math.inf, dtype=torch.float64)
        costs = torch.as_tensor(costs, dtype=torch.float64, device=values.device).reshape(m)
        k = self._key_list(keys)
        self.store.grow(int(k.max()) if k.numel() else 0)
        kb = k.numel()
        cand = torch.cat([self.store.buffer_tokens[k], values.unsqueeze(0).expand(kb, m, -1)], 1)
        cost = torch.cat([self.store.buffer_costs[k], costs.unsqueeze(0).expand(kb, m)], 1)
        valid = torch.cat([self.store.buffer_valid[k], torch.ones((kb, m), dtype=torch.bool, device=values.device)], 1)
        self._merge(k, cand, cost, valid, first_sample=cand.shape[1], use_threshold=False)
        if self.store.explored_tokens.shape[1]:  # a value is in the buffer or explored, never both
            same = (self.store.explored_tokens[k].unsqueeze(2) == values.reshape(1, 1, m, -1)).all(-1).any(-1)
            self.store.explored_valid[k] = self.store.explored_valid[k] & ~same

    def memory(self, key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer of ``key``: values ``(m, *var_shape)`` (value indices) and their costs ``(m,)``,
        best first (a cost of ``−inf``: added by `storch.method.mapo.MAPO.add_to_memory` and not
        evaluated yet)."""
        var_shape = self.store.var_shape if self.store.var_shape is not None else ()
        if key >= self.store.buffer_tokens.shape[0]:
            return torch.zeros((0,) + var_shape, dtype=torch.long), torch.zeros((0,), dtype=torch.float64)
        valid = self.store.buffer_valid[key]
        return self.store.buffer_tokens[key][valid].reshape((-1,) + var_shape), self.store.buffer_costs[key][valid]

    def explored(self, key: int = 0) -> torch.Tensor:
        """The explored values of ``key`` (with ``systematic_exploration``): ``(m, *var_shape)``."""
        var_shape = self.store.var_shape if self.store.var_shape is not None else ()
        if key >= self.store.explored_tokens.shape[0]:
            return torch.zeros((0,) + var_shape, dtype=torch.long)
        return self.store.explored_tokens[key][self.store.explored_valid[key]].reshape((-1,) + var_shape)

    def _merge(
        self, keys: torch.Tensor, tokens: torch.Tensor, costs: torch.Tensor, valid: torch.Tensor,
        first_sample: int, use_threshold: bool = True,
    ) -> None:
        """Keep, per key, the ``buffer_size`` best distinct eligible candidates ``(K, C, D)``; with
        systematic exploration the candidates from ``first_sample`` on that stay out join the explored set."""
        c = tokens.shape[1]
        eligible = valid & ~torch.isnan(costs)
        if use_threshold and self.threshold is not None:
            eligible = eligible & (costs < self.threshold)
        same = (tokens.unsqueeze(2) == tokens.unsqueeze(1)).all(-1)  # (K, C, C)
        position = torch.arange(c, device=tokens.device)
        earlier = position.unsqueeze(1) > position  # [i, j]: j < i
        eligible = eligible & ~(same & earlier & eligible.unsqueeze(1)).any(-1)
        order = torch.sort(torch.where(eligible, costs, torch.full_like(costs, math.inf)), dim=-1, stable=True).indices
        b = self.buffer_size
        if c < b:
            pad = b - c
            tokens = torch.cat([tokens, tokens.new_zeros((tokens.shape[0], pad, tokens.shape[2]))], 1)
            costs = torch.cat([costs, costs.new_full((costs.shape[0], pad), math.inf)], 1)
            eligible = torch.cat([eligible, eligible.new_zeros((eligible.shape[0], pad))], 1)
            order = torch.cat([order, torch.arange(c, b, device=order.device).expand(order.shape[0], pad)], 1)
        keep = order[:, :b]
        new_valid = eligible.gather(1, keep)
        kept = tokens.gather(1, keep.unsqueeze(-1).expand(-1, -1, tokens.shape[2]))
        self.store.buffer_tokens[keys] = torch.where(new_valid.unsqueeze(-1), kept, 0)
        self.store.buffer_costs[keys] = torch.where(new_valid, costs.gather(1, keep), math.inf)
        self.store.buffer_valid[keys] = new_valid
        if not self.store.explored_tokens.shape[1] or first_sample >= c:
            return
        in_buffer = torch.zeros_like(eligible).scatter(1, keep, new_valid)[:, :c]
        valid = valid[:, :c]
        is_sample = torch.arange(c, device=tokens.device) >= first_sample
        fresh = valid & is_sample & ~in_buffer[:, :c] & ~(same & earlier & valid.unsqueeze(1)).any(-1)
        e = self.store.explored_tokens.shape[1]
        rank = fresh.long().cumsum(-1) - 1
        fresh = fresh & (rank < e)
        slot = (self.store.explored_next[keys].unsqueeze(1) + rank) % e
        rows = keys.unsqueeze(1).expand_as(slot)
        self.store.explored_tokens[rows[fresh], slot[fresh]] = tokens[:, :c][fresh]
        self.store.explored_valid[rows[fresh], slot[fresh]] = True
        self.store.explored_next[keys] = (self.store.explored_next[keys] + fresh.sum(-1)) % e

    def reset(self) -> None:
        """Forget every buffer and explored set."""
        super().reset()
        self.store.clear()

    def get_extra_state(self) -> dict:
        """The memory (copies), for ``state_dict`` (key ``_extra_state``; see
        `storch.method.mapo.MAPOMemory.state`)."""
        return self.store.state()

    def set_extra_state(self, state: Any) -> None:
        """Restore the memory saved by `storch.method.mapo.MAPO.get_extra_state`
        (``load_state_dict`` calls it)."""
        self.store.load(state, f"MAPO({self.plate_name!r})")

    def __setstate__(self, state: dict) -> None:
        """Unpickle, also a MAPO pickled before its memory became a ``MAPOMemory`` (attributes then)."""
        old = {new: state.pop(name) for name, new in _OLD_ATTRIBUTES.items() if name in state}
        var_shape, n_values = state.pop("_var_shape", None), state.pop("_n_values", -1)
        super().__setstate__(state)
        if old:
            self.store = MAPOMemory(self.buffer_size)
            self.store.load({"var_shape": list(var_shape) if var_shape is not None else [-1], "n_values": n_values,
                             **old}, f"MAPO({self.plate_name!r})")

    #: MAPO's memory is tensors (`MAPOMemory`'s buffers), but what a step does with it is decided on the
    #: host, so a compiled step would replay the first step's choices (a traced step is refused before
    #: anything is drawn, by `_refuse_trace`)
    step_state = StepState.host(
        "its plate holds the longest memory buffer's values plus the samples, a size read from the memory on "
        "the host (it grows from 0 to buffer_size as values are found), its memory grows to the largest datum "
        "id, the draw from outside an empty memory takes another path, and systematic exploration stores as "
        "many values as it finds new"
    )

    def _refuse_trace(self) -> None:
        """In the trace of a compiled step (before anything is drawn): refuse, naming the host decisions."""
        check_replayable(self)

    # ------------------------------------------------------------------ sampling
    def check_distribution(self, distr: Distribution) -> None:
        _sequence_support(distr, f"MAPO({self.plate_name!r})")

    def forward(self, distr: Distribution, key: Any = None) -> StochasticTensor:  # type: ignore[override]
        """Sum the buffer of each datum exactly and sample ``n`` values outside it (see the class)."""
        owner = f"MAPO({self.plate_name!r})"
        if not isinstance(distr, Distribution):
            return super().forward(distr)  # raises the common error
        self.check_distribution(distr)
        if is_tracing():
            self._refuse_trace()
        parents = distribution_layout(distr)
        if self.plate_name in parents.names:
            raise _plate_taken_error(owner, parents.plates[parents.names.index(self.plate_name)], self)
        plates, sizes, n = parents.plates, tuple(parents.sizes), self.n_samples
        with no_dispatch():
            support, lp, var_shape = self._flat_log_probs(distr, parents, owner)  # lp: (F, D, V)
            n_elem, d = lp.shape[0], lp.shape[1]
            keys = self._keys(plates, key)  # (*P) broadcast
            buf_tokens, buf_valid, excluded, excl_valid = self._buffered(keys.expand(sizes).reshape(n_elem))
            m = buf_tokens.shape[1]
            lp_detached = lp.detach().double()
            samples_tok, outside = sample_outside(lp_detached, excluded, excl_valid, n)
            tokens = torch.cat([buf_tokens.transpose(0, 1), samples_tok], 0)  # (rows, F, D)
            rows = m + n
            row_valid = torch.cat([buf_valid.transpose(0, 1), buf_valid.new_ones((n, n_elem))], 0)
            weight64, pi_b = self._row_weights(lp_detached, tokens, row_valid, m, outside)
            log_prob = _gather_log_prob(lp, tokens)  # the differentiable log π(y) of each row
            used = row_valid & (weight64 > 0) & torch.isfinite(log_prob.detach())
            log_prob = torch.where(used, log_prob, torch.zeros_like(log_prob))
            log_outside = None
            if self.baseline is not None or self.leave_one_out:
                log_outside = _log_mass_outside(lp, excluded, excl_valid).reshape(sizes)
            values = support.values(tokens.reshape((rows,) + sizes + var_shape))
            if values.dtype.is_floating_point and lp.dtype != values.dtype:
                values = values.to(lp.dtype)
        self._check_samples(distr, values, sizes)
        state = MAPOState(
            tokens=tokens.reshape((rows,) + sizes + (d,)),
            log_prob=log_prob.reshape((rows,) + sizes),
            weight=weight64.reshape((rows,) + sizes),
            row_valid=row_valid.reshape((rows,) + sizes),
            n_buffer=m,
            keys=keys.expand(sizes),
            buffer_mass=pi_b.reshape(sizes),
            outside_mass=outside.reshape(sizes),
            log_outside=log_outside,
        )
        return self._make_node(distr, values, plates, state)

    def _flat_log_probs(self, distr: Distribution, parents: PlateLayout, owner: str):
        """The support and the log-probabilities of every value of every variable, flattened to
        ``(F, D, V)`` (elements of the plates, variables, values), and the variables' shape."""
        support, lp_full = _sequence_support(distr, owner)
        lp_full = plain(lp_full)
        sizes = tuple(parents.sizes)
        n_plates = len(sizes)
        if tuple(lp_full.shape[:n_plates]) != sizes:
            raise ValueError(
                f"{owner}: the distribution has batch shape {tuple(distr.batch_shape)}, which does not "
                f"start with the sizes {sizes} of its plates {list(parents.names)}."
            )
        var_shape = tuple(lp_full.shape[n_plates:-1])
        n_values = lp_full.shape[-1]
        self._init_memory(var_shape, n_values, lp_full.device)
        lp = lp_full.reshape((math.prod(sizes), math.prod(var_shape), n_values))
        return support, lp, var_shape

    def _buffered(self, keys_flat: torch.Tensor):
        """The buffered sequences of each element ``(F, m, D)`` and their validity ``(F, m)`` (``m``
        the longest buffer), and the sequences the samples must avoid: the buffer, plus those
        already explored with ``systematic_exploration``."""
        n_elem = keys_flat.shape[0]
        self.store.grow(int(keys_flat.max()) if n_elem else 0)
        buf_tokens = self.store.buffer_tokens[keys_flat]  # (F, B, D)
        buf_valid = self.store.buffer_valid[keys_flat]
        m = int(buf_valid.sum(-1).max()) if n_elem else 0
        buf_tokens, buf_valid = buf_tokens[:, :m], buf_valid[:, :m]
        excluded, excl_valid = buf_tokens, buf_valid
        if self.systematic_exploration:
            excluded = torch.cat([excluded, self.store.explored_tokens[keys_flat]], 1)
            excl_valid = torch.cat([excl_valid, self.store.explored_valid[keys_flat]], 1)
        return buf_tokens, buf_valid, excluded, excl_valid

    def _row_weights(
        self, lp: torch.Tensor, tokens: torch.Tensor, row_valid: torch.Tensor, m: int, outside: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight of each row ``(rows, F)`` in float64, and the buffer mass ``π_B`` ``(F,)``.

        Buffer rows get ``π(y)`` (with clipping: ``max(π_B, α) · π(y)/π_B``); the ``n`` samples share
        the mass outside, ``(1 − π_B)/n`` (with clipping: ``(1 − w_B)/n`` times the share of the
        complement the samples were drawn from).
        """
        n_elem, n = tokens.shape[1], tokens.shape[0] - m
        lp_rows = _gather_log_prob(lp, tokens)  # (rows, F)
        lp_buf = torch.where(row_valid[:m], lp_rows[:m], torch.full_like(lp_rows[:m], -math.inf))
        log_pi_b = lp_buf.logsumexp(0) if m else lp.new_full((n_elem,), -math.inf)
        has_buffer = log_pi_b > -math.inf
        pi_b = log_pi_b.exp()
        w_b = pi_b if self.clip is None else torch.where(has_buffer, pi_b.clamp_min(self.clip), torch.zeros_like(pi_b))
        within = torch.where(has_buffer, (lp_buf - log_pi_b.clamp_min(-1e300)).exp(), torch.zeros_like(lp_buf))
        w_buffer = torch.where(row_valid[:m], within * w_b, torch.zeros_like(within))
        if self.clip is None:
            out_total = outside
        else:
            out_b = (1.0 - pi_b).clamp_min(0.0)
            if self.systematic_exploration:
                out_b = torch.maximum(out_b, outside)
            ratio = torch.where(out_b > 0, outside / out_b.clamp_min(1e-300), torch.zeros_like(out_b))
            out_total = (1.0 - w_b).clamp_min(0.0) * ratio
        w_samples = (out_total / n).unsqueeze(0).expand(n, n_elem)
        return torch.cat([w_buffer, w_samples], 0), pi_b

    def _make_node(
        self, distr: Distribution, values: torch.Tensor, plates: tuple[Plate, ...], state: MAPOState
    ) -> StochasticTensor:
        """The node of the rows, its plate carrying ``state`` and the rows' weights."""
        plate = AncestralPlate(self.plate_name, values.shape[0], parents=plates, info=state)
        tensor = new_node(self, distr, values, plate, plates)
        state.weight = state.weight.to(floating_dtype(distr, values))
        plate.weight = wrap_new(state.weight.clone(), layout_of(tensor))
        restore_lazy_plates(distr)
        if torch.is_grad_enabled() and get_distr_parameters(distr):
            note_sampled(plate)
        return tensor

    def _keys(self, plates: tuple[Plate, ...], key: Any) -> torch.Tensor:
        """The memory key of each element of the plates, shaped to broadcast over them."""
        owner = f"MAPO({self.plate_name!r})"
        dev = self.store.buffer_tokens.device
        independent = [i for i, p in enumerate(plates) if p.node is None]
        indep_sizes = tuple(plates[i].size for i in independent)
        view = tuple(p.size if p.node is None else 1 for p in plates)
        if key is None:
            return torch.arange(math.prod(indep_sizes), device=dev).reshape(view)
        k = plain(torch.as_tensor(key)).to(dev)
        if k.is_floating_point() or k.dtype == torch.bool:
            raise TypeError(f"{owner}: key must hold integer datum ids, got dtype {k.dtype}.")
        if tuple(k.shape) != indep_sizes:
            names = [plates[i].name for i in independent]
            raise ValueError(
                f"{owner}: key must have one datum id per element of the independent plates {names}, "
                f"shape {indep_sizes}; got shape {tuple(k.shape)}."
            )
        if k.numel() and int(k.min()) < 0:
            raise ValueError(f"{owner}: key must hold non-negative datum ids, got {int(k.min())}.")
        if k.numel() != torch.unique(k).numel():
            raise ValueError(
                f"{owner}: key holds a datum id more than once; each datum of the minibatch needs its own "
                "id (its buffer is updated from its own samples)."
            )
        return k.long().reshape(view)

    # ------------------------------------------------------------------ estimator
    def gradient_function(self, tensor: StochasticTensor) -> Optional[torch.Tensor]:
        state = self._state(tensor)
        return wrap(state.log_prob, layout_of(tensor))

    def _state(self, tensor: StochasticTensor) -> MAPOState:
        info = tensor.plate.info
        if not isinstance(info, MAPOState):
            raise ValueError(f"MAPO({self.plate_name!r}): node {tensor.name!r} was not sampled by MAPO.")
        return info

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``log π(y)``, and the baseline term ``(1 − □(log π(y) − log(1 − π_B))) · b`` on the samples."""
        l = self.gradient_function(tensor)  # noqa: E741
        if self.baseline is None and not self.leave_one_out:
            return l, None
        state = self._state(tensor)
        m, n = state.n_buffer, self.n_samples
        is_sample = torch.arange(m + n, device=state.tokens.device) >= m
        mask = wrap_new(is_sample.to(state.weight.dtype), layout_of_plates((tensor.plate,)))
        if self.leave_one_out:
            with no_dispatch():
                c = plain(cost.detach())  # this node's plate first (newer plates are reduced)
                s = c[m:]
                b = torch.cat([torch.zeros_like(c[:m]), (s.sum(0, keepdim=True) - s) / (n - 1)], 0)
            b = wrap_new(b, layout_of(cost))
        else:
            b = self.baseline.compute_baseline(tensor, cost)  # type: ignore[union-attr]
        conditional = l - wrap(state.log_outside, layout_of_plates(tensor.plate.parents))  # type: ignore[arg-type]
        return l, (1.0 - magic_box(conditional)) * b * mask

    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        """Update the baseline, then each node's buffers from its rows' costs (all costs summed)."""
        super().update_parameters(result_triples)
        if self.baseline is not None:
            self.baseline.update()
        nodes: dict[int, tuple[StochasticTensor, list[CostTensor]]] = {}
        for tensor, cost, _ in result_triples:
            nodes.setdefault(id(tensor.plate), (tensor, []))[1].append(cost)
        for tensor, costs in nodes.values():
            self._update_memory(tensor, costs)

    def _update_memory(self, tensor: StochasticTensor, costs: list[CostTensor]) -> None:
        state = self._state(tensor)
        layout = layout_of(tensor)
        with torch.no_grad():
            total = costs[0].detach()
            for c in costs[1:]:
                total = total + c.detach()
            extra = [p for p in layout_of(total).plates if not any(p is q for q in layout.plates)]
            if extra:
                total = reduce_plates(total, extra)
            with no_dispatch():
                c = plain(align_to(total, layout, expand=True)).double()  # (rows, *P)
            plates = layout.plates[1:]
            independent = [i for i, p in enumerate(plates) if p.node is None]
            stochastic = [i for i, p in enumerate(plates) if p.node is not None]
            perm = [0] + [1 + i for i in independent + stochastic]
            kb = math.prod(plates[i].size for i in independent)
            rows, m = c.shape[0], state.n_buffer
            c = c.permute(perm).reshape(rows, kb, -1)  # (rows, Kb, S)
            tok = state.tokens.permute(perm + [len(perm)]).reshape(rows, kb, -1, state.tokens.shape[-1])
            valid = state.row_valid.permute(perm).reshape(rows, kb, -1)
            keys = state.keys.permute([i - 1 for i in perm[1:]]).reshape(kb, -1)[:, 0]
            n_stoch = c.shape[2]
            # the buffer's values (the same for every sample of the stochastic plates), costs averaged
            cand_tok = [tok[:m, :, 0].transpose(0, 1)]
            cand_cost = [c[:m].mean(-1).transpose(0, 1)]
            cand_valid = [valid[:m, :, 0].transpose(0, 1)]
            # the samples, pooled over the stochastic plates
            cand_tok.append(tok[m:].permute(1, 2, 0, 3).reshape(kb, n_stoch * (rows - m), -1))
            cand_cost.append(c[m:].permute(1, 2, 0).reshape(kb, -1))
            # where nothing was left outside, the samples were drawn from the whole support: not new
            drawn = valid[m:] & (state.outside_mass > 0).permute([i - 1 for i in perm[1:]]).reshape(1, kb, -1)
            cand_valid.append(drawn.permute(1, 2, 0).reshape(kb, -1))
            self._merge(keys, torch.cat(cand_tok, 1), torch.cat(cand_cost, 1), torch.cat(cand_valid, 1), first_sample=m)

    def extra_repr(self) -> str:
        text = f"plate_name={self.plate_name!r}, n_samples={self.n_samples}, buffer_size={self.buffer_size}"
        if self.clip is not None:
            text += f", clip={self.clip}"
        if self.threshold is not None:
            text += f", threshold={self.threshold}"
        if self.systematic_exploration:
            text += f", systematic_exploration=True, max_explored={self.max_explored}"
        return text
