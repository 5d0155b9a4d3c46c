"""The SGLang rollout engine: an adapter over SGLang's native HTTP API, launching or attaching a server.

Generation goes through `POST /generate` with `input_ids` and `return_logprob`, one request per
prompt (SGLang batches them itself); the behaviour logprobs and token ids come from
`meta_info.output_token_logprobs` (`[logprob, token_id, text]` per generated token). A weight update
is `POST /pause_generation` (mode `abort`), `POST /update_weights_from_disk` on the directory the
pool agent keeps in sync (with `weight_version` set to the version number), then
`POST /continue_generation`. Pausing in `abort` mode makes SGLang return every running request with
what it generated so far (finish reason `abort`); this adapter tags those tokens with the old version
and resubmits prompt + partial output for the rest, which then comes from the new weights. So a
generation may straddle a swap and every token's version is exact. Where SGLang reports
`meta_info.weight_version` as a number it is used as the segment's version.

SGLang cannot update in place from a delta: `apply_update` refuses and the agent uses `load_version`.
Nothing here imports SGLang; `pip install deltamesh[sglang]` brings it for launching a local server.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
from prometheus_client import CollectorRegistry

from deltamesh.config import http_url
from deltamesh.delta import DecodedVersion, dir_manifest
from deltamesh.http import HttpError, client_session, request_json
from deltamesh.mesh.engines.base import EngineError, FinishReason, Generation, SamplingParams, TokenizedEngine
from deltamesh.mesh.engines.metrics import EngineMetrics
from deltamesh.mesh.engines.sglang_server import launch_server, stop_server, wait_healthy
from deltamesh.trainer.models import load_tokenizer

log = logging.getLogger(__name__)


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
        self._serving.set()
        log.info("%s: SGLang engine at %s serving v%d", self.model_id, self.base_url, self._version)

    # -- the Engine interface --------------------------------------------------------------------
    @property
    def supports_in_place(self) -> bool:
        return False

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
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
        async with self._swap_lock:
            started = time.perf_counter()
            self._serving.clear()
            self._epoch += 1
            try:
                await self._call("POST", "/pause_generation", {"mode": "abort"})
                answer = await self._call(
                    "POST", "/update_weights_from_disk",
                    {"model_path": str(path), "weight_version": str(version)},
                    timeout_s=self.config.update_timeout_s,
                )
                if not isinstance(answer, dict) or not answer.get("success", False):
                    raise EngineError(f"SGLang refused the update to v{version}: {answer!r:.300}")
                self._version = version
            except Exception:
                self.metrics.update_done("disk", False, 0.0)
                raise
            finally:
                try:
                    await self._call("POST", "/continue_generation", {})
                finally:
                    self._serving.set()
        seconds = time.perf_counter() - started
        self.metrics.update_done("disk", True, seconds)
        self.metrics.version.set(version)
        log.info("%s: SGLang now serving v%d from %s (%.3f s paused)", self.model_id, version, path, seconds)

    async def apply_update(self, version: DecodedVersion) -> None:
        raise EngineError("the SGLang engine cannot apply updates in place: sync a directory, then load_version")

    async def close(self) -> None:
        if self._process is not None:
            await stop_server(self._process)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- internals -------------------------------------------------------------------------------
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
                "sampling_params": _sampling_body(params, params.max_new_tokens - len(gen.tokens)),
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
            tokens, logprobs, label, reason = _parse_answer(answer)
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


def _sampling_body(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        body["sampling_seed"] = params.seed
    return body


def _parse_answer(answer: Any) -> tuple[list[int], list[float], str | None, str]:
    """(token ids, logprobs, weight_version label, finish type) of one `/generate` answer."""
    try:
        meta = answer["meta_info"]
        entries = meta["output_token_logprobs"] or []
        tokens = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
        reason = meta.get("finish_reason") or {}
        kind = str(reason.get("type", "length")) if isinstance(reason, dict) else str(reason)
        label = meta.get("weight_version")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise EngineError(f"unexpected /generate answer from SGLang: {type(e).__name__}: {e}") from e
    return tokens, logprobs, None if label is None else str(label), kind
