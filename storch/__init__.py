"""storch: automatic differentiation of stochastic computation graphs for PyTorch.

Write the model as a generative story, choose a gradient estimator at each sampling step
(``storch.method``), register costs with `storch.add_cost`, and call `storch.backward`.

Examples:
    >>> import torch, storch
    >>> from torch.distributions import Normal
    >>> c = torch.tensor(0.23, requires_grad=True)
    >>> e = storch.method.Reparameterization("e", n_samples=1000)(Normal(c - 3.0, 1.0))
    >>> storch.add_cost(2.0 * e * e, "f")
    >>> _ = storch.backward()
    >>> abs(c.grad.item() - 4 * (c.item() - 3.0)) < 1.0   # d/dc E[2 e^2] = 4 (c - 3) = -11.08
    True
"""

from storch import distributed, distributions, exceptions, extend, method, nn, sampling, util
from storch.inference import add_cost, backward, registered_costs, reset, surrogate_loss
from storch.distributions.relaxation import conditional_gumbel_rsample
from storch.ops import cat, expand_as, gather, grad
from storch.plate import Plate, order_plates
from storch.reductions import denote_independent, gather_samples, logsumexp, mean, reduce_plates, sum, variance
from storch.tensor import CostTensor, IndependentTensor, StochasticTensor, Tensor, is_storch, is_tensor
from storch.exceptions import IllegalStorchExposeError
from storch.wrappers import deterministic, make_left_broadcastable, reduce, stochastic
from storch import storch  # the manual's storch.storch module of utilities
from storch import compiler
from storch.compiler import compile  # noqa: A004 - torch.compile with storch's frames left eager
from storch.compiled_step import compile_step

__version__ = "1.0.0"

__all__ = [
    "Tensor", "StochasticTensor", "CostTensor", "IndependentTensor", "Plate", "is_storch", "is_tensor",
    "IllegalStorchExposeError",
    "add_cost", "backward", "surrogate_loss", "reset", "registered_costs",
    "denote_independent", "gather_samples", "reduce_plates", "variance", "mean", "sum", "logsumexp",
    "cat", "gather", "expand_as", "grad", "order_plates", "conditional_gumbel_rsample",
    "deterministic", "reduce", "make_left_broadcastable", "stochastic",
    "method", "sampling", "nn", "util", "exceptions", "distributed", "compile", "compiler", "compile_step",
]

compiler.skip_storch_frames()  # storch's own frames run eagerly under torch.compile (storch.compiler)
