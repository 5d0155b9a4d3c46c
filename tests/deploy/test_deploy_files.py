"""deploy/: the systemd units pass `systemd-analyze verify`, the Kubernetes manifests validate
against the Kubernetes schemas (kubernetes-validate, strict) and their config tables name real
settings, and the Dockerfiles copy what exists and install the right extra (the gateway's no torch).
Building the images needs a Docker daemon, which is tried only where `docker info` answers."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from deltamesh.gateway.config import GatewayConfig
from deltamesh.mesh.broker.config import BrokerConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DELTAMESH = Path(sys.executable).with_name("deltamesh")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("unit", ["deltamesh-gateway.service", "deltamesh-broker.service", "deltamesh-pool.service"])
def test_systemd_unit_verifies(unit, tmp_path):
    text = (DEPLOY / "systemd" / unit).read_text()
    assert "DynamicUser=yes" in text and "NoNewPrivileges=yes" in text and "ProtectSystem=strict" in text
    # verify checks that ExecStart's binary exists: point it at this checkout's, as installed here.
    (tmp_path / unit).write_text(text.replace("/opt/deltamesh/bin/deltamesh", str(DELTAMESH)))
    done = subprocess.run(["systemd-analyze", "verify", unit], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stdout + done.stderr  # unknown keys only warn


def manifests() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_kubernetes_manifests_validate():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = set()
    for _name, doc in manifests():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)  # raises on any schema violation
        kinds.add((doc["kind"], doc["metadata"]["name"]))
    assert {("StatefulSet", "deltamesh-gateway"), ("Service", "deltamesh-gateway"), ("StatefulSet", "deltamesh-broker"),
            ("Deployment", "deltamesh-pool")} <= kinds


@pytest.mark.parametrize("section, config", [("gateway", GatewayConfig), ("broker", BrokerConfig)])
def test_kubernetes_configs_name_real_settings(section, config):
    (text,) = [doc["data"][f"{section}.toml"] for _, doc in manifests()
               if doc["kind"] == "ConfigMap" and f"{section}.toml" in doc.get("data", {})]
    table = tomllib.loads(text)[section]
    assert set(table) <= {f.name for f in dataclasses.fields(config)}, table


def dockerfiles() -> list[Path]:
    return sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def test_dockerfiles_copy_what_exists_and_pick_their_extra():
    assert {p.name.split(".")[0] for p in dockerfiles()} == {"gateway", "broker", "pool", "trainer"}
    for path in dockerfiles():
        text = path.read_text()
        for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
            assert all((ROOT / src).exists() for src in line.split()[:-1]), line
        role = path.name.split(".")[0]
        extra = re.search(r'\$\(ls /wheels/deltamesh-\*\.whl\)\[([^\]]+)\]', text).group(1)
        assert extra == ("$ROLE" if role in ("pool", "trainer") else role)
        installs_torch = re.search(r"^RUN .*torch==", text, re.M) is not None
        assert installs_torch == (role in ("pool", "trainer")), path.name
        assert "USER 10001" in text


def docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not docker_daemon(), reason="no Docker daemon here (`docker info` fails)")
def test_gateway_image_builds_and_has_no_torch():
    tag = "deltamesh-gateway:test"
    subprocess.run(["docker", "build", "-f", "deploy/docker/gateway.Dockerfile", "-t", tag, "."], cwd=ROOT,
                   check=True, timeout=1200)
    probe = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python", tag, "-c", "import torch"],
                           capture_output=True, timeout=120)
    assert probe.returncode != 0
