"""Pure per-coordinate derivatives ``∂ⁿf/∂z_jⁿ`` of a cost, for every coordinate ``j``, by autograd.

Generalized stochastic backpropagation (`storch.method.gsb`) needs, for a sample ``z`` of ``D``
coordinates and a cost ``f``, the pure derivatives ``∂ⁿf/∂z_jⁿ`` for ``n = 1..N`` and all ``j`` (not the
full derivative tensors). They come from one vector-Jacobian product per order:

* ``g₁ = ∂(Σ_b u_b f_b)/∂z`` is one ordinary VJP (``u`` weights the cost elements);
* ``g_n = diag_j ∂g_{n−1}[·, j]/∂z[·, j]``: one *batched* VJP (``is_grads_batched``) whose ``D``
  grad-outputs are the one-hot vectors ``e_j``, each broadcast over the independent leading (plate)
  dimensions of ``z``; entry ``j`` of the ``j``-th result is the next pure derivative.

The one-hot vectors are broadcast over the plate dimensions because costs of different plate
elements are independent: ``g_{n−1}[p, ·]`` depends on ``z[p, ·]`` only. A cost that couples
different plate elements (e.g. a ``logsumexp`` over the samples of the node) breaks this assumption.

Cost and the probe fallback. The graph of ``g_n`` is itself batched ``D`` times, so the exact batched
VJP of order ``n`` works on ``D^{n−1}`` copies of the cost's graph: fine for order 2 (``D`` copies) or
few coordinates, exponential beyond. Orders with ``D^{n−1} > max_exact_batch`` (default 256) are
therefore *estimated*: with a fresh random-sign vector ``s`` (independent per order and element),
``ĝ_n[l] = s_l Σ_j s_j ∂ĝ_{n−1}[j]/∂z_l`` is one plain VJP, and ``E_s ĝ_n[l] = ∂ĝ_{n−1}[l]/∂z_l``
(``E[s_l s_j] = δ_{lj}``), so by induction ``E ĝ_n = ∂ⁿf/∂z_jⁿ``: unbiased, with extra variance from the
mixed partials. Everything is then ``N`` backward passes, each at most ``D`` times one VJP.

Examples:
    >>> import torch
    >>> z = torch.tensor([[1.0, 2.0], [0.5, -1.0]], requires_grad=True)   # 2 samples × 2 coordinates
    >>> f = (z**3).sum(-1) + z[:, 0] * z[:, 1]
    >>> [d.tolist() for d in pure_derivatives(f, z, 3, n_plate_dims=1)]
    [[[5.0, 13.0], [-0.25, 3.5]], [[6.0, 12.0], [3.0, -6.0]], [[6.0, 6.0], [6.0, 6.0]]]
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["NoDifferentiablePath", "pure_derivatives"]


class NoDifferentiablePath(ValueError):
    """The output does not depend differentiably on the leaf."""


def pure_derivatives(
    output: torch.Tensor,
    leaf: torch.Tensor,
    order: int,
    n_plate_dims: int = 0,
    grad_outputs: Optional[torch.Tensor] = None,
    max_exact_batch: int = 256,
    generator: Optional[torch.Generator] = None,
) -> list[torch.Tensor]:
    """``[∂ⁿ(Σ_b u_b output_b)/∂leaf_{p,j}ⁿ for n = 1..order]``, each shaped like ``leaf``, detached.

    Orders ``n`` with ``D^{n−1} ≤ max_exact_batch`` are exact; from the first order beyond it, each
    order is an unbiased random-probe estimate (see the module docstring).

    Args:
        output: a plain tensor computed from ``leaf`` (its graph is kept for later backward passes).
        leaf: the tensor to differentiate with respect to (requires grad).
        order: the highest order ``N ≥ 1``.
        n_plate_dims: how many leading dimensions of ``leaf`` index independent problems (plates);
            the remaining dimensions are the coordinates ``j`` (``D`` = their product).
        grad_outputs: the weights ``u`` of the output elements (default: ones).
        max_exact_batch: the largest physical batch ``D^{n−1}`` allowed for an exact order ``n``.
        generator: random generator of the probes (default: torch's global one).

    Raises:
        NoDifferentiablePath: ``output`` does not depend on ``leaf`` through differentiable operations.
    """
    if order < 1:
        raise ValueError(f"pure_derivatives: order must be at least 1, got {order}.")
    shape = tuple(leaf.shape)
    plates, coords = shape[:n_plate_dims], shape[n_plate_dims:]
    n_coords = math.prod(coords)
    with torch.enable_grad():
        if not output.requires_grad:
            raise NoDifferentiablePath("the output does not require grad")
        u = torch.ones_like(output) if grad_outputs is None else grad_outputs.to(output.dtype).expand(output.shape)
        (g,) = torch.autograd.grad(output, leaf, u, retain_graph=True, create_graph=order > 1, allow_unused=True)
        if g is None:
            raise NoDifferentiablePath("the output does not depend on the leaf")
        results = [g.detach()]
        if order == 1:
            return results
        eye = torch.eye(n_coords, dtype=leaf.dtype, device=leaf.device)
        eye = eye.reshape((n_coords,) + (1,) * len(plates) + coords).expand((n_coords,) + shape)
        exact = True
        for n in range(2, order + 1):
            h = None
            exact = exact and (n_coords == 1 or n_coords ** (n - 1) <= max_exact_batch)
            if g.requires_grad:
                create = n < order
                if n_coords == 1:
                    (h,) = torch.autograd.grad(
                        g, leaf, torch.ones_like(g), retain_graph=True, create_graph=create, allow_unused=True
                    )
                elif exact:  # one VJP batched over the D one-hot cotangents; keep the diagonal
                    (h,) = torch.autograd.grad(
                        g, leaf, eye, retain_graph=True, create_graph=create, allow_unused=True,
                        is_grads_batched=True,
                    )
                    if h is not None:
                        h = h.reshape((n_coords, math.prod(plates), n_coords)).diagonal(0, 0, 2).reshape(shape)
                else:  # a random-sign probe s: s_l Σ_j s_j ∂g_j/∂z_l has expectation ∂g_l/∂z_l
                    s = torch.randint(0, 2, shape, generator=generator, device=leaf.device).to(leaf.dtype) * 2 - 1
                    (h,) = torch.autograd.grad(g, leaf, s, retain_graph=True, create_graph=create, allow_unused=True)
                    if h is not None:
                        h = h * s
            if h is None:  # the previous derivative is constant: all higher ones vanish
                zeros = torch.zeros_like(leaf).detach()
                results.extend(zeros for _ in range(n, order + 1))
                break
            g = h
            results.append(g.detach())
    return results
