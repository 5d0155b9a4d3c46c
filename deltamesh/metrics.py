"""What every deltamesh process exposes at `/metrics` beside its own figures.

Each service keeps its metrics in a `CollectorRegistry` of its own (several gateways, brokers or
pools may share a test process), so prometheus-client's default registry, which carries the process
metrics, is never scraped: `service_registry` adds them (`process_cpu_seconds_total`,
`process_resident_memory_bytes`, ...) and `deltamesh_build_info{version,role,python}` to a fresh one.

Importing this module also turns off the `_created` series prometheus-client adds next to every
counter and histogram: Prometheus derives resets itself, and the extra series doubled what each
scrape stored for nothing.
"""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, disable_created_metrics

from deltamesh import __version__

disable_created_metrics()


def service_registry(role: str) -> CollectorRegistry:
    """A registry for one `role` (gateway, broker, pool, pool-sync) with process and build metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    Gauge("deltamesh_build_info", "Always 1; the labels say what is running",
          ["version", "role", "python"], registry=registry).labels(__version__, role, platform.python_version()).set(1)
    return registry
