"""The in-process transformers engine: batched decoding, logprobs, and hot weight swaps in place.

Updates reach the engine decoded once (`decode_version`), as the pool hands them over; the applier
itself (rollback, torch and numpy paths) is tested in tests/delta/test_hot_swap.py.

Tiny random-init models (character tokenizer, bf16 on the CPU) keep every test well under a second.
A "next version" (`rl_step`, from tests/conftest.py) is the current bf16 weights with ~2% of words
moved by one or two ulps, the way one RL optimizer step moves them.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import pytest
import torch

from deltamesh.delta import (
    BaseMismatchError,
    CodecError,
    apply_to_dir,
    decode_version,
    dir_manifest,
    encode_delta,
    encode_full,
    generate_key,
    live_tensors,
    read_weights,
    tensor_digests,
    write_weights,
)
from deltamesh.mesh.demo.models import TinyModelConfig, tiny_model_dir
from deltamesh.mesh.engines.base import Engine, SamplingParams
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig

MODEL = "tiny"
KEY = generate_key()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(TinyModelConfig(seed=21), path=tmp_path_factory.mktemp("engine") / "v0")


def version_dir(base_dir: Path, target: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A model directory like `base_dir` (config, tokenizer) holding `weights`."""
    shutil.copytree(base_dir, target, ignore=shutil.ignore_patterns("*.safetensors*"))
    write_weights(target, weights)
    return target


def engine_at(path: Path, **kw) -> TransformersEngine:
    return TransformersEngine(TransformersEngineConfig(model_id=MODEL, model_dir=str(path), **kw))


def snapshot(engine: TransformersEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in live_tensors(engine.model).items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(
            a[name].contiguous().view(-1).view(torch.int16), b[name].contiguous().view(-1).view(torch.int16)
        ), name


def test_batched_greedy_matches_transformers_generate(base_dir):
    engine = engine_at(base_dir)
    assert isinstance(engine, Engine) and engine.supports_in_place and engine.version == 0
    prompts = [engine.encode("1+2="), engine.encode("a much longer prompt: 3+4=")]
    gens = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))
    for prompt, gen in zip(prompts, gens):
        with torch.inference_mode():
            ref = engine.model.generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
            )
        assert gen.tokens == ref[0, len(prompt):].tolist()
        assert gen.versions == [0] * 12 and gen.finish_reason == "length" and gen.prompt == prompt


def test_logprobs_are_the_temperature_scaled_model_logprobs(base_dir):
    engine = engine_at(base_dir)
    prompt = engine.encode("x=")
    params = SamplingParams(max_new_tokens=10, temperature=0.7, seed=1, ignore_eos=True)
    (gen,) = asyncio.run(engine.generate([prompt], params))
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([prompt + gen.tokens])).logits[0].float()
    expected = torch.log_softmax(logits / 0.7, dim=-1)[len(prompt) - 1:-1].gather(-1, torch.tensor(gen.tokens)[:, None])
    assert torch.allclose(torch.tensor(gen.logprobs), expected.squeeze(-1), atol=0.05)


def test_seeded_sampling_repeats_and_stop_tokens_end_generation(base_dir):
    engine = engine_at(base_dir)
    prompts = [engine.encode("abc")] * 3
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=4)
    a = asyncio.run(engine.generate(prompts, params))
    b = asyncio.run(engine.generate(prompts, params))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    first = a[0].tokens[0]
    (stopped,) = asyncio.run(engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9,
                                                                           top_k=20, seed=4, stop_token_ids=(first,))))
    assert stopped.tokens == [first] and stopped.finish_reason == "stop"


def test_in_place_delta_is_bit_identical_to_loading_the_new_version(base_dir, tmp_path, rl_step):
    v0 = read_weights(base_dir)
    v1 = rl_step(v0, seed=1)
    engine = engine_at(base_dir)
    enc = encode_delta(v0, v1, model_id=MODEL, version=1, base_version=0, key=KEY, piece_bytes=512)
    assert len(enc.pieces) > 1
    asyncio.run(engine.apply_update(decode_version(enc.manifest, enc.pieces)))
    assert engine.version == 1 and engine.weights_hash == enc.manifest.weights_hash

    from_disk = engine_at(version_dir(base_dir, tmp_path / "v1", v1), version=1)
    assert_bit_identical(live_tensors(engine.model), live_tensors(from_disk.model))
    # And they compute the same thing.
    prompt = [engine.encode("9+9=")]
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    swapped, loaded = asyncio.run(engine.generate(prompt, greedy)), asyncio.run(from_disk.generate(prompt, greedy))
    assert swapped[0].tokens == loaded[0].tokens and swapped[0].versions == [1] * 6


