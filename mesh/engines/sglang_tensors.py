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
installable on every pool host) is not needed. `HostWeights` is the pool's host copy that a decoded
version is applied to, to learn which tensors it changes and what they become; `post_tensors` sends
them in requests of bounded size (`buckets`).
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

from deltamesh.delta import BaseMismatchError, CorruptError, DecodedVersion, apply_version
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


class HostWeights:
    """The pool's host copy of the checkpoint tensors an SGLang server serves (bf16 on the CPU, named as
    in the model directory), which a decoded version is applied to so that only the tensors it changes
    need to reach the server. `apply` returns those tensors; `undo` puts the host copy back."""

    def __init__(self, weights: dict[str, torch.Tensor], weights_hash: str | None) -> None:
        self.weights = weights
        self.weights_hash = weights_hash
        self._spare: dict[str, torch.Tensor] = {}  # tensors a delta changed, as they were before it
        self._before: dict[str, torch.Tensor] = {}  # the previous tensors of the last `apply`

    def apply(self, version: DecodedVersion, served: int, *, diff: bool = True) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The weights of `version` (a delta onto version `served`, or a full snapshot) and the names
        of the tensors whose bytes it changes (a full snapshot without `diff`: all of them); the
        previous tensors stay available to `previous`."""
        manifest = version.manifest
        if manifest.kind == "delta":
            if manifest.base_version != served:
                raise BaseMismatchError(f"{manifest.model_id} v{manifest.version} is a delta from "
                                        f"v{manifest.base_version}, the server serves v{served}")
            if version.whole:
                raise CorruptError(f"{manifest.model_id} v{manifest.version} adds tensors the model lacks")
            changed = [manifest.tensors[i].name for i in version.updates]
            for name in changed:
                if name not in self.weights:
                    raise CorruptError(f"{manifest.model_id} v{manifest.version}: model has no tensor {name!r}")
                spare = self._spare.get(name)
                if spare is None or spare.shape != self.weights[name].shape or spare.dtype != self.weights[name].dtype:
                    spare = self._spare[name] = torch.empty_like(self.weights[name])
                spare.copy_(self.weights[name])
            # In place: on a wrong base or result the applier restores every word it wrote.
            result = apply_version(version, self.weights, base_hash=self.weights_hash, in_place=True)
            self._before = {name: self._spare[name] for name in changed}
        else:
            result = apply_version(version)
            if set(result) != set(self.weights):
                raise CorruptError(f"{manifest.model_id} v{manifest.version}: tensors differ from the model's")
            changed = [n for n, t in result.items() if not diff or not _same_bytes(t, self.weights[n])]
            self._before = {name: self.weights[name] for name in changed}
        return result, changed

    def previous(self) -> dict[str, torch.Tensor]:
        """The tensors the last `apply` changed, as they were before it."""
        return self._before

    def commit(self, result: dict[str, torch.Tensor], weights_hash: str | None) -> None:
        self.weights, self.weights_hash = result, weights_hash

    def undo(self, version: DecodedVersion) -> None:
        """Put back the tensors a delta wrote into the host copy (a full snapshot never wrote there)."""
        if version.manifest.kind == "delta":
            for name, before in self._before.items():
                self.weights[name].copy_(before)


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


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
