"""The verified fetcher that relays and pools share: a version's manifest and pieces from a list of
gateways (`sources`, ordered by measured `links`), parallel and ranged (`lanes`, `http_reads`), hedged at
a version's end (`hedge`), failing over and judging sources (`judge`, `scoring`), parts asked for before
the version is known (`parts`), and one plan step fetched and verified against the trainer's signature
(`plan_steps`). `link_bench` measures a link with the same requests.
"""

from deltamesh.gateway.fetch.errors import CredentialsError, SyncError
from deltamesh.gateway.fetch.fetcher import Fetcher, FetchError
from deltamesh.gateway.fetch.plan_steps import fetch_share, fetch_verified
from deltamesh.gateway.fetch.sources import Source

__all__ = ["CredentialsError", "FetchError", "Fetcher", "Source", "SyncError", "fetch_share", "fetch_verified"]
