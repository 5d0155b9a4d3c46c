"""thread_stream: results in input order, and never more pending work than its window allows; thread_map and
thread_stream run no more threads than the cores the caller may run on."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from deltamesh.delta.parallel import thread_map, thread_stream


def test_results_come_in_input_order_whatever_finishes_first():
    def slow_first(i: int) -> int:
        time.sleep(0.05 if i == 0 else 0.001)
        return i * i

    assert list(thread_stream(slow_first, range(20), ahead=4)) == [i * i for i in range(20)]


@pytest.mark.parametrize("weights", [[100, 1, 1, 1, 1, 1, 1, 1, 1, 1], [5] * 12, [60, 60, 60, 1, 1]])
def test_weighted_window_bounds_pending_work(weights):
    """Pending weight stays within `ahead` (beyond one item per worker), and items are handed out
    as far ahead as the window allows: a heavy first item does not hold back the light ones."""
    lock = threading.Lock()
    started: list[int] = []
    consumed: list[int] = []
    submitted_before_first: list[int] = []
    peak = {"weight": 0}
    submitted = []

    def weigh(i: int) -> float:
        submitted.append(i)
        return weights[i]

    def work(i: int) -> int:
        with lock:
            started.append(i)
            peak["weight"] = max(peak["weight"], sum(weights[j] for j in started if j not in consumed))
        time.sleep(0.01)
        return i

    out = []
    for i in thread_stream(work, range(len(weights)), ahead=110, weight=weigh):
        if not out:
            submitted_before_first.extend(submitted)
        with lock:
            consumed.append(i)
        out.append(i)
    assert out == list(range(len(weights)))
    expected_first = 0
    held = 0
    for w in weights:  # what the window admits before the first result must be taken
        if expected_first >= 2 and held + w > 110:
            break
        held += w
        expected_first += 1
    # The window weighs one item past what it admits before it yields.
    assert len(submitted_before_first) == min(expected_first + 1, len(weights))
    assert peak["weight"] <= max(110, sum(sorted(weights)[-2:]))


def test_error_propagates_and_stops():
    def boom(i: int) -> int:
        if i == 3:
            raise ValueError("item 3")
        return i

    with pytest.raises(ValueError, match="item 3"):
        list(thread_stream(boom, range(10), ahead=2))


@pytest.mark.skipif(sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores to pin a thread to one")
def test_a_thread_pinned_to_one_core_runs_the_work_itself():
    """Pinned to one core (as a benchmark measuring one core's speed pins itself), the codec's passes
    start no threads: every item runs in the caller's thread. Unpinned, the same call uses several."""
    seen: dict[str, set[int]] = {}

    def run(label: str, pin: bool) -> None:
        if pin:  # affinity is per thread: only this helper thread is pinned
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

        def work(_: int) -> int:
            time.sleep(0.01)
            return threading.get_ident()

        seen[label + " map"] = set(thread_map(work, range(8)))
        seen[label + " stream"] = set(thread_stream(work, range(8), ahead=8))
        seen[label + " caller"] = {threading.get_ident()}

    for label, pin in (("pinned", True), ("free", False)):
        t = threading.Thread(target=run, args=(label, pin))
        t.start()
        t.join()
    assert seen["pinned map"] == seen["pinned stream"] == seen["pinned caller"]
    assert len(seen["free map"]) >= 2 and seen["free caller"].isdisjoint(seen["free map"])
