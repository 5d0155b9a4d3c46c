"""Reading a service's Prometheus text (`/metrics`) into plain samples, for the figures the console takes
from there: the broker's counters and batch-time histogram, a trainer's mismatch per pool, and a
gateway's pools and links where the console's token may read only its metrics.

Parsed with prometheus-client's own parser; a body that does not parse is an empty reading, not an
error that stops the console (a service of another release may expose other series)."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Series name (with its _total, _sum, _count or _bucket suffix) -> [(labels, value)]."""


def parse_metrics(text: str) -> Samples:
    out: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError):
        return {}
    return dict(out)


def total(samples: Samples, name: str, **match: str) -> float | None:
    """The sum of `name`'s samples whose labels hold `match` (None when there is none)."""
    values = [v for labels, v in samples.get(name, []) if all(labels.get(k) == w for k, w in match.items())]
    return sum(values) if values else None


def by_label(samples: Samples, name: str, label: str, **match: str) -> dict[str, float]:
    """`name`'s samples holding `match`, summed per value of `label`."""
    out: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, []):
        if label in labels and all(labels.get(k) == w for k, w in match.items()):
            out[labels[label]] += value
    return dict(out)


def gateway_pools(samples: Samples) -> list[dict]:
    """A gateway's pools as its metrics show them, in the shape of `GET /v1/pools`' entries (the fields
    the metrics lack are absent)."""
    pools: dict[tuple[str, str], dict] = {}
    for series, key in (("deltamesh_gateway_pool_version", "version"),
                        ("deltamesh_gateway_pool_versions_behind", "versions_behind"),
                        ("deltamesh_gateway_pool_last_seen_seconds", "last_seen_s"),
                        ("deltamesh_gateway_pool_up", "up")):
        for labels, value in samples.get(series, []):
            entry = pools.setdefault((labels.get("pool", ""), labels.get("model", "")),
                                     {"name": labels.get("pool", ""), "model": labels.get("model", "")})
            entry[key] = bool(value) if key == "up" else (value if key == "last_seen_s" else int(value))
    return list(pools.values())


def gateway_links(samples: Samples) -> list[dict]:
    """A gateway's links as its metrics show them, in the shape of `GET /v1/links`' entries."""
    links: dict[tuple[str, str], dict] = {}

    def entry(labels: dict[str, str]) -> dict:
        key = (labels.get("peer", ""), labels.get("role", ""))
        return links.setdefault(key, {"peer": key[0], "role": key[1], "url": "", "rtt_ms": {"p50": None, "p95": None},
                                      "throughput_bps": None, "errors": 0, "last_error": "", "up": None})

    for labels, value in samples.get("deltamesh_gateway_link_rtt_seconds", []):
        quantile = {"0.5": "p50", "0.95": "p95"}.get(labels.get("quantile", ""))
        if quantile:
            entry(labels)["rtt_ms"][quantile] = value * 1e3
    for labels, value in samples.get("deltamesh_gateway_link_throughput_bytes_per_second", []):
        entry(labels)["throughput_bps"] = value
    for labels, value in samples.get("deltamesh_gateway_link_errors_total", []):
        entry(labels)["errors"] = int(value)
    for labels, value in samples.get("deltamesh_gateway_link_up", []):
        entry(labels)["up"] = bool(value)
    return list(links.values())


def gateway_heads(samples: Samples) -> dict[str, int]:
    return {model: int(v) for model, v in by_label(samples, "deltamesh_gateway_head_version", "model").items()}


def histogram_mean(samples: Samples, name: str, **match: str) -> tuple[float, float] | None:
    """(sum, count) of histogram `name` over the series holding `match`; None without any."""
    s, c = total(samples, f"{name}_sum", **match), total(samples, f"{name}_count", **match)
    return None if s is None or c is None else (s, c)


def labels_of(samples: Samples, names: Iterable[str], label: str) -> set[str]:
    return {labels[label] for name in names for labels, _ in samples.get(name, []) if label in labels}
