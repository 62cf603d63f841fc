"""The gradient-estimation method of one stochastic node, as four components (Storchastic, §3).

For node ``i`` with sample set ``X_i`` the surrogate loss is built, from the costs back to the
first node, as

    S_i = Σ_{x ∈ X_i} w_i(x) · [ □(l_i(x)) · S_{i+1}(x) + (1 − □(l_i(x))) · a_i(x) ]

with ``□(l) = exp(l − stopgrad(l))``. The components of a `storch.method.method.Method`:

1. **proposal** — a `storch.sampling.SamplingMethod` draws ``X_i``;
   `storch.method.method.Method.proposal_dist` overrides how Monte Carlo samples are drawn;
2. **weighting function** ``w_i`` — the proposal's ``weighting_function``
   (`storch.method.method.Method.weighting_function` overrides it for Monte Carlo
   proposals);
3. **gradient function** ``l_i`` — `storch.method.method.Method.gradient_function`
(``None``: no score term);
4. **control variate** ``a_i`` — `storch.method.method.Method.control_variate` (``None``:
none).

How to add an estimator
-----------------------
Subclass `storch.method.method.Method` and override what differs from plain Monte Carlo. The surrogate is
unbiased for all orders of derivatives if, for every order ``n`` and every function ``g``,
``E_X[Σ_x w(x) ∇ⁿ(□(l(x)) g(x))] = ∇ⁿ E_p[g]`` and ``E_X[Σ_x w(x) ∇ⁿ((1 − □(l(x))) a(x))] = 0``.
A score-function estimator with a leave-one-out baseline takes a few lines: it overrides
`proposal_dist` (``distr.sample((n,))``), `weighting_function` (``1/n`` per sample)
and `estimator`, which returns ``log p(x)`` and ``(1 − □(log p(x))) · b`` with ``b`` the mean
cost of the other samples. The complete class is ``examples/score_function_loo.py`` (the manual's
``ScoreFunctionLOO``); the tests check it is unbiased.

`estimator` returns the gradient function and the whole control-variate term; by default it
combines `gradient_function` and `control_variate`. Gradient functions and control
variates with extra (non-plate) dimensions, such as the per-variable log-probabilities above, are
summed over those dimensions. Pathwise estimators set ``reparameterized = True`` so that samples keep
their gradient.

Estimators that need the cost at extra points (ARM, measure-valued derivatives, local expectations,
REBAR) lay out groups of evaluation points along their own plate and weight them; see
`storch.method.groups`. Methods that learn from the gradient estimate (RELAX's control
variate) set ``needs_graph_after_backward`` so that `update_parameters` can differentiate
through the surrogate once more. A method whose `update_parameters` keeps state between steps
declares how in its class attribute ``step_state`` (`storch.state`); an override of
`update_parameters` without one counts as state that `storch.compile_step` refuses.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributions import Distribution

from storch.extend import (
    MAX_PLATES,
    alias,
    ChainPlate,
    CostTensor,
    DeclaresStepState,
    Plate,
    PlateLayout,
    StepState,
    StochasticNode,
    TooManyPlatesError,
    StochasticTensor,
    Tensor,
    distribution_facts,
    elementwise,
    floating_dtype,
    forget_lazy_plain_values,
    get_distr_parameters,
    is_tracing,
    layout_of,
    layout_of_plates,
    magic_box,
    new_node,
    no_dispatch,
    node_of,
    note_sampled,
    reraise_cuda_dimension_error,
    restore_lazy_plates,
    wrap,
    wrap_new,
)
from storch.sampling.method import MonteCarlo, SamplingMethod, check_count, describe_argument

__all__ = [
    "Method", "log_prob", "DEFAULT_N_SAMPLES", "proposal_arguments", "check_floating_parameters", "JointBoundRecords",
]


class _DefaultCount(int):
    """The default ``n_samples`` (1), told apart from an explicit ``n_samples=1`` by identity."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


#: the default ``n_samples`` of methods whose second argument is ``sampling_method`` (equal to 1)
DEFAULT_N_SAMPLES = _DefaultCount(1)


