"""A clean stop on SIGINT or SIGTERM, the same for every long-running deltamesh process.

The first signal logs one "stopping" line and starts the process's own shutdown (a pool finishes or
rolls back its apply and deregisters; a server stops taking requests). The process then exits with
the shell's status for that signal, 130 or 143, so that a shell and a service manager see it was
stopped rather than that it finished (docs/CLI.md). A second signal while stopping ends it at once.
`sleep_or_stop` and `until_stopped` cut a pause or a long poll short when the stop comes;
`wait_event` is the one way a loop here waits for an event with a timeout (see there why not
`asyncio.wait_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Awaitable, Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger(__name__)


def signal_exit(sig: int | None) -> int:
    """The exit status of a process stopped by `sig` (128 + its number; 0 for no signal)."""
    return 0 if sig is None else 128 + int(sig)


class Stop(asyncio.Event):
    """An event set by the first stop signal; `signal` says which (None while not stopped by one)."""

    signal: int | None = None

    @property
    def exit_code(self) -> int:
        return signal_exit(self.signal)


def on_stop_signals(loop: asyncio.AbstractEventLoop, on_stop: Callable[[int], None], what: str) -> None:
    """Call `on_stop(signal)` on the first SIGINT/SIGTERM, after logging that `what` is stopping."""
    stopping: list[int] = []

    def handle(sig: int) -> None:
        if stopping:  # the operator insists: do not wait for the clean stop
            log.warning("%s: %s again, stopping now", what, signal.Signals(sig).name)
            os._exit(signal_exit(stopping[0]))
        stopping.append(sig)
        log.info("%s: stopping (%s)", what, signal.Signals(sig).name)
        on_stop(sig)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handle, sig)


def stop_on_signals(what: str) -> Stop:
    """A `Stop` that SIGINT or SIGTERM sets (call it inside the running event loop)."""
    stop = Stop()

    def on_stop(sig: int) -> None:
        stop.signal = sig
        stop.set()

    on_stop_signals(asyncio.get_running_loop(), on_stop, what)
    return stop


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set (True) or `timeout` seconds pass (False).

    Not `asyncio.wait_for(event.wait(), timeout)`: before Python 3.12, wait_for returns the inner
    result when a cancellation comes just as the inner wait completes, so a loop cancelled at the
    moment its event was set lost the cancellation and went on, and whoever awaited its end after
    cancelling it waited for good. `asyncio.wait` never swallows one.
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `stop` is set first."""
    await wait_event(stop, seconds)


async def until_stopped(coro: Awaitable, stop: asyncio.Event) -> None:
    """Run `coro`, cancelling it if `stop` is set first (a long poll must not delay a shutdown)."""
    work = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.done() and not work.cancelled():
        work.result()

