"""The engine's step lock: a weight write waits for the forward pass in progress only, not for one pass
of every generation queued before it."""

from __future__ import annotations

import asyncio

from deltamesh.mesh.engines.step_lock import StepLock


def test_a_write_goes_before_the_passes_queued_ahead_of_it():
    lock, order = StepLock(), []

    async def generation(name: str, passes: int) -> None:
        for i in range(passes):
            async with lock.passes():
                order.append(f"{name}{i}")
                await asyncio.sleep(0.01)

    async def write() -> None:
        async with lock.write():
            order.append("write")

    async def main() -> None:
        gens = [asyncio.create_task(generation(n, 3)) for n in "abc"]
        await asyncio.sleep(0.005)  # a0 in progress, b and c queued on the lock
        await write()
        await asyncio.gather(*gens)

    asyncio.run(main())
    assert order[:2] == ["a0", "write"], order
    assert sorted(order[2:]) == sorted(f"{n}{i}" for n in "abc" for i in range(3) if f"{n}{i}" != "a0")


def test_passes_take_turns_again_after_the_write():
    lock, order = StepLock(), []

    async def generation(name: str) -> None:
        for i in range(2):
            async with lock.passes():
                order.append(f"{name}{i}")
                await asyncio.sleep(0.01)

    async def main() -> None:
        async with lock.write():
            tasks = [asyncio.create_task(generation(n)) for n in "ab"]
            await asyncio.sleep(0.02)
            assert order == []  # nothing passes while a write holds the lock
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert order == ["a0", "b0", "a1", "b1"], order
