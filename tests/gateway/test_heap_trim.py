"""A gateway gives back the memory of a burst of TLS connections once they close.

The one-hour soak read a gateway's resident size climbing for as long as it lived (4-9 MiB/min); the
climb came in steps, each when hundreds of connections were open at once, and stayed after they
closed: glibc kept the memory freed with them (see `deltamesh.heap`). Here a real gateway in this
process on a TLS socket is read by a burst of connections from another process (so only the server's
side is counted), and its resident size must come back near where it was before the burst.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltamesh.certs import issue, make_ca
from deltamesh.gateway.server.service import GC_INTERVAL_S
from deltamesh.heap import HeapTrimmer
from deltamesh.http import client_session
from deltamesh.tls import TlsSettings
from deltamesh.trainer.upload import upload_version

MODEL = "heap-m"
CONNECTIONS = 150

# Each connection its own session, all open at once, each reading a piece; then all close together.
BURST = """
import asyncio, sys
from deltamesh.http import client_session, request_bytes
from deltamesh.tls import TlsSettings

async def main(url, n, ca):
    sessions = [client_session(connections=1, tls=TlsSettings(ca=ca)) for _ in range(n)]
    await asyncio.gather(*(request_bytes(s, "GET", f"{url}/v1/models/heap-m/versions/0/full/pieces/{i % 4}")
                           for i, s in enumerate(sessions)))
    for s in sessions:
        await s.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""

pytestmark = pytest.mark.skipif(not HeapTrimmer().available, reason="no malloc_trim in this C library")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_memory_of_a_tls_connection_burst_goes_back_after_it(kit, tmp_path):
    ca = make_ca(tmp_path / "ca")
    server = issue(ca, tmp_path, "gateway/origin", hosts=["127.0.0.1"])
    tls = TlsSettings(cert=str(server.cert), key=str(server.key), ca=str(ca.cert))
    config = kit.config(tmp_path, tls=tls)

    async def main() -> tuple[float, float, float]:
        async with kit.running_gateway(config) as url:
            m, raw, pieces = kit.version(MODEL, 0, "full", pieces=4, piece_size=40_000)
            async with client_session(tls=TlsSettings(ca=str(ca.cert))) as s:
                await upload_version(s, url, m, raw, pieces)
            await asyncio.sleep(GC_INTERVAL_S + 0.5)  # the trim after start-up has run
            before = rss_mib()
            burst = await asyncio.create_subprocess_exec(sys.executable, "-c", BURST, url, str(CONNECTIONS),
                                                         str(ca.cert), stderr=subprocess.PIPE)
            peak = rss_mib()
            _, err = await burst.communicate()
            assert burst.returncode == 0, err.decode()[-2000:]
            peak = max(peak, rss_mib())
            # Within two of the gateway's collection rounds, the freed memory is back with the OS.
            deadline = time.monotonic() + 2 * GC_INTERVAL_S + 1
            while rss_mib() - before > 12 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            return before, peak, rss_mib()

    before, peak, after = asyncio.run(main())
    # Without the trim, the burst's ~0.3 MiB a connection stayed: ~45 MiB here, measured.
    assert peak - before > 20, f"the burst cost too little to tell ({before:.1f} -> {peak:.1f} MiB)"
    assert after - before <= 12, f"RSS {before:.1f} MiB before {CONNECTIONS} TLS connections, {after:.1f} after"


def test_trimmer_trims_at_most_once_an_interval():
    trimmer = HeapTrimmer(interval_s=3600)
    trimmer.maybe_trim()  # the first call trims (whatever it returns: there may be nothing to give back)
    assert trimmer.maybe_trim() is False  # the second, within the hour, does not even try
    with pytest.raises(ValueError):
        HeapTrimmer(interval_s=-1)
