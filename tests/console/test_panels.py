"""The console's pure parts: the version history and its slowest hop, rates over a minute, pool and
link health, and reading a gateway's pools and links from its Prometheus text."""

from __future__ import annotations

from deltamesh.mesh.console import prom
from deltamesh.mesh.console.history import Rates, VersionHistory
from deltamesh.mesh.console.panels import balance_summary, link_health, pool_state


def test_a_version_is_laid_out_from_its_publication_with_its_slowest_hop():
    history = VersionHistory(keep=3)
    history.stored("m", 5, "us", 100.0)
    history.stored("m", 5, "eu", 100.4)
    history.stored("m", 5, "ap", 102.0)
    history.serving("m", 5, "ap-1", 102.5)
    history.serving("m", 5, "eu-1", 100.6)
    parents = {"gateway:eu": "gateway:us", "gateway:ap": "gateway:eu", "pool:ap-1": "gateway:ap",
               "pool:eu-1": "gateway:eu"}
    (v,) = history.describe("m", "us", parents)
    assert v["version"] == 5 and v["published"] == 100.0
    assert v["after_s"] == {"gateway:ap": 2.0, "gateway:eu": 0.4, "gateway:us": 0.0, "pool:ap-1": 2.5,
                            "pool:eu-1": 0.6}
    assert v["slowest"] == {"from": "gateway:eu", "to": "gateway:ap", "seconds": 1.6}
    assert v["everywhere_s"] == 2.5


def test_the_history_keeps_the_newest_versions_and_the_first_times():
    history = VersionHistory(keep=3)
    for version in range(10):
        history.stored("m", version, "us", float(version))
    history.stored("m", 2, "us", 0.0)  # older than all kept: ignored
    history.stored("m", 9, "us", 50.0)  # a later time for a version stored before: the first stays
    history.serving("m", 9, "p", 9.5)
    history.serving("m", 9, "p", 20.0, replace=False)
    described = history.describe("m", "us", {})
    assert [v["version"] for v in described] == [9, 8, 7]
    assert described[0]["after_s"] == {"gateway:us": 0.0, "pool:p": 0.5}


def test_rates_per_minute_over_the_window_and_after_a_restart():
    now = [0.0]
    rates = Rates(window_s=60, clock=lambda: now[0])
    assert rates.per_minute("x") is None
    for t, value in ((0, 0), (10, 5), (20, 10)):
        now[0] = t
        rates.add("x", value)
    assert rates.per_minute("x") == 30.0 and rates.change("x") == 10
    now[0] = 30
    rates.add("x", 2)  # the counter restarted with its process
    assert rates.per_minute("x") is None
    now[0] = 40
    rates.add("x", 4)
    assert rates.per_minute("x") == 12.0


def test_a_pool_is_stale_when_behind_too_long_or_cut_off():
    assert pool_state(0, 0, gateway_ok=True, up=True, stale_after_s=30) == ("current", "")
    assert pool_state(2, 5, gateway_ok=True, up=True, stale_after_s=30)[0] == "behind"
    assert pool_state(2, 31, gateway_ok=True, up=True, stale_after_s=30)[0] == "stale"
    assert pool_state(0, 0, gateway_ok=False, up=True, stale_after_s=30) == ("stale", "its gateway does not answer")
    assert pool_state(0, 0, gateway_ok=True, up=False, stale_after_s=30)[0] == "stale"


def test_link_health():
    assert link_health({"rtt_ms": {"p95": 3.0}}, far_down=False, errors_grew=False) == "ok"
    assert link_health({"rtt_ms": {"p95": 900.0}}, far_down=False, errors_grew=False) == "slow"
    assert link_health({"rtt_ms": {"p95": 3.0}}, far_down=False, errors_grew=True) == "errors"
    assert link_health({"up": False}, far_down=False, errors_grew=False) == "down"
    assert link_health({}, far_down=True, errors_grew=False) == "down"


def test_a_gateways_pools_and_links_are_read_from_its_metrics():
    text = "\n".join([
        "# TYPE deltamesh_gateway_pool_version gauge",
        'deltamesh_gateway_pool_version{model="m",pool="p1"} 7.0',
        'deltamesh_gateway_pool_versions_behind{model="m",pool="p1"} 1.0',
        'deltamesh_gateway_pool_up{model="m",pool="p1"} 1.0',
        "# TYPE deltamesh_gateway_link_rtt_seconds gauge",
        'deltamesh_gateway_link_rtt_seconds{peer="eu",quantile="0.5",role="downstream"} 0.012',
        'deltamesh_gateway_link_rtt_seconds{peer="eu",quantile="0.95",role="downstream"} 0.030',
        "# TYPE deltamesh_gateway_link_errors_total counter",
        'deltamesh_gateway_link_errors_total{peer="eu",role="downstream"} 2.0',
        'deltamesh_gateway_head_version{model="m"} 8.0', ""])
    samples = prom.parse_metrics(text)
    assert prom.gateway_pools(samples) == [{"name": "p1", "model": "m", "version": 7, "versions_behind": 1, "up": True}]
    (link,) = prom.gateway_links(samples)
    assert link["peer"] == "eu" and link["rtt_ms"] == {"p50": 12.0, "p95": 30.0} and link["errors"] == 2
    assert prom.gateway_heads(samples) == {"m": 8}
    assert prom.parse_metrics("not { prometheus") == {}


def test_the_balance_report_says_which_way_the_autoscaler_moves():
    assert balance_summary({"gpus": 4, "target_gpus": 6, "models": {}})["decision"] == "scale up: 4 -> 6 GPUs"
    assert balance_summary({"gpus": 4, "target_gpus": 4, "models": {}})["decision"] == "hold at 4 GPUs"
    assert balance_summary(None) is None
