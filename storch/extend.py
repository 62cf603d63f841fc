"""The interface for writing estimators and samplers: everything the in-tree ones use.

An estimator (`storch.method.Method`) or a proposal
(`storch.sampling.SamplingMethod`)
works on the plain tensors underneath storch's plated ones, says which plates its results carry,
and registers distribution-specific math. The estimators and samplers of ``storch.method`` and
``storch.sampling`` import the engine from here and nowhere else (``tests/test_extend.py`` checks
it), so this interface is proven by them; see ``docs/tutorials/writing-an-estimator.md``.

**Running torch without plates.** Inside ``with no_dispatch():`` operations on storch tensors run
as plain torch operations (no alignment, no wrapping, no plate checks); results are plain tensors.

**Tensors and plates.**

* ``layout_of(t)``: the `storch.plate.PlateLayout` of ``t`` (empty for plain tensors)
* ``plain(t)``: a plain ``torch.Tensor`` view of ``t`` (same autograd graph)
* ``wrap(t, layout)``: a storch view of ``t`` with ``layout`` (``t`` untouched)
* ``wrap_new(t, layout)``: make a fresh plain result, held by nobody else, a storch tensor (no view)
* ``new_node(method, distribution, samples, plate, parents)``: make plain samples a node on ``plate``
* ``node_of(t)``: the `storch.extend.StochasticNode` of samples: ``samples``, ``distribution``,
  ``method``, ``plate``, ``layout``, ``param_grads``
* ``layout_of_plates(plates)``: the (cached) layout of plates in the order given
* ``merge_layouts(layouts)``: the union of layouts, newest plate first
* ``align_to(t, layout)``: a view of ``t`` laid out for a larger layout (under ``no_dispatch``)
* ``expand_plain(t, layout)``: a plain tensor expanded to carry every plate of ``layout``
* ``plate_weight(plate)``: a plate's weight tensor, or ``None`` for the uniform ``1/size``
* ``reduce_plate(t, plate)``: the weighted sum of ``t`` over one plate
* ``distribution_layout(d)``: the union of the plates of a distribution's parameters
* ``get_distr_parameters(d)``: a distribution's parameters by name (those that require grad)
* ``has_parameters_requiring_grad(d)``: whether ``get_distr_parameters(d)`` is not empty (no dict built)
* ``distribution_facts(d)``: its layouts, whether a parameter requires a gradient and its integer
  parameters, in one pass (what a method checks before it draws)
* ``floating_dtype(d, samples)``: the floating dtype of a distribution's parameters (for weights)
* ``restore_lazy_plates(d)``: re-wrap lazily computed parameters (``probs`` from ``logits``)
* ``forget_lazy_plain_values(d)``: forget them instead (computed again, with plates, when read)
* ``log_prob_of_own_samples``: ``d.log_prob(samples)`` without re-validating samples ``d`` produced
* ``stacked_log_prob(nodes, plates)``: ``log p_t(x_t)`` of a single-sample chain's steps in one call
  from their parameters stacked (``None`` where the distributions do not allow it)
* ``with_nested(d)``: ``d`` and the distributions nested in it, outermost first
* ``note_sampled(plate)``: mark a node that must reach a cost (the unused-node warning)
* ``magic_box(l)``: ``exp(l - stopgrad(l))``: 1 in value, ``∇l`` in derivative (DiCE)
* ``elementwise(op, a, b)``: ``op(a, b)`` on the plain values when no plates need aligning (``a`` and
  ``b`` share their plates, or the other operand is a number or a plain tensor that broadcasts over
  the event dimensions), without the trip through storch's dispatch; otherwise dispatched
* ``rsample_gumbel_softmax``: a reparameterized Gumbel-softmax draw
* ``is_tracing()``: whether `storch.compile_step` is tracing the step (take no branch that reads
  a tensor's value on the host)
* ``StepState``, ``StateKind``, ``DeclaresStepState``, ``step_state_of``, ``check_replayable``: what an
  estimator keeps between steps (its class attribute ``step_state``: ``StepState.NONE``,
  ``StepState.IN_PLACE`` or ``StepState.host(reason)``) and the check that refuses ``HOST`` state in a
  compiled step (`storch.state`); overriding ``update_parameters`` (a baseline's
  ``update``) without declaring ``step_state`` in the same class body counts as ``HOST``

**Operations.** `storch.extend.register_operation` says how a function treats plates
(elementwise, joins,
dimension arguments, …) when it is not one of torch's that storch already knows.

**Registries.** Distribution-specific math is kept in `storch.extend.TypeRegistry` instances, each
filled
by one ``register_*`` function (most specific base class wins; ambiguity and double registration
are errors). All of them are made in `storch.registries` and available here:

* ``register_relaxation``: continuous relaxation of a discrete distribution (Gumbel, REBAR)
* ``register_cumulants``: cumulants for generalized stochastic backpropagation
* ``register_representation``: how GSB represents a distribution's samples
* ``register_gsb_rule``: a distribution's GSB rule
* ``register_measure_valued``: the measure-valued decomposition of a distribution (MVD)
* ``register_coordinates``: the coordinates local expectation enumerates
* ``register_one_hot_view``: the one-hot view straight-through estimators use
* ``register_spsa_wrapper``: how SPSA perturbs a distribution's parameters
* ``register_critic_inputs``: what a learned critic sees of a node
* ``register_wor_support``: the support enumerated by sampling without replacement
* ``register_relaxed_wor_value``: relaxed values of unordered sets (Gumbel-softmax without
  replacement)

The registries live in a low layer, below the estimators that fill them with their built-in entries
when they are imported (every estimator is imported with ``storch``); so estimator modules import
this module without a cycle, and an entry registered here before an estimator's import is kept.

Examples:
    A proposal-independent estimator written with this interface only: the score function
    ``E_q[f] ∇ log q`` with the log-probabilities computed on plain tensors:

    >>> import torch, storch
    >>> from torch.distributions import Bernoulli
    >>> from storch.extend import layout_of, log_prob_of_own_samples, no_dispatch, node_of, wrap_new
    >>> class PlainScore(storch.method.Method):
    ...     def gradient_function(self, tensor):
    ...         node = node_of(tensor)
    ...         with no_dispatch():
    ...             lp = log_prob_of_own_samples(node.distribution, node.samples)
    ...         return wrap_new(lp, layout_of(tensor))
    >>> _ = torch.manual_seed(0)
    >>> p = torch.tensor(0.3, requires_grad=True)
    >>> x = PlainScore("x", n_samples=20000)(Bernoulli(p))
    >>> storch.add_cost((x - 2.0) ** 2, "f")                # E f = 4 - 3p, d/dp = -3
    >>> _ = storch.backward()
    >>> abs(p.grad.item() + 3.0) < 0.15
    True
"""

