"""Safe arithmetic: parse with `ast`, walk only number and operator nodes (never `eval`)."""

from __future__ import annotations

import ast
import operator
import warnings
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class ExpressionError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds; the message says why."""


def count_operations(expression: str) -> int:
    """Binary operations in `expression` (unary minus is not counted)."""
    return sum(isinstance(n, ast.BinOp) for n in ast.walk(_parse(expression)))


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses, unary minus.
    Integral results are ints; others are rounded to 6 decimals."""
    value = _eval(_parse(expression).body)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        return round(value, 6)
    return value


def _parse(expression: str) -> ast.Expression:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():
            # model-written text such as "12x" makes the parser warn on stderr before it fails;
            # the failure is the answer (a ToolError the model sees), the warning is noise
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ExpressionError(f"not an arithmetic expression: {expression!r}") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ExpressionError(f"exponent larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ExpressionError("division by zero") from None
        except OverflowError:
            raise ExpressionError("result too large") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ExpressionError("result too large" if not isinstance(value, complex) else "complex result")
        return value
    raise ExpressionError(f"not allowed in arithmetic: {ast.unparse(node)!r}")
