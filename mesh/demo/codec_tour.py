"""The codec tour (`deltamesh demo --codec-tour`): the bf16 delta codec on real pretrained weights.

The tour takes SmolLM2-135M-Instruct's weights as a trainer's fp32 master weights, makes one real
Adam step on next-token loss over English text, publishes the step as a signed delta, and shows what
it costs against a full snapshot and raw bf16; then it verifies and applies the delta, checks the
result bit for bit, and shows that a tampered piece is refused without touching the weights. The
first run fills the model cache (~30 s); later runs take well under a minute on two cores.

Its sizes are kept (`saved_figure`), so that the demo's closing table can set the real model's delta
beside the toy model's (`real_step_figure`); before any tour has run on this machine that table
shows `RECORDED`, the same step measured by benchmarks/codec.py (BENCHMARKS.md, Codec).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from deltamesh.cache import cache_dir

RECORDED = {"lr": 5e-6, "delta_bytes": 810_993, "full_bytes": 182_547_141, "raw_bytes": 269_060_520,
            "source": "benchmarks/codec.py on 2026-12-04 (BENCHMARKS.md)"}
"""SmolLM2-135M-Instruct, the first Adam step at lr 5e-6: deltamesh's delta, its full snapshot, raw bf16."""


def saved_figure() -> Path:
    return cache_dir("demo", "codec_tour.json")


def real_step_figure() -> dict[str, Any]:
    """The real model's delta against its full snapshot: this machine's last codec tour, else RECORDED."""
    try:
        facts = json.loads(saved_figure().read_text())
        return {k: facts[k] for k in ("lr", "delta_bytes", "full_bytes", "raw_bytes", "source")}
    except (OSError, ValueError, KeyError, TypeError):
        return dict(RECORDED)


def codec_tour(console, *, lr: float = 5e-6, batch: int = 2, seq_len: int = 128) -> dict[str, Any]:
    """Run the tour, printing as it goes; returns the measured facts (sizes in bytes, times in s)."""
    import torch
    from rich.table import Table

    from deltamesh.delta import CodecError, apply, encode_delta, encode_full, generate_key, load_manifest
    from deltamesh.mesh.demo import models

    facts: dict[str, Any] = {"lr": lr}
    with console.status("loading SmolLM2-135M-Instruct (fills the cache on the first run)"):
        with timed(facts, "load_s"):
            master = models.smollm2_state_dict()
            config = models.smollm2_config()
            tokenizer = models.load_tokenizer(models.smollm2_tokenizer_dir())
    old = models.to_bf16(master)
    raw = sum(t.numel() * t.element_size() for t in old.values())
    console.print(f"[bold]SmolLM2-135M-Instruct[/]: {len(old)} tensors, {raw / 1e6:.1f} MB in bf16 (real pretrained weights)")

    with console.status(f"one Adam step, lr {lr:g}, on {batch}x{seq_len} tokens of English text"):
        with timed(facts, "train_step_s"):
            # Offset 8 windows: a different slice of text from the one the codec benchmark uses.
            tokens = models.token_batch(tokenizer, models.english_text(), batch=batch, seq_len=seq_len, offset=8)
            grads = models.lm_gradients(config, master, tokens)
            new = models.to_bf16(models.adam_step(master, grads, lr))
    del grads, master
    changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in old)
    total = sum(t.numel() for t in old.values())
    facts.update(raw_bytes=raw, changed_words=changed, changed_fraction=changed / total)
    console.print(f"one real step changed {changed:,} of {total:,} bf16 words ({100 * changed / total:.2f}%)")

    key = generate_key()
    with console.status("encoding the delta and a full snapshot"):
        with timed(facts, "encode_delta_s"):
            delta = encode_delta(old, new, model_id="smollm2-135m-instruct", version=1, base_version=0, key=key)
        with timed(facts, "encode_full_s"):
            full = encode_full(new, model_id="smollm2-135m-instruct", version=1, key=key)
    facts["delta_bytes"] = len(delta.manifest_bytes) + sum(len(p) for p in delta.pieces)
    facts["full_bytes"] = len(full.manifest_bytes) + sum(len(p) for p in full.pieces)
    del full

    with console.status("verifying the signature, every piece and every result tensor; applying"):
        with timed(facts, "apply_s"):
            manifest = load_manifest(delta.manifest_bytes, [key.public_key()])
            result = apply(old, manifest, delta.pieces)
    facts["exact"] = result.keys() == new.keys() and all(
        torch.equal(result[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    del result

    tampered = list(delta.pieces)
    damaged = bytearray(tampered[0])
    damaged[len(damaged) // 2] ^= 0x01
    tampered[0] = bytes(damaged)
    before = {k: v.clone() for k, v in old.items()}
    try:
        apply(old, manifest, tampered)
        facts["tamper_refused"] = False
    except CodecError as e:
        facts["tamper_refused"] = all(torch.equal(before[k], old[k]) for k in old)
        facts["tamper_error"] = str(e)

    table = Table(title=f"codec tour: SmolLM2-135M, one Adam step at lr {lr:g}")
    for col in ("what", "bytes", "x smaller", "bytes/changed word", "encode", "apply"):
        table.add_column(col, justify="left" if col == "what" else "right")
    table.add_row("raw bf16", f"{raw:,}", "1.0", f"{raw / changed:.1f}", "", "")
    table.add_row("full snapshot", f"{facts['full_bytes']:,}", f"{raw / facts['full_bytes']:.2f}",
                  f"{facts['full_bytes'] / changed:.1f}", f"{facts['encode_full_s']:.2f} s", "")
    table.add_row("delta", f"{facts['delta_bytes']:,}", f"{raw / facts['delta_bytes']:.1f}",
                  f"{facts['delta_bytes'] / changed:.2f}", f"{facts['encode_delta_s']:.2f} s", f"{facts['apply_s']:.2f} s")
    console.print(table)
    pieces = f"{len(delta.pieces)} piece" + ("s" if len(delta.pieces) != 1 else "")
    console.print(f"delta: signed manifest + {pieces}; applied weights bit-exact: "
                  f"{'[green]yes[/]' if facts['exact'] else '[red]NO[/]'} (apply includes signature, "
                  f"piece and result-hash checks)")
    console.print(f"one flipped bit in piece 0: {'[green]refused, weights untouched[/]' if facts['tamper_refused'] else '[red]NOT refused[/]'}"
                  + (f" ({facts['tamper_error']})" if "tamper_error" in facts else ""))
    console.print(f"times: load {facts['load_s']:.1f} s, training step {facts['train_step_s']:.1f} s")
    if facts["exact"]:
        saved = saved_figure()
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps({**{k: facts[k] for k in ("lr", "delta_bytes", "full_bytes", "raw_bytes")},
                                     "source": f"the codec tour on this machine, {time.strftime('%Y-%m-%d')}"}))
    return facts


@contextmanager
def timed(facts: dict[str, Any], name: str) -> Iterator[None]:
    """Store the block's wall time in seconds under facts[name]."""
    start = time.perf_counter()
    yield
    facts[name] = time.perf_counter() - start
