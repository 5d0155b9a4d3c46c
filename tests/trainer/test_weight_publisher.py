"""`WeightPublisher`, the three-line publishing of any PyTorch loop, against real gateway processes.

An origin and a relay gateway (`deltamesh.mesh.vllm_plugin.local_mesh.LocalMesh`, with tokens) take
what the publisher sends; a pool's `deltamesh pool sync` at the relay then verifies it (signature,
hashes). The example of docs/API.md, `examples/publish_loop.py`, runs as written there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltamesh.delta import dir_manifest, read_weights
from deltamesh.http import HttpError
from deltamesh.mesh.demo.processes import deltamesh_command
from deltamesh.mesh.vllm_plugin.local_mesh import LocalMesh
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.weight_publisher import WeightPublisher, publishable

ROOT = Path(__file__).resolve().parents[2]
MODEL = "mlp"


@pytest.fixture
def mesh(tmp_path):
    with LocalMesh(tmp_path / "mesh", MODEL) as mesh:
        yield mesh


def write_config(mesh: LocalMesh, path: Path) -> Path:
    path.write_text(f'[publish]\ngateway = "{mesh.origin_url}"\nmodel = "{MODEL}"\nkey = "{mesh.key}"\nfull_every = 0\n')
    return path


def pool_sync(mesh: LocalMesh, directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*deltamesh_command(), "pool", "sync", "--once", "--gateway", mesh.relay_url,
                           "--token-file", str(mesh.pool_token_file), "--name", "vllm-eu", "--dir", str(directory),
                           "--trusted-key", str(mesh.public_key)], capture_output=True, text=True, timeout=120)


def test_a_module_in_three_lines_reaches_a_pool_in_another_region(mesh, tmp_path):
    config = write_config(mesh, tmp_path / "publish.toml")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with WeightPublisher.from_file(config, token_file=str(mesh.trainer_token_file)) as publisher:
        first = publisher.publish(model)
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        second = publisher.publish(model)
    assert (first.version, second.version) == (0, 1) and publisher.version == 1
    assert [m.kind for m in first.manifests] == ["full"] and [m.kind for m in second.manifests] == ["delta"]
    synced = pool_sync(mesh, tmp_path / "pool")
    assert synced.returncode == 0, synced.stderr
    assert dir_manifest(tmp_path / "pool").version == 1
    held = read_weights(tmp_path / "pool")
    assert all(torch.equal(held[n], p.detach().to(torch.bfloat16)) for n, p in model.state_dict().items())


def test_what_is_published_is_a_bf16_copy_with_tied_tensors_once():
    embed = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = embed.weight  # tied, as input and output embeddings often are
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    model.register_buffer("steps", torch.tensor(3))
    tensors = publishable(model)
    assert sorted(tensors) == ["embed.weight", "steps"]
    assert tensors["embed.weight"].dtype == torch.bfloat16 and tensors["steps"].dtype == torch.int64
    state = {"w": torch.ones(2, 2)}
    copied = publishable(state)
    state["w"].add_(1)  # the loop's next step leaves the published copy alone
    assert torch.equal(copied["w"], torch.ones(2, 2, dtype=torch.bfloat16))


def test_a_token_without_the_trainer_role_is_refused_and_nothing_is_published(mesh, tmp_path):
    config = write_config(mesh, tmp_path / "publish.toml")
    with WeightPublisher.from_file(config, token_file=str(mesh.pool_token_file)) as publisher:
        with pytest.raises(HttpError) as refused:
            publisher.publish({"w": torch.ones(4)})
    assert refused.value.status in (401, 403) and publisher.version is None
    other = tmp_path / "other.token"  # a trainer token for another model id
    other.write_text(add_token(mesh.root / "tokens.toml", TokenSpec("other", "trainer", ["other-model"])) + "\n")
    other.chmod(0o600)
    with WeightPublisher.from_file(config, token_file=str(other)) as publisher:
        with pytest.raises(HttpError) as refused:
            publisher.publish({"w": torch.ones(4)})
    assert refused.value.status in (401, 403)
    synced = pool_sync(mesh, tmp_path / "pool")
    assert synced.returncode != 0 and dir_manifest(tmp_path / "pool") is None


@pytest.mark.slow
def test_the_example_of_the_api_doc_runs_as_written(mesh, tmp_path):
    (line,) = [line for line in re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "API.md").read_text(), flags=re.S)
               for line in line.splitlines() if "examples/publish_loop.py" in line]
    write_config(mesh, mesh.root / "publish.toml")
    (mesh.root / "examples").symlink_to(ROOT / "examples")
    env_path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    run = subprocess.run(["bash", "-c", line], cwd=mesh.root, capture_output=True, text=True, timeout=300,
                         env={"PATH": env_path, "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert re.findall(r"published v(\d+)", run.stderr) == ["0", "1", "2"]
    synced = pool_sync(mesh, tmp_path / "pool")
    assert synced.returncode == 0 and dir_manifest(tmp_path / "pool").version == 2, synced.stderr
