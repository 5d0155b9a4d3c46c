"""A run's record of what its links did (records.py samples them): per link direction what the
delayer delayed, dropped as asked, released late and held at most, what the kernel dropped that was
not asked (a full queue, a delayer's socket out of room), what the tbf sent, dropped and queued; per
TCP connection that moved data, its retransmits, windows and the share of time its sender waited on
the receiver's window. A run's link check fails when the emulator itself did not do what was asked
(a delayer dead or silent, packets dropped that no loss asked for, more than LATE_SHARE of packets
released late: delayer.py's LATE_MS, or 2% of the delay if that is more): such a run is reported
with the reason, never left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .tcp_info import COUNTERS

if TYPE_CHECKING:
    from .links import Link
    from .records import Sample

LATE_SHARE = 0.01
"""Share of a direction's packets that may be released late before its link check fails."""
BUSY_PACKETS = 1000
"""A direction that carried fewer packets in a run (its ACKs, say) is left out of the one-line summary."""
MB = 1e6


@dataclass
class RunRecord:
    """What the links did during one run; `ok` is its link check, `problems` why it failed."""

    t0: float
    t1: float
    directions: list[dict[str, Any]] = field(default_factory=list)
    connections: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def tcp_summary(self) -> dict[str, Any]:
        conns = self.connections
        busy = sum(c.get("busy_ms", 0) for c in conns)
        windows = [c["max_snd_wnd"] for c in conns if c.get("max_snd_wnd")]
        return {
            "connections": len(conns),
            "retrans": sum(c.get("retrans", 0) for c in conns),
            "connections_with_retrans": sum(1 for c in conns if c.get("retrans")),
            "bytes_retrans": sum(c.get("bytes_retrans", 0) for c in conns),
            "rwnd_limited_share": round(sum(c.get("rwnd_limited_ms", 0) for c in conns) / busy, 4) if busy else None,
            "min_rcv_window": min(windows, default=None),
            "max_rcv_window": max(windows, default=None),
        }

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "problems": self.problems, "seconds": round(self.t1 - self.t0, 3),
                "directions": self.directions, "tcp": self.tcp_summary(), "connections": self.connections}

    def summary(self) -> str:
        return summary(self.as_dict())


def summary(record: dict[str, Any]) -> str:
    """One line for a table of a run's record (as_dict()): its link check, then what the loaded
    direction(s) and TCP did."""
    parts = ["link ok" if record["ok"] else "LINK CHECK FAILED: " + "; ".join(record["problems"])]
    for d in record["directions"]:
        if not d.get("packets") or d.get("packets", 0) < BUSY_PACKETS:
            continue
        text = f"{d['name']}: {d['packets']} pkts"
        if d.get("dropped"):
            text += f", {d['dropped']} dropped as asked"
            if d.get("segments"):  # one loss event per dropped packet, of the segments it carried
                text += (f" ({d['dropped'] / d['segments']:.2%} of {d['segments']} segments as loss events, "
                         f"{d['dropped_segments'] / d['segments']:.2%} of them lost)")
        if d.get("tbf_drops"):
            text += f", {d['tbf_drops']} at the rate limit"
        if "late_share" in d:
            text += f", {d['late_share']:.1%} late (max {d.get('max_late_ms', 0):.1f} ms)"
        parts.append(text)
    tcp = record["tcp"]
    if tcp["connections"]:
        text = f"TCP {tcp['connections']} conns, {tcp['retrans']} retrans on {tcp['connections_with_retrans']}"
        if tcp["rwnd_limited_share"] is not None:
            text += f", rwnd-limited {tcp['rwnd_limited_share']:.0%}"
        if tcp["max_rcv_window"]:
            text += f", rcv windows {tcp['min_rcv_window'] / MB:.2f}-{tcp['max_rcv_window'] / MB:.2f} MB"
        parts.append(text)
    return "; ".join(parts)


def build_record(samples: list[Sample], links: list[Link], t0: float, t1: float) -> RunRecord:
    """The record of a run from its samples: the first is the baseline (taken before `t0`, where there
    is one), the rest cover the run; counters are differences, maxima are over the run's samples."""
    record = RunRecord(t0, t1)
    if len(samples) < 2:
        record.problems.append("not sampled: no record of the links for this run")
        return record
    for link in links:
        for sender, receiver in ((link.a, link.b), (link.b, link.a)):
            direction = _direction(samples, link, sender, receiver)
            record.directions.append(direction)
            record.problems.extend(f"{direction['name']}: {p}" for p in direction.pop("problems"))
    record.connections = _connections(samples)
    return record


