"""`storch._step.StepLog`: the per-context lists of a step's costs and sampled nodes."""

from __future__ import annotations

import contextvars
import threading

import torch

import storch
from storch import inference
from storch._step import StepLog


def test_appends_in_order_and_clears():
    log = StepLog("test")
    assert log.items() == () and len(log) == 0
    for i in range(5):
        log.append(i)
    assert log.items() == (0, 1, 2, 3, 4) and len(log) == 5
    log.clear()
    assert log.items() == () and len(log) == 0


def test_one_context_appends_in_place():
    """The T-th append copies nothing: one context keeps extending one list (a tuple would be
    copied at each append, O(T²) for an episode)."""
    log = StepLog("test")
    log.append(0)
    shared = log._var.get().items
    for i in range(1, 1000):
        log.append(i)
    assert log._var.get().items is shared and len(shared) == 1000


def test_a_copied_context_sees_what_it_appended_and_nothing_else():
    log = StepLog("test")
    log.append("parent")
    child_context = contextvars.copy_context()
    child_context.run(log.append, "child")
    log.append("parent again")  # the child extended the shared list: the parent copies its prefix
    assert log.items() == ("parent", "parent again")
    assert child_context.run(log.items) == ("parent", "child")
    child_context.run(log.append, "child again")
    assert child_context.run(log.items) == ("parent", "child", "child again")
    assert log.items() == ("parent", "parent again")


def test_holds_answers_for_this_context_only():
    log = StepLog("test", key=str)
    log.append(1)
    child_context = contextvars.copy_context()
    child_context.run(log.append, 2)  # in place: the shared index now has 2, past the parent's prefix
    assert log.holds("1") and not log.holds("2")
    assert child_context.run(log.holds, "2")
    log.append(3)  # the parent copies its prefix, with an index of its own
    assert log.holds("3") and not log.holds("2") and not child_context.run(log.holds, "3")
    log.clear()
    assert not log.holds("1") and child_context.run(log.holds, "1")


def test_threads_appending_from_one_copied_context_keep_their_own_items():
    log = StepLog("test", key=lambda item: item)
    log.append("start")
    start = contextvars.copy_context()
    seen = {}
    barrier = threading.Barrier(4)

    def worker(k: int) -> None:
        barrier.wait()
        for i in range(2000):
            log.append((k, i))
        seen[k] = log.items()
        assert all(log.holds((k, i)) for i in range(2000)) and not log.holds(((k + 1) % 4, 0))

    threads = [threading.Thread(target=start.copy().run, args=(worker, k)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        assert seen[k] == ("start",) + tuple((k, i) for i in range(2000))
    assert log.items() == ("start",)


def test_costs_of_a_long_step_are_kept_in_order_and_forgotten_by_reset():
    for t in range(300):
        storch.add_cost(torch.tensor(float(t)), f"r{t}")
    costs = storch.registered_costs()
    assert [c.name for c in costs] == [f"r{t}" for t in range(300)]
    assert storch.surrogate_loss().item() == sum(range(300))
    storch.reset()
    assert storch.registered_costs() == () and len(inference._COSTS) == 0
