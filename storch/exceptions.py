"""Exceptions raised by storch."""

__all__ = [
    "CompileStepError", "IllegalStorchExposeError", "NonFiniteCostError", "RelaxedSampleError", "StaleCostError",
    "UnusedNodeWarning",
]


class IllegalStorchExposeError(ValueError):
    """A storch tensor's samples were exposed as one plain value, or plain values where storch tensors were required.

    Raised by ``bool(t)`` (so ``if t:``), ``t.item()``, ``float(t)``, ``int(t)`` and ``t.tolist()`` on a
    tensor that holds several samples along a plate (reduce the plates first, e.g. with
    [`storch.reduce_plates`][storch.reduce_plates]), and by [`storch.deterministic`][storch.deterministic]
    when a wrapped function returns a plain tensor or loses an input plate. A `ValueError`, so code that
    catches torch's own "ambiguous truth value" error keeps working.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NonFiniteCostError(ValueError):
    """[`storch.backward`][storch.backward] found a cost (or the surrogate loss) that is NaN or infinite.

    Raised before anything is differentiated: no ``.grad`` is touched, no baseline or method state
    is updated, and the cost registry is cleared.
    """


class RelaxedSampleError(ValueError):
    """A distribution's ``log_prob`` got the relaxed samples of a node (Gumbel-softmax, REBAR's relaxed
    points), which lie outside its discrete support. The message names the node, the estimator that
    relaxes it and the fix ([`StochasticTensor.log_prob`][storch.tensor.StochasticTensor.log_prob]).
    A `ValueError`, as torch's own validation error."""


class StaleCostError(ValueError):
    """The registered costs mix stochastic nodes of two different steps (a leftover cost)."""


class UnusedNodeWarning(UserWarning):
    """A score-function-like node whose parameters require grad appears in no registered cost."""


class CompileStepError(RuntimeError):
    """[`storch.compile_step`][storch.compile_step] cannot turn a step into one fixed graph without changing what it
    computes: the step reads a tensor's value on the host (an ``if`` on a tensor, ``.item()``), uses
    an estimator that keeps state between steps, captures a tensor that requires grad from outside
    the given modules, or returns a storch tensor. The message names what and where; the step still
    runs eagerly."""
