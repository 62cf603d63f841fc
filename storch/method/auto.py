"""`Auto`: the estimator of a node chosen, during training, by its measured efficiency.

For its node's distribution type, `Auto` takes the estimators that the catalog
(`storch.method.catalog.unbiased_estimators`) declares unbiased at the derivative order asked for,
builds each at the budget (the cost evaluations per step that one node may spend), and runs them on
the user's own model: a round of measurements visits every candidate a few steps in turn, then the
best one is used for a while, longer after each round, until the next round re-checks the ranking.

**What is measured.** After each step of a round, the gradient of the surrogate loss with respect to
the parameters the node's distribution was built with (a hook on each, whatever path the candidate's
surrogate takes to it: the estimate ``ĝ`` for those parameters, as in ``z.param_grads``) and the step's
wall time (from the node's sampling to the end of `storch.backward`, the candidate's own updates
included), its CPU time over the same span (``cost="cpu"``: on a machine shared with other programs,
wall time measures them too; on storch-bench's linear SBN on a loaded two-core machine, candidates of
the same cost showed medians up to 9 times apart in wall time), or its cost evaluations (the size of
the node's plate). A candidate's score is its mean
second moment ``E‖ĝ‖²`` in the round times its median seconds (or evaluations) per step; the lowest
score wins. The second moment is ``‖∇‖² + Var ĝ``: all candidates estimate the same ``∇``, so ranking by
it ranks by variance, and it is what sets the progress of stochastic gradient descent per step at its
best step size (the number of steps to a given accuracy grows as ``E‖ĝ‖² / ‖∇‖²``); times the cost of
a step it ranks the candidates by progress per second. Two candidates that are both almost exact tie on
it, and the cheaper one wins. Measurements of one round are compared with each other only, since the
gradient's scale changes as training moves on; within a round the candidates are interleaved (one step
each, in turn) so that they see the same phase of training. A candidate whose score exceeds ``prune``
(20) times the best one's leaves the round at once, and the later rounds (on its second step, if its
second moment is within that factor and only its time is over: one step's time is noisy): the steps
of a round are training steps, and one far noisier step already costs an adaptive optimizer (it inflates
Adam's second-moment estimate for about ``1 / (1 − β₂)`` steps). After a round, only the candidates
whose score is within ``recheck`` (4) times the best one's are measured in the later rounds: the others
would spend every round's steps on estimators that lost by a margin that a round's measurements do not
reverse (fewer noisy or slow training steps; on `storch-bench`'s 8 × 8 digits at 6 CPU seconds per run
it made no difference beyond the noise, since `prune` had already cut those candidates short).

**Unbiasedness.** The candidate of step ``t`` is a function of the history only (the earlier steps'
gradients and times): it is fixed when step ``t − 1`` ends, before step ``t``'s samples are drawn. So,
conditionally on the history, step ``t``'s gradient is that candidate's estimate, unbiased for
``∇ E[cost]`` at the current parameters; the sequence of gradients is therefore unbiased at every step,
also at the steps where the candidate switches, exactly as stochastic gradient descent with a fixed
estimator. A rule that looked at the current step's samples (keeping the better of two draws) would
not be. Each candidate keeps its own state (baselines, control variates, temperatures) between the
steps it is used in. With ``allow_bias=True``, biased estimators (relaxations, straight-through,
finite differences) join the candidates; their bias does not enter the score, so a low-variance
biased candidate may win over every unbiased one: that trades the guarantee above for speed, and
`Auto` says so in its table.

**Which candidates.** Entries of the catalog that handle the distribution and are declared unbiased
at ``order`` (derivatives of that order of the surrogate are unbiased for every candidate), at most
``budget`` cost evaluations per step. Left out, with the reason in `Auto.excluded`:
entries whose declaration ``requires`` something of the model (a cost differentiable in the sample,
one categorical variable per plate element), unless named in ``include`` (the user declares it safe);
entries that evaluate the cost at relaxed, continuous values of the sample (REBAR, RELAX), unless
``relaxed=True`` says the model's costs accept them; those in ``exclude``, by default `COLD_START`
(the estimators whose first steps run without an effective baseline); those over the budget or that
fail to sample the distribution.

**Overhead.** Between rounds, a step of `Auto` is its candidate's step plus the hand-over (a clock
read and a few dictionary operations); in a round it adds a hook per distribution parameter and the
sum of squares of its gradient. Measured with ``benchmarks/auto_overhead.py`` (the linear sigmoid
belief network of ``storch-bench`` on binarized MNIST, batch 50, one thread, 10 interleaved blocks of
40 steps, settled): 11.06 against 10.99 ms per step on DisARM (1.007×), 10.92 against 11.03 ms on the
leave-one-out score function (0.99×), within the noise; on the 8 × 8 digits, where a step takes
1.5 ms, about 0.1 ms (1.06×). Rounds cost what their candidates cost.

**Compiled steps.** `storch.compile_step` refuses `Auto` (it chooses on the host, between steps);
`Auto.settled` is the chosen candidate itself, with its learned state, to compile once the choice is
made.

Examples:
    >>> import torch, storch
    >>> from torch.distributions import Bernoulli
    >>> logits = torch.zeros(3, requires_grad=True)
    >>> auto = storch.method.Auto("z", budget=4, visits=2, explore_every=5)
    >>> for step in range(60):
    ...     z = auto(Bernoulli(logits=logits))
    ...     storch.add_cost(((z - torch.tensor([0.1, 0.5, 0.9])) ** 2).sum(-1), "cost")
    ...     _ = storch.backward()
    >>> auto.choice in auto.labels, len(auto.switches) > 0
    (True, True)
"""

