"""Test problems shared by the estimator tests, each with its exact expectation by enumeration.

Every problem holds its parameters, builds the storch model (``model(...)`` returns the function
that :func:`storch.testing.replicated_gradients` calls with the replicated parameters: it samples
with the given method(s) and registers the cost ``"f"``), and gives the exact expectation
``Σ_x p(x) f(x)`` as a differentiable function of the parameters, so that ``exact()`` (autograd of
the enumeration) is the value the estimates must match. The builders slice one set of constants,
so a problem of a given size has the same numbers in every test file.

* :func:`one_categorical`: one categorical node, ``f = g(v_z)`` (``g(v) = v²`` by default);
* :func:`nested_categorical`: two nested categorical nodes, ``f = table[z₁, z₂]``;
* :func:`bernoulli`: three Bernoulli variables in one node, a quadratic cost (and an interaction);
* :func:`minibatch_bernoulli`: a logistic model, two Bernoulli variables per data point of a plate;
* :func:`minibatch_categorical`: a softmax regression, one categorical per data point of a plate;
* :func:`nested_bernoulli`: two nested two-bit Bernoulli nodes, one cost of both;
* :func:`two_costs`: two Bernoulli nodes, two costs with different ancestors.

Also :func:`enumerate_bernoulli` (``Σ_x p(x) f(x)`` over independent bits), :func:`exact_grads`
and :func:`replicated_hessians` (independent Hessian estimates from one backward pass).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.distributions import Bernoulli, Categorical, OneHotCategorical

import storch
from storch.testing import assert_unbiased, replicate, replicated_gradients

Tensor = torch.Tensor
Model = Callable[..., None]
Check = Callable[[Tensor], None] | None

__all__ = [
    "BernoulliBits", "MinibatchBernoulli", "MinibatchCategorical", "NestedBernoulli", "NestedCategorical",
    "OneCategorical", "TwoCosts", "bernoulli", "enumerate_bernoulli", "exact_grads", "minibatch_bernoulli",
    "minibatch_categorical", "nested_bernoulli", "nested_categorical", "one_categorical", "replicated_hessians",
    "two_costs",
]


# ---------------------------------------------------------------- exact values and harness helpers
def exact_grads(expectation: Callable[..., Tensor], params: list[Tensor]) -> tuple[Tensor, ...]:
    """The gradient of ``expectation(*params)`` with respect to each parameter (autograd)."""
    leaves = [p.clone().requires_grad_() for p in params]
    return torch.autograd.grad(expectation(*leaves), leaves)


def enumerate_bernoulli(probs: Tensor, f: Callable[[Tensor], Tensor]) -> Tensor:
    """``Σ_x p(x) f(x)`` over the ``2^D`` values of ``D`` independent Bernoulli variables.

    ``probs`` holds the success probabilities in its last dimension ``D`` (leading dimensions, e.g.
    data points, are kept); ``f`` gets one value ``x`` of shape ``(D,)`` in the dtype of ``probs``.
    """
    total = 0.0
    for values in itertools.product([0.0, 1.0], repeat=probs.shape[-1]):
        x = torch.tensor(values, dtype=probs.dtype)
        total = total + (probs * x + (1 - probs) * (1 - x)).prod(-1) * f(x)
    return total


def replicated_hessians(param: Tensor, repeats: int, model: Model) -> Tensor:
    """``(repeats, d·d)`` independent Hessian estimates of ``param`` (``d`` entries, any shape).

    Like :func:`storch.testing.replicated_gradients`: ``model(view)`` samples and registers costs
    on the replicated view of ``param``, one ``storch.backward(create_graph=True)`` gives the
    gradient estimates with their graph, and each row of the Hessian is the gradient of one of
    their coordinates (times ``repeats``, the replicate plate's weight being ``1/repeats``).
    """
    leaf, view = replicate(param, repeats)
    model(view)
    storch.backward(create_graph=True)
    grad = leaf.grad.reshape(repeats, -1)
    rows = [
        torch.autograd.grad(grad[:, i].sum(), leaf, retain_graph=True)[0].reshape(repeats, -1) * repeats
        for i in range(param.numel())
    ]
    return torch.stack(rows, 1).reshape(repeats, -1)


def _square(v: Tensor) -> Tensor:
    return v**2


class _SeveralParameters:
    """For problems with several parameters: ``params``, ``exact()`` (one gradient each) and ``names``."""

    names: ClassVar[tuple[str, ...]]
    params: list[Tensor]

    def exact(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def assert_unbiased(self, model: Model, repeats: int, label: str = "") -> list[Tensor]:
        """``repeats`` gradient estimates of every parameter under ``model`` (one backward pass),
        each asserted unbiased against :meth:`exact` (labelled ``"{label} {name}"``); returns them."""
        grads = replicated_gradients(self.params, repeats, model)
        for g, e, name in zip(grads, self.exact(), self.names):
            assert_unbiased(g, e, label=f"{label} {name}".strip())
        return grads


# ---------------------------------------------------------------- one categorical node
CATEGORICAL_THETA = torch.tensor([0.2, -0.4, 0.9, 0.0, -1.0, 0.6])
CATEGORICAL_VALUES = torch.tensor([1.0, -2.0, 0.5, 3.0, 2.0, -1.0])


@dataclass(frozen=True, eq=False)
class OneCategorical:
    """``z ~ Cat(softmax θ)`` over ``K`` values, ``f(z) = g(v_z)``: ``E f = Σ_k softmax(θ)_k g(v_k)``."""

    theta: Tensor
    values: Tensor
    g: Callable[[Tensor], Tensor] = _square

    def cost(self, z: Tensor, one_hot: bool = True) -> Tensor:
        """``g(v_z)`` of a one-hot sample (``one_hot``) or of an index sample."""
        return self.g((z * self.values).sum(-1) if one_hot else self.values[z])

    def model(self, method: Callable, one_hot: bool = True, check: Check = None) -> Model:
        """Sample ``z`` with ``method`` from ``OneHotCategorical`` (``one_hot``) or ``Categorical``;
        ``check(z)``, if given, runs on the sample before the cost is added."""

        def model(theta: Tensor) -> None:
            z = method((OneHotCategorical if one_hot else Categorical)(logits=theta))
            if check is not None:
                check(z)
            storch.add_cost(self.cost(z, one_hot), "f")

        return model

    def expectation(self, theta: Tensor) -> Tensor:
        return (theta.softmax(-1) * self.cost(torch.eye(self.values.shape[0]))).sum()

    def exact(self, theta: Tensor | None = None) -> Tensor:
        """``∇_θ E f`` at ``theta`` (default: the problem's own)."""
        return exact_grads(self.expectation, [self.theta if theta is None else theta])[0]


def one_categorical(k: int = 6, theta: Tensor | None = None, g: Callable[[Tensor], Tensor] = _square) -> OneCategorical:
    """The first ``k`` (at most 6) logits and values of the shared constants; ``theta`` overrides
    the logits (for a differently shaped distribution over the same values)."""
    return OneCategorical(CATEGORICAL_THETA[:k].clone() if theta is None else theta, CATEGORICAL_VALUES[:k].clone(), g)


# ---------------------------------------------------------------- two nested categorical nodes
NESTED_THETA1 = torch.tensor([0.5, -0.3, 0.1, 1.0])
NESTED_THETA2 = torch.tensor(
    [[0.2, 1.0, -0.5, 0.0, 0.3], [0.0, -1.0, 0.7, 0.2, 0.0], [1.2, 0.3, 0.0, -0.4, 0.9], [0.1, 0.2, 0.3, 0.4, 0.5]]
)
NESTED_TABLE = torch.tensor(
    [[1.0, 4.0, -2.0, 0.0, 1.0], [0.5, 3.0, 2.5, -1.0, 0.0], [-1.0, 0.0, 6.0, 2.0, 1.0], [2.0, -3.0, 0.0, 1.0, 4.0]]
)


@dataclass(frozen=True, eq=False)
class NestedCategorical(_SeveralParameters):
    """``z₁ ~ Cat(softmax θ₁)``, ``z₂ | z₁ ~ Cat(softmax θ₂[z₁])``, ``f = table[z₁, z₂]``.

    ``E f = Σ_{a,b} softmax(θ₁)_a softmax(θ₂[a])_b table[a, b]``. The nodes are named ``z1`` and
    ``z2`` (the model checks that ``z2`` carries the plates ``z2, z1, replicate``, or ``z2, replicate``
    where ``z2``'s plate extends ``z1``'s, as chained local expectations do).
    """

    theta1: Tensor
    theta2: Tensor
    table: Tensor
    names: ClassVar[tuple[str, ...]] = ("theta1", "theta2")

    @property
    def params(self) -> list[Tensor]:
        return [self.theta1, self.theta2]

    def model(self, m1: Callable, m2: Callable) -> Model:
        """One-hot ``z1`` sampled with ``m1``; ``z2`` with ``m2``, its logits the row of θ₂ that ``z1`` selects."""

        def model(theta1: Tensor, theta2: Tensor) -> None:
            z1 = m1(OneHotCategorical(logits=theta1))
            z2 = m2(OneHotCategorical(logits=(z1.unsqueeze(-1) * theta2).sum(-2)))
            names = [p.name for p in z2.plates]
            # a local-expectation z2 extends z1's evaluation plate instead of adding its own
            assert names in (["z2", "z1", "replicate"], ["z2", "replicate"]), names
            storch.add_cost(((z1.unsqueeze(-1) * self.table) * z2.unsqueeze(-2)).sum((-1, -2)), "f")

        return model

    def expectation(self, theta1: Tensor, theta2: Tensor) -> Tensor:
        return (theta1.softmax(-1)[:, None] * theta2.softmax(-1) * self.table).sum()

    def exact(self) -> tuple[Tensor, ...]:
        """``(∇_θ₁ E f, ∇_θ₂ E f)``."""
        return exact_grads(self.expectation, self.params)


def nested_categorical(k1: int = 3, k2: int = 3) -> NestedCategorical:
    """``z₁`` with ``k1`` (at most 4) values, ``z₂`` with ``k2`` (at most 5): the top-left block of
    the shared constants."""
    return NestedCategorical(NESTED_THETA1[:k1].clone(), NESTED_THETA2[:k1, :k2].clone(), NESTED_TABLE[:k1, :k2].clone())


# ---------------------------------------------------------------- Bernoulli variables in one node
BERNOULLI_PHI = torch.tensor([0.3, -0.5, 1.0])
BERNOULLI_TARGET = torch.tensor([0.49, 0.499, 0.8])


@dataclass(frozen=True, eq=False)
class BernoulliBits:
    """``x_d ~ Bernoulli(σ(φ_d))``, ``d = 1..3``, in one node; ``f(x) = Σ_d (x_d − t_d)² + c·x₁x₂``.

    The targets ``t`` sit near ½ so that the gradient is small against the noise. With ``c = 0``
    the cost is separable; ``c ≠ 0`` couples the first two variables (so that estimators that
    treat coordinates one at a time, or antithetic pairs, are exercised).
    """

    phi: Tensor
    target: Tensor
    interaction: float

    def cost(self, x: Tensor) -> Tensor:
        cost = ((x - self.target) ** 2).sum(-1)
        if self.interaction:
            cost = cost + self.interaction * x[..., 0] * x[..., 1]
        return cost

    def model(self, method: Callable) -> Model:
        def model(phi: Tensor) -> None:
            x = method(Bernoulli(logits=phi))
            storch.add_cost(self.cost(x), "f")

        return model

    def expectation(self, phi: Tensor) -> Tensor:
        return enumerate_bernoulli(torch.sigmoid(phi), self.cost)

    def exact(self) -> Tensor:
        """``∇_φ E f``."""
        return exact_grads(self.expectation, [self.phi])[0]

    def exact_hessian(self) -> Tensor:
        """``∇²_φ E f`` (3 × 3)."""
        return torch.autograd.functional.hessian(self.expectation, self.phi.clone())


def bernoulli(interaction: float = 2.0) -> BernoulliBits:
    return BernoulliBits(BERNOULLI_PHI.clone(), BERNOULLI_TARGET.clone(), interaction)


# ---------------------------------------------------------------- Bernoulli under a minibatch plate
MINIBATCH_X = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -1.0], [0.3, 0.3, 0.3], [-1.0, 0.5, 0.0]])
MINIBATCH_W = torch.tensor([[0.5, -0.2], [0.1, 0.4], [-0.3, 0.8]])
MINIBATCH_T = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.2, 0.7]])


