"""The inputs of a compiled step: its arguments, its modules' state, and the key of a trace.

A traced graph is reused while its key is the same: the structure, shapes, dtypes and devices of the
arguments and of the modules' state, the non-tensor arguments' values, and the modules' Python
settings (`settings`), which a trace bakes in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from storch.exceptions import CompileStepError
from storch.tensor import Tensor as StorchTensor

__all__ = ["Inputs", "Slots", "cache_key", "flat_arguments", "module_state", "refuse_changed_settings", "settings"]

_SETTING_TYPES = (bool, int, float, str, type(None))

#: the ``(module, attribute name)`` places where a parameter or buffer sits, with the tensor
Slots = list[tuple[tuple[tuple[nn.Module, str], ...], torch.Tensor]]


@dataclass
class Inputs:
    """The graph's inputs, in its order: the modules' state, the incoming ``.grad``, the arguments."""

    trainable: list[torch.Tensor]
    incoming_grads: list[torch.Tensor]
    frozen: list[torch.Tensor]
    buffers: list[torch.Tensor]
    arguments: list[torch.Tensor]

    @classmethod
    def of(cls, params: Slots, buffers: Slots, leaves: list) -> Inputs:
        return cls(
            trainable=[p for _, p in params if p.requires_grad],
            incoming_grads=[p.grad for _, p in params if p.requires_grad and p.grad is not None],
            frozen=[p for _, p in params if not p.requires_grad],
            buffers=[b for _, b in buffers],
            arguments=[leaf for leaf in leaves if isinstance(leaf, torch.Tensor)],
        )

    def as_args(self) -> tuple[list, ...]:
        return self.trainable, self.incoming_grads, self.frozen, self.buffers, self.arguments

    def state(self) -> list[torch.Tensor]:
        """The modules' tensors a step may update in place: parameters, then buffers."""
        return self.trainable + self.frozen + self.buffers

    def placeholder_kinds(self) -> list[tuple[str, int]]:
        """``(kind, index)`` of each graph input, in the graph's order; kind ``"state"`` indexes `state`."""
        n_trainable, n_frozen = len(self.trainable), len(self.frozen)
        return ([("state", i) for i in range(n_trainable)] + [("grad", i) for i in range(len(self.incoming_grads))]
                + [("state", n_trainable + i) for i in range(n_frozen + len(self.buffers))]
                + [("argument", i) for i in range(len(self.arguments))])


def flat_arguments(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """The leaves and structure of the step's arguments; storch tensors and tensors that require grad
    are refused."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, StorchTensor):
            raise CompileStepError(
                "storch.compile_step: an argument is a storch tensor (plates "
                f"{leaf.plate_names}); its plates belong to another step. Pass plain tensors and "
                "make storch tensors inside the step (storch.denote_independent, a method)."
            )
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            raise CompileStepError(
                f"storch.compile_step: an argument of shape {tuple(leaf.shape)} requires grad; a "
                "compiled step computes gradients for the parameters of the modules given to "
                "compile_step only. Register it as a parameter of one of them, or detach it."
            )
    return leaves, spec


def module_state(modules: Sequence[nn.Module]) -> tuple[Slots, Slots]:
    """The modules' parameters and buffers, each once, with every slot it fills."""
    found: dict[str, dict[int, tuple[list, torch.Tensor]]] = {"_parameters": {}, "_buffers": {}}
    for module in modules:
        for owner in module.modules():
            for kind, table in found.items():
                for name, value in getattr(owner, kind).items():
                    if value is not None:
                        table.setdefault(id(value), ([], value))[0].append((owner, name))
    return (
        [(tuple(slots), value) for slots, value in found["_parameters"].values()],
        [(tuple(slots), value) for slots, value in found["_buffers"].values()],
    )


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _tensor_key(leaf)
    try:
        hash(leaf)
    except TypeError:
        raise CompileStepError(
            f"storch.compile_step: a non-tensor argument of type {type(leaf).__name__} is "
            "not hashable; non-tensor arguments are part of the traced graph (a new value "
            "is a new trace), so they must be hashable values (numbers, strings, tuples)."
        ) from None
    return (type(leaf), leaf)


def cache_key(leaves: list, spec: Any, params: Slots, buffers: Slots, module_settings: tuple) -> tuple:
    """What a trace depends on besides the values of tensors (see the module's docstring)."""
    return (
        spec,
        tuple(_leaf_key(leaf) for leaf in leaves),
        tuple((len(slots), _tensor_key(p), _tensor_key(p.grad)) for slots, p in params),
        tuple((len(slots), _tensor_key(b)) for slots, b in buffers),
        torch.is_grad_enabled(),
        torch.distributions.Distribution._validate_args,
        torch.get_default_dtype(),
        module_settings,
    )


def settings(modules: Sequence[nn.Module]) -> tuple:
    """The modules' Python settings a trace bakes in: ``training`` (``.eval()`` changes dropout and
    batch norm), every attribute that holds a number, a string or ``None`` (a temperature, a
    number of samples, a KL weight kept on the model), and what a module's
    ``prepare_compiled_step()`` returns (called first: it may build the module's lazy state)."""
    found = []
    for module in modules:
        for owner in module.modules():
            prepare = getattr(owner, "prepare_compiled_step", None)
            extra = tuple(prepare()) if callable(prepare) else ()
            found.append(tuple((k, v) for k, v in vars(owner).items() if type(v) in _SETTING_TYPES) + extra)
    return tuple(found)


def refuse_changed_settings(modules: Sequence[nn.Module], before: tuple, after: tuple) -> None:
    """A step that changes its modules' Python settings would change them only when traced."""
    if after == before:
        return
    owners = [owner for module in modules for owner in module.modules()]
    for owner, old, new in zip(owners, before, after):
        if old != new:
            changed = sorted(set(old) ^ set(new))
            names = sorted({name for name, _ in changed})
            raise CompileStepError(
                f"storch.compile_step: the step changes the Python settings {names} of its module "
                f"{type(owner).__name__} ({[c for c in changed if c in set(old)]} -> "
                f"{[c for c in changed if c in set(new)]}); a replay runs no Python, so they would stay "
                "as the trace left them. Keep values that change between steps in tensors (buffers) or "
                "pass them as arguments of the step."
            )