from __future__ import annotations

import copy
import math
import re
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.distributions import Distribution

from storch.extend import (
    StepState,
    StochasticTensor,
    distribution_layout,
    get_distr_parameters,
    no_dispatch,
    node_of,
)
from storch.method import auto_report
from storch.method.auto_schedule import CandidateStats, RoundSchedule
from storch.method.catalog import CatalogEntry, catalog
from storch.method.catalog import entry as catalog_entry
from storch.method.method import Method, check_floating_parameters

__all__ = ["Auto", "CandidateStats", "COLD_START"]

COSTS = ("time", "cpu", "evaluations")

#: catalog entries left out by default: their first steps run without an effective baseline (none, or
#: one that starts untrained), so their gradients there are hundreds of times noisier than the best
#: candidate's (on storch-bench's linear SBN at 4 evaluations: 600 to 5000 times the second moment of
#: the leave-one-out score function). Every candidate runs at least one real training step, and one such
#: step inflates Adam's second-moment estimate for about ``1 / (1 − β₂)`` steps: with them, Auto's
#: training −ELBO on that model after 600 steps was 180.0 against 168.3 without them (RLOO alone: 167.9).
#: ``exclude=()`` admits them.
COLD_START = (
    "ScoreFunction", "ScoreFunction(n_samples=3)", "ScoreFunction + moving_average", "ScoreFunction + critic",
    "RELAX", "ScoreFunctionWOR", "MAPO",
)


