"""Check the SGLang engine adapter against a real SGLang server; prints a table and PASS or FAIL.

Runs as is on a machine with a CUDA GPU and SGLang installed (`pip install deltamesh[sglang]`), from
an installed deltamesh or straight from a source checkout:

    python benchmarks/sglang_check.py [--model-dir HF_DIR] [--json]

It launches `python -m sglang.launch_server` on a model directory (default: a seeded tiny Qwen3
with the character tokenizer, built here without any download), then checks through
`deltamesh.mesh.engines.sglang_engine.SGLangEngine`:

1. generation: tokens, logprobs and versions for a batch of prompts, all tagged v0;
2. logprobs agree with the in-process transformers engine on the same weights (teacher forcing);
3. a swap from disk (pause, `/update_weights_from_disk`, continue) to v1, a directory written the
   way the pool agent writes one (`apply_to_dir` of a signed full snapshot: weights and manifest
   only): outputs change, tokens are tagged v1, and logprobs agree with transformers on v1;
4. an in-place update to v2, a delta changing half the tensors, sent as only those tensors with
   `/update_weights_from_tensor` (CUDA IPC handles): the adapter takes it in place, outputs change,
   tokens are tagged v2, the server reports weight version "2", every tensor read back with
   `/get_weights_by_name` hashes to v2's, and logprobs agree with transformers on v2;
5. a generation straddling an in-place update: its tokens are tagged v2 then v3, in order, none lost;
6. an update from a directory without weights fails cleanly and the server keeps generating.

Figures: server start-up time, the disk swap's time, the median in-place update time (pause to
continue), and decode throughput. Exit status 0 on PASS, 1 on FAIL, 2 when it cannot run (no SGLang
or no GPU). With `--launch-command` another server command can stand in for SGLang (the test
stand-in, with `--no-reference --tensor-device cpu`) to dry-run the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_deltamesh_from_checkout() -> None:
    """Make `import deltamesh.<part>` work from a source checkout that was not pip-installed.

    setup.py maps the top-level folders delta/, gateway/, trainer/ and mesh/ under `deltamesh.`;
    a temporary folder of symlinks lays them out the same way.
    """
    if importlib.util.find_spec("deltamesh") is not None:
        return
    shim = Path(tempfile.mkdtemp(prefix="deltamesh-src-")) / "deltamesh"
    atexit.register(shutil.rmtree, shim.parent, ignore_errors=True)
    shim.mkdir()
    for entry in (ROOT / "deltamesh").iterdir():
        (shim / entry.name).symlink_to(entry)
    for part in ("delta", "gateway", "trainer", "mesh"):
        (shim / part).symlink_to(ROOT / part)
    sys.path.insert(0, str(shim.parent))


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.rows.append({"check": name, "ok": bool(ok), "detail": detail})
        return ok

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r["ok"] for r in self.rows)


def perturbed(weights: dict, scale: float, seed: int, names: list[str] | None = None) -> dict:
    """Weights moved by `scale` times each tensor's standard deviation of noise (outputs change); only
    tensors `names` when given."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        if names is not None and name not in names:
            out[name] = w
            continue
        f = w.float()
        noise = torch.randn(f.shape, generator=g) * (f.std() if f.numel() > 1 else 0.0) * scale
        out[name] = (f + noise).to(w.dtype).contiguous()
    return out


def synced_dir(target: Path, weights: dict, version: int, model_id: str, key) -> Path:
    """A directory as the pool agent keeps it in sync: weights and manifest, written by apply_to_dir."""
    from deltamesh.delta import apply_to_dir, encode_full

    full = encode_full(weights, model_id=model_id, version=version, key=key)
    apply_to_dir(target, [(full.manifest, full.pieces)])
    return target


async def reference_logprobs(base: Path, synced: Path | None, version: int, device: str,
                             prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """Logprobs of `outputs` after `prompts` under the transformers engine started from `base` and
    moved to the weights of `synced` (teacher forcing)."""
    import torch

    from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig

    engine = TransformersEngine(TransformersEngineConfig(model_id="reference", model_dir=str(base), device=device))
    if synced is not None:
        await engine.load_version(synced, version)
    result = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + out], device=device)
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), dim=-1)
            picked = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(out, device=device)[:, None]).squeeze(-1)
            result.append(picked.cpu().tolist())
    await engine.close()
    return result


