"""The processes of benchmarks/scale.py: trainer ranks (sharded, or gathering to rank 0) and in-memory pools.

A trainer rank builds its rows of the synthetic model (scale_model.py), then for each version the
parent asks for: steps them, and publishes either its own part (`ShardPublisher`, the ranks meeting
on a TCPStore exchange) or, on the rank-0 path, sends them to rank 0 over gloo, which publishes the
whole model with today's `Publisher`. It reports the step's end, the publisher's stages and the peak
resident memory publishing added (sampled every few milliseconds, over the rank's memory with only its
live rows). A pool follows its region's gateway, fetches each new version, verifies it and applies it
in place to the weights it holds in memory (every result tensor checked against the signed manifest),
and reports when it serves it; it has no engine and writes no directory, so its time is what a
pool's verified fetch and apply cost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import scale_model
import torch

from deltamesh.delta import apply_version, load_private_key, tensor_digest
from deltamesh.gateway.fetch.errors import SyncError
from deltamesh.http import HttpError
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.trainer.distributed import shard_rows
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.shard_publisher import ShardPublisher
from deltamesh.trainer.store_exchange import store_exchange

MODEL = "scale"
log = logging.getLogger(__name__)


class PeakRss:
    """The largest resident set size of this process seen since `reset`, sampled on a thread."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.peak = self.baseline = rss_bytes()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, args=(every_s,), daemon=True).start()

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak = max(self.peak, rss_bytes())

    def reset(self) -> None:
        self.peak = self.baseline = rss_bytes()

    def forget_peak(self) -> None:
        """Drop the peak seen so far (the training step's old and new rows at once, which is not
        publishing's), keeping the baseline: what publishing adds is measured from here on."""
        self.peak = self.baseline

    def close(self) -> None:
        self._stop.set()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def trainer_rank(rank: int, world: int, cfg: dict[str, Any], orders, reports) -> None:
    """One trainer rank: for each (mode, version) of `orders` ("digests": report them; None: stop),
    step its rows and publish them that way, reporting on `reports`. The rank-0 path takes over the
    stream where the sharded one left it: rank 0 gathers the last version as its publisher's base."""
    torch.set_num_threads(1)
    specs = scale_model.table(cfg["shapes"])
    rows = {s.name: shard_rows(s.rows, world, rank) for s in specs}
    live = dict(scale_model.blocks(specs, rows))
    shard_bytes = sum(t.numel() * t.element_size() for t in live.values())
    rss = PeakRss()  # the baseline: the rank's live rows, which a trainer holds whether it publishes or not
    key = load_private_key(cfg["key"]) if rank == 0 else None
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['gloo_port']}",
                                         rank=rank, world_size=world)
    shards = ShardPublisher(cfg["gateway"], MODEL, store_exchange("127.0.0.1", cfg["store_port"], rank, world),
                            key=key, full_every=0, connections=4)
    whole: Publisher | None = None
    loop = asyncio.new_event_loop()
    try:
        while (order := orders.get()) is not None:
            mode, version = order
            if mode == "digests":
                reports.put({"who": f"rank{rank}", "digests": {n: tensor_digest(t) for n, t in live.items()},
                             "rows": rows})
                continue
            if mode == "rank0" and shards is not None:
                whole = _take_over(loop, shards, key, cfg, specs, live, rank, world)
                shards = None
                rss.reset()  # the sharded publisher's copies are gone: the rank holds its live rows again
            if version > 0:
                live = {n: scale_model.step_block(t, n, rows[n][0], version) for n, t in live.items()}
            step_end = time.time()
            rss.forget_peak()
            if shards is not None:
                published = loop.run_until_complete(shards.publish(specs, live, rows, version))
            else:
                published = _publish_gathered(loop, whole, specs, live, rank, world, version)
            reports.put({"who": f"rank{rank}", "version": version, "step_end": step_end,
                         "stages": published.stages if published else {}, "shard_bytes": shard_bytes,
                         "added_peak": rss.peak - rss.baseline,
                         "bytes_sent": published.bytes_sent if published else 0})
    finally:
        for publisher in (shards, whole):
            if publisher is not None:
                loop.run_until_complete(publisher.aclose())
        loop.close()
        rss.close()
        torch.distributed.destroy_process_group()


