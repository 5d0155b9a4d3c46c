"""A tensor's xxh3-128 digest taken on the host while its words stay on their device.

xxh3 has no GPU implementation, and the digest a manifest names a tensor by is over its bytes, so a
tensor scanned on a GPU still crosses to the host once, chunk by chunk, to be hashed there. On CUDA
each chunk is copied into one of two pinned host buffers without waiting (`feed`), and the chunk fed
before it is hashed meanwhile, so the copy over the host link and the device's own work on the chunk
overlap the host's hashing; what the host holds at a time is two chunks, never the tensor. On
another accelerator each chunk is copied as torch does by default, and a CPU tensor's chunks are
hashed in place. The digest equals `hashing.digest` of the whole tensor's bytes: xxh3's streaming
form does not depend on where the input is cut.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from .errors import CodecError


class StreamedDigest:
    """Hashes the chunks of one tensor's words fed in order; `hexdigest` once all are fed."""

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self._hasher = xxhash.xxh3_128()
        self._cuda = device.type == "cuda"
        self._chunk_bytes = chunk_bytes
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        self._pending: tuple[np.ndarray, torch.cuda.Event | None] | None = None

    def feed(self, words: torch.Tensor) -> None:
        """Queue the next chunk (a contiguous 1-D word view on the device), then hash the previous one."""
        raw = words.view(torch.uint8)
        if raw.numel() > self._chunk_bytes:
            raise CodecError(f"a chunk of {raw.numel()} bytes is over the {self._chunk_bytes} this digest buffers")
        if self._cuda:
            staged = self._copy_async(raw)
        elif raw.device.type == "cpu":
            staged = (raw.numpy(), None)
        else:
            staged = (raw.cpu().numpy(), None)
        self._hash_pending()
        self._pending = staged

    def hexdigest(self) -> str:
        self._hash_pending()
        return self._hasher.hexdigest()

    def _copy_async(self, raw: torch.Tensor) -> tuple[np.ndarray, torch.cuda.Event]:
        if len(self._buffers) < 2:
            self._buffers.append(torch.empty(self._chunk_bytes, dtype=torch.uint8, pin_memory=True))
        # Two buffers take turns: the one written now was hashed before this call returned last time.
        buffer = self._buffers[self._turn][: raw.numel()]
        self._turn ^= 1
        buffer.copy_(raw, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(raw.device))
        return buffer.numpy(), copied

    def _hash_pending(self) -> None:
        if self._pending is None:
            return
        data, copied = self._pending
        self._pending = None
        if copied is not None:
            copied.synchronize()
        self._hasher.update(data)
