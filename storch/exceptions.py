"""Exceptions raised by storch."""

__all__ = ["IllegalStorchExposeError", "NonFiniteCostError", "StaleCostError", "UnusedNodeWarning"]


class IllegalStorchExposeError(Exception):
    """A function exposed plain torch values where storch tensors were required."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NonFiniteCostError(ValueError):
    """:func:`storch.backward` found a cost (or the surrogate loss) that is NaN or infinite.

    Raised before anything is differentiated: no ``.grad`` is touched, no baseline or method state
    is updated, and the cost registry is cleared.
    """


class StaleCostError(ValueError):
    """The registered costs mix stochastic nodes of two different steps (a leftover cost)."""


class UnusedNodeWarning(UserWarning):
    """A score-function-like node whose parameters require grad appears in no registered cost."""
