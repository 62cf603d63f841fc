"""A user-written estimator: the score function with a leave-one-out baseline (manual, chapter 5.2).

The four components of a storch method in a few lines: the proposal (``proposal_dist``), the
weighting function, and, in ``estimator``, the gradient function ``log p(x)`` and the control
variate term ``(1 − □(log p)) · b`` with ``b_j`` the mean cost of the other samples. The tests
(``tests/test_unbiased.py``, ``tests/test_methods.py``) check that it is unbiased and that it
matches the built-in ``ScoreFunction(..., baseline_factory="batch_average")``.

Run: ``python examples/score_function_loo.py``
"""

import torch
from torch.distributions import Bernoulli

import storch
from storch.method import Method
from storch.util import magic_box


class ScoreFunctionLOO(Method):
    def proposal_dist(self, distr, amt_samples):
        return distr.sample((amt_samples,))

    def weighting_function(self, distr, amt_samples):
        return torch.full((amt_samples,), 1 / amt_samples)

    def estimator(self, tensor, cost):
        log_prob = tensor.distribution.log_prob(tensor)
        sum_costs = storch.sum(cost.detach(), tensor.name)
        baseline = (sum_costs - cost.detach()) / (tensor.n - 1)
        return log_prob, (1.0 - magic_box(log_prob)) * baseline


def main() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([0.3, -0.5, 1.0], requires_grad=True)
    target = torch.tensor([0.49, 0.499, 0.8])
    x = ScoreFunctionLOO("x", n_samples=1000)(Bernoulli(logits=logits))
    storch.add_cost(((x - target) ** 2).sum(-1), "f")
    print("estimate of E f:", storch.backward().item())
    p = torch.sigmoid(logits.detach())
    exact = p * (1 - p) * ((1 - target) ** 2 - target**2)
    print("gradient estimate:", logits.grad.tolist())
    print("exact gradient:   ", exact.tolist())


if __name__ == "__main__":
    main()
