"""The exchange of a sharded trainer's ranks when they publish a version in parts: torch's TCPStore.

`deltamesh.trainer.shard_publisher` has each rank put its part's description on an exchange and rank 0
put the outcome (`deltamesh.trainer.exchange.PartExchange`). Across processes that is a TCPStore
of torch.distributed, a small key-value server every rank reaches: rank 0 serves it on a free port
of the master address and tells the others the port with one broadcast (`open_store_exchange`, a
collective every rank calls once, at start-up, in step with the others). It is separate from the
process group's own store, and only the publishers' threads use it (never a collective), so it runs
beside training. Values are the publishers' JSON bytes.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from deltamesh.trainer.distributed import DistContext, broadcast_tensors


class StoreExchange:
    """A `PartExchange` over a TCPStore (one client per rank)."""

    def __init__(self, store: dist.TCPStore, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world

    def put(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError as e:
            raise TimeoutError(f"no value for {key!r} within {timeout_s:g} s") from e
        return self.store.get(key)

    def delete(self, key: str) -> None:
        self.store.delete_key(key)


def store_exchange(host: str, port: int, rank: int, world: int, timeout_s: float = 300.0) -> StoreExchange:
    """Rank `rank`'s exchange on the store rank 0 serves at host:port (port 0 on rank 0: a free one,
    see `.store.port`)."""
    store = dist.TCPStore(host, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return StoreExchange(store, rank, world)


def open_store_exchange(ctx: DistContext) -> StoreExchange:
    """Every rank's exchange, rank 0 serving it; a collective (call it on every rank, in step)."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    mine = store_exchange(host, 0, 0, ctx.world_size) if ctx.is_main else None
    port = broadcast_tensors({"port": torch.tensor([mine.store.port if mine else 0])} if ctx.is_main else None,
                             {"port": torch.int64}, ctx)["port"]
    return mine or store_exchange(host, int(port[0]), ctx.rank, ctx.world_size)