@dataclass(frozen=True, eq=False)
class MinibatchBernoulli:
    """A logistic model under the minibatch plate ``data`` (4 points, ``storch.denote_independent``).

    Per data point ``i``: ``z_i ~ Bernoulli(σ(X_i W))`` (two variables, one node ``z`` for all
    points), ``f_i = Σ_d (z_id − t_id)² + c·z_i1 z_i2``; the plate averages, so
    ``E f = mean_i Σ_z p_i(z) f_i(z)``. The parameter is ``W`` (3 × 2).
    """

    x: Tensor
    w: Tensor
    t: Tensor
    interaction: float

    def cost(self, z: Tensor, t: Tensor) -> Tensor:
        cost = ((z - t) ** 2).sum(-1)
        if self.interaction:
            cost = cost + self.interaction * z[..., 0] * z[..., 1]
        return cost

    def model(self, method: Callable, check: Check = None) -> Model:
        """``z`` sampled with ``method`` (checked to carry the plates ``z, data, replicate``);
        ``check(z)``, if given, runs on the sample before the cost is added."""

        def model(w: Tensor) -> None:
            x = storch.denote_independent(self.x, 0, "data")
            t = storch.denote_independent(self.t, 0, "data")
            z = method(Bernoulli(logits=(x.unsqueeze(-1) * w).sum(-2)))
            assert [p.name for p in z.plates] == ["z", "data", "replicate"]  # newest plate first
            if check is not None:
                check(z)
            storch.add_cost(self.cost(z, t), "f")

        return model

    def expectation(self, w: Tensor) -> Tensor:
        return enumerate_bernoulli(torch.sigmoid(self.x @ w), lambda z: self.cost(z, self.t)).mean()

    def exact(self) -> Tensor:
        """``∇_W E f``."""
        return exact_grads(self.expectation, [self.w])[0]


