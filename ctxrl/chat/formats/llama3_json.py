"""``llama3_json``: Llama 3.1 / 3.3 bare JSON calls, ``{"name": "f", "parameters": {...}}``.

A Llama 3 model calls a custom tool by writing the call as a JSON object, optionally after the
``<|python_tag|>`` token, several of them separated by ``;`` or new lines::

    <|python_tag|>{"name": "calculator", "parameters": {"expression": "3 + 4"}}

Its template renders the tool's result under the ``ipython`` role. ``"arguments"`` is accepted
in place of ``"parameters"`` (models fine-tuned on other formats write it).

What counts as a call: a JSON object that starts with a ``"name"`` key and has ``"parameters"``
or ``"arguments"``, or any JSON after ``<|python_tag|>``. Such a call that is not valid JSON, lacks
a string name, or whose parameters are not an object is an error, and so is ``<|python_tag|>``
followed by anything but a JSON object (Llama's built-in tools write ``brave_search.call(...)``
there, which ctxrl's tools do not take). Any other JSON is prose: an answer may well contain some,
even an object with a ``"name"``.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from ctxrl.chat.formats.base import MALFORMED, arguments_of, json_error, register_format, tool_call
from ctxrl.types import ToolCall

PYTHON_TAG = "<|python_tag|>"

_START = re.compile(r'\{\s*"name"\s*:')
_EXPECTED = 'write {"name": ..., "parameters": {...}}, one call per line or separated by ";"'
_DECODER = json.JSONDecoder()
_SEPARATOR = re.compile(r"[\s;]*")


@register_format
class Llama3Json:
    """``{"name": ..., "parameters": {...}}`` objects, optionally after ``<|python_tag|>``."""

    name: ClassVar[str] = "llama3_json"
    families: ClassVar[str] = "Llama 3.1, Llama 3.3"
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "ipython")
    call_tags: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)
    result_tags: ClassVar[tuple[str, ...]] = ()  # results come under the ipython role, between special tokens
    example: ClassVar[str] = '{"name": "f", "parameters": {"x": 1}}'

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for _, _, call, error in _scan(text):
            if call is not None:
                calls.append(call)
            if error is not None:
                errors.append(error)
        return calls, errors

    def render(self, calls: list[ToolCall]) -> str:
        # The layout the Llama 3.1 template gives a call: name first, then the parameters.
        return "; ".join(json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)
                         for call in calls)

    def content_without_calls(self, text: str) -> str:
        pieces, last = [], 0
        for start, end, _, _ in _scan(text):
            between = text[last:start]
            pieces.append("" if last and _SEPARATOR.fullmatch(between) else between)
            last = end
        pieces.append(text[last:])
        return "".join(pieces).replace(PYTHON_TAG, "").strip()


def _scan(text: str):
    """Each call of ``text`` as ``(start, end, call, error)`` (one of the last two is None), in order."""
    position = 0
    while True:
        match = _START.search(text, position)
        tag = text.find(PYTHON_TAG, position)
        if tag >= 0 and (match is None or tag < match.start()):
            start, body, tagged = tag, _skip_space(text, tag + len(PYTHON_TAG)), True
            if body == len(text):  # a bare tag at the end: nothing called, nothing to say
                return
            if text[body] != "{":
                end = _line_end(text, body)
                yield start, end, None, f"{MALFORMED}: {PYTHON_TAG} must be followed by a JSON object; {_EXPECTED}"
                position = end
                continue
        elif match is not None:
            start = body = match.start()
            tagged = False
        else:
            return
        try:
            obj, end = _DECODER.raw_decode(text, body)
        except (json.JSONDecodeError, RecursionError) as exc:
            end = _line_end(text, body)
            yield start, end, None, json_error(exc, _EXPECTED)
            position = end
            continue
        call, error = _call(obj, tagged)
        if call is None and error is None:  # JSON in the prose, not a call
            position = body + 1
            continue
        yield start, end, call, error
        position = end


def _call(obj: object, tagged: bool) -> tuple[ToolCall | None, str | None]:
    """The call ``obj`` writes, an error, or (None, None) for an object that is not a call: without
    ``<|python_tag|>``, an object with no ``parameters``/``arguments`` is taken as prose."""
    key = None
    if isinstance(obj, dict):
        key = "parameters" if "parameters" in obj else "arguments" if "arguments" in obj else None
    if key is None and not tagged:
        return None, None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f'{MALFORMED}: expected a JSON object with a string "name"; {_EXPECTED}'
    if key is None:
        return None, f'{MALFORMED} to {obj["name"]!r}: no "parameters" object; {_EXPECTED}'
    arguments, error = arguments_of(obj["name"], obj[key], key)
    if error:
        return None, error
    return tool_call(obj["name"], arguments), None


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _line_end(text: str, position: int) -> int:
    end = text.find("\n", position)
    return len(text) if end < 0 else end
