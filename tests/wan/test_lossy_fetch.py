"""deltamesh's fetch over emulated long links that lose packets: real gateway processes and a verifying
puller (the transfer benchmark's agents) in network namespaces; needs root.

* One of a relay's upstream connections goes silent mid-version (its packets dropped for far longer
  than the relay's stall timeout, as a connection in retransmission backoff on a lossy link does):
  the relay takes over what that request had left on another connection, so its cut-through to the
  pool beside it finishes in seconds, not after the stall timeout.
* A version crosses a relay over a link losing 2% of its packets each way intact (verified against
  the signed manifest), and the run's link record shows the drops and the retransmits.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from transfer_mesh import Mesh
from transfer_payload import MODEL_ID, prepare_payload
from wan import LinkRecorder, Wan
from wan.tcp_info import parse_ss

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.usefixtures("netns_ok")]

PAYLOAD_MB = 24.0
BLOCK_S = 60.0
RELAY_STALL_S = 20.0  # the gateway's default stall timeout: what the relay waited for before take-overs


def relay_and_pool(wan: Wan, tmp_path: Path, *, mbit: float, rtt_ms: float, loss: float | None = None):
    """origin -> regionA over a long link, a pool puller beside regionA's relay gateway (on its host);
    the hosts' TCP settings are the emulator's, congestion control the machine's default."""
    origin, relay = wan.host("origin"), wan.host("regionA")
    link = wan.link(origin, relay, mbit=mbit, rtt_ms=rtt_ms, loss=loss)
    mesh = Mesh(wan, tmp_path / "work")
    gateway = mesh.gateway(origin, "origin")
    relayed = mesh.gateway(relay, "regionA", [gateway], relay_connections=8,
                           extra=["--stall-timeout-s", str(RELAY_STALL_S)])
    return origin, relay, link, mesh, gateway, relayed


def transfer_batch(mesh: Mesh, origin, relay, gateway: str, relayed: str, payload: Path):
    batch = mesh.batch()
    batch.add(origin, "publish", "publish", "--gateway", gateway, "--payload", str(payload), "--version", "1",
              "--key", str(mesh.private_key))
    batch.add(relay, "pull", "pull", "--gateway", relayed, "--model", MODEL_ID, "--version", "1",
              "--trusted-key", str(mesh.public_key), "--connections", "4", "--name", "pool")
    return batch


def block_a_busy_upstream_connection(relay, origin_ip: str, blocked: dict) -> None:
    """Wait for an upstream connection of the relay that is receiving a piece, then drop every packet
    that arrives on it (for BLOCK_S); note its port in `blocked`."""
    def receiving() -> dict[str, int]:
        out = relay.run(["ss", "-tinH", "state", "established", "dst", origin_ip]).stdout
        return {c["local"]: c.get("bytes_received", 0) for c in parse_ss(out)}

    deadline = time.monotonic() + 60
    before = receiving()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = receiving()
        moving = [(now[k] - before.get(k, 0), k) for k in now if now[k] - before.get(k, 0) > 64 * 1024]
        if moving:
            port = max(moving)[1].rpartition(":")[2]
            relay.run(["iptables", "-w", "-I", "INPUT", "1", "-p", "tcp", "--sport", "8600", "--dport", port,
                       "-j", "DROP"])
            blocked["port"], blocked["at"] = port, time.time()
            return
        before = now


def test_a_relay_takes_over_a_stalled_upstream_connection_and_keeps_cutting_through(prefix, tmp_path):
    payload = prepare_payload(PAYLOAD_MB)
    with Wan(prefix) as wan:
        origin, relay, _, mesh, gateway, relayed = relay_and_pool(wan, tmp_path, mbit=50, rtt_ms=100)
        batch = transfer_batch(mesh, origin, relay, gateway, relayed, payload)
        blocked: dict = {}
        blocker = threading.Thread(target=block_a_busy_upstream_connection, args=(relay, origin.ip, blocked))
        t0 = batch.start()
        blocker.start()
        results = batch.finish(300)
        blocker.join()
        log = (mesh.work / "gateway-regionA.log").read_text()
    assert blocked, "no upstream connection was seen receiving"
    pool = results["pull"]
    assert pool["bytes"] == (payload / "version.bin").stat().st_size  # every piece, verified
    took = pool["t_done"] - t0
    # Unblocked, 24 MB cross 50 Mbit/s in ~5 s; the stalled connection would hold its piece until the
    # relay's stall timeout (20 s) dropped it, and its own retransmissions resume only after the block.
    assert took < RELAY_STALL_S - 5, f"the pool had the version after {took:.1f}s: the stall held it"
    assert "moved nothing for" in log and "on another connection" in log, log[-3000:]


def test_a_version_crosses_a_lossy_link_intact_and_its_record_shows_the_losses(prefix, tmp_path):
    payload = prepare_payload(PAYLOAD_MB)
    with Wan(prefix) as wan:
        origin, relay, link, mesh, gateway, relayed = relay_and_pool(wan, tmp_path, mbit=50, rtt_ms=60, loss=0.02)
        batch = transfer_batch(mesh, origin, relay, gateway, relayed, payload)
        with LinkRecorder(wan, [link]) as recorder:
            t0 = batch.start()
            results = batch.finish(300, recorder.sample)
            record = recorder.record(t0, results["pull"]["t_done"])
    assert results["pull"]["bytes"] == (payload / "version.bin").stat().st_size
    forward = next(d for d in record.directions if d["name"] == "origin -> regionA")
    assert forward["dropped"] > 0.01 * forward["packets"]
    assert record.as_dict()["tcp"]["retrans"] > 0