def minibatch_bernoulli(interaction: float = 0.0) -> MinibatchBernoulli:
    return MinibatchBernoulli(MINIBATCH_X.clone(), MINIBATCH_W.clone(), MINIBATCH_T.clone(), interaction)


# ---------------------------------------------------------------- a categorical under a minibatch plate
MINIBATCH_CATEGORICAL_W = torch.tensor(
    [[0.5, -0.2, 0.0, 1.0, 0.3], [0.1, 0.4, -0.7, 0.0, 0.2], [-0.3, 0.8, 0.5, 0.1, -0.6]]
)
MINIBATCH_Y = torch.tensor([0.0, 2.0, -1.0, 1.0])
LEVELS = torch.tensor([-1.0, 0.0, 1.0, 2.0, 3.0])


@dataclass(frozen=True, eq=False)
class MinibatchCategorical:
    """A softmax regression under the minibatch plate ``data`` (the 4 points of :data:`MINIBATCH_X`).

    Per data point ``i``: ``z_i ~ Cat(softmax(X_i W))`` over 5 levels (one node ``z``, one-hot),
    ``f_i = (level_{z_i} − y_i)²``; the plate averages, so
    ``E f = mean_i Σ_k softmax(X_i W)_k (level_k − y_i)²``. The parameter is ``W`` (3 × 5).
    """

    x: Tensor
    w: Tensor
    y: Tensor
    levels: Tensor

    def model(self, method: Callable) -> Model:
        def model(w: Tensor) -> None:
            x = storch.denote_independent(self.x, 0, "data")
            y = storch.denote_independent(self.y, 0, "data")
            z = method(OneHotCategorical(logits=(x.unsqueeze(-1) * w).sum(-2)))
            assert z.plate_names == ["z", "data", "replicate"]
            storch.add_cost(((z * self.levels).sum(-1) - y) ** 2, "f")

        return model

    def expectation(self, w: Tensor) -> Tensor:
        return ((self.x @ w).softmax(-1) * (self.levels - self.y[:, None]) ** 2).sum(-1).mean()

    def exact(self) -> Tensor:
        """``∇_W E f``."""
        return exact_grads(self.expectation, [self.w])[0]


