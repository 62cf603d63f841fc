"""ARSM: augment–REINFORCE–swap–merge for categorical variables.

Yin, Yue & Zhou 2019, "ARSM: Augment-REINFORCE-Swap-Merge Estimator for Gradient Backpropagation
Through Categorical Variables" (ICML). For one categorical variable with logits ``φ ∈ R^C``
(``p = softmax φ``), draw ``π ~ Dirichlet(1_C)``; then ``z = argmin_i π_i e^{−φ_i}`` is a sample
of ``Cat(p)`` (augment), and ``∇_{φ_c} E f = E[f(z)(1 − C π_c)]`` (REINFORCE). Swapping entries
``c`` and ``j`` of ``π`` gives another ``Dirichlet(1_C)`` draw ``π^{c⇌j}`` and the pseudo-action
``z^{c⇌j} = argmin_i π^{c⇌j}_i e^{−φ_i}`` (``z^{c⇌c} = z``). With the reference category ``j``
(swap) and the average over all ``j`` (merge):

    g_{φ_c} = Σ_j (F[c, j] − (1/C) Σ_m F[m, j]) (1/C − π_j),      F[c, j] = f(z^{c⇌j})

The subtracted row mean is a baseline with expectation zero (``Σ_m ∇_{φ_m} E f = 0``).

**Several variables** (a node with batch shape ``S``: ``|S|`` independent categoricals, e.g. a
minibatch plate and ``D`` latent variables): one ``π_d`` per variable, and, as in the paper's
multivariate ARSM (its §2.4), the pair ``(c, j)`` is swapped in *every* variable at once:
``F[c, j] = f(z_1^{c⇌j}, …, z_D^{c⇌j})`` and ``g_{φ_{dc}} = Σ_j (F[c, j] − mean_m F[m, j]) (1/C − π_{dj})``.
Each term is unbiased for fixed ``(c, j)``: the other variables' swapped draws are again
``Dirichlet(1_C)`` and independent of ``π_d``.

**Evaluations.** ``F`` is symmetric (``z^{c⇌j} = z^{j⇌c}``), so one draw needs the cost at
``M = C(C − 1)/2 + 1`` points: the true action ``z`` and one pseudo-action per pair ``c < j``,
whatever the number of variables. All ``M`` are evaluated (one vectorised pass); pseudo-actions
that happen to coincide are not deduplicated (the paper counts only the unique ones, which would
need a data-dependent number of points). Every pseudo-action is itself a ``Cat(p)`` sample: the
forward value averages the ``C²`` entries of ``F`` (weights ``1/(nC)`` on ``z``, ``2/(nC²)`` on
each pair), and gradients that reach the cost by other paths flow through all points.

In the surrogate there is no gradient function; the control-variate term
``(φ − stopgrad φ) · stopgrad(g_φ)``, summed over the variables and categories, is zero in the
forward pass and has gradient ``g_φ``. Unbiased for **first-order** derivatives only: the term is
linear in the normalised logits ``φ = log_softmax θ``, so ``backward(create_graph=True)``
differentiates only the chain rule through ``log_softmax`` and the second derivatives are not
estimated (the tests show them biased).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributions import Distribution, OneHotCategorical

from storch.extend import (
    CostTensor, StochasticTensor, align_to, layout_of, layout_of_plates, no_dispatch, node_of, wrap,
)
from storch.method.antithetic import (
    aligned_logits, categorical_logits, check_categorical, check_logit_plates, control_variate_term, cost_target,
    on_every_point, points_first,
)
from storch.method.groups import GroupRecords, flatten_groups, group_plate, group_weights
from storch.method.method import Method

__all__ = ["ARSM", "arsm_logit_gradient", "arsm_pseudo_actions"]

def as_samples(distr: Distribution, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Category indices as the samples of ``distr``: one-hot in ``like``'s dtype, or the indices."""
    if isinstance(distr, OneHotCategorical):
        return F.one_hot(index, like.shape[-1]).to(like.dtype)
    return index


def sample_index(distr: Distribution, samples: torch.Tensor) -> torch.Tensor:
    """The category indices of samples of ``distr`` (the inverse of `as_samples`)."""
    return samples.argmax(-1) if isinstance(distr, OneHotCategorical) else samples.long()


