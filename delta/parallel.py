"""Running independent per-tensor or per-piece work on every core.

numpy (copies, comparisons, fancy indexing), zstd and xxhash (buffers over 64 KiB) release the GIL,
so plain threads scale the codec's passes across cores without copying weights into other
processes. Results come back in input order, so output never depends on scheduling. The cores are
those the calling thread may run on (its CPU affinity: `taskset`, a cgroup cpuset, or
`os.sched_setaffinity`), at most `MAX_WORKERS`: a process pinned to its share of a node's cores, or to
one core, runs that many threads and no more.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = 8


def usable_cores() -> int:
    """The cores the calling thread may run on (threads it starts inherit them)."""
    if sys.platform == "linux":
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _workers(items: list) -> int:
    return min(MAX_WORKERS, usable_cores(), len(items))


def thread_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """`[fn(x) for x in items]`, run on up to one thread per core; the first error is raised."""
    items = list(items)
    workers = _workers(items)
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def thread_stream(fn: Callable[[T], R], items: Iterable[T], ahead: float,
                  weight: Callable[[T], float] | None = None) -> Iterator[R]:
    """`fn(x)` for each of `items`, yielded in input order, with at most `ahead` pending.

    Pending is counted in items, or in `weight(x)` summed over the pending items when `weight` is
    given (say bytes, so one huge item does not stall the other cores the way a count would: while
    a worker is busy with it, the rest move on through smaller ones). Unlike fixed batches, a worker
    that finishes early moves on to the next item while a slow one is still running, so every core
    stays busy; `ahead` bounds memory held. At least one item per core is always pending.
    """
    items = list(items)
    workers = _workers(items)
    if workers <= 1:
        yield from (fn(x) for x in items)
        return
    cost = weight or (lambda _: 1.0)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        held = 0.0
        try:
            for x in items:
                w = cost(x)
                while pending and len(pending) >= workers and held + w > ahead:
                    future, done_w = pending.popleft()
                    held -= done_w
                    yield future.result()
                pending.append((pool.submit(fn, x), w))
                held += w
            while pending:
                yield pending.popleft()[0].result()
        finally:
            for future, _ in pending:
                future.cancel()
