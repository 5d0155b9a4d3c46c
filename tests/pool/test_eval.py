"""The evaluator (`deltamesh eval`) on a real gateway (in-process, loopback) and a real tiny transformers
engine: it scores version 0 and every k-th version in order, each result tied to the weights hash the
engine proved it served (read back against the trainer's signed hashes); an engine that does not serve
the version it claims gets no score until a reload proves it; a version asked for below the one held
is scored from a full route and the engine goes back; and its server refuses callers without the right
role, with nothing changed.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from deltamesh.delta import weights_hash
from deltamesh.http import HttpError, client_session, request_json
from deltamesh.mesh.demo.processes import free_port
from deltamesh.mesh.engines.base import EngineError, ServedDigests
from deltamesh.mesh.engines.transformers_engine import TransformersEngine
from deltamesh.mesh.eval.config import EvalConfig, HeldoutConfig
from deltamesh.mesh.eval.server import ROUTES, eval_app
from deltamesh.mesh.eval.service import run_evaluator
from deltamesh.mesh.eval.store import EvalStore
from deltamesh.mesh.pool.config import SamplingConfig
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.publisher import Publisher


def eval_config(kit, gateway: str, **kw) -> EvalConfig:
    kw.setdefault("anonymous", True)
    return EvalConfig(gateways=[gateway], token=kit.token, trusted_keys=[str(kit.public_key)], model_id=kit.model,
                      model_path=str(kit.model_dir), dir=str(kit.tmp / "eval" / "weights"),
                      db=str(kit.tmp / "eval" / "eval.db"), listen=f"127.0.0.1:{free_port()}", threads=1,
                      samples=2, heldout=HeldoutConfig(problems=4, levels=[1]),
                      sampling=SamplingConfig(max_new_tokens=2), heartbeat_s=0.3, poll_wait_s=1,
                      stall_timeout_s=3, give_up_s=20, **kw)


def versions(kit, count: int) -> list[dict]:
    out = [kit.base_weights()]
    for v in range(1, count):
        out.append(kit.next_version(out[-1], seed=v))
    return out


@contextlib.asynccontextmanager
async def running(config: EvalConfig):
    """`run_evaluator` as a task, stopped on exit; yields its base URL once it answers."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_evaluator(config, stop))
    url = f"http://{config.listen}"
    async with client_session(timeout_s=5.0) as session:
        async def up() -> bool:
            if task.done():
                task.result()  # its error, if it failed
            try:
                await request_json(session, "GET", url + "/healthz")
                return True
            except HttpError:
                return False

        for _ in range(300):
            if await up():
                break
            await asyncio.sleep(0.1)
        try:
            yield url, session
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def results(session: aiohttp.ClientSession, url: str, headers: dict | None = None) -> list[dict]:
    return (await request_json(session, "GET", url + "/v1/evals", headers=headers))["results"]


async def wait_scored(session, url: str, wanted: set[int], timeout: float = 120.0) -> list[dict]:
    async def scored() -> set[int]:
        return {r["version"] for r in await results(session, url)}

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not wanted <= await scored():
        if loop.time() > deadline:
            raise AssertionError(f"scored {sorted(await scored())}, waiting for {sorted(wanted)}")
        await asyncio.sleep(0.2)
    return await results(session, url)


def test_version_0_and_every_kth_are_scored_in_order_with_the_weights_hash_the_engine_proved(kit):
    weights = versions(kit, 7)

    async def main() -> None:
        async with kit.running_gateway(kit.gateway_config()) as gw:
            pub = Publisher(gw, kit.private_key, kit.model, full_every=0, piece_bytes=16384)
            for v in range(5):
                await pub.publish(weights[v], v)
            async with running(eval_config(kit, gw, every=2)) as (url, session):
                got = await wait_scored(session, url, {0, 2, 4})
                for v in (5, 6):  # published while it runs
                    await pub.publish(weights[v], v)
                got = await wait_scored(session, url, {0, 2, 4, 6})
                listing = {e["version"]: e["weights_hash"]
                           for e in (await request_json(session, "GET", f"{gw}/v1/models/{kit.model}/versions"))["versions"]}
                status = await request_json(session, "GET", url + "/v1/status")
        assert [r["version"] for r in got] == [0, 2, 4, 6]
        for r in got:
            assert r["weights_hash"] == weights_hash(weights[r["version"]]) == listing[r["version"]]
            assert f"v{r['version']}:" in r["check"] and "match" in r["check"]
            assert (r["problems"], r["samples"]) == (4, 2) and 0 <= r["correct"] <= 8
            assert r["reason"] == ("initial" if r["version"] == 0 else "every")
        assert status["engine_version"] == 6 and status["waiting"] == 0 and not status["drifted"]

    asyncio.run(main())


