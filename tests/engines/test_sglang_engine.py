"""The SGLang engine adapter against a stand-in server (tests/engines/sglang_standin.py).

SGLang needs CUDA, so it cannot run on these machines: the stand-in (a mock) follows SGLang's
documented HTTP API (/generate with logprobs, /pause_generation, /update_weights_from_tensor,
/update_weights_from_disk, /continue_generation, /get_weights_by_name, /get_weight_version, /health,
/get_model_info) and is started as a real process on a real socket, the way the adapter starts
`python -m sglang.launch_server`. The adapter sends it tensors in shared memory (`tensor_device
"cpu"`), a real server CUDA IPC handles. benchmarks/sglang_check.py runs the same adapter against a
real SGLang server on a GPU machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from deltamesh.delta import decode_version, encode_delta, encode_full, generate_key, read_weights, tensor_digest
from deltamesh.mesh.demo.models import TinyModelConfig, tiny_model_dir
from deltamesh.mesh.engines.base import Engine, EngineError, ReadsBack, SamplingParams
from deltamesh.mesh.engines.sglang_engine import SGLangEngine, SGLangEngineConfig

STANDIN_PATH = Path(__file__).with_name("sglang_standin.py")
_spec = importlib.util.spec_from_file_location("sglang_standin", STANDIN_PATH)
standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standin)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("sglang-models")
    return [tiny_model_dir(TinyModelConfig(seed=s), path=root / f"v{s}") for s in range(2)]


KEY = generate_key()


def launch_config(model_dirs, port: int, delay_s: float = 0.002, extra: tuple[str, ...] = ()) -> SGLangEngineConfig:
    return SGLangEngineConfig(
        model_id="tiny", model_path=str(model_dirs[0]), port=port, tensor_device="cpu",
        launch_command=[sys.executable, str(STANDIN_PATH)], extra_args=["--token-delay-s", str(delay_s), *extra],
        startup_timeout_s=60,
    )


def expected(model_dir: Path, prompt: list[int], tokens_so_far: list[int], weights: dict | None = None) -> int:
    """The token the stand-in serving `model_dir` (or `weights`, with that model's vocabulary)
    generates after prompt + tokens_so_far."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    fp = standin.weights_fingerprint(weights) if weights is not None else standin.fingerprint(str(model_dir))
    return standin.next_token(fp, prompt + tokens_so_far, vocab, {0, 1, 2, 3})


def nudged(weights: dict, names: list[str]) -> dict:
    """`weights` with a few elements of each of `names` moved (a new version changing only those)."""
    out = {n: t.clone() for n, t in weights.items()}
    for name in names:
        flat = out[name].view(-1)
        flat[:3] += 0.5
    return out


def delta(old: dict, new: dict, version: int):
    encoded = encode_delta(old, new, model_id="tiny", version=version, base_version=version - 1, key=KEY)
    return decode_version(encoded.manifest, encoded.pieces)


async def standin_calls(engine: SGLangEngine) -> list[dict]:
    async with aiohttp.ClientSession() as s, s.get(f"{engine.base_url}/standin/calls") as r:
        return await r.json()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_launch_generate_and_swap_from_disk(model_dirs, free_port):
    async def main():
        engine = await SGLangEngine.open(launch_config(model_dirs, free_port))
        try:
            assert isinstance(engine, Engine) and isinstance(engine, ReadsBack) and engine.version == 0
            assert engine.supports_in_place
            prompts = [engine.encode("1+2="), engine.encode("hello")]
            params = SamplingParams(max_new_tokens=6, temperature=0)
            before = await engine.generate(prompts, params)
            for p, g in zip(prompts, before):
                assert g.versions == [0] * 6 and len(g.logprobs) == 6 and g.finish_reason == "length"
                assert all(lp < 0 for lp in g.logprobs)
                assert g.tokens[0] == expected(model_dirs[0], p, [])

            await engine.load_version(model_dirs[1], 1)
            assert engine.version == 1
            calls = await standin_calls(engine)
            assert [c["call"] for c in calls] == ["pause_generation", "update_weights_from_disk", "continue_generation"]
            assert calls[0]["mode"] == "abort"
            assert calls[1] == {"call": "update_weights_from_disk", "model_path": str(model_dirs[1]),
                                "weight_version": "1", "paused": True}

            after = await engine.generate(prompts, params)
            assert all(g.versions == [1] * 6 for g in after)
            assert [g.tokens for g in after] != [g.tokens for g in before]
            assert after[0].tokens[0] == expected(model_dirs[1], prompts[0], [])

        finally:
            await engine.close()
        assert not port_open(free_port)  # the launched server is gone

    asyncio.run(main())


@pytest.mark.parametrize("way", ["disk", "tensor"])
def test_generation_straddling_a_swap_is_resumed_and_tagged_per_token(model_dirs, free_port, way):
    async def main():
        engine = await SGLangEngine.open(launch_config(model_dirs, free_port, delay_s=0.004))
        update = delta(read_weights(model_dirs[0]), read_weights(model_dirs[1]), 1)
        try:
            prompt = engine.encode("count: ")
            params = SamplingParams(max_new_tokens=120, temperature=1.0)

            async def swap_soon():
                await asyncio.sleep(0.15)
                if way == "disk":
                    await engine.load_version(model_dirs[1], 1)
                else:
                    await engine.apply_update(update)

            (gen,), _ = await asyncio.gather(engine.generate([prompt], params), swap_soon())
            assert len(gen.tokens) == len(gen.logprobs) == len(gen.versions) == 120
            switch = gen.versions.index(1)
            assert 0 < switch < 120 and gen.versions == [0] * switch + [1] * (120 - switch)
            # Every token is exactly what its tagged version generates after the tokens before it.
            for k, (token, version) in enumerate(zip(gen.tokens, gen.versions)):
                assert token == expected(model_dirs[version], prompt, gen.tokens[:k]), k
        finally:
            await engine.close()

    asyncio.run(main())


def test_failed_update_keeps_version_and_resumes_generation(model_dirs, free_port, tmp_path):
    async def main():
        config = launch_config(model_dirs, free_port)
        config.weight_update = "disk"  # no host copy to read first: the server itself refuses the path
        engine = await SGLangEngine.open(config)
        try:
            with pytest.raises(EngineError, match="update_weights_from_disk"):
                await engine.load_version(tmp_path / "missing", 5)
            assert engine.version == 0
            assert [c["call"] for c in await standin_calls(engine)][-1] == "continue_generation"
            (gen,) = await engine.generate([engine.encode("x")], SamplingParams(max_new_tokens=3))
            assert gen.versions == [0, 0, 0]
        finally:
            await engine.close()

    asyncio.run(main())


def test_attach_to_running_server_leaves_it_running(model_dirs, free_port):
    server = subprocess.Popen(
        [sys.executable, str(STANDIN_PATH), "--model-path", str(model_dirs[0]), "--port", str(free_port),
         "--weight-version", "7"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        async def main():
            # No model_path or tokenizer_path: the tokenizer is found through /get_model_info.
            config = SGLangEngineConfig(model_id="tiny", url=f"http://127.0.0.1:{free_port}", version=7)
            engine = await SGLangEngine.open(config)
            try:
                (gen,) = await engine.generate([engine.encode("7+1=")], SamplingParams(max_new_tokens=4))
                assert gen.versions == [7] * 4  # the server's numeric weight_version label
            finally:
                await engine.close()

        asyncio.run(main())
        assert server.poll() is None and port_open(free_port)
    finally:
        server.kill()
        server.wait(timeout=10)


def test_server_that_dies_at_start_is_reported(model_dirs, free_port):
    config = SGLangEngineConfig(
        model_id="tiny", model_path=str(model_dirs[0]), port=free_port,
        launch_command=[sys.executable, "-c", "import sys; sys.exit(3)"], startup_timeout_s=30,
    )
    started = time.monotonic()
    with pytest.raises(EngineError, match="exited with code 3"):
        asyncio.run(SGLangEngine.open(config))
    assert time.monotonic() - started < 20


def test_config_needs_a_server_or_weights():
    with pytest.raises(ValueError, match="url"):
        SGLangEngineConfig(model_id="tiny")
    with pytest.raises(ValueError, match="http"):
        SGLangEngineConfig(model_id="tiny", url="localhost:30000")


def test_in_place_update_sends_only_changed_tensors_between_pause_and_continue(model_dirs, free_port):
    v0 = read_weights(model_dirs[0])
    names = sorted(v0)
    v1 = nudged(v0, names[:2])
    v2 = nudged(v1, names[-1:])

    async def main():
        engine = await SGLangEngine.open(launch_config(model_dirs, free_port))
        try:
            prompts = [engine.encode("1+2="), engine.encode("hello")]
            greedy = SamplingParams(max_new_tokens=5, temperature=0)
            await engine.apply_update(delta(v0, v1, 1))
            assert engine.version == 1
            calls = await standin_calls(engine)
            assert [c["call"] for c in calls] == ["pause_generation", "update_weights_from_tensor", "continue_generation"]
            assert calls[0]["mode"] == "abort"
            assert calls[1] == {"call": "update_weights_from_tensor", "names": names[:2], "tp_entries": 1,
                                "load_format": None, "flush_cache": True, "weight_version": "1", "paused": True}
            gens = await engine.generate(prompts, greedy)
            for p, g in zip(prompts, gens):
                assert g.versions == [1] * 5  # the server's weight_version label, set by the update
                assert g.tokens[0] == expected(model_dirs[0], p, [], weights=v1)
            async with aiohttp.ClientSession() as s, s.get(f"{engine.base_url}/get_weight_version") as r:
                assert (await r.json())["weight_version"] == "1"

            # A full snapshot sends only the tensors whose bytes differ from what is served.
            full = encode_full(v2, model_id="tiny", version=2, key=KEY)
            await engine.apply_update(decode_version(full.manifest, full.pieces))
            sent = [c for c in await standin_calls(engine) if c["call"] == "update_weights_from_tensor"]
            assert sent[-1]["names"] == names[-1:] and sent[-1]["weight_version"] == "2"

            # Read-back: the served values, and their digests, are v2's exactly.
            back = await engine.read_back(names[:1])
            assert (back[names[0]] == v2[names[0]].float().numpy()).all()
            served = await engine.served_digests(names)
            assert served.version == 2 and served.digests == {n: tensor_digest(v2[n]) for n in names}
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_failed_tensor_update_is_undone_and_the_old_version_keeps_serving(model_dirs, free_port):
    v0 = read_weights(model_dirs[0])
    names = sorted(v0)
    v1 = nudged(v0, names[:3])
    update = delta(v0, v1, 1)

    async def main():
        engine = await SGLangEngine.open(launch_config(model_dirs, free_port))
        try:
            prompt = engine.encode("x=")
            async with aiohttp.ClientSession() as s:
                await s.post(f"{engine.base_url}/standin/fail_tensor_updates", json={"count": 1})
            with pytest.raises(EngineError, match="still serving v0"):
                await engine.apply_update(update)  # the server took one tensor, then broke
            assert engine.version == 0
            calls = await standin_calls(engine)
            assert [c["call"] for c in calls] == ["pause_generation", "update_weights_from_tensor",
                                                  "update_weights_from_tensor", "continue_generation"]
            assert calls[2]["names"] == names[:3] and calls[2]["weight_version"] == "0"  # the old bytes back
            (g,) = await engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0))
            assert g.tokens[0] == expected(model_dirs[0], prompt, [], weights=v0)
            await engine.apply_update(update)  # the host copy was put back too: the delta applies now
            (g,) = await engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0))
            assert g.versions == [1] * 3 and g.tokens[0] == expected(model_dirs[0], prompt, [], weights=v1)
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_server_without_the_tensor_route_falls_back_to_disk_reloads(model_dirs, free_port, caplog):
    v0 = read_weights(model_dirs[0])

    async def main():
        engine = await SGLangEngine.open(launch_config(model_dirs, free_port, extra=("--no-tensor-route",)))
        try:
            assert not engine.supports_in_place
            with pytest.raises(EngineError, match="load_version"):
                await engine.apply_update(delta(v0, nudged(v0, sorted(v0)[:1]), 1))
            await engine.load_version(model_dirs[1], 1)
            assert engine.version == 1
            assert [c["call"] for c in await standin_calls(engine)] == [
                "pause_generation", "update_weights_from_disk", "continue_generation"]
        finally:
            await engine.close()

    with caplog.at_level("WARNING", logger="deltamesh.mesh.engines.sglang_engine"):
        asyncio.run(main())
    assert any("no /update_weights_from_tensor (HTTP 404)" in r.getMessage() for r in caplog.records)


