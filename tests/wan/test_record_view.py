"""A run's link record from samples (pure functions: the sampling itself runs on real links in
test_loss.py): `ss -tin` output parsed, counters taken as differences over the run and maxima as seen,
both ends of a connection joined, and a link check that fails when the emulator did not do what was
asked (a delayer late, silent or dead, packets dropped that no loss asked for) but not when TCP lost
packets to the rate limit's queue, which is the link behaving as a real one does. Also the loss
model's drop rate and burst lengths, and the one-line summary a table prints beside a run."""

from __future__ import annotations

import random
import statistics

import pytest
from wan.links import DelayLine
from wan.loss import Dropper, Loss, segments_of
from wan.record_view import LATE_SHARE, build_record, summary
from wan.records import Sample
from wan.tcp_info import parse_ss

SS = """\
0      0      10.77.0.1:8600 10.77.0.2:41234
\t cubic wscale:7,7 rto:504 rtt:301.768/0.313 mss:1448 cwnd:4844 ssthresh:3000 bytes_sent:33495713 bytes_retrans:2896 bytes_acked:30664202 segs_out:23142 data_segs_out:23140 send 185947138bps pacing_rate 371893192bps delivery_rate 88107088bps delivered:21185 busy:8824ms rwnd_limited:4240ms(48.1%) sndbuf_limited:1620ms(18.4%) retrans:0/2 unacked:1956 rcv_space:14480 minrtt:300.096 snd_wnd:4860928
0      0      10.77.0.1:8600 10.77.0.2:41236
\t cubic wscale:7,7 rto:504 rtt:300.1/0.2 mss:1448 cwnd:20 bytes_acked:1 segs_out:3 minrtt:300.0 snd_wnd:65536
"""


def test_ss_lines_give_each_connections_figures():
    conns = parse_ss(SS)
    assert [(c["local"], c["peer"]) for c in conns] == [("10.77.0.1:8600", "10.77.0.2:41234"),
                                                        ("10.77.0.1:8600", "10.77.0.2:41236")]
    first = conns[0]
    assert first["cc"] == "cubic" and first["cwnd"] == 4844 and first["retrans"] == 2
    assert first["bytes_acked"] == 30664202 and first["bytes_retrans"] == 2896
    assert first["rwnd_limited_ms"] == 4240 and first["sndbuf_limited_ms"] == 1620 and first["busy_ms"] == 8824
    assert first["snd_wnd"] == 4860928 and first["rcv_space"] == 14480
    assert first["rtt_ms"] == 301.768 and first["minrtt_ms"] == 300.096
    assert first["delivery_rate_bps"] == 88107088
    with_state = "ESTAB 0 0 [::ffff:10.0.0.1]:80 [::ffff:10.0.0.2]:5000\n\t cubic cwnd:10\n"
    assert parse_ss(with_state)[0]["local"] == "[::ffff:10.0.0.1]:80"


class _Host:
    def __init__(self, name: str):
        self.name = name


class _Link:
    """What build_record reads of a Link (a real one needs namespaces)."""

    def __init__(self, loss: Loss = Loss()):
        self.a, self.b = _Host("origin"), _Host("far")
        self.rtt_ms, self.loss = 300.0, loss
        self.lines = {"origin": DelayLine(self.a, self.b, "to-origin", None),
                      "far": DelayLine(self.b, self.a, "to-far", None)}

    def mbit_from(self, sender) -> float:
        return 400.0

    def loss_from(self, sender) -> Loss:
        return self.loss

    def line_from(self, sender):
        return self.lines.get(sender.name)


