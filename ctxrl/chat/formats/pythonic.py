"""``pythonic``: a Python list of calls with keyword arguments (Llama 3.2, Llama 4)::

    [get_weather(city='Paris'), add(a=1, b=2)]

The list is read with ``ast`` and every argument with ``ast.literal_eval``: strings, numbers,
``True``/``False``/``None``, lists, tuples (as lists) and dicts with string keys, nested as deep as
they like. Nothing is ever evaluated: a name, an attribute, an operator or a nested call is an
error that says which argument holds it, and so are positional arguments, ``**kwargs``, a list
that does not parse and a ``[`` that is never closed.

What counts as a call list: a ``[`` followed by a name and ``(``. Other brackets are prose.
"""

from __future__ import annotations

import ast
import re
from typing import Any, ClassVar

from ctxrl.chat.formats.base import MALFORMED, gather, register_format, tool_call, without_spans
from ctxrl.types import ToolCall

_START = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.]*\s*\(")
_EXPECTED = "write [name(argument=value, ...), ...] with literal values (strings, numbers, True/False/None, lists)"
_QUOTES = ("'''", '"""', "'", '"')


@register_format
class Pythonic:
    """``[f(a=1), g(b='x')]``, read with ``ast`` (literals only, never evaluated)."""

    name: ClassVar[str] = "pythonic"
    families: ClassVar[str] = "Llama 3.2, Llama 4"
    markers: ClassVar[tuple[str, ...]] = ("[func_name1(", "[func_name(", "[function_name(")
    call_tags: ClassVar[tuple[str, ...]] = ()  # a call list is plain Python: no tag to keep or guard
    result_tags: ClassVar[tuple[str, ...]] = ()
    example: ClassVar[str] = "[f(x=1)]"

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        return gather(_scan(text))

    def render(self, calls: list[ToolCall]) -> str:
        if not calls:
            return ""
        written = [f"{call.name}({', '.join(f'{k}={_literal(v)}' for k, v in call.arguments.items())})"
                   for call in calls]
        return f"[{', '.join(written)}]"

    def content_without_calls(self, text: str) -> str:
        return without_spans(text, _scan(text))


def _literal(value: Any) -> str:
    """``value`` as Python source that ``ast.literal_eval`` reads back as it (JSON values only)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _scan(text: str):
    """Each call list of ``text``: ``(start, end, calls, errors)``, in order."""
    position = 0
    while (match := _START.search(text, position)) is not None:
        start = match.start()
        end = _closing(text, start)
        if end is None:
            yield start, len(text), [], [f"{MALFORMED}: the call list opened with '[' was not closed with ']'; "
                                         f"{_EXPECTED}"]
            return
        yield start, end, *_calls(text[start:end])
        position = end


def _closing(text: str, start: int) -> int | None:
    """The index just past the ``]`` that closes the ``[`` at ``start``, skipping brackets inside strings."""
    depth, i = 0, start
    while i < len(text):
        quote = next((q for q in _QUOTES if text.startswith(q, i)), None)
        if quote is not None:
            i += len(quote)
            while i < len(text) and not text.startswith(quote, i):
                i += 2 if text[i] == "\\" else 1
            i += len(quote)
            continue
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _calls(source: str) -> tuple[list[ToolCall], list[str]]:
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        return [], [f"{MALFORMED}: the call list is not valid Python ({exc.msg}); {_EXPECTED}"]
    if not isinstance(tree.body, ast.List):  # e.g. a list comprehension
        return [], [f"{MALFORMED}: expected a plain list of calls; {_EXPECTED}"]
    calls, errors = [], []
    for node in tree.body.elts:
        call, error = _call(node)
        if error:
            errors.append(error)
        else:
            calls.append(call)
    return calls, errors


def _call(node: ast.expr) -> tuple[ToolCall | None, str | None]:
    if not isinstance(node, ast.Call):
        return None, f"{MALFORMED}: each item of the list must be a call name(...); {_EXPECTED}"
    name = _dotted(node.func)
    if name is None:
        return None, f"{MALFORMED}: a call must name a tool, as name(...); {_EXPECTED}"
    if node.args:
        return None, f"{MALFORMED} to {name!r}: pass arguments by keyword, as {name}(argument=value)"
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None, f"{MALFORMED} to {name!r}: **kwargs are not allowed; name each argument"
        try:
            value = _plain(ast.literal_eval(keyword.value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None, (f"{MALFORMED} to {name!r}: argument {keyword.arg!r} must be a literal value, got "
                          f"{ast.unparse(keyword.value)!r}; {_EXPECTED}")
        arguments[keyword.arg] = value
    return tool_call(name, arguments), None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _plain(value: Any) -> Any:
    """A literal as JSON data: tuples become lists; sets, bytes, complex numbers and non-string keys are refused."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("dict keys must be strings")
        return {k: _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{type(value).__name__} is not JSON data")
