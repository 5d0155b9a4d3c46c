"""A small synthetic code set for fast tests and the demo: HumanEval-shaped problems (a signature and
docstring to complete, an entry point, a body that solves it, hidden asserts), each solved by a
line or two, so that a sandbox run takes milliseconds and a reference and its mutants are easy to
read. Loaded as `CodeProblem`s by `code_tasks.synthetic_problems`.
"""

from __future__ import annotations

SYNTHETIC: tuple[dict, ...] = (
    {"id": "syn/add", "entry_point": "add",
     "prompt": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
     "solution": "    return a + b\n",
     "tests": ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"]},
    {"id": "syn/max_of_two", "entry_point": "max_of_two",
     "prompt": 'def max_of_two(a: int, b: int) -> int:\n    """Return the larger of a and b."""\n',
     "solution": "    if a > b:\n        return a\n    return b\n",
     "tests": ["assert max_of_two(1, 2) == 2", "assert max_of_two(7, 3) == 7", "assert max_of_two(-1, -1) == -1"]},
    {"id": "syn/is_even", "entry_point": "is_even",
     "prompt": 'def is_even(n: int) -> bool:\n    """Whether n is even."""\n',
     "solution": "    return n % 2 == 0\n",
     "tests": ["assert is_even(4) is True", "assert is_even(7) is False", "assert is_even(0) is True"]},
    {"id": "syn/reverse", "entry_point": "reverse",
     "prompt": 'def reverse(s: str) -> str:\n    """Return s reversed."""\n',
     "solution": "    return s[::-1]\n",
     "tests": ["assert reverse('abc') == 'cba'", "assert reverse('') == ''", "assert reverse('aa') == 'aa'"]},
    {"id": "syn/count_positive", "entry_point": "count_positive",
     "prompt": 'def count_positive(xs: list) -> int:\n    """How many numbers in xs are greater than 0."""\n',
     "solution": "    return sum(1 for x in xs if x > 0)\n",
     "tests": ["assert count_positive([1, -2, 3]) == 2", "assert count_positive([]) == 0",
               "assert count_positive([0, 0, 5]) == 1"]},
    {"id": "syn/factorial", "entry_point": "factorial",
     "prompt": 'def factorial(n: int) -> int:\n    """n! for n >= 0."""\n',
     "solution": "    out = 1\n    for i in range(2, n + 1):\n        out = out * i\n    return out\n",
     "tests": ["assert factorial(0) == 1", "assert factorial(1) == 1", "assert factorial(5) == 120"]},
    {"id": "syn/clamp", "entry_point": "clamp",
     "prompt": 'def clamp(x: int, low: int, high: int) -> int:\n    """x limited to the range [low, high]."""\n',
     "solution": "    if x < low:\n        return low\n    if x > high:\n        return high\n    return x\n",
     "tests": ["assert clamp(5, 0, 10) == 5", "assert clamp(-3, 0, 10) == 0", "assert clamp(12, 0, 10) == 10",
               "assert clamp(10, 0, 10) == 10"]},
    {"id": "syn/sum_squares", "entry_point": "sum_squares",
     "prompt": 'def sum_squares(n: int) -> int:\n    """The sum of i * i for i from 1 to n."""\n',
     "solution": "    return sum(i * i for i in range(1, n + 1))\n",
     "tests": ["assert sum_squares(0) == 0", "assert sum_squares(1) == 1", "assert sum_squares(3) == 14"]},
)
