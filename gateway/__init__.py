"""The weight network's gateway: the regional server (`server/`: routes, version store, relays, registry,
statements) and the verified fetcher that relays and pools share (`fetch/`), with what both sides of
the protocol speak: the transfer plan (`plan`), the parts of a version (`version_parts`) and the
gateway's settings (`config`). The pool's side of the protocol lives in `deltamesh.mesh.pool` and the
publisher in `deltamesh.trainer`. Imports only `deltamesh.delta` among deltamesh components.

The face is loaded on first use, so that a module of one side (a pool's fetch, a CLI's flags) does
not load the other side's server.
"""

from deltamesh.lazy_face import lazy_face

__getattr__, __all__ = lazy_face(__name__, {
    "GatewayConfig": "deltamesh.gateway.config",
    "Plan": "deltamesh.gateway.plan",
    "PlanStep": "deltamesh.gateway.plan",
    "create_app": "deltamesh.gateway.server",
    "run_gateway": "deltamesh.gateway.server",
    "Fetcher": "deltamesh.gateway.fetch",
    "FetchError": "deltamesh.gateway.fetch",
    "Source": "deltamesh.gateway.fetch",
    "fetch_verified": "deltamesh.gateway.fetch",
})
