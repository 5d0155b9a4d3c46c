"""docs/DEPLOY.md's 3-host walk-through, run as written with every host on this machine: each host is a
folder, its names map to loopback addresses (origin 127.0.0.1, eu 127.0.0.2, ap 127.0.0.3; a server's
`0.0.0.0` becomes its host's), Prometheus's config folder is a folder of the test's, and `scp` is a
stand-in that copies between the host folders. The lines run in a network namespace of their own
(fixed ports): keys, CA and certificates, tokens, the origin gateway and broker, two relays in a chain,
the trainer's publish, a pool in each region bit-exact, the admin's tables and `promtool`."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from deltamesh.config import load_config
from deltamesh.delta import read_weights, write_weights
from deltamesh.gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "DEPLOY.md"
HOSTS = {"origin.example.net": "127.0.0.1", "eu.example.net": "127.0.0.2", "ap.example.net": "127.0.0.3"}
pytestmark = [pytest.mark.slow, pytest.mark.netns]

SCP = '''import os, shutil, sys
from pathlib import Path
# scp stand-in: HOST:PATH is PATH in the folder HOST of the hosts folder (its home folder when PATH is empty)
ROOT = Path(os.environ["DEPLOY_HOSTS"])
*sources, dest = [a for a in sys.argv[1:] if not a.startswith("-")]
def local(arg):
    host, sep, path = arg.partition(":")
    return ROOT / host / path if sep else Path(arg)
target = local(dest)
for source in map(local, sources):
    shutil.copy(source, target / source.name if target.is_dir() else target)
'''


def host_blocks() -> list[tuple[str, list[str]]]:
    """(host, lines) of each bash block, in order; the block's first line says `# on HOST`."""
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S):
        first, *lines = [line for line in block.splitlines() if line.strip()]
        host = re.fullmatch(r"# on (\S+)", first)
        assert host and host.group(1) in HOSTS, f"a DEPLOY.md block must start with '# on HOST': {first!r}"
        blocks.append((host.group(1), lines))
    return blocks


def on_this_machine(line: str, host: str, prometheus: Path) -> str:
    """`line` with the walk-through's addresses (and Prometheus's folder) replaced by the test's."""
    line = line.replace("0.0.0.0", HOSTS[host]).replace("/etc/prometheus", str(prometheus))
    for name, address in HOSTS.items():
        line = line.replace(name, address)
    return line


def prometheus_folder(tmp: Path) -> Path:
    """The shipped scrape config and rules, as the operator copies them: targets at the test's addresses."""
    folder = tmp / "etc-prometheus"
    folder.mkdir()
    for name in ("prometheus.yml", "deltamesh-rules.yml"):
        text = (ROOT / "deploy" / "prometheus" / name).read_text()
        (folder / name).write_text(on_this_machine(text, "origin.example.net", folder))
    return folder


def test_the_walk_through_runs_on_one_machine(tmp_path, run_documented_lines):
    if shutil.which("promtool") is None:
        pytest.skip("needs promtool (benchmarks/setup_prometheus.sh)")
    hosts = tmp_path / "hosts"
    for address in HOSTS.values():
        (hosts / address).mkdir(parents=True)
    origin = hosts / HOSTS["origin.example.net"]
    gen = torch.Generator().manual_seed(5)
    weights = {"layer.weight": torch.randn(96, 64, generator=gen).to(torch.bfloat16),
               "layer.bias": torch.randn(96, generator=gen).to(torch.bfloat16)}
    write_weights(origin / "weights", weights)
    prometheus = prometheus_folder(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scp").write_text(f"#!{sys.executable}\n{SCP}")
    (bin_dir / "scp").chmod(0o755)

    lines = []
    for host, block in host_blocks():
        lines.append(f"cd {hosts / HOSTS[host]}")
        lines += [on_this_machine(line, host, prometheus) for line in block]
    ran = run_documented_lines(lines, tmp_path, env={"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "DEPLOY_HOSTS": str(hosts)})
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-4000:]
    assert "others may read it" not in ran.stderr  # the walk-through keeps its secrets private

    for region, pool in (("eu.example.net", "pool-eu-1"), ("ap.example.net", "pool-ap-1")):
        synced = read_weights(hosts / HOSTS[region] / pool)
        assert all(torch.equal(synced[n].view(torch.int16), w.view(torch.int16)) for n, w in weights.items())
    assert len(re.findall(r"^policy v0$", ran.stdout, re.M)) == 2, ran.stdout  # each pool says what it holds
    assert "ap-1" in ran.stdout  # the admin's table of the ap gateway lists its pool
    for secret in origin.glob("*.token"):
        assert secret.read_text().strip() not in (origin / "tokens.toml").read_text()


def test_the_unit_config_loads(tmp_path):
    (text,) = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.S)
    for name in ("ca.pem", "trainer.key.pub"):  # the files it names, as the operator put them there
        (tmp_path / name).write_text("")
    (tmp_path / "gateway.toml").write_text(text.replace("/etc/deltamesh/", f"{tmp_path}/"))
    config = load_config(GatewayConfig, tmp_path / "gateway.toml", section="gateway")
    assert config.region == "eu" and config.upstreams == ["https://origin.example.net:8700"]