def _direction(samples: list[Sample], link: Link, sender, receiver) -> dict[str, Any]:
    name = f"{sender.name} -> {receiver.name}"
    rows = [s.lines.get(name, {}) for s in samples]
    out: dict[str, Any] = {"name": name, "mbit": link.mbit_from(sender), "rtt_ms": link.rtt_ms,
                           "loss": link.loss_from(sender).as_dict(), "problems": []}
    if not all(r.get("alive", True) for r in rows):
        out["problems"].append("its delayer exited (the direction drops everything)")
    if link.line_from(sender) is not None:
        delayer = [r["delayer"] for r in rows if r.get("delayer")]
        if len(delayer) < 2:
            out["problems"].append("its delayer did not report its counts")
        else:
            first, last = delayer[0], delayer[-1]
            out.update({key: last[key] - first[key] for key in ("received", "released", "dropped", "late",
                                                                 "overflows", "segments", "dropped_segments")})
            out["packets"] = out.pop("received")
            out["max_late_ms"] = round(max(d["max_late_ms"] for d in delayer[1:]), 2)
            out["max_held"] = max(d["max_held"] for d in delayer[1:])
            out["late_share"] = round(out["late"] / out["released"], 5) if out["released"] else 0.0
            if out["late_share"] > LATE_SHARE:
                out["problems"].append(f"{out['late_share']:.1%} of packets released late "
                                       f"(up to {out['max_late_ms']:.1f} ms)")
        kernel = [r["kernel_queue"] for r in rows if r.get("kernel_queue")]
        if len(kernel) >= 2:
            out["unasked_drops"] = sum(kernel[-1][k] - kernel[0][k] for k in ("queue_dropped", "user_dropped"))
            out["max_queued"] = max(k["held"] for k in kernel[1:])
        unasked = out.get("unasked_drops", 0) + out.get("overflows", 0)
        if unasked:
            out["problems"].append(f"{unasked} packets dropped that no loss asked for (the delayer's queue or "
                                   "socket ran out of room)")
    tbf = [r["tbf"] for r in rows if r.get("tbf")]
    if len(tbf) >= 2:
        out["tbf_packets"] = tbf[-1]["packets"] - tbf[0]["packets"]
        out["tbf_drops"] = tbf[-1]["drops"] - tbf[0]["drops"]
        out["tbf_max_backlog_bytes"] = max(t["backlog_bytes"] for t in tbf[1:])
        out.setdefault("packets", out["tbf_packets"])
    return out


def _connections(samples: list[Sample]) -> list[dict[str, Any]]:
    """Each connection that moved data during the run, both of its ends' views joined."""
    base, run = samples[0], samples[1:]
    seen: dict[frozenset, dict[str, Any]] = {}
    for sample in run:
        for host, conns in sample.tcp.items():
            for key, conn in conns.items():
                pair = frozenset((conn["local"], conn["peer"]))
                entry = seen.setdefault(pair, {"views": {}})
                view = entry["views"].setdefault(host, {"first": base.tcp.get(host, {}).get(key), "max": {}})
                view["last"] = conn
                for figure in ("cwnd", "snd_wnd", "rcv_space"):
                    if figure in conn:
                        view["max"][figure] = max(view["max"].get(figure, 0), conn[figure])
    out = []
    for entry in seen.values():
        views = {host: _view(v) for host, v in entry["views"].items()}
        sender = max(views.values(), key=lambda v: v.get("bytes_acked", 0))
        receiver = max(views.values(), key=lambda v: v.get("bytes_received", 0))
        moved = sender.get("bytes_acked", 0)
        if moved <= 0:
            continue
        out.append({
            "from": sender["host"], "to": sender["peer_host"], "sender": sender["local"], "receiver": sender["peer"],
            "cc": sender.get("cc"), "bytes": moved, "retrans": sender.get("retrans", 0),
            "bytes_retrans": sender.get("bytes_retrans", 0), "busy_ms": sender.get("busy_ms", 0),
            "rwnd_limited_ms": sender.get("rwnd_limited_ms", 0),
            "sndbuf_limited_ms": sender.get("sndbuf_limited_ms", 0),
            "max_cwnd": sender.get("max_cwnd"), "max_snd_wnd": sender.get("max_snd_wnd"),
            "max_rcv_space": receiver.get("max_rcv_space") if receiver is not sender else None,
            "min_rtt_ms": sender.get("minrtt_ms"),
        })
    return sorted(out, key=lambda c: -c["bytes"])


def _view(v: dict[str, Any]) -> dict[str, Any]:
    """One end's figures over the run: counters as differences from the baseline, maxima as seen."""
    first, last = v["first"] or {}, v["last"]
    out = {k: val for k, val in last.items() if k not in COUNTERS}
    for key in COUNTERS:
        if key in last:
            out[key] = last[key] - (first.get(key, 0) if first else 0)
    out.update({f"max_{k}": val for k, val in v["max"].items()})
    return out
