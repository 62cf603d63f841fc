"""Monte Carlo decoding of sequences with ancestral plates.

Draw ``k`` independent sequences token by token: at step ``t`` each of the ``k`` prefixes gets one
token from ``p(x_t | x_<t)``; a finished prefix (last token ``eos``) continues with ``eos`` with
probability 1. Each step has its own plate (an `storch.plate.AncestralPlate` whose parent
index is the identity), so tensors of different steps combine without bookkeeping. Each prefix has
weight ``1/k``, and with the score function over the whole prefix,

    ∇ E[f(x_{≤t})] ≈ (1/k) Σ_i f(x^i_{≤t}) ∇ log p(x^i_{≤t}),   log p(x_{≤t}) = Σ_{s≤t} log p(x_s | x_<s),

which is unbiased (for every order of derivatives, as the plain score function). Since the ``k``
sequences are independent, the leave-one-out baseline (the other sequences' mean cost) keeps it
unbiased: ``ScoreFunctionWOR(..., sampling_method=MCDecoder(...), baseline_factory="batch_average")``
(or ``"moving_average"``). A step with
several variables per prefix (batch dimensions that are not plates) draws one value of each, and
their log-probabilities are summed into the prefix's (``eos`` then is refused: such a step has no
single token).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributions import Categorical, Distribution

from storch.sampling.swor import SequenceSampler, WORState, wor_support

__all__ = ["MCDecoder"]


class MCDecoder(SequenceSampler):
    """``k`` i.i.d. sequences decoded step by step (ancestral sampling), each with weight ``1/k``.

    Use it as the proposal of
    `storch.method.score_function_wor.ScoreFunctionWOR`, which
    then is the plain
    score function over sequences: ``ScoreFunctionWOR("seq", k, sampling_method=MCDecoder("seq", k,
    eos=EOS))``, called once per step as for sampling without replacement.

    Baselines: pass ``baseline_factory="batch_average"`` (leave-one-out over the ``k`` sequences,
    ``k ≥ 2``) or ``"moving_average"`` to the method, as for
    `storch.method.ScoreFunction`.

    Args:
        plate_name: the name of the plates of the steps.
        k: the number of sequences.
        eos: the end-of-sequence value index (``None``: fixed-length sequences).

    Examples:
        >>> import torch, storch
        >>> from torch.distributions import Categorical
        >>> from storch.method.score_function_wor import ScoreFunctionWOR
        >>> method = ScoreFunctionWOR("seq", 5, sampling_method=MCDecoder("seq", 5, eos=0))
        >>> x1 = method(Categorical(logits=torch.zeros(3)))
        >>> x2 = method(Categorical(logits=x1.unsqueeze(-1) * torch.tensor([0.0, 1.0, 2.0])))
        >>> (x1 + x2).plates[0] is x2.plates[0], x2.plates[0].size   # x1 is lined up with x2
        (True, 5)
    """

    #: the ``k`` sequences are i.i.d.: a leave-one-out baseline keeps the estimator unbiased
    independent_samples = True

    def draw(self, distr: Distribution, n_plates: int) -> tuple[torch.Tensor, WORState]:
        support = wor_support(distr)
        lp = support.log_probs
        var_shape = tuple(lp.shape[n_plates:-1])
        self._check_eos_variables(var_shape, tuple(distr.batch_shape), "the node")
        tokens = Categorical(logits=lp.detach()).sample((self.k,))  # (k, *P, *var)
        log_prob = lp.unsqueeze(0).expand((self.k,) + tuple(lp.shape)).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if var_shape:
            log_prob = log_prob.sum(tuple(range(1 + n_plates, log_prob.dim())))
        zeros = log_prob.detach().new_zeros(log_prob.shape)
        kappa = zeros.new_full(log_prob.shape[1:], float("-inf"))
        state = WORState(log_prob, zeros, kappa, tokens, finished=self._finished(tokens, var_shape))
        return support.values(tokens), state

    def extend(self, distr: Distribution, parent: WORState, beam_dim: int) -> tuple[torch.Tensor, WORState]:
        """One token per prefix from ``p(x_t | x_<t)``; with several variables per step (batch
        dimensions of ``distr`` that are not plates) one value of each, their log-probabilities
        summed into the prefix's. ``eos`` is refused with several variables."""
        support, lp, ext = self._extension_log_probs(distr, parent, beam_dim)
        token = Categorical(logits=ext).sample()  # one token per prefix (and variable): (n, *B, *var_shape)
        shape = tuple(parent.log_prob.shape)  # (n, *B)
        n = shape[0]
        parent_index = torch.arange(n, device=token.device).reshape((n,) + (1,) * (len(shape) - 1)).expand(shape)
        log_prob, done = self._extend_prefixes(lp, parent, parent_index, token)
        state = WORState(log_prob, parent.perturbed, parent.kappa, token, parent_index, done)
        return support.values(token), state

    def weights(self, state: WORState) -> Optional[torch.Tensor]:
        return None  # i.i.d. samples: 1/k
