"""``mistral``: ``[TOOL_CALLS]`` followed by the calls (Mistral 7B v0.3, Mixtral 8x22B, Mistral Small/Nemo).

Two layouts, both read:

- v3, a JSON list after the tag, each call with a tool-call id::

      [TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "3 + 4"}, "id": "a1b2c3d4e"}]

- the newer one, name then ``[ARGS]`` then the JSON arguments, one tag per call::

      [TOOL_CALLS]calculator[ARGS]{"expression": "3 + 4"}[TOOL_CALLS]now[ARGS]{}

Mistral templates want every call to carry an id of 9 letters and digits and every tool result
the ``tool_call_id`` of the call it answers. An id the model wrote is kept (one that breaks the
rule is an error); ``render`` writes the v3 layout with ids from ``call_id`` (a hash of the call
and its place), and the renderer gives a call without one the same id, so that a result's id
always matches its call's (``ctxrl.chat.render``).

Errors: a tag followed by neither layout, JSON that does not parse, a call without a string
``name``, arguments that are not an object.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from ctxrl.chat.formats.base import (
    MALFORMED,
    arguments_of,
    call_id,
    gather,
    json_error,
    register_format,
    tool_call,
    without_spans,
)
from ctxrl.types import ToolCall

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
TOOL_RESULTS = ("[TOOL_RESULTS]", "[/TOOL_RESULTS]")

_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*" + re.escape(ARGS) + r"\s*")
_ID = re.compile(r"^[A-Za-z0-9]{9}$")
_EXPECTED = f'write {TOOL_CALLS} [{{"name": ..., "arguments": {{...}}}}] or {TOOL_CALLS}name{ARGS}{{...}}'
_DECODER = json.JSONDecoder()


@register_format
class Mistral:
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}]`` (v3) or ``[TOOL_CALLS]name[ARGS]{...}``."""

    name: ClassVar[str] = "mistral"
    families: ClassVar[str] = "Mistral, Mixtral"
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    call_tags: ClassVar[tuple[str, ...]] = (TOOL_CALLS, ARGS)
    result_tags: ClassVar[tuple[str, ...]] = TOOL_RESULTS
    example: ClassVar[str] = f'{TOOL_CALLS} [{{"name": "f", "arguments": {{"x": 1}}, "id": "a1b2c3d4e"}}]'

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        return gather(_scan(text))

    def render(self, calls: list[ToolCall]) -> str:
        if not calls:
            return ""
        items = [json.dumps({"name": call.name, "arguments": call.arguments,
                             "id": call.id or call_id(call.name, call.arguments, index)}, ensure_ascii=False)
                 for index, call in enumerate(calls)]
        return f"{TOOL_CALLS} [{', '.join(items)}]"

    def content_without_calls(self, text: str) -> str:
        return without_spans(text, _scan(text))


def _scan(text: str):
    """Each ``[TOOL_CALLS]`` span of ``text``: ``(start, end, calls, errors)``, in order."""
    start = text.find(TOOL_CALLS)
    while start >= 0:
        body = start + len(TOOL_CALLS)
        following = text.find(TOOL_CALLS, body)
        limit = len(text) if following < 0 else following
        first = body + len(text[body:limit]) - len(text[body:limit].lstrip())
        named = _NAME.match(text, body, limit)
        if first < limit and text[first] == "[":
            end, calls, errors = _json_list(text, first, limit)
        elif named is not None:
            end, calls, errors = _named_call(text, named, limit)
        else:
            end, calls, errors = limit, [], [f"{MALFORMED}: {TOOL_CALLS} must be followed by the calls; {_EXPECTED}"]
        yield start, end, calls, errors
        start = text.find(TOOL_CALLS, end)


def _json_list(text: str, start: int, limit: int) -> tuple[int, list[ToolCall], list[str]]:
    try:
        items, end = _DECODER.raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError) as exc:
        return limit, [], [json_error(exc, _EXPECTED)]
    calls, errors = [], []
    for item in items:
        call, error = _v3_call(item)
        if error:
            errors.append(error)
        else:
            calls.append(call)
    return end, calls, errors


def _v3_call(item: Any) -> tuple[ToolCall | None, str | None]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None, f'{MALFORMED}: each call in the list must be a JSON object with a string "name"; {_EXPECTED}'
    arguments, error = arguments_of(item["name"], item.get("arguments", {}))
    if error:
        return None, error
    given = item.get("id")
    if given is not None and not (isinstance(given, str) and _ID.match(given)):
        return None, f"{MALFORMED} to {item['name']!r}: the id must be 9 letters or digits, got {given!r}"
    return tool_call(item["name"], arguments, given), None


def _named_call(text: str, named: re.Match, limit: int) -> tuple[int, list[ToolCall], list[str]]:
    name = named.group(1)
    try:
        arguments, end = _DECODER.raw_decode(text, named.end())
    except (json.JSONDecodeError, RecursionError) as exc:
        return limit, [], [json_error(exc, _EXPECTED)]
    arguments, error = arguments_of(name, arguments)
    if error:
        return end, [], [error]
    return end, [tool_call(name, arguments)], []
