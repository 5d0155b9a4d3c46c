"""Prompts through a model's chat template when the engine is wrapped by the pool's batching layer:
the workflows read the tokenizer through the Engine interface, so a wrapped engine keeps its chat
template (a real Hugging Face tokenizer here, the demo's character tokenizer given a template)."""

from __future__ import annotations

from typing import Sequence

import pytest

from deltamesh.mesh.demo.models import char_tokenizer_dir
from deltamesh.mesh.pool.batching import BatchingEngine
from deltamesh.mesh.workflows.base import WorkflowError, encode_prompt, uses_chat
from deltamesh.trainer.models import load_tokenizer

TEMPLATE = "{% for m in messages %}U:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"


class TokenizerEngine:
    """The tokenizing half of an engine over a real tokenizer (generation is not needed here)."""

    supports_in_place = False
    eos_token_ids = ()
    version = 0

    def __init__(self, tokenizer) -> None:
        self.model_id, self.tokenizer = "policy", tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))


def test_a_wrapped_engine_keeps_its_chat_template():
    tokenizer = load_tokenizer(char_tokenizer_dir())
    tokenizer.chat_template = TEMPLATE
    engine = BatchingEngine(TokenizerEngine(tokenizer))
    assert uses_chat(engine, "chat") and uses_chat(engine, "auto")
    assert engine.decode(encode_prompt(engine, "2+2?", True, "The answer")) == "U:2+2?\nA:The answer"


def test_chat_without_a_template_is_refused_and_auto_falls_back_to_plain_text():
    engine = BatchingEngine(TokenizerEngine(load_tokenizer(char_tokenizer_dir())))
    assert not uses_chat(engine, "auto")
    with pytest.raises(WorkflowError, match="has no chat template"):
        uses_chat(engine, "chat")
    assert engine.decode(encode_prompt(engine, "2+2?", False, " =")) == "2+2? ="