def test_swap_lands_between_decode_steps_and_tags_tokens(base_dir, rl_step):
    v0 = read_weights(base_dir)
    v1 = rl_step(v0, seed=2, share=0.3)
    enc = encode_delta(v0, v1, model_id=MODEL, version=1, base_version=0, key=KEY)
    reference = engine_at(base_dir)
    engine = engine_at(base_dir)
    prompt = engine.encode("straddle: ")
    params = SamplingParams(max_new_tokens=150, temperature=0, ignore_eos=True)

    async def main():
        task = asyncio.create_task(engine.generate([prompt], params))
        await asyncio.sleep(0)  # the generation holds the step lock now; the update queues behind it
        await engine.apply_update(decode_version(enc.manifest, enc.pieces))
        return (await task)[0]

    gen = asyncio.run(main())
    (old_only,) = asyncio.run(reference.generate([prompt], params))
    switch = gen.versions.index(1)
    assert 0 < switch < 150 and gen.versions == [0] * switch + [1] * (150 - switch)
    assert gen.tokens[:switch] == old_only.tokens[:switch]  # tokens before the swap came from v0
    straddled = engine.metrics.registry.get_sample_value(
        "deltamesh_engine_straddling_generations_total", {"model": MODEL, "engine": "transformers"})
    assert straddled == 1


def test_chunked_prefill_decodes_as_one_pass_does(base_dir):
    whole, chunked = engine_at(base_dir, prefill_chunk_tokens=0), engine_at(base_dir, prefill_chunk_tokens=3)
    prompts = [whole.encode("1+2="), whole.encode("a much longer prompt, padded the least: 3+4="),
               whole.encode("a middle one: 5+6=")]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    a, b = asyncio.run(whole.generate(prompts, params)), asyncio.run(chunked.generate(prompts, params))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=0.05)


@pytest.mark.parametrize("chunk_tokens, first_token_version", [(0, 0), (4, 1)])
def test_an_update_lands_between_prefill_passes(base_dir, rl_step, chunk_tokens, first_token_version):
    """Unchunked, an update waits for the whole prompt's pass and the first token is still the old
    version's; chunked, it lands between two passes and the first token is already the new one's."""
    v0 = read_weights(base_dir)
    enc = encode_delta(v0, rl_step(v0, seed=5), model_id=MODEL, version=1, base_version=0, key=KEY)
    engine = engine_at(base_dir, prefill_chunk_tokens=chunk_tokens)
    prompt = engine.encode("a prompt long enough for several prefill passes: " * 2)

    async def main():
        task = asyncio.create_task(engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)))
        await asyncio.sleep(0)  # the generation holds the lock for its first pass; the update queues behind it
        await engine.apply_update(decode_version(enc.manifest, enc.pieces))
        return (await task)[0]

    gen = asyncio.run(main())
    assert gen.versions[0] == first_token_version and engine.version == 1
    straddled = engine.metrics.registry.get_sample_value(
        "deltamesh_engine_straddling_generations_total", {"model": MODEL, "engine": "transformers"})
    assert straddled == 1


def test_a_negative_prefill_chunk_is_refused(base_dir):
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        TransformersEngineConfig(model_id=MODEL, model_dir=str(base_dir), prefill_chunk_tokens=-1)


def test_read_back_goes_beside_a_decode_step_and_waits_for_an_update(base_dir, rl_step):
    """The pool's check reads the weights while a decode step runs (both only read them), but never
    while an update writes them: it then reports the version the update left."""
    v0 = read_weights(base_dir)
    enc = encode_delta(v0, rl_step(v0, seed=4), model_id=MODEL, version=1, base_version=0, key=KEY)
    engine = engine_at(base_dir)
    names = [e.name for e in enc.manifest.tensors]
    in_step, release = threading.Event(), threading.Event()

    def hold_first_step(module, args):
        in_step.set()
        release.wait(30)

    hook = engine.model.register_forward_pre_hook(hold_first_step)
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        generating = asyncio.create_task(engine.generate([engine.encode("1+1=")], params))
        await asyncio.to_thread(in_step.wait, 30)
        before = await asyncio.wait_for(engine.served_digests(names), 30)  # the step is still held
        update = asyncio.create_task(engine.apply_update(decode_version(enc.manifest, enc.pieces)))
        await asyncio.sleep(0.2)
        reading = asyncio.create_task(engine.served_digests(names))
        await asyncio.sleep(0.2)
        waiting = (update.done(), reading.done())
        release.set()
        await update
        return before, waiting, await reading, await generating

    try:
        before, waiting, after, _ = asyncio.run(main())
    finally:
        release.set()
        hook.remove()
    assert before.version == 0 and before.digests == tensor_digests({name: v0[name] for name in names})
    assert waiting == (False, False)  # the update waits for the step, the read-back for the update
    assert after.version == 1 and after.digests == {e.name: e.hash for e in enc.manifest.tensors}