def _counts(seq: int, received: int, late: int = 0, max_late: float = 0.3, dropped: int = 0, overflows: int = 0):
    return {"pid": 1, "queue": 0, "seq": seq, "time": 0.0, "received": received, "released": received - dropped,
            "dropped": dropped, "segments": 3 * received, "dropped_segments": 3 * dropped, "late": late,
            "overflows": overflows, "wakeups": 0, "max_late_ms": max_late, "max_held": received // 10}


def _sample(t: float, received: int, *, late: int = 0, max_late: float = 0.3, kernel_drops: int = 0,
            tbf_drops: int = 0, acked: int = 0, retrans: int = 0, alive: bool = True, dropped: int = 0) -> Sample:
    line = {"delayer": _counts(int(t), received, late, max_late, dropped),
            "kernel_queue": {"held": 10, "queue_dropped": kernel_drops, "user_dropped": 0, "seen": received},
            "tbf": {"packets": received, "bytes": received * 1500, "drops": tbf_drops, "backlog_bytes": 3000,
                    "backlog_packets": 2},
            "alive": alive}
    quiet = {"delayer": _counts(int(t), 0), "kernel_queue": None, "tbf": None, "alive": True}
    sender = {"local": "10.77.0.1:8600", "peer": "10.77.0.2:41234", "cc": "cubic", "bytes_acked": acked,
              "retrans": retrans, "busy_ms": int(t * 1000), "rwnd_limited_ms": 0, "cwnd": 100 + acked // 10_000,
              "snd_wnd": 4_000_000, "minrtt_ms": 300.1, "host": "origin", "peer_host": "far"}
    receiver = {"local": "10.77.0.2:41234", "peer": "10.77.0.1:8600", "bytes_received": acked, "rcv_space": 3_000_000,
                "host": "far", "peer_host": "origin"}
    return Sample(t, {"origin -> far": line, "far -> origin": quiet},
                  {"origin": {"10.77.0.1:8600 10.77.0.2:41234": sender},
                   "far": {"10.77.0.2:41234 10.77.0.1:8600": receiver}})


def test_counters_are_differences_over_the_run_and_connections_join_both_ends():
    samples = [_sample(0, 1000, acked=5_000_000, retrans=3), _sample(1, 21000, acked=25_000_000, retrans=10),
               _sample(2, 41000, acked=45_000_000, retrans=12, tbf_drops=40)]
    record = build_record(samples, [_Link()], 0.5, 2.0)
    assert record.ok, record.problems
    origin_far = record.directions[0]
    assert origin_far["packets"] == 40000 and origin_far["tbf_drops"] == 40 and origin_far["max_held"] == 4100
    (conn,) = record.connections
    assert conn["from"] == "origin" and conn["to"] == "far"
    assert conn["bytes"] == 40_000_000 and conn["retrans"] == 9  # the run's share, not the connection's life
    assert conn["max_snd_wnd"] == 4_000_000 and conn["max_rcv_space"] == 3_000_000
    tcp = record.as_dict()["tcp"]
    assert tcp["retrans"] == 9 and tcp["connections_with_retrans"] == 1


def test_drops_at_the_rate_limit_are_the_links_queue_not_a_failed_check():
    samples = [_sample(0, 0), _sample(1, 30000, tbf_drops=500, retrans=500, acked=1)]
    assert build_record(samples, [_Link()], 0, 1).ok


@pytest.mark.parametrize("bad, problem", [
    ({"late": int(30000 * LATE_SHARE * 2), "max_late": 9.0}, "released late (up to 9.0 ms)"),
    ({"kernel_drops": 7}, "7 packets dropped that no loss asked for"),
    ({"alive": False}, "its delayer exited"),
])
def test_a_link_that_did_not_do_what_was_asked_fails_its_check(bad, problem):
    samples = [_sample(0, 0), _sample(1, 30000, **bad)]
    record = build_record(samples, [_Link()], 0, 1)
    assert not record.ok
    assert any(problem in p for p in record.problems), record.problems
    assert summary(record.as_dict()).startswith("LINK CHECK FAILED: origin -> far: ")


def test_a_run_without_samples_is_reported_not_dropped():
    record = build_record([_sample(0, 0)], [_Link()], 0, 1)
    assert not record.ok and "not sampled" in record.problems[0]


def test_the_summary_says_what_was_dropped_as_asked():
    samples = [_sample(0, 0), _sample(1, 100_000, dropped=100, acked=1000, retrans=90)]
    record = build_record(samples, [_Link(Loss(0.001))], 0, 1)
    assert record.ok
    line = summary(record.as_dict())
    assert ("origin -> far: 100000 pkts, 100 dropped as asked (0.03% of 300000 segments as loss events, "
            "0.10% of them lost)") in line
    assert "TCP 1 conns, 90 retrans on 1" in line


def test_random_loss_drops_its_rate():
    dropper = Dropper(Loss(rate=0.01), random.Random(1))
    dropped = sum(dropper.drop() for _ in range(200_000))
    assert 0.009 < dropped / 200_000 < 0.011


def test_a_gso_packet_is_lost_when_any_of_its_segments_is():
    """Loss events per segment stay at the rate asked: a 4-segment packet is lost 1-(1-p)^4 of the time."""
    dropper = Dropper(Loss(rate=0.01), random.Random(3))
    dropped = sum(dropper.drop(4) for _ in range(100_000))
    assert dropped / 100_000 == pytest.approx(1 - 0.99 ** 4, rel=0.08)
    assert segments_of(52) == 1 and segments_of(52 + 1448) == 1 and segments_of(52 + 3 * 1448) == 3
    assert segments_of(52 + 3 * 1448 + 1) == 4


def test_bursts_drop_packets_in_a_row_of_their_mean_length():
    loss = Loss(burst_rate=0.001, burst_len=5)
    dropper = Dropper(loss, random.Random(2))
    runs, current = [], 0
    for _ in range(500_000):
        if dropper.drop():
            current += 1
        elif current:
            runs.append(current)
            current = 0
    assert 4.0 < statistics.mean(runs) < 6.0
    assert abs(sum(runs) / 500_000 - loss.expected) < 0.2 * loss.expected


def test_loss_is_checked_and_read_from_what_a_caller_gives():
    assert Loss.of(None) == Loss() and not Loss().active
    assert Loss.of(0.001) == Loss(rate=0.001) and Loss.of({"burst_rate": 0.01, "burst_len": 3}).burst_len == 3
    for bad in ({"rate": 1.0}, {"rate": -0.1}, {"burst_len": 0.5}):
        with pytest.raises(ValueError):
            Loss(**bad)
