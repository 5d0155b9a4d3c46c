"""Hot-swap benchmark: from "version available at the gateway" to "engine generating with it".

A real gateway (in this process, on a loopback socket) holds the versions; a pool's weight stream
(`deltamesh.mesh.pool.weights.PolicyWeights`, the code `deltamesh pool run` uses) brings each new
version into a live transformers engine that keeps generating meanwhile, one token per call. The
clock starts when the publisher has uploaded the whole version and stops when the engine serves it:
the swap is done and every later decode step, starting with the next, uses the new weights. The time
until the engine has actually returned its first token from the new version is reported too
(`*_first_token_seconds`): it adds the decode step that was running and any slowdown of generation
while the synced directory is being written; `*_round_seconds` runs until the pool's round is over
(the synced directory written too, which an engine updated in place may do behind it), and
`*_proven_seconds` until the pool's check of what the engine serves has passed (the `serving` stage of
its timeline: from then on the pool leases rollouts on the version). For the
in-place delta, `in_place_next_seconds` times a version published the moment the one before is
served, as a trainer faster than the pool's round would: it waits for whatever of the previous
round still holds the pool up. Two ways side by side, in one run, on the same versions:

- in place: the plan's verified pieces are decoded once and written into the live model (a delta
  changes only its changed words; a full snapshot is decoded off to the side and copied in); the
  same decoded version is then applied to the synced directory.
- reload: the version is applied to the synced directory first (atomic, fsynced), then the engine
  reloads the whole model from it (`load_version`: read, hash-check, copy in), which is what an
  engine without hot swap does.

Each is measured for a delta (one step later) and a full snapshot (a version published as a full
snapshot only, so the plan must take it), with two engines in the same run: the transformers engine
and, on SmolLM2, vLLM in process (`VLLMEngine`: in place hands vLLM's `reload_weights` only the layers
the version touches, from memory; reload lets the same running vLLM reload the fsynced directory with
`reload_weights(weights_path=...)`). For vLLM, `*_vllm_seconds` is the time spent inside vLLM's own
reload (its re-processing of those layers): the floor of either way. Models: SmolLM2-135M-Instruct (real weights, one real
Adam step) and a synthetic model with Qwen3-0.6B's shapes (1.19 GB of seeded random bf16 weights,
1% of words moving per version). Medians of `--repeats` runs. Prints a table, or with --json one
object `{"cases": [{"model", "engine", "kind", "in_place_seconds", "reload_seconds", ...}]}`. `--kinds` and
`--ways` measure a subset (`swap_compare.py` times only the in-place delta, against an older checkout).

    .venv/bin/python benchmarks/swap.py [--quick] [--json] [--repeats N] [--no-synthetic] [--engines ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from common import bench_parser, emit, parse_bench_args
from inputs import qwen3_shapes, synthetic_case

from deltamesh.delta import dir_manifest, generate_key, read_weights, save_keypair, write_weights
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.app import create_app
from deltamesh.http import serving
from deltamesh.mesh.demo.models import char_tokenizer_dir, smollm2_adam_versions, smollm2_model_dir
from deltamesh.mesh.engines.base import Engine, SamplingParams
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weights import PolicyWeights
from deltamesh.trainer.models import load_tokenizer
from deltamesh.trainer.publisher import Publisher

log = logging.getLogger("benchmarks.swap")

Weights = dict[str, torch.Tensor]
MODES = {"in_place": True, "reload": False}
KINDS = ("delta", "full")
ENGINES = ("transformers", "vllm")
TOKEN = "bench-token"


@dataclass
class ModelInput:
    name: str
    model_dir: Path
    old: Weights
    new: Weights
    note: str

    @property
    def model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.old.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="one repeat, a 4-layer synthetic model (well under 1 GiB)",
                     repeats="timed runs per case and way")
    p.add_argument("--lr", type=float, default=5e-6, help="Adam learning rate of SmolLM2's real step")
    p.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2-135M")
    p.add_argument("--no-synthetic", action="store_true", help="skip the Qwen3-0.6B-shaped synthetic model")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="which kinds of version to time")
    p.add_argument("--ways", nargs="+", choices=list(MODES), default=list(MODES), help="which ways in to time")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
                   help="engines to time (vllm on SmolLM2 only)")
    p.add_argument("--verbose", action="store_true", help="show the services' own logs")
    p.add_argument("--workdir", help="where model copies, gateway store and synced directories go (default: a temp dir)")
    return parse_bench_args(p, argv)


# -- inputs ------------------------------------------------------------------------------------------

def smollm2_input(lr: float) -> ModelInput:
    model_dir = smollm2_model_dir()
    old = read_weights(model_dir)
    new = smollm2_adam_versions([lr])[lr]
    if old.keys() != new.keys():
        raise RuntimeError("SmolLM2's stepped weights do not match its model directory")
    return ModelInput("smollm2-135m", model_dir, old, new, f"real weights, one Adam step at lr {lr:g}")


def synthetic_input(workdir: Path, layers: int) -> ModelInput:
    """A Qwen3-0.6B-shaped model directory (config, character tokenizer, seeded random bf16 weights)."""
    from transformers import AutoConfig

    case = synthetic_case(qwen3_shapes(layers=layers), changed=0.01)
    model_dir = workdir / "synthetic-model"
    tokenizer = load_tokenizer(char_tokenizer_dir())
    AutoConfig.for_model(
        "qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="bfloat16",
    ).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_weights(model_dir, case.old)
    name = "qwen3-0.6b-synthetic" if layers == 28 else f"qwen3-synthetic-{layers}l"
    return ModelInput(name, model_dir, case.old, case.new, case.note)


# -- the measured system -------------------------------------------------------------------------------

class Generating:
    """Keeps an engine generating (one greedy token per call) and notes when each version first served."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.prompt = engine.encode("12+30=")
        self.first_served: dict[int, float] = {}
        self._seen = asyncio.Event()

    async def __aenter__(self) -> "Generating":
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _loop(self) -> None:
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        while True:
            (gen,) = await self.engine.generate([self.prompt], params)
            self.first_served.setdefault(gen.versions[0], time.time())
            self._seen.set()
            self._seen.clear()

    async def first_token_of(self, version: int, timeout_s: float = 300.0) -> float:
        deadline = time.monotonic() + timeout_s
        while version not in self.first_served:
            await asyncio.wait_for(self._seen.wait(), max(0.0, deadline - time.monotonic()))
        return self.first_served[version]


class Trainer:
    """Publishes versions of the model: every measured version goes from the old weights to the new ones
    (a delta is not equally large both ways), as a delta or as a full snapshot only."""

    def __init__(self, url: str, key, model: ModelInput):
        self.url, self.key, self.model = url, key, model
        self.publisher = Publisher(url, key, model.name, full_every=0)
        self.current = model.old

    async def start(self) -> None:
        await self.publisher.publish(self.model.old, 0)

    async def back_to_old(self) -> bool:
        """Publish the old weights again (a delta) unless they are the head; True if it published."""
        if self.current is self.model.old:
            return False
        await self.publisher.publish(self.model.old)
        self.current = self.model.old
        return True

    async def publish_new(self, kind: str) -> tuple[int, int]:
        """Publish the new weights as `kind`; returns (version, payload bytes) once all of it is uploaded."""
        target = self.model.new
        if kind == "delta":
            published = await self.publisher.publish(target)
        else:
            # A publisher without a base continues after the gateway's head with a full snapshot only.
            published = await Publisher(self.url, self.key, self.model.name, full_every=0).publish(target)
            self.publisher.set_base(published.version, target, published.manifests[0].weights_hash)
        self.current = target
        return published.version, published.manifests[0].payload_bytes


def start_engine(name: str, model: ModelInput) -> Engine:
    if name == "vllm":
        # Imported here: swap_compare.py runs this script against older code trees that have no vLLM engine.
        from deltamesh.mesh.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

        return VLLMEngine(VLLMEngineConfig(model_id=model.name, model_dir=str(model.model_dir)))
    return TransformersEngine(TransformersEngineConfig(model_id=model.name, model_dir=str(model.model_dir)))


async def measure_model(model: ModelInput, repeats: int, workdir: Path, kinds: Sequence[str] = KINDS,
                        ways: Sequence[str] = tuple(MODES), engine_name: str = "transformers") -> list[dict]:
    key = generate_key()
    public = save_keypair(key, workdir / "trainer.key")
    config = GatewayConfig(store=str(workdir / "store"), trusted_keys=[str(public)], anonymous=True,
                           keep_fulls=1, keep_deltas=4)
    cells = [(k, m) for k in kinds for m in ways]
    served_after: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    first_token: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    round_over: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    proven: dict[tuple[str, str], list[float]] = {c: [] for c in cells}  # the after-swap check passed
    payload: dict[str, list[int]] = {k: [] for k in kinds}
    in_engine: dict[tuple[str, str], list[float]] = {c: [] for c in cells}  # vLLM: inside its reload
    async with serving(create_app(config), "127.0.0.1:0") as url, contextlib.AsyncExitStack() as stack:
        trainer = Trainer(url, key, model)
        await trainer.start()
        pools = {}
        for mode in ways:
            engine = await asyncio.to_thread(start_engine, engine_name, model)
            stack.push_async_callback(engine.close)
            sync = PoolSyncConfig(gateways=[url], token=TOKEN, name=f"bench-{mode}", dir=str(workdir / mode),
                                  trusted_keys=[str(public)], model=model.name, connections=4, give_up_s=600)
            pools[mode] = await stack.enter_async_context(PolicyWeights(engine, sync, hot_swap=MODES[mode]))
        # The ways take turns version by version, so that both see the same background load over time;
        # before each measured version both catch up, off the clock, with the old weights republished.
        for _rep in range(repeats):
            for kind in kinds:
                for mode, weights in pools.items():
                    await trainer.back_to_old()
                    await catch_up(pools.values())
                    engine = weights.engine
                    async with Generating(engine) as generating:
                        version, nbytes = await trainer.publish_new(kind)
                        available = time.time()
                        await weights.sync_round()
                        # An engine updated in place may have its directory written behind it.
                        over = await directory_holds(weights, version) - available
                        if engine.version != version or weights.status.last_error:
                            raise RuntimeError(f"{model.name} {kind} {mode}: engine at v{engine.version}, "
                                               f"wanted v{version}; {weights.status.last_error}")
                        served = weights.status.last_swap_at - available
                        passed = weights.timeline.get(version).get("serving")
                        first = await generating.first_token_of(version) - available
                    served_after[(kind, mode)].append(served)
                    first_token[(kind, mode)].append(first)
                    round_over[(kind, mode)].append(over)
                    if passed is not None:
                        proven[(kind, mode)].append(passed - available)
                    if engine_name == "vllm":
                        in_engine[(kind, mode)].append(engine.last_reload_s)
                    payload[kind].append(nbytes)
                    log.info("%s %s %s: v%d served after %.3f s, first token after %.3f s, round over after "
                             "%.3f s (%d payload bytes)", model.name, kind, mode, version, served, first, over, nbytes)
        next_served = []
        if "in_place" in pools and "delta" in kinds:
            for _rep in range(repeats):
                await trainer.back_to_old()
                await catch_up(pools.values())
                async with Generating(pools["in_place"].engine):
                    next_served.append(await next_version_served(pools["in_place"], trainer))
                log.info("%s delta in_place, next version: served after %.3f s", model.name, next_served[-1])
    gc.collect()
    cases = []
    for kind in kinds:
        case = {"model": model.name, "engine": engine_name, "kind": kind, "model_bytes": model.model_bytes,
                "payload_bytes": int(statistics.median(payload[kind])), "runs": repeats, "note": model.note}
        if kind == "delta" and next_served:
            case.update(in_place_next_seconds=statistics.median(next_served), in_place_next_runs=next_served)
        for mode in ways:
            case.update({
                f"{mode}_seconds": statistics.median(served_after[(kind, mode)]),
                f"{mode}_first_token_seconds": statistics.median(first_token[(kind, mode)]),
                f"{mode}_round_seconds": statistics.median(round_over[(kind, mode)]),
                f"{mode}_runs": served_after[(kind, mode)], f"{mode}_round_runs": round_over[(kind, mode)],
            })
            if proven[(kind, mode)]:
                case.update({f"{mode}_proven_seconds": statistics.median(proven[(kind, mode)]),
                             f"{mode}_proven_runs": proven[(kind, mode)]})
            if in_engine[(kind, mode)]:
                case[f"{mode}_vllm_seconds"] = statistics.median(in_engine[(kind, mode)])
        cases.append(case)
    return cases


async def catch_up(pools) -> None:
    """Bring every pool to the head, its directory written too (off the clock)."""
    for each in pools:
        await each.sync_round()
        await directory_holds(each, each.engine.version)


async def directory_holds(weights: PolicyWeights, version: int, timeout_s: float = 300.0) -> float:
    """When (wall clock) the pool's synced directory holds `version` (polled: older code trees wrote it
    in the round). A write behind the round that fails, or none within `timeout_s`, fails the run."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = await asyncio.to_thread(dir_manifest, weights.dir)
        if held is not None and held.version >= version:
            return time.time()
        if weights.status.last_error or time.monotonic() > deadline:
            raise RuntimeError(f"{weights.model_id}: the synced directory holds v{held.version if held else None}, "
                               f"not v{version}; {weights.status.last_error or 'no error reported'}")
        await asyncio.sleep(0.01)


async def next_version_served(weights: PolicyWeights, trainer: Trainer) -> float:
    """A trainer faster than the pool's round: the next version is published the moment the one before
    is served. Seconds from the next one available at the gateway to the engine serving it."""
    engine = weights.engine
    version, _ = await trainer.publish_new("delta")

    async def publish_when_served() -> float:
        while engine.version != version:
            await asyncio.sleep(0.005)
        await trainer.back_to_old()
        return time.time()

    publishing = asyncio.create_task(publish_when_served())
    await weights.sync_round()
    available = await publishing
    while engine.version == version:
        await weights.sync_round(wait_s=30)
    if weights.status.last_error:
        raise RuntimeError(f"{engine.model_id}: next version: {weights.status.last_error}")
    return weights.status.last_swap_at - available


# -- report --------------------------------------------------------------------------------------------

def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(c: dict, key: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(c[key]) if key in c else "-"

    table = Table(title="version available at the gateway -> engine serving it (median s)")
    for col in ("model", "engine", "model MB", "kind", "payload MB", "in place s", "reload s", "reload / in place",
                "proven: in place s", "reload s", "first token: in place s", "reload s", "round over: in place s", "reload s",
                "next version: in place s", "inside vLLM: in place s", "reload s"):
        table.add_column(col, justify="left" if col in ("model", "engine", "kind") else "right")
    for c in result["cases"]:
        ratio = (f"{c['reload_seconds'] / c['in_place_seconds']:.1f}x"
                 if "reload_seconds" in c and "in_place_seconds" in c else "-")
        table.add_row(c["model"], c.get("engine", "transformers"), f"{c['model_bytes'] / 1e6:.0f}", c["kind"],
                      f"{c['payload_bytes'] / 1e6:.1f}", cell(c, "in_place_seconds"), cell(c, "reload_seconds"), ratio,
                      cell(c, "in_place_proven_seconds"), cell(c, "reload_proven_seconds"),
                      cell(c, "in_place_first_token_seconds"), cell(c, "reload_first_token_seconds"),
                      cell(c, "in_place_round_seconds"), cell(c, "reload_round_seconds"),
                      cell(c, "in_place_next_seconds"), cell(c, "in_place_vllm_seconds"), cell(c, "reload_vllm_seconds"))
    console = Console(width=160)
    console.print(table)
    console.print(f"{result['repeats']} runs per cell; {result['threads']} torch threads; "
                  "the engine generates one token per call throughout.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    for noisy in (("aiohttp.access",) if args.verbose else ("deltamesh", "aiohttp.access")):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    result = {"repeats": args.repeats, "threads": torch.get_num_threads(), "cases": []}
    with tempfile.TemporaryDirectory(prefix="swap-bench-", dir=args.workdir) as tmp:
        root = Path(tmp)
        builders = []
        if not args.no_smollm2:
            builders.append((lambda: smollm2_input(args.lr), args.engines))
        if not args.no_synthetic and "transformers" in args.engines:
            builders.append((lambda: synthetic_input(root, 4 if args.quick else 28), ["transformers"]))
        for i, (build, engines) in enumerate(builders):
            model = build()
            for engine_name in engines:
                workdir = root / f"case{i}-{engine_name}"
                workdir.mkdir()
                result["cases"] += asyncio.run(
                    measure_model(model, args.repeats, workdir, args.kinds, args.ways, engine_name))
                gc.collect()
            del model
            gc.collect()
    emit(result, args, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
