"""A trainer's batch polls as a process of their own, for the tests that SIGKILL a trainer.

`python batch_poller.py URL MODEL SIZE POLLS TIMEOUT` polls the broker POLLS times for batches of SIZE
samples (never acknowledging them, as a trainer killed before its checkpoint) and prints one JSON line
per event on stdout: {"event": "polling"} before each poll, then {"event": "batch", "batch_id", "ids",
"tokens"} for each batch received (or {"event": "empty"}). Then it waits for its SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import sys

from deltamesh.trainer.batch_client import BatchClient


def say(event: dict) -> None:
    print(json.dumps(event), flush=True)


async def main(url: str, model_id: str, size: int, polls: int, timeout_s: float) -> None:
    async with BatchClient(url, model_id, auto_ack=False) as client:
        for _ in range(polls):
            say({"event": "polling"})
            batch = await client.next_batch(size, timeout_s=timeout_s)
            if batch is None:
                say({"event": "empty"})
            else:
                say({"event": "batch", "batch_id": batch.batch_id, "ids": [s["id"] for s in batch.samples],
                     "tokens": batch.tokens.tolist()})
        await asyncio.sleep(3600)


if __name__ == "__main__":
    url, model_id, size, polls, timeout_s = sys.argv[1:6]
    asyncio.run(main(url, model_id, int(size), int(polls), float(timeout_s)))