def _is_index(value: Any) -> bool:
    """Whether ``value`` is an integer (``operator.index`` works) other than a ``bool``."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def proposal_arguments(owner: str, sampling_method: Any, n_samples: Any) -> tuple[Optional[SamplingMethod], int]:
    """Check the ``(sampling_method, n_samples)`` arguments of a method; ``(proposal or None, n)``.

    ``sampling_method`` may also be the number of samples, the manual's (Storchastic's) spelling
    ``ScoreFunction("z", 8)``: an ``int`` in that slot means ``n_samples`` (an error if
    ``n_samples`` is also given with another value). Anything else there that is not a
    `storch.sampling.SamplingMethod` is a `TypeError`; counts are checked by
    `storch.sampling.method.check_count`. Idempotent: its result passed again
    returns itself.
    """
    explicit = n_samples is not DEFAULT_N_SAMPLES
    n = check_count(n_samples, "n_samples", owner)
    if sampling_method is None or isinstance(sampling_method, SamplingMethod):
        return sampling_method, n
    if not (isinstance(sampling_method, float) or _is_index(sampling_method)):
        raise TypeError(
            f"{owner}: the second argument, sampling_method, must be a storch.sampling.SamplingMethod "
            f"(or the number of samples as an int, as in {owner.split('(')[0]}('z', 8)); got "
            f"{describe_argument(sampling_method)}."
        )
    count = check_count(sampling_method, "n_samples (given as the second argument)", owner)
    if explicit and n != count:
        raise ValueError(
            f"{owner}: n_samples is given twice, as the second argument ({count}) and as "
            f"n_samples={n}; give it once."
        )
    return None, count


def check_floating_parameters(distr: Distribution, method: str, node: str) -> None:
    """Refuse a distribution with integer (or bool) parameters before sampling it.

    Torch samples such a distribution with a bare ``"normal_kernel_cpu" not implemented for 'Long'``
    (``Normal(torch.tensor(0), torch.tensor(1))``; a Python ``1.0`` next to an integer tensor is
    turned into an integer too). Parameters whose constraint is discrete (``Binomial.total_count``)
    may be integers.

    Args:
        distr: the distribution a method is about to sample.
        method: the method's name for the message, e.g. ``"ScoreFunction"``.
        node: the node's (plate's) name.

    Raises:
        TypeError: naming the node, the method, the distribution and each integer parameter.

    Examples:
        >>> import torch
        >>> from torch.distributions import Normal
        >>> check_floating_parameters(Normal(torch.tensor(0.0), 1.0), "ScoreFunction", "z")  # fine
        >>> check_floating_parameters(Normal(torch.tensor(0), 1.0), "ScoreFunction", "z")
        Traceback (most recent call last):
        ...
        TypeError: ScoreFunction cannot sample node 'z': the parameters of Normal must be floating point ...
    """
    _refuse_integer_parameters(distribution_facts(distr).integer_parameters, distr, method, node)


def _refuse_integer_parameters(
    found: list[tuple[str, str, torch.dtype]], distr: Distribution, method: str, node: str
) -> None:
    """`check_floating_parameters` on the integer parameters of `DistributionFacts` found already."""
    if not found:
        return
    top = type(distr).__name__
    params = ", ".join(
        f"{name if owner == top else f'{owner}.{name}'} ({dtype})" for owner, name, dtype in found
    )
    raise TypeError(
        f"{method} cannot sample node {node!r}: the parameters of {top} must be floating point tensors, "
        f"got {params}. Torch cannot sample a distribution with integer parameters (and a Python float "
        "next to an integer tensor becomes an integer too). Build them as floating point, e.g. "
        "torch.tensor(0.) instead of torch.tensor(0), or convert them with .float()."
    )


def _check_room_for_a_plate(distr: Distribution, parents: PlateLayout, method: str, node: str) -> None:
    """Refuse a node whose plate would give its samples or its distribution's parameters more dimensions
    than torch handles (`MAX_PLATES`): the parents' plates, the new one, and one sample's (or one
    parameter's) own dimensions. Without it the step fails later, in the backward pass, with torch's
    bare "only tensors with up to 64 dims are supported"."""
    own = len(distr.batch_shape) + len(distr.event_shape) - len(parents.sizes)  # batch_shape holds the plates
    if len(parents.sizes) + own + 2 <= MAX_PLATES:  # a parameter has at most one dimension more
        return
    widest = own
    for param in get_distr_parameters(distr, filter_requires_grad=False).values():
        widest = max(widest, param.dim() - len(layout_of(param).sizes))
    if len(parents.sizes) + 1 + widest > MAX_PLATES:
        raise TooManyPlatesError(
            [*parents.plates, Plate(node, 1)],
            detail=f"{method} cannot add node {node!r}: its samples or its distribution's parameters would "
            f"have {len(parents.sizes) + 1} plates and {widest} dimensions of their own, "
            f"{len(parents.sizes) + 1 + widest} in all.",
        )


def log_prob(tensor: StochasticTensor) -> Tensor:
    """``log p(x)`` of each sample of ``tensor``, summed over all non-plate dimensions.

    Reuses the log-probability the model computed with
    `storch.tensor.StochasticTensor.log_prob`, if it did.
    """
    node = node_of(tensor)
    layout = node.layout
    with no_dispatch():
        lp = node.shared_log_prob(view=False)  # the node's own tensor: summed into a new one, else viewed
        if lp is None:
            lp = node.own_samples_log_prob()
            shared = False
        else:
            shared = True
        extra = tuple(range(len(layout.sizes), lp.dim()))
        if extra:
            lp = lp.sum(extra)
        elif shared:
            lp = alias(lp)
    return wrap_new(lp, layout)


# CPU weights (e.g. the group weights of ARM, LocalExpectation, MVD) copied to an accelerator, by
# device, dtype and values: a copy from host memory waits for the device's queue, once per step
# otherwise. Small and bounded: methods make a handful of distinct weight vectors.
_DEVICE_COPIES: dict[tuple, torch.Tensor] = {}
_MAX_DEVICE_COPIES = 256


def _on_device(weight: Any, device: torch.device) -> torch.Tensor:
    """``weight`` as a tensor on ``device``; a small CPU tensor is copied to an accelerator only once
    (the copy is shared: callers must not write into it)."""
    if isinstance(weight, torch.Tensor) and weight.device == device:
        return weight
    if device.type in ("cpu", "meta") or not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" \
            or weight.numel() > 1024 or is_tracing():  # the cache key reads the values on the host
        return torch.as_tensor(weight, device=device)
    key = (device, weight.dtype, tuple(weight.shape), tuple(weight.flatten().tolist()))
    copy = _DEVICE_COPIES.get(key)
    if copy is None:
        if len(_DEVICE_COPIES) >= _MAX_DEVICE_COPIES:
            _DEVICE_COPIES.clear()
        copy = _DEVICE_COPIES[key] = weight.to(device)
    return copy


class Method(nn.Module, DeclaresStepState):
    """Base class of gradient estimators: sample a distribution and say how to differentiate it.

    Args:
        plate_name: the name of the node and of its plate.
        sampling_method: the proposal; defaults to `storch.sampling.MonteCarlo` with
            ``n_samples``. An ``int`` here is ``n_samples`` (the manual's ``ScoreFunction("z", 8)``).
        n_samples: the number of Monte Carlo samples when no ``sampling_method`` is given: a
            positive ``int`` (``2.5`` or ``2.0`` is an error, not truncated).

    Calling the method on a ``torch.distributions.Distribution`` returns a
    `storch.StochasticTensor`. A method is an ``nn.Module``, so it can live inside a model.

    Examples:
        The plain score function in two lines: Monte Carlo samples (the default proposal, weights
        ``1/n``) and the gradient function ``l(x) = log p(x)`` (`storch.method.method.log_prob`):

        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> class MyScoreFunction(Method):
        ...     def gradient_function(self, tensor):
        ...         return log_prob(tensor)
        >>> _ = torch.manual_seed(0)
        >>> p = torch.tensor(0.3, requires_grad=True)
        >>> x = MyScoreFunction("x", n_samples=20000)(Bernoulli(p))
        >>> storch.add_cost((x - 2.0) ** 2, "f")              # E f = 4 (1 - p) + p = 4 - 3p
        >>> estimate = storch.backward()
        >>> abs(estimate.item() - 3.1) < 0.05, abs(p.grad.item() + 3.0) < 0.15
        (True, True)
    """

    #: marks storch's estimators for the layers below that cannot import this class
    #: (`storch.distributed.exclude_methods_from_ddp`)
    is_storch_method: bool = True
    #: whether the samples carry pathwise gradients (``rsample``)
    reparameterized: bool = False
    #: whether some of the node's samples are relaxed, continuous values between those of a discrete
    #: support (Gumbel-softmax, REBAR's relaxed points): ``z.log_prob()`` then gives the continuous
    #: extension of ``log p`` (`storch.tensor.StochasticTensor.log_prob`)
    relaxes_samples: bool = False
    #: whether `storch.method.method.Method.update_parameters` differentiates through the
    #: surrogate again (e.g. to train a control variate on the gradient variance);
    #: ``storch.backward`` then retains the graph
    needs_graph_after_backward: bool = False
    #: whether the method estimates gradients of a multi-sample bound over its samples jointly
    #: (VIMCO), so that `storch.method.iwae_bound` may be taken over its plate although it is
    #: not reparameterized; such a method gets the bound through
    #: `storch.method.method.Method.on_joint_bound`
    handles_joint_bound: bool = False
    #: whether a node drawn with a single plain Monte Carlo sample may be a step of a single-sample
    #: chain (`storch.plate.ChainPlate`): it then extends the chain its
    #: distribution carries instead of adding a plate, so that rollouts of any length fit in torch's
    #: 64 dimensions. Methods whose estimator needs the node's plate next to its parents' (`GSB`,
    #: whose rules keep a record of the samples they drew) set it to ``False``.
    extends_chains: bool = True
    #: what the method keeps between steps apart from its parts (its ``sampling_method``; see
    #: `storch.state`): nothing. A subclass that overrides
    #: `storch.method.method.Method.update_parameters` declares its own ``step_state``
    #: in the same class body, or counts as keeping ``HOST`` state
    step_state = StepState.NONE
    state_hooks = ("update_parameters",)
    #: ``method(distribution)`` runs ``forward`` through ``nn.Module.__call__`` (hooks run), the same
    #: function; declared here so that type checkers and editors see the node it returns
    __call__: Callable[..., StochasticTensor] = nn.Module.__call__

    def __init__(
        self, plate_name: str, sampling_method: SamplingMethod | None = None, n_samples: int = DEFAULT_N_SAMPLES
    ) -> None:
        super().__init__()
        if not isinstance(plate_name, str) or not plate_name:
            raise TypeError(
                f"{type(self).__name__}: the first argument is the plate name (a string), got "
                f"{plate_name!r}. Call it as {type(self).__name__}('z', n_samples=8)(distribution)."
            )
        self.plate_name = plate_name
        sampling_method, n_samples = proposal_arguments(
            f"{type(self).__name__}({plate_name!r})", sampling_method, n_samples
        )
        self.sampling_method = sampling_method if sampling_method is not None else MonteCarlo(plate_name, n_samples)
        # plain Monte Carlo draws and weights come from this method's proposal_dist and
        # weighting_function (the proposal's delegate; a reference, so the method still pickles)
        self.sampling_method.set_delegate(self)

    @property
    def n_samples(self) -> int:
        """The number of samples the proposal draws (see ``SamplingMethod.n_samples``)."""
        return self.sampling_method.n_samples

    # --------------------------------------------------------------- sampling
    def forward(self, distr: Distribution) -> StochasticTensor:
        return self._new_node(distr, self._draw)

    def _new_node(
        self, distr: Distribution, draw: Callable[[Distribution, PlateLayout], tuple[torch.Tensor, Plate, Sequence[Plate]]]
    ) -> StochasticTensor:
        """Check ``distr``, draw the node with ``draw(distr, parents)`` (storch dispatch disabled; it
        returns the plain samples, the node's plate and the samples' other plates), and make the node:
        its plate weight, the plates of lazily computed parameters, the unused-node bookkeeping."""
        if not isinstance(distr, Distribution):
            raise TypeError(
                f"{type(self).__name__}({self.plate_name!r}) samples a torch.distributions.Distribution, "
                f"got {type(distr).__name__}. Build the method with its plate name and call it on the "
                "distribution, e.g. ScoreFunction('z', n_samples=8)(q) (the manual's older form was "
                "method('z', q, n=8))."
            )
        facts = distribution_facts(distr)  # one pass over the distribution for the checks below
        _refuse_integer_parameters(facts.integer_parameters, distr, type(self).__name__, self.plate_name)
        self.check_distribution(distr)
        parents = facts.layout
        self._check_orders_needed_above(parents)
        tip = self._chain_tip(parents)
        if self.plate_name in parents.names and not (tip is not None and tip.name == self.plate_name):
            raise ValueError(
                f"{type(self).__name__}: the distribution's parameters already carry a plate named "
                f"{self.plate_name!r}; give this node another name."
            )
        if tip is None:  # a chain's next step adds no plate
            _check_room_for_a_plate(distr, parents, type(self).__name__, self.plate_name)
        try:
            with no_dispatch():
                samples, plate, others = draw(distr, parents)
        except RuntimeError as error:
            reraise_cuda_dimension_error(error, parents.plates, f"{type(self).__name__}({self.plate_name!r}) sampling")
            raise
        tensor = new_node(self, distr, samples, plate, others)
        weight = self._plate_weight(tensor, plate)
        if weight is not plate._weight or plate._weight_plates is not None:  # else it has that weight already
            plate.weight = weight
        # parameters computed while sampling with dispatch disabled: plated where the samples' graph may
        # hold them (relaxed, reparameterized), else forgotten (computed again, plated, if read)
        if samples.requires_grad:  # (the node's own flag; read on the plain samples, not through dispatch)
            restore_lazy_plates(distr, parents)
        else:
            forget_lazy_plain_values(distr, parents)
        if isinstance(plate, ChainPlate) and plate.ancestor is not None:
            # the node's distribution without the step it extended, as its samples are (copied when first read)
            node_of(tensor).step_of_chain(distr, 1 + parents.position(plate.ancestor))
        if not self.reparameterized and torch.is_grad_enabled() and facts.requires_grad:
            note_sampled(plate)  # its gradient needs a cost that carries its plate (see storch.backward)
        return tensor

    def order_needed_below(self, node: StochasticNode) -> int:
        """The derivative order to which the estimators of the nodes drawn from ``node``'s samples (this
        method's node) must be unbiased for this method's own estimate to be: ``0``, no requirement.
        `storch.method.gsb.GSB`'s continuous rules differentiate the downstream estimate in the sample."""
        return 0

    def _check_orders_needed_above(self, parents: PlateLayout) -> None:
        """Refuse to draw below a node whose estimator needs derivatives of this node's estimate that
        this estimator is not declared unbiased for (`storch.method.catalog`): the upper node's
        gradient would be silently wrong (GSB's Normal scale got a zero gradient below ARSM)."""
        for plate in parents.plates:
            node = plate.node
            needed = 0 if node is None else node.method.order_needed_below(node)
            if needed <= 1:
                continue
            from storch.method.catalog import highest_unbiased_order  # it lists every estimator class

            have = highest_unbiased_order(type(self))
            if have is not None and have < needed:
                above = f"{type(node.method).__name__}({node.name!r})"
                raise ValueError(
                    f"{type(self).__name__}({self.plate_name!r}) is drawn from the samples of {above}, "
                    f"which differentiates the estimate of every node below it {needed} times in its "
                    f"sample; {type(self).__name__}'s estimate is unbiased for derivatives up to order "
                    f"{have} only, so {node.name!r}'s gradient would be wrong. Use an estimator unbiased "
                    f"at order {needed} for {self.plate_name!r} (ScoreFunction, Expect, LocalExpectation, "
                    f"Reparameterization), or Reparameterization for {node.name!r}."
                )

    def _draw(self, distr: Distribution, parents: PlateLayout) -> tuple[torch.Tensor, Plate, Sequence[Plate]]:
        """The proposal's samples on a new plate over all the distribution's plates; a single sample
        starts or extends a single-sample chain (see `storch.plate.ChainPlate`)."""
        sampling = self._modules.get("sampling_method")  # not through nn.Module.__getattr__ (once per draw)
        if sampling is None:
            sampling = self.sampling_method
        samples = sampling(distr, parents.plates, self.reparameterized)
        self._check_samples(distr, samples, parents.sizes)
        if samples.shape[0] != 1 or not self._draws_chain_steps():
            return samples, Plate(self.plate_name, samples.shape[0], parents=parents.plates), parents.plates
        tip = _newest_tip(parents)
        if tip is None:
            return samples, ChainPlate(self.plate_name, parents=parents.plates), parents.plates
        others = tuple(p for p in parents.plates if p is not tip)
        if len(tip.parents) == len(others) and all(map(operator.is_, tip.parents, others)):
            others = tip.parents  # the previous step's own tuple: one object fewer per decision
        # the new step takes the tip's place: the tip's size-1 dimension is dropped
        return samples.select(1 + parents.position(tip), 0), tip.next_step(self.plate_name, others), others

    def _draws_chain_steps(self) -> bool:
        """Whether this method's nodes are steps of single-sample chains: one plain Monte Carlo sample,
        drawn and weighted as `Method` does (a method that overrides `proposal_dist` or
        `weighting_function` lays out its own evaluation points on its plate)."""
        cls = type(self)
        if not (
            self.extends_chains
            and cls.proposal_dist is Method.proposal_dist
            and cls.weighting_function is Method.weighting_function
        ):
            return False
        # the submodule read from _modules, not through nn.Module.__getattr__ (twice per decision of a rollout)
        sampling = self._modules.get("sampling_method")
        return type(sampling) is MonteCarlo and sampling.n_samples == 1

    def _chain_tip(self, parents: PlateLayout) -> Optional[ChainPlate]:
        """The newest chain step among ``parents`` that a node of this method extends, if any."""
        return _newest_tip(parents) if self._draws_chain_steps() else None

    def sample(self, distr: Distribution) -> StochasticTensor:
        """Sample ``distr`` with this method: the same as calling it, ``method(distr)``.

        The manual's (Storchastic's) name for drawing a node. It goes through ``nn.Module.__call__``,
        so forward hooks run and subclasses that override `forward` (sequence decoding, for
        example) are honoured.

        Examples:
            >>> import torch
            >>> from torch.distributions import Normal
            >>> from storch.method import Reparameterization
            >>> z = Reparameterization("z", n_samples=3).sample(Normal(torch.zeros(2), 1.0))
            >>> type(z).__name__, z.shape, z.plates[0].name
            ('StochasticTensor', torch.Size([3, 2]), 'z')
        """
        return self(distr)

    def _check_samples(self, distr: Distribution, samples: torch.Tensor, sizes: tuple[int, ...]) -> None:
        batch, event = distr.batch_shape, distr.event_shape
        if type(batch) is torch.Size and type(event) is torch.Size:
            expected = batch + event
        else:  # a distribution that gives its shapes as lists
            expected = tuple(batch) + tuple(event)
        shape = samples.shape
        if not shape or shape[1:] != expected:  # (a tuple's equality: the same length and sizes)
            expected = tuple(expected)
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): the proposal returned samples of shape "
                f"{tuple(samples.shape)}; expected (n, *batch_shape, *event_shape) = (n, {expected})."
            )

    def _plate_weight(self, tensor: StochasticTensor, plate: Plate) -> torch.Tensor:
        sampling = self._modules.get("sampling_method")
        if (  # the proposal's weights are this method's, and it keeps Method's (none): no call per draw
            type(sampling).weighting_function is SamplingMethod.weighting_function
            and sampling.mc_weighting_function is None
            and sampling.delegate is self
            and type(self).weighting_function is Method.weighting_function
        ):
            return plate.weight  # the uniform 1/n the plate was created with
        weight = self.sampling_method.weighting_function(tensor, plate)
        if weight is None:
            return plate.weight  # the uniform 1/n the plate was created with
        if isinstance(weight, Tensor):
            return weight
        samples = node_of(tensor).samples  # a plain weight follows the node's device and floating dtype
        weight = _on_device(weight, samples.device)
        if weight.is_floating_point():
            weight = weight.to(floating_dtype(tensor.distribution, samples))
        if weight.dim() == 0:
            return weight
        if tuple(weight.shape) != (plate.size,):
            raise ValueError(
                f"{type(self).__name__}({self.plate_name!r}): a plain weight tensor must be a scalar or "
                f"have shape ({plate.size},), one weight per sample; got {tuple(weight.shape)}. Return "
                "a storch tensor for weights that depend on other plates."
            )
        return wrap(weight, layout_of_plates((plate,)))  # a view: the plate keeps a copy (Plate.weight)

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
        return l, elementwise(operator.mul, elementwise(operator.sub, 1.0, magic_box(l)), a)

    def vectorises_chain(self, plates: PlateLayout) -> bool:
        """Whether the surrogate terms of this method's nodes along one single-sample chain, whose costs
        carry ``plates`` besides the chain, may be formed at once (`storch._chain_terms`): the
        estimator is ``l`` and ``(1 − □(l))·a`` (`estimator`), ``l`` does not depend on the costs, ``a``
        depends on the values of the reward to go only, and `update_parameters` does not read the
        ``(node, cost, term)`` triples (it then gets ``(node, None, None)`` per step). ``False`` here:
        the terms are formed step by step."""
        return False

    def chain_gradient_functions(
        self, nodes: Sequence[StochasticNode], plates: PlateLayout
    ) -> Optional[torch.Tensor]:
        """The gradient functions ``l_s`` of the steps ``nodes`` (oldest first) of a chain this method
        vectorises (see `vectorises_chain`), in one call: plain, ``(T, *sizes of plates, ...)``, called with
        storch's dispatch disabled. ``None`` (the default): `gradient_function` is called step by step."""
        return None

    def chain_control_variates(
        self, names: Sequence[str], to_go: torch.Tensor, plates: PlateLayout
    ) -> Optional[torch.Tensor]:
        """The control variates ``a_s`` of the steps of a chain this method vectorises (see
        `vectorises_chain`), oldest first, as a plain tensor that broadcasts against ``to_go``;
        ``None``: no control variate. ``to_go`` holds the detached reward to go of each step,
        ``(T, *sizes of plates)``; ``names[s]`` is the cost name step ``s``'s control variate is
        computed for (as ``control_variate``'s ``cost.name``)."""
        return None

    def on_joint_bound(self, cost_name: str, plate: Plate, log_w: Tensor, later: Sequence[Plate] = ()) -> None:
        """Called by `storch.method.iwae_bound` when the bound over this node's ``plate`` is
        registered as cost ``cost_name``, with the per-sample log-weights ``log_w``; ``later`` are
        the plates of reparameterized nodes sampled after this one. Does nothing by default."""

    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        """Called once after each `storch.backward` that used this method."""
        self.sampling_method.update_parameters(result_triples)

    def state_parts(self) -> dict[str, Any]:
        """The parts whose state joins the method's (see `storch.state`): its proposal."""
        return {"sampling_method": getattr(self, "sampling_method", None)}

    def reset(self) -> None:
        self.sampling_method.reset()

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, n_samples={self.n_samples}"


def _newest_tip(parents: PlateLayout) -> Optional[ChainPlate]:
    """The newest step among ``parents`` that is the tip of its single-sample chain, if any."""
    tip = None
    for p in parents.plates:
        if isinstance(p, ChainPlate) and p.is_tip and (tip is None or p.order > tip.order):
            tip = p
    return tip


class JointBoundRecords(DeclaresStepState):
    """Mixin for methods that estimate a joint bound over their samples (``handles_joint_bound``):
    the bounds that `Method.on_joint_bound` notes in ``self._bounds`` during a step (by cost name)
    are forgotten after it, so nothing carries over between steps. List it before the ``Method`` base.
    """

    handles_joint_bound = True
    #: the bounds noted in a step are cleared after it: nothing carries over
    step_state = StepState.NONE
    state_hooks = ("update_parameters",)
    _bounds: dict

    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        super().update_parameters(result_triples)  # type: ignore[misc]
        self._bounds.clear()

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        self._bounds.clear()
