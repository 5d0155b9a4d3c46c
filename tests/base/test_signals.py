"""`wait_event`: a loop waiting on an event with a timeout stops when cancelled, even at the moment the
event is set (where `asyncio.wait_for` before Python 3.12 drops the cancellation)."""

import asyncio
import sys
import time

import pytest

from deltamesh.signals import sleep_or_stop, wait_event


async def _wait_for(event: asyncio.Event) -> None:
    try:
        await asyncio.wait_for(event.wait(), 5)
    except asyncio.TimeoutError:
        pass


async def _wait_event(event: asyncio.Event) -> None:
    await wait_event(event, 5)


async def _cancelled_as_the_event_is_set(wait, steps: int) -> str:
    """A `while True` loop like a gateway's GC or sync loop: set its event, let `steps` turns of the
    event loop pass, cancel it. Says whether it ended cancelled or went on waiting."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait(event)
            event.clear()

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0.01)
    event.set()
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(task), 1.0)
    except asyncio.CancelledError:
        return "cancelled"
    except asyncio.TimeoutError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "went on"
    return "ended"


@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_a_loop_cancelled_as_its_event_is_set_stops(steps):
    assert asyncio.run(_cancelled_as_the_event_is_set(_wait_event, steps)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancellation from 3.12")
def test_the_same_loop_on_wait_for_loses_the_cancellation():
    """What the check above would see with the code it replaced."""
    assert asyncio.run(_cancelled_as_the_event_is_set(_wait_for, 0)) == "went on"


def test_wait_event_says_whether_the_event_came():
    async def main() -> tuple[bool, bool, float]:
        event = asyncio.Event()
        t0 = time.monotonic()
        late = await wait_event(event, 0.05)
        waited = time.monotonic() - t0
        asyncio.get_running_loop().call_later(0.01, event.set)
        return late, await wait_event(event, 5), waited

    timed_out, came, waited = asyncio.run(main())
    assert timed_out is False and came is True and waited >= 0.04


def test_sleep_or_stop_ends_at_the_stop():
    async def main() -> float:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.02, stop.set)
        t0 = time.monotonic()
        await sleep_or_stop(stop, 30)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5
