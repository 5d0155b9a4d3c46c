"""The propagation model behind benchmarks/simulate.py: how long a version takes over links, relay
chains and fan-out trees, in plain Python.

One hop is simulated in small time steps: N parallel TCP connections, each fetching one piece per
request (a request costs one RTT of idle before its data flows; a fresh connection one more RTT for
its handshake), each sending at most min(cwnd, window) per RTT, the link's payload rate shared fairly
among the busy ones. cwnd starts at 10 segments and grows by `growth` per RTT (slow start) until the
link is full; from then on, as BBR does, each connection keeps twice its share of the bandwidth-delay
product, so it can take up the slack of connections idle between pieces. Once the transfer is in a
steady state the rest is extrapolated at the steady rate. Hops compose with the rule of cut-through
pipelining: a relay's downstream hop starts when the relay has the manifest and ends no earlier than
a piece's transfer time after the relay's own last piece; store-and-forward adds the hops up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

MSS = 1448
PAYLOAD_EFFICIENCY = 1448 / 1514
"""TCP payload per byte on the wire at MTU 1500 (Ethernet, IP and TCP headers with timestamps)."""


@dataclass(frozen=True)
class Tcp:
    """How one TCP connection behaves; `window` and `piece_overhead_s` are calibrated on measured runs."""

    window: float = 1.9e6
    """Bytes a connection keeps in flight at most (bounded by the sender's buffer)."""
    growth: float = 2.0
    """cwnd multiplier per RTT in slow start."""
    initial_window: float = 10 * MSS
    piece_overhead_s: float = 0.0
    """Software time per piece request beyond the RTT (request handling, hashing, scheduling)."""


@dataclass(frozen=True)
class Link:
    mbit: float
    rtt_ms: float

    @property
    def rate(self) -> float:
        """Payload bytes per second."""
        return self.mbit * 1e6 / 8 * PAYLOAD_EFFICIENCY

    @property
    def rtt(self) -> float:
        return self.rtt_ms / 1000


@dataclass(frozen=True)
class Hop:
    seconds: float
    """From the first request to the last byte."""
    first_piece_s: float
    steady_bps: float


@lru_cache(maxsize=4096)
def fetch(total: float, piece: float, link: Link, tcp: Tcp, connections: int, *, fresh: bool = True) -> Hop:
    """Fetch `total` bytes in pieces of `piece` bytes over `connections` parallel connections."""
    n_pieces = max(1, math.ceil(total / piece))
    sizes = [piece] * (n_pieces - 1) + [total - piece * (n_pieces - 1)]
    rtt, rate = max(link.rtt, 1e-4), link.rate
    dt = rtt / 10
    conns = [{"cwnd": tcp.initial_window, "slow": True, "left": 0.0, "ready": 0.0, "busy": False}
             for _ in range(min(connections, n_pieces))]
    start_delay = (2 if fresh else 1) * rtt
    queue = list(reversed(sizes))
    for c in conns:
        c["left"], c["ready"], c["busy"] = queue.pop(), start_delay, True
    t, done_bytes, first_piece = 0.0, 0.0, None
    mark: tuple[float, float] | None = None  # (time, bytes) when the transfer became steady
    steady_pieces = 0
    while any(c["busy"] for c in conns):
        active = [c for c in conns if c["busy"] and t >= c["ready"]]
        demand = [min(c["cwnd"], tcp.window) / rtt for c in active]
        total_demand = sum(demand)
        scale = min(1.0, rate / total_demand) if total_demand else 1.0
        for c, d in zip(active, demand):
            if c["slow"] and (scale < 1.0 or c["cwnd"] >= tcp.window):  # the link, or the window, is full
                c["slow"] = False
            if c["slow"]:
                c["cwnd"] *= tcp.growth ** (dt / rtt)
            else:  # BBR-like: twice the share of the path's bandwidth-delay product
                c["cwnd"] = max(c["cwnd"] if scale >= 1.0 else 0.0, 2 * rate / max(len(active), 1) * rtt)
            sent = d * scale * dt
            c["left"] -= sent
            done_bytes += sent
            if c["left"] <= 0:
                finished = t + dt + c["left"] / max(d * scale, 1e-9)
                first_piece = finished if first_piece is None else first_piece
                if mark is not None:
                    steady_pieces += 1
                if queue:
                    c["left"], c["ready"] = queue.pop(), finished + rtt + tcp.piece_overhead_s
                else:
                    c["busy"] = False
        t += dt
        if mark is None and active and not any(c["slow"] for c in conns if c["busy"]):
            mark = (t, done_bytes)
        if mark is not None and t - mark[0] >= 8 * rtt and (steady_pieces >= 3 * len(conns) or len(conns) == 1):
            steady = (done_bytes - mark[1]) / (t - mark[0])
            remaining = sum(queue) + sum(max(c["left"], 0.0) for c in conns if c["busy"])
            if remaining > 0:
                return Hop(t + remaining / steady, first_piece or t + remaining / steady, steady)
    steady = (done_bytes - mark[1]) / (t - mark[0]) if mark and t > mark[0] else total / max(t, 1e-9)
    return Hop(t, first_piece or t, steady)


def single_stream(total: float, link: Link, tcp: Tcp) -> float:
    """One HTTP GET of the whole version over one fresh connection."""
    return fetch(total, total, link, tcp, 1).seconds


@dataclass(frozen=True)
class Path:
    """A relay path from the origin: the links of its hops, in order, with their fetch parallelism."""

    hops: tuple[Link, ...]
    connections: tuple[int, ...]


def control_s(link: Link) -> float:
    """Learning of a version and fetching its manifest: the long poll's answer (half an RTT) plus one RTT."""
    return 1.5 * link.rtt


def relay_path(total: float, piece: float, path: Path, tcp: Tcp, *, cut_through: bool = True,
               origin_ready_s: float = 0.0, poll_s: float = 0.0, first_hop_waits: bool = False) -> float:
    """Seconds from the version's manifest at the origin until the path's last host holds all of it.

    `origin_ready_s`: when the origin itself holds the last piece (its upload). Cut-through: each hop
    starts once its relay has the manifest and ends no earlier than one piece after its upstream's
    end. Store-and-forward: each relay's downstream hop starts `poll_s` after the relay holds
    everything; the first hop too only if `first_hop_waits` (else it follows the origin cut-through,
    as a deltamesh gateway pulling from a publishing origin does).
    """
    start, end = 0.0, origin_ready_s
    for index, (link, conns) in enumerate(zip(path.hops, path.connections)):
        hop = fetch(total, piece, link, tcp, conns)
        if cut_through or (index == 0 and not first_hop_waits):
            start += control_s(link)
            end = max(start + hop.seconds, end + link.rtt / 2 + piece / min(link.rate, hop.steady_bps or link.rate))
        else:
            start = end + poll_s + control_s(link)
            end = start + hop.seconds
    return end


def connections_for(link: Link, tcp: Tcp, floor: int = 4, ceiling: int = 256) -> int:
    """Fetches needed to fill a link: 1.5x its bandwidth-delay product over the per-connection window."""
    return max(floor, min(ceiling, math.ceil(1.5 * link.rate * link.rtt / tcp.window)))
