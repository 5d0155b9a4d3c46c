"""deploy/prometheus and deploy/grafana against a real Prometheus server and a running mini-mesh.

`promtool` checks the shipped scrape config (its credential and CA paths pointed at real files) and
rules, and runs the rules' unit tests. Then a copy of both, with the mini-mesh's addresses, 1 s
intervals and `for: 1s`, runs in a real `prometheus` against an origin gateway, a relay and a pool
syncing from it: the server's HTTP API must show the relay's link RTT (p50 and p95) and the pool's
lag, and once the pool is killed (it does not deregister) and the trainer publishes on, the pool's
stale and down alerts must fire. Every query of the Grafana dashboard must parse and name metrics
the services expose. Needs the `prometheus` Debian package (benchmarks/setup_prometheus.sh).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from deltamesh.gateway.server.metrics import GatewayMetrics
from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.demo.processes import end_process
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.metrics import service_registry
from deltamesh.trainer.metrics import TrainerMetrics
from deltamesh.trainer.publisher import Publisher

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "deltamesh.json"
MODEL = "tiny"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool")
                                                   is None, reason="needs prometheus (benchmarks/setup_prometheus.sh)")]


def promtool(*args: str, cwd: Path) -> None:
    done = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def exposed_names() -> set[str]:
    """Every sample name the gateway, broker, trainer and pool registries can expose."""
    registries = [GatewayMetrics().registry, BrokerMetrics().registry, TrainerMetrics().registry, service_registry("pool")]
    PoolMetrics(registries[-1])
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def scrape_copy(tmp: Path, gateways: list[str]) -> Path:
    """The shipped config and rules, for the mini-mesh: plain HTTP, its gateways, 1 s everything."""
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "deltamesh-gateway")
    for key in ("scheme", "tls_config", "authorization"):  # the test's gateways are anonymous HTTP
        job.pop(key)
    job["static_configs"] = [{"targets": [urllib.parse.urlsplit(u).netloc], "labels": {"region": r}}
                             for r, u in gateways]
    config["scrape_configs"] = [job]
    rules = yaml.safe_load((PROM / "deltamesh-rules.yml").read_text())
    for rule in rules["groups"][0]["rules"]:
        rule["for"] = "1s"
        if rule["alert"] == "DeltameshPoolStale":
            rule["expr"] = rule["expr"].replace("> 3", "> 1")
    (tmp / "deltamesh-rules.yml").write_text(yaml.safe_dump(rules))
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def api(base: str, path: str, **params: str) -> dict:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        answer = json.loads(r.read())
    assert answer["status"] == "success", answer
    return answer["data"]


def ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_shipped_config_and_rules_pass_promtool(tmp_path):
    (tmp_path / "ca.pem").write_text("unused")
    (tmp_path / "metrics.token").write_text("unused")
    text = (PROM / "prometheus.yml").read_text().replace("/etc/prometheus/deltamesh-ca.pem", str(tmp_path / "ca.pem"))
    text = text.replace("/etc/prometheus/deltamesh-metrics.token", str(tmp_path / "metrics.token"))
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copy(PROM / "deltamesh-rules.yml", tmp_path)
    promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    promtool("check", "rules", str(PROM / "deltamesh-rules.yml"), cwd=PROM)
    promtool("test", "rules", "rules_test.yml", cwd=PROM)


def test_dashboard_is_grafana_json_with_real_metric_names():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    names = exposed_names()
    used = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            used.update(re.findall(r"\bdeltamesh_\w+", target["expr"]))
    assert used and used <= names, used - names
    for topic in ("link_rtt", "propagation", "pool_versions_behind", "ingested", "wait_fraction", "mismatch"):
        assert any(topic in name for name in used), topic


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$__rate_interval", "1m") for p in dash["panels"] for t in p.get("targets", [])]


def test_prometheus_scrapes_a_mini_mesh_and_a_stopped_pool_fires(kit, spawn_gateway, spawn_pool, tmp_path):
    origin = spawn_gateway("origin", start=False)
    relay = spawn_gateway("eu", upstreams=[origin.url], start=False)
    for g in (origin, relay):
        g.wait()
    pool = spawn_pool("eu-1", [relay.url])
    config = scrape_copy(tmp_path, [("origin", origin.url), ("eu", relay.url)])
    promtool("check", "config", config.name, cwd=tmp_path)
    port = kit.free_port()
    server = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    weights = [kit.tiny_weights()]
    pub = Publisher(origin.url, kit.key.key, MODEL, full_every=100, piece_bytes=4096)

    def publish(v: int) -> None:
        if v:
            weights.append(kit.next_step(weights[-1], v))
        asyncio.run(pub.publish(weights[v]))

    def query(expr: str) -> list[dict]:
        return api(base, "query", query=expr)["result"]

    def firing(alert: str) -> bool:
        return any(a["labels"]["alertname"] == alert and a["labels"].get("pool") == "eu-1" and a["state"] == "firing"
                   for a in api(base, "alerts")["alerts"])

    try:
        kit.wait_until(lambda: ready(base), 30, "prometheus to be ready")
        publish(0)
        kit.wait_until(lambda: bool(query('deltamesh_gateway_pool_versions_behind{pool="eu-1",region="eu"} == 0')),
                       30, "the pool's lag at 0 in Prometheus")
        kit.wait_until(lambda: len(query('deltamesh_gateway_link_rtt_seconds{region="eu",role="upstream"}')) == 2,
                       20, "the relay's upstream RTT p50 and p95")
        assert all(0 < float(s["value"][1]) < 1
                   for s in query('deltamesh_gateway_link_rtt_seconds{region="eu",role="upstream"}'))
        assert query('deltamesh_build_info{job="deltamesh-gateway"}') and query("process_resident_memory_bytes")
        assert not query('{__name__=~"deltamesh_.*_created"}')
        assert not firing("DeltameshPoolStale")
        for expr in dashboard_queries():  # the dashboard's PromQL parses on a real server
            query(expr)

        pool.stop(signal.SIGKILL)  # a pool that dies does not deregister: its gateway keeps its record
        for v in (1, 2):
            publish(v)
        kit.wait_until(lambda: firing("DeltameshPoolStale"), 30, "the stale-pool alert to fire")
        kit.wait_until(lambda: firing("DeltameshPoolDown"), 30, "the pool-down alert to fire")
        lag = query('deltamesh_gateway_pool_versions_behind{pool="eu-1",region="eu"}')
        assert float(lag[0]["value"][1]) == 2
    finally:
        end_process(server, signal.SIGTERM)
