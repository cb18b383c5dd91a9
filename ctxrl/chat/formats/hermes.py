"""``hermes``: ``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes, ctxrl's tiny model).

An assistant message calls tools with one block per call::

    Let me compute.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 + 4"}}
    </tool_call>

A block that is not valid JSON, lacks a string ``name``, has ``arguments`` that are not an object
(a JSON string holding one is decoded), or is left unclosed is an error. A missing ``arguments``
is an empty object (a call to a tool without parameters).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from ctxrl.chat.formats.base import MALFORMED, arguments_of, json_error, register_format, tool_call
from ctxrl.types import ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def format_call(name: str, arguments: dict) -> str:
    """The exact text a Hermes/Qwen model writes to call ``name`` with ``arguments``."""
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


@register_format
class Hermes:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call."""

    name: ClassVar[str] = "hermes"
    families: ClassVar[str] = "Qwen2.5, Qwen3, Hermes"
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALL_OPEN,)
    call_tags: ClassVar[tuple[str, ...]] = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    result_tags: ClassVar[tuple[str, ...]] = (TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
    example: ClassVar[str] = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls: list[ToolCall] = []
        errors: list[str] = []
        last_end = 0
        for match in _BLOCK.finditer(text):
            last_end = match.end()
            try:
                obj = json.loads(match.group(1).strip())
            except (json.JSONDecodeError, RecursionError) as exc:
                errors.append(json_error(exc, 'write {"name": ..., "arguments": {...}} inside '
                                              "<tool_call></tool_call>"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                errors.append(f'{MALFORMED}: expected a JSON object with a string "name"')
                continue
            arguments, error = arguments_of(obj["name"], obj.get("arguments", {}))
            if error:
                errors.append(error)
                continue
            calls.append(tool_call(obj["name"], arguments))
        if TOOL_CALL_OPEN in text[last_end:]:  # an opening tag after the last complete block
            errors.append(f"{MALFORMED}: {TOOL_CALL_OPEN} was not closed with {TOOL_CALL_CLOSE}")
        return calls, errors

    def render(self, calls: list[ToolCall]) -> str:
        return "\n".join(format_call(call.name, call.arguments) for call in calls)

    def content_without_calls(self, text: str) -> str:
        return _BLOCK.sub("", text).strip()
