"""Verifiable answer checking: pull the final answer out of a completion and compare it with a reference.

Extraction looks, in order, for the last `\\boxed{...}`, a `#### X` line (GSM8K style), an
"answer is X" / "answer: X" phrase, and finally the last number in the text. Numbers compare as exact
rationals, so "0.5", "1/2", "\\frac{1}{2}" and "1,000" vs "1000" are equal; anything else compares as
normalized text (case, spaces, surrounding `$` and a trailing period ignored). `first_number` reads
the first number instead, for a short reply whose later words may hold other numbers.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*([^\n]+)", re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    """The final answer a completion gives, as a string, or None when it gives none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def first_number(text: str) -> str | None:
    """The first number in the text (a short reply such as "The answer is 7. Then ..."), or None."""
    found = _NUMBER.search(text)
    return found.group(0) if found else None


def parse_number(text: str) -> Fraction | None:
    """An exact rational from "7", "-3", "1,000", "0.75", "3/4", "\\frac{3}{4}", "$12", "50%"; else None."""
    s = _FRAC.sub(r"(\1)/(\2)", text.strip())
    s = s.strip().strip("$").rstrip(".").replace(",", "").replace(" ", "").replace("(", "").replace(")", "")
    percent = s.endswith("%")
    if percent:
        s = s[:-1]
    if not s or not _NUMBER.fullmatch(s):
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def normalize_text(text: str) -> str:
    s = text.strip().strip("$").rstrip(".").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    return re.sub(r"\s+", " ", s).lower()


def answers_match(candidate: str | None, reference: str) -> bool:
    """Whether extracted `candidate` equals `reference` (as numbers when the reference is one)."""
    if candidate is None:
        return False
    expected = parse_number(reference)
    if expected is None:
        return normalize_text(candidate) == normalize_text(reference)
    got = parse_number(candidate)
    if got is None:
        # "7 apples", "x = 7": the last number inside the extracted answer.
        numbers = _NUMBER.findall(candidate)
        got = parse_number(numbers[-1]) if numbers else None
    return got == expected


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None
