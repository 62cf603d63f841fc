"""storch's random-graph tester: random graphs, storch's estimates against exact values, shrinking.

For one `storch.testing.graphs.Graph`, `storch.testing.fuzz.check_graph`
computes the exact gradient of the expected cost (and at order 2 a Hessian-vector product ``H v``)
with `storch.testing.exact`, draws many independent estimates with storch
(the leaf parameters copied ``R`` times along an independent plate, as
`storch.testing.replicated_gradients` does, over several steps after the
estimators' warm-up steps, so that baselines and control variates learn between steps) and
z-tests every coordinate: with ``N`` estimates of mean ``m`` and standard error ``se``, a coordinate
fails when ``|m − exact| − tol > z · se`` (``z = 5.5`` by default: a correct estimator fails one of a
hundred coordinates with probability below 1e-5, so thousands of graphs raise no false alarm; ``tol``
covers rounding of exact estimators and, where all estimates are equal, an unseen outcome of
probability below ``20/N``). A graph fails when storch raises or a coordinate fails.

`storch.testing.shrink.shrink` reduces a failing graph while it still fails in the same way
(drops costs, nodes, edges, log-probability terms and the plate, lowers the order, makes nodes
smaller and estimators simpler), and `storch.testing.reproducer.reproducer` prints it as a
standalone script. The command line runs many seeds::

    python -m storch.testing.fuzz --count 1000 --out fuzz-failures
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

import storch
from storch.method.catalog import entry
from storch.testing.exact import exact_derivatives
from storch.testing.graphs import Graph, compile_model, event_shape, random_graph, values
from storch.testing.reproducer import reproducer
from storch.testing.shrink import shrink

__all__ = ["Outcome", "check_graph", "storch_estimates", "same_failure", "main"]

#: the z-score beyond which a coordinate fails
Z_LIMIT = 5.5
#: the largest number of evaluation points per replicate and step
POINT_BUDGET = 40_000


@dataclass
class Outcome:
    """The result of checking one graph."""

    graph: Graph
    kind: str  # "pass", "biased" or "error"
    max_z: float = 0.0
    detail: str = ""
    estimates: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.kind != "pass"

    def line(self) -> str:
        g = self.graph
        what = {"pass": f"max |z| {self.max_z:.2f}", "biased": f"BIASED {self.detail}", "error": f"ERROR {self.detail}"}
        nodes = ", ".join(f"{n.name}:{n.kind}[{n.estimator}]" for n in g.nodes)
        return f"seed {g.seed} order {g.order} plate {g.plate} ({nodes}): {what[self.kind]}"


def _points(graph: Graph) -> int:
    """A rough bound on the evaluation points of one replicate (the product of the nodes' plates)."""
    total = max(graph.plate, 1)
    for node in graph.nodes:
        label = node.estimator
        if label == "Expect":
            total *= node.categories ** node.size
        elif label.startswith("LocalExpectation"):
            total *= (2 if "2" in label else 1) * (1 + node.size * (node.categories - 1))
        elif label in ("MVD", "GSB"):
            total *= 1 + 2 * node.size * node.categories
        else:
            total *= 6
    return total


def _direction(graph: Graph, p: dict) -> dict:
    gen = torch.Generator().manual_seed(graph.seed + 17)
    return {k: torch.randn(t.shape, generator=gen, dtype=torch.float64) for k, t in sorted(p.items())}


def storch_estimates(
    graph: Graph, p: dict, x: dict, c: dict, v: Optional[dict], estimates: int
) -> tuple[dict, Optional[dict]]:
    """Independent estimates ``(∇J, H v)`` by parameter name, each ``(N, *shape)``, from storch."""
    model = compile_model(graph)
    # float64 throughout: methods with parameters (control variates, temperatures) are converted
    methods = {n.name: entry(n.estimator).make(n.name, event_shape(n)).to(torch.float64) for n in graph.nodes}
    xs = {k: storch.denote_independent(t, 0, "data") for k, t in x.items()}

    def draw(name: str, q, joint_with=None):
        return methods[name](q) if joint_with is None else methods[name](q, joint_with=joint_with)

    replicates = max(32, min(1000, POINT_BUDGET // _points(graph), estimates))
    steps = max(1, math.ceil(estimates / replicates))
    warmup = max(entry(n.estimator).warmup for n in graph.nodes)
    grads: dict[str, list] = {k: [] for k in p}
    hvs: dict[str, list] = {k: [] for k in p}
    for step in range(warmup + steps):
        storch.reset()
        leaves = {k: t.detach().unsqueeze(0).repeat((replicates,) + (1,) * t.dim()).requires_grad_()
                  for k, t in p.items()}
        views = {k: storch.denote_independent(t, 0, "replicate") for k, t in leaves.items()}
        for name, cost in model(draw, views, xs, c).items():
            storch.add_cost(cost, name)
        storch.backward(create_graph=v is not None)
        if step < warmup:
            continue
        g = {k: (torch.zeros_like(t) if t.grad is None else t.grad * replicates) for k, t in leaves.items()}
        for k in p:
            grads[k].append(g[k].detach())
        if v is not None:
            s = sum((g[k] * v[k]).sum() for k in p if g[k].requires_grad)
            names = [k for k in p]
            hv = (torch.autograd.grad(s, [leaves[k] for k in names], allow_unused=True)
                  if isinstance(s, torch.Tensor) else [None] * len(names))
            for k, h in zip(names, hv):
                hvs[k].append(torch.zeros_like(leaves[k]) if h is None else h.detach())
    storch.reset()
    stack = {k: torch.cat(t) for k, t in grads.items()}
    return stack, ({k: torch.cat(t) for k, t in hvs.items()} if v is not None else None)


def _ztest(estimates: dict, exact: dict, what: str, z_limit: float) -> tuple[float, str, bool]:
    """``(max z, description of the worst coordinate, failed)`` over every coordinate."""
    worst, text, failed = 0.0, "", False
    for k in sorted(exact):
        est = estimates[k].double().reshape(estimates[k].shape[0], -1)
        ex = exact[k].double().reshape(-1)
        n = est.shape[0]
        mean = est.mean(0)
        se = est.std(0) / math.sqrt(n)
        # rounding; and, where all n estimates are equal (se = 0), an unseen outcome of probability below
        # 20/n (missed with probability e^-20): ARMS's three Dirichlet-antithetic samples at p = 0.55 give
        # one value with probability 1 - 3e-4 and 0 otherwise
        unseen = torch.where(se == 0, (20 / n) * (mean.abs() + ex.abs()), torch.zeros_like(se))
        diff = (mean - ex).abs() - 1e-6 * (1 + ex.abs()) - unseen
        z = torch.where(diff > 0, diff / se.clamp_min(1e-300), torch.zeros_like(diff))
        z = torch.where((se == 0) & (diff > 0), torch.full_like(z, math.inf), z)
        i = int(z.argmax())
        if float(z[i]) > worst or not text:
            worst = max(worst, float(z[i]))
            text = (f"{what} {k}[{i}]: mean {float(mean[i]):.5g}, exact {float(ex[i]):.5g}, "
                    f"se {float(se[i]):.3g}, |z| {float(z[i]):.2f} ({n} estimates)")
        failed = failed or bool((z > z_limit).any())
    return worst, text, failed


def check_graph(
    graph: Graph, estimates: int = 1000, z_limit: float = Z_LIMIT, confirm: bool = True, rng_offset: int = 0
) -> Outcome:
    """Check ``graph``: storch's estimates against the exact values (module docstring).

    With ``confirm``, a graph whose z-test fails is checked again with four times the estimates (other
    random numbers), and counts as biased only if it fails again: a heavy-tailed estimator (a score
    function on a Normal's scale) can make the standard error of a thousand estimates too small.
    storch's random numbers start from ``graph.seed + rng_offset``. The graph's tensors are small: it
    runs on one thread (the thread count is restored afterwards), many times faster than on several.
    """
    with _one_thread():
        return _check_graph(graph, estimates, z_limit, confirm, rng_offset)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_graph(graph: Graph, estimates: int, z_limit: float, confirm: bool, rng_offset: int) -> Outcome:
    start = time.perf_counter()
    p, x, c = values(graph)
    v = _direction(graph, p) if graph.order == 2 else None
    exact = exact_derivatives(compile_model(graph, exact=True), graph, p, x, c, v)
    first = graph.seed + rng_offset
    runs = [(first, estimates)] + ([(first + 1, 4 * estimates)] if confirm else [])
    for seed, count in runs:
        torch.manual_seed(seed)
        try:
            got = storch_estimates(graph, p, x, c, v, count)
        except Exception as error:  # noqa: BLE001 -- any error on a supported graph is a finding
            storch.reset()
            lines = [ln for ln in traceback.format_exception_only(type(error), error)[-1].strip().splitlines() if ln]
            detail = " / ".join(lines[:3])[:400]
            return Outcome(graph, "error", detail=detail, seconds=time.perf_counter() - start)
        z, text, failed = _ztest(got[0], exact[0], "gradient", z_limit)
        if got[1] is not None:
            z2, text2, failed2 = _ztest(got[1], exact[1], "Hessian-vector product", z_limit)
            if z2 > z:
                z, text = z2, text2
            failed = failed or failed2
        n = next(iter(got[0].values())).shape[0]
        outcome = Outcome(graph, "biased" if failed else "pass", z, text, n, time.perf_counter() - start)
        if not failed:
            break
    return outcome


def same_failure(outcome: Outcome, estimates: int) -> Callable[[Graph], bool]:
    """The predicate of `storch.testing.shrink.shrink` for ``outcome``: the same error type, or
    a bias again."""
    if outcome.kind == "error":
        error_type = outcome.detail.split(":", 1)[0]
        return lambda g: (o := check_graph(g, estimates)).kind == "error" and o.detail.split(":", 1)[0] == error_type
    return lambda g: check_graph(g, estimates).kind == "biased"


# ----------------------------------------------------------------------------------------- command line


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            seeds.extend(range(int(a), int(b) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m storch.testing.fuzz``: check random graphs; shrink and write each failure."""
    parser = argparse.ArgumentParser(prog="python -m storch.testing.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", help="seeds, e.g. 0-99,150 (default: --start .. --start+--count-1)")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--order", type=int, choices=(1, 2), help="the derivative order (default: drawn)")
    parser.add_argument("--estimator", help="a catalog label that one node of every graph uses")
    parser.add_argument("--estimates", type=int, default=1000, help="independent estimates per graph")
    parser.add_argument("--no-relaxed-log-prob", action="store_true",
                        help="no z.log_prob() terms on nodes whose estimator relaxes the sample")
    parser.add_argument("--no-cross-scores", action="store_true",
                        help="r.log_prob(z) terms with r built from a descendant of z only (or constants)")
    parser.add_argument("--out", help="a folder for the reproducers of failing graphs (shrunk)")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="a line per graph, not only per failure")
    args = parser.parse_args(argv)
    seeds = _seeds(args.seeds) if args.seeds else list(range(args.start, args.start + args.count))
    failures: list[Outcome] = []
    worst = 0.0
    start = time.perf_counter()
    for seed in seeds:
        graph = random_graph(seed, order=args.order, estimator=args.estimator, relaxed_log_prob=not args.no_relaxed_log_prob,
                             cross_scores=not args.no_cross_scores)
        outcome = check_graph(graph, args.estimates)
        if not outcome.failed:
            worst = max(worst, outcome.max_z)
        if args.verbose or outcome.failed:
            print(outcome.line(), flush=True)
        if outcome.failed:
            failures.append(outcome)
            _write(outcome, args)
    seconds = time.perf_counter() - start
    print(f"{len(seeds)} graphs in {seconds:.0f} s: {len(seeds) - len(failures)} passed, "
          f"{len(failures)} failed; max |z| of the passing graphs {worst:.2f} (limit {Z_LIMIT})")
    return 1 if failures else 0


def _write(outcome: Outcome, args: argparse.Namespace) -> None:
    if not args.out:
        return
    import pathlib

    graph = outcome.graph
    small = outcome
    if not args.no_shrink:
        graph = shrink(graph, same_failure(outcome, args.estimates))
        small = check_graph(graph, args.estimates)
        print(f"    shrunk to: {small.line()}", flush=True)
    folder = pathlib.Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"seed_{outcome.graph.seed}.py"
    path.write_text(reproducer(graph, small.line(), args.estimates))
    print(f"    reproducer: {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