def compare(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return (statistics.fmean(diffs), max(diffs)) if diffs else (float("nan"), float("nan"))


async def run_checks(args: argparse.Namespace, work: Path, checks: Checks, figures: dict) -> None:
    from deltamesh.delta import decode_version, encode_delta, generate_key, read_weights, tensor_digest
    from deltamesh.mesh.demo.models import TinyModelConfig, tiny_model_dir
    from deltamesh.mesh.demo.processes import free_port
    from deltamesh.mesh.engines.base import EngineError, SamplingParams
    from deltamesh.mesh.engines.sglang_engine import SGLangEngine, SGLangEngineConfig

    model_id = "sglang-check"
    key = generate_key()
    if args.model_dir:
        base = Path(args.model_dir)
    else:
        # head_dim 64 and a hidden size of 256: shapes that SGLang's attention kernels support.
        base = tiny_model_dir(TinyModelConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=64, seed=0), path=work / "base")
    # The server starts from the model directory (v0); later versions come from directories written
    # the way the pool agent writes its synced directory.
    v0_weights = read_weights(base)
    v1_weights = perturbed(v0_weights, 0.5, seed=1)
    v1 = synced_dir(work / "v1", v1_weights, 1, model_id, key)
    # v2 and v3 change half the tensors each: in-place updates send only those.
    names = sorted(v0_weights)
    v2_weights = perturbed(v1_weights, 0.5, seed=2, names=names[::2])
    v3_weights = perturbed(v2_weights, 0.5, seed=3, names=names[1::2])
    v2 = synced_dir(work / "v2", v2_weights, 2, model_id, key)

    def delta(old: dict, new: dict, version: int):
        encoded = encode_delta(old, new, model_id=model_id, version=version, base_version=version - 1, key=key)
        return decode_version(encoded.manifest, encoded.pieces)

    launch = shlex.split(args.launch_command) if args.launch_command else [sys.executable, "-m", "sglang.launch_server"]
    extra = shlex.split(args.server_args)
    config = SGLangEngineConfig(
        model_id=model_id, model_path=str(base), port=free_port(), launch_command=launch, extra_args=extra,
        log_path=str(work / "server.log"), startup_timeout_s=args.startup_timeout_s, tensor_device=args.tensor_device,
    )
    started = time.perf_counter()
    try:
        engine = await SGLangEngine.open(config)
    except EngineError as e:
        checks.add("server starts and is healthy", False, f"{e} (log: {work / 'server.log'})")
        return
    figures["startup_s"] = round(time.perf_counter() - started, 2)
    checks.add("server starts and is healthy", True, f"{figures['startup_s']} s, v{engine.version}, "
               f"{'in-place updates' if engine.supports_in_place else 'disk reloads only'}")
    swaps: list[float] = []
    try:
        prompts = [engine.encode(t) for t in ("1+2=", "The capital of France is", "def f(x):", "abc")]
        greedy = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)

        async def check_reference(synced: Path | None, version: int, generated: list) -> None:
            """The engine's logprobs of `generated` (at `version`) beside transformers' own, unless skipped."""
            if args.no_reference:
                return
            ref = await reference_logprobs(base, synced, version, args.device, prompts, [g.tokens for g in generated])
            mean, worst = compare([g.logprobs for g in generated], ref)
            figures[f"logprob_mean_abs_diff_v{version}"] = round(mean, 4)
            checks.add(f"logprobs agree with transformers (v{version})", mean < args.logprob_tolerance,
                       f"mean |diff| {mean:.4f}, max {worst:.4f}")

        t0 = time.perf_counter()
        before = await engine.generate(prompts, greedy)
        figures["decode_tokens_per_s"] = round(sum(len(g.tokens) for g in before) / (time.perf_counter() - t0), 1)
        ok = all(len(g.tokens) == len(g.logprobs) == 32 and set(g.versions) == {0} and max(g.logprobs) <= 1e-6
                 for g in before)
        checks.add("generate: tokens, logprobs, versions", ok,
                   f"{len(prompts)} prompts x 32 tokens, versions {sorted({v for g in before for v in g.versions})}")
        await check_reference(None, 0, before)

        t0 = time.perf_counter()
        await engine.load_version(v1, 1)
        swaps.append(time.perf_counter() - t0)
        after = await engine.generate(prompts, greedy)
        changed = sum(a.tokens != b.tokens for a, b in zip(after, before))
        ok = engine.version == 1 and all(set(g.versions) == {1} for g in after) and changed > 0
        checks.add("swap from disk to v1", ok, f"{swaps[-1]:.2f} s; {changed}/{len(prompts)} outputs changed")
        await check_reference(v1, 1, after)

        figures["disk_swap_s"] = round(swaps.pop(), 3)

        if not checks.add("in-place updates available", engine.supports_in_place,
                          "the server takes /update_weights_from_tensor" if engine.supports_in_place
                          else "no /update_weights_from_tensor, or no CUDA here: see the log"):
            return
        t0 = time.perf_counter()
        await engine.apply_update(delta(v1_weights, v2_weights, 2))
        swaps.append(time.perf_counter() - t0)
        at_v2 = await engine.generate(prompts, greedy)
        changed = sum(a.tokens != b.tokens for a, b in zip(at_v2, after))
        label = await engine.weight_version()
        ok = engine.version == 2 and all(set(g.versions) == {2} for g in at_v2) and changed > 0 and label == "2"
        checks.add("in-place update of the changed tensors to v2", ok,
                   f"{len(names[::2])}/{len(names)} tensors sent, {swaps[-1]:.2f} s; {changed}/{len(prompts)} "
                   f"outputs changed; server weight version {label!r}")
        served = await engine.served_digests(names)
        read = {n: d for n, d in served.digests.items() if d is not None}
        ok = bool(read) and all(d == tensor_digest(v2_weights[n]) for n, d in read.items())
        checks.add("weights read back are v2's", ok, f"{len(read)}/{len(names)} tensors read back and hashed")
        await check_reference(v2, 2, at_v2)

        long = SamplingParams(max_new_tokens=args.straddle_tokens, temperature=1.0, ignore_eos=True)
        update = delta(v2_weights, v3_weights, 3)

        async def swap_later() -> None:
            await asyncio.sleep(args.straddle_delay_s)
            t = time.perf_counter()
            await engine.apply_update(update)
            swaps.append(time.perf_counter() - t)

        (gen,), _ = await asyncio.gather(engine.generate([prompts[1]], long), swap_later())
        n = args.straddle_tokens
        switch = gen.versions.index(3) if 3 in gen.versions else -1
        ok = len(gen.tokens) == n and 0 < switch < n and gen.versions == [2] * switch + [3] * (n - switch)
        checks.add("generation straddling an in-place update", ok, f"{n} tokens: v2 for {max(switch, 0)}, then v3")

        try:
            await engine.load_version(work / "missing", 4)
            checks.add("failed update is reported, server continues", False, "no error")
        except EngineError as e:
            (g,) = await engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))
            ok = engine.version == 3 and g.versions == [3] * 4
            checks.add("failed update is reported, server continues", ok, f"{str(e)[:70]}...")
    finally:
        await engine.close()
        if swaps:
            figures["in_place_update_s_median"] = round(statistics.median(swaps), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a local Hugging Face model directory (default: a tiny Qwen3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--device", default="cuda", help="device of the transformers reference (default cuda)")
    parser.add_argument("--server-args", default="--mem-fraction-static 0.3 --disable-cuda-graph",
                        help="extra sglang.launch_server flags")
    parser.add_argument("--launch-command", help="server command instead of `python -m sglang.launch_server`")
    parser.add_argument("--no-reference", action="store_true", help="skip the transformers logprob comparison")
    parser.add_argument("--tensor-device", default="cuda",
                        help="where in-place updates put the tensors the server maps (default cuda; cpu for the stand-in)")
    parser.add_argument("--logprob-tolerance", type=float, default=0.1)
    parser.add_argument("--straddle-tokens", type=int, default=400)
    parser.add_argument("--straddle-delay-s", type=float, default=0.3)
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    args = parser.parse_args()

    import_deltamesh_from_checkout()
    reason = None
    if not args.launch_command and importlib.util.find_spec("sglang") is None:
        reason = "SGLang is not installed (pip install deltamesh[sglang])"
    elif not args.no_reference and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            reason = "no CUDA device"
    checks, figures = Checks(), {}
    if reason is None:
        work = Path(tempfile.mkdtemp(prefix="sglang-check-"))
        try:
            asyncio.run(run_checks(args, work, checks, figures))
        finally:
            if checks.passed:
                shutil.rmtree(work, ignore_errors=True)
            else:
                figures["kept_for_inspection"] = str(work)
    verdict = "SKIP" if reason else ("PASS" if checks.passed else "FAIL")
    report(args, verdict, reason, checks, figures)
    return {"PASS": 0, "FAIL": 1, "SKIP": 2}[verdict]


def report(args: argparse.Namespace, verdict: str, reason: str | None, checks: Checks, figures: dict) -> None:
    if args.json:
        print(json.dumps({"benchmark": "sglang_check", "result": verdict, "reason": reason,
                          "checks": checks.rows, "figures": figures}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SGLang engine adapter against a real SGLang server")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for row in checks.rows:
        table.add_row(row["check"], "ok" if row["ok"] else "FAILED", row["detail"])
    for name, value in figures.items():
        table.add_row(name, "", str(value))
    console = Console()
    if checks.rows:
        console.print(table)
    console.print(f"{verdict}{': ' + reason if reason else ''}", markup=False)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