def test_chain_of_deltas_then_full_snapshot(base_dir, rl_step):
    engine = engine_at(base_dir)
    weights = read_weights(base_dir)
    for v in (1, 2, 3):
        new = rl_step(weights, seed=10 + v)
        enc = encode_delta(weights, new, model_id=MODEL, version=v, base_version=v - 1, key=KEY)
        asyncio.run(engine.apply_update(decode_version(enc.manifest, enc.pieces)))
        weights = new
    assert engine.version == 3
    assert_bit_identical({k: v for k, v in live_tensors(engine.model).items() if k in weights}, weights)
    fresh = rl_step(weights, seed=99, share=0.5)
    full = encode_full(fresh, model_id=MODEL, version=10, key=KEY)
    asyncio.run(engine.apply_update(decode_version(full.manifest, full.pieces)))
    assert engine.version == 10 and engine.weights_hash == full.manifest.weights_hash
    assert_bit_identical({k: v for k, v in live_tensors(engine.model).items() if k in fresh}, fresh)


def test_corrupt_piece_changes_nothing(base_dir, rl_step):
    engine = engine_at(base_dir)
    before = snapshot(engine)
    v0 = read_weights(base_dir)
    enc = encode_delta(v0, rl_step(v0, seed=3), model_id=MODEL, version=1, base_version=0, key=KEY, piece_bytes=512)
    pieces = list(enc.pieces)
    pieces[-1] = pieces[-1][:-1] + bytes([pieces[-1][-1] ^ 1])
    with pytest.raises(CodecError):
        asyncio.run(engine.apply_update(decode_version(enc.manifest, pieces)))
    with pytest.raises(CodecError):
        asyncio.run(engine.apply_update(decode_version(enc.manifest, enc.pieces[:-1])))
    assert engine.version == 0
    assert_bit_identical(snapshot(engine), before)


def test_delta_for_another_base_or_model_is_refused(base_dir, rl_step):
    engine = engine_at(base_dir)
    before = snapshot(engine)
    v0 = read_weights(base_dir)
    v1, v2 = rl_step(v0, seed=4), rl_step(rl_step(v0, seed=4), seed=5)
    skip = encode_delta(v1, v2, model_id=MODEL, version=2, base_version=1, key=KEY)
    with pytest.raises(BaseMismatchError, match="from v1"):
        asyncio.run(engine.apply_update(decode_version(skip.manifest, skip.pieces)))
    other = encode_delta(v0, v1, model_id="other", version=1, base_version=0, key=KEY)
    with pytest.raises(BaseMismatchError, match="other"):
        asyncio.run(engine.apply_update(decode_version(other.manifest, other.pieces)))
    assert engine.version == 0
    assert_bit_identical(snapshot(engine), before)


def test_delta_for_other_weights_of_the_same_version_is_refused(base_dir, rl_step):
    """Same version number, other weights: the base hash (computed from the live model) differs."""
    engine = engine_at(base_dir)
    assert engine.weights_hash is None  # its directory has no manifest
    before = snapshot(engine)
    stranger = rl_step(read_weights(base_dir), seed=6)  # a different "v0"
    enc = encode_delta(stranger, rl_step(stranger, seed=7), model_id=MODEL, version=1, base_version=0, key=KEY)
    with pytest.raises(BaseMismatchError, match="base v0"):
        asyncio.run(engine.apply_update(decode_version(enc.manifest, enc.pieces)))
    assert engine.version == 0
    assert_bit_identical(snapshot(engine), before)
    (gen,) = asyncio.run(engine.generate([engine.encode("ok")], SamplingParams(max_new_tokens=2)))
    assert gen.versions == [0, 0]


def test_failed_result_hash_leaves_the_engine_serving_the_old_weights(base_dir, rl_step):
    """Below the base check: a delta written onto other weights fails its result hashes; the engine
    restores every written word and keeps serving its version."""
    engine = engine_at(base_dir)
    before = snapshot(engine)
    stranger = rl_step(read_weights(base_dir), seed=6)
    enc = encode_delta(stranger, rl_step(stranger, seed=7), model_id=MODEL, version=1, base_version=0, key=KEY,
                       piece_bytes=512)
    engine._weights_hash = enc.manifest.base_hash  # the engine believes it serves the stranger's v0
    with pytest.raises(CodecError, match="does not match the manifest's hash"):
        asyncio.run(engine.apply_update(decode_version(enc.manifest, enc.pieces)))
    assert engine.version == 0
    assert_bit_identical(snapshot(engine), before)


def test_load_version_from_a_synced_directory(base_dir, tmp_path, rl_step):
    v0 = read_weights(base_dir)
    v5 = rl_step(v0, seed=8)
    synced = tmp_path / "synced"
    full = encode_full(v5, model_id=MODEL, version=5, key=KEY)
    apply_to_dir(synced, [(full.manifest, full.pieces)])
    assert dir_manifest(synced).version == 5
    engine = engine_at(base_dir)
    asyncio.run(engine.load_version(synced, 5))
    assert engine.version == 5 and engine.weights_hash == full.manifest.weights_hash
    assert_bit_identical({k: v for k, v in live_tensors(engine.model).items() if k in v5}, v5)
    # The directory says v5: asking for another version is refused and changes nothing.
    with pytest.raises(BaseMismatchError):
        asyncio.run(engine.load_version(synced, 6))
    with pytest.raises(Exception, match="not a model directory"):
        asyncio.run(engine.load_version(tmp_path / "absent", 7))
    assert engine.version == 5
