"""The schedule of `storch.method.Auto`: rounds of measurements, pruning, and the choice after each round.

A round queues every candidate that is still in the running ``visits`` times (plus its warm-up steps in
the first round), interleaved one step each, so that the candidates see the same phase of training.
After each measured step a candidate whose running score exceeds ``prune`` times the best measured one
(``prune²`` while it warms up) leaves the round and the later ones, if its second moment does too or it
has run two steps of the round. When the queue is empty the round is scored: each candidate's mean
second moment ``E‖ĝ‖²`` times its median cost per step (seconds, CPU seconds or evaluations); the lowest
wins and is used for ``explore_every · growth^(r−1)`` steps after round ``r``, then the next round
starts, without the candidates whose score was over ``recheck`` times the winner's. Every decision uses the steps already taken only (the history), which is what keeps each
step's gradient unbiased (`storch.method.auto`).

`RoundSchedule` holds these rules for `Auto`, whose state (``stats``, ``_queue``, ``_current``,
``_chosen``, ``_round``, ``_exploit_left``, ``_clear_optimizer``, ``switches``, ``step`` and the options ``visits``,
``explore_every``, ``growth``, ``prune``, ``recheck``, ``cost``) it reads and updates; `CandidateStats` is what it
keeps of one candidate.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["CandidateStats", "RoundSchedule"]


@dataclass
class CandidateStats:
    """What `Auto` measured of one candidate: its uses, and the latest round's measurements."""

    label: str
    evaluations: int
    unbiased: bool
    warmup: int
    uses: int = 0
    round_moments: list[float] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    warm_moments: list[float] = field(default_factory=list)
    warm_seconds: list[float] = field(default_factory=list)
    second_moment: Optional[float] = None
    seconds: Optional[float] = None
    dropped: str = ""
    entry: str = ""  # the catalog entry it was built from, and its count (None: the entry's own)
    count: Optional[int] = None

    def running(self) -> tuple[Optional[float], Optional[float], bool]:
        """The round's second moment and score so far, and whether they are from measured steps (else
        from warm-up steps); ``None`` before any step of the round."""
        for moments, seconds, measured in ((self.round_moments, self.round_seconds, True),
                                           (self.warm_moments, self.warm_seconds, False)):
            if moments:
                moment = sum(moments) / len(moments)
                return moment, moment * statistics.median(seconds), measured
        return None, None, False

    def close_round(self) -> None:
        """Summarise the round's measurements (mean second moment, median seconds) and clear them."""
        if self.round_moments:
            self.second_moment = sum(self.round_moments) / len(self.round_moments)
            self.seconds = statistics.median(self.round_seconds)
        self.round_moments, self.round_seconds, self.warm_moments, self.warm_seconds = [], [], [], []


class RoundSchedule:
    """The rounds of `storch.method.Auto` (module docstring): which candidate runs the next step."""

    def _prune(self) -> None:
        """Drop, from this round and the later ones, the candidates whose running score exceeds ``prune``
        times the best measured one (``prune²`` times while they warm up)."""
        if self.prune is None:
            return
        running = {c: s.running() for c, s in enumerate(self.stats) if not s.dropped}
        measured = {c: r for c, r in running.items() if r[2]}
        if not measured:
            return
        leader = min(measured, key=lambda c: measured[c][1])
        best, low = measured[leader][1], min(r[0] for r in measured.values())
        if best <= 0 or low <= 0:  # an exactly zero estimate so far (an antithetic pair that agreed): no ratio
            return
        for c, (moment, score, full) in running.items():
            limit = self.prune if full else self.prune**2
            steps = len(self.stats[c].round_moments if full else self.stats[c].warm_moments)
            if score is not None and score > limit * best and (moment > limit * low or steps >= 2):
                phase = "" if full else " while warming up"
                self.stats[c].dropped = (f"round {self._round}, step {self.step}: score {_ratio(score, best)} that of "
                                         f"{self.stats[leader].label}{phase}")
                self._queue[1:] = [q for q in self._queue[1:] if q != c]

    def _start_round(self) -> None:
        """Queue a round of measurements: each candidate ``visits`` times (plus its warm-up in the first
        round), interleaved."""
        self._round += 1
        needs = [0 if s.dropped else self.visits + (s.warmup if self._round == 1 else 0) for s in self.stats]
        self._queue = [c for i in range(max(needs)) for c in range(len(self.stats)) if i < needs[c]]
        if len(needs) - needs.count(0) == 1:
            self._queue = self._queue[:1]
        previous = "" if self._chosen is None else self.stats[self._chosen].label
        self._current = self._queue[0]
        self.switches.append((self.step, previous, "(measuring)",
                              f"round {self._round}: {len(needs) - needs.count(0)} candidates, {self.visits} measured steps each"))

    def _advance(self) -> None:
        """Pick the candidate of the next step (from the history only)."""
        if self._queue:
            self._queue.pop(0)
            if self._queue:
                self._current = self._queue[0]
                return
            self._settle()
            return
        self._exploit_left -= 1
        if self._exploit_left <= 0:
            self._start_round()

    def _settle(self) -> None:
        """End a round: score the candidates, choose the best, schedule the next round."""
        for s in self.stats:
            s.close_round()
        scores = {c: v for c, v in self.scores().items() if not self.stats[c].dropped}
        if not scores:  # nothing measured in the round (every candidate dropped while warming up)
            scores = {self._current: 0.0}
        best = min(scores, key=lambda c: (scores[c], self.stats[c].seconds or 0.0))
        ranked = sorted(scores, key=scores.get)
        runner = next((c for c in ranked if c != best), None)
        versus = "" if runner is None else f", next {self.stats[runner].label} at {_ratio(scores[runner], scores[best])}"
        bias = "" if self.stats[best].unbiased else " (a biased candidate: allow_bias=True)"
        what = {"time": "second moment × seconds per step", "cpu": "second moment × CPU seconds per step",
                "evaluations": "second moment × evaluations"}[self.cost]
        self.switches.append((self.step, "(measuring)", self.stats[best].label,
                              f"lowest {what} in round {self._round}{versus}{bias}"))
        if self.recheck is not None:  # far behind after a whole round: not measured again
            for c, score in scores.items():
                if score > self.recheck * scores[best]:
                    self.stats[c].dropped = (f"round {self._round}: score {_ratio(score, scores[best])} that of "
                                             f"{self.stats[best].label}, over recheck={self.recheck:g}")
        self._chosen = self._current = best
        self._queue = []
        if self._round == 1:  # Auto's optimizer (if given) forgets the first round's steps
            self._clear_optimizer = True
        self._exploit_left = int(round(self.explore_every * self.growth ** (self._round - 1)))

    def scores(self) -> dict[int, float]:
        """Each measured candidate's score (second moment × cost) from its latest round, by index."""
        return {
            c: s.second_moment * s.seconds for c, s in enumerate(self.stats)
            if s.second_moment is not None and s.seconds is not None
        }


def _ratio(a: float, b: float) -> str:
    return "the same score" if a == b else (f"{a / b:.3g}×" if b > 0 else "a higher score")
