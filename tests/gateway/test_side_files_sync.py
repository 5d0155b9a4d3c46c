"""A fresh pool becomes a loadable model directory from what the trainer publishes: config, tokenizer and
generation files travel in each version (signed), are re-shipped only when they change, and a relay
that tampers with one is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import AsyncIterator

import deltamesh_test_passthrough as passthrough  # a helper module of this folder, loaded by its conftest.py
import pytest
import torch
from aiohttp import ClientSession, ClientTimeout, web

from deltamesh.delta import dir_manifest, load_public_key, read_weights, write_weights
from deltamesh.delta.manifest import Manifest, load_manifest
from deltamesh.http import serving
from deltamesh.mesh.demo.models import tiny_model_dir
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import SyncError, WeightSync
from deltamesh.trainer.publisher import Publisher

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
MODEL = "tiny-hf"
pytestmark = pytest.mark.slow


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # The pool's token by the environment (the gateway is anonymous and takes any): never on the command line.
    return subprocess.run([DELTAMESH, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", "DELTAMESH_TOKEN": "t"})


def _manifest(kit, url: str, version: int, kind: str) -> Manifest:
    """A version's manifest as the gateway serves it, signature verified."""
    with urllib.request.urlopen(f"{url}/v1/models/{MODEL}/versions/{version}/{kind}/manifest", timeout=10) as r:
        return load_manifest(r.read(), [load_public_key(kit.key.public)])


def _loads_as(pool: Path, source: Path) -> None:
    """`from_pretrained` loads the pool's directory alone, with the source model's weights and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(pool, local_files_only=True, dtype=torch.bfloat16)
    expected = read_weights(source)
    state = model.state_dict()
    assert all(torch.equal(state[name].view(torch.int16), t.view(torch.int16)) for name, t in expected.items())
    tok, ref = AutoTokenizer.from_pretrained(pool, local_files_only=True), AutoTokenizer.from_pretrained(source)
    assert tok("deltamesh 1+2=3")["input_ids"] == ref("deltamesh 1+2=3")["input_ids"]
    assert tok.eos_token_id == ref.eos_token_id and model.generation_config.eos_token_id == ref.eos_token_id


def test_a_fresh_pool_syncs_a_loadable_model_directory_and_deltas_reship_only_changed_files(
        kit, spawn_gateway, tmp_path):
    gw = spawn_gateway("eu-1")
    src = tmp_path / "trainer-model"
    shutil.copytree(tiny_model_dir(), src)
    side = sorted(p.name for p in src.iterdir() if p.name != "model.safetensors")
    state = tmp_path / "publish-state"
    publish = ["--gateway", gw.url, "--model", MODEL, "--key", str(kit.key.private), "--state", str(state),
               "--piece-mib", "0.05", str(src)]
    first = _run("publish", *publish)
    assert first.returncode == 0, first.stderr
    full = _manifest(kit, gw.url, 0, "full")
    assert [f.name for f in full.files] == side and all(f.piece is not None for f in full.files)

    pool = tmp_path / "pool"
    pool.mkdir()  # empty: nothing pre-seeded
    sync = ["pool", "sync", "--gateway", gw.url, "--name", "fresh", "--dir", str(pool),
            "--trusted-key", str(kit.key.public), "--once"]
    done = _run(*sync)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in pool.iterdir()) == sorted([*side, "model.safetensors", "deltamesh-manifest.json"])
    _loads_as(pool, src)

    # The next version changes weights only: its delta lists the side files, signed, but ships none.
    write_weights(src, kit.next_step(read_weights(src), 1))
    second = _run("publish", *publish)
    assert second.returncode == 0 and "v1: delta" in second.stdout, second.stderr
    delta = _manifest(kit, gw.url, 1, "delta")
    assert [f.name for f in delta.files] == side and all(f.piece is None for f in delta.files)
    assert all(p.tensors for p in delta.pieces), "no side-file piece"
    assert _run(*sync).returncode == 0 and dir_manifest(pool).version == 1
    _loads_as(pool, src)

    # A changed generation config is shipped, alone.
    config = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 7}))
    write_weights(src, kit.next_step(read_weights(src), 2))
    assert _run("publish", *publish).returncode == 0
    shipped = [f.name for f in _manifest(kit, gw.url, 2, "delta").files if f.piece is not None]
    assert shipped == ["generation_config.json"]
    assert _run(*sync).returncode == 0 and dir_manifest(pool).version == 2
    assert json.loads((pool / "generation_config.json").read_text())["max_new_tokens"] == 7
    _loads_as(pool, src)


class Tamper:
    """A relay in front of a real gateway that changes one byte of the pieces it is told to, and every
    byte of the parts of a version it serves (so the told pieces never come intact in a part)."""

    def __init__(self, real: str, pieces: set[int]):
        self.real, self.pieces, self.served, self.url = real, pieces, 0, ""

    async def _handle(self, request: web.Request) -> web.Response:
        data, status, headers = await passthrough.pass_through(self._session, self.real, request)
        index = request.path.rsplit("/", 1)[-1]
        if "/parts/" in request.path and status == 200:
            data = bytes(b ^ 0x01 for b in data)
            self.served += 1
        elif "/pieces/" in request.path and int(index) in self.pieces and status in (200, 206) and data:
            data = data[:-2] + bytes([data[-2] ^ 0x01]) + data[-1:]
            self.served += 1
        return web.Response(body=data, status=status, headers=headers)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator["Tamper"]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        async with ClientSession(timeout=ClientTimeout(total=None)) as self._session:
            async with serving(app, "127.0.0.1:0") as url:
                self.url = url
                yield self


def test_a_side_file_tampered_with_by_a_relay_is_refused(kit, tmp_path):
    files = {"config.json": b'{"model_type": "qwen3"}', "tokenizer.json": b'{"version": "1.0"}'}

    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            pub = Publisher(url, kit.key.key, MODEL, piece_bytes=4096, side_files=files)
            published = await pub.publish(kit.tiny_weights())
            carrier = {f.name: f.piece for f in published.manifests[0].files}["config.json"]
            async with Tamper(url, {carrier}).serving() as relay:
                alone = PoolSyncConfig(gateways=[relay.url], token="t", name="p", dir=str(tmp_path / "alone"),
                                       trusted_keys=[str(kit.key.public)], model=MODEL, stall_timeout_s=2.0,
                                       give_up_s=4.0)
                async with WeightSync(alone) as sync:
                    with pytest.raises(SyncError, match="hash"):
                        await sync.sync_once()
                assert relay.served and not (tmp_path / "alone").exists(), "nothing written"
                # With an honest gateway beside it, the pool takes the file from there.
                both = PoolSyncConfig(gateways=[relay.url, url], token="t", name="q", dir=str(tmp_path / "both"),
                                      trusted_keys=[str(kit.key.public)], model=MODEL, stall_timeout_s=2.0,
                                      give_up_s=10.0)
                async with WeightSync(both) as sync:
                    assert await sync.sync_once() is True
                assert {n: (tmp_path / "both" / n).read_bytes() for n in files} == files

    asyncio.run(main())
