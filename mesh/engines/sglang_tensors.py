"""The body of SGLang's `POST /update_weights_from_tensor`: named tensors the way SGLang's serializer writes them.

SGLang's request (`UpdateWeightsFromTensorReqInput`) is JSON: `serialized_named_tensors`, a list with
one entry per tensor-parallel rank, plus `load_format` (null: a list of (name, tensor) pairs),
`flush_cache`, `abort_all_requests` and `weight_version`. Each entry is what SGLang's
`MultiprocessingSerializer.serialize(named_tensors, output_str=True)` produces: the base64 text of a
`multiprocessing.reduction.ForkingPickler` pickle of `[(name, tensor), ...]`. With torch imported,
ForkingPickler reduces a tensor to a handle, not its bytes: a CUDA tensor to a CUDA IPC handle (with
the device's index, which SGLang's rebuild accepts beside its own UUID form when both processes
number the GPUs alike), a CPU tensor to the name of a shared-memory file (torch's `file_system`
strategy, chosen here because a file descriptor cannot reach an unrelated process). So the server
maps the sender's memory: this path is for a pool on the same machine as its SGLang server, and the
sender keeps the tensors alive until the server has answered. The body is small whatever the
tensors' size; SGLang copies each tensor into its parameters (its model's `load_weights`, which also
fuses q/k/v and gate/up projections).

This is a pickle, which deltamesh keeps off every wire it reads: here one is only written, for the
pool's own local server, and never read from a peer. `serialize_named_tensors` is the one place that
knows the format, so a change of SGLang's encoding is a change here; SGLang's package (CUDA-only, not
installable on every pool host) is not needed. The pool applies a version to its host copy
(host_weights.py) to learn which tensors it changes and what they become; `post_tensors` sends them
in requests of bounded size (`buckets`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Sequence

import aiohttp
import torch
import torch.multiprocessing

from deltamesh.http import request_json
from deltamesh.mesh.engines.base import EngineError

_strategy_lock = threading.Lock()  # the sharing strategy is process-wide: one serialization at a time


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]], *, tp_size: int = 1) -> list[str]:
    """`serialized_named_tensors` for `named` (tensors already on the device the server should map them
    from, and not shared otherwise: serializing a CPU tensor moves its storage to shared memory)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    pairs = [(str(name), tensor.detach()) for name, tensor in named]
    buf = io.BytesIO()
    with _strategy_lock:
        previous = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(pairs)
        finally:
            torch.multiprocessing.set_sharing_strategy(previous)
    text = base64.b64encode(buf.getvalue()).decode("ascii")
    # Every rank gets the whole tensors and loads its own shard of them, as SGLang's own senders do.
    return [text] * tp_size


async def post_tensors(
    session: aiohttp.ClientSession, base_url: str, weights: dict[str, torch.Tensor], names: Sequence[str],
    label: str, *, device: str, tp_size: int, bucket_bytes: int, timeout_s: float, on_post: Callable[[], None],
) -> None:
    """`POST /update_weights_from_tensor` with tensors `names` of `weights` put on `device`, in buckets;
    the last request flushes the prefix cache and sets weight version `label`. `on_post` is called
    before each request goes out. HttpError is raised as it comes (404: the server lacks the route)."""
    groups = buckets(names, weights, bucket_bytes) or [[]]
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        # The copies stay referenced until the server has answered: it maps their memory.
        tensors = await asyncio.to_thread(lambda group=group: [(n, weights[n].to(device, copy=True)) for n in group])
        body = {
            "serialized_named_tensors": await asyncio.to_thread(serialize_named_tensors, tensors, tp_size=tp_size),
            "load_format": None, "flush_cache": last, "abort_all_requests": False,
            "weight_version": label if last else None,
        }
        on_post()
        answer = await request_json(session, "POST", f"{base_url}/update_weights_from_tensor", body=body,
                                    timeout_s=timeout_s)
        del tensors
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise EngineError(f"SGLang refused tensors for v{label}: {answer!r:.300}")


def buckets(names: Sequence[str], weights: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """`names` in groups of at most `max_bytes` of tensor data (a bigger tensor goes alone), so the copies
    on the server's device for one request stay bounded."""
    groups: list[list[str]] = []
    size = 0
    for name in names:
        nbytes = weights[name].numel() * weights[name].element_size()
        if not groups or size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups
