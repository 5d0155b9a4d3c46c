"""A two-region weight path on one machine, with a vLLM server taking versions through the backend.

What the TRL example, the backend's tests and its benchmark run: an origin gateway, a relay gateway
following it (as a second region would), each a real `deltamesh gateway` process with tokens, and a
real vLLM server process (`python -m vllm.entrypoints.openai.api_server`, the server `vllm serve`
runs) started with `VLLM_SERVER_DEV_MODE=1` and `--weight-transfer-config '{"backend": "deltamesh"}'`.
`LocalMesh` writes the trainer's key pair and the tokens (a gateway token for the relay, a pool token
for the server, a trainer token for the model) into its folder, and hands out the `[publish]` table
of the trainer and the `init_info` of the server. Every process logs to a file in the folder, runs in
a process group of its own and is stopped with it (`close`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.mesh.demo.processes import ServiceError, child_env, deltamesh_command, free_port, log_tail
from deltamesh.tokens import TokenSpec, add_token

log = logging.getLogger(__name__)

SERVER_START_S = 600.0
"""How long a vLLM server may take to answer `/health` (its CPU build starts in ~1 min on two cores)."""


class LocalMesh:
    """Origin and relay gateways for `model`, and vLLM servers started on demand (see the module docstring)."""

    def __init__(self, root: str | Path, model: str, *, threads: int = 1) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.threads = threads
        self.key = self.root / "trainer.key"
        self.public_key = save_keypair(generate_key(), self.key)
        tokens = self.root / "tokens.toml"
        self.relay_token_file = self._token(tokens, "relay.token", TokenSpec("eu", "gateway"))
        self.pool_token_file = self._token(tokens, "pool.token", TokenSpec("vllm-eu", "pool"))
        self.trainer_token_file = self._token(tokens, "trainer.token", TokenSpec("trainer", "trainer", [model]))
        self.trusted_keys = [self.public_key]
        """Public keys the gateways accept (a test may add more before `start`)."""
        self._procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.origin_url = self.relay_url = ""

    def start(self) -> "LocalMesh":
        """Start the origin and the relay; returns once both answer."""
        origin, relay = free_port(), free_port()
        keys = [arg for k in self.trusted_keys for arg in ("--trusted-key", str(k))]
        tokens = ["--tokens-file", str(self.root / "tokens.toml")]
        self.origin_url = self._gateway("origin", origin, [*keys, *tokens])
        self.relay_url = self._gateway("eu", relay, [*keys, *tokens, "--upstream", self.origin_url,
                                                     "--upstream-token-file", str(self.relay_token_file)])
        for url in (self.origin_url, self.relay_url):
            self._wait(url + "/healthz", 60.0)
        return self

    def publish_table(self, **more: Any) -> dict[str, Any]:
        """The trainer's `[publish]` table (`deltamesh.trainer.publish_config.PublishConfig`), token included."""
        return {"gateway": self.origin_url, "model": self.model, "key": str(self.key),
                "token": self.trainer_token_file.read_text().strip(), **more}

    def engine_init(self, **more: Any) -> dict[str, Any]:
        """The server's `init_info` (`deltamesh.mesh.vllm_plugin.config.BackendConfig`): it takes versions
        from the relay, the other region."""
        return {"gateway": self.relay_url, "model": self.model, "token_file": str(self.pool_token_file),
                "trusted_key": str(self.public_key), "name": "vllm-eu", **more}

    def start_vllm(self, model_dir: str | Path, *, args: Sequence[str] = (), env: dict[str, str] | None = None,
                   name: str = "vllm") -> str:
        """A vLLM server on `model_dir` with the backend; returns its base URL once it answers."""
        port = free_port()
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
                   "--weight-transfer-config", json.dumps({"backend": "deltamesh"}), *args]
        environ = {**child_env(self.threads), "VLLM_SERVER_DEV_MODE": "1",
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
        url = f"http://127.0.0.1:{port}"
        self._spawn(name, command, environ)
        self._wait(url + "/health", SERVER_START_S)
        return url

    def close(self) -> None:
        """SIGTERM each process group (a vLLM server's engine and worker processes with it), SIGKILL what
        is left after a grace period."""
        for _, proc, _ in reversed(self._procs):
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(20.0)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)
            proc.wait(10.0)
        self._procs.clear()

    def __enter__(self) -> "LocalMesh":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _token(self, tokens: Path, name: str, spec: TokenSpec) -> Path:
        path = self.root / name
        path.write_text(add_token(tokens, spec) + "\n")
        path.chmod(0o600)
        return path

    def _gateway(self, region: str, port: int, args: list[str]) -> str:
        command = [*deltamesh_command(), "gateway", "--region", region, "--listen", f"127.0.0.1:{port}",
                   "--store", str(self.root / f"store-{region}"), *args]
        self._spawn(f"gateway-{region}", command, child_env(self.threads))
        return f"http://127.0.0.1:{port}"

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> None:
        log_path = self.root / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=self.root, start_new_session=True)
        self._procs.append((name, proc, log_path))
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)

    def _wait(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        name, proc, log_path = self._procs[-1]
        while True:
            for other, p, path in self._procs:
                if p.poll() is not None:
                    raise ServiceError(f"{other} exited with code {p.returncode}; its log ends:\n{log_tail(path)}")
            try:
                with urllib.request.urlopen(url, timeout=2.0):
                    return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise ServiceError(f"{url} did not answer within {timeout_s:.0f} s; {name}'s log ends:\n"
                                       f"{log_tail(log_path)}") from None
                time.sleep(0.5)

    def log_of(self, name: str) -> str:
        return log_tail(self.root / f"{name}.log", 20000)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def dict_source(weights: Mapping[str, Any]) -> Any:
    """vLLM's `WeightSource` over a name -> tensor mapping, as a trainer holding a state dict hands it to
    the trainer engine; set its `weights` to the next version's before the next `send_weights`."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def __init__(self) -> None:
            self.weights = weights

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

        def __iter__(self):
            return iter(list(self.weights.items()))

    return DictSource()
