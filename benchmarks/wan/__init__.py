"""WAN emulation for the transfer benchmarks: regions as network namespaces joined by
point-to-point links with a rate limit (tbf) and a one-way delay (an NFQUEUE delayer), the
processes run inside them, link verification, and guaranteed teardown.

Import it as `wan` with the `benchmarks/` folder on sys.path (a script in benchmarks/ has it
there already; tests put it there in tests/wan/conftest.py). Needs root and what setup.sh
installs.

    with Wan("dm") as net:
        a, b = net.host("origin"), net.host("regionA")
        net.link(a, b, mbit=400, rtt_ms=300)
        gateway = a.spawn(["deltamesh", "gateway", ...])
        net.verify_link(a, b)     # LinkCheck(rtt_ms=..., mbit=..., ok=..., message=...)
"""

from .emulator import Host, Link, Wan
from .links import DelayLine
from .loss import Loss
from .netns import purge
from .record_view import RunRecord
from .records import LinkRecorder
from .shell import WanError
from .topology import build, load_topology
from .verify import LinkCheck, format_table, verify_all, verify_link

__all__ = [
    "DelayLine", "Host", "Link", "LinkCheck", "LinkRecorder", "Loss", "RunRecord", "Wan", "WanError", "build",
    "format_table", "load_topology", "purge", "verify_all", "verify_link",
]
