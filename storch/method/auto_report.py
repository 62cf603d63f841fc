"""What `storch.method.Auto` shows of its choice: the record (plain data, JSON-ready) and the table.

`record` gives the node, the budget, the choice, one row per candidate (its evaluations, the steps it
ran, its cost per step, its second moment and score relative to the lowest, whether it was chosen or
dropped and why), the catalog entries left out with their reasons, and every switch; `table` prints
the candidates' rows of the latest round. `Auto.record` and `Auto.table` call them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from storch.method.auto import Auto

__all__ = ["record", "table"]


def record(auto: "Auto") -> dict[str, Any]:
    """The choice, the per-candidate table and the switches, as plain data (JSON)."""
    scores = auto.scores()
    low_m = min((s.second_moment for s in auto.stats if s.second_moment), default=None)
    low_s = min(scores.values(), default=None)
    rows = []
    for c, s in enumerate(auto.stats):
        rows.append({
            "candidate": s.label, "unbiased": s.unbiased, "evaluations": s.evaluations, "steps": s.uses,
            "cost_per_step": s.seconds,
            "cost_unit": {"time": "seconds", "cpu": "CPU seconds"}.get(auto.cost, "evaluations"),
            "second_moment": s.second_moment,
            "relative_second_moment": _relative(s.second_moment, low_m),
            "relative_score": _relative(scores.get(c), low_s),
            "chosen": c == auto._chosen, "dropped": s.dropped,
        })
    return {
        "node": auto.plate_name, "budget": auto.budget, "order": auto.order, "allow_bias": auto.allow_bias,
        "choice": auto.choice, "settled": None if auto._chosen is None else auto.stats[auto._chosen].label,
        "step": auto.step, "round": auto._round, "candidates": rows,
        "excluded": [{"entry": label, "reason": why} for label, why in auto.excluded],
        "switches": [{"step": t, "from": a, "to": b, "reason": r} for t, a, b, r in auto.switches],
    }


def table(auto: "Auto") -> str:
    """The per-candidate table of the latest round: second moment and score relative to the best."""
    rec = record(auto)
    unit = {"time": "s/step", "cpu": "cpu s/step"}.get(auto.cost, "evals")
    settled = "none yet" if auto._chosen is None else auto.stats[auto._chosen].label
    measuring = f" (a round of measurements: next step {auto.choice})" if auto._queue else ""
    lines = [f"Auto({auto.plate_name!r}) after {auto.step} steps, settled on {settled}{measuring}",
             f"{'candidate':<36} {'evals':>5} {'steps':>6} {unit:>9} {'E|g|^2 rel':>10} {'score rel':>9}"]
    for r in rec["candidates"]:
        cost = "-" if r["cost_per_step"] is None else format(r["cost_per_step"], ".3g")
        mark = " *" if r["chosen"] else ("  (biased)" if not r["unbiased"] else "")
        mark += "  (dropped)" if r["dropped"] else ""
        lines.append(f"{r['candidate']:<36} {r['evaluations']:>5} {r['steps']:>6} {cost:>9} "
                     f"{_fmt(r['relative_second_moment']):>10} {_fmt(r['relative_score']):>9}{mark}")
    return "\n".join(lines)


def _relative(value: Optional[float], low: Optional[float]) -> Optional[float]:
    if value is None or low is None:
        return None
    return value / low if low > 0 else (1.0 if value == 0 else math.inf)


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else format(value, ".3g")