class Auto(RoundSchedule, Method):
    """A node's estimator chosen among the catalog's by measured efficiency (module docstring).

    Args:
        plate_name: the node's name.
        budget: the most cost evaluations per step (the size of the node's plate: samples, antithetic
            pairs times 2, local-expectation points, ...); each candidate that takes a number of
            samples gets the most that fit. ``None``: the catalog's own counts, no limit.
        order: the derivative order whose unbiasedness every candidate must declare (``1``: gradients;
            ``2``: Hessians too, for ``storch.backward(create_graph=True)``).
        allow_bias: also biased candidates (relaxations, straight-through, finite differences).
        relaxed: the model's costs accept relaxed (continuous) values of the sample, so REBAR and RELAX
            (and, with ``allow_bias``, the relaxations) may be candidates.
        include: catalog labels of entries whose ``requires`` condition the model meets (e.g.
            ``"DoubleControlVariate"`` for a cost differentiable in the sample).
        candidates: catalog labels to choose among (default: every entry that applies).
        exclude: catalog labels to leave out; by default `COLD_START`, the entries whose first steps run
            without an effective baseline.
        cost: ``"time"`` (wall-clock seconds per step), ``"cpu"`` (this process's CPU seconds per step,
            `time.process_time`: what the step computed on the host, not the time other programs on a
            busy machine took from it; not for a GPU, whose work the host waits for) or
            ``"evaluations"`` (the node's plate size).
        visits: measured steps of each candidate per round.
        explore_every: steps on the chosen candidate before the first re-check.
        growth: factor by which the steps between re-checks grow after each round.
        prune: a candidate whose score in a round exceeds ``prune`` times the best one's (``prune²`` times
            during its warm-up) leaves the round at once, and the later rounds, if its second moment
            does too or it has run two steps of the round (the time of a single step is too noisy to drop
            a candidate on); ``None``: never.
            Exploration steps are training steps, so a candidate with a gradient hundreds of times
            noisier than the best one's is dropped after a step or two rather than run ``visits`` times.
        recheck: after a round, the candidates whose score exceeds ``recheck`` times the best one's are
            not measured again (they stay in the table with the reason); ``None``: every candidate in
            every round.
        optimizer: the optimizer that trains the model; its state is cleared once, before the first step
            on the candidate chosen after the first round. The first round trains a few steps with every
            candidate, some with gradients hundreds of times noisier than the best one's, and an adaptive
            optimizer keeps them: Adam's running mean of the squared gradient holds them for about
            ``1 / (1 − β₂)`` steps (1000), and its steps are that much shorter. On a Bernoulli VAE's
            initial plateau that held Auto there for 2700 steps where its chosen estimator alone left it
            at step 300 (the local-expectation results page). The gradients themselves are unaffected:
            every step stays its candidate's unbiased estimate.

    Attributes:
        choice: the label of the candidate used in the current (or next) step.
        switches: ``(step, from, to, reason)`` for every change of the chosen candidate and every round.
    """

    step_state = StepState.host(
        "Auto chooses its candidate estimator on the host, between steps, from the gradients and times it "
        "measured; compile its settled candidate (Auto.settled) instead"
    )
    state_hooks = ("update_parameters",)

    def __init__(
        self,
        plate_name: str,
        budget: Optional[int] = None,
        *,
        order: int = 1,
        allow_bias: bool = False,
        relaxed: bool = False,
        include: Sequence[str] = (),
        candidates: Optional[Sequence[str]] = None,
        exclude: Sequence[str] = COLD_START,
        cost: str = "time",
        visits: int = 4,
        explore_every: int = 100,
        growth: float = 2.0,
        prune: Optional[float] = 20.0,
        recheck: Optional[float] = 4.0,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> None:
        super().__init__(plate_name)
        owner = f"Auto({plate_name!r})"
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"{owner}: budget must be a positive int (cost evaluations per step) or None, got {budget!r}.")
        if cost not in COSTS:
            raise ValueError(f"{owner}: cost must be one of {COSTS}, got {cost!r}.")
        if not isinstance(order, int) or order < 1:
            raise ValueError(f"{owner}: order must be a positive int, got {order!r}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{owner}: optimizer must be a torch.optim.Optimizer (the one that trains the model), "
                            f"got {type(optimizer).__name__}.")
        if visits < 1 or explore_every < 1 or growth < 1 or any(f is not None and f <= 1 for f in (prune, recheck)):
            raise ValueError(f"{owner}: visits and explore_every must be >= 1, growth >= 1, and prune and recheck > 1 "
                             f"(or None).")
        known = {e.label for e in catalog()}
        unknown = sorted(set(include) - known) + sorted(set(candidates or ()) - known) + sorted(set(exclude) - known)
        if unknown:
            raise ValueError(f"{owner}: no catalog entries labelled {unknown}; the labels are {sorted(known)}.")
        self.budget, self.order, self.allow_bias, self.relaxed = budget, order, bool(allow_bias), bool(relaxed)
        self.include, self.only = tuple(include), None if candidates is None else tuple(candidates)
        self.exclude = tuple(exclude)
        self.cost, self.visits, self.explore_every, self.growth = cost, int(visits), int(explore_every), float(growth)
        self.prune = None if prune is None else float(prune)
        self.recheck = None if recheck is None else float(recheck)
        self.optimizer = optimizer
        self._clear_optimizer = False  # set when the first round ends; done before the next step's draw
        self.methods = nn.ModuleList()
        self.stats: list[CandidateStats] = []
        self.excluded: list[tuple[str, str]] = []
        self.switches: list[tuple[int, str, str, str]] = []
        self.step = 0
        self._current = 0
        self._chosen: Optional[int] = None
        self._round = 0
        self._queue: list[int] = []
        self._exploit_left = 0
        self._t0: Optional[float] = None
        self._owner: Optional[Method] = None
        self._owners: dict[int, Method] = {}
        self._hooks: dict[int, Any] = {}
        self._moment = 0.0
        self._listening = True
        self._shape: tuple[int, ...] = ()

    # ------------------------------------------------------------ candidates
    def build(self, distribution: Distribution) -> "Auto":
        """Build the candidates for nodes like ``distribution`` (its type, and its sample's shape beyond
        the plates) now rather than at the first sample, e.g. to give an optimizer the candidates'
        parameters. (``load_state_dict`` into a fresh `Auto` rebuilds them from the checkpoint.) Returns
        ``self``."""
        if not self.stats:
            self._build(distribution)
        return self

    def _build(self, distr: Distribution) -> None:
        """Build the candidates for ``distr``'s type and event shape, at the budget."""
        kind = type(distr)
        shape = self._shape = _event_shape(distr)
        left_out = self._left_out_by_exclude(distr, shape)
        for entry in catalog():
            reason = self._why_not(entry, kind)
            if reason:
                if entry.handles(kind) and self.only is None or entry.label in (self.only or ()):
                    self.excluded.append((entry.label, reason))
                continue
            try:
                label, method, evals, count = self._sized(entry, distr, shape)
            except Exception as error:  # noqa: BLE001  (a candidate that cannot sample this node is left out)
                self.excluded.append((entry.label, f"cannot sample this node: {str(error).splitlines()[0][:160]}"))
                continue
            if method is None:
                self.excluded.append((entry.label, f"needs {evals} cost evaluations per step, over the budget of {self.budget}"))
                continue
            twin = next((s.label for s, m in zip(self.stats, self.methods)
                         if _fingerprint(m, distr) == _fingerprint(method, distr)), None)
            if twin is not None:  # e.g. Infer, which delegates to the score function with batch_average
                self.excluded.append((label if label != twin else entry.label, f"the same estimator as {twin} on {kind.__name__} (built alike)"))
                continue
            if _fingerprint(method, distr) in left_out:  # Infer at n=1: the score function with a moving average
                self.excluded.append((label, f"the same estimator as {left_out[_fingerprint(method, distr)]} on "
                                             f"{kind.__name__}, which exclude= leaves out"))
                continue
            if any(s.label == label for s in self.stats):  # another estimator sized to the same label
                label = f"{entry.label} [n={count}]" if count is not None else entry.label
            self.methods.append(method)
            self.stats.append(CandidateStats(label, evals, entry.unbiased_for(kind, self.order), entry.warmup,
                                             entry=entry.label, count=count))
        if not self.stats:
            raise ValueError(
                f"Auto({self.plate_name!r}): no catalog estimator applies to {kind.__name__} at order {self.order}"
                f"{'' if self.budget is None else f' within a budget of {self.budget}'}; left out: "
                + "; ".join(f"{label} ({why})" for label, why in self.excluded)
                + ". Raise the budget, or name entries the model allows in include=."
            )
        self._start_round()

    def _left_out_by_exclude(self, distr: Distribution, shape: tuple[int, ...]) -> dict[tuple[type, str], str]:
        """The estimators that ``exclude`` leaves out, built at the budget as candidates would be, by
        `_fingerprint`: another entry that builds one of them is left out too (unless named in
        ``candidates``)."""
        out: dict[tuple[type, str], str] = {}
        if self.only is not None:  # the candidates are named: none is left out as another's twin
            return out
        for entry in catalog():
            if entry.label not in self.exclude or not entry.handles(type(distr)):
                continue
            try:
                label, method, _, _ = self._sized(entry, distr, shape)
            except Exception:  # noqa: BLE001  (an entry that cannot sample this node builds nothing to match)
                continue
            if method is not None:
                out.setdefault(_fingerprint(method, distr), label)
        return out

    def _why_not(self, entry: CatalogEntry, kind: type) -> str:
        """Why ``entry`` is not a candidate for ``kind`` (``""``: it is)."""
        if not entry.handles(kind):
            return "does not handle the distribution"
        if self.only is not None and entry.label not in self.only:
            return "not among candidates="
        if entry.label in self.exclude and entry.label not in (self.only or ()):
            default = " (COLD_START, by default: no effective baseline in its first steps)" \
                if self.exclude == COLD_START else ""
            return f"in exclude={default}"
        if not entry.unbiased_for(kind, self.order) and not self.allow_bias:
            return f"not declared unbiased at order {self.order} (allow_bias=True admits it)"
        if entry.requires and entry.label not in self.include:
            return f"requires {entry.requires} (name it in include= if the model meets it)"
        if entry.relaxes and not (self.relaxed or entry.label in self.include):
            return "evaluates the cost at relaxed (continuous) samples (relaxed=True admits it)"
        return ""

    def _sized(
        self, entry: CatalogEntry, distr: Distribution, shape: tuple[int, ...]
    ) -> tuple[str, Optional[Method], int, Optional[int]]:
        """``(label, method or None when over the budget, evaluations per step, count)`` for ``entry``."""
        name = self.plate_name
        if entry.make_counted is None or self.budget is None:
            method = entry.make(name, shape)
            evals = _evaluations(method, distr)
            fits = self.budget is None or evals <= self.budget
            return entry.label, (method if fits else None), evals, None
        try:  # evaluations per sample, from one sample (two for estimators that need them)
            first, per = 1, _evaluations(entry.make_counted(name, shape, 1), distr)
        except ValueError:
            first, per = 2, _evaluations(entry.make_counted(name, shape, 2), distr) / 2
        count = int(self.budget // per)
        if count < first:
            return entry.label, None, int(math.ceil(per * first)), None
        base = re.sub(r"\(n_samples=\d+\)", "", entry.label).rstrip()  # the count replaces it; other settings stay
        method = entry.make_counted(name, shape, count)
        return f"{base} [n={count}]", method, int(round(per * count)), count

    # -------------------------------------------------------------- sampling
    def forward(self, distr: Distribution) -> StochasticTensor:
        if not self.stats:
            if isinstance(distr, Distribution):
                check_floating_parameters(distr, type(self).__name__, self.plate_name)
            self._build(distr)
        if torch.is_grad_enabled():
            if self._clear_optimizer:  # the previous step's update is done: the first round leaves no trace
                self._clear_optimizer = False
                if self.optimizer is not None:
                    self.optimizer.state.clear()
            if self._t0 is None:
                self._t0 = self._clock()
            if self._queue:  # a step of a round: its gradient is measured (the chosen one's are not)
                self._hook_parameters(distr)
        self._listening = False  # a candidate's own autograd calls while it samples are not the step's gradient
        try:
            tensor = self.methods[self._current](distr)
        finally:
            self._listening = True
        node = node_of(tensor)
        # the surrogate asks Auto, which hands over to the method that drew the node (the candidate, or
        # the method it delegated to, as Infer does); without autograd no surrogate asks, and nothing
        # would clear the record (update_parameters runs after a backward)
        if torch.is_grad_enabled():
            self._owners[id(node)] = node.method
        self.__dict__["_owner"] = node.method  # a reference, not a submodule (its state is the candidate's)
        node.method = self
        return tensor

    def _clock(self) -> float:
        """The clock of ``cost``: wall-clock seconds, or this process's CPU seconds for ``"cpu"``."""
        return time.process_time() if self.cost == "cpu" else time.perf_counter()

    def _hook_parameters(self, distr: Distribution) -> None:
        """Sum the squares of the step's gradient with respect to the parameters ``distr`` was built with
        (each tensor once, whatever path the candidate's surrogate takes to it)."""
        with no_dispatch():
            for param in get_distr_parameters(distr).values():
                if id(param) not in self._hooks:
                    self._hooks[id(param)] = param.register_hook(self._add_moment)

    def _add_moment(self, grad: torch.Tensor) -> None:
        if not self._listening:
            return
        with no_dispatch():
            self._moment += float((grad.detach().double() ** 2).sum())

    def _owner_of(self, tensor) -> Method:
        return self._owners.get(id(node_of(tensor)), self._owner or self.candidate)

    @property
    def candidate(self) -> Method:
        """The candidate method of the current (or next) step."""
        if not self.stats:
            raise RuntimeError(f"Auto({self.plate_name!r}) has no candidates before its first sample.")
        return self.methods[self._current]

    @property
    def labels(self) -> list[str]:
        """The candidates' labels."""
        return [s.label for s in self.stats]

    @property
    def choice(self) -> Optional[str]:
        """The label of the candidate of the current (or next) step; ``None`` before the first sample."""
        return self.stats[self._current].label if self.stats else None

    @property
    def settled(self) -> Optional[Method]:
        """The candidate chosen by the latest round (with its learned state); ``None`` before one ends."""
        return None if self._chosen is None else self.methods[self._chosen]

    # the method that drew the step's node answers for it
    @property
    def reparameterized(self) -> bool:  # type: ignore[override]
        return self._owner is not None and self._owner.reparameterized

    @property
    def needs_graph_after_backward(self) -> bool:  # type: ignore[override]
        return self._owner is not None and self._owner.needs_graph_after_backward

    @property
    def handles_joint_bound(self) -> bool:  # type: ignore[override]
        return self._owner is not None and self._owner.handles_joint_bound

    @property
    def n_samples(self) -> int:
        return self.candidate.n_samples if self.stats else 0

    def estimator(self, tensor, cost):
        # the candidate's own gradients while it builds its terms (double control variates' α statistics)
        # are not the step's gradient: the hooks count the backward pass of the surrogate only
        self._listening = False
        try:
            return self._owner_of(tensor).estimator(tensor, cost)
        finally:
            self._listening = True

    def order_needed_below(self, node) -> int:
        return self._owners.get(id(node), self._owner or self.candidate).order_needed_below(node)

    def on_joint_bound(self, cost_name, plate, log_w, later=()) -> None:
        owner = self._owners.get(id(plate.node), self._owner)
        if owner is not None:
            owner.on_joint_bound(cost_name, plate, log_w, later)

    # ------------------------------------------------------------ measuring
    def update_parameters(self, result_triples: Sequence[tuple]) -> None:
        # the step's gradient is complete: stop counting before the candidate's update, which may
        # differentiate the surrogate again (RELAX's and REBAR's variance gradients)
        if self._hooks:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
        moment, self._moment = self._moment, 0.0
        owners = {id(m): m for m in self._owners.values()}
        if len(owners) <= 1:
            next(iter(owners.values()), self._owner or self.candidate).update_parameters(result_triples)
        else:  # several nodes of this Auto in the step, drawn by different methods (as Infer delegates)
            by_owner: dict[int, tuple[Method, list]] = {}
            for triple in result_triples:
                owner = self._owner_of(triple[0])
                by_owner.setdefault(id(owner), (owner, []))[1].append(triple)
            for owner, triples in by_owner.values():
                owner.update_parameters(triples)
        self._owners.clear()
        if self._t0 is None:
            return
        seconds = self._clock() - self._t0
        self._t0 = None
        stats = self.stats[self._current]
        stats.uses += 1
        self.step += 1
        if self._queue:
            cost = float(_evaluations_of(result_triples)) if self.cost == "evaluations" else seconds
            if stats.uses > (stats.warmup if self._round == 1 else 0):
                stats.round_moments.append(moment)
                stats.round_seconds.append(cost)
            else:
                stats.warm_moments.append(moment)
                stats.warm_seconds.append(cost)
            self._prune()
        self._advance()

    # ------------------------------------------------------------ checkpoints
    _SCHEDULE = ("excluded", "switches", "step", "_current", "_chosen", "_round", "_queue", "_exploit_left", "_shape",
                 "_clear_optimizer")

    def get_extra_state(self) -> dict[str, Any]:
        """The measurements and the schedule (the candidates' own state is in their ``state_dict``)."""
        state = {key: copy.deepcopy(getattr(self, key)) for key in self._SCHEDULE}
        state["stats"] = [vars(s).copy() for s in self.stats]
        return state

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if not self.stats:  # a fresh Auto: its candidates, rebuilt from their catalog entries and counts
            shape = tuple(state["_shape"])
            for s in state["stats"]:
                made = catalog_entry(s["entry"])
                self.methods.append(made.make(self.plate_name, shape) if s["count"] is None
                                    else made.make_counted(self.plate_name, shape, s["count"]))
            self.stats = [CandidateStats(**s) for s in state["stats"]]
        labels = [s["label"] for s in state["stats"]]
        if labels != self.labels:
            raise ValueError(
                f"Auto({self.plate_name!r}).load_state_dict: the checkpoint's candidates {labels} differ from this "
                f"Auto's {self.labels}; build it for the same distribution and budget first (Auto.build)."
            )
        for key in self._SCHEDULE:
            if key == "_clear_optimizer" and key not in state:  # a checkpoint of an earlier storch
                self._clear_optimizer = False
                continue
            setattr(self, key, copy.deepcopy(state[key]))
        self.stats = [CandidateStats(**s) for s in state["stats"]]
        self._shape = tuple(self._shape)

    # ------------------------------------------------------------ reporting
    def record(self) -> dict[str, Any]:
        """The choice, the per-candidate table and the switches, as plain data (JSON)."""
        return auto_report.record(self)

    def table(self) -> str:
        """The per-candidate table of the latest round: second moment and score relative to the best."""
        return auto_report.table(self)

    def reset(self) -> None:
        for method in self.methods:
            method.reset()

    def extra_repr(self) -> str:
        return f"plate_name={self.plate_name!r}, budget={self.budget}, choice={self.choice!r}"


def _event_shape(distr: Distribution) -> tuple[int, ...]:
    """The sample's shape beyond the distribution's plates (the catalog's ``event_shape``)."""
    full = tuple(distr.batch_shape) + tuple(distr.event_shape)
    return full[len(distribution_layout(distr).sizes):]


def _fingerprint(method: Method, distr: Distribution) -> tuple[type, str]:
    """What ``method`` is for nodes of ``distr``: the class and the construction (its ``repr``: options,
    sampling method, baseline) of the method that draws them, following a method that delegates (as
    `storch.method.Infer` does), so that two catalog entries that build the same estimator are one
    candidate."""
    delegate = getattr(method, "delegate_for", None)
    drawn = delegate(distr) if delegate is not None else method
    return type(drawn), repr(drawn)


def _evaluations(method: Method, distr: Distribution) -> int:
    """The size of the plate that ``method`` gives a node of ``distr``: the points the cost is evaluated at.

    Sampled from a copy of ``distr`` whose parameters are detached leaves that require grad (estimators
    lay out points for the parameters they differentiate, as measure-valued derivatives do), so that
    nothing reaches the user's graph or is cached on ``distr``; drawn without gradients, so that
    the probe is no node of the step.
    """
    with torch.no_grad():  # and not noted as a node of the step
        tensor = method(_probe(distr))
        return tensor.plate.size


def _probe(distr: Distribution) -> Distribution:
    """A copy of ``distr`` whose floating parameters are detached leaves that require grad, also those of
    the distributions it wraps (`OneHotCategorical` keeps its parameters in a `Categorical`)."""
    probe = copy.copy(distr)
    for name, value in list(vars(probe).items()):
        if isinstance(value, Distribution):
            probe.__dict__[name] = _probe(value)
        elif name in distr.arg_constraints and isinstance(value, torch.Tensor) and value.is_floating_point():
            probe.__dict__[name] = value.detach().requires_grad_()
    return probe


def _evaluations_of(triples: Sequence[tuple]) -> int:
    """The plate sizes of the step's nodes, summed: the points the cost was evaluated at."""
    sizes = {id(node_of(tensor)): tensor.plate.size for tensor, *_ in triples}
    return sum(sizes.values())
