"""The trainer side of the `deltamesh` backend: a `WeightSource` published through the mesh, then taken.

`WeightTransferTrainerFactory.trainer_init(DeltameshTrainerInitInfo(...), client=..., source=...)`
(the factory knows the name once deltamesh is installed) builds `DeltameshTrainerWeightTransferEngine`
on every trainer rank. The sender (rank 0) opens a `deltamesh.trainer.WeightPublisher` to
the origin gateway (the `[publish]` settings: its URL, the model id, the trainer's signing key, its
token, TLS) and tells the inference servers to initialise their side with `engine_init`, the
`init_info` of their region (their gateways, pool token file, trusted key: `config.BackendConfig`).

`send_weights()` runs one round: every rank iterates the source (materialising FSDP shards is a
collective); the sender publishes the tensors as the next version, a signed delta (or the periodic
full snapshot) on the last one, then drives the servers through the client: `start_weight_update`,
`update_weights` naming the version, `finish_weight_update` naming it as the servers' weight version.
Each server fetches the version through its own region's gateway, verifies and applies it, or refuses
it (the client's call then raises, and the servers keep what they served). `version` is the last
version the servers took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from deltamesh.config import from_dict
from deltamesh.delta.layouts import parse_layout
from deltamesh.mesh.vllm_plugin import BACKEND
from deltamesh.mesh.vllm_plugin.config import BackendConfig
from deltamesh.trainer import WeightPublisher
from deltamesh.trainer.publish_config import PublishConfig
from deltamesh.trainer.publisher import Published


@dataclass
class DeltameshTrainerInitInfo(TrainerInitInfo):
    """The trainer engine's settings: where it publishes and what the servers are told at init."""

    backend: ClassVar[str] = BACKEND
    publish: dict[str, Any] = field(default_factory=dict)
    """The `[publish]` table (`deltamesh.trainer.publish_config.PublishConfig`): gateway (the origin), model, key,
    token, full_every, piece_mib, connections, tls."""
    engine_init: dict[str, Any] = field(default_factory=dict)
    """The servers' `init_info` (`deltamesh.mesh.vllm_plugin.config.BackendConfig`); its model is the
    published one when left out."""
    side_files_dir: str = ""
    """A model directory whose config and tokenizer ship with every version; empty: none."""
    pool_layouts: list[str] = field(default_factory=list)
    """The layouts of the tensor-parallel servers that take the versions (`tp2`, `tp4-kv2`, `ep4`: as
    `deltamesh train --pool-layout`): each version is cut and hashed for them, so that each of their
    ranks fetches and verifies only its own share. A server of a layout not listed refuses the versions."""


class DeltameshTrainerWeightTransferEngine(TrainerWeightTransferEngine[DeltameshTrainerInitInfo]):
    """See the module docstring."""

    init_info_cls = DeltameshTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, publisher: WeightPublisher | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.publisher = publisher
        self.version: int | None = None
        """The last version the servers took."""

    @classmethod
    def trainer_init(cls, init_info: DeltameshTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        if source is None:
            raise ValueError("the deltamesh trainer engine needs a WeightSource (e.g. vLLM's ModuleSource)")
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False)
        publish = from_dict(PublishConfig, init_info.publish, where="publish")
        engine_init = {"model": publish.model, **init_info.engine_init}
        from_dict(BackendConfig, engine_init, where="engine_init")  # wrong settings fail here, not on a server
        layouts = [parse_layout(text) for text in init_info.pool_layouts]
        publisher = WeightPublisher(publish, side_files_dir=init_info.side_files_dir or None, layouts=layouts)
        try:
            client.init_weight_transfer_engine(engine_init)
        except BaseException:
            publisher.close()
            raise
        return cls(client=client, source=source, is_sender=True, publisher=publisher)

    def send_weights(self, version: int | None = None) -> Published | None:
        """Publish the source's weights as `version` (default: the next) and have the servers take it;
        the sender returns what was published, the other ranks None."""
        assert self.source is not None
        tensors = {name: t for name, t in self.source}  # every rank: the gathers are collectives
        if not self.is_sender or self.publisher is None:
            return None
        published = self.publisher.publish(tensors, version)
        # A server that refuses the version ends its update session itself and keeps what it served: the
        # client's `update_weights` raises, and there is nothing to finish.
        self.client.start_weight_update()
        self.client.update_weights({"version": published.version})
        self.client.finish_weight_update(str(published.version))
        self.version = published.version
        return published

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
