"""The gradient-estimation method of one stochastic node, as four components (Storchastic, §3).

For node ``i`` with sample set ``X_i`` the surrogate loss is built, from the costs back to the
first node, as

    S_i = Σ_{x ∈ X_i} w_i(x) · [ □(l_i(x)) · S_{i+1}(x) + (1 − □(l_i(x))) · a_i(x) ]

with ``□(l) = exp(l − stopgrad(l))``. The components of a :class:`Method`:

1. **proposal** — a :class:`storch.sampling.SamplingMethod` draws ``X_i``;
   :meth:`Method.proposal_dist` overrides how Monte Carlo samples are drawn;
2. **weighting function** ``w_i`` — the proposal's ``weighting_function``
   (:meth:`Method.weighting_function` overrides it for Monte Carlo proposals);
3. **gradient function** ``l_i`` — :meth:`Method.gradient_function` (``None``: no score term);
4. **control variate** ``a_i`` — :meth:`Method.control_variate` (``None``: none).

How to add an estimator
-----------------------
Subclass :class:`Method` and override what differs from plain Monte Carlo. The surrogate is
unbiased for all orders of derivatives if, for every order ``n`` and every function ``g``,
``E_X[Σ_x w(x) ∇ⁿ(□(l(x)) g(x))] = ∇ⁿ E_p[g]`` and ``E_X[Σ_x w(x) ∇ⁿ((1 − □(l(x))) a(x))] = 0``.
A score-function estimator with a leave-one-out baseline takes a few lines: it overrides
:meth:`proposal_dist` (``distr.sample((n,))``), :meth:`weighting_function` (``1/n`` per sample)
and :meth:`estimator`, which returns ``log p(x)`` and ``(1 − □(log p(x))) · b`` with ``b`` the mean
cost of the other samples. The complete class is ``examples/score_function_loo.py`` (the manual's
``ScoreFunctionLOO``); the tests check it is unbiased.

:meth:`estimator` returns the gradient function and the whole control-variate term; by default it
combines :meth:`gradient_function` and :meth:`control_variate`. Gradient functions and control
variates with extra (non-plate) dimensions, such as the per-variable log-probabilities above, are
summed over those dimensions. Pathwise estimators set ``reparameterized = True`` so that samples keep
their gradient.

Estimators that need the cost at extra points (ARM, measure-valued derivatives, local expectations,
REBAR) lay out groups of evaluation points along their own plate and weight them; see
:mod:`storch.method.groups`. Methods that learn from the gradient estimate (RELAX's control
variate) set ``needs_graph_after_backward`` so that :meth:`update_parameters` can differentiate
through the surrogate once more.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributions import Distribution

from storch.plate import Plate, layout_of_plates
from storch.sampling.method import MonteCarlo, SamplingMethod
from storch.tensor import CostTensor, StochasticNode, StochasticTensor, Tensor, _alias, _Disable, wrap_new
from storch.util import distribution_layout, log_prob_of_own_samples, magic_box

__all__ = ["Method", "log_prob"]


def log_prob(tensor: StochasticTensor) -> Tensor:
    """``log p(x)`` of each sample of ``tensor``, summed over all non-plate dimensions."""
    node = tensor._node
    layout = node.layout
    with _Disable():
        lp = log_prob_of_own_samples(node.distribution, node.samples)
        extra = tuple(range(len(layout.sizes), lp.dim()))
        if extra:
            lp = lp.sum(extra)
    return wrap_new(lp, layout)


class Method(nn.Module):
    """Base class of gradient estimators: sample a distribution and say how to differentiate it.

    Args:
        plate_name: the name of the node and of its plate.
        sampling_method: the proposal; defaults to :class:`storch.sampling.MonteCarlo` with
            ``n_samples``.
        n_samples: the number of Monte Carlo samples when no ``sampling_method`` is given.

    Calling the method on a ``torch.distributions.Distribution`` returns a
    :class:`storch.StochasticTensor`. A method is an ``nn.Module``, so it can live inside a model.
    """

    #: whether the samples carry pathwise gradients (``rsample``)
    reparameterized: bool = False
    #: whether :meth:`update_parameters` differentiates through the surrogate again (e.g. to train
    #: a control variate on the gradient variance); ``storch.backward`` then retains the graph
    needs_graph_after_backward: bool = False

    def __init__(
        self, plate_name: str, sampling_method: SamplingMethod | None = None, n_samples: int = 1
    ) -> None:
        super().__init__()
        if not isinstance(plate_name, str) or not plate_name:
            raise TypeError(
                f"{type(self).__name__}: the first argument is the plate name (a string), got "
                f"{plate_name!r}. Call it as {type(self).__name__}('z', n_samples=8)(distribution)."
            )
        self.plate_name = plate_name
        self.sampling_method = sampling_method if sampling_method is not None else MonteCarlo(plate_name, n_samples)
        if type(self).proposal_dist is not Method.proposal_dist:
            self.sampling_method.set_mc_sample(lambda distr, plates, n: self.proposal_dist(distr, n))
        if type(self).weighting_function is not Method.weighting_function:
            self.sampling_method.set_mc_weighting_function(
                lambda tensor, plate: self.weighting_function(tensor.distribution, plate.size)
            )

    @property
    def n_samples(self) -> int:
        return getattr(self.sampling_method, "n_samples", 1)

    # --------------------------------------------------------------- sampling
    def forward(self, distr: Distribution) -> StochasticTensor:
        if not isinstance(distr, Distribution):
            raise TypeError(
                f"{type(self).__name__}({self.plate_name!r}) samples a torch.distributions.Distribution, "
                f"got {type(distr).__name__}. Build the method with its plate name and call it on the "
                "distribution, e.g. ScoreFunction('z', n_samples=8)(q) (the manual's older form was "
                "method('z', q, n=8))."
            )
        self.check_distribution(distr)
        parents = distribution_layout(distr)
        if self.plate_name in parents.names:
            raise ValueError(
                f"{type(self).__name__}: the distribution's parameters already carry a plate named "
                f"{self.plate_name!r}; give this node another name."
            )
        with _Disable():
            samples = self.sampling_method(distr, parents.plates, self.reparameterized)
        self._check_samples(distr, samples, parents.sizes)
        plate = Plate(self.plate_name, samples.shape[0], parents=parents.plates)
        layout = layout_of_plates((plate,) + parents.plates)
        node = StochasticNode(self.plate_name, self, distr, samples, layout, plate)
        plate.node = node
        tensor = StochasticTensor._from_node(_alias(samples), node)
        plate.weight = self._plate_weight(tensor, plate)
        return tensor

    def _check_samples(self, distr: Distribution, samples: torch.Tensor, sizes: tuple[int, ...]) -> None:
        expected = tuple(distr.batch_shape) + tuple(distr.event_shape)
        if samples.dim() != len(expected) + 1 or tuple(samples.shape[1:]) != expected:
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): the proposal returned samples of shape "
                f"{tuple(samples.shape)}; expected (n, *batch_shape, *event_shape) = (n, {expected})."
            )

    def _plate_weight(self, tensor: StochasticTensor, plate: Plate) -> torch.Tensor:
        weight = self.sampling_method.weighting_function(tensor, plate)
        if weight is None:
            return plate.weight  # the uniform 1/n the plate was created with
        if isinstance(weight, Tensor):
            return weight
        weight = torch.as_tensor(weight)
        if weight.dim() == 0:
            return weight
        if tuple(weight.shape) != (plate.size,):
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): a plain weight tensor must be a scalar or "
                f"have shape ({plate.size},), one weight per sample; got {tuple(weight.shape)}. Return "
                "a storch tensor for weights that depend on other plates."
            )
        return wrap_new(weight.clone(), layout_of_plates((plate,)))

    # ------------------------------------------------------------- components
    def check_distribution(self, distr: Distribution) -> None:
        """Raise a clear error if this method cannot handle ``distr`` (default: any is fine)."""

    def proposal_dist(self, distr: Distribution, amt_samples: int) -> torch.Tensor:
        """How Monte Carlo samples are drawn: ``(amt_samples, *batch_shape, *event_shape)``.

        Pathwise methods (``reparameterized = True``) use ``rsample``, others ``sample``.
        """
        if self.reparameterized:
            return distr.rsample((amt_samples,))
        return distr.sample((amt_samples,))

    def weighting_function(self, distr: Distribution, amt_samples: int) -> torch.Tensor | None:
        """Override to weight Monte Carlo samples (a scalar or one weight per sample)."""
        return None

    def gradient_function(self, tensor: StochasticTensor) -> Optional[torch.Tensor]:
        """The gradient function ``l(x)``; ``None`` for estimators without a score term."""
        return None

    def control_variate(self, tensor: StochasticTensor, cost: CostTensor) -> Optional[torch.Tensor]:
        """The control variate ``a(x)`` for ``cost``, or ``None``.

        ``cost`` is the downstream estimate ``S_{i+1}``: one value per sample of this node (and
        per value of the other plates), named after the registered cost it comes from.
        """
        return None

    def estimator(
        self, tensor: StochasticTensor, cost: CostTensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The gradient function ``l`` and the control-variate term ``(1 − □(l)) · a``."""
        l = self.gradient_function(tensor)  # noqa: E741
        if l is None:
            return None, None
        a = self.control_variate(tensor, cost)
        if a is None:
            return l, None
        return l, (1.0 - magic_box(l)) * a

    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        """Called once after each :func:`storch.backward` that used this method."""
        self.sampling_method.update_parameters(result_triples)

    def reset(self) -> None:
        self.sampling_method.reset()

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}"
