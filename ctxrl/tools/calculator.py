"""A safe arithmetic calculator tool.

Expressions are parsed with ``ast`` and evaluated by walking the tree, never with ``eval``.
Only numbers, ``+ - * / // %``, unary ``+``/``-`` and parentheses are allowed; everything
else (names, calls, attributes, ``**``, comparisons) is rejected with a message saying what
was found, because the message becomes the model's observation and should teach it.

Blow-ups are capped rather than trusted away: the expression length, and the magnitude of
every literal and intermediate result, are bounded so ``9999999 * 9999999 * ...`` cannot
eat memory. There is no ``**``, which is the usual way to build huge integers.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from ctxrl.tools.base import Tool

MAX_EXPRESSION_CHARS = 256
MAX_MAGNITUDE = 10**30
"""Largest absolute value of any literal or intermediate result."""

_BINARY: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


def safe_eval(expression: str) -> int | float:
    """Evaluate an arithmetic expression with standard precedence; raise ``CalculatorError``."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"could not parse {text!r}: use numbers, + - * / // % and parentheses") from exc
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"unsupported literal {value!r}: only numbers are allowed")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        symbol, fn = _BINARY[type(node.op)]
        left, right = _eval(node.left), _eval(node.right)
        if symbol in ("/", "//", "%") and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(fn(left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        raise CalculatorError("'**' is not supported: write the multiplication out")
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}): use numbers, + - * / // % and parentheses")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"number too large (limit {MAX_MAGNITUDE:.0e})")
    return value


def format_number(value: int | float) -> str:
    """Integers (and integral floats) without ``.0``; other floats rounded to 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    text = f"{round(value, 6):.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calculate(expression: str) -> str:
    """The calculator tool's function: the formatted value of ``expression``."""
    return format_number(safe_eval(expression))


async def calculate_inline(expression: str) -> str:
    """``calculate`` on the event loop itself, not in a worker thread.

    Safe because an evaluation is bounded (256 characters, no powers, magnitudes below 1e30:
    microseconds). It matters for exact reproducibility: a thread's finishing time decides which
    episodes share the engine's next batch, and that changes the behaviour log-probs in their last
    bits (the sampled tokens stay the same); inline, a seeded run repeats bit for bit.
    """
    return calculate(expression)


def calculator_tool(timeout_s: float = 5.0) -> Tool:
    """The ``calculator`` tool: one required string argument ``expression``."""
    return Tool(
        name="calculator",
        # Kept short: every prompt carries this schema, and the tiny model pays for each token.
        description="Evaluate an arithmetic expression.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
        fn=calculate_inline,
        timeout_s=timeout_s,
    )
