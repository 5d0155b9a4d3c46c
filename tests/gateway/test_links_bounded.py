"""A link's transfer records stay bounded on a gateway whose links no one reads.

Found by the chaos soak (benchmarks/soak.py): the origin gateway's memory grew all run long, in part
because every piece it served appended a record to its peer's link, and records were dropped only
when the links were read (/metrics, /v1/links), which nothing in the soak did.
"""

from __future__ import annotations

import time

from deltamesh.gateway.fetch.links import TRANSFER_WINDOW_S, TRANSFERS_KEPT, LinkMonitor


def test_transfers_older_than_the_window_go_when_the_next_is_recorded_unread():
    monitor = LinkMonitor()
    link = monitor.link("pool-a", "pool", "http://10.0.0.9:9000")
    long_ago = time.monotonic() - TRANSFER_WINDOW_S - 5
    link.transfers.extend((long_ago + i * 1e-3, 1000, 0.01) for i in range(500))

    monitor.record_transfer(link, 2048, 0.02)

    assert len(link.transfers) == 1 and link.transfers[0][1] == 2048
    assert link.bytes_total == 2048


def test_a_burst_within_the_window_keeps_at_most_the_cap_and_the_newest():
    monitor = LinkMonitor()
    link = monitor.link("relay-eu", "downstream", "https://10.0.0.2:8600")
    for n in range(TRANSFERS_KEPT * 3):
        monitor.record_transfer(link, n, 0.001)

    assert len(link.transfers) == TRANSFERS_KEPT
    assert link.transfers[-1][1] == TRANSFERS_KEPT * 3 - 1
    assert link.bytes_total == sum(range(TRANSFERS_KEPT * 3))
    assert link.recent_throughput(time.monotonic()) is not None
