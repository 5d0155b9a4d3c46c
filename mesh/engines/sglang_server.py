"""Starting, waiting for and stopping an SGLang server process for the SGLang engine, asking it whether
it has a route (`has_route`), and the shapes of its `/generate` request and answer (`sampling_body`,
`parse_answer`).

The server runs in a session of its own, so stopping it ends its scheduler and detokenizer children
too: SIGTERM to the process group, then SIGKILL after a grace period. Nothing here imports SGLang;
the server is a command line (by default `python -m sglang.launch_server`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from deltamesh.http import HttpError, request_bytes
from deltamesh.mesh.engines.base import EngineError, SamplingParams

log = logging.getLogger(__name__)


async def launch_server(
    command: Sequence[str], model_path: str | Path, host: str, port: int, extra_args: Sequence[str] = (),
    *, log_path: Path | None = None,
) -> asyncio.subprocess.Process:
    """Start `command --model-path M --host H --port P EXTRA...` in its own process group."""
    argv = [*command, "--model-path", str(model_path), "--host", host, "--port", str(port), *extra_args]
    log.info("starting SGLang server: %s", " ".join(argv))
    out = open(log_path, "ab") if log_path is not None else asyncio.subprocess.DEVNULL
    try:
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        raise EngineError(f"cannot start SGLang server ({argv[0]}): {e}") from e
    finally:
        if log_path is not None:
            out.close()


async def wait_healthy(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float,
    process: asyncio.subprocess.Process | None = None,
) -> None:
    """Poll `GET /health` until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if process is not None and process.returncode is not None:
            raise EngineError(f"SGLang server exited with code {process.returncode} before it was healthy")
        try:
            await request_bytes(session, "GET", f"{base_url}/health", timeout_s=5.0)
            return
        except HttpError as e:
            last = str(e)
        await asyncio.sleep(0.25)
    raise EngineError(f"SGLang server at {base_url} not healthy after {timeout_s:.0f} s: {last}")


async def has_route(session: aiohttp.ClientSession, base_url: str, path: str) -> bool:
    """Whether the server serves POST `path`: a GET answers 405 if so, 404 if not (and changes nothing)."""
    try:
        await request_bytes(session, "GET", f"{base_url}{path}", timeout_s=10.0)
    except HttpError as e:
        return e.status != 404
    return True


async def stop_server(process: asyncio.subprocess.Process, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, SIGKILL it if it has not exited after `grace_s`."""
    if process.returncode is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(process.wait(), wait_s)
            return
        except asyncio.TimeoutError:
            log.warning("SGLang server pid %d ignored %s", process.pid, sig.name)


def sampling_body(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
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


def parse_answer(answer: Any) -> tuple[list[int], list[float], str | None, str]:
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
