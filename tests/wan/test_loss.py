"""Loss on emulated links, and the record of what a link did during a run: real namespaces, veths,
tbf and NFQUEUE delayers, real TCP streams (probe.py); needs root.

A lossy link drops the share of packets it was asked to (a link of wire packets: one packet per drop;
else a GSO packet whenever one of its segments is lost), TCP retransmits them and the run's record says
so; its loss changes on the
running link, from a detached network's view too, and a link made without loss refuses to lose
packets later; a run during which a delayer died is recorded with its link check failed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from wan import LinkRecorder, Loss, Wan, WanError, verify_link
from wan.verify import PROBE

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.usefixtures("netns_ok")]


def bulk(sender, receiver, seconds: float = 3.0, streams: int = 4) -> tuple[float, float]:
    """Push TCP streams from `sender` to `receiver`; (start, end) wall-clock times."""
    server = receiver.spawn([sys.executable, str(PROBE), "serve", "--port", "0"], stdout=subprocess.PIPE)
    port = json.loads(server.stdout.readline())["listening"]
    t0 = time.time()
    sender.run([sys.executable, str(PROBE), "send", "--to", f"{sender.addr_of(receiver)}:{port}",
                "--streams", str(streams), "--seconds", str(seconds)], timeout=seconds + 60)
    return t0, time.time()


def test_a_link_of_wire_packets_drops_its_share_and_the_record_shows_drops_and_retransmits(prefix):
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        link = wan.link(a, b, mbit=40, rtt_ms=20, loss=0.02, wire_packets=True)
        with LinkRecorder(wan) as recorder:
            t0, t1 = bulk(a, b)
            record = recorder.record(t0, t1)
        assert link.lossy and link.loss_from(a) == Loss(rate=0.02)
    # The emulator's timing is its link check's business (a loaded machine may wake a delayer late);
    # what matters here is that every drop was one it was asked for.
    assert not [p for p in record.problems if "no loss asked for" in p], record.problems
    forward = next(d for d in record.directions if d["name"] == "a -> b")
    assert forward["packets"] > 3000
    assert 0.012 < forward["dropped"] / forward["packets"] < 0.03, forward
    # One segment per packet: the rate limit (which counts segments) saw as many as the delayer, give or
    # take those on their way at the run's edges; GSO packets would be several segments each.
    assert forward["packets"] == pytest.approx(forward["tbf_packets"], rel=0.02), "GSO packets crossed a lossy link"
    tcp = record.as_dict()["tcp"]
    assert tcp["connections"] == 4
    assert tcp["retrans"] >= 0.5 * forward["dropped"], (tcp, forward)


def test_a_link_of_gso_packets_loses_them_at_the_rate_of_loss_events_per_segment(prefix):
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        wan.link(a, b, mbit=100, rtt_ms=20, loss=0.01)
        with LinkRecorder(wan) as recorder:
            record = recorder.record(*bulk(a, b))
    forward = next(d for d in record.directions if d["name"] == "a -> b")
    assert forward["segments"] > forward["packets"], "no GSO packets crossed: nothing to test"
    assert 0.006 < forward["dropped"] / forward["segments"] < 0.015, forward
    assert forward["dropped_segments"] >= forward["dropped"]
    assert forward["segments"] == pytest.approx(forward["tbf_packets"], rel=0.05)  # the estimate of segments


def test_loss_changes_on_the_running_link_and_through_a_detached_view(prefix):
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        link = wan.link(a, b, mbit=40, rtt_ms=20, loss=0.0)
        with LinkRecorder(wan) as recorder:
            clean = recorder.record(*bulk(a, b, seconds=2))
            link.set_loss(a, Loss(burst_rate=0.002, burst_len=8))
            bursty = recorder.record(*bulk(a, b, seconds=3))
            wan.save_state()
            view = Wan.attach(wan.prefix)  # as `cli.py up` leaves a network for others to change
            view.links[0].set_loss(view.hosts["a"], 0.05)
            heavy = recorder.record(*bulk(a, b, seconds=2))
            view.close()
    def share(record):  # loss events per segment
        d = next(d for d in record.directions if d["name"] == "a -> b")
        return d["dropped"] / max(1, d["segments"])
    assert share(clean) == 0
    assert 0.005 < share(bursty) < 0.04
    assert 0.03 < share(heavy) < 0.08
    back = next(d for d in heavy.directions if d["name"] == "b -> a")
    assert back["dropped"] == 0  # only a -> b was changed


def test_a_link_made_without_loss_refuses_to_lose_packets_later_and_verifies_as_before(prefix):
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        link = wan.link(a, b, mbit=20, rtt_ms=10)
        with pytest.raises(WanError, match="not made lossy"):
            link.set_loss(a, 0.01)
        lossy = wan.link(a, wan.host("c"), mbit=20, rtt_ms=10, loss=0.05)
        check = verify_link(a, wan.hosts["c"], rtt_count=5)
    assert not link.lossy and lossy.lossy
    assert check.mbit is None and check.rtt_ms is not None  # a lossy direction's rate is not held to its asked rate


def test_a_run_whose_delayer_died_is_recorded_as_a_failed_link_check(prefix):
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        link = wan.link(a, b, mbit=20, rtt_ms=10)
        with LinkRecorder(wan) as recorder:
            t0 = time.time()
            time.sleep(1.2)
            line = link.line_from(a)  # delays what a sends to b
            line.proc.kill()
            line.proc.wait()
            time.sleep(1.2)
            record = recorder.record(t0, time.time())
    assert not record.ok
    assert any(p.startswith("a -> b: its delayer exited") for p in record.problems), record.problems
