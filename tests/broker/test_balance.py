"""The balance report on a scripted trainer/producer schedule: wait fraction, production, consumption
and the GPU target follow the formula, as JSON and as metrics."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.mesh.broker.config import BalanceConfig, BrokerConfig
from deltamesh.trainer.batch_client import BatchClient


def metric(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def formula(g: int, w: float, n_p: int, n_c: int) -> int:
    if w > 0.10:
        return math.ceil(g / (1 - w))
    if w < 0.05 and n_p > 0 and n_c > 0:
        return min(g, math.ceil(g * n_c / n_p * 1.10))
    return g


def test_balance_report_follows_a_scripted_schedule(serve_broker, make_group):
    config = BrokerConfig(models=["m", "idle"], balance=BalanceConfig(window_steps=2))
    # (groups of 4 produced, batches of 8 consumed, wait_s, step_s) per trainer step
    schedule = [(4, 1, 3.0, 10.0), (2, 1, 1.0, 10.0),  # starved
                (4, 1, 0.1, 10.0), (4, 1, 0.1, 10.0),  # fed, producing twice what is consumed
                (2, 1, 0.7, 10.0), (2, 1, 0.7, 10.0)]  # in between the thresholds

    async def scenario():
        async with serve_broker(config) as (url, broker), BrokerClient(url, pool="a", gpus=3) as a, \
                BrokerClient(url, pool="b", gpus=1) as b, BatchClient(url, "m") as trainer, aiohttp.ClientSession() as s:
            await a.lease(1)
            await b.lease(1)
            n = 0
            history = []
            for produced, consumed, wait_s, step_s in schedule:
                for _ in range(produced):
                    await a.submit(make_group(f"g{n}", [1.0, 0.0, 1.0, 0.0]))
                    n += 1
                for _ in range(consumed):
                    assert len(await trainer.next_batch(8, timeout_s=5)) == 8
                await trainer.report_step(wait_s, step_s)
                history.append((produced * 4, consumed * 8, wait_s, step_s))
                async with s.get(f"{url}/v1/balance") as r:
                    report = await r.json()
                last = history[-2:]
                w = sum(h[2] for h in last) / sum(h[3] for h in last)
                n_p, n_c = sum(h[0] for h in last), sum(h[1] for h in last)
                entry = report["models"]["m"]
                assert report["gpus"] == 4
                assert entry["wait_fraction"] == w and (entry["produced"], entry["consumed"]) == (n_p, n_c)
                assert entry["target_gpus"] == formula(4, w, n_p, n_c)
                assert report["models"]["idle"] == {"steps": 0, "wait_s": 0, "step_s": 0, "wait_fraction": 0.0,
                                                    "produced": 0, "consumed": 0, "target_gpus": 4}
                assert report["target_gpus"] == max(entry["target_gpus"], 4)
                history_targets.append(entry["target_gpus"])
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
            assert metric(text, 'deltamesh_broker_wait_fraction{model_id="m"}') == pytest.approx(0.07)
            assert metric(text, 'deltamesh_broker_target_gpus{model_id="m"}') == 4
            assert metric(text, "deltamesh_broker_rollout_gpus") == 4

    history_targets: list[int] = []
    asyncio.run(scenario())
    # w 0.3 -> ceil(4/0.7) = 6; w 0.2 -> 5; w 0.055 -> hold 4; w 0.01 with n_c/n_p = 16/32 -> ceil(2.2) = 3;
    # w 0.04 with 16/24 -> ceil(2.93) = 3; w 0.07 -> hold 4
    assert history_targets == [6, 5, 4, 3, 3, 4]
