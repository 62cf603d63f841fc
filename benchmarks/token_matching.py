"""Which estimator for a sequence policy: learning to match a target string, rewarded at the end.

A recurrent policy (embedding, ``GRUCell``, linear readout; the cell wrapped by
``storch.make_left_broadcastable`` inside the policy's ``nn.Module``) writes ``L = 8`` tokens from a
vocabulary of ``V = 8``, one per step, each conditioned on the previous one. The reward is the
number of positions that match a fixed random target, given once, after the last token (cost
``−matches``): every decision is credited through the log-probability of the whole sequence.
Each training step decodes ``k = 8`` sequences and takes an Adam step (lr ``0.01``).

Estimators (``ScoreFunctionWOR`` called once per step, its proposal and baseline varied):

* ``iid`` / ``iid+loo`` / ``iid+ma``: ``k`` i.i.d. sequences (``MCDecoder``) without a baseline, with
  the leave-one-out ``batch_average``, with ``moving_average``;
* ``wor`` / ``wor+ma``: ``k`` sequences without replacement (stochastic beam search), the unbiased
  importance-weighted estimator (``biased=False``) without a baseline and with ``moving_average``;
* ``wor-normalised``: ``biased=True``, normalised weights and the built-in baseline;
* ``unordered-set``: ``UnorderedSetEstimator``, with its built-in baseline.

It prints, per estimator, the expected number of matches of the policy (the mean over 512
sequences sampled from it, without storch) after each quarter of the steps, averaged over the seeds,
and the time per step. Run from the repository root::

    .venv/bin/python benchmarks/token_matching.py                  # 200 steps, 4 seeds
    .venv/bin/python benchmarks/token_matching.py --steps 50 --seeds 1 --only iid+loo wor+ma
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import storch  # noqa: E402
from storch.method import ScoreFunctionWOR, UnorderedSetEstimator  # noqa: E402
from storch.sampling import MCDecoder  # noqa: E402

__all__ = ["Policy", "ESTIMATORS", "train", "main"]

LENGTH, VOCAB, K, HIDDEN = 8, 8, 8, 32


class Policy(nn.Module):
    """An autoregressive policy over ``LENGTH`` tokens: GRU state, logits of the next token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, 16)  # the last index is the start token
        self.cell = storch.make_left_broadcastable(nn.GRUCell(16, HIDDEN))
        self.readout = nn.Linear(HIDDEN, VOCAB)

    def decode(self, method: Callable) -> list[torch.Tensor]:
        """``LENGTH`` tokens, each drawn by ``method`` from the logits given the previous ones."""
        h = self.cell(self.embed(torch.tensor(VOCAB)))  # (H,): the state after the start token
        tokens = []
        for _ in range(LENGTH):
            token = method(Categorical(logits=self.readout(h)))
            tokens.append(token)
            h = self.cell(self.embed(token), h)
        return tokens

    @torch.no_grad()
    def expected_matches(self, target: torch.Tensor, n: int = 512) -> float:
        """The mean number of matches of ``n`` sequences sampled from the policy (plain torch)."""
        h = self.cell.module(self.embed(torch.full((n,), VOCAB)))
        matches = torch.zeros(n)
        for t in range(LENGTH):
            token = Categorical(logits=self.readout(h)).sample()
            matches += (token == target[t]).float()
            h = self.cell.module(self.embed(token), h)
        return matches.mean().item()


ESTIMATORS: dict[str, Callable[[], Callable]] = {
    "iid": lambda: ScoreFunctionWOR("seq", K, sampling_method=MCDecoder("seq", K)),
    "iid+loo": lambda: ScoreFunctionWOR("seq", K, sampling_method=MCDecoder("seq", K),
                                        baseline_factory="batch_average"),
    "iid+ma": lambda: ScoreFunctionWOR("seq", K, sampling_method=MCDecoder("seq", K),
                                       baseline_factory="moving_average"),
    "wor": lambda: ScoreFunctionWOR("seq", K),
    "wor+ma": lambda: ScoreFunctionWOR("seq", K, baseline_factory="moving_average"),
    "wor-normalised": lambda: ScoreFunctionWOR("seq", K, biased=True),
    "unordered-set": lambda: UnorderedSetEstimator("seq", K),
}


def train(name: str, seed: int, steps: int, checkpoints: list[int]) -> tuple[list[float], float]:
    """Train a fresh policy with estimator ``name``; the expected matches at ``checkpoints`` and the
    seconds per step."""
    torch.manual_seed(seed)
    target = torch.randint(VOCAB, (LENGTH,))
    policy, method = Policy(), ESTIMATORS[name]()
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.01)
    found, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        tokens = policy.decode(method)
        matches = sum((token == target[t]).float() for t, token in enumerate(tokens))
        storch.add_cost(-matches, "reward")
        optimizer.zero_grad()
        storch.backward()
        optimizer.step()
        if step in checkpoints:
            found.append(policy.expected_matches(target))
    return found, (time.perf_counter() - start) / steps


def main(argv: Optional[list[str]] = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--only", nargs="*", choices=list(ESTIMATORS), default=list(ESTIMATORS))
    args = parser.parse_args(argv)
    checkpoints = [args.steps * q // 4 for q in (1, 2, 3, 4)]
    torch.set_num_threads(1)
    print(f"expected matches of {LENGTH} (k = {K} sequences per step, mean over {args.seeds} seeds)")
    header = "".join(f"{'step ' + str(c):>10}" for c in checkpoints)
    print(f"{'estimator':<16}{header}{'seeds at end':>16}{'ms/step':>9}")
    results = {}
    for name in args.only:
        runs = [train(name, seed, args.steps, checkpoints) for seed in range(args.seeds)]
        means = [sum(r[0][i] for r in runs) / len(runs) for i in range(len(checkpoints))]
        ends = " ".join(f"{r[0][-1]:.1f}" for r in runs)
        ms = 1000 * sum(r[1] for r in runs) / len(runs)
        print(f"{name:<16}" + "".join(f"{m:>10.2f}" for m in means) + f"{ends:>16}{ms:>9.1f}", flush=True)
        results[name] = means
    return results


if __name__ == "__main__":
    main()
