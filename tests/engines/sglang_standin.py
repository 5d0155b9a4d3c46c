"""A stand-in for an SGLang server, for testing the SGLang engine adapter on machines without a GPU.

SGLang itself needs CUDA kernels, so it cannot run here. This script follows the parts of SGLang's
documented native HTTP API that the adapter uses, with the same request and answer fields:
`GET /health`, `GET /get_model_info`, `POST /generate` (`input_ids`, `sampling_params`,
`return_logprob`; answer `output_ids` and `meta_info` with `finish_reason`, `output_token_logprobs`
as `[logprob, token_id, null]` and `weight_version`), `POST /pause_generation` (mode `abort` returns
running requests at once with what they generated so far and finish type `abort`; requests that
arrive while paused wait), `POST /continue_generation` and `POST /update_weights_from_disk`
(`model_path`, `weight_version`; HTTP 400 with `success: false` for a path without weights).

It has no model: the next token is a deterministic function of a fingerprint of the served
safetensors files and the sequence so far, so changing weights visibly changes the output and a test
can recompute what any version would have generated. One token takes `--token-delay-s`. The extra
route `GET /standin/calls` lists the control calls received, for tests to check their order.
Run: python sglang_standin.py --model-path DIR --host 127.0.0.1 --port N
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path

import xxhash
from aiohttp import web


def fingerprint(model_path: str) -> int:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    h = xxhash.xxh64()
    for f in files:
        h.update(f.read_bytes())
    return h.intdigest()


def next_token(fp: int, sequence: list[int], vocab: int, avoid: set[int]) -> int:
    """What the stand-in 'model' with fingerprint `fp` generates after `sequence`."""
    h = xxhash.xxh64(json.dumps(sequence[-4:]).encode(), seed=fp % (1 << 63)).intdigest()
    token = h % vocab
    while token in avoid:
        token = (token + 1) % vocab
    return token


def token_logprob(fp: int, position: int, token: int) -> float:
    return -0.01 - ((fp + 31 * position + token) % 1000) / 250.0


class StandIn:
    def __init__(self, model_path: str, token_delay_s: float, weight_version: str):
        self.model_path = model_path
        self.fp = fingerprint(model_path)
        self.vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
        self.token_delay_s = token_delay_s
        self.weight_version = weight_version
        self.running = asyncio.Event()
        self.running.set()
        self.aborts: set[asyncio.Event] = set()
        self.calls: list[dict] = []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            return web.json_response([await self._one(i, body) for i in ids])
        return web.json_response(await self._one(ids, body))

    async def _one(self, ids: list[int], body: dict) -> dict:
        await self.running.wait()
        sp = body.get("sampling_params", {})
        stop = set(sp.get("stop_token_ids") or [])
        abort = asyncio.Event()
        self.aborts.add(abort)
        out: list[int] = []
        lps: list[float] = []
        finish: dict = {"type": "length", "length": sp.get("max_new_tokens", 16)}
        try:
            for _ in range(sp.get("max_new_tokens", 16)):
                try:
                    await asyncio.wait_for(abort.wait(), self.token_delay_s)
                except asyncio.TimeoutError:
                    pass
                if abort.is_set():
                    finish = {"type": "abort", "message": "Abort before update weights."}
                    break
                seq = ids + out
                token = next_token(self.fp, seq, self.vocab, {0, 1, 2, 3} - stop)
                out.append(token)
                lps.append(token_logprob(self.fp, len(seq), token))
                if token in stop:
                    finish = {"type": "stop", "matched": token}
                    break
        finally:
            self.aborts.discard(abort)
        meta = {
            "id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(ids),
            "completion_tokens": len(out), "weight_version": self.weight_version,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
        return {"text": "", "output_ids": out, "meta_info": meta}

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await request.json()).get("mode", "abort")
        self.calls.append({"call": "pause_generation", "mode": mode})
        self.running.clear()
        if mode == "abort":
            for ev in list(self.aborts):
                ev.set()
        return web.json_response({"message": "Generation paused."})

    async def resume(self, request: web.Request) -> web.Response:
        self.calls.append({"call": "continue_generation"})
        self.running.set()
        return web.json_response({"message": "Generation continued."})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = body["model_path"]
        self.calls.append({"call": "update_weights_from_disk", "model_path": path,
                           "weight_version": body.get("weight_version"), "paused": not self.running.is_set()})
        try:
            fp = fingerprint(path)
        except (FileNotFoundError, OSError) as e:
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}"}, status=400)
        self.fp, self.model_path = fp, path
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "weight_version": self.weight_version})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def list_calls(self, request: web.Request) -> web.Response:
        return web.json_response(self.calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-s", type=float, default=0.002)
    parser.add_argument("--weight-version", default="default")
    args = parser.parse_args()
    server = StandIn(args.model_path, args.token_delay_s, args.weight_version)
    app = web.Application()
    app.add_routes([
        web.get("/health", server.health), web.get("/get_model_info", server.model_info),
        web.post("/generate", server.generate), web.post("/pause_generation", server.pause),
        web.post("/continue_generation", server.resume), web.post("/update_weights_from_disk", server.update),
        web.get("/standin/calls", server.list_calls),
    ])
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
