"""`BrokerClient` and `BatchClient` across several brokers, on real loopback sockets.

A client given a broker that refuses connections, a standby (503 naming its leader) and a real
broker ends at the real one, following the leader named when it is one of its URLs and never one it
was not given (its bearer token would go there); it gives up after `failover_s`; an error that is not
about reachability is not retried. A trainer never trains twice on a batch that a broker taking
over serves again because its acknowledgement was lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aiohttp import web

from deltamesh.broker_client import LEADER_HEADER, BrokerClient
from deltamesh.config import ConfigError, from_dict
from deltamesh.data import BATCH_CONTENT_TYPE, encode_batch
from deltamesh.http import HttpError, serving
from deltamesh.mesh.autoscale.config import AutoscaleConfig
from deltamesh.mesh.demo.processes import free_port
from deltamesh.mesh.pool.config import PoolConfig
from deltamesh.tls import TlsError
from deltamesh.trainer import batch_client
from deltamesh.trainer.batch_client import BatchClient
from deltamesh.trainer.loop_config import TrainLoopConfig


class FakeBroker:
    """A broker on a real socket that records every request. As a standby (`leader` not None) it
    answers every /v1/ route as a standby broker does; else `status` (200: a batch poll serves the
    ids of `serve` in turn, then nothing) and its `answer` for every other route."""

    def __init__(self, *, leader: str | None = None, status: int = 200, serve: list[str] | None = None):
        self.leader = leader
        self.status = status
        self.serve = list(serve or [])
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        self.polls: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path, request.headers.get("Authorization")))
        if self.leader is not None:
            return web.json_response({"error": "standby broker", "leader": self.leader}, status=503,
                                     headers={"Retry-After": "1", LEADER_HEADER: self.leader})
        if self.status != 200:
            return web.json_response({"error": "refused"}, status=self.status)
        if request.path.endswith("/batch"):
            self.polls.append(await request.json())
            if not self.serve:
                return web.Response(status=204)
            batch_id = self.serve.pop(0)
            data = encode_batch([], [], model_id="m", batch_id=batch_id, version=0)
            return web.Response(body=data, content_type=BATCH_CONTENT_TYPE, headers={"X-Batch-Id": batch_id})
        return web.json_response({"models": {}, "tasks": {}})


async def start(stack: AsyncExitStack, broker: FakeBroker) -> str:
    return await stack.enter_async_context(serving(broker.app(), "127.0.0.1:0"))


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused


def switches(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "switching to" in r.getMessage()]


def test_a_client_fails_over_past_a_dead_broker_and_a_standby_to_the_leader(serve_broker, make_group, caplog):
    caplog.set_level(logging.WARNING, logger="deltamesh.broker_client")

    async def scenario() -> None:
        async with serve_broker() as (active, broker), AsyncExitStack() as stack:
            standby, unnamed = FakeBroker(leader=active), FakeBroker(leader="")
            standby_url, unnamed_url = await start(stack, standby), await start(stack, unnamed)
            dead = dead_url()
            # In list order the client would try `unnamed` before `active`: the standby's answer skips it.
            async with BrokerClient([dead, standby_url, unnamed_url, active], pool="p", failover_s=10) as client:
                assert client.base == dead
                assert (await client.submit(make_group("g", [1.0, 0.0, 1.0, 0.0]))).accepted == 4
                assert client.base == active
                assert (await client.status())["models"]["m"]["fresh_samples"] == 4
            assert len(standby.requests) == 1 and unnamed.requests == []
            first, second = switches(caplog)  # one warning per switch
            assert first.startswith(f"broker {dead} failed") and first.endswith(f"switching to {standby_url}")
            assert second == (f"broker {standby_url} failed ({standby_url}/v1/trajectories: 503 standby broker); "
                              f"switching to {active}")

    asyncio.run(scenario())


def test_a_leader_the_client_was_not_given_is_never_followed(serve_broker, caplog):
    caplog.set_level(logging.WARNING, logger="deltamesh.broker_client")

    async def scenario() -> None:
        async with serve_broker() as (active, _), AsyncExitStack() as stack:
            decoy = FakeBroker()
            decoy_url = await start(stack, decoy)
            standby_url = await start(stack, FakeBroker(leader=decoy_url))
            async with BrokerClient(f"{standby_url},{active}", token="dm_secret", failover_s=10) as client:
                assert "models" in await client.status()
                assert client.base == active
            async with BrokerClient(standby_url, token="dm_secret", failover_s=0.5) as alone:
                with pytest.raises(HttpError) as refused:
                    await alone.status()
                assert refused.value.status == 503 and alone.base == standby_url
            assert decoy.requests == []  # the token never went there
            not_followed = [r for r in caplog.records if "not following it" in r.getMessage()]
            assert len(not_followed) == 2  # once per client, not once per retry

    asyncio.run(scenario())


def test_a_client_gives_up_after_failover_s():
    async def scenario() -> None:
        async with BrokerClient([dead_url(), dead_url()], failover_s=0.6) as client:
            began = time.monotonic()
            with pytest.raises(HttpError) as unreachable:
                await client.lease()
            assert unreachable.value.status == 0 and 0.6 <= time.monotonic() - began < 3.0
        async with BrokerClient(dead_url(), failover_s=0) as once:
            began = time.monotonic()
            with pytest.raises(HttpError):
                await once.status()
            assert time.monotonic() - began < 1.0  # no retry at all

    asyncio.run(scenario())


def test_an_answer_that_is_not_about_reachability_is_not_retried():
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            refusing, other = FakeBroker(status=403), FakeBroker()
            urls = [await start(stack, refusing), await start(stack, other)]
            async with BrokerClient(urls, failover_s=10) as client:
                with pytest.raises(HttpError) as refused:
                    await client.report_version("m", 3)
                assert refused.value.status == 403 and client.base == urls[0]
            assert len(refusing.requests) == 1 and other.requests == []

    asyncio.run(scenario())


def test_every_broker_url_must_be_safe_for_the_token():
    with pytest.raises(TlsError, match="refusing to send a token"):
        BrokerClient("http://127.0.0.1:8700,http://broker.example:8800", token="dm_x")
    with pytest.raises(ValueError, match="no broker URL"):
        BrokerClient(" , ")


@pytest.mark.parametrize("cls,table", [
    (PoolConfig, {"name": "p", "sync": {"gateways": ["http://127.0.0.1:1"], "token": "t", "trusted_keys": ["/k"]},
                  "models": [{"model_path": "/m"}]}),
    (TrainLoopConfig, {"model": "/m", "key": "/k", "gateway": "http://g:1"}),
    (AutoscaleConfig, {"command": ["true"]}),
])
def test_every_broker_setting_takes_several_urls(cls, table):
    config = from_dict(cls, {**table, "broker": " http://a:8700/, https://b:8700 "})
    assert config.broker == "http://a:8700,https://b:8700"
    with pytest.raises(ConfigError, match="broker must be an http"):
        from_dict(cls, {**table, "broker": "http://a:8700,b:8700"})
    with pytest.raises(ConfigError, match="broker must be one or more"):
        from_dict(cls, {**table, "broker": ","})


def test_a_trainer_skips_a_batch_served_again_after_a_failover():
    """The first broker confirms the acknowledgement of b1, then steps down; the broker that takes
    over never got it and serves b1 again. The trainer acknowledges b1 once more and gets b2."""

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            first, second = FakeBroker(serve=["b1"]), FakeBroker(serve=["b1", "b2"])
            first_url, second_url = await start(stack, first), await start(stack, second)
            async with BatchClient(f"{first_url},{second_url}", "m", failover_s=10) as trainer:
                assert (await trainer.next_batch(4, timeout_s=1)).batch_id == "b1"
                assert await trainer.next_batch(4, timeout_s=0.1) is None  # b1 trained; its ack confirmed
                first.leader = second_url
                assert (await trainer.next_batch(4, timeout_s=5)).batch_id == "b2"
                assert [p["ack"] for p in second.polls] == [[], ["b1"]]
                assert trainer.held == ["b2"] and trainer.unconfirmed_acks == []
            assert [p["ack"] for p in first.polls] == [[], ["b1"]]

    asyncio.run(scenario())


def test_a_trainer_remembers_a_bounded_number_of_trained_batches(monkeypatch):
    monkeypatch.setattr(batch_client, "TRAINED_MEMORY", 2)

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            broker = FakeBroker(serve=["a", "b", "c", "b", "a", "d"])
            url = await start(stack, broker)
            async with BatchClient(url, "m", auto_ack=False) as trainer:
                for expected in "abc":
                    assert (await trainer.next_batch(1, timeout_s=1)).batch_id == expected
                    await trainer.ack()
                # b is remembered (skipped and acknowledged again); a is forgotten (only the last 2 are kept)
                assert (await trainer.next_batch(1, timeout_s=1)).batch_id == "a"
                assert broker.polls[-1]["ack"] == ["b"]
                await trainer.ack()
                assert (await trainer.next_batch(1, timeout_s=1)).batch_id == "d"

    asyncio.run(scenario())
