"""The trainer: its loop, RL losses, publishing through a gateway, and the trainer's side of the data
interface (the trajectory and batch format and the client of the broker's batch API).
Imports `deltamesh.delta` and `deltamesh.gateway`.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Loaded on first use: a gateway's command line reads the trainer's settings without its torch stack.
    if name == "WeightPublisher":
        from deltamesh.trainer.weight_publisher import WeightPublisher

        return WeightPublisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["WeightPublisher"]
