"""The meshes of README.md and docs/SECURITY.md, run as written. The README's: keys, a CA and
certificates, tokens, a TLS origin and a TLS relay pulling from it with a gateway token, a publish with
the trainer's token, a pool syncing through the relay bit-exact, the admin's tables and a TLS broker;
its servers read their settings from the repository's examples/ files (a copy in the scratch folder).
SECURITY.md's: three regions, mTLS between gateways and for the trainer, a pool two relay hops away.
The lines use fixed ports, so each runs in a network namespace of its own, where nothing else listens."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import tomllib
import torch

from deltamesh.delta import read_weights, write_weights

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.netns]



# The README's web console, once up, shows the pool that synced through the relay, at the published version.
CONSOLE_SHOWS_POOL = """import json, sys, time, urllib.request
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    snap = json.load(urllib.request.urlopen("http://127.0.0.1:8790/api/snapshot", timeout=5))
    if [(p["name"], p["region"], p["version"]) for p in snap.get("pools", [])] == [("eu-1", "eu", 0)]:
        sys.exit(0)
    time.sleep(0.5)
sys.exit(f"the console does not show pool eu-1 at v0: {snap.get('pools')}")
"""


def doc_lines(doc: str) -> list[str]:
    """The lines of the one bash block of `doc` that sets up a mesh."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
                if "deltamesh certs" in b]
    return [line for line in block.splitlines() if line.strip()]


def listen_addresses(lines: list[str], cwd: Path) -> list[str]:
    """Where each server line (ending in `&`) listens: its `--listen`, or that of its `--config` file's table
    (the command's own: `deltamesh gateway --config F` reads `[gateway]`)."""
    found = []
    for line in lines:
        if line.endswith("&"):
            argv = shlex.split(line.removesuffix("&"))
            if "--listen" in argv:
                found.append(argv[argv.index("--listen") + 1])
            else:
                config = tomllib.loads((cwd / argv[argv.index("--config") + 1]).read_text())
                found.append(config[argv[1]]["listen"])
    return found


@pytest.mark.parametrize("doc, pool_dir, admin_table", [("README.md", "pool-eu-1", "eu-1"),
                                                         ("docs/SECURITY.md", "pool-ap-1", None)])
def test_the_documented_mesh_runs_as_written(tmp_path, run_documented_lines, doc, pool_dir, admin_table):
    gen = torch.Generator().manual_seed(3)
    weights = {"layer.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
               "layer.bias": torch.randn(64, generator=gen).to(torch.bfloat16)}
    write_weights(tmp_path / "weights", weights)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    lines = doc_lines(doc)
    after = [f"python -c {shlex.quote(CONSOLE_SHOWS_POOL)}"] if doc == "README.md" else []
    ran = run_documented_lines(lines, tmp_path, ports=listen_addresses(lines, tmp_path), after=after)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    synced = read_weights(tmp_path / pool_dir)
    assert all(torch.equal(synced[name].view(torch.int16), w.view(torch.int16)) for name, w in weights.items())
    if admin_table is not None:
        assert admin_table in ran.stdout  # the admin's pools table lists the pool
    for secret in tmp_path.glob("*.token"):
        assert secret.read_text().strip() not in (tmp_path / "tokens.toml").read_text()
