"""Countdown: its arithmetic, checked without eval() (the ground truth's numbers and target, and the exact value
(Fraction) of a + - * / ( ) expression with the integer literals it uses), and reward_countdown, which compares
the two."""
from __future__ import annotations

import ast
import json
import re
import unicodedata
from collections import Counter
from fractions import Fraction

from trainer.rewards.answers import extract_answer, need_ground_truth

MAX_EXPR_CHARS = 200
MAX_EXPR_DEPTH = 32
_EXPR_CHARS_RE = re.compile(r"[0-9+\-*/()\s]*")


def parse_countdown_truth(ground_truth: str) -> tuple[list[int], int]:
    """Countdown ground truth is JSON: {"numbers": [3, 5, 7], "target": 22}.

    A malformed ground truth is a data bug, not a wrong answer, so it raises ValueError.
    """
    try:
        obj = json.loads(ground_truth)
        numbers, target = obj["numbers" if "numbers" in obj else "nums"], obj["target"]  # nums: Countdown-Tasks
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise ValueError(f'countdown ground truth must be JSON {{"numbers": [...], "target": N}}, '
                         f'got {ground_truth[:200]!r}') from e
    if not (isinstance(numbers, list) and numbers and all(type(n) is int for n in numbers) and type(target) is int):
        raise ValueError(f"countdown ground truth needs a non-empty int list and an int target: {ground_truth[:200]!r}")
    return numbers, target


class _Reject(Exception):
    """The expression is not plain integer arithmetic (or divides by zero)."""


def _eval_node(node: ast.AST, used: list[int], depth: int = 0) -> Fraction:
    """Exact value of an arithmetic AST; only + - * /, unary minus and int literals are allowed."""
    if depth > MAX_EXPR_DEPTH:
        raise _Reject("too deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool and float excluded
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_node(node.operand, used, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _eval_node(node.left, used, depth + 1), _eval_node(node.right, used, depth + 1)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise _Reject("division by zero")
        return a / b
    raise _Reject(f"disallowed syntax {type(node).__name__}")


def evaluate_countdown(expr: str) -> tuple[Fraction, list[int]] | None:
    """(value, integer literals used) of a + - * / ( ) expression, or None when it is not one.

    Never eval()s: the text is checked against a character whitelist, parsed with
    ast.parse(mode="eval") and walked node by node with Fraction arithmetic.
    """
    expr = expr.replace("×", "*").replace("÷", "/").split("=", 1)[0].strip()  # "3*5+7 = 22" -> left side
    if not expr or len(expr) > MAX_EXPR_CHARS or not _EXPR_CHARS_RE.fullmatch(expr) or "**" in expr:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        return _eval_node(tree.body, used), used
    except (SyntaxError, ValueError, RecursionError, MemoryError, _Reject):
        return None


def reward_countdown(completion: str, ground_truth: str) -> float:
    """+1.0 when the last <answer> holds an expression equal to the target that uses each given
    number exactly once (as a multiset) and only + - * / and parentheses; else -1.0.

    ground_truth: JSON {"numbers": [3, 5, 7], "target": 22}. An optional "= ..." tail in the
    answer is ignored (the left side is what is evaluated); × and ÷ are read as * and /.
    """
    numbers, target = parse_countdown_truth(need_ground_truth(ground_truth, "countdown"))
    expr = extract_answer(completion)
    res = None if expr is None else evaluate_countdown(unicodedata.normalize("NFKC", expr))
    if res is None:
        return -1.0
    value, used = res
    return 1.0 if Counter(used) == Counter(numbers) and value == target else -1.0