def minibatch_categorical() -> MinibatchCategorical:
    return MinibatchCategorical(MINIBATCH_X.clone(), MINIBATCH_CATEGORICAL_W.clone(), MINIBATCH_Y.clone(), LEVELS.clone())


# ---------------------------------------------------------------- two Bernoulli nodes
PHI1 = torch.tensor([0.4, -0.2])
PHI2 = torch.tensor([-0.3, 0.6])
A = torch.tensor([0.3, 0.9])


@dataclass(frozen=True, eq=False)
class NestedBernoulli(_SeveralParameters):
    """``x₁ ~ Bernoulli(σ(φ₁))``, ``x₂ | x₁ ~ Bernoulli(σ(φ₂ + x₁ C))`` (two bits each), one cost
    ``f = Σ (x₁ − a)² + 3 Σ (x₂ − x₁/2)² + x₁₁ x₂₂`` of both (``C`` = ``coupling``, or the
    identity when ``None``). The model is left to the tests (how ``x₁`` enters ``x₂``'s logits
    differs); ``cost`` and ``expectation`` are shared.
    """

    phi1: Tensor
    phi2: Tensor
    a: Tensor
    coupling: Tensor | None = field(default=None)
    names: ClassVar[tuple[str, ...]] = ("phi1", "phi2")

    @property
    def params(self) -> list[Tensor]:
        return [self.phi1, self.phi2]

    def cost(self, x1: Tensor, x2: Tensor) -> Tensor:
        return ((x1 - self.a) ** 2).sum(-1) + 3.0 * ((x2 - 0.5 * x1) ** 2).sum(-1) + x1[..., 0] * x2[..., 1]

    def expectation(self, phi1: Tensor, phi2: Tensor) -> Tensor:
        """By enumeration, in the dtype of ``phi1``."""
        p1 = torch.sigmoid(phi1)
        total = 0.0
        for v1 in itertools.product([0.0, 1.0], repeat=2):
            x1 = torch.tensor(v1, dtype=phi1.dtype)
            q1 = (p1 * x1 + (1 - p1) * (1 - x1)).prod()
            p2 = torch.sigmoid(phi2 + (x1 if self.coupling is None else x1 @ self.coupling))
            total = total + q1 * enumerate_bernoulli(p2, lambda x2, x1=x1: self.cost(x1, x2))
        return total

    def exact(self) -> tuple[Tensor, ...]:
        return exact_grads(self.expectation, self.params)


