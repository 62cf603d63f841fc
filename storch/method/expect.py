"""Exact expectation by enumeration.

    ∇θ E_{p_θ}[f(x)] = ∇θ Σ_x p_θ(x) f(x)

Components: the whole support, enumerated (`storch.sampling.Enumerate`); weight ``p(x)``,
not detached; no gradient function; no control variate. Exact, at the price of one cost evaluation
per joint configuration.
"""

from __future__ import annotations

from torch.distributions import Distribution

from storch.method.method import Method
from storch.sampling.expect import Enumerate
from storch.sampling.method import check_count

__all__ = ["Expect"]


class Expect(Method):
    """Sum over every value of a discrete node, weighted by its probability.

    Args:
        plate_name: node / plate name.
        budget: the most joint configurations to enumerate; more is an error.

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Bernoulli
        >>> p = torch.tensor([0.2, 0.6], requires_grad=True)
        >>> x = Expect("x")(Bernoulli(p))
        >>> x.shape, x.plain().tolist()                 # the 4 joint values
        (torch.Size([4, 2]), [[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
        >>> [round(w, 4) for w in x.plate.weight.plain().tolist()]   # their probabilities
        [0.32, 0.48, 0.08, 0.12]
        >>> storch.add_cost((x * torch.tensor([1.0, 2.0])).sum(-1), "f")
        >>> round(storch.backward().item(), 4), p.grad.tolist()   # E f = p₁ + 2 p₂, exactly
        (1.4, [1.0, 2.0])
    """

    def __init__(self, plate_name: str, budget: int = 10000) -> None:
        budget = check_count(budget, "budget", f"Expect({plate_name!r})")
        super().__init__(plate_name, Enumerate(plate_name, budget))

    def check_distribution(self, distr: Distribution) -> None:
        if not distr.has_enumerate_support:
            raise ValueError(
                f"Expect({self.plate_name!r}): {type(distr).__name__} has no finite support to "
                "enumerate. Use Reparameterization, ScoreFunction or Infer."
            )
