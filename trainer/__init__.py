"""The trainer: its loop, RL losses, checkpoints, and the publisher of its versions to an origin gateway
(`publisher`: whole weights; `shard_publisher`: each rank's rows, in parts; `upload` and `origin_link`:
the publish protocol's client side; `stream_start`: rejoining the gateway's stream at start or
restart), plus the trainer's side of the data interface (the client of the broker's batch API).
Imports `deltamesh.delta` and `deltamesh.gateway`.
"""

from deltamesh.lazy_face import lazy_face

# Loaded on first use: a gateway's command line reads the trainer's settings without its torch stack.
__getattr__, __all__ = lazy_face(__name__, {
    "WeightPublisher": "deltamesh.trainer.weight_publisher",
    "PublishConfig": "deltamesh.trainer.publish_config",
    "Publisher": "deltamesh.trainer.publisher",
    "Published": "deltamesh.trainer.publisher",
    "ShardPublisher": "deltamesh.trainer.shard_publisher",
    "upload_version": "deltamesh.trainer.upload",
})
