"""Data-parallel training: keep the state that storch's methods own identical on every rank.

Under ``torch.distributed`` (processes started by ``torchrun``, the model wrapped in
`torch.nn.parallel.DistributedDataParallel`), each rank runs the whole generative story on
its own slice of the minibatch and draws its own samples; ``storch.backward()`` gives each rank the
gradient of its local estimate and DDP averages the model's gradients across ranks. Some state is
not the model's, and DDP does not see it:

* methods with parameters and an optimizer of their own (`storch.method.RELAX`,
  `storch.method.REBAR`, `storch.method.LAX`) average their parameters' gradients across ranks
  (`storch.distributed.all_reduce_gradients_`) before their optimizer steps, and broadcast the
  parameters of rank 0 at their first step, so all replicas hold the same control variate;
* `storch.method.baseline.MovingAverageBaseline` averages the batch mean of the cost across
  ranks before it updates (``sync=True``, the default), so its value is global.

Both happen only while `storch.distributed.syncing` is true: a process group with more than one rank is
initialised, and the code does not run inside `storch.distributed.local_only` (e.g. a probe that only
rank 0
runs: a collective that the other ranks never join would wait for ever). Each method also takes
``sync=False`` to opt out. Every collective works on the tensors' own device and dtype, so gloo
(CPU) and NCCL (GPU) both work.

Example (one process: nothing to synchronise, and every helper is a no-op):
    >>> import torch
    >>> from storch import distributed
    >>> distributed.is_initialized(), distributed.world_size(), distributed.rank(), distributed.syncing()
    (False, 1, 0, False)
    >>> g = [torch.tensor([1.0, 2.0])]
    >>> distributed.all_reduce_mean_(g)
    [tensor([1., 2.])]
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from datetime import timedelta
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

__all__ = [
    "is_initialized", "world_size", "rank", "is_main_process", "syncing", "local_only",
    "all_reduce_mean_", "all_reduce_gradients_", "broadcast_", "synchronise_replicas_", "exclude_methods_from_ddp",
    "init_process_group_from_env", "default_backend",
]

_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("storch_distributed_local_only", default=False)


def _dist():
    import torch.distributed as dist

    return dist


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default process group is initialised."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    """The number of ranks (1 without a process group)."""
    return _dist().get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    """This process's rank (0 without a process group)."""
    return _dist().get_rank(group) if is_initialized() else 0


def is_main_process() -> bool:
    """Whether this is rank 0 (or the only process): the one that prints and writes files."""
    return rank() == 0


def syncing(group=None) -> bool:
    """Whether storch's own collectives run now: more than one rank, and not inside
    `storch.distributed.local_only`."""
    return not _LOCAL.get() and world_size(group) > 1


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """Within this block storch runs no collective: methods and baselines update from this rank alone.

    Use it for work that not every rank does, such as an evaluation or a gradient-variance probe
    on rank 0 that calls `storch.backward` (a collective that the other ranks never join
    would block). It does not affect DDP, whose hooks fire only after a forward pass of the
    wrapped module.

    Examples:
        >>> from storch import distributed
        >>> with distributed.local_only():
        ...     distributed.syncing()
        False
    """
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


def _groups(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), in order of first appearance."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _check_floating(tensors: Sequence[torch.Tensor], what: str) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"storch.distributed.{what}: expected tensors, got {type(t).__name__}.")
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"storch.distributed.{what}: a mean needs floating-point tensors, got dtype {t.dtype}; "
                "convert it first (e.g. t.float())."
            )


def all_reduce_mean_(tensors: Sequence[torch.Tensor], group=None) -> Sequence[torch.Tensor]:
    """Replace each tensor, in place, by its mean over the ranks; returns ``tensors``.

    The tensors are packed into one flat buffer per (device, dtype), so a list of many small
    tensors costs one collective per kind. Every rank must pass tensors of the same shapes, dtypes
    and order. Without `storch.distributed.syncing` (one process, or inside
    `storch.distributed.local_only`) nothing happens.
    """
    tensors = list(tensors)
    _check_floating(tensors, "all_reduce_mean_")
    if not tensors or not syncing(group):
        return tensors
    dist = _dist()
    n = world_size(group)
    with torch.no_grad():
        for indices in _groups(tensors).values():
            members = [tensors[i] for i in indices]
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(n)
            for t, chunk in zip(members, flat.split([t.numel() for t in members])):
                t.copy_(chunk.view_as(t))
    return tensors


def synchronise_replicas_(params: Sequence[torch.Tensor], first: bool, group=None) -> None:
    """Keep parameters that a method trains itself identical on every rank, before its optimizer step.

    At the ``first`` step rank 0's values are copied to every rank (`storch.distributed.broadcast_`;
    replicas may
    have been initialised differently), then the gradients are averaged
    (`storch.distributed.all_reduce_gradients_`).
    Every rank must call it at the same steps with the same parameters. Without `storch.distributed.syncing`
    nothing happens.

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.tensor([3.0, 4.0])
        >>> synchronise_replicas_([p], first=True); p.grad     # one process: unchanged
        tensor([3., 4.])
    """
    if first:
        broadcast_(params, group=group)
    all_reduce_gradients_(params, group=group)


