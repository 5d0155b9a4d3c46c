"""Judging link measurements against what was asked, and the table that shows them (pure
functions: the measurements themselves are tested on real links in test_links.py)."""

from __future__ import annotations

from wan.verify import LATE_WAKEUP_MS, RTT_SLACK_MS, default_seconds, format_table, judge


def test_on_target_link_is_ok():
    check = judge("a", "b", 100, 104.0, 400, 383.0, 0.10)
    assert check.ok
    assert check.message == "RTT 104.0 ms of 100, 383.0 Mbit/s of 400"


def test_off_target_rtt_and_rate_are_both_reported():
    check = judge("a", "b", 100, 125.0, 400, 300.0, 0.10)
    assert not check.ok
    assert "RTT 125.0 ms is +25.0 ms off 100 ms" in check.message
    assert "throughput 300 Mbit/s is -25% off 400 Mbit/s" in check.message


def test_short_links_get_an_absolute_rtt_allowance():
    assert judge("a", "b", 2, 2 - RTT_SLACK_MS * 0.9, 100, None, 0.10).ok
    assert not judge("a", "b", 2, 2 - RTT_SLACK_MS * 1.5, 100, None, 0.10).ok


def test_a_late_round_trip_gets_room_for_wake_ups_a_short_one_does_not():
    assert judge("a", "b", 10, 10 + 1.0 + LATE_WAKEUP_MS * 0.9, 100, None, 0.10).ok
    assert not judge("a", "b", 10, 10 + 1.0 + LATE_WAKEUP_MS * 1.1, 100, None, 0.10).ok
    assert not judge("a", "b", 10, 10 - 1.0 - LATE_WAKEUP_MS * 0.5, 100, None, 0.10).ok


def test_a_failed_measurement_is_a_failed_check():
    check = judge("a", "b", 50, None, 100, None, 0.10, "measurement failed: connection timed out")
    assert not check.ok
    assert check.message.startswith("RTT not measured, rate not measured: measurement failed")


def test_table_lists_every_check_and_explains_failures():
    good = judge("origin", "regionA", 300, 300.6, 400, 382.5, 0.10)
    bad = judge("regionA", "pool1", 2, None, 1000, None, 0.10, "delayer(s) exited: x")
    lines = format_table([good, bad]).splitlines()
    assert lines[0].split() == ["link", "RTT", "asked", "RTT", "ms", "Mbit", "asked", "Mbit/s", "ok"]
    assert lines[1].split() == ["origin", "->", "regionA", "300", "300.6", "400", "382.5", "yes"]
    assert lines[2].split() == ["regionA", "->", "pool1", "2", "-", "1000", "-", "NO"]
    assert lines[3].strip().startswith("regionA -> pool1: RTT not measured")


def test_bulk_runs_outlast_slow_start():
    assert default_seconds(0) == 3.0
    assert default_seconds(300) == 8.0
    assert default_seconds(5000) == 15.0
