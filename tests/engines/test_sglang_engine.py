"""The SGLang engine adapter against a stand-in server (tests/engines/sglang_standin.py).

SGLang needs CUDA, so it cannot run on these machines: the stand-in follows SGLang's documented HTTP
API (/generate with logprobs, /pause_generation, /update_weights_from_disk, /continue_generation,
/health, /get_model_info) and is started as a real process on a real socket, the way the adapter
starts `python -m sglang.launch_server`. benchmarks/sglang_check.py runs the same adapter against a
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

from deltamesh.mesh.engines.base import Engine, EngineError, SamplingParams
from deltamesh.mesh.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
from deltamesh.mesh.demo.models import TinyModelConfig, tiny_model_dir

STANDIN_PATH = Path(__file__).with_name("sglang_standin.py")
_spec = importlib.util.spec_from_file_location("sglang_standin", STANDIN_PATH)
standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standin)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("sglang-models")
    return [tiny_model_dir(TinyModelConfig(seed=s), path=root / f"v{s}") for s in range(2)]


def launch_config(model_dirs, port: int, delay_s: float = 0.002) -> SGLangEngineConfig:
    return SGLangEngineConfig(
        model_id="tiny", model_path=str(model_dirs[0]), port=port,
        launch_command=[sys.executable, str(STANDIN_PATH)], extra_args=["--token-delay-s", str(delay_s)],
        startup_timeout_s=60,
    )


def expected(model_dir: Path, prompt: list[int], tokens_so_far: list[int]) -> int:
    """The token the stand-in serving `model_dir` generates after prompt + tokens_so_far."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return standin.next_token(standin.fingerprint(str(model_dir)), prompt + tokens_so_far, vocab, {0, 1, 2, 3})


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
            assert isinstance(engine, Engine) and engine.version == 0 and not engine.supports_in_place
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

            with pytest.raises(EngineError, match="in place"):
                await engine.apply_update(None)  # type: ignore[arg-type]
        finally:
            await engine.close()
        assert not port_open(free_port)  # the launched server is gone

    asyncio.run(main())


def test_generation_straddling_a_swap_is_resumed_and_tagged_per_token(model_dirs, free_port):
    async def main():
        engine = await SGLangEngine.open(launch_config(model_dirs, free_port, delay_s=0.004))
        try:
            prompt = engine.encode("count: ")
            params = SamplingParams(max_new_tokens=120, temperature=1.0)

            async def swap_soon():
                await asyncio.sleep(0.15)
                await engine.load_version(model_dirs[1], 1)

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
        engine = await SGLangEngine.open(launch_config(model_dirs, free_port))
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
