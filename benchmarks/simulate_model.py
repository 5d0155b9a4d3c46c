"""The propagation model behind benchmarks/simulate.py: how long a version takes over links, relay
chains and fan-out trees, in plain Python.

One hop is simulated in small time steps: N parallel TCP connections, each fetching one piece per
request (a request costs one RTT of idle before its data flows; a fresh connection one more RTT for
its handshake), each sending at most min(cwnd, window) per RTT, the link's payload rate shared fairly
among the busy ones. cwnd starts at 10 segments and grows by `growth` per RTT (slow start) until the
link is full; from then on each connection keeps twice its share of the bandwidth-delay
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
    """Bytes a connection keeps in flight at most at an RTT of `window_rtt_ms` (bounded by the sender's buffer)."""
    window_rtt_ms: float = 300.0
    window_exponent: float = 0.0
    """The kernel keeps more in flight on shorter links: window x (window_rtt_ms / rtt) ** this."""
    window_cap: float = 4 * 2**20
    """The send buffer's limit (tcp_wmem's max) bounds the window whatever the RTT."""
    growth: float = 2.0
    """cwnd multiplier per RTT in slow start, for a connection alone on its link."""
    shared_growth: float = 2.0
    """The same for connections starting together on one link: their joint burst fills the bottleneck
    queue early, so they leave slow start before doubling all the way."""
    initial_window: float = 10 * MSS
    piece_overhead_s: float = 0.0
    """Software time per piece request beyond the RTT (request handling, hashing, scheduling)."""
    shared_efficiency: float = 1.0
    """Fraction of the link's payload rate that several connections sharing it get together (losses in
    the bottleneck queue, uneven sharing); one connection alone is not affected."""

    def window_at(self, rtt_ms: float) -> float:
        scaled = self.window * (self.window_rtt_ms / max(rtt_ms, 0.1)) ** self.window_exponent
        return min(scaled, max(self.window_cap, self.window))


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
def fetch(total: float, piece: float, link: Link, tcp: Tcp, connections: int, *, fresh: bool = True,
          warm: bool = False, ahead: bool = False) -> Hop:
    """Fetch `total` bytes in pieces of `piece` bytes over `connections` parallel connections.

    `fresh`: the connections are new (a handshake before the first request). `warm`: they have carried
    data before and kept their sending rate (an idle connection keeps its window), so they start at
    their share of the link instead of in slow start. `ahead`: the first pieces were asked for before
    the version existed, so they flow at once (their requests' round trip is already paid).
    """
    n_pieces = max(1, math.ceil(total / piece))
    sizes = [piece] * (n_pieces - 1) + [total - piece * (n_pieces - 1)]
    rtt, rate = max(link.rtt, 1e-4), link.rate
    window = tcp.window_at(link.rtt_ms)
    dt = rtt / 10
    count = min(connections, n_pieces)
    cwnd = min(window, 2 * rate / count * rtt) if warm else tcp.initial_window
    # Real connections never share a link exactly evenly; without some spread, identical connections
    # would finish their pieces in lockstep and all sit out the next request's RTT together.
    conns = [{"cwnd": cwnd, "slow": not warm, "left": 0.0, "ready": 0.0, "busy": False,
              "weight": 1.0 + 0.4 * ((i * 0.618034) % 1.0 - 0.5)} for i in range(count)]
    start_delay = 0.0 if ahead else (2 if fresh else 1) * rtt
    queue = list(reversed(sizes))
    for c in conns:
        c["left"], c["ready"], c["busy"] = queue.pop(), start_delay, True
    t, done_bytes, first_piece = 0.0, 0.0, None
    mark: tuple[float, float] | None = None  # (time, bytes) when the transfer became steady
    steady_pieces = 0
    while any(c["busy"] for c in conns):
        active = [c for c in conns if c["busy"] and t >= c["ready"]]
        demand = [min(c["cwnd"], window) / rtt for c in active]
        total_demand = sum(demand)
        usable = rate * (tcp.shared_efficiency if len(active) > 1 else 1.0)
        scale = min(1.0, usable / total_demand) if total_demand else 1.0
        if scale < 1.0:  # the link is full: shares follow the connections' weights
            weighted = sum(d * c["weight"] for c, d in zip(active, demand))
            demand = [d * c["weight"] * total_demand / weighted for c, d in zip(active, demand)]
        for c, d in zip(active, demand):
            if c["slow"] and (scale < 1.0 or c["cwnd"] >= window):  # the link, or the window, is full
                c["slow"] = False
            if c["slow"]:
                c["cwnd"] *= (tcp.growth if count == 1 else tcp.shared_growth) ** (dt / rtt)
            else:  # twice the share of the path's bandwidth-delay product, to take up idle connections' slack
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


def control_s(link: Link, relay: bool = True, ahead: bool = False) -> float:
    """Learning of a version and fetching its manifest: the long poll's answer (half an RTT), a relay's
    listing of the upstream's versions (one RTT), the manifest (one RTT). A relay that asked for the
    version ahead gets its manifest (and first pieces) half an RTT after the upstream has it."""
    if relay and ahead:
        return 0.5 * link.rtt
    return (2.5 if relay else 1.5) * link.rtt


def relay_path(total: float, piece: float, path: Path, tcp: Tcp, *, cut_through: bool = True,
               origin_ready_s: float = 0.0, poll_s: float = 0.0, first_hop_waits: bool = False,
               warm: bool = False, ahead: bool = False) -> float:
    """Seconds from the version's manifest at the origin until the path's last host holds all of it.

    Every hop but the last is a relay gateway; the last is a pool (or puller) fetching a plan.
    `origin_ready_s`: when the origin itself holds the last piece (its upload). Cut-through: each hop
    starts once its relay has the manifest and ends no earlier than its upstream's end plus the last
    piece's own trip. Store-and-forward: each relay's downstream hop starts `poll_s` after the relay
    holds everything; the first hop too only if `first_hop_waits` (else it follows the origin
    cut-through, as a deltamesh gateway pulling from a publishing origin does). `warm`: the hops'
    connections have carried data before (see `fetch`). `ahead`: the relays hold their upstream's
    head and ask for the next version before it exists (deltamesh's relays in a running mesh).
    """
    start, end = 0.0, origin_ready_s
    last = len(path.hops) - 1
    for index, (link, conns) in enumerate(zip(path.hops, path.connections)):
        relay_ahead = ahead and index < last
        hop = fetch(total, piece, link, tcp, conns, fresh=not (warm or relay_ahead), warm=warm, ahead=relay_ahead)
        control = control_s(link, relay=index < last, ahead=relay_ahead)
        if cut_through or (index == 0 and not first_hop_waits):
            start += control
            last_piece = min(piece, total) / min(link.rate, tcp.window_at(link.rtt_ms) / max(link.rtt, 1e-4))
            end = max(start + hop.seconds, end + link.rtt / 2 + last_piece)
        else:
            start = end + poll_s + control
            end = start + hop.seconds
    return end


def connections_for(link: Link, tcp: Tcp, piece: float = 4 * 2**20, floor: int = 4, ceiling: int = 512) -> int:
    """Fetches needed to fill a link with 25% to spare: each connection moves at most a window per RTT,
    and sits idle for one RTT between pieces."""
    window = tcp.window_at(link.rtt_ms)
    per_connection = window / max(link.rtt, 1e-4) * piece / (piece + window)
    return max(floor, min(ceiling, math.ceil(1.25 * link.rate / per_connection)))
