"""Running independent per-tensor or per-piece work on every core.

numpy (copies, comparisons, fancy indexing), zstd and xxhash (buffers over 64 KiB) release the GIL,
so plain threads scale the codec's passes across cores without copying weights into other
processes. Results come back in input order, so output never depends on scheduling.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = 8


def thread_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """`[fn(x) for x in items]`, run on up to one thread per core; the first error is raised."""
    items = list(items)
    workers = min(MAX_WORKERS, os.cpu_count() or 1, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))
