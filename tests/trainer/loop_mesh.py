"""A small real mesh for the trainer loop tests: broker, origin gateway, pools and trainers as processes.

Every process is a real `deltamesh` command on a free loopback port, logging to a file under the
test's temporary directory; `Mesh.close()` kills whatever is still running. Trajectories are made
here the simplest valid way: random tokens from the tiny model's vocabulary, scored by that model
for their behaviour logprobs, with rewards the caller chooses; they reach the broker through its
pool-side client, as a rollout pool's would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from deltamesh.mesh.demo.processes import free_port, log_tail

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
POOL_TOKEN = "loop-test-token"
PROMPT, GROUP = 6, 4


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, procs: Sequence["Proc"] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.exited():
                raise AssertionError(f"{p.name} exited with {p.proc.returncode} while waiting for {what}:\n{p.tail()}")
        try:
            if predicate():
                return
        except (OSError, urllib.error.URLError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def signal(self, sig: int) -> None:
        """Signal the whole process group (torchrun's ranks too)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                try:  # leftover children (torchrun's ranks) in its group
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s:\n{self.tail()}") from None

    def tail(self, n: int = 5000) -> str:
        return log_tail(self.log_path, n)


class Mesh:
    """The processes of one test; `close()` kills them all."""

    def __init__(self, root: Path, public_key: Path, private_key: Path, model_dir: Path):
        self.root, self.public_key, self.private_key, self.model_dir = root, public_key, private_key, model_dir
        self.procs: list[Proc] = []
        self._pending: list[tuple[str, Proc]] = []
        self.env = {**os.environ, "DELTAMESH_LOG": "INFO", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                    "TOKENIZERS_PARALLELISM": "false"}

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, cmd, self.root / f"{name}.log", {**self.env, **(env or {})}).start()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            p.kill()

    def broker(self, models: Sequence[str]) -> str:
        """Launch the broker (serving `models`); `ready()` waits for it."""
        port = free_port()
        cmd = [DELTAMESH, "broker", "--anonymous", "--listen", f"127.0.0.1:{port}", "--db", str(self.root / "broker.db"),
               "--durability", "process"]
        for m in models:
            cmd += ["--model", m]
        url = f"http://127.0.0.1:{port}"
        self._pending.append((url + "/v1/status", self._spawn("broker", cmd)))
        return url

    def gateway(self) -> str:
        """Launch the origin gateway; `ready()` waits for it."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = self._spawn("gateway", [
            DELTAMESH, "gateway", "--region", "origin", "--listen", f"127.0.0.1:{port}",
            "--store", str(self.root / "gateway-store"), "--trusted-key", str(self.public_key),
            "--anonymous", "--advertise", url, "--piece-wait-s", "1.5", "--stall-timeout-s", "3"])
        self._pending.append((url + "/healthz", proc))
        return url

    def ready(self, timeout: float = 90.0) -> None:
        """Wait until every service launched so far answers (they boot side by side)."""
        for url, proc in self._pending:
            wait_until(lambda: get_text(url, 1) is not None, timeout, proc.name, [proc])
        self._pending.clear()

    def pool(self, name: str, gateway: str, model_id: str) -> Path:
        directory = self.root / "pools" / name
        self._spawn(f"pool-{name}", [
            DELTAMESH, "pool", "sync", "--gateway", gateway, "--name", name,
            "--dir", str(directory), "--trusted-key", str(self.public_key), "--model", model_id,
            "--heartbeat-s", "0.5", "--stall-timeout-s", "3"], env={"DELTAMESH_TOKEN": POOL_TOKEN})
        return directory

    def trainer(self, name: str, *, broker: str, gateway: str, model_id: str, args: Sequence[str] = (),
                ranks: int = 1) -> Proc:
        train = ["train", "--broker", broker, "--gateway", gateway, "--model-id", model_id,
                 "--model", str(self.model_dir), "--key", str(self.private_key), "--device", "cpu", *args]
        if ranks == 1:
            cmd = [DELTAMESH, *train]
        else:
            cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), "--no-python", DELTAMESH, *train]
        return self._spawn(name, cmd)


def gateway_versions(gateway: str, model_id: str) -> dict[int, dict[str, dict]]:
    """{version: {kind: entry}} of a model at the gateway."""
    out: dict[int, dict[str, dict]] = {}
    for e in get_json(f"{gateway}/v1/models/{model_id}/versions")["versions"]:
        out.setdefault(e["version"], {})[e["kind"]] = e
    return out


def metric(text: str, name: str, labels: dict[str, str]) -> float:
    """One sample's value from Prometheus text (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1:line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def make_trajectories(model: torch.nn.Module, model_id: str, groups: int, *, version: int, seed: int,
                      rewards: Sequence[float] = (0.0, 1.0), group_size: int = GROUP) -> list:
    """`groups` groups of `group_size` trajectories: random prompt and response tokens, behaviour
    logprobs from `model`, rewards drawn from `rewards`, generated tokens tagged with `version`."""
    from deltamesh.data import Trajectory
    from deltamesh.trainer.step import sequence_logprobs

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    out = []
    for g in range(groups):
        group_id = f"{model_id}-s{seed}-g{g}"
        for i in range(group_size):
            length = PROMPT + int(rng.integers(3, 9))
            tokens = rng.integers(4, vocab, length).astype(np.int32)
            with torch.no_grad():
                logp = sequence_logprobs(model, torch.from_numpy(tokens.astype(np.int64))[None], None, 1.0)[0]
            loss_mask = np.zeros(length, np.uint8)
            loss_mask[PROMPT:] = 1
            versions = np.where(loss_mask == 1, version, -1).astype(np.int32)
            out.append(Trajectory(
                id=f"{group_id}-{i}", task_id=f"task-{g}", group_id=group_id, group_size=group_size, model_id=model_id,
                tokens=tokens, logprobs=logp.float().numpy().astype(np.float32) * loss_mask, loss_mask=loss_mask,
                versions=versions, reward=float(rng.choice(rewards))))
    return out


