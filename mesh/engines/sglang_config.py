"""The settings of the SGLang engine adapter (sglang_engine.py): which server, how to launch it, and how
versions reach it (tensors sent in place, or a reload from disk). Validated on construction."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

from deltamesh.config import http_url


@dataclass
class SGLangEngineConfig:
    model_id: str
    model_path: str = ""
    """Weights the launched server starts from; also where the tokenizer is read unless set below."""
    url: str = ""
    """Attach to the SGLang server at this base URL instead of launching one."""
    tokenizer_path: str = ""
    host: str = "127.0.0.1"
    port: int = 30000
    launch_command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "sglang.launch_server"])
    extra_args: list[str] = field(default_factory=list)
    """More `sglang.launch_server` flags, e.g. ["--mem-fraction-static", "0.7"]."""
    log_path: str = ""
    """File the launched server's output is appended to (empty: discarded)."""
    version: int | None = None
    """Version served at start; None takes it from `model_path`'s manifest, else 0."""
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    update_timeout_s: float = 900.0
    connections: int = 256
    weight_update: Literal["tensor", "disk"] = "tensor"
    """tensor: `apply_update` sends the server only the tensors a version changes (needs `model_path`,
    the host copy's source, and the server on this machine); disk: every version reloads from the
    synced directory."""
    tensor_device: str = "cuda"
    """Where sent tensors are put for the server to map: "cuda" (CUDA IPC, the GPU the server uses) or
    "cpu" (shared memory; a server that copies from host memory, such as the test stand-in)."""
    tp_size: int = 1
    """The server's tensor-parallel size: `serialized_named_tensors` has one entry per rank."""
    bucket_bytes: int = 1 << 30
    """Most tensor bytes per `/update_weights_from_tensor` request."""
    read_back_max_elements: int = 1 << 20
    """`served_digests` reads back no tensor larger than this (SGLang answers JSON floats, ~12 bytes per
    element); those get None, which the pool's check counts as unread, not as wrong."""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be set")
        if not self.url and not self.model_path:
            raise ValueError("set url (attach to a server) or model_path (launch one)")
        if self.url:
            self.url = http_url(self.url, "url")
        if not self.url and not self.launch_command:
            raise ValueError("launch_command must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if min(self.startup_timeout_s, self.request_timeout_s, self.update_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.weight_update not in ("tensor", "disk"):
            raise ValueError(f"weight_update must be tensor or disk, got {self.weight_update!r}")
        if min(self.tp_size, self.bucket_bytes, self.read_back_max_elements) < 1:
            raise ValueError("tp_size, bucket_bytes and read_back_max_elements must be >= 1")
