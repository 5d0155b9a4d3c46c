"""How the ranks of a trainer that publish a version in parts tell each other what they did.

Each rank encodes and stages its own part (shard_publisher.py), then `put`s the part's description
under a key of its own; rank 0 `get`s every rank's (blocking, with a deadline: a rank that died never
answers and the version is not published), signs the manifest and `put`s the outcome, which the
other ranks `get`. Values are bytes (JSON: never pickle). An exchange is a small key-value store
shared by the ranks: `LocalExchange` for ranks that are threads of one process (tests, benchmarks),
and, for ranks that are processes, the trainer's (`deltamesh.trainer.store_exchange`: torch's
TCPStore, which torchrun's ranks reach anyway).
"""

from __future__ import annotations

import threading
from typing import Protocol


class PartExchange(Protocol):
    rank: int
    world: int

    def put(self, key: str, value: bytes) -> None:
        """Set `key` (never set before) to `value` for every rank to read."""
        ...

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of `key`, waiting up to `timeout_s` for it to be set (TimeoutError)."""
        ...

    def delete(self, key: str) -> None:
        """Forget `key` (no rank reads it again)."""
        ...


class LocalBoard:
    """The shared store of `LocalExchange`s: ranks that are threads of one process."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def put(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout_s):
                raise TimeoutError(f"no value for {key!r} within {timeout_s:g} s")
            return self._values[key]

    def delete(self, key: str) -> None:
        with self._changed:
            self._values.pop(key, None)

    def __len__(self) -> int:
        return len(self._values)


class LocalExchange:
    """One rank's view of a `LocalBoard`."""

    def __init__(self, board: LocalBoard, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.board, self.rank, self.world = board, rank, world

    def put(self, key: str, value: bytes) -> None:
        self.board.put(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        return self.board.get(key, timeout_s)

    def delete(self, key: str) -> None:
        self.board.delete(key)
