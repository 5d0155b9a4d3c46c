"""A gateway's link monitor over an emulated WAN link: the RTT it measures is the link's RTT (within
10%), real relayed transfers show up as throughput on the link, and `deltamesh links` shows it all,
once or live with --watch. Real gateway processes in network namespaces joined by an emulated 100 ms
link, speaking mTLS as machines of a mesh do (each shows a certificate of the test's CA, which is
also its credential: the relay announces itself with it, so the origin probes it); needs root."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from wan import Wan

from deltamesh.certs import issue, make_ca
from deltamesh.delta import generate_key, save_keypair, write_weights

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.usefixtures("netns_ok")]

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
PORT = 8600
RTT_MS = 100.0


def tls_flags(tmp_path: Path, holder: str) -> list[str]:
    """The TLS flags of a process holding the certificate `holder` (file stem) of the test's CA."""
    pki = tmp_path / "pki"
    return ["--ca", str(pki / "ca.pem"), "--tls-cert", str(pki / f"{holder}.pem"), "--tls-key", str(pki / f"{holder}.key")]


def links_json(host, url: str, tmp_path: Path) -> dict:
    done = host.run([DELTAMESH, "links", "--gateway", url, "--json", *tls_flags(tmp_path, "admin-ops")], timeout=60)
    return json.loads(done.stdout)


def find(answer: dict, role: str) -> dict:
    found = [link for link in answer["links"] if link["role"] == role]
    assert found, answer
    return found[0]


def wait_for(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def relay_over_wan(netns_ok, tmp_path_factory):
    """origin and regionA joined by a 100 Mbit/s, 100 ms link, each running a gateway; A relays from origin.

    One network for the module's tests: building it and starting two gateways is most of their time.
    """
    tmp_path = tmp_path_factory.mktemp("links")
    key = generate_key()
    public = save_keypair(key, tmp_path / "trainer.key")
    with Wan(f"lm{secrets.token_hex(2)}") as wan:
        origin, region = wan.host("origin"), wan.host("regionA")
        wan.link(origin, region, mbit=100, rtt_ms=RTT_MS)
        urls = {h.name: f"https://{h.ip}:{PORT}" for h in (origin, region)}
        ca = make_ca(tmp_path / "pki")
        for holder, hosts in (("admin/ops", ()), ("trainer/t", ()), ("gateway/origin", [origin.ip]),
                              ("gateway/regionA", [region.ip])):
            issue(ca, tmp_path / "pki", holder, hosts=hosts)
        for host, upstream in ((origin, None), (region, urls["origin"])):
            args = [DELTAMESH, "gateway", "--region", host.name, "--listen", f"0.0.0.0:{PORT}",
                    "--store", str(tmp_path / f"store-{host.name}"), "--trusted-key", str(public),
                    "--advertise", urls[host.name], "--probe-interval-s", "0.3",
                    "--client-ca", str(ca.cert), *tls_flags(tmp_path, f"gateway-{host.name}")]
            if upstream:
                args += ["--upstream", upstream]
            with open(tmp_path / f"{host.name}.log", "ab") as log:
                host.spawn(args, stdout=log, stderr=subprocess.STDOUT)
        for host in (origin, region):
            wait_for(f"gateway on {host.name}", lambda h=host: h.run(
                [DELTAMESH, "links", "--gateway", urls[h.name], "--json", *tls_flags(tmp_path, "admin-ops")],
                check=False).returncode == 0)
        yield wan, origin, region, urls, tmp_path


def test_measured_rtt_within_ten_percent_of_emulated(relay_over_wan):
    wan, origin, region, urls, tmp_path = relay_over_wan
    upstream = wait_for("10 RTT samples of the upstream link", lambda: (
        (link := find(links_json(region, urls["regionA"], tmp_path), "upstream"))["rtt_ms"]["samples"] >= 10 and link))
    assert abs(upstream["rtt_ms"]["p50"] - RTT_MS) <= 0.1 * RTT_MS, upstream
    assert upstream["rtt_ms"]["p95"] < 2 * RTT_MS, upstream
    # The origin probes its announced downstream over the same link, in the other direction.
    downstream = wait_for("5 RTT samples of the downstream link", lambda: (
        (link := find(links_json(origin, urls["origin"], tmp_path), "downstream"))["rtt_ms"]["samples"] >= 5 and link))
    assert downstream["peer"] == "regionA"
    assert abs(downstream["rtt_ms"]["p50"] - RTT_MS) <= 0.1 * RTT_MS, downstream


def test_relayed_transfer_shows_as_throughput_and_in_the_table(relay_over_wan):
    wan, origin, region, urls, tmp_path = relay_over_wan
    weights = {f"layer{i}.weight": torch.randn(512, 1024).to(torch.bfloat16) for i in range(4)}  # 4 MiB
    write_weights(tmp_path / "weights", weights)
    origin.run([DELTAMESH, "publish", str(tmp_path / "weights"), "--gateway", urls["origin"], "--model", "m",
                "--key", str(tmp_path / "trainer.key"), "--state", str(tmp_path / "publish-state"),
                *tls_flags(tmp_path, "trainer-t")], timeout=120)
    upstream = wait_for("relayed bytes on the upstream link", lambda: (
        (link := find(links_json(region, urls["regionA"], tmp_path), "upstream"))["bytes_total"] > 0
        and link["last_transfer_s"] is not None and link))
    # A few MiB over a 100 Mbit/s link: a positive rate no faster than the link.
    assert 0 < upstream["throughput_bps"] <= 100e6 / 8 * 1.05, upstream

    # As on a terminal 200 columns wide (rich fits the table to the width it is given).
    table = region.run(["env", "COLUMNS=200", DELTAMESH, "links", "--gateway", urls["regionA"],
                        *tls_flags(tmp_path, "admin-ops")], timeout=60).stdout
    assert "links of region regionA" in table
    row = next((line for line in table.splitlines() if "upstream" in line), None)
    assert row is not None, table
    cells = [cell.strip() for cell in row.split("│")]
    assert cells[1] == urls["origin"] and cells[2] == "upstream", table
    assert abs(float(cells[3]) - RTT_MS) <= 0.1 * RTT_MS, table  # RTT p50 in ms
    assert cells[6] == f"{upstream['bytes_total']:,}" or int(cells[6].replace(",", "")) >= upstream["bytes_total"], table
    assert cells[8].endswith("ago"), table


def test_watch_updates_until_interrupted(relay_over_wan):
    # --watch has no iteration count: it runs until Ctrl-C, which it answers by exiting cleanly.
    wan, origin, region, urls, tmp_path = relay_over_wan
    out = tmp_path / "watch.out"
    with open(out, "wb") as f:
        proc = region.spawn(["env", "COLUMNS=200", DELTAMESH, "links", "--gateway", urls["regionA"], "--watch",
                             "--interval-s", "0.2", *tls_flags(tmp_path, "admin-ops")],
                            stdout=f, stderr=subprocess.STDOUT)
    try:
        time.sleep(3)
        assert proc.poll() is None, out.read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert "links of region regionA" in text and "upstream" in text, text
