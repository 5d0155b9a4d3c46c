"""How a trainer's versions leave its ranks: gathered to rank 0, or built in parts where the weights are.

`VersionStream` hides the two ways from the trainer loop:

- whole (`publish_parts` off, or one process): every step's bf16 weights are gathered to rank 0 (a
  collective), whose `MeshClient` encodes and publishes them (the gateway's stream joined as
  `deltamesh.trainer.stream_start.start_stream` says);
- in parts (`publish_parts` on, or auto on several ranks): every rank copies its own rows to bf16 (no
  collective) and publishes them in the background on a thread of its own
  (`deltamesh.trainer.shard_publisher`: encoded against its own last rows, staged on the origin over its
  own connections, described to rank 0 on a TCPStore exchange); rank 0 signs one manifest for all of them
  and reports each version to the broker. The stream starts with a full snapshot from every rank
  (`start_sharded`). No rank ever holds more than its own rows, twice, and its pieces.

Both cut and hash each version for the pool layouts the trainer is given (`pool_layouts`).
"""

from __future__ import annotations

import threading
import time
from typing import Mapping

import torch
from torch import nn

from deltamesh.delta import load_private_key, read_side_files
from deltamesh.delta.layouts import cuts_for, parse_layout
from deltamesh.loop_thread import LoopThread
from deltamesh.trainer.distributed import DistContext, broadcast_tensors
from deltamesh.trainer.loop_config import TrainLoopConfig
from deltamesh.trainer.mesh_client import MeshClient, PublishOutcome
from deltamesh.trainer.publishing import Publishing, ShardedVersions, rank_publishing
from deltamesh.trainer.shard_publisher import ShardPublisher
from deltamesh.trainer.step import published_shard, published_weights
from deltamesh.trainer.store_exchange import open_store_exchange


class VersionStream:
    """This rank's way of publishing versions (see the module docstring); `client` is rank 0's `MeshClient`."""

    def __init__(self, cfg: TrainLoopConfig, ctx: DistContext, model: nn.Module, *,
                 on_published=None) -> None:
        self.ctx = ctx
        self.model = model
        self.in_parts = cfg.publish_parts == "on" or (cfg.publish_parts == "auto" and ctx.distributed)
        layouts = [parse_layout(text) for text in cfg.pool_layouts]
        settings = cfg.publish_settings(layouts)
        key = load_private_key(cfg.key) if ctx.is_main else None
        side_files = read_side_files(cfg.model) if ctx.is_main else None
        self.thread = LoopThread(f"versions-{cfg.model_id}-{ctx.rank}")
        self.sharded: ShardedVersions | None = None
        self._rank_publishing: Publishing | None = None
        if self.in_parts:
            exchange = open_store_exchange(ctx)  # a collective: every rank, in step
            table, _, rows = published_shard(model)
            shards = ShardPublisher.from_settings(settings, exchange, key=key, side_files=side_files,
                                                  cuts=cuts_for(table, layouts) if layouts else None)
            self.sharded = ShardedVersions(shards, table, rows)
            if not ctx.is_main:
                self._rank_publishing = rank_publishing(self.thread, self.sharded)
        self.client: MeshClient | None = None
        if ctx.is_main:
            assert key is not None
            self.client = MeshClient(broker=cfg.broker, broker_token=cfg.broker_token, publish=settings, key=key,
                                     statement_every_s=cfg.statement_every_s, on_published=on_published,
                                     side_files=side_files, sharded=self.sharded, thread=self.thread)

    def start(self, version: int, stop: threading.Event) -> int | None:
        """Join the gateway's stream with the trainer's `version`; the version counter from now on (None
        when stopped before the gateway could be reached). A collective."""
        if self.in_parts:
            started = self.client.start(version, None, stop) if self.client is not None else None
            at = self._share(-1 if self.client is not None and started is None else
                             started.version if started is not None else 0)
            if at >= 0:
                self.publish(at, {})  # the first version: every rank's full snapshot
            return at if at >= 0 else None
        weights = published_weights(self.model, self.ctx)  # a collective: the whole weights on rank 0
        started = self.client.start(version, weights, stop) if self.client is not None else None
        counter = self._share(-1 if started is None else started.version)
        return counter if counter >= 0 else None

    def publish(self, version: int, stages: Mapping[str, float]) -> float:
        """Publish the model's current weights as `version` in the background (gathering them to rank 0
        first, a collective, unless in parts); the seconds this waited for the previous publish."""
        if self.in_parts:
            _, weights, _ = published_shard(self.model)
        else:
            weights = published_weights(self.model, self.ctx)
        cast = {**stages, "cast": time.time()}
        if self.client is not None:
            return self.client.publish(weights, version, cast)
        if self._rank_publishing is not None:
            return self._rank_publishing.publish(weights, version, cast)
        return 0.0

    def wait_encoded(self) -> float:
        """Wait until this rank's publish in flight is encoded; the seconds waited."""
        if self.client is not None:
            return self.client.wait_encoded()
        return self._rank_publishing.wait_encoded() if self._rank_publishing is not None else 0.0

    def wait_published(self) -> float:
        if self.client is not None:
            return self.client.wait_published()
        return self._rank_publishing.wait_published() if self._rank_publishing is not None else 0.0

    def close(self) -> None:
        """Finish the publish in flight, close the connections, stop the thread."""
        try:
            if self.client is not None:
                self.client.close()
            elif self._rank_publishing is not None:
                self._rank_publishing.wait_published()
                self.thread.call(self.sharded.aclose())
        finally:
            self.thread.close()

    def _share(self, value: int) -> int:
        """Rank 0's integer on every rank."""
        sent = broadcast_tensors({"v": torch.tensor([value])} if self.ctx.is_main else None, {"v": torch.int64},
                                 self.ctx)["v"]
        return int(sent[0])


__all__ = ["VersionStream", "PublishOutcome"]