@pytest.mark.slow
def test_an_engine_not_serving_the_version_it_claims_gets_no_score_until_a_reload_proves_it(kit, monkeypatch):
    """The engine's weights read back differ from v2's signed hashes (as if an update went astray inside
    it): nothing is stored for v2 while that lasts, the stream drifts; once the engine serves v2 again, v2
    is scored with v2's true weights hash. On code that scored whatever the engine claimed, v2 would be
    stored at once."""
    weights = versions(kit, 3)
    wrong = {"on": True}
    real = TransformersEngine.served_digests

    async def served_digests(self, names, grids=None):
        served = await real(self, names, grids)
        if self.version == 2 and wrong["on"]:
            name = next(iter(served.digests))
            return ServedDigests(served.version, {**served.digests, name: "0" * 32})
        return served

    monkeypatch.setattr(TransformersEngine, "served_digests", served_digests)

    async def main() -> None:
        async with kit.running_gateway(kit.gateway_config()) as gw:
            pub = Publisher(gw, kit.private_key, kit.model, full_every=0, piece_bytes=16384)
            for v in range(3):
                await pub.publish(weights[v], v)
            async with running(eval_config(kit, gw, every=2)) as (url, session):
                await wait_scored(session, url, {0})

                async def drifted() -> bool:
                    st = await request_json(session, "GET", url + "/v1/status")
                    return st["drifted"] and st["engine_version"] == 2

                for _ in range(600):
                    if await drifted():
                        break
                    await asyncio.sleep(0.1)
                assert await drifted()
                await asyncio.sleep(2.0)  # reloads and checks go on failing: still nothing stored
                assert [r["version"] for r in await results(session, url)] == [0]
                wrong["on"] = False
                got = await wait_scored(session, url, {0, 2})
        assert got[1]["weights_hash"] == weights_hash(weights[2])

    asyncio.run(main())


def test_a_version_asked_for_below_the_one_held_is_scored_and_the_engine_goes_back(kit):
    weights = versions(kit, 4)

    async def main() -> None:
        async with kit.running_gateway(kit.gateway_config()) as gw:
            pub = Publisher(gw, kit.private_key, kit.model, full_every=0, piece_bytes=16384)
            for v in range(4):
                await pub.publish(weights[v], v)
            async with running(eval_config(kit, gw, every=3)) as (url, session):
                await wait_scored(session, url, {0, 3})
                asked = await request_json(session, "POST", url + "/v1/evals", body={"version": 1})
                again = await request_json(session, "POST", url + "/v1/evals", body={"version": 3})
                got = await wait_scored(session, url, {0, 1, 3})

                async def back() -> bool:
                    st = await request_json(session, "GET", url + "/v1/status")
                    return st["engine_version"] == 3 and not st["drifted"]

                await until_async(back, 60, "the engine back on v3")
        assert asked == {"version": 1, "queued": True}
        assert again["queued"] is False and again["result"]["version"] == 3
        one = next(r for r in got if r["version"] == 1)
        assert one["reason"] == "request" and one["weights_hash"] == weights_hash(weights[1])

    asyncio.run(main())


