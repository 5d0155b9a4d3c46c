"""A stand-in for an SGLang server, for testing the SGLang engine adapter on machines without a GPU.

This is a mock: SGLang itself needs CUDA kernels, so it cannot run here. The script follows the parts
of SGLang's documented native HTTP API that the adapter uses, with the same request and answer
fields: `GET /health`, `GET /get_model_info`, `POST /generate` (`input_ids`, `sampling_params`,
`return_logprob`; answer `output_ids` and `meta_info` with `finish_reason`, `output_token_logprobs`
as `[logprob, token_id, null]` and `weight_version`), `POST /pause_generation` (mode `abort` returns
running requests at once with what they generated so far and finish type `abort`; `retract` and
`in_place` hold them where they are; requests that arrive while paused wait),
`POST /continue_generation`, `POST /update_weights_from_disk` (`model_path`, `weight_version`; HTTP
400 with `success: false` for a path without weights), `POST /update_weights_from_tensor`
(`serialized_named_tensors`: one base64 ForkingPickler pickle of `[(name, tensor)]` per TP rank, read
with an unpickler that admits torch's tensor rebuilders only, as SGLang's does; `load_format`,
`flush_cache`, `weight_version`; HTTP 400 with `success: false` for an unknown name or a wrong shape,
and for `flush_cache` while requests sit paused `in_place`), `GET|POST /get_weights_by_name` (`name`,
`truncate_size`: the first rows as float32 lists), `GET /get_weight_version` and
`POST /update_weight_version` (`new_version`).

It has no model: it holds the checkpoint's tensors, and the next token is a deterministic function
of a fingerprint of those tensors and the sequence so far, so changing weights visibly changes the
output and a test can recompute what any weights would have generated. One token takes
`--token-delay-s`. `--no-tensor-route` leaves `/update_weights_from_tensor` out (an older SGLang: 404).
Test-only routes: `GET /standin/calls` lists the control calls received, for tests to check their
order; `POST /standin/fail_tensor_updates` (`count`) makes that many next tensor updates fail after
taking their first tensor, as a load that breaks part way.
Flags it does not know (SGLang's memory and CUDA-graph flags) are ignored.
Run: python sglang_standin.py --model-path DIR --host 127.0.0.1 --port N
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import pickle
import uuid
from pathlib import Path

import torch
import xxhash
from aiohttp import web
from safetensors.torch import load_file

# What SGLang's restricted unpickler admits, reduced to what torch's tensor reducers name.
ALLOWED_MODULES = {"torch", "torch.multiprocessing.reductions", "torch.storage", "torch._utils"}


class TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in ALLOWED_MODULES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked {module}.{name}")


def load_weights(model_path: str) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> int:
    h = xxhash.xxh64()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.intdigest()


def fingerprint(model_path: str) -> int:
    """The fingerprint of the tensors in a model directory (whatever their files' layout)."""
    return weights_fingerprint(load_weights(model_path))


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
        self.weights = load_weights(model_path)
        self.fp = weights_fingerprint(self.weights)
        self.pause_mode = ""
        self.fail_tensor_updates = 0
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
                if not abort.is_set() and not self.running.is_set():  # paused in_place / retract: held
                    await self.running.wait()
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
        self.pause_mode = mode
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
            weights = load_weights(path)
        except (FileNotFoundError, OSError) as e:
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}"}, status=400)
        self.weights, self.fp, self.model_path = weights, weights_fingerprint(weights), path
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        entries = body["serialized_named_tensors"]
        named = TensorUnpickler(io.BytesIO(base64.b64decode(entries[0], validate=True))).load()
        call = {"call": "update_weights_from_tensor", "names": [n for n, _ in named], "tp_entries": len(entries),
                "load_format": body.get("load_format"), "flush_cache": body.get("flush_cache", True),
                "weight_version": body.get("weight_version"), "paused": not self.running.is_set()}
        self.calls.append(call)
        for name, tensor in named:
            if name not in self.weights or self.weights[name].shape != tensor.shape:
                return web.json_response({"success": False, "message": f"Failed to update weights: bad tensor {name}"},
                                         status=400)
        if call["flush_cache"] and self.pause_mode == "in_place" and self.aborts:
            return web.json_response({"success": False, "message": "Cannot flush cache: requests are running"},
                                     status=400)
        for k, (name, tensor) in enumerate(named):
            if self.fail_tensor_updates and k == 1:
                self.fail_tensor_updates -= 1
                self.fp = weights_fingerprint(self.weights)
                return web.json_response({"success": False, "message": "Failed to update weights: load broke"},
                                         status=400)
            self.weights[name] = tensor.to(self.weights[name].dtype).clone()
        self.fp = weights_fingerprint(self.weights)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def weights_by_name(self, request: web.Request) -> web.Response:
        body = await request.json()
        tensor = self.weights.get(body["name"])
        if tensor is None:
            return web.json_response({"error": {"message": f"no parameter {body['name']}"}}, status=400)
        return web.json_response(tensor[: body.get("truncate_size", 100)].float().tolist())

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.weight_version = str(body["new_version"])
        self.calls.append({"call": "update_weight_version", "new_version": self.weight_version})
        return web.json_response({"success": True, "message": f"Weight version updated to {self.weight_version}",
                                  "new_version": self.weight_version})

    async def fail_tensors(self, request: web.Request) -> web.Response:
        self.fail_tensor_updates = int((await request.json())["count"])
        return web.json_response({})

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
    parser.add_argument("--no-tensor-route", action="store_true", help="no /update_weights_from_tensor (404)")
    args, _ = parser.parse_known_args()  # SGLang's own flags (memory, CUDA graphs) mean nothing here
    server = StandIn(args.model_path, args.token_delay_s, args.weight_version)
    app = web.Application(client_max_size=1 << 30)
    if not args.no_tensor_route:
        app.add_routes([web.post("/update_weights_from_tensor", server.update_from_tensor)])
    app.add_routes([
        web.get("/get_weights_by_name", server.weights_by_name), web.post("/get_weights_by_name", server.weights_by_name),
        web.get("/get_weight_version", server.get_weight_version),
        web.post("/update_weight_version", server.update_weight_version),
        web.post("/standin/fail_tensor_updates", server.fail_tensors),
        web.get("/health", server.health), web.get("/get_model_info", server.model_info),
        web.post("/generate", server.generate), web.post("/pause_generation", server.pause),
        web.post("/continue_generation", server.resume), web.post("/update_weights_from_disk", server.update),
        web.get("/standin/calls", server.list_calls),
    ])
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
