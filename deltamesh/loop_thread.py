"""An asyncio event loop in a daemon thread, for synchronous callers of the project's asyncio clients.

A training loop, or a vLLM worker whose weight-transfer calls arrive on its own thread, cannot await
the gateway and broker clients (aiohttp sessions belong to one event loop). `LoopThread` runs one
loop for the caller's lifetime: `call` blocks on a coroutine run there, `submit` returns its future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread, fed coroutines from other threads."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
