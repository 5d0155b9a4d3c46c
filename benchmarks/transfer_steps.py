"""Successive real training versions of SmolLM2-135M for the real_training transfer scenario.

Version 0 is the pretrained bf16 checkpoint (fp32 master weights on its bf16 grid, as a trainer that
loads a bf16 release starts). Each later version is the bf16 cast of the master weights after one more
step of one `torch.optim.Adam` that keeps its state across steps, on next-token loss over the next
window of real English text (the recipe of benchmarks/inputs.py's one-step deltas, continued for
several steps). Built once and cached beside the other model artifacts, with a JSON of what each
version costs to ship: the fraction of bf16 words changed since the previous version, and the payload
of a full snapshot and of a delta from the previous version as the codec encodes them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from deltamesh.delta import encode_delta, encode_full, generate_key
from deltamesh.mesh.demo.models import (
    RECIPE_VERSION,
    SMOLLM2_NAME,
    build_causal_lm,
    build_once,
    cache_dir,
    english_text,
    load_tokenizer,
    smollm2_config,
    smollm2_state_dict,
    smollm2_tokenizer_dir,
    to_bf16,
    token_batch,
)

log = logging.getLogger(__name__)


def steps_dir(lr: float, steps: int, batch: int = 4, seq_len: int = 256) -> Path:
    """A folder of v00.safetensors .. v{steps}.safetensors and info.json (built on first use)."""
    from safetensors.torch import save_file

    target = cache_dir() / f"{SMOLLM2_NAME}-adam-steps{steps}-b{batch}x{seq_len}-lr{lr:g}-r{RECIPE_VERSION}"

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        master = smollm2_state_dict()
        model = build_causal_lm(smollm2_config(), master)
        model.train()
        params = dict(model.named_parameters())
        names = sorted(master)
        optimizer = torch.optim.Adam([params[name] for name in names], lr=lr)
        tokenizer = load_tokenizer(smollm2_tokenizer_dir())
        text = english_text()
        # Each version goes to disk as it is made: eleven bf16 copies would hold 3 GB at once.
        save_file(to_bf16(master), str(tmp / "v00.safetensors"))
        del master
        for step in range(steps):
            tokens = token_batch(tokenizer, text, batch=batch, seq_len=seq_len, offset=step)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.info("step %d: loss %.3f", step + 1, loss.item())
            weights = to_bf16({name: params[name].detach() for name in names})
            save_file(weights, str(tmp / f"v{step + 1:02d}.safetensors"))
        del model, optimizer, params
        (tmp / "info.json").write_text(json.dumps(version_costs(tmp, steps + 1), indent=1))

    return build_once(target, build)


def version_costs(folder: Path, count: int) -> list[dict]:
    """Per version: changed fraction and delta payload against the previous one, full payload."""
    from safetensors.torch import load_file

    key = generate_key()
    out, old = [], None
    for i in range(count):
        new = load_file(str(folder / f"v{i:02d}.safetensors"))
        full = encode_full(new, model_id="costs", version=i, key=key).manifest.payload_bytes
        item = {"version": i, "full_bytes": full, "delta_bytes": None, "changed_fraction": None}
        if old is not None:
            changed = sum(int((old[k].view(torch.int16) != t.view(torch.int16)).sum()) for k, t in new.items())
            item["changed_fraction"] = changed / sum(t.numel() for t in new.values())
            item["delta_bytes"] = encode_delta(old, new, model_id="costs", version=i, base_version=i - 1,
                                               key=key).manifest.payload_bytes
        out.append(item)
        old = new
    return out


def load_costs(folder: Path) -> list[dict]:
    return json.loads((folder / "info.json").read_text())
