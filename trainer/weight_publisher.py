"""Publishing from any PyTorch training loop: a module's or a state dict's weights as the next version.

A lab whose trainer is not deltamesh's (`deltamesh train`) publishes with three lines:

    from deltamesh.trainer import WeightPublisher
    publisher = WeightPublisher.from_file("publish.toml")   # [publish]: gateway, model, key, TLS
    publisher.publish(model)                                 # after each optimizer step

`publish` casts the floating tensors to bf16 on the CPU (tied tensors once, as Hugging Face stores
them), then encodes the version against the last one this publisher sent (the first one of a process
is a full snapshot numbered after the gateway's head), signs it with the trainer's key and uploads it
to the origin gateway with the trainer's token (`deltamesh.trainer.publisher.Publisher`); it returns
once the origin holds it. It runs the publisher's asyncio client on a thread of its own
(`deltamesh.loop_thread`), so the calling loop needs none. The settings are the `[publish]` table of
`deltamesh publish` (`deltamesh.trainer.publish_config.PublishConfig`); the token never goes in the file: it
comes from `token_file` or `$DELTAMESH_TOKEN`.

It lives in the trainer part, not the base package: publishing encodes and signs versions (the codec)
and speaks to the gateway (the weight network), which the base package may not import.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from deltamesh.config import load_config
from deltamesh.config_flags import read_secret
from deltamesh.delta.keys import load_private_key
from deltamesh.delta.layouts import PoolLayout
from deltamesh.delta.side_files import read_side_files
from deltamesh.loop_thread import LoopThread
from deltamesh.trainer.publish_config import PublishConfig
from deltamesh.trainer.publisher import Published, Publisher
from deltamesh.trainer.step import PUBLISH_DTYPE, published_weights

TOKEN_ENV = "DELTAMESH_TOKEN"


class WeightPublisher:
    """A trainer's stream of versions to its origin gateway (see the module docstring)."""

    def __init__(self, config: PublishConfig, *, side_files_dir: str | Path | None = None,
                 layouts: Sequence[PoolLayout] = ()) -> None:
        """`side_files_dir`: a model directory whose config and tokenizer files ship with every version
        (so that a fresh pool's directory loads with `from_pretrained`); None: none ship. `layouts`: the
        pool layouts each version is cut and hashed for (`deltamesh.delta.layouts`), so that every rank of
        such a pool fetches and verifies its own share alone."""
        self.config = config
        self.publisher = Publisher.from_settings(
            dataclasses.replace(config.publish_settings(), layouts=tuple(layouts)), load_private_key(config.key),
            side_files=read_side_files(side_files_dir) if side_files_dir is not None else None)
        self.version: int | None = None
        """The last version published (None before the first)."""
        self._thread = LoopThread(f"publish-{config.model}")

    @classmethod
    def from_file(cls, path: str | Path, *, section: str = "publish", token_file: str | None = None,
                  side_files_dir: str | Path | None = None, **overrides: Any) -> "WeightPublisher":
        """The publisher of table `section` of the TOML file `path` (keys of `PublishConfig`); `overrides`
        set keys beside the file's. The token is read from `token_file`, else `$DELTAMESH_TOKEN`."""
        token = read_secret(token_file, "token_file") if token_file else os.environ.get(TOKEN_ENV)
        config = load_config(PublishConfig, path, section=section, overrides={"token": token or None, **overrides})
        return cls(config, side_files_dir=side_files_dir)

    def publish(self, weights: nn.Module | Mapping[str, torch.Tensor], version: int | None = None) -> Published:
        """Publish `weights` (a module, or a state dict) as `version` (default: the next one); returns once
        the origin gateway holds it. Raises `deltamesh.http.HttpError` when the gateway refuses it or
        cannot be reached; the next call then encodes against the last version that got through."""
        tensors = publishable(weights)
        published = self._thread.call(self.publisher.publish(tensors, version))
        self.version = published.version
        return published

    def close(self) -> None:
        try:
            self._thread.call(self.publisher.aclose())
        finally:
            self._thread.close()

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def publishable(weights: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A version's tensors from a module (its state, tied tensors once) or a state dict: floating tensors
    cast to bf16, every tensor a CPU copy that the training loop's next step leaves alone."""
    if isinstance(weights, nn.Module):
        tensors = published_weights(weights)
        assert tensors is not None  # a single process is its own rank 0
        return tensors
    out = {}
    for name, t in weights.items():
        t = t.detach()
        target = PUBLISH_DTYPE if t.is_floating_point() else t.dtype
        out[name] = t.to("cpu", target, copy=True).contiguous()
    return out
