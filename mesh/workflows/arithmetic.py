"""Arithmetic word problems of graded difficulty: a math task family a small real model learns by RL.

Five levels: (1) a single digit plus a single digit, (2) a two-digit number plus a digit, (3) a
two-digit number minus a digit, (4) a digit times a digit, (5) two steps (a + b - c). A problem is
its arithmetic: its id names the level and the operands (`arith-1-3-4` is 3 + 4), and its wording
(who, what, the sentence) follows from the id, so one id is always the same prompt. Every problem of
a level is either in the training split or in the held-out split, by a keyed hash of its id
(`split_seed`, `heldout_percent`): the held-out set asks arithmetic facts the policy never trained
on, with any wording. A problem is worded as a story (`wording="words"`) or as its bare equation
(`"equation"`: `3 + 4 =`, what a 135M-parameter model can learn to answer by RL on a CPU: SmolLM2-135M
answers the stories about 2% of the time at temperature 1, the equations about 70%); the wording
changes the prompt only, never the id, the answer or the split. `train_tasks` draws the broker's
dataset from the training split only and `heldout_tasks` the evaluation set from the held-out split
only; `split_of` tells which a problem id is in. Answers are integers, checked exactly by the `math` workflow.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

LEVELS = (1, 2, 3, 4, 5)
NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Lea", "Max", "Eva")
ITEMS = ("apples", "pens", "coins", "books", "cards", "shells", "stamps", "marbles")
Split = Literal["train", "heldout"]
Wording = Literal["words", "equation"]
WORDINGS = ("words", "equation")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: its id, level, operands, question and integer answer."""

    id: str
    level: int
    operands: tuple[int, ...]
    prompt: str
    answer: int

    def record(self) -> dict[str, Any]:
        """The broker's dataset record (and the evaluation set's): {"id", "prompt", "metadata"}."""
        return {"id": self.id, "prompt": self.prompt,
                "metadata": {"answer": str(self.answer), "level": self.level, "family": "arithmetic"}}


# Each level's operand ranges, one per operand.
RANGES: dict[int, tuple[range, ...]] = {
    1: (range(1, 10), range(1, 10)),
    2: (range(10, 50), range(1, 10)),
    3: (range(10, 100), range(1, 10)),
    4: (range(2, 10), range(2, 10)),
    5: (range(10, 41), range(2, 10), range(2, 10)),
}


def _ranges(level: int) -> tuple[range, ...]:
    if level not in RANGES:
        raise ValueError(f"level must be one of {LEVELS}, got {level}")
    return RANGES[level]


def _operand_space(level: int) -> Iterator[tuple[int, ...]]:
    return itertools.product(*_ranges(level))


def _keyed(text: str, key: int) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, key=str(key).encode()).digest(), "big")


EQUATIONS = {1: "{} + {} =", 2: "{} + {} =", 3: "{} - {} =", 4: "{} * {} =", 5: "{} + {} - {} ="}


def problem(level: int, operands: Sequence[int], wording: Wording = "words") -> Problem:
    """The problem of `level` with these operands (ValueError if they are not of that level)."""
    ops = tuple(int(x) for x in operands)
    ranges = _ranges(level)
    if len(ops) != len(ranges) or not all(x in r for x, r in zip(ops, ranges)):
        raise ValueError(f"operands {ops} are not a level-{level} problem")
    if wording not in WORDINGS:
        raise ValueError(f"wording must be one of {WORDINGS}, got {wording!r}")
    pid = f"arith-{level}-" + "-".join(str(x) for x in ops)
    pick = _keyed(pid, 0)
    who, what = NAMES[pick % len(NAMES)], ITEMS[(pick // len(NAMES)) % len(ITEMS)]
    if level in (1, 2):
        a, b = ops
        text, answer = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?", a + b
    elif level == 3:
        a, b = ops
        text, answer = f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have left?", a - b
    elif level == 4:
        a, b = ops
        text, answer = f"{who} has {a} bags with {b} {what} in each bag. How many {what} does {who} have?", a * b
    else:
        a, b, c = ops
        text, answer = (f"{who} has {a} {what}, gets {b} more and then gives away {c}. "
                        f"How many {what} does {who} have now?", a + b - c)
    if wording == "equation":
        text = EQUATIONS[level].format(*ops)
    return Problem(pid, level, ops, text, answer)


def split_of(problem_id: str, *, split_seed: int = 0, heldout_percent: int = 20) -> Split:
    """Which split a problem id is in: the same answer for the same id, seed and share, always."""
    return "heldout" if _keyed(problem_id, split_seed) % 100 < heldout_percent else "train"


def problems(levels: Sequence[int], split: Split, *, split_seed: int = 0, heldout_percent: int = 20,
             wording: Wording = "words") -> list[Problem]:
    """Every problem of `levels` in `split`, in a fixed order (level, then operands)."""
    if not 0 < heldout_percent < 100:
        raise ValueError(f"heldout_percent must be in 1..99, got {heldout_percent}")
    out = []
    for level in levels:
        for ops in _operand_space(level):
            p = problem(level, ops, wording)
            if split_of(p.id, split_seed=split_seed, heldout_percent=heldout_percent) == split:
                out.append(p)
    return out


def train_tasks(count: int, levels: Sequence[int], *, seed: int = 0, split_seed: int = 0,
                heldout_percent: int = 20, wording: Wording = "words") -> list[dict[str, Any]]:
    """Up to `count` dataset records of the training split only, each problem once (a dataset's ids
    are unique: the broker cycles it over epochs for more): each level's problems shuffled (seeded)
    and dealt in turn, so levels come in equal shares until the smallest has none left."""
    rng = random.Random(seed)
    decks = [rng.sample(ps, len(ps)) for ps in
             (problems([lv], "train", split_seed=split_seed, heldout_percent=heldout_percent, wording=wording)
              for lv in levels)]
    out: list[dict[str, Any]] = []
    while len(out) < count and any(decks):
        for deck in decks:
            if deck and len(out) < count:
                out.append(deck.pop().record())
    return out


def heldout_tasks(count: int, levels: Sequence[int], *, split_seed: int = 0,
                  heldout_percent: int = 20, wording: Wording = "words") -> list[dict[str, Any]]:
    """The evaluation set: `count` problems of the held-out split, levels in equal shares (fewer when
    a level has fewer), the same ones for the same arguments."""
    by_level = [problems([lv], "heldout", split_seed=split_seed, heldout_percent=heldout_percent, wording=wording)
                for lv in levels]
    # Spread over each level's operand space rather than its first few, in a fixed order.
    for pool in by_level:
        pool.sort(key=lambda p: _keyed(p.id, 1))
    out: list[dict[str, Any]] = []
    while len(out) < count and any(by_level):
        for pool in by_level:
            if pool and len(out) < count:
                out.append(pool.pop(0).record())
    return out
