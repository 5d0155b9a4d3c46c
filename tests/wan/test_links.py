"""The emulator's links measure what they were asked for: rate and RTT within 10%, and the delay
cannot be skipped. Real namespaces, veths, tbf and NFQUEUE delayers; needs root."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable

import pytest
from wan import Wan, WanError, verify_link
from wan.verify import PROBE, LinkCheck

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("netns_ok")]


def measured(check: Callable[[], LinkCheck], attempts: int = 3) -> LinkCheck:
    """The first passing of up to `attempts` measurements: a 400 Mbit/s link runs every packet through a
    Python delayer, so a measurement on the shared 2-core machine may catch a busy stretch (a right
    link read 319 Mbit/s twice in a row in one full suite run, and 400 alone right after)."""
    for _ in range(attempts - 1):
        result = check()
        if result.ok:
            return result
    return check()


@pytest.mark.slow
@pytest.mark.parametrize("far, mbit, rtt_ms, verify", [
    ("regionA", 100, 100, {"seconds": 4}),
    # The transfer benchmark's long link: 15 MB in flight through tbf and the delayers.
    ("far", 400, 300, {"rtt_count": 3}),
], ids=["100_mbit_100_ms", "long_fat_400_mbit_300_ms"])
def test_link_rate_and_rtt_within_ten_percent(prefix, far, mbit, rtt_ms, verify):
    with Wan(prefix) as wan:
        a, b = wan.host("origin"), wan.host(far)
        wan.link(a, b, mbit=mbit, rtt_ms=rtt_ms)
        check = measured(lambda: verify_link(a, b, **verify))
    assert check.ok, check.message
    assert abs(check.rtt_ms - rtt_ms) <= rtt_ms / 10, check.message
    assert abs(check.mbit - mbit) <= mbit / 10, check.message


@pytest.mark.slow
def test_asymmetric_rate_and_addresses(prefix):
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        # 60 ms rather than a LAN-like RTT: a few ms of scheduling delay on a loaded 2-core machine
        # must not decide a 10% check.
        link = wan.link(a, b, mbit=20, rtt_ms=60, mbit_back=80)
        assert a.addr_of(b) == link.addr_b and b.addr_of(a) == link.addr_a
        forward = measured(lambda: verify_link(a, b, seconds=3))
        back = measured(lambda: verify_link(b, a, seconds=3))
        # Each host's own address (on its loopback) is routed over the link too.
        server = a.spawn([sys.executable, str(PROBE), "serve", "--port", "5998"], stdout=subprocess.PIPE)
        assert server.stdout.readline()
        echo = b.run([sys.executable, str(PROBE), "rtt", "--to", f"{a.ip}:5998", "--count", "7"])
        assert 54 <= json.loads(echo.stdout)["rtt_ms"] <= 66
    assert forward.ok and back.ok, (forward.message, back.message)
    assert forward.mbit < 22 and back.mbit > 70


def test_dead_delayer_darkens_the_link(prefix):
    # No --queue-bypass: with its delayer gone a direction drops everything instead of
    # turning into an undelayed LAN, and the emulator reports the dead delayer.
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        wan.link(a, b, mbit=50, rtt_ms=10)
        delayer = wan.delayers[0]  # the one in a: it delays what b sends to a
        delayer.kill()
        delayer.wait()
        assert wan.dead_delayers()
        check = verify_link(a, b)
        assert not check.ok and check.rtt_ms is None and "delayer(s) exited" in check.message
        server = b.spawn([sys.executable, str(PROBE), "serve", "--port", "5999"], stdout=subprocess.PIPE)
        assert server.stdout.readline()
        probe = a.run([sys.executable, str(PROBE), "rtt", "--to", f"{a.addr_of(b)}:5999",
                       "--count", "1", "--timeout", "2"], check=False)
        assert probe.returncode != 0
        assert "timed out" in probe.stderr


def test_link_arguments_are_checked(prefix):
    with Wan(prefix) as wan:
        a = wan.host("a")
        with pytest.raises(WanError):
            wan.link(a, a, mbit=10, rtt_ms=1)
        with pytest.raises(WanError):
            wan.host("a-name-far-too-long")
        b = wan.host("b")
        with pytest.raises(WanError):
            wan.link(a, b, mbit=0, rtt_ms=1)
        with pytest.raises(WanError):
            a.addr_of(b)


def test_a_queue_bound_by_a_delayer_cannot_be_bound_again(prefix):
    """The delayer's NFQUEUE client reports the kernel's refusal (here: a second binder of a queue)
    as an error naming the queue, instead of silently delaying nothing."""
    with Wan(prefix) as wan:
        a, b = wan.host("a"), wan.host("b")
        wan.link(a, b, mbit=100, rtt_ms=20)  # a's delayer holds queue 0 of its namespace
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from nfqueue import Queue, NfqueueError\n"
                "try:\n    Queue(0, 1024, 1 << 20)\nexcept NfqueueError as e:\n    print('refused', e)\n"
                "else:\n    print('bound')\n"
                "q = Queue(7, 1024, 1 << 20); q.close(); print('free queue bound and released')")
        done = a.run([sys.executable, "-c", code, str(PROBE.parent)], check=False)
    assert done.returncode == 0, done.stderr
    assert "refused" in done.stdout and "NFQUEUE 0" in done.stdout, done.stdout
    assert "free queue bound and released" in done.stdout
