"""The built-in `calculator` tool: a bounded evaluation of an arithmetic expression's syntax tree (no `eval`).

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses. Nothing else parses into a value:
no names, calls, attributes, subscripts, comparisons or strings. Bounds keep one call cheap enough to run in the
rollout process itself: an exponent at most MAX_EXPONENT in size, every intermediate value at most MAX_MAGNITUDE,
at most MAX_NODES nodes in the tree and MAX_CHARS characters of text.
"""
from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 10 ** 60

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain bounded arithmetic (said in one line, for the model to read)."""


def _check(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a value exceeds the calculator's bound of 1e{len(str(MAX_MAGNITUDE)) - 1}")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise CalculatorError("0 cannot be raised to a negative power")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        return _check(value)
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"the name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = "a function call"
    raise CalculatorError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> int | float:
    """The value of `expression`; CalculatorError (one line) when it is not bounded plain arithmetic."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    return _eval(tree)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic expression to evaluate, using numbers, + - * / // % ** and parentheses,
            for example "123 * 456 + 7".
    """
    return str(evaluate(expression))
