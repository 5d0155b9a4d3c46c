"""The code workflows' default prompts, one set per prompt format (`base.PromptFormat`).

"completion" prompts are text a model continues (HumanEval's convention: the function's signature and
docstring, the completion is its body); anything else shown to it (an earlier program, test failures)
is a Python comment, so the prompt stays a Python file. "chat" prompts are one user turn for an
instruct model: a short instruction, the function in a ```python block, and the request to reply with
one ```python block, which `code_reward.program_from_completion` reads back (an instruct model asked
to continue a bare signature mostly writes prose about it); `CodePrompter` opens that block itself
and stops the reply where it closes. A template a workflow's options set
explicitly is used in either format as it is.

Placeholders: `{prompt}` (the signature and docstring), `{entry_point}`, and per template `{a}`/`{b}`
(the Selector's candidates), `{program}`/`{feedback}` (the Solver's retry).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from deltamesh.mesh.engines.base import Engine, SamplingParams
from deltamesh.mesh.workflows.base import encode_prompt, render, token_ids_containing, uses_chat

REPLY_PREFIX = "```python\n"
"""How a code-writing role's chat reply starts (see `CodePrompter`)."""
TESTGEN_PREFIX = REPLY_PREFIX + "assert {entry_point}("
"""How the Test-Case Generator's chat reply starts: inside the block, its first assert begun (a small
instruct model asked for tests mostly writes the function again)."""
_REPLY = "Reply with the whole function in one ```python code block."

COMPLETION: dict[str, str] = {
    "solver": "{prompt}",
    "selector": "Which program implements the function correctly?\n{prompt}\n### A\n{a}\n### B\n{b}\n"
                "Reply A or B.\nChoice:",
    "testgen": "{prompt}\n# Tests of {entry_point}, one assert per line:\n",
    "retry": "# A previous attempt:\n{program}\n# failed these tests:\n{feedback}\n\n{prompt}",
}
CHAT: dict[str, str] = {
    "solver": f"Complete this Python function. {_REPLY}\n\n```python\n{{prompt}}```",
    "selector": "Which of the two programs implements this Python function correctly?\n\n```python\n{prompt}```\n\n"
                "Program A:\n```python\n{a}```\n\nProgram B:\n```python\n{b}```\n\nReply with one letter: A or B.",
    "testgen": "Write assert statements that test the Python function `{entry_point}` below, one assert per "
               "line, in one ```python code block.\n\n```python\n{prompt}```",
    "retry": f"This attempt at a Python function failed some tests.\n\n```python\n{{program}}```\n\n"
             f"The failed tests:\n```\n{{feedback}}\n```\n\nWrite a corrected version of the function. {_REPLY}\n\n"
             "The function:\n```python\n{prompt}```",
}


def check_template(name: str, template: str | None, *placeholders: str) -> None:
    """ValueError unless an explicitly set template has every placeholder (None: the format's default)."""
    if template is None:
        return
    for p in ("prompt", *placeholders):
        if "{" + p + "}" not in template:
            raise ValueError(f"{name} must contain {{{p}}}")


def _comment(text: str) -> str:
    return "\n".join("# " + line for line in text.splitlines())


class CodePrompter:
    """Renders and encodes one role's prompts for one engine in the configured prompt format.

    In chat format a role that writes code (solver, retry, testgen) has its reply opened with
    "```python\n" (`REPLY_PREFIX`, appended after the chat template's generation prompt; the
    Test-Case Generator's with its first assert begun, `TESTGEN_PREFIX`) and stops at
    the first token holding the closing fence: the model writes the code block and nothing after it
    (an instruct model otherwise goes on explaining its code until `max_new_tokens`), and `reply`
    puts the opening fence back in front of the decoded tokens."""

    def __init__(self, engine: Engine, prompt_format: str):
        self.engine = engine
        self.chat = uses_chat(engine, prompt_format)
        self._fence_ids: tuple[int, ...] | None = None

    def opens_block(self, kind: str) -> bool:
        return self.chat and kind != "selector"

    def prefix(self, kind: str, entry_point: str = "") -> str:
        """The start of the reply that the prompt already holds."""
        if not self.opens_block(kind):
            return ""
        return render(TESTGEN_PREFIX, entry_point=entry_point) if kind == "testgen" else REPLY_PREFIX

    def template(self, kind: str, explicit: str | None) -> str:
        return explicit if explicit is not None else (CHAT if self.chat else COMPLETION)[kind]

    def text(self, kind: str, explicit: str | None, **values: str) -> str:
        """The prompt's text; in completion format a `program` and `feedback` are shown as comments."""
        if not self.chat:
            values = {k: _comment(v) if k in ("program", "feedback") else v for k, v in values.items()}
        return render(self.template(kind, explicit), **values)

    def encode(self, kind: str, explicit: str | None, **values: str) -> list[int]:
        return encode_prompt(self.engine, self.text(kind, explicit, **values), self.chat,
                             self.prefix(kind, values.get("entry_point", "")))

    def params(self, kind: str, params: SamplingParams) -> SamplingParams:
        """`params`, stopping also at a closing fence where the reply was opened with one."""
        if not self.opens_block(kind):
            return params
        if self._fence_ids is None:
            self._fence_ids = token_ids_containing(self.engine, "```")
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self._fence_ids)))
        return replace(params, stop_token_ids=stops)

    def reply(self, kind: str, tokens: Sequence[int], entry_point: str = "") -> str:
        """The reply's text, with the start it was given (`prefix`) in front."""
        return self.prefix(kind, entry_point) + self.engine.decode(tokens)
