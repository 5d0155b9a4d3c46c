"""Mutants of a reference solution, for scoring generated tests: a good test kills some mutant.

A mutant is the reference with one small change inside the entry point's function (its docstring
and the rest of the module untouched). The mutation sites, in the order `ast` visits them, and what
each becomes:

| site | mutation |
|---|---|
| comparison operator | `<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`, `in` <-> `not in`, `is` <-> `is not` |
| arithmetic operator | `+` -> `-`, `-` -> `+`, `*` -> `+`, `/` -> `*`, `//` -> `*`, `%` -> `//` |
| integer constant | n -> n + 1 |
| boolean constant | `True` <-> `False` |
| boolean operator | `and` <-> `or` |
| `not x` | `x` |

`mutants(source, entry_point, k)` picks k sites spread evenly over all of them (the first, then
every len/k-th), so the mutants touch different parts of the function; a mutation that leaves the
source unchanged once unparsed is skipped. The same source always gives the same mutants. A mutant
may happen to be equivalent to the reference (no test can kill it); it lowers the best reward
reachable on that problem, it never rewards a bad test.
"""

from __future__ import annotations

import ast
import copy

_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
          ast.Mod: ast.FloorDiv}


class _Mutator(ast.NodeTransformer):
    """Counts the mutation sites it visits and mutates the one numbered `target` (-1: none)."""

    def __init__(self, target: int = -1) -> None:
        self.target = target
        self.sites = 0

    def _hit(self) -> bool:
        hit = self.sites == self.target
        self.sites += 1
        return hit

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        for i, op in enumerate(node.ops):
            if type(op) in _COMPARE and self._hit():
                node.ops[i] = _COMPARE[type(op)]()
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if type(node.op) in _ARITH and self._hit():
            node.op = _ARITH[type(node.op)]()
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        if self._hit():
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and self._hit():
            return node.operand
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, bool):
            if self._hit():
                return ast.Constant(not node.value)
        elif isinstance(node.value, int) and self._hit():
            return ast.Constant(node.value + 1)
        return node


def _function(tree: ast.Module, entry_point: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == entry_point:
            return node
    raise ValueError(f"the reference defines no function {entry_point!r} at the top level")


def mutation_sites(source: str, entry_point: str) -> int:
    """How many mutation sites the entry point's function has."""
    counter = _Mutator()
    counter.visit(_function(ast.parse(source), entry_point))
    return counter.sites


def mutants(source: str, entry_point: str, k: int) -> list[str]:
    """Up to k distinct mutants of `source` (see the module docstring); ValueError if it does not parse
    or does not define `entry_point`."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    tree = ast.parse(source)
    n = mutation_sites(source, entry_point)
    original = ast.unparse(tree)
    out: list[str] = []
    for target in sorted({i * n // k for i in range(k)}) if n else ():
        mutated = copy.deepcopy(tree)
        _Mutator(target).visit(_function(mutated, entry_point))
        text = ast.unparse(ast.fix_missing_locations(mutated))
        if text != original and text not in out:
            out.append(text + "\n")
    return out
