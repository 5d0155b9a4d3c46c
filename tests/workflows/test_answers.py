"""Answer extraction and comparison of the verifiable-math workflows (pure functions)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from deltamesh.mesh.workflows.answers import answers_match, extract_answer, parse_number


@pytest.mark.parametrize("completion, answer", [
    ("so the result is \\boxed{\\frac{3}{4}} indeed", "\\frac{3}{4}"),
    ("\\boxed{x^{2}} then \\boxed{12}", "12"),
    ("Natalia sold 48 clips.\n#### 72", "72"),
    ("I think the answer is 1,024.", "1,024."),
    ("Answer: Paris", "Paris"),
    ("3+4 makes 7", "7"),
    ("7", "7"),
    ("-2.5 degrees", "-2.5"),
])
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


def test_no_answer_is_none():
    assert extract_answer("I do not know") is None
    assert extract_answer("") is None
    assert extract_answer("\\boxed{unclosed") is None


@pytest.mark.parametrize("text, value", [
    ("7", Fraction(7)), ("-3", Fraction(-3)), ("1,000", Fraction(1000)), ("0.75", Fraction(3, 4)),
    ("3/4", Fraction(3, 4)), ("\\frac{3}{4}", Fraction(3, 4)), ("$12", Fraction(12)), ("50%", Fraction(1, 2)),
    ("12.", Fraction(12)), ("apples", None), ("1/0", None), ("", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("candidate, reference, expected", [
    ("0.5", "1/2", True),
    ("\\frac{1}{2}", "0.5", True),
    ("1,000", "1000", True),
    ("x = 7", "7", True),
    ("7 apples", "7", True),
    ("8", "7", False),
    ("Paris.", "paris", True),
    ("\\text{Paris}", "Paris", True),
    ("Lyon", "Paris", False),
    (None, "7", False),
    ("seven", "7", False),
])
def test_answers_match(candidate, reference, expected):
    assert answers_match(candidate, reference) is expected
