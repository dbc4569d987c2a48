"""A restricted arithmetic evaluator: what the calculator and Python-expression tools compute with.

A model's tool arguments are untrusted text, so nothing here hands them to
`eval` or `exec`. The text is parsed by Python's own parser (`ast`, mode
"eval") and the tree is walked by `evaluate`, which knows only numbers,
the operators of its `Grammar` and a few named functions; a name, an
attribute, a subscript, a string or a call outside the whitelist is an
`ExpressionError` naming the construct. Sizes are bounded before and during
the walk (characters, nodes, magnitudes, exponents), so an argument like
`9**9**9` is refused instead of running for minutes.
"""
from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

__all__ = ["CALCULATOR", "PYTHON", "ExpressionError", "Grammar", "evaluate"]

Number = Union[int, float]

MAX_CHARS = 256        # longer arguments are refused before parsing
MAX_NODES = 128        # syntax-tree nodes
MAX_MAGNITUDE = 10 ** 40  # any intermediate result; past it the computation stops
MAX_EXPONENT = 128


class ExpressionError(ValueError):
    """The expression is not one the grammar accepts, or its value is out of bounds; the message says which."""


_OPERATORS: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
            ast.Pow: "**", ast.UAdd: "unary +", ast.USub: "unary -"}
_COMPARISONS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
                ast.Eq: operator.eq, ast.NotEq: operator.ne}


@dataclass(frozen=True)
class Grammar:
    """What an expression may contain: binary operators, unary signs, named functions, comparisons."""

    name: str
    binary: frozenset = frozenset({ast.Add, ast.Sub, ast.Mult, ast.Div})
    functions: Mapping[str, Callable[..., Number]] = field(default_factory=dict)
    comparisons: bool = False


CALCULATOR = Grammar("calculator")
PYTHON = Grammar("python", binary=frozenset(_OPERATORS),
                 functions={"abs": abs, "min": min, "max": max, "round": round}, comparisons=True)


def evaluate(text: str, grammar: Grammar = CALCULATOR) -> Number:
    """The value of `text` under `grammar`; ExpressionError for anything else (never evaluated by Python)."""
    if not isinstance(text, str):
        raise ExpressionError(f"an expression is a string, got {type(text).__name__}")
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"the expression has {len(text)} characters; at most {MAX_CHARS}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not an arithmetic expression: {exc.msg}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise ExpressionError(f"the expression has {nodes} syntax nodes; at most {MAX_NODES}")
    return _Walker(grammar).value(tree.body)


class _Walker:
    def __init__(self, grammar: Grammar):
        self.grammar = grammar

    def value(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in (ast.UAdd, ast.USub):
            operand = self.value(node.operand)
            return operand if isinstance(node.op, ast.UAdd) else -operand
        if isinstance(node, ast.BinOp) and type(node.op) in self.grammar.binary:
            return self._binary(type(node.op), self.value(node.left), self.value(node.right))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in self.grammar.functions and not node.keywords:
            if not node.args:
                raise ExpressionError(f"{node.func.id}() needs arguments")
            return _bounded(self.grammar.functions[node.func.id](*(self.value(a) for a in node.args)))
        if isinstance(node, ast.Compare) and self.grammar.comparisons:
            return int(self._compare(node))
        raise ExpressionError(f"{self.grammar.name} expressions may not contain {_describe(node)}")

    def _binary(self, op: type, left: Number, right: Number) -> Number:
        if op is ast.Pow and (abs(right) > MAX_EXPONENT or (abs(left) > 1 and abs(right) * math.log10(abs(left))
                                                             > math.log10(MAX_MAGNITUDE))):
            raise ExpressionError(f"{left} ** {right} is too large (results are bounded by 1e40)")
        try:
            return _bounded(_OPERATORS[op](left, right))
        except ZeroDivisionError:
            raise ExpressionError("division by zero") from None
        except (OverflowError, ValueError, TypeError) as exc:
            raise ExpressionError(f"{left} {_SYMBOLS[op]} {right}: {exc}") from None

    def _compare(self, node: ast.Compare) -> bool:
        left = self.value(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            if type(op) not in _COMPARISONS:
                raise ExpressionError(f"{self.grammar.name} expressions may not contain {_describe(op)}")
            right = self.value(right_node)
            if not _COMPARISONS[type(op)](left, right):
                return False
            left = right
        return True


def _bounded(value: Number) -> Number:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise ExpressionError(f"the result {value} is not a finite real number")
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError("a result exceeds 1e40 in magnitude")
    return value


def _describe(node: ast.AST) -> str:
    """A short name for a refused construct: 'the operator **', 'a name (os)', 'a str constant'."""
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {_SYMBOLS.get(type(node.op), type(node.op).__name__)}"
    if isinstance(node, ast.Name):
        return f"a name ({node.id})"
    if isinstance(node, ast.Call):
        return f"a call of {ast.unparse(node.func)}"
    if isinstance(node, ast.Constant):
        return f"a {type(node.value).__name__} constant"
    return f"a {type(node).__name__}"