def all_reduce_gradients_(params: Iterable[torch.Tensor], group=None) -> None:
    """Average the ``.grad`` of ``params`` over the ranks, in place (as DDP does for a model).

    A rank where a parameter has no gradient (``.grad is None``) contributes zeros; a parameter
    that has no gradient on any rank keeps ``.grad = None`` everywhere, so an optimizer skips it on
    every rank alike. Every rank must pass the same parameters in the same order. Without
    `storch.distributed.syncing` nothing happens.

    Example (one process: gradients unchanged):
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.tensor([3.0, 4.0])
        >>> all_reduce_gradients_([p]); p.grad
        tensor([3., 4.])
    """
    params = list(params)
    if not params or not syncing(group):
        return
    dist = _dist()
    n = world_size(group)
    _check_floating(params, "all_reduce_gradients_")
    with torch.no_grad():
        for indices in _groups(params).values():
            members = [params[i] for i in indices]
            # the gradients, then one flag per parameter: does this rank have a gradient for it?
            pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in members]
            flags = torch.tensor(
                [float(p.grad is not None) for p in members], device=members[0].device
            ).to(members[0].dtype)
            flat = torch.cat(pieces + [flags])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            sizes = [p.numel() for p in members] + [len(members)]
            *chunks, summed_flags = flat.split(sizes)
            for p, chunk, flag in zip(members, chunks, summed_flags.tolist()):
                p.grad = (chunk / n).view_as(p).clone() if flag > 0 else None


def broadcast_(tensors: Sequence[torch.Tensor], src: int = 0, group=None) -> Sequence[torch.Tensor]:
    """Overwrite each tensor, in place, with its value on rank ``src``; returns ``tensors``.

    Without `storch.distributed.syncing` nothing happens.
    """
    tensors = list(tensors)
    if not tensors or not syncing(group):
        return tensors
    dist = _dist()
    with torch.no_grad():
        for indices in _groups(tensors).values():
            members = [tensors[i] for i in indices]
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            dist.broadcast(flat, src=src, group=group)
            for t, chunk in zip(members, flat.split([t.numel() for t in members])):
                t.copy_(chunk.view_as(t))
    return tensors


def exclude_methods_from_ddp(model: nn.Module) -> list[str]:
    """Tell DDP to leave alone the parameters and buffers of the storch methods inside ``model``.

    Call it *before* wrapping ``model`` in ``DistributedDataParallel``. The parameters of RELAX,
    REBAR and LAX never receive a gradient from the main backward pass (their own optimizer
    trains them, and they synchronise themselves), so DDP would wait for them and fail at the
    next step ("Expected to have finished reduction in the prior iteration"). Methods kept outside
    the wrapped module need nothing. Returns the names it excluded.

    Examples:
        >>> import torch
        >>> from storch.method import RELAX
        >>> model = torch.nn.Module()
        >>> model.net = torch.nn.Linear(2, 1)
        >>> model.method = RELAX("z", control_variate=torch.nn.Linear(2, 1))
        >>> exclude_methods_from_ddp(model)
        ['method.log_temperature', 'method.network.weight', 'method.network.bias']
    """
    from torch.nn.parallel import DistributedDataParallel

    names: list[str] = []
    for prefix, module in model.named_modules():
        if getattr(type(module), "is_storch_method", False):  # storch.method.Method (a higher layer)
            dotted = f"{prefix}." if prefix else ""
            names += [dotted + name for name, _ in module.named_parameters()]
            names += [dotted + name for name, _ in module.named_buffers()]
    names = list(dict.fromkeys(names))  # a method inside a method: its names once
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, existing + names)
    return names


def default_backend() -> str:
    """``"nccl"`` when CUDA and NCCL are available, else ``"gloo"`` (CPU)."""
    dist = _dist()
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init_process_group_from_env(backend: Optional[str] = None, timeout_s: float = 1800.0) -> bool:
    """Join the process group that ``torchrun`` describes in the environment; ``True`` if joined.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``env://``), as set by
    ``torchrun --nproc-per-node N ...``. Does nothing (and returns ``False``) if a group exists
    already. With ``backend=None``: NCCL when CUDA is available, else gloo. With NCCL, the CUDA
    device of ``LOCAL_RANK`` becomes the current device.

    Raises:
        RuntimeError: the variables are missing (the script was not started by ``torchrun``).
    """
    dist = _dist()
    if not dist.is_available():
        raise RuntimeError("storch.distributed: this torch build has no torch.distributed.")
    if dist.is_initialized():
        return False
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"storch.distributed: {', '.join(missing)} not set; start the processes with torchrun, e.g. "
            "`torchrun --standalone --nproc-per-node 2 -m storch.bench --distributed ...` "
            "(see docs/scaling.md)."
        )
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return True