@functools.lru_cache(maxsize=32)
def _swaps(c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``M = C(C−1)/2 + 1`` swap permutations (identity first, then pairs ``c < j``), ``(M, C)``,
    and the ``(C, C)`` table of the point that holds ``F[c, j]``."""
    perms, where = [list(range(c))], torch.zeros(c, c, dtype=torch.long)
    for a in range(c):
        for b in range(a + 1, c):
            perm = list(range(c))
            perm[a], perm[b] = b, a
            where[a, b] = where[b, a] = len(perms)
            perms.append(perm)
    return torch.tensor(perms), where


def arsm_pseudo_actions(phi: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """The indices of the true action and the pseudo-actions, ``(n, M, *S)``.

    Args:
        phi: logits ``(*S, C)``.
        pi: Dirichlet draws ``(n, *S, C)``.

    Examples:
        >>> arsm_pseudo_actions(torch.zeros(3), torch.tensor([[0.1, 0.3, 0.6]]))   # z, z^{0⇌1}, ...
        tensor([[0, 1, 2, 0]])
    """
    perms, _ = _swaps(phi.shape[-1])
    scores = pi.log()[..., perms.to(pi.device)] - phi.unsqueeze(-2)  # (n, *S, M, C)
    return scores.argmin(-1).movedim(-1, 1)


def arsm_logit_gradient(costs: torch.Tensor, pi: torch.Tensor, n_batch: int) -> torch.Tensor:
    """``g_{φ_c} = Σ_j (F[c, j] − mean_m F[m, j]) (1/C − π_j)``, plain tensors.

    Args:
        costs: ``(n, M, *rest)``: the cost at the ``M`` points of each of ``n`` draws.
        pi: the draws ``(n, *rest', *batch, C)``, ``rest'`` broadcastable against ``rest``.
        n_batch: the number of batch dimensions of ``pi`` (the variables of the node).

    Examples:
        >>> pi = torch.tensor([[0.2, 0.5, 0.3]])
        >>> f = torch.tensor([[1.0, 2.0, 4.0, 8.0]])            # f(z), f(z^{0⇌1}), f(z^{0⇌2}), f(z^{1⇌2})
        >>> arsm_logit_gradient(f, pi, 0)                      # sums to 0 over the categories
        tensor([[ 0.0889,  0.5222, -0.6111]])
    """
    c = pi.shape[-1]
    _, where = _swaps(c)
    table = costs[:, where.flatten().to(costs.device)].movedim(1, -1)  # (n, *rest, C·C)
    table = table.reshape(tuple(table.shape[:-1]) + (1,) * n_batch + (c, c))
    centred = table - table.mean(-2, keepdim=True)
    return (centred * (1.0 / c - pi).unsqueeze(-2)).sum(-1)


class ARSM(Method):
    """ARSM for ``OneHotCategorical`` and ``Categorical`` nodes (see the module for the formula).

    The plate holds ``n_samples`` groups of ``M = C(C − 1)/2 + 1`` points: the true action and the
    pseudo-actions of one Dirichlet draw per variable, the pair swapped in all variables at once
    (``M`` cost evaluations per draw, whatever the number of variables). Unbiased for the
    first-order gradient with respect to the logits (or, by the chain rule, ``probs``); not for
    higher orders (see the module).

    Args:
        plate_name: node / plate name.
        n_samples: the number of Dirichlet draws (evaluation groups).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import OneHotCategorical
        >>> _ = torch.manual_seed(0)
        >>> theta = torch.tensor([0.2, -0.4, 0.9], requires_grad=True)
        >>> z = ARSM("z", n_samples=3000)(OneHotCategorical(logits=theta))
        >>> z.shape                                   # 4 points per draw: z and 3 swaps
        torch.Size([12000, 3])
        >>> values = torch.tensor([1.0, -2.0, 0.5])
        >>> storch.add_cost((z * values).sum(-1) ** 2, "f")
        >>> _ = storch.backward()
        >>> p = theta.softmax(-1)
        >>> exact = p * (values**2 - (p * values**2).sum())
        >>> bool(torch.allclose(theta.grad, exact, atol=0.02))
        True
    """

    def __init__(self, plate_name: str, n_samples: int = 1) -> None:
        super().__init__(plate_name, None, n_samples)
        self._draws = GroupRecords("ARSM", "Dirichlet draws")  # samples -> π

    def check_distribution(self, distr: Distribution) -> None:
        check_categorical(f"ARSM({self.plate_name!r})", distr)

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        phi = categorical_logits(distr).detach()  # type: ignore[arg-type]
        tiny = torch.finfo(phi.dtype).tiny
        e = -torch.rand((amt_samples,) + tuple(phi.shape), dtype=phi.dtype, device=phi.device).clamp_min(tiny).log()
        pi = e / e.sum(-1, keepdim=True)  # Dirichlet(1_C): normalised exponentials
        samples = as_samples(distr, flatten_groups(arsm_pseudo_actions(phi, pi)), phi)
        self._draws.keep(samples, pi)
        return samples

    def weighting_function(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        c = categorical_logits(distr).shape[-1]  # type: ignore[arg-type]
        return group_weights(amt_samples // _group_size(c), [1.0 / c] + [2.0 / c**2] * (_group_size(c) - 1))

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(φ − stopgrad φ) · stopgrad(g_φ)``, summed over variables and categories, for each point
        of a draw; computed on plain values laid out as ``[draws, *other plates of the cost, ...]``."""
        plate, cost_layout = tensor.plate, layout_of(cost)
        phi = categorical_logits(tensor.distribution)  # type: ignore[arg-type]
        m = _group_size(phi.shape[-1])
        groups = group_plate(plate, m)
        target = cost_target(groups, plate, cost)
        phi_layout = check_logit_plates(f"ARSM({self.plate_name!r})", phi, cost, target)
        i = cost_layout.position(plate)
        with no_dispatch():
            phi, n_event = aligned_logits(phi, phi_layout, target)
            c = points_first(cost, i)
            c = c.reshape((groups.size, m) + tuple(c.shape[1:]))
            node_layout = layout_of_plates((groups,) + node_of(tensor).layout.plates[1:])
            pi = align_to(wrap(self._draws.of(tensor), node_layout), target)
            g = arsm_logit_gradient(c, pi, n_event - 1)
            term = on_every_point(control_variate_term(phi, g, n_event), target, plate, m, i)
        return None, wrap(term, cost_layout)


def _group_size(c: int) -> int:
    return c * (c - 1) // 2 + 1