def _take_over(loop, shards: ShardPublisher, key, cfg: dict[str, Any], specs, live, rank: int,
               world: int) -> Publisher | None:
    """Rank 0's whole-weights publisher, based on the last version the ranks published in parts (its
    rows gathered; its weights hash as the signed manifest names it), so the stream goes on in deltas."""
    version, weights_hash = shards.base[0], shards.published_hash
    gathered = _gather(specs, live, rank, world)
    loop.run_until_complete(shards.aclose())
    if rank != 0:
        return None
    publisher = Publisher(cfg["gateway"], key, MODEL, full_every=0, connections=4)
    publisher.set_base(version, gathered, weights_hash)
    return publisher


def _gather(specs, live, rank: int, world: int) -> dict[str, torch.Tensor] | None:
    """Every tensor's rows gathered to rank 0 (gloo): the whole weights there, None elsewhere."""
    whole = {} if rank == 0 else None
    for spec in specs:
        mine = live[spec.name].contiguous()
        if rank == 0:
            parts = [torch.empty((b - a, *spec.shape[1:]), dtype=mine.dtype)
                     for a, b in (shard_rows(spec.rows, world, r) for r in range(world))]
            torch.distributed.gather(mine, parts, dst=0)
            whole[spec.name] = torch.cat(parts)
        else:
            torch.distributed.gather(mine, None, dst=0)
    return whole


def _publish_gathered(loop, publisher: Publisher | None, specs, live, rank: int, world: int, version: int):
    """Today's path: every tensor gathered to rank 0, which encodes and publishes it whole."""
    whole = _gather(specs, live, rank, world)
    if rank != 0:
        return None
    gathered = time.time()
    published = loop.run_until_complete(publisher.publish(whole, version))
    published.stages["gathered"] = gathered
    return published


def pool(name: str, gateway: str, trusted_key: str, workdir: str, reports, stop, first_lock, digest_at) -> None:
    """An in-memory pool: every new version fetched, verified, applied in place and reported (and, after
    version `digest_at.value`, the digests of what it holds, rank by rank). Pools take
    their first version (a full snapshot: its pieces and its decoded tensors at once, ~1.7x the model)
    one at a time under `first_lock`, so that three of them fit this machine's memory; it is not timed."""
    torch.set_num_threads(1)
    # The benchmark's gateways are anonymous (loopback, this run's alone): the token is not checked.
    config = PoolSyncConfig(gateways=[gateway], token="scale-bench", name=name, dir=os.path.join(workdir, name),
                            trusted_keys=[trusted_key], model=MODEL, connections=8, give_up_s=600)
    asyncio.run(_follow(config, reports, stop, first_lock, digest_at))


async def _follow(config: PoolSyncConfig, reports, stop, first_lock, digest_at) -> None:
    held: dict[str, torch.Tensor] | None = None
    manifest = None
    async with WeightSync(config) as sync:
        while not stop.is_set():
            try:
                head = await sync.wait_for_head(1.0, after=None if manifest is None else manifest.version)
            except (SyncError, HttpError) as e:  # a gateway too busy to answer in time: ask again, as a pool does
                log.warning("%s: %s; asking again", config.name, e)
                await asyncio.sleep(0.5)
                continue
            if head is None:
                continue
            seen = time.time()
            first = manifest is None
            if first:
                await asyncio.to_thread(first_lock.acquire)
            try:
                plan = await sync.fetch_plan(head, base=None if manifest is None else manifest.version)
                versions = await sync.fetch_decoded(plan)
                fetched = time.time()
                for decoded in versions:
                    held = await asyncio.to_thread(apply_version, decoded, held if decoded.kind == "delta" else None,
                                                   base_entries=None if manifest is None else manifest.entries(),
                                                   in_place=True)
                    manifest = decoded.manifest
                del versions
            finally:
                if first:
                    first_lock.release()
            reports.put({"who": config.name, "version": manifest.version, "head_seen": seen, "fetched": fetched,
                         "serving": time.time(), "bytes": plan.payload_bytes})
            if manifest.version == digest_at.value:  # the last version of a phase: what every pool holds
                reports.put({"who": config.name, "digests_of": _rows_digests(held), "at": manifest.version})


def _rows_digests(held: dict[str, torch.Tensor]) -> dict[str, dict[str, str]]:
    """Per tensor, the digest of each rank's rows for 1 and 2 ranks (what the ranks report of theirs)."""
    out: dict[str, dict[str, str]] = {}
    for name, t in held.items():
        rows = t.shape[0] if t.dim() else 1
        out[name] = {f"{a}:{b}": tensor_digest(t[a:b] if t.dim() else t)
                     for world in (1, 2) for a, b in [shard_rows(rows, world, r) for r in range(world)] if b > a}
    return out