def test_weight_update_disk_never_sends_tensors(model_dirs, free_port):
    async def main():
        config = launch_config(model_dirs, free_port)
        config.weight_update = "disk"
        engine = await SGLangEngine.open(config)
        try:
            assert not engine.supports_in_place
        finally:
            await engine.close()

    asyncio.run(main())


def test_an_attached_server_takes_deltas_in_place_once_a_reload_made_the_host_copy_match(model_dirs, free_port):
    server = subprocess.Popen(
        [sys.executable, str(STANDIN_PATH), "--model-path", str(model_dirs[0]), "--port", str(free_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    v1 = read_weights(model_dirs[1])
    try:
        async def main():
            # model_path is only where the pool starts from: the attached server may serve anything.
            config = SGLangEngineConfig(model_id="tiny", url=f"http://127.0.0.1:{free_port}",
                                        model_path=str(model_dirs[0]), tensor_device="cpu")
            engine = await SGLangEngine.open(config)
            try:
                assert engine.supports_in_place
                update = delta(v1, nudged(v1, sorted(v1)[:1]), 2)
                with pytest.raises(EngineError, match="load_version first"):
                    await engine.apply_update(update)
                await engine.load_version(model_dirs[1], 1)
                await engine.apply_update(update)
                assert engine.version == 2
            finally:
                await engine.close()

        asyncio.run(main())
    finally:
        server.kill()
        server.wait(timeout=10)
