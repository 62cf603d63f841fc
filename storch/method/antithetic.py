"""Shared pieces of the antithetic estimators of logits (ARM, ARMS, ARSM, CARMS, coupled categorical).

Each of them estimates ``g_φ``, the gradient of the expected cost with respect to the logits ``φ``,
from a few coupled points per draw, and puts it in the surrogate as the control-variate term
``(φ − stopgrad φ) · stopgrad(g_φ)``: zero in the forward pass, with gradient ``g_φ``. The estimate
is computed on plain values laid out for the cost's plates, with the node's plate first (or replaced
by its evaluation groups, `storch.method.groups`); these helpers check the inputs, lay the values
out and give the term back to every point of the node's plate.
"""

from __future__ import annotations

import torch
from torch.distributions import Bernoulli, Categorical, Distribution, OneHotCategorical
from torch.distributions.utils import probs_to_logits

from storch.extend import AncestralPlate, CostTensor, Plate, PlateLayout, align_to, layout_of, layout_of_plates, wrap
from storch.sampling.method import check_count

__all__ = [
    "categorical_logits", "check_antithetic_count", "check_bernoulli", "check_categorical", "check_logit_plates",
    "cost_target", "aligned_logits", "points_first", "control_variate_term", "on_every_point",
]


def categorical_logits(d: Categorical | OneHotCategorical) -> torch.Tensor:
    """The (normalised) logits of ``d``: as given, or ``log probs`` from the given ``probs``.

    The lazily cached attribute of the other parameterisation is not used: torch caches it on first
    use, possibly while storch dispatch is disabled, without the plates of the parameters.

    Examples:
        >>> categorical_logits(Categorical(probs=torch.tensor([0.25, 0.75]))).exp()
        tensor([0.2500, 0.7500])
        >>> categorical_logits(OneHotCategorical(probs=torch.tensor([0.5, 0.25, 0.25]))).exp()
        tensor([0.5000, 0.2500, 0.2500])
    """
    inner = d._categorical if isinstance(d, OneHotCategorical) else d
    given = inner.__dict__.get("_param")
    if given is not None and given is inner.__dict__.get("logits"):
        return given
    return probs_to_logits(inner.probs)


def check_bernoulli(owner: str, distr: Distribution) -> None:
    """Refuse anything but a ``Bernoulli``; ``owner`` names the method, e.g. ``"ARM('z')"``.

    Examples:
        >>> check_bernoulli("ARM('z')", Categorical(logits=torch.zeros(2)))
        Traceback (most recent call last):
        ...
        ValueError: ARM('z') estimates gradients of Bernoulli logits only, got Categorical. ...
    """
    if not isinstance(distr, Bernoulli):
        raise ValueError(
            f"{owner} estimates gradients of Bernoulli logits only, got {type(distr).__name__}. Use "
            "Bernoulli(logits=...) for binary variables, or another method for this node (ScoreFunction, "
            "LocalExpectation, MVD)."
        )


def check_categorical(owner: str, distr: Distribution) -> None:
    """Refuse anything but a ``Categorical`` or ``OneHotCategorical`` with at least two categories."""
    if not isinstance(distr, (Categorical, OneHotCategorical)):
        raise ValueError(
            f"{owner} estimates gradients of categorical logits only, got {type(distr).__name__}. Use "
            "OneHotCategorical(logits=...) or Categorical(logits=...), ARMS or DisARM for Bernoulli variables, "
            "or another method for this node (ScoreFunction, LocalExpectation, MVD)."
        )
    if categorical_logits(distr).shape[-1] < 2:
        raise ValueError(
            f"{owner}: a categorical needs at least 2 categories; this one has a single category, so there is "
            "no gradient to estimate: sample it with another method or drop the node."
        )


def check_antithetic_count(owner: str, n_samples: int) -> int:
    """``n_samples``, checked to be an int of at least 2 (mutually antithetic samples need two)."""
    n_samples = check_count(n_samples, "n_samples", owner)
    if n_samples < 2:
        raise ValueError(
            f"{owner}: the copula and the leave-one-out baseline need n_samples >= 2 mutually "
            f"antithetic samples, got {n_samples}. Use n_samples=2 or more."
        )
    return n_samples


def cost_target(first: Plate, plate: Plate, cost: CostTensor) -> PlateLayout:
    """The cost's plates with the node's ``plate`` replaced by ``first`` (the plate, or its groups) in front."""
    return layout_of_plates([first] + [p for p in layout_of(cost).plates if p is not plate])


def check_logit_plates(owner: str, phi: torch.Tensor, cost: CostTensor, target: PlateLayout) -> PlateLayout:
    """The layout of the logits ``phi``; an error naming the plates the cost lacks.

    A plate the cost carries through a newer step of its single-sample chain (a later node drawn
    from it) counts as carried: aligning re-indexes the older step to the newer one.
    """
    phi_layout = layout_of(phi)
    extra = [p.name for p in phi_layout.plates
             if p not in target.plates and not any(isinstance(u, AncestralPlate) and u.descends_from(p) for u in target.plates)]
    if extra:
        raise ValueError(
            f"{owner}: the logits carry plates {extra} that the cost {cost.name!r} does not "
            f"have (its plates: {list(layout_of(cost).names)}); register the cost before reducing them."
        )
    return phi_layout


def aligned_logits(phi: torch.Tensor, phi_layout: PlateLayout, target: PlateLayout) -> tuple[torch.Tensor, int]:
    """The plain logits laid out for ``target``, and their number of event dimensions (under ``no_dispatch``)."""
    n_event = phi.dim() - len(phi_layout.sizes)
    return (align_to(wrap(phi, phi_layout), target) if phi_layout.plates else phi), n_event


def points_first(cost: CostTensor, i: int) -> torch.Tensor:
    """The plain detached cost with the node's plate (at position ``i``) first (under ``no_dispatch``)."""
    return cost.detach().movedim(i, 0) if i else cost.detach()


def control_variate_term(
    phi: torch.Tensor, g: torch.Tensor, n_event: int, detached: torch.Tensor | None = None
) -> torch.Tensor:
    """``(φ − stopgrad φ) · g``, summed over the ``n_event`` trailing dimensions (``detached``: ``φ.detach()``
    if the caller has it already).

    Examples:
        >>> phi = torch.tensor([0.5, -1.0], requires_grad=True)
        >>> term = control_variate_term(phi, torch.tensor([2.0, 3.0]), 1)
        >>> float(term.detach()), torch.autograd.grad(term, phi)[0]
        (0.0, tensor([2., 3.]))
    """
    term = (phi - (phi.detach() if detached is None else detached)) * g
    return term.sum(tuple(range(-n_event, 0))) if n_event else term


def on_every_point(
    term: torch.Tensor, target: PlateLayout | None, plate: Plate, group_size: int, i: int
) -> torch.Tensor:
    """The term of each group (``target``'s first plate) given to each of its ``group_size`` points, the
    other plates of ``target`` expanded (``target=None``: the term has them all already), and the node's
    plate moved back to position ``i``. A single group is expanded to its points without a copy."""
    if target is not None:
        term = term.expand(target.sizes)
    if term.shape[0] == 1:
        term = term.expand((group_size,) + tuple(term.shape[1:]))
    else:
        term = term.unsqueeze(1).expand((term.shape[0], group_size) + tuple(term.shape[1:]))
        term = term.reshape((plate.size,) + tuple(term.shape[2:]))
    return term.movedim(0, i) if i else term
