"""The checks of eager mode that a replayed step keeps, as (exception type, message) pairs.

``torch.distributions`` argument validation and ``F.one_hot``'s range check read a value on the
host, which a graph cannot. In the trace (a real step) each check is decided on the real value, as
eagerly; for the replays it is kept in the graph: on the CPU as an assertion, which raises where
eager mode would; on other devices (an assertion there is asynchronous and ends the process) as a
boolean output read once per step with storch's finite-loss check (`all_ok`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode

from storch.distributions.one_hot import one_hot
from storch.tensor import plain

__all__ = ["ASSERTED_DEVICES", "Check", "CheckFailed", "DeferredChecks", "all_ok", "failed_assertions"]

#: devices whose checks are assertions in the graph (raising where eager mode does); elsewhere an
#: assertion is asynchronous and ends the process, so the check is an output read after the step
ASSERTED_DEVICES = frozenset({"cpu"})


@dataclass(frozen=True)
class Check:
    """A check of the step and the exception eager mode raises when it fails."""

    error: type[Exception]
    message: str
    #: eager mode's message names what the trace does not see (a distribution's parameter and
    #: constraint): on failure, the step is run eagerly for torch's own error
    rerun_for_message: bool = False

    def exception(self, note: str = "") -> Exception:
        return self.error(self.message + note)


class CheckFailed(Exception):
    """A check of a replay failed (raised by storch, caught by the compiled step)."""

    def __init__(self, check: Check) -> None:
        super().__init__(check.message)
        self.check = check


class DeferredChecks(TorchFunctionMode):
    """Keep the checks of ``torch.distributions`` and ``F.one_hot`` in the traced graph.

    A failure in the trace raises eager mode's error: torch's own ``ValueError`` for a validation
    (its ``_is_all_true`` is answered with the real value), storch's ``RuntimeError`` for
    ``F.one_hot``, which with ``num_classes`` given is computed by comparison with
    ``arange(num_classes)`` (the same result for indices in range, and no host read).

    Attributes:
        asserted: the checks that are assertions in the graph, by their assertion's message.
        deferred: ``(boolean tensor, check)`` of the checks read after the step.
    """

    def __init__(self, asserted_devices: frozenset) -> None:
        super().__init__()
        self.asserted_devices = asserted_devices
        self.asserted: dict[str, Check] = {}
        self.deferred: list[tuple[torch.Tensor, Check]] = []

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._is_all_true:
            return self._validation(plain(func(*args, **kwargs)))
        if func is F.one_hot:
            n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            if isinstance(n, int) and n >= 0:
                return self._one_hot(args[0], n)
        return func(*args, **kwargs)

    def _validation(self, valid: torch.Tensor) -> bool:
        """Answer torch's validation with the real outcome (a failure raises torch's own error)."""
        if not _holds(valid):
            return False
        self._keep(valid, Check(ValueError, (
            f"a torch.distributions argument validation failed (a check of shape {tuple(valid.shape)})"
        ), rerun_for_message=True))
        return True

    def _one_hot(self, index: torch.Tensor, n: int) -> torch.Tensor:
        check = Check(RuntimeError, f"F.one_hot: every class index must lie in [0, {n}) (num_classes={n})")
        valid = plain(((index >= 0) & (index < n)).all())
        if not _holds(valid):
            raise check.exception()
        self._keep(valid, check)
        return one_hot(index, n, torch.long)

    def _keep(self, valid: torch.Tensor, check: Check) -> None:
        if valid.device.type in self.asserted_devices:
            torch._assert_async(valid, check.message)
            self.asserted[check.message] = check
        else:
            self.deferred.append((valid, check))


def _holds(valid: torch.Tensor) -> bool:
    """The real outcome of a check in the trace (read without recording the read)."""
    with disable_proxy_modes_tracing():
        return bool(valid)


@contextmanager
def failed_assertions(asserted: dict[str, Check]) -> Iterator[None]:
    """Turn the error of a failed assertion in the graph into `CheckFailed` for its check."""
    try:
        yield
    except RuntimeError as error:
        check = asserted.get(str(error))
        if check is None:
            raise
        raise CheckFailed(check) from None


def all_ok(checks: list[torch.Tensor], losses: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """One boolean for every check of the step: validations hold and surrogate losses are finite."""
    flags = [c.reshape(()).bool() for c in checks] + [torch.isfinite(loss).reshape(()) for loss in losses]
    if not flags:
        device = params[0].device if params else None
        return torch.ones((), dtype=torch.bool, device=device)
    if len({f.device for f in flags}) > 1:
        flags = [f.cpu() for f in flags]
    return torch.stack(flags).all()
