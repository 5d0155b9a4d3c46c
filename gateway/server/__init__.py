"""The regional gateway server: the aiohttp application (`app`), its routes (`routes_*`), the durable
version store (`store`, `ledger`, `staging`, `disk`), relays that mirror an upstream cut-through
(`relay*`), the pool registry, signed head statements, link probes' metrics and traffic accounting.
"""

from deltamesh.gateway.server.app import create_app, run_gateway
from deltamesh.gateway.server.service import Gateway
from deltamesh.gateway.server.store import VersionStore

__all__ = ["Gateway", "VersionStore", "create_app", "run_gateway"]