def nested_bernoulli(coupling: Tensor | None = None) -> NestedBernoulli:
    return NestedBernoulli(PHI1.clone(), PHI2.clone(), A.clone(), coupling)


@dataclass(frozen=True, eq=False)
class TwoCosts(_SeveralParameters):
    """Two costs with different ancestors: ``z₁ ~ Bernoulli(σ(φ₁))`` with ``first = Σ (z₁ − a)²``,
    ``z₂ | z₁ ~ Bernoulli(σ(φ₂ + z₁))`` with ``second = 3 Σ (z₂ − z₁/2)²`` (two bits each): ``z₂``
    is an ancestor of the second cost only."""

    phi1: Tensor
    phi2: Tensor
    a: Tensor
    names: ClassVar[tuple[str, ...]] = ("phi1", "phi2")

    @property
    def params(self) -> list[Tensor]:
        return [self.phi1, self.phi2]

    def model(self, m1: Callable, m2: Callable) -> Model:
        def model(phi1: Tensor, phi2: Tensor) -> None:
            z1 = m1(Bernoulli(logits=phi1))
            storch.add_cost(((z1 - self.a) ** 2).sum(-1), "first")
            z2 = m2(Bernoulli(logits=phi2 + z1))
            storch.add_cost(((z2 - 0.5 * z1) ** 2).sum(-1) * 3.0, "second")

        return model

    def expectation(self, phi1: Tensor, phi2: Tensor) -> Tensor:
        total = 0.0
        for v1 in itertools.product([0.0, 1.0], repeat=2):
            x1 = torch.tensor(v1)
            p1 = Bernoulli(logits=phi1).log_prob(x1).sum().exp()
            total = total + p1 * ((x1 - self.a) ** 2).sum()
            for v2 in itertools.product([0.0, 1.0], repeat=2):
                x2 = torch.tensor(v2)
                p2 = Bernoulli(logits=phi2 + x1).log_prob(x2).sum().exp()
                total = total + p1 * p2 * ((x2 - 0.5 * x1) ** 2).sum() * 3.0
        return total

    def exact(self) -> tuple[Tensor, ...]:
        return exact_grads(self.expectation, self.params)


def two_costs() -> TwoCosts:
    return TwoCosts(PHI1.clone(), PHI2.clone(), A.clone())
