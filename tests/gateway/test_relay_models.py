"""A relay following many models at once: every model's new versions arrive, none waits for another.

With a dozen models the relay keeps a request for each model's next version waiting upstream; those
must not take the connections the transfers need (when they did, a new delta reached a relay tens of
seconds late). How long a new version takes as the number of models grows is measured by
benchmarks/many_models.py; here every model's versions must simply all arrive, promptly.
"""

from __future__ import annotations

import asyncio
import time

from deltamesh.http import HttpError, client_session, request_json
from deltamesh.trainer.upload import upload_version

MODELS = [f"model-{i:02d}" for i in range(12)]


async def _complete(s, url: str, model: str, version: int) -> bool:
    try:
        listing = await request_json(s, "GET", f"{url}/v1/models/{model}/versions")
    except HttpError:
        return False
    return any(v["version"] == version and v["complete"] for v in listing["versions"])


async def _all_arrive(s, relay: str, version: int, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        done = await asyncio.gather(*(_complete(s, relay, m, version) for m in MODELS))
        if all(done):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            missing = [m for m, ok in zip(MODELS, done) if not ok]
            raise AssertionError(f"v{version} of {missing} did not reach the relay within {timeout}s")
        await asyncio.sleep(0.05)


def test_every_models_new_versions_reach_the_relay(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin, client_session(connections=64) as s:
            async with kit.running_gateway(kit.config(tmp_path / "r", upstreams=[origin])) as relay:
                for version, kind in ((0, "full"), (1, "delta"), (2, "delta")):
                    await asyncio.gather(*(upload_version(s, origin, *kit.version(m, version, kind, piece_size=20_000))
                                           for m in MODELS))
                    took = await _all_arrive(s, relay, version, 20)
                    if version == 2:  # by now a request for each model's next version waits upstream
                        assert took < 3.0, f"{len(MODELS)} models' new deltas took {took:.1f}s to reach the relay"
                status = await request_json(s, "GET", f"{relay}/healthz")
                assert status["relay"]["retrying"] == []

    asyncio.run(main())
