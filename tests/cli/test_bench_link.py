"""`deltamesh bench link` against a real gateway process that authenticates: the figures of its JSON
(RTT, throughput over 1 and N connections, the head fetched whole, delta and full), the table of
docs/CLI.md's line as written, and a wrong token refused with exit code 4 before anything is read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from common import wait_healthy

from deltamesh.delta import write_weights
from deltamesh.mesh.cli.exits import Exit
from deltamesh.mesh.demo.processes import end_process, free_port
from deltamesh.tokens import TokenSpec, add_token

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DELTAMESH = str(BIN / "deltamesh")
MODEL = "bench-m"
pytestmark = pytest.mark.slow


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAMESH_")}
    return subprocess.run([DELTAMESH, *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **(env or {})}, cwd=cwd)


def documented_line(command: str) -> str:
    """The line of docs/CLI.md's benchmark block that runs `command`."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "CLI.md").read_text(), flags=re.S)
    (line,) = [ln for b in blocks for ln in b.splitlines() if ln.startswith(command)]
    return line


def weights(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = {"layer.weight": torch.randn(512, 1024, generator=gen).to(torch.bfloat16)}
    words = w["layer.weight"].view(torch.int16).view(-1)
    words[: step * 1000] += 1  # an RL step: a few words move by one ulp
    return w


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """(URL, pool token, admin token) of a gateway process with two published versions of MODEL."""
    tmp_path = tmp_path_factory.mktemp("gateway")
    tokens = tmp_path / "tokens.toml"
    trainer = add_token(tokens, TokenSpec("t", "trainer", [MODEL]))
    pool = add_token(tokens, TokenSpec("p1", "pool"))
    admin = add_token(tokens, TokenSpec("ops", "admin"))
    assert run("keys", "generate", "--out", str(tmp_path / "trainer.key")).returncode == 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([DELTAMESH, "gateway", "--listen", f"127.0.0.1:{port}", "--store", str(tmp_path / "s"),
                             "--trusted-key", str(tmp_path / "trainer.key.pub"), "--tokens-file", str(tokens)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, timeout=30)
        for step in (0, 1):  # v0 a full; v1 a delta, and a full too (--full-every 1)
            write_weights(tmp_path / f"w{step}", weights(step))
            done = run("publish", "--gateway", url, "--model", MODEL, "--key", str(tmp_path / "trainer.key"),
                       "--state", str(tmp_path / "state"), "--piece-mib", "0.25",
                       "--full-every", "1", str(tmp_path / f"w{step}"), env={"DELTAMESH_TOKEN": trainer})
            assert done.returncode == 0, done.stderr
        yield url, pool, admin
    finally:
        end_process(proc)


def bytes_served(url: str, admin: str) -> float:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {admin}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("deltamesh_gateway_bytes_out_total"))


def versions(url: str, token: str) -> dict:
    request = urllib.request.Request(f"{url}/v1/models/{MODEL}/versions", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def test_bench_link_measures_a_real_gateway(gateway, tmp_path):
    url, pool, _ = gateway
    secret = tmp_path / "pool.token"
    secret.write_text(pool + "\n")
    secret.chmod(0o600)
    done = run("bench", "link", "--gateway", url, "--json", "--token-file", str(secret), "--connections", "4",
               "--range-mb", "0.1")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == MODEL and 0 < result["rtt_ms"]["p50"] <= result["rtt_ms"]["p95"]
    stored = {(v["version"], v["kind"]): v for v in versions(url, pool)["versions"]}
    tp = result["throughput"]
    assert (tp["version"], tp["kind"]) == (1, "full")
    full = stored[(1, "full")]["payload_bytes"]
    for key, connections in (("one", 1), ("parallel", 4)):
        assert tp[key]["connections"] == connections and tp[key]["mbit_per_s"] > 0
        assert tp[key]["bytes"] == full  # below --sample-mb: the whole version, in 0.1 MiB ranges
    head = result["head"]
    assert head["version"] == 1 and set(head["kinds"]) == {"delta", "full"}
    for kind, figure in head["kinds"].items():
        assert figure["bytes"] == figure["payload_bytes"] == stored[(1, kind)]["payload_bytes"]
        assert figure["seconds"] > 0 and figure["pieces"] == stored[(1, kind)]["pieces"]
    assert head["kinds"]["delta"]["base_version"] == 0


def test_the_documented_line_prints_a_table(gateway, tmp_path):
    url, pool, _ = gateway
    (tmp_path / "pool.token").write_text(pool + "\n")
    (tmp_path / "pool.token").chmod(0o600)
    line = documented_line("deltamesh bench link")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAMESH_")}
    env.update(GATEWAY=url, PATH=f"{BIN}:{env['PATH']}", COLUMNS="120")
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for figure in ("RTT p50", "RTT p95", "throughput, 1 conn.", "throughput, 8 conn.", "head v1 delta from v0",
                   "head v1 full"):
        assert figure in done.stdout, done.stdout


def test_a_wrong_token_is_refused_before_anything_is_read(gateway):
    url, _, admin = gateway
    before = bytes_served(url, admin)
    done = run("bench", "link", "--gateway", url, "--json", env={"DELTAMESH_TOKEN": "dm_wrong"})
    assert done.returncode == Exit.REFUSED and done.stdout == "", (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "401" in lines[0] and "Traceback" not in done.stderr
    assert bytes_served(url, admin) == before