def submit(broker: str, trajectories: list) -> None:
    """Hand trajectories to the broker through the rollout pools' client."""
    from deltamesh.broker_client import BrokerClient

    async def main() -> None:
        async with BrokerClient(broker, pool="loop-test", region="local") as client:
            result = await client.submit(trajectories)
            assert result.accepted == len(trajectories), result

    asyncio.run(main())


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class AckDropper:
    """A proxy in front of the broker that loses every request carrying an acknowledgement, as a network
    that cuts a trainer off right after its checkpoint would: `POST .../acks`, and every poll once it
    has an acknowledgement to carry, answer 503; everything else passes through. It runs in a thread of
    its own (`LoopThread`); `dropped` lists the batch ids whose acknowledgements it lost."""

    def __init__(self, broker: str):
        from deltamesh.loop_thread import LoopThread

        self.broker = broker
        self.dropped: list[str] = []
        self._thread = LoopThread("ack-dropper")
        self.url = self._thread.call(self._start())

    async def _start(self) -> str:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _handle(self, request):
        from aiohttp import web

        body = await request.read()
        acks = []
        if request.method == "POST" and request.path.endswith("/acks"):
            acks = json.loads(body).get("batch_ids", [])
        elif request.method == "POST" and request.path.endswith("/batch") and body:
            acks = json.loads(body).get("ack") or []
        if acks:
            self.dropped += [a for a in acks if a not in self.dropped]
            return web.json_response({"error": "lost on the way"}, status=503, headers={"Retry-After": "1"})
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with self._session.request(request.method, self.broker + request.path_qs, data=body or None,
                                         headers=headers) as answer:
            data = await answer.read()
            out = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "transfer-encoding",
                                                                              "content-encoding", "connection")}
            return web.Response(body=data, status=answer.status, headers=out)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()

        self._thread.call(stop())
        self._thread.close()