from __future__ import annotations

from storch._dispatch import align_tensor as align_to
from storch._dispatch import expand_plain, no_dispatch, register_operation, union_of_layouts
from storch._stacked_log_prob import stacked_log_prob
from storch._step import note_sampled
from storch._tracing import EagerStepNeeded
from storch._tracing import active as is_tracing
from storch.state import DeclaresStepState, StateKind, StepState, check_replayable, step_state_of
from storch.plate import (
    MAX_PLATES,
    AncestralPlate,
    ChainPlate,
    Plate,
    PlateLayout,
    TooManyPlatesError,
    layout_of_plates,
    merge_layouts,
    order_plates,
    reraise_cuda_dimension_error,
)
from storch.reductions import plate_weight, reduce_plate
from storch.registries import (
    register_coordinates,
    register_critic_inputs,
    register_cumulants,
    register_gsb_rule,
    register_measure_valued,
    register_one_hot_view,
    register_relaxation,
    register_relaxed_wor_value,
    register_representation,
    register_spsa_wrapper,
    register_wor_support,
)
from storch.registry import AmbiguousLookupError, DuplicateRegistrationError, TypeRegistry, ambiguity_message
from storch.tensor import (
    CostTensor,
    IndependentTensor,
    StochasticNode,
    StochasticTensor,
    Tensor,
    alias,
    layout_of,
    new_node,
    node_of,
    plain,
    wrap,
    wrap_new,
)
from storch.util import (
    DistributionFacts,
    copy_distribution,
    distribution_facts,
    distribution_layout,
    elementwise,
    floating_dtype,
    forget_lazy_plain_values,
    get_distr_parameters,
    has_parameters_requiring_grad,
    log_prob_of_own_samples,
    magic_box,
    restore_lazy_plates,
    rsample_gumbel_softmax,
    with_nested,
    without_plate,
)

__all__ = [
    "no_dispatch",
    # tensors and plates
    "Tensor",
    "StochasticTensor",
    "CostTensor",
    "IndependentTensor",
    "StochasticNode",
    "Plate",
    "AncestralPlate",
    "ChainPlate",
    "PlateLayout",
    "layout_of",
    "node_of",
    "new_node",
    "plain",
    "alias",
    "wrap",
    "wrap_new",
    "layout_of_plates",
    "merge_layouts",
    "union_of_layouts",
    "order_plates",
    "align_to",
    "expand_plain",
    "plate_weight",
    "reduce_plate",
    "distribution_layout",
    "get_distr_parameters",
    "DistributionFacts",
    "distribution_facts",
    "has_parameters_requiring_grad",
    "floating_dtype",
    "restore_lazy_plates",
    "forget_lazy_plain_values",
    "log_prob_of_own_samples",
    "stacked_log_prob",
    "copy_distribution",
    "with_nested",
    "without_plate",
    "note_sampled",
    "reraise_cuda_dimension_error",
    "MAX_PLATES",
    "TooManyPlatesError",
    # surrogate-loss helpers
    "magic_box",
    "elementwise",
    "rsample_gumbel_softmax",
    # storch.compile_step
    "is_tracing",
    "EagerStepNeeded",
    "StepState",
    "StateKind",
    "DeclaresStepState",
    "step_state_of",
    "check_replayable",
    # operations
    "register_operation",
    # registries
    "TypeRegistry",
    "AmbiguousLookupError",
    "DuplicateRegistrationError",
    "ambiguity_message",
    "register_relaxation",
    "register_cumulants",
    "register_representation",
    "register_gsb_rule",
    "register_measure_valued",
    "register_coordinates",
    "register_one_hot_view",
    "register_spsa_wrapper",
    "register_critic_inputs",
    "register_wor_support",
    "register_relaxed_wor_value",
]
