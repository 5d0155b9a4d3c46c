"""The SGLang rollout engine: an adapter over SGLang's native HTTP API, launching or attaching a server.

Generation goes through `POST /generate` with `input_ids` and `return_logprob`, one request per
prompt (SGLang batches them itself); the behaviour logprobs and token ids come from
`meta_info.output_token_logprobs` (`[logprob, token_id, text]` per generated token).

Weight updates (docs/ENGINES.md), fastest first. `apply_update` applies the pool's decoded version
to a host copy of the weights (`host_weights.HostWeights`, read from `model_path`) and sends only
the tensors whose bytes changed with `POST /update_weights_from_tensor` (handles to memory on this
machine: the server must be co-located), in buckets of `bucket_bytes`, the last one flushing the
prefix cache and setting `weight_version` to the deltamesh version. `load_version` reloads a whole
directory with `POST /update_weights_from_disk`; it is the fallback, with a log line, for a server
that answers 404 for the tensor route (probed at start, noticed on use), no CUDA device to send
from, no `model_path`, or `weight_update = "disk"`. Either update sits between
`POST /pause_generation` (mode `abort`) and `POST /continue_generation`: SGLang returns each running
request with what it generated so far (finish reason `abort`), this adapter tags those tokens with
the old version and resubmits prompt + partial output for the rest, so every token's version is
exact (`retract` would hide where the version changed; `in_place` keeps the old KV and cannot flush
the cache). Where SGLang reports `meta_info.weight_version` as a number it is the segment's version.

A failed tensor update is undone (the previous bytes of the tensors it touched are sent back before
generation continues); if even that fails, the adapter refuses to generate until a `load_version`
succeeds. `served_digests` reads tensors back with `POST /get_weights_by_name` (float32 lists, exact
for bf16) and hashes them, for the pool's check after a swap; `read_back` returns the values.
Nothing here imports SGLang; `pip install deltamesh[sglang]` brings it for launching a local server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import aiohttp
import numpy as np
import torch
from prometheus_client import CollectorRegistry

from deltamesh.delta import BaseMismatchError, DecodedVersion, Grid, dir_manifest, read_weights, tensor_digest
from deltamesh.http import HttpError, client_session, request_json
from deltamesh.mesh.engines.base import (
    EngineError,
    FinishReason,
    Generation,
    SamplingParams,
    ServedDigests,
    TokenizedEngine,
)
from deltamesh.mesh.engines.host_weights import HostWeights
from deltamesh.mesh.engines.local import read_verified
from deltamesh.mesh.engines.metrics import EngineMetrics
from deltamesh.mesh.engines.sglang_config import SGLangEngineConfig
from deltamesh.mesh.engines.sglang_server import (
    has_route,
    launch_server,
    parse_answer,
    sampling_body,
    stop_server,
    wait_healthy,
)
from deltamesh.mesh.engines.sglang_tensors import post_tensors
from deltamesh.trainer.models import load_tokenizer

log = logging.getLogger(__name__)


class SGLangEngine(TokenizedEngine):
    """SGLang adapter (see the module docstring). Use `await SGLangEngine.open(config)`."""

    def __init__(self, config: SGLangEngineConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.model_id = config.model_id
        self.base_url = config.url or f"http://{config.host}:{config.port}"
        self.metrics = EngineMetrics(self.model_id, "sglang", registry)
        self._session: aiohttp.ClientSession | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._tokenizer: Any = None
        self._eos: tuple[int, ...] = ()
        self._version = 0
        self._epoch = 0  # bumped by every pause, so a request can tell its abort was ours
        self._serving = asyncio.Event()
        self._swap_lock = asyncio.Lock()
        self._host: HostWeights | None = None  # the tensor path's host copy (None: disk reloads only)
        self._weights_lost = ""  # why the server's weights are unknown (a failed update not undone)
        self._posted = 0  # tensor requests of the update under way that were sent
        self._mirrored = False  # the host copy is known to hold what the server serves

    @classmethod
    async def open(cls, config: SGLangEngineConfig, *, registry: CollectorRegistry | None = None) -> "SGLangEngine":
        engine = cls(config, registry=registry)
        try:
            await engine.start()
        except BaseException:
            await engine.close()
            raise
        return engine

    async def start(self) -> None:
        """Launch (or reach) the server, wait until it is healthy, load the tokenizer."""
        cfg = self.config
        self._session = client_session(connections=cfg.connections, timeout_s=None)
        if cfg.url:
            await wait_healthy(self._session, self.base_url, min(cfg.startup_timeout_s, 60.0))
        else:
            self._mirrored = True  # the server starts from model_path, as the host copy does
            self._process = await launch_server(
                cfg.launch_command, cfg.model_path, cfg.host, cfg.port, cfg.extra_args,
                log_path=Path(cfg.log_path) if cfg.log_path else None,
            )
            await wait_healthy(self._session, self.base_url, cfg.startup_timeout_s, self._process)
        tokenizer_path = cfg.tokenizer_path or cfg.model_path
        if not tokenizer_path:
            info = await self._call("GET", "/get_model_info")
            tokenizer_path = str(info.get("tokenizer_path") or info.get("model_path") or "")
        if not tokenizer_path or not Path(tokenizer_path).is_dir():
            raise EngineError(
                f"no local tokenizer directory for {self.model_id} (got {tokenizer_path!r}); set tokenizer_path")
        self._tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
        eos = self._tokenizer.eos_token_id
        self._eos = (int(eos),) if eos is not None else ()
        manifest = dir_manifest(cfg.model_path) if cfg.model_path else None
        if manifest is not None and cfg.version is not None and manifest.version != cfg.version:
            raise EngineError(f"{cfg.model_path} holds v{manifest.version}, config says v{cfg.version}")
        self._version = manifest.version if manifest is not None else (cfg.version or 0)
        self.metrics.version.set(self._version)
        if cfg.weight_update == "tensor" and cfg.model_path:
            if cfg.tensor_device.startswith("cuda") and not torch.cuda.is_available():
                log.warning("%s: no CUDA device here to hand SGLang tensors from (tensor_device %s): every "
                            "version reloads from disk", self.model_id, cfg.tensor_device)
            elif await has_route(self._session, self.base_url, "/update_weights_from_tensor"):
                weights = await asyncio.to_thread(read_weights, cfg.model_path)
                self._host = HostWeights(weights, manifest.weights_hash if manifest is not None else None)
            else:
                log.warning("%s: SGLang at %s has no /update_weights_from_tensor (HTTP 404): every version "
                            "reloads from disk", self.model_id, self.base_url)
        self._serving.set()
        log.info("%s: SGLang engine at %s serving v%d (updates: %s)", self.model_id, self.base_url, self._version,
                 "changed tensors" if self._host is not None else "reload from disk")

    # -- the Engine interface --------------------------------------------------------------------
    @property
    def supports_in_place(self) -> bool:
        return self._host is not None

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        if self._weights_lost:
            raise EngineError(f"{self.model_id}: weights unknown until a full reload ({self._weights_lost})")
        prompts = [[int(t) for t in p] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        gens = await asyncio.gather(*(self._generate_one(p, params) for p in prompts))
        self.metrics.generations.inc(len(gens))
        self.metrics.tokens.inc(sum(len(g.tokens) for g in gens))
        return list(gens)

    async def load_version(self, path: str | Path, version: int) -> None:
        """Pause (aborting running requests, which resume after), load `path` from disk, continue."""
        manifest = dir_manifest(path)
        if manifest is not None and manifest.version != version:
            raise EngineError(f"{path} holds v{manifest.version}, v{version} was asked for")
        weights = None
        if self._host is not None:  # the host copy follows, read (and checked) before the pause
            weights, manifest = await asyncio.to_thread(read_verified, Path(path), version)

        async def reload() -> None:
            answer = await self._call("POST", "/update_weights_from_disk",
                                      {"model_path": str(path), "weight_version": str(version)},
                                      timeout_s=self.config.update_timeout_s)
            if not isinstance(answer, dict) or not answer.get("success", False):
                raise EngineError(f"SGLang refused the update to v{version}: {answer!r:.300}")

        async with self._swap_lock:
            seconds = await self._paused("disk", reload)
            self._weights_lost = ""
            if self._host is not None and weights is not None:
                self._host.commit(weights, manifest.weights_hash if manifest is not None else None)
                self._mirrored = True
            self._set_version(version)
        log.info("%s: SGLang now serving v%d from %s (%.3f s paused)", self.model_id, version, path, seconds)

    async def apply_update(self, version: DecodedVersion) -> None:
        """Send the server only the tensors that decoded delta or full snapshot `version` changes."""
        host, manifest = self._host, version.manifest
        if host is None:
            raise EngineError(f"{self.model_id}: this SGLang engine takes no in-place updates "
                              "(weight_update disk, no model_path, or no /update_weights_from_tensor): load_version")
        if self._weights_lost:
            raise EngineError(f"{self.model_id}: weights unknown until a full reload ({self._weights_lost})")
        if manifest.model_id != self.model_id:
            raise BaseMismatchError(f"update is for model {manifest.model_id!r}, engine serves {self.model_id!r}")
        if manifest.kind == "delta" and not self._mirrored:
            raise EngineError(f"{self.model_id}: the attached server's weights are not known to match {self.config.model_path}; "
                              "load_version first")
        async with self._swap_lock:
            try:
                # Until the host copy is known to mirror the server, a full snapshot is sent whole.
                result, changed = await asyncio.to_thread(
                    lambda: host.apply(version, self._version, diff=self._mirrored))
            except Exception:
                self.metrics.update_done(manifest.kind, False, 0.0)
                raise
            try:
                seconds = await self._paused(manifest.kind, lambda: self._send_or_restore(result, changed, version))
            except Exception:
                host.undo(version)
                raise
            host.commit(result, manifest.weights_hash, adopted=manifest.kind == "full")
            self._mirrored = True
            self._set_version(manifest.version)
        log.info("%s: SGLang now serving %s v%d (%d of %d tensors sent, %.3f s paused)", self.model_id,
                 manifest.kind, manifest.version, len(changed), len(result), seconds)

    async def read_back(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The served values of checkpoint tensors `names` (`POST /get_weights_by_name`), as float32
        arrays; SGLang reads them between two scheduler steps, and no update runs meanwhile."""
        async with self._swap_lock:
            return {name: await self._read_one(name) for name in names}

    async def weight_version(self) -> str | None:
        """The weight version the server reports (`GET /get_weight_version`; newer SGLang: its model info)."""
        for path in ("/get_weight_version", "/model_info", "/get_model_info"):
            try:
                answer = await self._call("GET", path)
            except EngineError:
                continue
            if isinstance(answer, dict) and answer.get("weight_version") is not None:
                return str(answer["weight_version"])
        return None

    async def served_digests(self, names: Sequence[str], grids: Mapping[str, Grid] | None = None) -> ServedDigests:
        """xxh3-128 of each tensor as the server holds it (`ReadsBack`), cast back to the checkpoint's
        dtype; None for a tensor not in the host copy, too large to read back, or not answered."""
        host = self._host.weights if self._host is not None else {}
        digests: dict[str, str | None] = {name: None for name in names}
        async with self._swap_lock:
            version = self._version
            for name in names:
                if name not in host or host[name].numel() > self.config.read_back_max_elements:
                    continue
                try:
                    values = await self._read_one(name)
                except EngineError as e:
                    log.warning("%s: cannot read %s back from SGLang: %s", self.model_id, name, e)
                    continue
                if values.size == host[name].numel():
                    served = torch.from_numpy(values).reshape(host[name].shape).to(host[name].dtype)
                    digests[name] = tensor_digest(served, (grids or {}).get(name))
        return ServedDigests(version, digests)

    async def close(self) -> None:
        if self._process is not None:
            await stop_server(self._process)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- internals -------------------------------------------------------------------------------
    async def _send(self, weights: dict[str, torch.Tensor], names: list[str], label: str) -> None:
        assert self._session is not None
        cfg = self.config

        def posted() -> None:
            self._posted += 1

        await post_tensors(self._session, self.base_url, weights, names, label, device=cfg.tensor_device,
                           tp_size=cfg.tp_size, bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.update_timeout_s,
                           on_post=posted)

    async def _paused(self, way: str, update: Callable[[], Awaitable[None]]) -> float:
        """Run `update` with generation paused (mode abort: running requests return and are resumed
        after), continuing whatever happens; the seconds paused."""
        started = time.perf_counter()
        self._serving.clear()
        self._epoch += 1
        try:
            await self._call("POST", "/pause_generation", {"mode": "abort"})
            await update()
        except Exception:
            self.metrics.update_done(way, False, 0.0)
            raise
        finally:
            try:
                await self._call("POST", "/continue_generation", {})
            finally:
                self._serving.set()
        seconds = time.perf_counter() - started
        self.metrics.update_done(way, True, seconds)
        return seconds

    async def _send_or_restore(self, result: dict[str, torch.Tensor], changed: list[str],
                               version: DecodedVersion) -> None:
        """Send `changed` tensors of `result`; if that fails, send back their previous bytes."""
        self._posted = 0
        try:
            await self._send(result, changed, str(version.version))
        except Exception as e:
            if not self._posted:  # failed before anything reached the server: nothing to undo there
                raise EngineError(f"{self.model_id}: could not send v{version.version} to SGLang: {e}") from e
            assert self._host is not None
            if isinstance(e, HttpError) and e.status == 404:
                log.warning("%s: SGLang at %s has no /update_weights_from_tensor (HTTP 404): every version "
                            "reloads from disk from now on", self.model_id, self.base_url)
                self._host = None  # apply_update puts the host copy back as it was
                raise EngineError(f"{self.model_id}: SGLang has no /update_weights_from_tensor; load_version") from e
            if not self._mirrored:  # the server's previous bytes are unknown: nothing to send back
                self._weights_lost = f"a full update to an attached server failed part way: {e}"
                raise EngineError(f"{self.model_id}: {self._weights_lost}") from e
            try:
                await self._send(self._host.previous(), changed, str(self._version))
            except Exception as again:  # noqa: BLE001 - reported through the engine's state
                self._weights_lost = f"restoring v{self._version} after a failed update failed: {again}"
                log.exception("%s: %s", self.model_id, self._weights_lost)
            raise EngineError(f"{self.model_id}: SGLang failed to take v{version.version} ({e}); "
                              f"{'weights lost' if self._weights_lost else f'still serving v{self._version}'}") from e

    async def _read_one(self, name: str) -> np.ndarray:
        """SGLang answers a parameter's first `truncate_size` rows: ask for all of them."""
        host = self._host.weights if self._host is not None else {}
        rows = max(1, host[name].shape[0]) if name in host and host[name].dim() else 1 << 30
        answer = await self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": rows})
        return np.asarray(answer, dtype=np.float32)

    def _set_version(self, version: int) -> None:
        self._version = version
        self.metrics.version.set(version)

    async def _call(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        if self._session is None:
            raise EngineError(f"{self.model_id}: engine is not started")
        try:
            return await request_json(self._session, method, f"{self.base_url}{path}", body=body,
                                      timeout_s=timeout_s or self.config.request_timeout_s)
        except HttpError as e:
            raise EngineError(f"SGLang {method} {path} failed: {e}") from e

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Generation:
        gen = Generation(prompt=prompt)
        started = time.perf_counter()
        finish: FinishReason = "length"
        while len(gen.tokens) < params.max_new_tokens:
            await self._serving.wait()
            epoch, version = self._epoch, self._version
            body = {
                "input_ids": prompt + gen.tokens,
                "sampling_params": sampling_body(params, params.max_new_tokens - len(gen.tokens)),
                "return_logprob": True,
            }
            try:
                answer = await self._call("POST", "/generate", body)
            except EngineError:
                if epoch == self._epoch:
                    raise
                # A server that answers an aborted request with an error status: redo the segment.
                log.warning("%s: request failed across a weight update; resubmitting", self.model_id)
                continue
            tokens, logprobs, label, reason = parse_answer(answer)
            segment_version = int(label) if label is not None and label.isdigit() else version
            gen.tokens += tokens
            gen.logprobs += logprobs
            gen.versions += [segment_version] * len(tokens)
            if reason != "abort":
                finish = "stop" if reason == "stop" else "length"
                break
            if epoch == self._epoch and self._serving.is_set():
                raise EngineError(f"SGLang aborted a request for {self.model_id} (not by a weight update)")
            # Aborted by our own pause: resume from prompt + partial output once serving again.
        gen.finish_reason = finish
        gen.generate_s = time.perf_counter() - started
        if len(set(gen.versions)) > 1:
            self.metrics.straddled.inc()
        return gen