async def until_async(predicate, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def test_every_route_says_who_may_call_it_and_a_caller_without_the_role_is_refused_with_nothing_changed(kit):
    tokens = kit.tmp / "tokens.toml"
    admin, metrics, pool = (add_token(tokens, TokenSpec(n, r)) for n, r in
                            (("ops", "admin"), ("scraper", "metrics"), ("eval", "pool")))
    config = eval_config(kit, "http://127.0.0.1:9", anonymous=False, tokens_file=str(tokens))
    store = EvalStore(kit.tmp / "evals.db")
    asked: list[int] = []

    def request(version: int) -> bool:
        asked.append(version)
        return True

    from prometheus_client import CollectorRegistry

    app = eval_app(config, store, CollectorRegistry(), status=lambda: {"ok": True}, request=request, heldout="h")
    assert {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"} == set(ROUTES)

    async def main() -> None:
        from deltamesh.http import bearer, serving

        async with serving(app, "127.0.0.1:0") as url, client_session(timeout_s=5.0) as session:
            async def call(method: str, path: str, token: str | None, body=None) -> int:
                headers = bearer(token) if token else None
                try:
                    await request_json(session, method, url + path, body=body, headers=headers)
                    return 200
                except HttpError as e:
                    return e.status

            assert await call("GET", "/healthz", None) == 200
            for path in ("/v1/evals", "/v1/status", "/metrics"):
                assert await call("GET", path, None) == 401
                assert await call("GET", path, pool) == 403
            assert await call("POST", "/v1/evals", None, {"version": 3}) == 401
            assert await call("POST", "/v1/evals", metrics, {"version": 3}) == 403
            assert await call("POST", "/v1/evals", pool, {"version": 3}) == 403
            assert asked == []  # nothing was queued by a refused caller
            assert await call("GET", "/v1/evals", metrics) == 200
            for bad in ({"version": -1}, {"version": "3"}, {"version": True}, [3], {}):
                assert await call("POST", "/v1/evals", admin, bad) == 400
            assert asked == []
            assert await call("POST", "/v1/evals", admin, {"version": 3}) == 200
            assert asked == [3]

    asyncio.run(main())
    store.close()


def test_the_evaluator_refuses_to_start_without_a_way_to_tell_its_callers_apart(kit):
    with pytest.raises(ValueError, match="tokens file"):
        eval_config(kit, "http://127.0.0.1:9", anonymous=False)
    with pytest.raises(ValueError, match="exclude each other"):
        eval_config(kit, "http://127.0.0.1:9", tokens_file=str(kit.tmp / "t.toml"))


async def eval_metric(session: aiohttp.ClientSession, url: str, series: str) -> float | None:
    """One sample of the evaluator's `/metrics` (its full line start, labels included), None if absent."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def test_a_scoring_in_which_every_episode_failed_stores_nothing_and_counts_as_failed(kit, monkeypatch):
    """Every held-out episode raises (the engine fails each generation, as an engine out of memory
    would): that is no measurement of v0, so no result is stored, no accuracy is exported, the scoring
    counts as failed and the status says why; once the engine generates again, v0 is scored. On code
    that stored whatever came back, v0 would be stored at once with accuracy 0."""
    weights = versions(kit, 1)
    broken = {"on": True}
    real = TransformersEngine.generate

    async def generate(self, prompts, params):
        if broken["on"]:
            raise EngineError("generation failed (injected)")
        return await real(self, prompts, params)

    monkeypatch.setattr(TransformersEngine, "generate", generate)
    failed = f'deltamesh_eval_versions_total{{model_id="{kit.model}",outcome="failed"}}'

    async def main() -> None:
        async with kit.running_gateway(kit.gateway_config()) as gw:
            await Publisher(gw, kit.private_key, kit.model, full_every=0, piece_bytes=16384).publish(weights[0], 0)
            async with running(eval_config(kit, gw, every=2)) as (url, session):
                async def failed_twice() -> bool:
                    return (await eval_metric(session, url, failed) or 0) >= 2

                await until_async(failed_twice, 60, "two failed scorings of v0")
                status = await request_json(session, "GET", url + "/v1/status")
                assert "every one of 4 held-out episodes raised" in status["last_error"], status
                assert await results(session, url) == []
                assert await eval_metric(session, url, f'deltamesh_eval_accuracy{{model_id="{kit.model}"}}') is None
                broken["on"] = False
                got = await wait_scored(session, url, {0})
                status = await request_json(session, "GET", url + "/v1/status")
        assert got[0]["failed"] == 0 and got[0]["weights_hash"] == weights_hash(weights[0])
        assert status["last_error"] == ""

    asyncio.run(main())


def test_a_due_version_no_gateway_holds_any_more_is_skipped_and_counted(kit):
    """The gateway keeps only the newest version (retention 1): v0 and v2, due at every=2, can no longer
    be planned to (409), so they are skipped (listed, counted), not waited for; v4 is scored, and asking
    for v0 again answers that it was skipped."""
    weights = versions(kit, 5)
    skipped = f'deltamesh_eval_versions_total{{model_id="{kit.model}",outcome="skipped"}}'

    async def main() -> None:
        async with kit.running_gateway(kit.gateway_config(keep_deltas=1, keep_fulls=1)) as gw:
            pub = Publisher(gw, kit.private_key, kit.model, full_every=1, piece_bytes=16384)
            for v in range(5):
                await pub.publish(weights[v], v)
            async with client_session(timeout_s=5.0) as s:
                async def collected() -> bool:
                    listing = await request_json(s, "GET", f"{gw}/v1/models/{kit.model}/versions")
                    return {e["version"] for e in listing["versions"]} == {4}

                await until_async(collected, 30, "the gateway to collect v0-v3")
            async with running(eval_config(kit, gw, every=2)) as (url, session):
                got = await wait_scored(session, url, {4})
                status = await request_json(session, "GET", url + "/v1/status")
                count = await eval_metric(session, url, skipped)
                again = await request_json(session, "POST", url + "/v1/evals", body={"version": 0})
        assert [r["version"] for r in got] == [4] and got[0]["weights_hash"] == weights_hash(weights[4])
        assert status["skipped"] == [0, 2] and count == 2
        assert again == {"version": 0, "queued": False, "result": None, "skipped": True}

    asyncio.run(main())
